// Test support (ROPE_EXT_TESTING=1 builds only, library rope_ext._C_testing):
// runs the CUDA kernel bodies on the CPU (launch.h: twice, in launch order and
// shuffled, failing on any data race). Tests compare the output with the float64
// reference, so the CUDA indexing, vector paths and grid shapes are checked on
// machines without a GPU. This file: the rotation, the module and the op schemas;
// cache.cpp and norm.cpp: the serving bodies (one file each, compiled side by side).
#include <torch/csrc/stable/library.h>

#include "emulated.h"

#define ROPE_EMULATION 1  // the bodies report their global accesses (launch.h)
#include "../../rope/cuda/rotary.cuh"
#include "../layout.h"
#include "launch.h"

namespace rope_ext {

std::vector<int64_t> cuda_emulated(Tensor q, std::optional<Tensor> k, Tensor q_out,
                                   std::optional<Tensor> k_out, Tensor positions, Tensor cos_sin,
                                   bool interleaved, bool inverse, int64_t num_sms,
                                   bool force_scalar, int64_t rotary_offset, Sections mrope_section,
                                   int64_t mrope_interleaved) {
  const Tensor* kp = k.has_value() && k->defined() ? &*k : nullptr;
  const Tensor* kop = k_out.has_value() && k_out->defined() ? &*k_out : nullptr;
  using ValueError = std::invalid_argument;
  ROPE_CHECK(ValueError, (kp == nullptr) == (kop == nullptr), "k and k_out must be given together");
  ROPE_CHECK(ValueError, q_out.sizes().equals(q.sizes()) && q_out.scalar_type() == q.scalar_type(),
             "q_out must match q in shape and dtype");
  ROPE_CHECK(ValueError,
             !kp || (kop->sizes().equals(kp->sizes()) && kop->scalar_type() == kp->scalar_type()),
             "k_out must match k in shape and dtype");
  const Arg qa(q), qoa(q_out);
  std::optional<Arg> ka, koa;
  if (kp) ka.emplace(*kp), koa.emplace(*kop);
  check_input(qoa, "q_out");
  if (koa) check_input(*koa, "k_out");
  auto p = make_params(qa, qoa, ka ? &*ka : nullptr, koa ? &*koa : nullptr, positions, cos_sin,
                       interleaved, inverse, rotary_offset, mrope_section, mrope_interleaved);
  check_writable(qoa, koa ? &*koa : nullptr);
  const auto rows = bind_angle_rows(p, q, emulated_angle_rows);
  const auto l = rope::gpu::plan_launch(p, num_sms, force_scalar);
  if (rope::gpu::has_work(p, l)) {
    rope::gpu::dispatch_cuda(p, l.vectorized,
                             [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
                               run_grid(l, [&](const rope::gpu::Coord& c) {
                                 rope::gpu::rotary_thread<T, CS, Pos, IL, Vec>(p, l, c);
                               });
                             });
  }
  return {l.grid_x, l.grid_y, l.block_x, l.block_y, l.vectorized ? 1 : 0};
}

}  // namespace rope_ext

#if defined(ROPE_EXT_PYTHON_MODULE)
#include <Python.h>
extern "C" {
// Importable as rope_ext._C_testing (registers the op below); no Python functions.
PyMODINIT_FUNC PyInit__C_testing(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_testing", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}
#endif

STABLE_TORCH_LIBRARY_FRAGMENT(rope_ext, m) {
  // The CUDA kernel body run on the CPU over the CUDA grid, writing into q_out
  // / k_out (which may be q / k). num_sms picks the grid shape as on a GPU with
  // that many SMs; force_scalar disables 16-byte accesses. Returns [grid_x,
  // grid_y, block_x, block_y, vectorized].
  m.def(
      "_cuda_emulated(Tensor q, Tensor? k, Tensor(a!) q_out, Tensor(b!)? k_out, Tensor positions, "
      "Tensor cos_sin, bool interleaved, bool inverse, int num_sms, bool force_scalar, "
      "int rotary_offset=0, int[]? mrope_section=None, int mrope_interleaved=0) -> int[]");
  // The CUDA body of rotary_qk_cache_ (same arguments, then num_sms and
  // force_scalar) run on the CPU. Returns [grid_x, grid_y, block_x, block_y, vectorized].
  m.def(
      "_cuda_emulated_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, "
      "Tensor cos_sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor? slot_mapping, "
      "Tensor? k_scale, Tensor? v_scale, Tensor(e!)? q_out, Tensor? q_scale, bool interleaved, "
      "str layout, int num_sms, bool force_scalar, int rotary_offset=0, "
      "int[]? mrope_section=None, int mrope_interleaved=0, bool inverse=False, "
      "Tensor[]? page_table=None) -> int[]");
  // The CUDA body of mla_rotary_cache_ (same arguments, then num_sms and
  // force_scalar) run on the CPU. Returns as _cuda_emulated_cache.
  m.def(
      "_cuda_emulated_mla(Tensor(a!) q, Tensor kv_c, Tensor(b!) k_pe, Tensor positions, "
      "Tensor cos_sin, Tensor(c!) kv_cache, Tensor? slot_mapping, Tensor? kv_scale, "
      "Tensor(d!)? q_out, Tensor? q_scale, bool interleaved, int rotary_offset, int num_sms, "
      "bool force_scalar, bool inverse=False, Tensor[]? page_table=None) -> int[]");
  // The CUDA body of rerotate_kv_cache_ (same arguments, then num_sms and
  // force_scalar) run on the CPU. Returns [grid_x, grid_y, block_x, block_y, vectorized].
  m.def(
      "_cuda_emulated_rerotate(Tensor(a!) key_cache, Tensor slot_mapping, Tensor delta, "
      "Tensor cos_sin, Tensor? k_scale, bool interleaved, str layout, int rotary_offset, "
      "int num_sms, bool force_scalar) -> int[]");
  // The CUDA body of qk_norm_rotary into q_out / k_out (which may be q / k).
  // Returns [grid_x, warps per block, vectorized, lanes per (token, head)].
  m.def(
      "_cuda_emulated_norm(Tensor q, Tensor k, Tensor(a!) q_out, Tensor(b!) k_out, "
      "Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin, float eps, "
      "bool interleaved, float weight_offset, int num_sms, bool force_scalar, "
      "int rotary_offset=0, int[]? mrope_section=None, int mrope_interleaved=0) -> int[]");
}

STABLE_TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  m.impl("_cuda_emulated", TORCH_BOX(&rope_ext::cuda_emulated));
  m.impl("_cuda_emulated_cache", TORCH_BOX(&rope_ext::cuda_emulated_cache));
  m.impl("_cuda_emulated_rerotate", TORCH_BOX(&rope_ext::cuda_emulated_rerotate));
  m.impl("_cuda_emulated_mla", TORCH_BOX(&rope_ext::cuda_emulated_mla));
  m.impl("_cuda_emulated_norm", TORCH_BOX(&rope_ext::cuda_emulated_norm));
}

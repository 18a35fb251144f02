// Test support (ROPE_EXT_TESTING=1 builds only, library rope_ext._C_testing):
// runs the CUDA kernel body on the CPU. Tests compare its output with the
// float64 reference, so the CUDA indexing, vector paths and grid shapes are
// checked on machines without a GPU.
#include "cuda_emulated.h"

#include <torch/csrc/stable/library.h>

#include "../rope/cuda_kernel.cuh"

namespace rope_ext {

std::vector<int64_t> cuda_emulated(Tensor q, std::optional<Tensor> k, Tensor q_out,
                                   std::optional<Tensor> k_out, Tensor positions, Tensor cos_sin,
                                   bool interleaved, bool inverse, int64_t num_sms,
                                   bool force_scalar, int64_t rotary_offset, Sections mrope_section,
                                   bool mrope_interleaved) {
  const Tensor* kp = k.has_value() && k->defined() ? &*k : nullptr;
  const Tensor* kop = k_out.has_value() && k_out->defined() ? &*k_out : nullptr;
  using ValueError = std::invalid_argument;
  ROPE_CHECK(ValueError, (kp == nullptr) == (kop == nullptr), "k and k_out must be given together");
  ROPE_CHECK(ValueError, sizes_of(q_out) == sizes_of(q) && q_out.scalar_type() == q.scalar_type(),
             "q_out must match q in shape and dtype");
  ROPE_CHECK(ValueError,
             !kp || (sizes_of(*kop) == sizes_of(*kp) && kop->scalar_type() == kp->scalar_type()),
             "k_out must match k in shape and dtype");
  const auto p = make_params(q, q_out, kp, kop, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  check_writable(q_out, kop);
  const auto l = rope::gpu::plan_launch(p, num_sms, force_scalar);
  if (rope::gpu::has_work(p, l)) {
    rope::gpu::dispatch_cuda(
        p, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
          for (int64_t by = 0; by < l.grid_y; ++by)
            for (int64_t bx = 0; bx < l.grid_x; ++bx)
              for (int64_t ty = 0; ty < l.block_y; ++ty)
                for (int64_t tx = 0; tx < l.block_x; ++tx)
                  rope::gpu::rotary_thread<T, CS, Pos, IL, Vec>(
                      p, l, {bx, by, tx, ty, l.block_x, l.block_y, l.grid_x, l.grid_y});
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
      "int rotary_offset=0, int[]? mrope_section=None, bool mrope_interleaved=False) -> int[]");
}

STABLE_TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  m.impl("_cuda_emulated", TORCH_BOX(&rope_ext::cuda_emulated));
}

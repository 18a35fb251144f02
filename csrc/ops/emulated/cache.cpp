// Test support: the CUDA body of rotary_qk_cache_ run on the CPU (see rotary.cpp).
#include "emulated.h"

#define ROPE_EMULATION 1  // the bodies report their global accesses (launch.h)
#include "../../rope/cuda/serving.cuh"
#include "../layout.h"
#include "launch.h"

namespace rope_ext {

namespace {

// The cache kernel's body over its grid for a GPU with num_sms SMs. Returns [grid_x, grid_y,
// block_x, block_y, vectorized].
std::vector<int64_t> emulate(rope::CacheParams cp, const Tensor& q, int64_t num_sms,
                             bool force_scalar) {
  const int64_t n_q_tokens = q.size(0);
  const auto rows =
      n_q_tokens > 0 ? bind_angle_rows(cp.rope, q, emulated_angle_rows) : std::nullopt;
  const auto l = rope::gpu::plan_cache_launch(cp, num_sms, force_scalar);
  const auto& g = l.grid;
  if (n_q_tokens > 0 && rope::gpu::cache_has_work(cp, l)) {
    rope::gpu::dispatch_cuda(cp.rope, g.vectorized,
                             [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
                               run_grid(g, [&](const rope::gpu::Coord& c) {
                                 rope::gpu::cache_thread<T, CS, Pos, IL, Vec>(cp, l, c);
                               });
                             });
  }
  return {g.grid_x, g.grid_y, g.block_x, g.block_y, g.vectorized ? 1 : 0};
}

}  // namespace

std::vector<int64_t> cuda_emulated_cache(
    Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin, Tensor key_cache,
    Tensor value_cache, std::optional<Tensor> slot_mapping, std::optional<Tensor> k_scale,
    std::optional<Tensor> v_scale, std::optional<Tensor> q_out, std::optional<Tensor> q_scale,
    bool interleaved, std::string layout, int64_t num_sms, bool force_scalar, int64_t rotary_offset,
    Sections mrope_section, int64_t mrope_interleaved, bool inverse, PageTableArg page_table) {
  const auto cp =
      make_cache_params(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale,
                        v_scale, q_out, q_scale, interleaved, layout, rotary_offset, mrope_section,
                        mrope_interleaved, inverse, page_table);
  return emulate(cp, q, num_sms, force_scalar);
}

std::vector<int64_t> cuda_emulated_mla(Tensor q, Tensor kv_c, Tensor k_pe, Tensor positions,
                                       Tensor cos_sin, Tensor kv_cache,
                                       std::optional<Tensor> slot_mapping,
                                       std::optional<Tensor> kv_scale, std::optional<Tensor> q_out,
                                       std::optional<Tensor> q_scale, bool interleaved,
                                       int64_t rotary_offset, int64_t num_sms, bool force_scalar,
                                       bool inverse, PageTableArg page_table) {
  const auto cp =
      make_mla_cache_params(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping, kv_scale,
                            q_out, q_scale, interleaved, rotary_offset, inverse, page_table);
  return emulate(cp, q, num_sms, force_scalar);
}

}  // namespace rope_ext

// Test support: the CUDA body of rerotate_kv_cache_ run on the CPU (see rotary.cpp).
#include "emulated.h"

#define ROPE_EMULATION 1  // the bodies report their global accesses (launch.h)
#include "../../rope/cuda/rerotate.cuh"
#include "launch.h"

namespace rope_ext {

std::vector<int64_t> cuda_emulated_rerotate(Tensor key_cache, Tensor slot_mapping, Tensor delta,
                                            Tensor cos_sin, std::optional<Tensor> k_scale,
                                            bool interleaved, std::string layout,
                                            int64_t rotary_offset, int64_t num_sms,
                                            bool force_scalar) {
  auto rp = make_rerotate_params(key_cache, slot_mapping, delta, cos_sin, k_scale, interleaved,
                                 layout, rotary_offset);
  const auto rows = rp.rope.n_tokens > 0 ? bind_angle_rows(rp.rope, key_cache, emulated_angle_rows)
                                         : std::nullopt;
  const auto l = rope::gpu::plan_rerotate_launch(rp, num_sms, force_scalar);
  if (rope::gpu::rerotate_has_work(rp, l)) {
    rope::gpu::dispatch_cuda(rp.rope, l.vectorized,
                             [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
                               run_grid(l, [&](const rope::gpu::Coord& c) {
                                 rope::gpu::rerotate_thread<T, CS, Pos, IL, Vec>(rp, l, c);
                               });
                             });
  }
  return {l.grid_x, l.grid_y, l.block_x, l.block_y, l.vectorized ? 1 : 0};
}

}  // namespace rope_ext

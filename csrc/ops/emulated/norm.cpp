// Test support: the CUDA body of qk_norm_rotary run on the CPU, warp by warp (see rotary.cpp).
#include <algorithm>
#include <vector>

#include "emulated.h"

#define ROPE_EMULATION 1  // the bodies report their global accesses (launch.h)
#include "../../rope/cuda/serving.cuh"
#include "../layout.h"
#include "launch.h"

namespace rope_ext {

std::vector<int64_t> cuda_emulated_norm(Tensor q, Tensor k, Tensor q_out, Tensor k_out,
                                        Tensor q_weight, Tensor k_weight, Tensor positions,
                                        Tensor cos_sin, double eps, bool interleaved,
                                        double weight_offset, int64_t num_sms, bool force_scalar,
                                        int64_t rotary_offset, Sections mrope_section,
                                        int64_t mrope_interleaved) {
  using ValueError = std::invalid_argument;
  ROPE_CHECK(ValueError, q_out.sizes().equals(q.sizes()) && q_out.scalar_type() == q.scalar_type(),
             "q_out must match q in shape and dtype");
  ROPE_CHECK(ValueError, k_out.sizes().equals(k.sizes()) && k_out.scalar_type() == k.scalar_type(),
             "k_out must match k in shape and dtype");
  const Arg qa(q), qoa(q_out), ka(k), koa(k_out);
  check_input(qoa, "q_out");
  check_input(koa, "k_out");
  auto np =
      make_norm_params(qa, qoa, ka, koa, q_weight, k_weight, positions, cos_sin, eps, interleaved,
                       weight_offset, rotary_offset, mrope_section, mrope_interleaved);
  check_writable(qoa, &koa);
  const auto rows = bind_angle_rows(np.rope, q, emulated_angle_rows);
  const auto l = rope::gpu::plan_norm_launch(np, num_sms, force_scalar);
  if (l.n_items > 0) {
    rope::gpu::dispatch_cuda(
        np.rope, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
          using A = typename rope::Acc<T>::type;
          constexpr int64_t kWarp = rope::gpu::kWarp, kWarps = rope::gpu::kNormWarps;
          const int64_t group = l.group;
          // One unit per warp of the grid; its lanes run phase by phase, as the GPU's
          // __syncwarp() orders them. A lane's thread is (warp * kWarp + lane); each group of
          // lanes carries its items' (token, head) in a cursor, as the kernel's threads do, and
          // the warp stops when no group has an item left.
          auto warp = [&](int64_t wi, AccessRecorder& log) {
            const int64_t bx = wi / kWarps, wy = wi % kWarps;
            const int64_t w0 = bx * kWarps + wy, per_warp = kWarp / group;
            std::vector<rope::gpu::NormAt> at;
            for (int64_t g = 0; g < per_warp; ++g)
              at.push_back(rope::gpu::norm_at(l, w0 * per_warp + g));
            const auto on = [&](int64_t g) { return at[g].token < np.rope.n_tokens; };
            while (std::any_of(at.begin(), at.end(),
                               [&](const auto& a) { return a.token < np.rope.n_tokens; })) {
              A partial[kWarp];
              for (int lane = 0; lane < kWarp; ++lane) {
                log.thread = wi * kWarp + lane;
                const int64_t g = lane / group;
                partial[lane] = on(g) ? rope::gpu::norm_phase1<T, CS, Pos, IL, Vec>(
                                            np, l, at[g], int(lane % group))
                                      : A(0);
              }
              for (int lane = 0; lane < kWarp; ++lane) {
                log.thread = wi * kWarp + lane;
                const int64_t g = lane / group;
                const A total = rope::gpu::group_total(partial + g * group, group);
                if (on(g))
                  rope::gpu::norm_phase2<T, CS, Pos, IL, Vec>(np, l, at[g], int(lane % group),
                                                              total);
              }
              for (auto& a : at) rope::gpu::next_item(l, a);
            }
          };
          auto name = [&](int64_t thread) {
            const int64_t wi = thread / kWarp;
            return "lane " + std::to_string(thread % kWarp) + " of warp " +
                   std::to_string(wi % kWarps) + " of block " + std::to_string(wi / kWarps);
          };
          run_launch(l.grid_x * kWarps, warp, name);
        });
  }
  return {l.grid_x, rope::gpu::kNormWarps, l.vectorized ? 1 : 0, l.group};
}

}  // namespace rope_ext

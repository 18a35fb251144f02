// The CUDA launcher of QK-RMSNorm + RoPE: one warp per group of (token, head)
// items, norm_phase1 / norm_phase2 (cuda/serving.cuh) ordered by __syncwarp().
#include "launch.h"
#include "serving.cuh"

namespace rope {
namespace gpu {
namespace {

// At most kMaxRegisters registers (eight resident blocks of 128 threads), no stack frame.
template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(kWarp* kNormWarps, min_blocks(kWarp* kNormWarps))
    norm_kernel(const NormParams p, const NormLaunch l) {
  using A = typename Acc<T>::type;
  __shared__ A partial[kNormWarps][kWarp];
  const int lane = int(threadIdx.x), warp = int(threadIdx.y);
  const int group = int(l.group), g = lane / group;
  // The warp's groups work on items w * (kWarp / group) + g, w from the warp's index on in steps of
  // the grid's warps; the cursor carries each item's (token, head) to the next without a division.
  // Items grow with w: the warp stops when none of its lanes has one.
  const int64_t w0 = int64_t(blockIdx.x) * kNormWarps + warp;
  NormAt at = norm_at(l, w0 * (kWarp / group) + g);
  for (;; next_item(l, at)) {  // per head
    const bool on = at.token < p.rope.n_tokens;
    if (!__any_sync(0xffffffffu, on)) break;
    partial[warp][lane] = on ? norm_phase1<T, CS, Pos, IL, Vec>(p, l, at, lane % group) : A(0);
    __syncwarp();
    const A total = group_total(&partial[warp][g * group], group);
    if (on) norm_phase2<T, CS, Pos, IL, Vec>(p, l, at, lane % group, total);
    __syncwarp();
  }
}

}  // namespace

cudaError_t launch_norm(const NormParams& p, int num_sms, cudaStream_t stream) {
  const NormLaunch l = plan_norm_launch(p, num_sms);
  if (l.n_items == 0) return cudaSuccess;
  dispatch_cuda(p.rope, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
    norm_kernel<T, CS, Pos, IL, Vec>
        <<<unsigned(l.grid_x), dim3(kWarp, kNormWarps), 0, stream>>>(p, l);
  });
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace rope

// The CUDA launcher of QK-RMSNorm + RoPE: one warp per group of (token, head)
// items, norm_phase1 / norm_phase2 (cuda/serving.cuh) ordered by __syncwarp().
#include "launch.h"
#include "serving.cuh"

namespace rope {
namespace gpu {
namespace {

// Six resident blocks of 128 threads: up to 85 registers, no stack frame.
template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(kWarp* kNormWarps, 6)
    norm_kernel(const NormParams p, const NormLaunch l) {
  using A = typename Acc<T>::type;
  __shared__ A partial[kNormWarps][kWarp];
  const int lane = int(threadIdx.x), warp = int(threadIdx.y);
  const int group = int(l.group), g = lane / group;
  // Warp-uniform loop: the warp's groups work on items w * (kWarp / group) + g; the cursor carries
  // each item's (token, head) to the next without a division.
  const int64_t w0 = int64_t(blockIdx.x) * kNormWarps + warp, dw = int64_t(gridDim.x) * kNormWarps;
  const int64_t per_warp = kWarp / group;
  NormAt at = norm_at(l, w0 * per_warp + g);
  for (int64_t w = w0; w < l.n_warp_items; w += dw, next_item(l, at)) {  // per head
    const bool on = w * per_warp + g < l.n_items;
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

// The CUDA launchers of the serving ops: __global__ wrappers around the bodies
// of cuda/serving.cuh, over the grids their plans choose.
#include "launch.h"
#include "serving.cuh"

namespace rope {
namespace gpu {
namespace {

template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(256) cache_kernel(const CacheParams p, const CacheLaunch l) {
  cache_thread<T, CS, Pos, IL, Vec>(p, l, this_thread());
}

template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(kWarp* kNormWarps)
    norm_kernel(const NormParams p, const NormLaunch l) {
  using A = typename Acc<T>::type;
  __shared__ A partial[kNormWarps][kWarp];
  const int lane = int(threadIdx.x), warp = int(threadIdx.y);
  const int group = int(l.group), g = lane / group;
  // Warp-uniform loop: the warp's groups work on items w * (kWarp / group) + g.
  for (int64_t w = int64_t(blockIdx.x) * kNormWarps + warp; w < l.n_warp_items;
       w += int64_t(gridDim.x) * kNormWarps) {
    const int64_t item = w * (kWarp / group) + g;
    const bool on = item < l.n_items;
    partial[warp][lane] = on ? norm_phase1<T, CS, Pos, IL, Vec>(p, l, item, lane % group) : A(0);
    __syncwarp();
    const A total = group_total(&partial[warp][g * group], group);
    if (on) norm_phase2<T, CS, Pos, IL, Vec>(p, l, item, lane % group, total);
    __syncwarp();
  }
}

}  // namespace

cudaError_t launch_cache(const CacheParams& p, int num_sms, cudaStream_t stream) {
  const CacheLaunch l = plan_cache_launch(p, num_sms);
  if (!cache_has_work(p, l)) return cudaSuccess;
  dispatch_cuda(p.rope, l.grid.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
    cache_kernel<T, CS, Pos, IL, Vec>
        <<<dim3(unsigned(l.grid.grid_x), unsigned(l.grid.grid_y)),
           dim3(unsigned(l.grid.block_x), unsigned(l.grid.block_y)), 0, stream>>>(p, l);
  });
  return cudaGetLastError();
}

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

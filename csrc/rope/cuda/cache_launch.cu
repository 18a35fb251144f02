// The CUDA launcher of the RoPE + KV-cache write: a __global__ wrapper around
// cache_thread (cuda/serving.cuh) per type combination, over the grid its plan chooses.
#include "launch.h"
#include "serving.cuh"

namespace rope {
namespace gpu {
namespace {

// At most kMaxRegisters registers (four resident blocks of 256 threads), which every instance fits
// without a stack frame.
template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(256, min_blocks(256))
    cache_kernel(const CacheParams p, const CacheLaunch l) {
  cache_thread<T, CS, Pos, IL, Vec>(p, l, this_thread());
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

}  // namespace gpu
}  // namespace rope

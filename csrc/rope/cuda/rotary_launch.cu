// The CUDA launcher: one __global__ wrapper around rotary_thread per type
// combination, over the grid plan_launch chooses.
#include "launch.h"
#include "rotary.cuh"

namespace rope {
namespace gpu {
namespace {

template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(256, min_blocks(256))
    rotary_kernel(const RopeParams p, const Launch l) {
  rotary_thread<T, CS, Pos, IL, Vec>(p, l, this_thread());
}

}  // namespace

cudaError_t launch(const RopeParams& p, int num_sms, cudaStream_t stream) {
  const Launch l = plan_launch(p, num_sms);
  if (!has_work(p, l)) return cudaSuccess;
  dispatch_cuda(p, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
    rotary_kernel<T, CS, Pos, IL, Vec>
        <<<dim3(unsigned(l.grid_x), unsigned(l.grid_y)),
           dim3(unsigned(l.block_x), unsigned(l.block_y)), 0, stream>>>(p, l);
  });
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace rope

// The CUDA launcher of the re-rotation of cached keys: a __global__ wrapper
// around rerotate_thread (cuda/rerotate.cuh) per type combination.
#include "launch.h"
#include "rerotate.cuh"

namespace rope {
namespace gpu {
namespace {

template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(256, 4) rerotate_kernel(const RerotateParams p, const Launch l) {
  rerotate_thread<T, CS, Pos, IL, Vec>(p, l, this_thread());
}

}  // namespace

cudaError_t launch_rerotate(const RerotateParams& p, int num_sms, cudaStream_t stream) {
  const Launch l = plan_rerotate_launch(p, num_sms);
  if (!rerotate_has_work(p, l)) return cudaSuccess;
  dispatch_cuda(p.rope, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
    rerotate_kernel<T, CS, Pos, IL, Vec>
        <<<dim3(unsigned(l.grid_x), unsigned(l.grid_y)),
           dim3(unsigned(l.block_x), unsigned(l.block_y)), 0, stream>>>(p, l);
  });
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace rope

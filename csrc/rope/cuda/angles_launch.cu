// The launcher of the table-free rows (cuda/angles.cuh).
#include "angles.cuh"
#include "launch.h"

namespace rope {
namespace gpu {
namespace {

template <class Pos, class R>
__global__ void __launch_bounds__(128) angle_rows_kernel(const AngleRows ar) {
  angle_rows_thread<Pos, R>(ar, this_thread());
}

}  // namespace

cudaError_t launch_angle_rows(const AngleRows& ar, int num_sms, cudaStream_t stream) {
  const Launch l = plan_angle_rows(ar, num_sms);
  if (ar.rope.n_tokens == 0 || ar.rope.rotary_dim == 0) return cudaSuccess;
  dispatch_angle_rows(ar, [&]<class Pos, class R>() {
    angle_rows_kernel<Pos, R>
        <<<dim3(unsigned(l.grid_x)), dim3(unsigned(l.block_x)), 0, stream>>>(ar);
  });
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace rope

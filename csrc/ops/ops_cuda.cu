// CUDA kernels of the rope_ext ops: launch on the current stream under a
// device guard; no host synchronisation and no allocation besides the
// outputs of the out-of-place ops, so every op can be captured in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "../rope/cuda_kernel.cuh"
#include "binding.h"

namespace rope_ext {
namespace {

template <class T, class CS, class Pos, bool IL, bool Vec>
__global__ void __launch_bounds__(256)
    rotary_kernel(const rope::RopeParams p, const rope::gpu::Launch l) {
  rope::gpu::rotary_thread<T, CS, Pos, IL, Vec>(p, l,
                                                {blockIdx.x, blockIdx.y, threadIdx.x, threadIdx.y,
                                                 blockDim.x, blockDim.y, gridDim.x, gridDim.y});
}

int64_t sm_count(int device) {
  // Cached per device: the launch path makes no CUDA API call but the launch.
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < 64) {
    if (const int n = cache[device].load(std::memory_order_relaxed)) return n;
  }
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

void launch_cuda(const rope::RopeParams& p, const at::Tensor& q) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto l = rope::gpu::plan_launch(p, sm_count(q.get_device()), false);
  if (l.n_rot_units + l.n_pass_units == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  rope::gpu::dispatch_cuda(p, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
    rotary_kernel<T, CS, Pos, IL, Vec>
        <<<dim3(unsigned(l.grid_x), unsigned(l.grid_y)),
           dim3(unsigned(l.block_x), unsigned(l.block_y)), 0, stream>>>(p, l);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Positions are not inspected on the host (that would synchronise): a
// position outside the cache yields NaN in that token's rotated features, and
// rope_ext.set_position_checks(True) makes the Python API raise instead.
constexpr Backend kCuda{nullptr, launch_cuda};

at::Tensor rotary_cuda(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                       bool interleaved, bool inverse) {
  return rotary(x, positions, cos_sin, interleaved, inverse, kCuda);
}

std::tuple<at::Tensor, at::Tensor> rotary_qk_cuda(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& positions,
                                                  const at::Tensor& cos_sin, bool interleaved,
                                                  bool inverse) {
  return rotary_qk(q, k, positions, cos_sin, interleaved, inverse, kCuda);
}

void rotary_qk_inplace_cuda(const at::Tensor& q, const std::optional<at::Tensor>& k,
                            const at::Tensor& positions, const at::Tensor& cos_sin,
                            bool interleaved, bool inverse) {
  rotary_qk_(q, k, positions, cos_sin, interleaved, inverse, kCuda);
}

}  // namespace
}  // namespace rope_ext

TORCH_LIBRARY_IMPL(rope_ext, CUDA, m) {
  m.impl("rotary", &rope_ext::rotary_cuda);
  m.impl("rotary_qk", &rope_ext::rotary_qk_cuda);
  m.impl("rotary_qk_", &rope_ext::rotary_qk_inplace_cuda);
}

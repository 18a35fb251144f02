// CUDA kernels of the rope_ext ops: launch on the current stream under a
// device guard; no host synchronisation and no allocation besides the
// outputs of the out-of-place ops, so every op can be captured in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "../rope/cuda.h"
#include "binding.h"

namespace rope_ext {
namespace {

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
  C10_CUDA_CHECK(
      rope::gpu::launch(p, int(sm_count(q.get_device())), c10::cuda::getCurrentCUDAStream()));
}

// Positions are not inspected on the host (that would synchronise): a
// position outside the cache yields NaN in that token's rotated features, and
// rope_ext.set_position_checks(True) makes the Python API raise instead.
constexpr Backend kCuda{nullptr, launch_cuda};

at::Tensor rotary_cuda(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                       bool interleaved, bool inverse, int64_t rotary_offset,
                       at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  return rotary(x, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
                mrope_interleaved, kCuda);
}

std::tuple<at::Tensor, at::Tensor> rotary_qk_cuda(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& positions,
                                                  const at::Tensor& cos_sin, bool interleaved,
                                                  bool inverse, int64_t rotary_offset,
                                                  at::OptionalIntArrayRef mrope_section,
                                                  bool mrope_interleaved) {
  return rotary_qk(q, k, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
                   mrope_interleaved, kCuda);
}

void rotary_qk_inplace_cuda(const at::Tensor& q, const std::optional<at::Tensor>& k,
                            const at::Tensor& positions, const at::Tensor& cos_sin,
                            bool interleaved, bool inverse, int64_t rotary_offset,
                            at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  rotary_qk_(q, k, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
             mrope_interleaved, kCuda);
}

}  // namespace
}  // namespace rope_ext

TORCH_LIBRARY_IMPL(rope_ext, CUDA, m) {
  m.impl("rotary", &rope_ext::rotary_cuda);
  m.impl("rotary_qk", &rope_ext::rotary_qk_cuda);
  m.impl("rotary_qk_", &rope_ext::rotary_qk_inplace_cuda);
}

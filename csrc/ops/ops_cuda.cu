// CUDA kernels of the rope_ext ops, in their own library (rope_ext._C_cuda,
// loaded by rope_ext/ops.py when torch has CUDA): launch on the current stream
// under a device guard; no host synchronisation and no allocation besides the
// outputs of the out-of-place ops and the rows of the table-free mode (from
// the caching allocator, stream-ordered), so every op can be captured in a
// CUDA graph.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <array>
#include <atomic>

#include "../rope/cuda/launch.h"
#include "binding.h"

namespace rope_ext {
namespace {

void cuda_check(cudaError_t err) {
  if (err != cudaSuccess) throw std::runtime_error(str("CUDA error: ", cudaGetErrorString(err)));
}

int sm_count(int device) {
  // Cached per device: the launch path makes no CUDA API call but the launch.
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < 64) {
    if (const int n = cache[device].load(std::memory_order_relaxed)) return n;
  }
  int n = 0;
  cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(device, &stream) != AOTI_TORCH_SUCCESS)
    throw std::runtime_error("rope_ext: could not get the current CUDA stream");
  return static_cast<cudaStream_t>(stream);
}

// Runs launcher L of rope::gpu for p on q's device and current stream.
template <class Params, cudaError_t (*L)(const Params&, int, cudaStream_t)>
void on_device(const Params& p, const Tensor& q) {
  const int device = q.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  cuda_check(L(p, sm_count(device), current_stream(device)));
}

// No check_positions: positions and slots are not inspected on the host (that
// would synchronise). A position outside the cache yields NaN in that token's
// rotated features, a slot outside the cache is skipped (never written), and
// rope_ext.set_position_checks(True) makes the Python API raise instead.
constexpr Backend kCuda{nullptr,
                        on_device<rope::RopeParams, rope::gpu::launch>,
                        on_device<rope::CacheParams, rope::gpu::launch_cache>,
                        on_device<rope::NormParams, rope::gpu::launch_norm>,
                        on_device<rope::RerotateParams, rope::gpu::launch_rerotate>,
                        on_device<rope::AngleRows, rope::gpu::launch_angle_rows>,
                        nullptr};

}  // namespace
}  // namespace rope_ext

#if defined(ROPE_EXT_PYTHON_MODULE)
#include <Python.h>
extern "C" {
// Importable as rope_ext._C_cuda (registers the kernels below); no Python functions.
PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}
#endif

STABLE_TORCH_LIBRARY_IMPL(rope_ext, CUDA, m) { rope_ext::impl_ops<rope_ext::kCuda>(m); }

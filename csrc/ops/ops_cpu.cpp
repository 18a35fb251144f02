// CPU kernels of the rope_ext ops.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../rope/cpu.h"
#include "../rope/rope.h"
#include "binding.h"
#if defined(ROPE_EXT_TESTING)
#include "cuda_emulated.h"
#endif

namespace rope_ext {
namespace {

void check_positions_cpu(const rope::RopeParams& p) {
  int64_t value = 0;
  const int64_t token = first_bad_position(p, &value);
  TORCH_CHECK_INDEX(token < 0, "positions must be in [0, cos_sin.shape[0]) = [0, ", p.n_cache_rows,
                    "), got ", value);
}

// Bytes a thread should move (read + write) before splitting pays for waking
// another one: an OpenMP fork/join costs a few microseconds, about what it
// takes to stream 256 KiB. Decode steps (a few tokens) stay on the calling
// thread; a prefill splits into one contiguous block of tokens per thread.
constexpr int64_t kMinBytesPerChunk = int64_t(256) << 10;

void launch_cpu(const rope::RopeParams& p, const at::Tensor&) {
  int64_t per_token = 0;  // bytes read + written per token
  for (int t = 0; t < p.n_tensors; ++t) per_token += 2 * p.t[t].n_heads * p.head_dim;
  per_token *= rope::dtype_size(p.x_dtype);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerChunk / std::max<int64_t>(1, per_token));
  at::parallel_for(0, p.n_tokens, grain,
                   [&](int64_t begin, int64_t end) { rope::cpu::rotate_tokens(p, begin, end); });
}

constexpr Backend kCpu{check_positions_cpu, launch_cpu};

at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                      bool interleaved, bool inverse, int64_t rotary_offset,
                      at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  return rotary(x, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
                mrope_interleaved, kCpu);
}

std::tuple<at::Tensor, at::Tensor> rotary_qk_cpu(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& positions,
                                                 const at::Tensor& cos_sin, bool interleaved,
                                                 bool inverse, int64_t rotary_offset,
                                                 at::OptionalIntArrayRef mrope_section,
                                                 bool mrope_interleaved) {
  return rotary_qk(q, k, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
                   mrope_interleaved, kCpu);
}

void rotary_qk_inplace_cpu(const at::Tensor& q, const std::optional<at::Tensor>& k,
                           const at::Tensor& positions, const at::Tensor& cos_sin, bool interleaved,
                           bool inverse, int64_t rotary_offset,
                           at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  rotary_qk_(q, k, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
             mrope_interleaved, kCpu);
}

}  // namespace

}  // namespace rope_ext

TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  m.impl("rotary", &rope_ext::rotary_cpu);
  m.impl("rotary_qk", &rope_ext::rotary_qk_cpu);
  m.impl("rotary_qk_", &rope_ext::rotary_qk_inplace_cpu);
#if defined(ROPE_EXT_TESTING)
  m.impl("_cuda_emulated", &rope_ext::cuda_emulated);
#endif
}

// An op without tensor arguments dispatches to its CompositeImplicitAutograd kernel.
TORCH_LIBRARY_IMPL(rope_ext, CompositeImplicitAutograd, m) {
  m.impl("_cpu_isa", [] { return std::string(rope::cpu::isa()); });
  m.impl("_cpu_isa_supported",
         [](c10::string_view name) { return rope::cpu::isa_supported(std::string(name).c_str()); });
  m.impl("_set_cpu_isa",
         [](c10::string_view name) { return rope::cpu::set_isa(std::string(name).c_str()); });
}

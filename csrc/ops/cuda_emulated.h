// Test support, built only with ROPE_EXT_TESTING=1: the CUDA kernel body
// (rope/cuda_kernel.cuh) run on the CPU, one thread of the CUDA grid at a
// time, with every vector access checked for alignment.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace rope_ext {

// rope_ext::_cuda_emulated: rotates q (and k) into q_out (and k_out), which may
// be q (and k), over the grid plan_launch chooses for a GPU with num_sms SMs;
// force_scalar disables the 16-byte accesses; features [rotary_offset,
// rotary_offset + rotary_dim) rotate. Returns [grid_x, grid_y,
// block_x, block_y, vectorized].
std::vector<int64_t> cuda_emulated(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                   const at::Tensor& q_out, const std::optional<at::Tensor>& k_out,
                                   const at::Tensor& positions, const at::Tensor& cos_sin,
                                   bool interleaved, bool inverse, int64_t num_sms,
                                   bool force_scalar, int64_t rotary_offset,
                                   at::OptionalIntArrayRef mrope_section, bool mrope_interleaved);

}  // namespace rope_ext

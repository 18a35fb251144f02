// Test support, built only with ROPE_EXT_TESTING=1 (library rope_ext._C_testing):
// the CUDA kernel body (rope/cuda/rotary.cuh) run on the CPU, one thread of the
// CUDA grid at a time, with every vector access checked for alignment.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "../binding.h"

namespace rope_ext {

// The CUDA body of the table-free rows over its grid (the emulated ops'
// RowsLauncher, binding.h bind_angle_rows).
void emulated_angle_rows(const rope::AngleRows& ar, const Tensor& q);

// rope_ext::_cuda_emulated: rotates q (and k) into q_out (and k_out), which may
// be q (and k), over the grid plan_launch chooses for a GPU with num_sms SMs;
// force_scalar disables the 16-byte accesses; features [rotary_offset,
// rotary_offset + rotary_dim) rotate. Returns [grid_x, grid_y,
// block_x, block_y, vectorized].
std::vector<int64_t> cuda_emulated(Tensor q, std::optional<Tensor> k, Tensor q_out,
                                   std::optional<Tensor> k_out, Tensor positions, Tensor cos_sin,
                                   bool interleaved, bool inverse, int64_t num_sms,
                                   bool force_scalar, int64_t rotary_offset, Sections mrope_section,
                                   int64_t mrope_interleaved);

// rope_ext::_cuda_emulated_cache: the CUDA body of rotary_qk_cache_ (slots
// outside the cache skipped, no position check, as on the GPU).
std::vector<int64_t> cuda_emulated_cache(
    Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin, Tensor key_cache,
    Tensor value_cache, std::optional<Tensor> slot_mapping, std::optional<Tensor> k_scale,
    std::optional<Tensor> v_scale, std::optional<Tensor> q_out, std::optional<Tensor> q_scale,
    bool interleaved, std::string layout, int64_t num_sms, bool force_scalar, int64_t rotary_offset,
    Sections mrope_section, int64_t mrope_interleaved, bool inverse, PageTableArg page_table);

// rope_ext::_cuda_emulated_mla: the CUDA body of mla_rotary_cache_, as
// cuda_emulated_cache.
std::vector<int64_t> cuda_emulated_mla(Tensor q, Tensor kv_c, Tensor k_pe, Tensor positions,
                                       Tensor cos_sin, Tensor kv_cache,
                                       std::optional<Tensor> slot_mapping,
                                       std::optional<Tensor> kv_scale, std::optional<Tensor> q_out,
                                       std::optional<Tensor> q_scale, bool interleaved,
                                       int64_t rotary_offset, int64_t num_sms, bool force_scalar,
                                       bool inverse, PageTableArg page_table);

// rope_ext::_cuda_emulated_rerotate: the CUDA body of rerotate_kv_cache_ (slots
// outside the cache and shifts outside the table skipped, as on the GPU).
std::vector<int64_t> cuda_emulated_rerotate(Tensor key_cache, Tensor slot_mapping, Tensor delta,
                                            Tensor cos_sin, std::optional<Tensor> k_scale,
                                            bool interleaved, std::string layout,
                                            int64_t rotary_offset, int64_t num_sms,
                                            bool force_scalar);

// rope_ext::_cuda_emulated_norm: the CUDA body of qk_norm_rotary, warp by warp. Returns
// [grid_x, warps per block, vectorized, lanes per (token, head)].
std::vector<int64_t> cuda_emulated_norm(Tensor q, Tensor k, Tensor q_out, Tensor k_out,
                                        Tensor q_weight, Tensor k_weight, Tensor positions,
                                        Tensor cos_sin, double eps, bool interleaved,
                                        double weight_offset, int64_t num_sms, bool force_scalar,
                                        int64_t rotary_offset, Sections mrope_section,
                                        int64_t mrope_interleaved);

}  // namespace rope_ext

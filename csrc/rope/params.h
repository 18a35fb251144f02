// The parameters every rope_ext kernel takes (CPU, CUDA and the host
// emulation of the CUDA kernel). Plain data: no torch, no CUDA, no code.
//
// A call rotates up to two tensors (q, then optionally k) that share one
// position per token. Kernels receive raw pointers plus explicit sizes and
// strides in elements, so any layout whose last dim is contiguous is rotated
// without a copy.
//
// The batch dims of q and k (every dim but the last) are split in two groups:
//   token dims: where positions vary; q and k have the same sizes there;
//   head dims:  where positions are constant (broadcast); q and k may differ
//               (grouped-query attention).
// A kernel therefore reads one position and one cos/sin row per token and
// reuses them for every head of q and k.
#pragma once

#include <cstdint>

namespace rope {

// Batch dims left after coalescing (token dims and head dims counted apart).
constexpr int kMaxDims = 6;

// Largest head_dim (and so rotary_dim) the kernels accept: index arithmetic
// within one head, and the per-token tables of the CPU kernel (4 floats per
// rotary feature), are 32-bit.
constexpr int64_t kMaxHeadDim = int64_t(1) << 29;

enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// 16-bit storage types. The kernels only move their bits; all arithmetic
// happens in float (double for float64 inputs).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// One tensor to rotate: [token dims..., head dims..., head_dim].
struct RotTensor {
  const void* in;  // input, last dim contiguous
  void* out;       // output of the same shape; may be `in` (in place)
  // Whether the pass-through features (all but [rot_offset, rot_offset +
  // rotary_dim)) are copied from in to out. False in place (they already hold
  // their values); true for a separate output.
  bool copy_pass;
  int n_head_dims;
  int64_t n_heads;  // product of head_size
  int64_t head_size[kMaxDims];
  int64_t in_head_stride[kMaxDims];
  int64_t out_head_stride[kMaxDims];
  int64_t in_tok_stride[kMaxDims];  // one per token dim of RopeParams
  int64_t out_tok_stride[kMaxDims];
};

struct RopeParams {
  RotTensor t[2];  // q, then k (when n_tensors == 2)
  int n_tensors;   // 1 or 2

  int n_tok_dims;
  int64_t n_tokens;  // product of tok_size
  int64_t tok_size[kMaxDims];

  const void* positions;  // int32 or int64 (pos_int64), one per token
  int64_t pos_stride[kMaxDims];

  // MRoPE (multimodal rotary, Qwen2-VL / Qwen3-VL): when mrope_section is not
  // all zero, a token has three positions (temporal, height, width), section s
  // at offset s * pos_section_stride from its position, and pair j takes its
  // cos/sin from the position of section mrope_row(p, j) (rope.h). The
  // sections sum to rotary_dim / 2.
  int mrope_section[3];
  bool mrope_interleaved;  // Qwen3-VL's interleaved sections, else contiguous
  int64_t pos_section_stride;

  // [n_cache_rows, rotary_dim]: cos(p inv_j) for j < rotary_dim/2, then
  // sin(p inv_j). A position outside [0, n_cache_rows) is never read: that
  // token's rotated features become NaN.
  const void* cos_sin;
  int64_t cs_row_stride;
  int64_t n_cache_rows;

  int head_dim;      // features per head, <= kMaxHeadDim
  int rotary_dim;    // even; features [rot_offset, rot_offset + rotary_dim) rotate
  int rot_offset;    // >= 0, rot_offset + rotary_dim <= head_dim; all other features pass through
  bool interleaved;  // pairs (2j, 2j+1); else (j, j + rotary_dim/2)
  bool inverse;      // rotate by the negative angle (the gradient)

  DType x_dtype;   // dtype of q and k (input and output)
  DType cs_dtype;  // float32, or x_dtype
  bool pos_int64;  // positions are int64 (else int32)
};

}  // namespace rope

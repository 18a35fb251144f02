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
// Position axes (RopeParams::n_axes) at most.
constexpr int kMaxAxes = 8;

// Largest head_dim (and so rotary_dim) the kernels accept: index arithmetic
// within one head, and the per-token tables of the CPU kernel (4 floats per
// rotary feature), are 32-bit.
constexpr int64_t kMaxHeadDim = int64_t(1) << 29;

enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Storage of positions: integers, or (the table-free mode only) floats.
enum class PosType : int32_t { kInt32 = 0, kInt64 = 1, kFloat32 = 2, kFloat64 = 3 };

// 16-bit storage types. The kernels only move their bits; all arithmetic
// happens in float (double for float64 inputs).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// How the pairs of a head are shared among several position axes (the ops'
// mrope_interleaved: 0, 1, 2): contiguous sections (Qwen2-VL), interleaved
// ones (Qwen3-VL), or axes 1 .. n-1 taking turns before axis 0 (ERNIE-4.5-VL).
enum class AxisLayout : int32_t { kContiguous = 0, kInterleaved = 1, kAlternating = 2 };

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

  // Positions along several axes (MRoPE: Qwen2-VL / Qwen3-VL's temporal,
  // height, width; 2-D and 3-D vision and video): when n_axes > 0, a token
  // has n_axes positions, axis s at offset s * pos_section_stride from its
  // position, and pair j takes its cos/sin from the position of axis
  // mrope_row(p, j) (rope.h). The first n_axes sections (pairs per axis) sum
  // to rotary_dim / 2.
  int n_axes;
  int mrope_section[kMaxAxes];
  AxisLayout axis_layout;  // which pairs each axis takes (mrope_row)
  // mrope_row's bounds: contiguous, the end of axis s's pairs (s < n_axes - 1,
  // then INT_MAX); interleaved, n_axes * mrope_section[s] (0 from n_axes on);
  // alternating, (n_axes - 1) * mrope_section[1] for axes 1 .. n_axes - 1 (0
  // for the others).
  int axis_bound[kMaxAxes];
  // Interleaved and alternating: pair j's turn is axis_first + j % axis_period
  // (0 + j % n_axes; 1 + j % (n_axes - 1)).
  int axis_period, axis_first;
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

  // The table-free mode (cos_sin given as frequencies; null otherwise): pair
  // j rotates by the angle p f_j, f_j = freqs[j], and its cos and sin are
  // multiplied by freqs[rotary_dim / 2 + j] (angles.h). Positions may then
  // be floats (pos_type). The binding first builds every token's row
  // (AngleRows) and hands the kernels a table: they never read freqs.
  const double* freqs;
  PosType pos_type;

  // CPU kernels only (null elsewhere): token t of t[0] starts at element
  // tok_rows[t] of in and of out instead of at its token dims' offsets (the
  // re-rotation's cache rows, at any slots).
  const int64_t* tok_rows;

  DType x_dtype;   // dtype of q and k (input and output)
  DType cs_dtype;  // float32, or x_dtype
  bool pos_int64;  // positions are int64 (else int32)
};

// The cos/sin rows of the table-free mode (angles.h): row t of `rows`
// [rope.n_tokens, rotary_dim] is token t's (its pairs' positions as the
// kernels read them, MRoPE axes included), cos half then sin half, the sine
// not negated for rope.inverse. index[t] = t when index is set: the kernels
// then read the rows as a table, with the token's index as its position.
struct AngleRows {
  RopeParams rope;  // freqs set; cos_sin unused
  void* rows;
  DType rows_dtype;  // float32 or float64
  int64_t* index;    // [rope.n_tokens], or null
};

}  // namespace rope

namespace rope {

// ---------------------------------------------------------------------------
// Serving ops (kernels in cpu/kv_cache.cpp and cuda/serving.cuh).

// Largest head_dim of the fused QK-RMSNorm + rotary (one warp holds a head in
// registers on the GPU: at most 16 rotated and 16 pass-through features per lane).
constexpr int kMaxNormHeadDim = 512;

// Storage of a KV cache or of q_out: the activation dtype, or fp8.
enum class Fp8 : int32_t { kNone = 0, kE4M3 = 1, kE5M2 = 2 };

// A paged cache [num_blocks, block_size, heads, dim] ("NHD") or [num_blocks,
// heads, block_size, dim] ("HND"), any strides but a contiguous last dim: slot
// s is block s / block_size, row s % block_size.
struct PagedCache {
  void* data;
  int64_t block_stride, row_stride, head_stride;  // elements
  const float* scale;                             // fp8: one float32 (device memory)
};

// FlashInfer's page table (append_paged_kv_cache): token t < n_tokens goes
// to entry pos[t] of request b = batch[t] (-1: not written), whose pages are
// indices[indptr[b] .. indptr[b + 1]) and, with last_len, whose length is
// max(pages - 1, 0) * block_size + last_len[b]. Each tensor int32 or int64
// (bit i of int64_mask: the i-th in the order below), contiguous.
struct PageTable {
  const void* batch;     // [n_tokens]; null: no page table
  const void* pos;       // [n_tokens]
  const void* indices;   // [n_indices]
  const void* indptr;    // [batch_size + 1]
  const void* last_len;  // [batch_size], or null
  int64_t n_tokens, n_indices, batch_size;
  int64_t n_blocks;  // the cache's pages
  uint32_t int64_mask;
};

// RoPE + KV-cache write (rope_ext::rotary_qk_cache_). q [T, Hq, D] and k [T,
// Hk, D] are rotated as rope (t[0] = q, t[1] = k in place; q may go to a
// separate output of its dtype), then rotated k and v [T, Hk, Dv] are stored
// in the caches at slot_mapping[t] for t < n_slots, slot >= 0 (or at the
// slots of a page table).
//
// The MLA cache write (rope_ext::mla_rotary_cache_) is the same op on views:
// k is k_pe [T, 1, rotary_dim], rotated whole (k_dim = rotary_dim,
// k_rot_offset = 0, while q rotates at rope.rot_offset), v is the latent
// kv_c [T, 1, kv_lora_rank], and the two caches are the two column ranges of
// one cache [blocks, block_size, kv_lora_rank + rotary_dim].
struct CacheParams {
  RopeParams rope;  // n_tensors == 2; one token dim (or none for T <= 1)
  // k's features: [0, k_dim), rotated at [k_rot_offset, k_rot_offset +
  // rotary_dim), the rest passed through to the key cache. For q and k of
  // one head size: rope.head_dim and rope.rot_offset.
  int k_dim;
  int k_rot_offset;
  // q rotates by the negative angle (rope.inverse stays false: k is rotated
  // for the cache as always).
  bool q_inverse;
  // q_out in fp8 (q_fp8 != kNone): q is read only and its rotation, rounded to
  // q's dtype then quantized with q_scale, goes to q8 [T, Hq, D].
  Fp8 q_fp8;
  void* q8;
  int64_t q8_tok_stride, q8_head_stride;
  const float* q_scale;
  // v [T, Hk, Dv], read only.
  const void* v;
  int64_t v_tok_stride, v_head_stride;
  int v_dim;
  int64_t n_kv_heads;
  PagedCache key_cache, value_cache;
  Fp8 cache_fp8;
  int64_t block_size, n_cache_slots;  // n_cache_slots = num_blocks * block_size
  // Token t's slot: slots[t] for t < n_slots, or from the page table when
  // pages.batch is set (slots null, n_slots 0).
  const int64_t* slots;
  int64_t n_slots;  // slot_mapping.numel() <= T
  PageTable pages;
};

// Re-rotation of cached keys (rope_ext::rerotate_kv_cache_): every head of
// the key stored at slot slots[t] rotated in place by delta[t] positions, its
// features [rope.rot_offset, rope.rot_offset + rotary_dim): by the table row
// |delta| (inversely when delta < 0). rope describes the rotation: t[0] is
// the cache (in = out, the heads at cache.head_stride; a token's row is its
// slot's), its positions are the deltas (pos_stride[0] 0: one for all).
// An fp8 cache is dequantized (x * scale in float32), rotated in float32
// (rope.x_dtype float32) and requantized with the same scale.
struct RerotateParams {
  RopeParams rope;  // n_tensors 1, one token dim, inverse false
  PagedCache cache;
  Fp8 fp8;
  int64_t block_size, n_cache_slots;
  const int64_t* slots;  // [rope.n_tokens]; -1: skipped
};

// QK-RMSNorm + rotary (rope_ext::qk_norm_rotary): each head of rope.t[0] (q)
// and rope.t[1] (k) is RMS-normalised over head_dim in float32, scaled by
// weight + weight_offset, rounded to the activation dtype, then rotated.
// rope.inverse is false and rope.rot_offset 0.
struct NormParams {
  RopeParams rope;
  const void* weight[2];  // [head_dim] each, contiguous
  DType w_dtype[2];
  double eps;  // used as float32 for every dtype but float64
  double weight_offset;
};

}  // namespace rope

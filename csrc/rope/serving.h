// Per-element math of the serving ops, shared by the CPU and CUDA kernels:
// the saturating scaled fp8 conversion of the KV cache, the slot addressing
// of a paged cache, and the RMSNorm scale. Torch-free; every function inline
// (see rope.h for ROPE_ISA).
#pragma once

#include "rope.h"

namespace rope {
inline namespace ROPE_ISA {

// float -> float8_e4m3fn bits, round to nearest even, as c10's
// fp8e4m3fn_from_fp32_value (|x| >= 480 and NaN give NaN 0x7f; the callers
// saturate first).
ROPE_HD uint8_t float_to_e4m3(float f) {
  uint32_t u = float_to_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= (1087u << 20)) {
    r = 0x7f;
  } else if (u < (121u << 23)) {
    // Below 2^-6 (the smallest normal): the float addition rounds to the subnormal grid.
    const uint32_t denorm = 141u << 23;
    r = uint8_t(float_to_bits(bits_to_float(u) + bits_to_float(denorm)) - denorm);
  } else {
    const uint32_t odd = (u >> 20) & 1u;
    u += (uint32_t(7 - 127) << 23) + 0x7ffffu + odd;
    r = uint8_t(u >> 20);
  }
  return uint8_t(r | uint8_t(sign >> 24));
}

// float -> float8_e5m2 bits, round to nearest even, as c10's fp8e5m2_from_fp32_value.
ROPE_HD uint8_t float_to_e5m2(float f) {
  uint32_t u = float_to_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= (143u << 23)) {
    r = u > 0x7f800000u ? 0x7f : 0x7c;
  } else if (u < (113u << 23)) {
    const uint32_t denorm = 134u << 23;
    r = uint8_t(float_to_bits(bits_to_float(u) + bits_to_float(denorm)) - denorm);
  } else {
    const uint32_t odd = (u >> 21) & 1u;
    u += (uint32_t(15 - 127) << 23) + 0xfffffu + odd;
    r = uint8_t(u >> 21);
  }
  return uint8_t(r | uint8_t(sign >> 24));
}

// The finite maximum of an fp8 type.
ROPE_HD float fp8_max(Fp8 t) { return t == Fp8::kE4M3 ? 448.0f : 57344.0f; }

// Stored fp8 bits of x: x / scale in float32, saturated to the type's finite
// range (infinities too), rounded to nearest even; NaN stays NaN.
ROPE_HD uint8_t quantize_fp8(float x, float scale, Fp8 t) {
  float y = x / scale;
  const float m = fp8_max(t);
  y = y > m ? m : (y < -m ? -m : y);  // NaN compares false: kept
  return t == Fp8::kE4M3 ? float_to_e4m3(y) : float_to_e5m2(y);
}

// float8_e4m3fn / float8_e5m2 bits -> float (exact).
ROPE_HD float fp8_to_float(uint8_t b, Fp8 t) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  if (t == Fp8::kE5M2) {
    // the upper byte of a float16: exponent bias 15, 2 mantissa bits
    const uint32_t e = (b >> 2) & 0x1fu, m = b & 0x3u;
    if (e == 0x1f) return bits_to_float(sign | (m ? 0x7fc00000u : 0x7f800000u));
    if (e == 0) return bits_to_float(sign) + (b & 0x80u ? -1.0f : 1.0f) * float(m) * 0x1p-16f;
    return bits_to_float(sign | ((e + 112u) << 23) | (m << 21));
  }
  // e4m3fn: exponent bias 7, 3 mantissa bits, no infinities, 0x7f / 0xff NaN
  const uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
  if (e == 0xf && m == 0x7) return bits_to_float(sign | 0x7fc00000u);
  if (e == 0) return bits_to_float(sign) + (b & 0x80u ? -1.0f : 1.0f) * float(m) * 0x1p-9f;
  return bits_to_float(sign | ((e + 120u) << 23) | (m << 20));
}

// The table row and direction of a shift by delta positions: |delta| (-1 when
// no row of n_rows holds it), inverse when delta < 0.
ROPE_HD int64_t shift_row(int64_t delta, int64_t n_rows, bool& inverse) {
  inverse = delta < 0;
  if (delta <= -n_rows || delta >= n_rows) return -1;  // also INT64_MIN, whose |delta| overflows
  return delta < 0 ? -delta : delta;
}

// Element offset of a slot's row in a paged cache (its head h starts
// h * head_stride further); slot in [0, n_cache_slots). The one division of
// a slot: kernels take it once per token, outside their loops over heads.
ROPE_HD int64_t slot_offset(const PagedCache& c, int64_t block_size, int64_t slot) {
  const int64_t block = slot / block_size;
  return block * c.block_stride + (slot - block * block_size) * c.row_stride;
}

// Element i of a page-table tensor (bit `which` of int64_mask: int64).
ROPE_HD int64_t page_index(const PageTable& pt, const void* x, int which, int64_t i) {
  return (pt.int64_mask >> which) & 1u ? static_cast<const int64_t*>(x)[i]
                                       : int64_t(static_cast<const int32_t*>(x)[i]);
}

// Why a page-table token has no slot.
enum class PageFault : int32_t {
  kNone = 0,
  kSkipped,   // batch index -1, or t past the page table's tokens
  kBatch,     // batch index outside [0, batch_size)
  kIndptr,    // the request's pages outside [0, n_indices), or indptr decreasing
  kLastLen,   // last_len outside [0, block_size]
  kPosition,  // position negative, past the request's pages or past its length
  kPage,      // page index outside [0, n_blocks)
};

// Token t's slot in a page table, and what was read to find it (b: the
// request, page: the index into indices; -1 when not read).
struct PageSlot {
  int64_t slot;  // -1 unless fault is kNone
  PageFault fault;
  int64_t b, page;
};

// The slot of token t of a page table: page indices[indptr[b] + pos /
// block_size], row pos % block_size. Every index is checked before it is
// read through, so a bad table yields a fault, not a stray read.
ROPE_HD PageSlot page_slot(const PageTable& pt, int64_t block_size, int64_t t) {
  PageSlot r{-1, PageFault::kSkipped, -1, -1};
  if (t >= pt.n_tokens) return r;
  const int64_t b = page_index(pt, pt.batch, 0, t);
  if (b == -1) return r;
  r.fault = PageFault::kBatch;
  if (b < 0 || b >= pt.batch_size) return r;
  r.b = b;
  const int64_t first = page_index(pt, pt.indptr, 3, b), end = page_index(pt, pt.indptr, 3, b + 1);
  r.fault = PageFault::kIndptr;
  if (first < 0 || first > end || end > pt.n_indices) return r;
  const int64_t last = pt.last_len ? page_index(pt, pt.last_len, 4, b) : block_size;
  r.fault = PageFault::kLastLen;
  if (last < 0 || last > block_size) return r;
  // Entry e is row e % block_size of the request's page e / block_size; in its last page, a row
  // below last_len (the request's length: max(pages - 1, 0) * block_size + last_len).
  const int64_t e = page_index(pt, pt.pos, 1, t);
  r.fault = PageFault::kPosition;
  if (e < 0 || block_size == 0) return r;
  const int64_t in_page = e / block_size, row = e - in_page * block_size;
  if (in_page >= end - first || (in_page == end - first - 1 && row >= last)) return r;
  r.page = first + in_page;
  const int64_t page = page_index(pt, pt.indices, 2, r.page);
  r.fault = PageFault::kPage;
  if (page < 0 || page >= pt.n_blocks) return r;
  r.fault = PageFault::kNone;
  r.slot = page * block_size + row;
  return r;
}

// The cache slot of token t, or -1 when nothing is written for it (slot -1,
// t past slot_mapping, a slot outside the cache, or a page-table fault).
ROPE_HD int64_t token_slot(const CacheParams& p, int64_t t) {
  if (p.pages.batch) return page_slot(p.pages, p.block_size, t).slot;
  if (t >= p.n_slots) return -1;
  const int64_t s = p.slots[t];
  return s >= 0 && s < p.n_cache_slots ? s : -1;
}

// One element of a weight vector, as A (float, or double for float64 inputs).
template <class A>
ROPE_HD A load_weight(const void* w, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32:
      return A(static_cast<const float*>(w)[i]);
    case DType::kFloat64:
      return A(static_cast<const double*>(w)[i]);
    case DType::kFloat16:
      return A(half_to_float(static_cast<const Half*>(w)[i].bits));
    default:
      return A(bf16_to_float(static_cast<const BFloat16*>(w)[i].bits));
  }
}

// 1 / sqrt(sum_sq / head_dim + eps): the RMSNorm scale of a head whose squares
// sum to sum_sq (IEEE division and square root on the host and the device).
template <class A>
ROPE_HD A rms_inverse(A sum_sq, int head_dim, double eps) {
#if defined(__CUDA_ARCH__)
  return A(1) / sqrt(sum_sq / A(head_dim) + A(eps));
#else
  return A(1) / std::sqrt(sum_sq / A(head_dim) + A(eps));
#endif
}

}  // namespace ROPE_ISA
}  // namespace rope

// aarch64 Advanced SIMD (NEON) build of the CPU kernel. Advanced SIMD is part
// of every aarch64 CPU, so no run-time check is needed (cpu/kernel.cpp). On
// other architectures this file is empty.
//
// As in cpu/avx2.cpp, ROPE_ISA puts the rope headers' inline code in a
// namespace of its own (rope::neon), apart from the portable copies.
//
// Numerics: all arithmetic in fp32 (fp64 for float64 inputs, by the portable
// loop), never in fp16, with the same formula and roundings as the AVX2
// build, so that both give bit-identical results:
//   half-split   y1 = fma(x1, c, round(x2 (-s))),  y2 = fma(x2, c, round(x1 s))
//   interleaved  y  = fma(x, cdup, round(swap(x) * (-s, +s)))
// fp16 is widened and narrowed by the hardware conversions (round to nearest
// even, as float_to_half); bf16 is widened by a shift and narrowed by the
// integer rounding of float_to_bf16, so both are bit-exact with rope.h.
#if defined(__aarch64__)

#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../params.h"
#define ROPE_ISA neon

#include "kernel.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

inline const uint16_t* u16(const Half* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const uint16_t* u16(const BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* u16(Half* p) { return reinterpret_cast<uint16_t*>(p); }
inline uint16_t* u16(BFloat16* p) { return reinterpret_cast<uint16_t*>(p); }

// Four elements of any 32-bit-or-narrower float type, widened to fp32 lanes.
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const Half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(u16(p))));
}
inline float32x4_t load4(const BFloat16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(u16(p)), 16));
}

// Eight elements as two vectors: lo = elements 0..3, hi = 4..7.
inline void load8(const float* p, float32x4_t& lo, float32x4_t& hi) {
  lo = vld1q_f32(p);
  hi = vld1q_f32(p + 4);
}
inline void load8(const Half* p, float32x4_t& lo, float32x4_t& hi) {
  const float16x8_t v = vreinterpretq_f16_u16(vld1q_u16(u16(p)));
  lo = vcvt_f32_f16(vget_low_f16(v));
  hi = vcvt_high_f32_f16(v);
}
inline void load8(const BFloat16* p, float32x4_t& lo, float32x4_t& hi) {
  const uint16x8_t v = vld1q_u16(u16(p));
  lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
  hi = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
}

// The float bits whose high half is float_to_bf16(v): u + 0x7fff + (bit 16 of
// u) rounds to nearest even; a NaN becomes u | 0x00400000 (quiet, sign and
// payload kept), i.e. (u >> 16) | 0x40 once narrowed.
inline uint32x4_t round_bf16(float32x4_t v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t rounded = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb);
  const uint32x4_t qnan = vorrq_u32(u, vdupq_n_u32(0x00400000));
  return vbslq_u32(vceqq_f32(v, v), rounded, qnan);  // v == v: not NaN
}

inline void store4(float* p, float32x4_t v) { vst1q_f32(p, v); }
inline void store4(Half* p, float32x4_t v) {
  vst1_u16(u16(p), vreinterpret_u16_f16(vcvt_f16_f32(v)));
}
inline void store4(BFloat16* p, float32x4_t v) { vst1_u16(u16(p), vshrn_n_u32(round_bf16(v), 16)); }

inline void store8(float* p, float32x4_t lo, float32x4_t hi) {
  vst1q_f32(p, lo);
  vst1q_f32(p + 4, hi);
}
inline void store8(Half* p, float32x4_t lo, float32x4_t hi) {
  vst1q_u16(u16(p), vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(lo), hi)));
}
inline void store8(BFloat16* p, float32x4_t lo, float32x4_t hi) {
  vst1q_u16(u16(p), vshrn_high_n_u32(vshrn_n_u32(round_bf16(lo), 16), round_bf16(hi), 16));
}

// Half-split pair: y1 = x1 c - x2 s, y2 = x2 c + x1 s, each one fused
// multiply-add onto the rounded product with s (rope.h's rotate_pair).
// fma(x1, c, x2 (-s)) rather than -(x2 s - x1 c) (vfmsq): the two differ in
// the sign of an exact zero; s is negated, not the product, so that a NaN x2
// keeps its sign.
inline void rotate_half(float32x4_t x1, float32x4_t x2, float32x4_t c, float32x4_t s,
                        float32x4_t& y1, float32x4_t& y2) {
  y1 = vfmaq_f32(vmulq_f32(x2, vnegq_f32(s)), x1, c);
  y2 = vfmaq_f32(vmulq_f32(x1, s), x2, c);
}

// Interleaved pairs x = (a0 b0 a1 b1): y = x * (c0 c0 c1 c1) + swap(x) * (-s0 s0 -s1 s1).
inline float32x4_t rotate_interleaved(float32x4_t x, float32x4_t c, float32x4_t s) {
  return vfmaq_f32(vmulq_f32(vrev64q_f32(x), s), x, c);
}

// R: the rotary dim when known at compile time (loops fully unrolled), else 0.
// The table is ScalarHead's (ScalarTable::build_table, inherited).
template <int R>
struct NeonHead : ScalarTable {
  // float / Half / BFloat16: eight lanes (two vectors) at a time, then four,
  // then the portable loop for the last pairs and the pass-through copy.
  template <class T, bool Interleaved, class A>
  __attribute__((always_inline)) static void rotate(const T* in, T* out, const float* tab, int r_,
                                                    int D, bool copy_pass) {
    const int r = R ? R : r_;
    const int h = r / 2;
    int j = 0;  // pairs done
    if (Interleaved) {
      const float* ts = tab + r;
      for (; 2 * j + 8 <= r; j += 4) {
        const int i = 2 * j;
        float32x4_t x0, x1;
        load8(in + i, x0, x1);
        store8(out + i, rotate_interleaved(x0, vld1q_f32(tab + i), vld1q_f32(ts + i)),
               rotate_interleaved(x1, vld1q_f32(tab + i + 4), vld1q_f32(ts + i + 4)));
      }
      for (; 2 * j + 4 <= r; j += 2) {
        const int i = 2 * j;
        store4(out + i, rotate_interleaved(load4(in + i), vld1q_f32(tab + i), vld1q_f32(ts + i)));
      }
    } else {
      const float* ts = tab + h;
      for (; j + 8 <= h; j += 8) {
        float32x4_t a0, a1, b0, b1, y0, y1, z0, z1;
        load8(in + j, a0, a1);
        load8(in + h + j, b0, b1);
        rotate_half(a0, b0, vld1q_f32(tab + j), vld1q_f32(ts + j), y0, z0);
        rotate_half(a1, b1, vld1q_f32(tab + j + 4), vld1q_f32(ts + j + 4), y1, z1);
        store8(out + j, y0, y1);
        store8(out + h + j, z0, z1);
      }
      for (; j + 4 <= h; j += 4) {
        float32x4_t y1, y2;
        rotate_half(load4(in + j), load4(in + h + j), vld1q_f32(tab + j), vld1q_f32(ts + j), y1,
                    y2);
        store4(out + j, y1);
        store4(out + h + j, y2);
      }
    }
    ScalarHead::rotate<T, Interleaved, A>(in, out, tab, r, D, copy_pass, j);
  }
  // float64: the portable loop.
  template <class T, bool Interleaved, class A>
  static void rotate(const double* in, double* out, const double* tab, int r, int D,
                     bool copy_pass) {
    ScalarHead::rotate<double, Interleaved, double>(in, out, tab, r, D, copy_pass);
  }
};

}  // namespace host
}  // namespace ROPE_ISA

void cpu::detail::rotate_tokens_neon(const RopeParams& p, int64_t begin, int64_t end) {
  host::rotate_tokens_unrolled<host::NeonHead>(p, begin, end);
}

}  // namespace rope

#endif  // __aarch64__

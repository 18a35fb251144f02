// The AVX2 row kernel of the serving ops (cpu/fp8_rows.h), included by cpu/avx2.cpp after its
// load8: the fp8 quantization of a row in 32-byte stores (eight lanes per vector, remainders
// element by element), and cache-row copies with 32-byte streaming stores. The bits of the portable
// row kernel (saturate, round to nearest even: float_to_e4m3 / float_to_e5m2 of serving.h).
// Torch-free.
#pragma once

#include "fp8_rows.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

// fp8 bits of eight scaled magnitudes a already clamped to the type's finite range (or NaN), in the
// low byte of each lane, with the sign bit of `sign`: avx512_rows.h's fp8_lanes16 on eight lanes.
template <bool E4>
inline __m256i fp8_lanes8(__m256i a, __m256i sign) {
  constexpr int kShift = E4 ? 20 : 21;
  constexpr uint32_t kBias =
      E4 ? (uint32_t(7 - 127) << 23) + 0x7ffffu : (uint32_t(15 - 127) << 23) + 0xfffffu;
  constexpr uint32_t kDenorm = E4 ? 141u << 23 : 134u << 23;
  constexpr uint32_t kSmall = E4 ? 121u << 23 : 113u << 23;
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_min_epu32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(int(kBias))), odd),
                        kShift),
      _mm256_set1_epi32(0x7f));
  const __m256i dc = _mm256_set1_epi32(int(kDenorm));
  const __m256i denorm = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(dc))), dc);
  // a is below 2^31: the signed compare holds
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(kSmall)), a);
  const __m256i r = _mm256_blendv_epi8(normal, denorm, small);
  return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(sign, 24), _mm256_set1_epi32(0x80)));
}

// Thirty-two values quantized at a time (four vectors packed to bytes by two saturating packs,
// whose per-128-bit-lane order one permutation undoes; bf16 widened by word unpacks, as in
// avx512_rows.h), then eight, then element by element. The quotient: Quotient (fp8_rows.h).
template <class T, bool E4, Quotient Q>
void quant_row8(const T* x, uint8_t* dst, int64_t n, float scale) {
  const float inv = Q == Quotient::kDivide ? 0.0f : 1.0f / scale;
  const float top = fp8_max(E4 ? Fp8::kE4M3 : Fp8::kE5M2);
  const __m256 s = _mm256_set1_ps(scale), r = _mm256_set1_ps(inv), hi = _mm256_set1_ps(top),
               lo = _mm256_set1_ps(-top), bound = _mm256_set1_ps(2 * top * scale);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  auto bits = [&](__m256 v) __attribute__((always_inline)) {
    if constexpr (Q == Quotient::kDivide) {
      // min / max return their second operand when one is NaN: NaN is kept.
      const __m256i y =
          _mm256_castps_si256(_mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_div_ps(v, s))));
      return fp8_lanes8<E4>(_mm256_and_si256(y, abs_mask), y);
    } else {
      __m256 a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), abs_mask));
      if constexpr (Q == Quotient::kProduct) {
        a = _mm256_mul_ps(a, r);
      } else {
        a = _mm256_min_ps(bound, a);
        const __m256 q = _mm256_mul_ps(a, r);
        a = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, s, a), r, q);
      }
      return fp8_lanes8<E4>(_mm256_castps_si256(_mm256_min_ps(hi, a)), _mm256_castps_si256(v));
    }
  };
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BFloat16>) {
    const __m256i z = _mm256_setzero_si256();
    auto lo16 = [&](__m256i w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w)); };
    auto hi16 = [&](__m256i w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w)); };
    for (; i + 32 <= n; i += 32) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16));
      const __m256i ab = _mm256_packus_epi32(bits(lo16(w0)), bits(hi16(w0)));
      const __m256i cd = _mm256_packus_epi32(bits(lo16(w1)), bits(hi16(w1)));
      // quadword 2 * lane + k holds 8 values of block k's lane
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_permute4x64_epi64(_mm256_packus_epi16(ab, cd), 0xD8));
    }
  } else {
    // dword 4 * lane + k of the packed bytes holds vector k's values 4 * lane .. 4 * lane + 3
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= n; i += 32) {
      const __m256i ab = _mm256_packus_epi32(bits(load8(x + i)), bits(load8(x + i + 8)));
      const __m256i cd = _mm256_packus_epi32(bits(load8(x + i + 16)), bits(load8(x + i + 24)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order));
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256i b = bits(load8(x + i));
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi16(w16, w16));
  }
  for (; i < n; ++i)
    dst[i] = quantize_fp8(float(to_acc(x[i])), scale, E4 ? Fp8::kE4M3 : Fp8::kE5M2);
}

template <class T>
void quant_row8(const void* xv, uint8_t* dst, int64_t n, float scale, Fp8 t, bool) {
  const T* x = static_cast<const T*>(xv);
  const bool e4 = t == Fp8::kE4M3;
  switch (quotient_of(scale)) {
    case Quotient::kProduct:
      return e4 ? quant_row8<T, true, Quotient::kProduct>(x, dst, n, scale)
                : quant_row8<T, false, Quotient::kProduct>(x, dst, n, scale);
    case Quotient::kCorrected:
      return e4 ? quant_row8<T, true, Quotient::kCorrected>(x, dst, n, scale)
                : quant_row8<T, false, Quotient::kCorrected>(x, dst, n, scale);
    default:
      return e4 ? quant_row8<T, true, Quotient::kDivide>(x, dst, n, scale)
                : quant_row8<T, false, Quotient::kDivide>(x, dst, n, scale);
  }
}

// Floats of eight fp8 codes: avx512_rows.h's fp8_floats16 on eight lanes.
template <bool E4>
inline __m256 fp8_floats8(__m256i b) {
  constexpr int kShift = E4 ? 20 : 21, kFirstNormal = E4 ? 8 : 4;
  constexpr uint32_t kRebias = E4 ? 120u << 23 : 112u << 23;
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  __m256i r = _mm256_add_epi32(_mm256_slli_epi32(mag, kShift), _mm256_set1_epi32(int(kRebias)));
  const __m256 sub =
      _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(E4 ? 0x1p-9f : 0x1p-16f));
  r = _mm256_blendv_epi8(r, _mm256_castps_si256(sub),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(kFirstNormal), mag));
  if constexpr (E4) {
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000),
                           _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
  } else {
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f800000),
                           _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7c)));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000),
                           _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7c)));
  }
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

// Eight codes at a time, then code by code.
template <bool E4>
void dequant_row8(const uint8_t* codes, float* dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(fp8_floats8<E4>(b), s));
  }
  for (; i < n; ++i) dst[i] = fp8_to_float(codes[i], E4 ? Fp8::kE4M3 : Fp8::kE5M2) * scale;
}

inline void dequant_row8(const uint8_t* codes, float* dst, int64_t n, float scale, Fp8 t) {
  if (t == Fp8::kE4M3) return dequant_row8<true>(codes, dst, n, scale);
  dequant_row8<false>(codes, dst, n, scale);
}

// Whole 32-byte-aligned rows (every cache row of D >= 16 16-bit values in a
// torch allocation) with streaming stores; others with memcpy.
inline void copy_row_nt(const void* x, void* dst, int64_t bytes) {
  if ((reinterpret_cast<uintptr_t>(dst) | uintptr_t(bytes)) % 32 != 0)
    return copy_row(x, dst, bytes);
  const char* src = static_cast<const char*>(x);
  char* d = static_cast<char*>(dst);
  for (int64_t i = 0; i < bytes; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
}

inline void store_fence() { _mm_sfence(); }

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

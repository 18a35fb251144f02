// The AVX-512 row kernel of the serving ops (cpu/fp8_rows.h), included by cpu/avx512.cpp after
// cpu/avx512_kernel.h: the fp8 quantization of a row in 64-byte stores (sixteen lanes per vector,
// a masked tail), and cache-row copies with 64-byte streaming stores. The bits of the portable and
// AVX2 row kernels (saturate, round to nearest even: float_to_e4m3 / float_to_e5m2 of serving.h).
// Torch-free.
#pragma once

#include "avx512_kernel.h"
#include "fp8_rows.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

// fp8 magnitude codes of sixteen scaled magnitudes a already clamped to the type's finite range (or
// NaN), one per 32-bit lane (float_to_e4m3 / float_to_e5m2 of values within the range, without the
// sign): normal results rounded in the integer bits (a + bias, plus one where the lowest kept bit
// is odd), subnormal ones by a float addition. The largest finite value encodes to 0x7e (e4m3) /
// 0x7b (e5m2); a NaN gives a code above 0x7f (and below 0x8000), which the signed saturating packs
// of the callers clamp to 0x7f, the NaN of both types.
template <bool E4>
inline __m512i fp8_magnitudes16(__m512i a) {
  constexpr int kShift = E4 ? 20 : 21;
  constexpr uint32_t kBias =
      E4 ? (uint32_t(7 - 127) << 23) + 0x7ffffu : (uint32_t(15 - 127) << 23) + 0xfffffu;
  constexpr uint32_t kDenorm = E4 ? 141u << 23 : 134u << 23;
  constexpr uint32_t kSmall = E4 ? 121u << 23 : 113u << 23;
  const __m512i u = _mm512_add_epi32(a, _mm512_set1_epi32(int(kBias)));
  const __mmask16 odd = _mm512_test_epi32_mask(a, _mm512_set1_epi32(1 << kShift));
  const __m512i normal =
      _mm512_srli_epi32(_mm512_mask_add_epi32(u, odd, u, _mm512_set1_epi32(1)), kShift);
  const __m512i dc = _mm512_set1_epi32(int(kDenorm));
  const __m512i sum =
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(dc)));
  return _mm512_mask_sub_epi32(normal, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(int(kSmall))),
                               sum, dc);
}

// Sixty-four values quantized at a time: four vectors of magnitude codes packed to bytes by two
// signed saturating packs (NaN codes become 0x7f), whose per-128-bit-lane order one permutation
// undoes, then the sign bits of the sixty-four inputs (one mask) added as 0x80. Then sixteen, then
// a masked tail. bf16 values at a product quotient are widened by word unpacks of their
// magnitudes (each vector holds four runs of four), whose order the same permutation undoes, in
// quadwords; their signs are the words' top bits.
template <class T, bool E4, Quotient Q>
void quant_row16(const T* x, uint8_t* dst, int64_t n, float scale, bool stream) {
  const float inv = Q == Quotient::kDivide ? 0.0f : 1.0f / scale;
  const float top = fp8_max(E4 ? Fp8::kE4M3 : Fp8::kE5M2);
  const __m512 s = _mm512_set1_ps(scale), r = _mm512_set1_ps(inv), hi = _mm512_set1_ps(top),
               lo = _mm512_sub_ps(_mm512_setzero_ps(), hi), bound = _mm512_set1_ps(2 * top * scale);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  // Magnitude codes of the values in v, and in `negative` the lanes whose value is negative (none
  // when `positive`: v then holds magnitudes).
  auto codes = [&](__m512 v, bool positive, __mmask16& negative) __attribute__((always_inline)) {
    if constexpr (Q == Quotient::kDivide) {
      // min / max return their second operand when one is NaN: NaN is kept.
      const __m512i y =
          _mm512_castps_si512(_mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_div_ps(v, s))));
      negative = _mm512_movepi32_mask(y);
      return fp8_magnitudes16<E4>(_mm512_and_si512(y, abs_mask));
    } else {
      negative = positive ? 0 : _mm512_movepi32_mask(_mm512_castps_si512(v));
      __m512 a =
          positive ? v : _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
      if constexpr (Q == Quotient::kProduct) {
        a = _mm512_mul_ps(a, r);
      } else {
        a = _mm512_min_ps(bound, a);
        const __m512 q = _mm512_mul_ps(a, r);
        a = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, a), r, q);
      }
      return fp8_magnitudes16<E4>(_mm512_castps_si512(_mm512_min_ps(hi, a)));
    }
  };
  // Bytes of 64 codes (signed packs, then `order`), the negative ones with 0x80 added.
  auto bytes = [&](__m512i order, bool quads, __m512i a, __m512i b, __m512i c, __m512i d,
                   __mmask64 negative) __attribute__((always_inline)) {
    const __m512i p = _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
    const __m512i r8 =
        quads ? _mm512_permutexvar_epi64(order, p) : _mm512_permutexvar_epi32(order, p);
    return _mm512_mask_add_epi8(r8, negative, r8, _mm512_set1_epi8(char(0x80)));
  };
  auto put = [&](int64_t i, __m512i r8) __attribute__((always_inline)) {
    if (stream && reinterpret_cast<uintptr_t>(dst + i) % 64 == 0)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), r8);
    else
      _mm512_storeu_si512(dst + i, r8);
  };
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BFloat16> && Q != Quotient::kDivide) {
    // quadword 2 * lane + k of the packed bytes holds 8 values of block k's lane
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    const __m512i z = _mm512_setzero_si512(), mag = _mm512_set1_epi16(0x7fff);
    auto lo16 = [&](__m512i w) { return _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w)); };
    auto hi16 = [&](__m512i w) { return _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w)); };
    __mmask16 unused;
    for (; i + 64 <= n; i += 64) {
      const __m512i w0 = _mm512_loadu_si512(x + i), w1 = _mm512_loadu_si512(x + i + 32);
      const __mmask64 negative =
          _mm512_kunpackd(_mm512_movepi16_mask(w1), _mm512_movepi16_mask(w0));
      const __m512i a0 = _mm512_and_si512(w0, mag), a1 = _mm512_and_si512(w1, mag);
      put(i, bytes(order, true, codes(lo16(a0), true, unused), codes(hi16(a0), true, unused),
                   codes(lo16(a1), true, unused), codes(hi16(a1), true, unused), negative));
    }
  } else {
    // dword 4 * lane + k of the packed bytes holds vector k's values 4 * lane .. 4 * lane + 3
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __mmask16 n0, n1, n2, n3;
    for (; i + 64 <= n; i += 64) {
      const __m512i a = codes(load16(x + i), false, n0), b = codes(load16(x + i + 16), false, n1);
      const __m512i c = codes(load16(x + i + 32), false, n2);
      const __m512i d = codes(load16(x + i + 48), false, n3);
      const __mmask64 negative = _mm512_kunpackd(_mm512_kunpackw(n3, n2), _mm512_kunpackw(n1, n0));
      put(i, bytes(order, false, a, b, c, d, negative));
    }
  }
  const __m128i sign = _mm_set1_epi8(char(0x80));
  __mmask16 negative;
  for (; i + 16 <= n; i += 16) {
    const __m128i r = _mm512_cvtsepi32_epi8(codes(load16(x + i), false, negative));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_mask_add_epi8(r, negative, r, sign));
  }
  if (i < n) {
    const __mmask16 m = lanes(int(n - i));
    const __m128i r = _mm512_cvtsepi32_epi8(codes(load16(x + i, m), false, negative));
    _mm_mask_storeu_epi8(dst + i, m, _mm_mask_add_epi8(r, negative, r, sign));
  }
}

template <class T, bool E4>
void quant_row16(const T* x, uint8_t* dst, int64_t n, float scale, bool stream) {
  switch (quotient_of(scale)) {
    case Quotient::kProduct:
      return quant_row16<T, E4, Quotient::kProduct>(x, dst, n, scale, stream);
    case Quotient::kCorrected:
      return quant_row16<T, E4, Quotient::kCorrected>(x, dst, n, scale, stream);
    default:
      return quant_row16<T, E4, Quotient::kDivide>(x, dst, n, scale, stream);
  }
}

template <class T>
void quant_row16(const void* x, uint8_t* dst, int64_t n, float scale, Fp8 t, bool stream) {
  if (t == Fp8::kE4M3) return quant_row16<T, true>(static_cast<const T*>(x), dst, n, scale, stream);
  quant_row16<T, false>(static_cast<const T*>(x), dst, n, scale, stream);
}

// Floats of sixteen fp8 codes (the low byte of each lane; fp8_to_float of serving.h): a normal
// code's exponent and mantissa moved into place and the exponent rebased, a subnormal code's
// mantissa m converted as m * 2^-9 (e4m3) / m * 2^-16 (e5m2), exactly and without a subnormal float
// on the way (the same under FTZ / DAZ); NaN and infinity codes the canonical floats; then the
// sign.
template <bool E4>
inline __m512 fp8_floats16(__m512i b) {
  constexpr int kShift = E4 ? 20 : 21, kFirstNormal = E4 ? 8 : 4;
  constexpr uint32_t kRebias = E4 ? 120u << 23 : 112u << 23;
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  __m512i r = _mm512_add_epi32(_mm512_slli_epi32(mag, kShift), _mm512_set1_epi32(int(kRebias)));
  const __m512 sub =
      _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(E4 ? 0x1p-9f : 0x1p-16f));
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(kFirstNormal)),
                            _mm512_castps_si512(sub));
  if constexpr (E4) {
    r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)),
                              _mm512_set1_epi32(0x7fc00000));
  } else {
    r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7c)),
                              _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7c)),
                              _mm512_set1_epi32(0x7fc00000));
  }
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(r, sign));
}

// Sixteen codes at a time, then a masked tail.
template <bool E4>
void dequant_row16(const uint8_t* codes, float* dst, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(fp8_floats16<E4>(b), s));
  }
  if (i < n) {
    const __mmask16 m = lanes(int(n - i));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, codes + i));
    _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(fp8_floats16<E4>(b), s));
  }
}

inline void dequant_row16(const uint8_t* codes, float* dst, int64_t n, float scale, Fp8 t) {
  if (t == Fp8::kE4M3) return dequant_row16<true>(codes, dst, n, scale);
  dequant_row16<false>(codes, dst, n, scale);
}

// Rows whose start and length are multiples of 64 bytes (cache rows of D >= 32 16-bit values in a
// torch allocation) with 64-byte streaming stores, of 32 with 32-byte ones; others with memcpy.
inline void copy_row_nt64(const void* x, void* dst, int64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | uintptr_t(bytes);
  const char* src = static_cast<const char*>(x);
  char* d = static_cast<char*>(dst);
  if (a % 64 == 0) {
    for (int64_t i = 0; i < bytes; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(src + i));
  } else if (a % 32 == 0) {
    for (int64_t i = 0; i < bytes; i += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  } else {
    copy_row(x, dst, bytes);
  }
}

inline void store_fence512() { _mm_sfence(); }

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

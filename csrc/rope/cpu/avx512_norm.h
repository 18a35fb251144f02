// The AVX-512 QK-RMSNorm + rotary head (cpu/qk_norm.h's token loop), included by cpu/avx512.cpp and
// cpu/avx512_bf16.cpp after cpu/avx512_kernel.h. Torch-free.
//
// One zmm holds the 16 lanes of the sum of squares (lane k: features k mod 16, in order; a masked
// tail adds zeros), added as lane_total's tree; each feature is normalised as (x * rms) * w rounded
// to T (the products not fused), the rotated pairs rotated with Avx512Head's grouping. So every
// instruction set computes the same bits (tests/test_bit_equal.py, tests/test_serving_isa.py).
#pragma once

#include "avx512_kernel.h"
#include "qk_norm.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

template <int R>
struct Avx512Norm : Avx512Head<R> {
  // x * rms * w rounded to T, as floats.
  template <class T>
  static __m512 normed16(__m512 x, __m512 rms, __m512 w) {
    const __m512 n = _mm512_mul_ps(_mm512_mul_ps(x, rms), w);
    if constexpr (std::is_same_v<T, BFloat16>)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round(n)), 16));
    else if constexpr (std::is_same_v<T, Half>)
      return _mm512_cvtph_ps(_mm512_cvtps_ph(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
      return n;
  }

  // The RMSNorm scale of a head.
  template <class T, class A>
  __attribute__((always_inline)) static A norm_scale(const T* in, int D, double eps) {
    if constexpr (std::is_same_v<T, double>) {
      return PortableNorm::norm_scale<T, A>(in, D, eps);
    } else {
      __m512 s = _mm512_setzero_ps();
      for (int i = 0; i < D; i += 16) {
        const __m512 x = i + 16 <= D ? load16(in + i) : load16(in + i, lanes(D - i));
        s = _mm512_add_ps(s, _mm512_mul_ps(x, x));
      }
      // lane_total: k + (k + 8), then k + 4, k + 2, k + 1.
      const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
      const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
      const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
      return rms_inverse<float>(_mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2))), D, eps);
    }
  }

  // Normalises a head with its scale and rotates its rotary features.
  template <class T, bool Interleaved, class A>
  __attribute__((always_inline)) static void norm_rotate(const T* in, T* out,
                                                         const NormWeights<A>& nw, const A* tab,
                                                         int r_, int off, int D, A rms) {
    if constexpr (std::is_same_v<T, double>) {
      PortableNorm::norm_rotate<T, Interleaved, A>(in, out, nw, tab, r_, off, D, rms);
    } else {
      const int r = R ? R : r_, h = r / 2;
      const __m512 vr = _mm512_set1_ps(rms);
      const float* w = nw.w;
      // Features before and after the rotated ones.
      auto pass = [&](int a, int b) {
        for (int k = a; k < b; k += 16) {
          const __mmask16 m = lanes(b - k);
          const __m512 x = load16(in + k, m);
          store16(out + k, _mm512_mul_ps(_mm512_mul_ps(x, vr), _mm512_maskz_loadu_ps(m, w + k)), m);
        }
      };
      pass(0, off);
      pass(off + r, D);
      const T* x = in + off;
      T* y = out + off;
      const float* wr = w + off;
      // Features [i, i + 16) of the rotary part, normalised (lanes outside m: 0).
      auto normed = [&](int i, __mmask16 m, bool full) {
        return full ? normed16<T>(load16(x + i), vr, _mm512_loadu_ps(wr + i))
                    : normed16<T>(load16(x + i, m), vr, _mm512_maskz_loadu_ps(m, wr + i));
      };
      auto table = [&](int i, __mmask16 m, bool full) {
        return full ? _mm512_loadu_ps(tab + i) : _mm512_maskz_loadu_ps(m, tab + i);
      };
      if (Interleaved) {
        // n = (a0 b0 a1 b1 ..): y = n * (c0 c0 ..) + swap(n) * (-s0 s0 ..)
        for (int i = 0; i < r; i += 16) {
          const __mmask16 m = lanes(r - i);
          const bool full = i + 16 <= r;
          const __m512 n = normed(i, m, full);
          const __m512 v =
              _mm512_fmadd_ps(n, table(i, m, full),
                              _mm512_mul_ps(_mm512_permute_ps(n, 0xB1), table(r + i, m, full)));
          full ? store16(y + i, v) : store16(y + i, v, m);
        }
      } else {
        for (int j = 0; j < h; j += 16) {
          const __mmask16 m = lanes(h - j);
          const bool full = j + 16 <= h;
          const __m512 n1 = normed(j, m, full), n2 = normed(h + j, m, full);
          const __m512 c = table(j, m, full), s = table(h + j, m, full);
          const __m512 y1 = _mm512_fmsub_ps(n1, c, _mm512_mul_ps(n2, s));
          const __m512 y2 = _mm512_fmadd_ps(n2, c, _mm512_mul_ps(n1, s));
          if (full) {
            store16(y + j, y1);
            store16(y + h + j, y2);
          } else {
            store16(y + j, y1, m);
            store16(y + h + j, y2, m);
          }
        }
      }
    }
  }
};

inline void norm_rotate_tokens_avx512_body(const NormParams& np, int64_t begin, int64_t end) {
  dispatch_types(np.rope, [&]<class T, class CS, class Pos, bool IL>() {
    switch (np.rope.rotary_dim) {
      case 64:
        return norm_rotate_tokens_impl<T, CS, Pos, IL, Avx512Norm<64>>(np, begin, end);
      case 128:
        return norm_rotate_tokens_impl<T, CS, Pos, IL, Avx512Norm<128>>(np, begin, end);
      default:
        return norm_rotate_tokens_impl<T, CS, Pos, IL, Avx512Norm<0>>(np, begin, end);
    }
  });
}

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

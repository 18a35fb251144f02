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

  // x * rms * w rounded to T, as floats, without a branch: bf16 by the integer rounding with the
  // low half cleared (its NaN condition holds, see round_bf16_bits: x is bf16, rms a float
  // result, every NaN weight the canonical one).
  template <class T>
  static __m512 normed16_int(__m512 x, __m512 rms, __m512 w) {
    const __m512 n = _mm512_mul_ps(_mm512_mul_ps(x, rms), w);
    if constexpr (std::is_same_v<T, BFloat16>)
      return _mm512_castsi512_ps(
          _mm512_and_si512(round_bf16_bits(n), _mm512_set1_epi32(int(0xffff0000u))));
    else
      return normed16<T>(x, rms, w);
  }

  // Vectors k and k + 1 of a head (features [16k, 16k + 32)) stored.
  template <class T>
  static void store_two(T* p, __m512 a, __m512 b) {
#if ROPE_AVX512_HW_BF16
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (__builtin_expect(
              _kortestz_mask16_u8(_mm512_fpclass_ps_mask(a, 0x20), _mm512_fpclass_ps_mask(b, 0x20)),
              1)) {
        _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        return;
      }
    }
#endif
    store16(p, a);
    store16(p + 16, b);
  }

  // n whole heads (rotary_dim = head_dim = R, heads at in + i * si, out + i * so) in one pass
  // each: the head loaded once into registers, its sum of squares (norm_scale's lanes and
  // order) and scale, then every feature normalised, rotated (norm_rotate's arithmetic) and
  // stored: the same bits as norm_scale + norm_rotate, without reading the head twice. Software
  // pipelined two heads deep: head i + 2 is loaded and its scale computed while head i is
  // normalised and rotated, so the chain of the scale (the sum's tree, a division, a square root)
  // overlaps work instead of stalling the loop (one head deep is slower, and three spill
  // registers: benchmarks/cpu-zen4.md).
  template <class T, bool Interleaved, class A>
    requires(R > 0 && !std::is_same_v<T, double>)
  __attribute__((always_inline)) static void norm_heads(const T* in, T* out, int64_t si, int64_t so,
                                                        int64_t n, const NormWeights<A>& nw,
                                                        const A* tab, double eps,
                                                        const Ahead<T>& pf) {
    constexpr int V = R / 16, H = V / 2, kHeadBytes = R * int(sizeof(T));
    const float* w = nw.w;
    // Loads head i into x and returns its scale (after the hint of a later head: Ahead).
    auto load = [&](int64_t i, __m512(&x)[V]) __attribute__((always_inline)) {
      pf.template hint<kHeadBytes>(in, i, n, si);
      const T* p = in + i * si;
#pragma GCC unroll 8
      for (int k = 0; k < V; ++k) x[k] = load16(p + 16 * k);
      __m512 s = _mm512_mul_ps(x[0], x[0]);
#pragma GCC unroll 8
      for (int k = 1; k < V; ++k) s = _mm512_add_ps(s, _mm512_mul_ps(x[k], x[k]));
      const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
      const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
      const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
      return rms_inverse<float>(_mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2))), R, eps);
    };
    // Normalises, rotates and stores the head in x with scale rms.
    auto finish = [&](__m512(&x)[V], float rms, T* o) __attribute__((always_inline)) {
      const __m512 vr = _mm512_set1_ps(rms);
      __m512 y[V];
#pragma GCC unroll 8
      for (int k = 0; k < V; ++k) x[k] = normed16_int<T>(x[k], vr, _mm512_loadu_ps(w + 16 * k));
      if constexpr (Interleaved) {
#pragma GCC unroll 8
        for (int k = 0; k < V; ++k)
          y[k] = _mm512_fmadd_ps(
              x[k], _mm512_loadu_ps(tab + 16 * k),
              _mm512_mul_ps(_mm512_permute_ps(x[k], 0xB1), _mm512_loadu_ps(tab + R + 16 * k)));
      } else {
#pragma GCC unroll 8
        for (int k = 0; k < H; ++k) {
          const __m512 c = _mm512_loadu_ps(tab + 16 * k);
          const __m512 sn = _mm512_loadu_ps(tab + R / 2 + 16 * k);
          y[k] = _mm512_fmsub_ps(x[k], c, _mm512_mul_ps(x[H + k], sn));
          y[H + k] = _mm512_fmadd_ps(x[H + k], c, _mm512_mul_ps(x[k], sn));
        }
      }
#pragma GCC unroll 8
      for (int k = 0; k < V; k += 2) store_two(o + 16 * k, y[k], y[k + 1]);
    };
    if (n <= 0) return;
    __m512 a[V], b[V], c[V];
    float ra = load(0, a), rb = n > 1 ? load(1, b) : 0.0f, rc = 0.0f;
    for (int64_t head = 0;; head += 3) {  // a holds head `head`, b head + 1 (when there)
      if (head + 2 < n) rc = load(head + 2, c);
      finish(a, ra, out + head * so);
      if (head + 1 >= n) return;
      if (head + 3 < n) ra = load(head + 3, a);
      finish(b, rb, out + (head + 1) * so);
      if (head + 2 >= n) return;
      if (head + 4 < n) rb = load(head + 4, b);
      finish(c, rc, out + (head + 2) * so);
      if (head + 3 >= n) return;
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

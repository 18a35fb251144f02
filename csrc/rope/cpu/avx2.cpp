// AVX2 + FMA + F16C build of the CPU kernel, called only after a run-time
// CPU check (cpu/kernel.cpp). On other architectures this file is empty.
//
// Only the code of this file and of the rope headers is compiled for AVX2:
// the standard headers are included before the target pragma (their inline
// functions and templates keep the default instruction set), and ROPE_ISA
// puts the rope headers' inline code in namespace rope::avx2, so none of it
// can be merged at link time with the portable copies (a CPU without AVX2
// would then run AVX2 code). tests/test_layers.py checks both in the objects.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../params.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ROPE_HAVE_AVX2 1
#define ROPE_ISA avx2
#pragma GCC target("avx2,fma,f16c")
#endif

#include "fp8_rows.h"
#include "kernel.h"
#include "qk_norm.h"

namespace rope {

#if ROPE_HAVE_AVX2

inline namespace ROPE_ISA {
namespace host {

// Eight elements of any 32-bit-or-narrower float type, widened to fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store8(BFloat16* p, __m256 v) {
  // Round to nearest even, NaN kept quiet: the vector form of float_to_bf16.
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(is_nan));
  // 32 -> 16 bits: packus works within 128-bit lanes, so gather lanes 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// bf16 <-> fp32 sixteen lanes at a time, with no shuffle at all: in each
// 32-bit word of a 16-element load, the even element is the low half and the
// odd element the high half, so a shift widens the even elements and a mask
// the odd ones (lo = elements 0, 2, .., 14; hi = 1, 3, .., 15), and a word
// blend puts the two rounded halves back. The cos/sin lanes that go with them
// come from a copy of the table in the same order (build_table). Shifts and
// shuffles share few ports on AVX2 machines; this path uses four shifts per 32
// elements and no shuffle.
inline void load16(const BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
}

// float bits + rounding bias, so that the high half is the float rounded to
// bf16, to nearest even: u + 0x7fff + (bit 16 of u), with the parity bit
// tested by a compare instead of a shift. This is float_to_bf16 for values
// that are not NaN, and for NaN with a zero low half (then the bias cannot
// carry into the exponent, and the quiet bit, which arithmetic always sets,
// is kept). The 16-lane paths only produce those: bf16 inputs have a zero low
// half, and build_table replaces every NaN of the table by the canonical
// quiet NaN.
inline __m256i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i even = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)),
                                          _mm256_setzero_si256());  // -1 where bit 16 is 0
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), even);
}

inline void store16(BFloat16* p, __m256 lo, __m256 hi) {
  const __m256i l = _mm256_srli_epi32(round_bf16(lo), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_blend_epi16(l, round_bf16(hi), 0xAA));
}

// Index, within a block of 16, of the element that lane k of load16's
// (lo, hi) pair holds.
constexpr int lane16(int k) { return k < 8 ? 2 * k : 2 * (k - 8) + 1; }

// R: the rotary dim when known at compile time (loops fully unrolled), else 0.
template <int R>
struct Avx2Head : ScalarTable {
  // Standard table (ScalarHead's) in [0, 2r), the same in load16's lane order
  // in [2r, 4r) (used by bf16 only).
  static constexpr int kTabPerFeature = 4;

  // The standard table, plus for bf16 the copy in load16's lane order, with
  // NaN made canonical (see round_bf16). Vector code for float cos/sin rows
  // whose halves are whole vectors (all models'); the portable loop otherwise.
  template <class T, class CS, bool Interleaved, class A>
  static void build_table(const CS* row, A sign, A* tab, int r_) {
    const int r = R ? R : r_;
    const int h = r / 2;
    constexpr bool kBf16 = std::is_same_v<T, BFloat16>;
    if constexpr (std::is_same_v<CS, float> && std::is_same_v<A, float>) {
      if (vector_table<kBf16, Interleaved>(h)) {
        build_table_vector<kBf16, Interleaved>([row](int i) { return _mm256_loadu_ps(row + i); },
                                               sign, tab, r);
        return;
      }
    }
    ScalarTable::build_table<T, CS, Interleaved, A>(row, sign, tab, r);
    if constexpr (kBf16) {
      // Both layouts are a c part [0, n) and an s part [n, 2n).
      const int n = Interleaved ? r : h;
      A* perm = tab + 2 * r;
      for (int part = 0; part < 2 * n; part += n) {
        int b = 0;
        for (; b + 16 <= n; b += 16)
          for (int k = 0; k < 16; ++k) {
            const A v = tab[part + b + lane16(k)];
            perm[part + b + k] = v == v ? v : std::numeric_limits<A>::quiet_NaN();
          }
        for (; b < n; ++b) perm[part + b] = tab[part + b];
      }
    }
  }

  // Whether build_table_vector serves rotary_dim 2h.
  template <bool kBf16, bool Interleaved>
  static constexpr bool vector_table(int h) {
    return h % 8 == 0 && (!kBf16 || h % 16 == 0 || Interleaved);
  }

  // MRoPE: the table of the row that pairs its features from rows[0..2] by
  // `section` (section[j] = the row of pair j), without building that row:
  // each vector of eight pairs is blended from the axes' rows. Float cos/sin
  // rows whose halves are whole vectors only; returns false to have the
  // caller build the merged row instead.
  template <class T, class CS, bool Interleaved, class A>
  static bool build_table_mrope(const CS* const rows[], int n_axes, const uint8_t* section, A sign,
                                A* tab, int r_) {
    const int r = R ? R : r_;
    constexpr bool kBf16 = std::is_same_v<T, BFloat16>;
    if constexpr (std::is_same_v<CS, float> && std::is_same_v<A, float>) {
      const int h = r / 2;
      if (!vector_table<kBf16, Interleaved>(h)) return false;
      auto load = [&](int i) {  // features [i, i + 8) of the merged row
        const int j = i < h ? i : i - h;
        const __m256i sec =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(section + j)));
        __m256 v = _mm256_loadu_ps(rows[0] + i);
        for (int a = 1; a < n_axes; ++a) {
          const __m256i is_a = _mm256_cmpeq_epi32(sec, _mm256_set1_epi32(a));
          v = _mm256_blendv_ps(v, _mm256_loadu_ps(rows[a] + i), _mm256_castsi256_ps(is_a));
        }
        return v;
      };
      build_table_vector<kBf16, Interleaved>(load, sign, tab, r);
      return true;
    }
    return false;
  }

  // build_table's vector code: `load(i)` gives the floats [i, i + 8) of the
  // cos/sin row.
  template <bool kBf16, bool Interleaved, class Load>
  static void build_table_vector(const Load& load, float sign, float* tab, int r) {
    const int h = r / 2;
    const __m256 sg = _mm256_set1_ps(sign);
    const __m256 qnan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
    // NaN -> canonical quiet NaN (only needed in the bf16 copy).
    auto canon = [&](__m256 v) {
      return kBf16 ? _mm256_blendv_ps(v, qnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)) : v;
    };
    float* perm = tab + 2 * r;
    for (int j = 0; j < h; j += 8) {
      const __m256 c = load(j);
      const __m256 s = _mm256_mul_ps(load(h + j), sg);
      if (Interleaved) {
        // c0 c0 c1 c1 .. and -s0 s0 -s1 s1 ..
        const __m256 ns = _mm256_xor_ps(s, _mm256_set1_ps(-0.0f));  // -s (0 - s would make -0 +0)
        const __m256 clo = _mm256_unpacklo_ps(c, c), chi = _mm256_unpackhi_ps(c, c);
        const __m256 slo = _mm256_unpacklo_ps(ns, s), shi = _mm256_unpackhi_ps(ns, s);
        _mm256_storeu_ps(tab + 2 * j, _mm256_permute2f128_ps(clo, chi, 0x20));
        _mm256_storeu_ps(tab + 2 * j + 8, _mm256_permute2f128_ps(clo, chi, 0x31));
        _mm256_storeu_ps(tab + r + 2 * j, _mm256_permute2f128_ps(slo, shi, 0x20));
        _mm256_storeu_ps(tab + r + 2 * j + 8, _mm256_permute2f128_ps(slo, shi, 0x31));
        if (kBf16) {
          // lo lanes: first features of pairs j..j+7; hi lanes: second features.
          _mm256_storeu_ps(perm + 2 * j, canon(c));
          _mm256_storeu_ps(perm + 2 * j + 8, canon(c));
          _mm256_storeu_ps(perm + r + 2 * j, canon(ns));
          _mm256_storeu_ps(perm + r + 2 * j + 8, canon(s));
        }
      } else {
        _mm256_storeu_ps(tab + j, c);
        _mm256_storeu_ps(tab + h + j, s);
      }
    }
    if (kBf16 && !Interleaved) {
      // Blocks of 16 pairs: even pairs, then odd pairs.
      for (int part = 0; part < r; part += h)
        for (int j = 0; j < h; j += 16) {
          const __m256 a = _mm256_loadu_ps(tab + part + j);
          const __m256 b = _mm256_loadu_ps(tab + part + j + 8);
          const __m256 ev = _mm256_castpd_ps(
              _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
          const __m256 od = _mm256_castpd_ps(
              _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
          _mm256_storeu_ps(perm + part + j, canon(ev));
          _mm256_storeu_ps(perm + part + j + 8, canon(od));
        }
    }
  }

  // What the vector loops of rotate_vector do to the values they load before
  // rotating them: nothing (rotate), or the QK norm's normalisation
  // (norm_rotate). `lanes` takes the 8 values of load16's lane order that
  // start at rotated feature i, `plain` 8 consecutive ones.
  struct NoPrep {
    __m256 lanes(__m256 v, int) const { return v; }
    __m256 plain(__m256 v, int) const { return v; }
  };

  // The vector loops of the rotation of one head (float / Half / BFloat16:
  // sixteen (bf16) or eight lanes at a time) on the values prep makes of the
  // loaded ones; returns the pairs done (the caller does the scalar tail).
  template <class T, bool Interleaved, class Prep>
  __attribute__((always_inline)) static int rotate_vector(const T* in, T* out, const float* tab,
                                                          int r_, const Prep& prep) {
    const int r = R ? R : r_;
    const int h = r / 2;
    int j = 0;  // pairs done
    if (Interleaved) {
      // x = (a0 b0 a1 b1 ..): y = x * (c0 c0 c1 c1 ..) + swap(x) * (-s0 s0 -s1 s1 ..)
      if constexpr (std::is_same_v<T, BFloat16>) {
        const float* tp = tab + 2 * r;
        for (; 2 * j + 16 <= r; j += 8) {
          const int i = 2 * j;
          __m256 lo, hi;
          load16(in + i, lo, hi);  // lo: first feature of pairs j..j+7, hi: second
          lo = prep.lanes(lo, i);
          hi = prep.lanes(hi, i + 8);
          const __m256 ylo = _mm256_fmadd_ps(lo, _mm256_loadu_ps(tp + i),
                                             _mm256_mul_ps(hi, _mm256_loadu_ps(tp + r + i)));
          const __m256 yhi = _mm256_fmadd_ps(hi, _mm256_loadu_ps(tp + i + 8),
                                             _mm256_mul_ps(lo, _mm256_loadu_ps(tp + r + i + 8)));
          store16(out + i, ylo, yhi);
        }
      }
      for (; 2 * j + 8 <= r; j += 4) {
        const __m256 x = prep.plain(load8(in + 2 * j), 2 * j);
        const __m256 xs = _mm256_permute_ps(x, 0xB1);
        const __m256 y = _mm256_fmadd_ps(x, _mm256_loadu_ps(tab + 2 * j),
                                         _mm256_mul_ps(xs, _mm256_loadu_ps(tab + r + 2 * j)));
        store8(out + 2 * j, y);
      }
    } else {
      if constexpr (std::is_same_v<T, BFloat16>) {
        const float* tp = tab + 2 * r;
        for (; j + 16 <= h; j += 16) {
          __m256 x1l, x1h, x2l, x2h;
          load16(in + j, x1l, x1h);
          load16(in + h + j, x2l, x2h);
          x1l = prep.lanes(x1l, j);
          x1h = prep.lanes(x1h, j + 8);
          x2l = prep.lanes(x2l, h + j);
          x2h = prep.lanes(x2h, h + j + 8);
          const __m256 cl = _mm256_loadu_ps(tp + j), ch = _mm256_loadu_ps(tp + j + 8);
          const __m256 sl = _mm256_loadu_ps(tp + h + j), sh = _mm256_loadu_ps(tp + h + j + 8);
          store16(out + j, _mm256_fmsub_ps(x1l, cl, _mm256_mul_ps(x2l, sl)),
                  _mm256_fmsub_ps(x1h, ch, _mm256_mul_ps(x2h, sh)));
          store16(out + h + j, _mm256_fmadd_ps(x2l, cl, _mm256_mul_ps(x1l, sl)),
                  _mm256_fmadd_ps(x2h, ch, _mm256_mul_ps(x1h, sh)));
        }
      }
      for (; j + 8 <= h; j += 8) {
        const __m256 x1 = prep.plain(load8(in + j), j);
        const __m256 x2 = prep.plain(load8(in + h + j), h + j);
        const __m256 c = _mm256_loadu_ps(tab + j);
        const __m256 s = _mm256_loadu_ps(tab + h + j);
        store8(out + j, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
        store8(out + h + j, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
      }
    }
    return j;
  }

  // float / Half / BFloat16: rotate_vector, scalar tail.
  template <class T, bool Interleaved, class A>
  __attribute__((always_inline)) static void rotate(const T* in, T* out, const float* tab, int r_,
                                                    int D, bool copy_pass) {
    const int r = R ? R : r_;
    const int j = rotate_vector<T, Interleaved>(in, out, tab, r, NoPrep{});
    ScalarHead::rotate<T, Interleaved, A>(in, out, tab, r, D, copy_pass, j);
  }
  // float64: the portable loop, compiled for AVX2.
  template <class T, bool Interleaved, class A>
  static void rotate(const double* in, double* out, const double* tab, int r, int D,
                     bool copy_pass) {
    ScalarHead::rotate<double, Interleaved, double>(in, out, tab, r, D, copy_pass);
  }

  // --- QK-RMSNorm + rotary (cpu/qk_norm.h), one pass per head ---

  // bf16: the weights of the rotated features in load16's lane order (as the
  // table's copy).
  template <class T, bool Interleaved, class A>
  static void weights_in_lane_order(NormWeights<A>& nw, int r, int off) {
    if constexpr (std::is_same_v<T, BFloat16>) {
      const int n = Interleaved ? r : r / 2;  // runs of features: one, or the two halves
      for (int part = 0; part < r; part += n) {
        const A* w = nw.w + off + part;
        A* rot = nw.rot + part;
        int b = 0;
        for (; b + 16 <= n; b += 16)
          for (int k = 0; k < 16; ++k) rot[b + k] = w[b + lane16(k)];
        for (; b < n; ++b) rot[b] = w[b];
      }
    }
  }

  // x * rms * w rounded to T, as floats (bf16: round_bf16 with the low half
  // cleared; its NaN condition holds: x is bf16, rms a float result, and
  // norm_rotate_tokens_impl makes every NaN weight the canonical one).
  template <class T>
  static __m256 normed8(__m256 x, __m256 rms, __m256 w) {
    const __m256 n = _mm256_mul_ps(_mm256_mul_ps(x, rms), w);
    if constexpr (std::is_same_v<T, BFloat16>)
      return _mm256_castsi256_ps(
          _mm256_and_si256(round_bf16(n), _mm256_set1_epi32(int(0xffff0000u))));
    else if constexpr (std::is_same_v<T, Half>)
      return _mm256_cvtph_ps(_mm256_cvtps_ph(n, _MM_FROUND_TO_NEAREST_INT));
    else
      return n;
  }

  // The squares of a head's whole blocks of 16 features summed in 16 lanes,
  // as two vectors (bf16: load16's even and odd features; others: features
  // 0-7 and 8-15 of each block). Returns the features summed.
  template <class T>
  __attribute__((always_inline)) static int block_squares(const T* in, int D, __m256& s0,
                                                          __m256& s1) {
    __m256 u = _mm256_setzero_ps(), v = _mm256_setzero_ps();  // in registers
    int i = 0;
    for (; i + 16 <= D; i += 16) {
      __m256 a, b;
      if constexpr (std::is_same_v<T, BFloat16>) {
        load16(in + i, a, b);
      } else {
        a = load8(in + i);
        b = load8(in + i + 8);
      }
      u = _mm256_add_ps(u, _mm256_mul_ps(a, a));
      v = _mm256_add_ps(v, _mm256_mul_ps(b, b));
    }
    s0 = u;
    s1 = v;
    return i;
  }

  // The RMSNorm scale of a head: block_squares' 16 lanes (and the tail's)
  // added as lane_total's tree.
  template <class T, class A>
  __attribute__((always_inline)) static A norm_scale(const T* in, int D, double eps) {
    if constexpr (std::is_same_v<T, double>) {
      return PortableNorm::norm_scale<T, A>(in, D, eps);
    } else {
      constexpr bool kBf16 = std::is_same_v<T, BFloat16>;
      __m256 s0, s1;
      const int i = block_squares(in, D, s0, s1);
      if constexpr (kBf16) {
        // Lanes 0-7 and 8-15 in feature order.
        const __m256 lo = _mm256_unpacklo_ps(s0, s1), hi = _mm256_unpackhi_ps(s0, s1);
        s0 = _mm256_permute2f128_ps(lo, hi, 0x20);
        s1 = _mm256_permute2f128_ps(lo, hi, 0x31);
      }
      float total;
      if (i == D) {
        const __m256 t8 = _mm256_add_ps(s0, s1);
        const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
        const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        total = _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
      } else {
        float part[kNormLanes];
        _mm256_storeu_ps(part, s0);
        _mm256_storeu_ps(part + 8, s1);
        for (int k = 0; i + k < D; ++k) {
          const float v = to_acc(in[i + k]);
          part[k] += v * v;
        }
        total = lane_total(part);
      }
      return rms_inverse<float>(total, D, eps);
    }
  }

  // [a.lo + a.hi | b.lo + b.hi]
  static __m256 halves(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }

  // The RMSNorm scales of eight heads (in[k]: head k's first feature), D a
  // multiple of 16: each head's block_squares, as norm_scale sums them, then
  // lane_total's tree for the eight heads at once (the vectors transposed as
  // the tree goes, so that every addition is the one norm_scale makes), and
  // rms_inverse in vectors (IEEE division and square root: the same bits). A
  // head at a time, the tree and the scalar division and square root form a
  // chain of dependent operations that stalls the token loop.
  template <class T>
  __attribute__((always_inline)) static void norm_scales8(const T* const* in, int D, double eps,
                                                          float* out) {
    constexpr bool kBf16 = std::is_same_v<T, BFloat16>;
    __m256 s0[8], s1[8];
    for (int k = 0; k < 8; ++k) block_squares(in[k], D, s0[k], s1[k]);
    // x[j]: the four lanes t[0..3] of lane_total after its second step for
    // heads j (low half) and j + 4 (high half); bf16 in the order t0 t2 t1 t3.
    __m256 x[4];
    for (int j = 0; j < 4; ++j) {
      if constexpr (kBf16) {
        // s0 lane m holds feature lane 2m, s1 lane m lane 2m + 1: halves
        // gives e[m] = t[2m] and o[m] = t[2m + 1] of the first step.
        const __m256 e = halves(s0[j], s0[j + 4]), o = halves(s1[j], s1[j + 4]);
        x[j] = _mm256_add_ps(_mm256_shuffle_ps(e, o, 0x44), _mm256_shuffle_ps(e, o, 0xEE));
      } else {
        x[j] = halves(_mm256_add_ps(s0[j], s1[j]), _mm256_add_ps(s0[j + 4], s1[j + 4]));
      }
    }
    // t[0] + t[2] and t[1] + t[3]: y[j] = (heads 2j, 2j + 1 | 2j + 4, 2j + 5).
    constexpr int kLo = kBf16 ? 0x88 : 0x44, kHi = kBf16 ? 0xDD : 0xEE;
    __m256 y[2];
    for (int j = 0; j < 2; ++j)
      y[j] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * j], x[2 * j + 1], kLo),
                           _mm256_shuffle_ps(x[2 * j], x[2 * j + 1], kHi));
    // t[0] + t[1]: heads 0-3 | 4-7.
    const __m256 total =
        _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88), _mm256_shuffle_ps(y[0], y[1], 0xDD));
    const __m256 mean = _mm256_div_ps(total, _mm256_set1_ps(float(D)));
    const __m256 root = _mm256_sqrt_ps(_mm256_add_ps(mean, _mm256_set1_ps(float(eps))));
    _mm256_storeu_ps(out, _mm256_div_ps(_mm256_set1_ps(1.0f), root));
  }

  // Normalises a head with its scale and rotates it, in rotate()'s loops.
  template <class T, bool Interleaved, class A>
  __attribute__((always_inline)) static void norm_rotate(const T* in, T* out,
                                                         const NormWeights<A>& nw, const A* tab,
                                                         int r_, int off, int D, A rms) {
    if constexpr (std::is_same_v<T, double>) {
      PortableNorm::norm_rotate<T, Interleaved, A>(in, out, nw, tab, r_, off, D, rms);
    } else {
      const int r = R ? R : r_;
      const __m256 vr = _mm256_set1_ps(rms);
      const float* w = nw.w;

      // Features before and after the rotated ones.
      auto pass = [&](int a, int b) {
        int k = a;
        for (; k + 8 <= b; k += 8)
          store8(out + k, _mm256_mul_ps(_mm256_mul_ps(load8(in + k), vr), _mm256_loadu_ps(w + k)));
        norm_pass<T, float>(in, out, w, rms, k, b);
      };
      pass(0, off);
      pass(off + r, D);

      // The rotated features: rotate()'s loops on the normalised values.
      struct Normalise {
        __m256 vr;
        const float* rot;  // weights of the rotated features, load16's lane order
        const float* w;    // the same in feature order
        __m256 lanes(__m256 v, int i) const { return normed8<T>(v, vr, _mm256_loadu_ps(rot + i)); }
        __m256 plain(__m256 v, int i) const { return normed8<T>(v, vr, _mm256_loadu_ps(w + i)); }
      };
      const int j = rotate_vector<T, Interleaved>(in + off, out + off, tab, r,
                                                  Normalise{vr, nw.rot, w + off});
      norm_rotate_pairs<T, Interleaved, float>(in, out, w, rms, tab, r, off, j);
    }
  }
};

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

#include "avx2_rows.h"

namespace rope {

const cpu::RowOps cpu::detail::kRowsAvx2{{host::quant_row8<float>, host::quant_row<double>,
                                          host::quant_row8<Half>, host::quant_row8<BFloat16>},
                                         host::dequant_row8,
                                         host::copy_row_nt,
                                         host::store_fence,
                                         true};

void cpu::detail::rotate_tokens_avx2(const RopeParams& p, int64_t begin, int64_t end) {
  host::rotate_tokens_unrolled<host::Avx2Head>(p, begin, end);
}

int64_t cpu::detail::angle_rows_avx2(const AngleRows& ar, int64_t begin, int64_t end) {
  return host::angle_rows(ar, begin, end);
}

void cpu::detail::norm_rotate_tokens_avx2(const NormParams& np, int64_t begin, int64_t end) {
  dispatch_types(np.rope, [&]<class T, class CS, class Pos, bool IL>() {
    switch (np.rope.rotary_dim) {
      case 64:
        return host::norm_rotate_tokens_impl<T, CS, Pos, IL, host::Avx2Head<64>>(np, begin, end);
      case 128:
        return host::norm_rotate_tokens_impl<T, CS, Pos, IL, host::Avx2Head<128>>(np, begin, end);
      default:
        return host::norm_rotate_tokens_impl<T, CS, Pos, IL, host::Avx2Head<0>>(np, begin, end);
    }
  });
}

#endif  // ROPE_HAVE_AVX2

}  // namespace rope

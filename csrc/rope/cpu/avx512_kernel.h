// The AVX-512 CPU kernel body, included by cpu/avx512.cpp (bf16 rounded with
// integer instructions) and cpu/avx512_bf16.cpp (the AVX512_BF16 conversion).
// Each includes it after its own target pragma, with ROPE_ISA naming its
// build and ROPE_AVX512_HW_BF16 set to 0 or 1. Torch-free.
//
// Sixteen fp32 lanes per instruction; every loop ends with a masked partial
// vector instead of a scalar remainder. The products are the AVX2 build's
// (y1 = x1 c - (x2 s) with one fused multiply-add, y2 = x2 c + (x1 s)), so the
// two builds agree bit for bit wherever AVX2 runs whole vectors.
#pragma once

#include "kernel.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

// Mask of the first min(n, 16) lanes.
inline __mmask16 lanes(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// Sixteen elements widened to fp32 lanes; lanes outside `m` read nothing (0).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load16(const BFloat16* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// float_to_bf16 (rope.h) on sixteen lanes: round to nearest even, NaN kept
// and made quiet.
inline __m256i bf16_round_int(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

#if ROPE_AVX512_HW_BF16
// vcvtneps2bf16 rounds to nearest even and quiets NaN as float_to_bf16 does,
// but treats denormal inputs as zero (it ignores MXCSR and always flushes).
// The rare vector holding a denormal takes the integer rounding, so results
// do not depend on the build.
inline __m256i bf16_round(__m512 v) {
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) return bf16_round_int(v);
  return (__m256i)_mm512_cvtneps_pbh(v);
}
#else
inline __m256i bf16_round(__m512 v) { return bf16_round_int(v); }
#endif

// Whole vectors: plain loads and stores (masked ones cost more on some CPUs).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_round(v));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, bf16_round(v));
}

// bf16 <-> fp32 thirty-two elements at a time without any shuffle: in each
// 32-bit word of a 32-element load the even element is the low half and the
// odd element the high half, so a shift widens the even elements (lo) and a
// mask the odd ones (hi); a word blend puts the two rounded halves back. The
// cos/sin lanes that go with them come from a copy of the table in that order
// (Avx512Head::build_table). Fewer instructions per element than widening
// sixteen at a time (no vpmovzxwd, one load and one store per 32 elements).
inline void load32(const BFloat16* p, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

// Float bits whose high half is the float rounded to bf16, to nearest even:
// u + 0x7fff + (bit 16 of u). This is float_to_bf16 for values that are not
// NaN, and for NaN with a zero low half (the bias cannot carry into the
// exponent, and the quiet bit, which arithmetic always sets, is kept). The
// 32-element paths only produce those: bf16 inputs have a zero low half, and
// build_table replaces every NaN of the table by the canonical quiet NaN.
// Exact for denormals (no flush), unlike vcvtneps2bf16.
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i u = _mm512_add_epi32(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fff));
  const __mmask16 odd = _mm512_test_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x10000));
  return _mm512_mask_add_epi32(u, odd, u, _mm512_set1_epi32(1));
}

inline void store32_int(BFloat16* p, __m512 lo, __m512 hi) {
  const __m512i l = _mm512_srli_epi32(round_bf16_bits(lo), 16);
  _mm512_storeu_si512(p, _mm512_mask_blend_epi16(0xAAAAAAAAu, l, round_bf16_bits(hi)));
}

#if ROPE_AVX512_HW_BF16
// Word k of the result of vcvtne2ps2bf16(hi, lo) (lo in words 0-15, hi in
// 16-31) that goes to word k of the stored block (lo, hi interleaved).
alignas(64) inline constexpr uint16_t kZipWords[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// One conversion and one word shuffle; a block holding a denormal (see
// bf16_round) takes the integer rounding.
inline void store32(BFloat16* p, __m512 lo, __m512 hi) {
  if (__builtin_expect(
          _kortestz_mask16_u8(_mm512_fpclass_ps_mask(lo, 0x20), _mm512_fpclass_ps_mask(hi, 0x20)),
          1)) {
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(_mm512_load_si512(kZipWords), packed));
  } else {
    store32_int(p, lo, hi);
  }
}
#else
inline void store32(BFloat16* p, __m512 lo, __m512 hi) { store32_int(p, lo, hi); }
#endif

// Index, within a block of 32, of the element that lane k of load32's
// (lo, hi) pair holds.
constexpr int lane32(int k) { return k < 16 ? 2 * k : 2 * (k - 16) + 1; }

// R: the rotary dim when known at compile time (loops fully unrolled), else 0.
template <int R>
struct Avx512Head : ScalarTable {
  // ScalarHead's table in [0, 2r); for bf16 also, in [2r, 3r), c and s in
  // load32's lane order (half-split: blocks of 32 pairs, even pairs then odd;
  // interleaved: c[0..h) then s[0..h)), every NaN made the canonical quiet NaN.
  static constexpr int kTabPerFeature = 4;

  template <class T, class CS, bool Interleaved, class A>
  static void build_table(const CS* row, A sign, A* tab, int r_) {
    const int r = R ? R : r_;
    const int h = r / 2;
    constexpr bool kBf16 = std::is_same_v<T, BFloat16>;
    if constexpr (std::is_same_v<CS, float> && std::is_same_v<A, float>) {
      if (h % 16 == 0) {
        build_table_vector<kBf16, Interleaved>([row](int i) { return _mm512_loadu_ps(row + i); },
                                               sign, tab, r);
        return;
      }
    }
    ScalarTable::build_table<T, CS, Interleaved, A>(row, sign, tab, r);
    if constexpr (kBf16) {
      A* perm = tab + 2 * r;
      auto canon = [](A v) { return v == v ? v : std::numeric_limits<A>::quiet_NaN(); };
      if (Interleaved) {
        // c[0..h), then s[0..h): load32 puts the two features of a pair in
        // the same lane of lo and hi.
        for (int j = 0; j < h; ++j) {
          perm[j] = canon(tab[2 * j]);
          perm[h + j] = canon(tab[r + 2 * j + 1]);
        }
      } else {
        // c and s parts, each in blocks of 32 pairs: even pairs, then odd.
        for (int part = 0; part < r; part += h)
          for (int b = 0; b + 32 <= h; b += 32)
            for (int k = 0; k < 32; ++k) perm[part + b + k] = canon(tab[part + b + lane32(k)]);
      }
    }
  }

  // MRoPE: the table of the row that pairs its features from rows[0..2] by
  // `section` (section[j] = the row of pair j), without building that row:
  // each vector of sixteen pairs is loaded from row 0, then overwritten where
  // the pairs belong to another axis's row by masked loads. Float cos/sin rows
  // whose halves are whole vectors only; returns false to have the caller
  // build the merged row instead.
  template <class T, class CS, bool Interleaved, class A>
  static bool build_table_mrope(const CS* const rows[], int n_axes, const uint8_t* section, A sign,
                                A* tab, int r_) {
    const int r = R ? R : r_;
    if constexpr (std::is_same_v<CS, float> && std::is_same_v<A, float>) {
      const int h = r / 2;
      if (h % 16 != 0) return false;
      auto load = [&](int i) {  // features [i, i + 16) of the merged row
        const int j = i < h ? i : i - h;
        const __m128i sec = _mm_loadu_si128(reinterpret_cast<const __m128i*>(section + j));
        __m512 v = _mm512_loadu_ps(rows[0] + i);
        for (int a = 1; a < n_axes; ++a)
          v = _mm512_mask_loadu_ps(v, _mm_cmpeq_epi8_mask(sec, _mm_set1_epi8(char(a))),
                                   rows[a] + i);
        return v;
      };
      build_table_vector<std::is_same_v<T, BFloat16>, Interleaved>(load, sign, tab, r);
      return true;
    }
    return false;
  }

  // build_table for float cos/sin rows whose halves are whole vectors (all
  // models'): the same tables, sixteen lanes at a time, from `load(i)`, the
  // floats [i, i + 16) of the cos/sin row.
  template <bool kBf16, bool Interleaved, class Load>
  static void build_table_vector(const Load& load, float sign, float* tab, int r) {
    const int h = r / 2;
    const __m512 sg = _mm512_set1_ps(sign);
    const __m512 qnan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
    auto canon = [&](__m512 v) {
      return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, qnan);
    };
    float* perm = tab + 2 * r;
    if (Interleaved) {
      const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
      const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
      const __m512i zip_lo =
          _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i zip_hi = _mm512_add_epi32(zip_lo, _mm512_set1_epi32(8));
      for (int j = 0; j < h; j += 16) {
        const __m512 c = load(j);
        const __m512 sv = _mm512_mul_ps(load(h + j), sg);
        const __m512 ns = _mm512_castsi512_ps(  // -s (0 - s would make -0 +0)
            _mm512_xor_si512(_mm512_castps_si512(sv), _mm512_set1_epi32(int(0x80000000u))));
        // c0 c0 c1 c1 .. and -s0 s0 -s1 s1 ..
        _mm512_storeu_ps(tab + 2 * j, _mm512_permutexvar_ps(dup_lo, c));
        _mm512_storeu_ps(tab + 2 * j + 16, _mm512_permutexvar_ps(dup_hi, c));
        _mm512_storeu_ps(tab + r + 2 * j, _mm512_permutex2var_ps(ns, zip_lo, sv));
        _mm512_storeu_ps(tab + r + 2 * j + 16, _mm512_permutex2var_ps(ns, zip_hi, sv));
        if (kBf16) {
          _mm512_storeu_ps(perm + j, canon(c));
          _mm512_storeu_ps(perm + h + j, canon(sv));
        }
      }
    } else {
      for (int j = 0; j < h; j += 16) {
        _mm512_storeu_ps(tab + j, load(j));
        _mm512_storeu_ps(tab + h + j, _mm512_mul_ps(load(h + j), sg));
      }
      if (kBf16) {
        // Blocks of 32 pairs: even pairs, then odd pairs.
        const __m512i even =
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (int part = 0; part < r; part += h)
          for (int b = 0; b + 32 <= h; b += 32) {
            const __m512 x = _mm512_loadu_ps(tab + part + b);
            const __m512 y = _mm512_loadu_ps(tab + part + b + 16);
            _mm512_storeu_ps(perm + part + b, canon(_mm512_permutex2var_ps(x, even, y)));
            _mm512_storeu_ps(perm + part + b + 16, canon(_mm512_permutex2var_ps(x, odd, y)));
          }
      }
    }
  }

  template <class T, bool Interleaved, class A>
  __attribute__((always_inline)) static void rotate(const T* in, T* out, const float* tab, int r_,
                                                    int D, bool copy_pass) {
    const int r = R ? R : r_;
    const int h = r / 2;
    int j = 0;  // pairs done
    if (Interleaved) {
      // x = (a0 b0 a1 b1 ..): y = x * (c0 c0 c1 c1 ..) + swap(x) * (-s0 s0 -s1 s1 ..)
      if constexpr (std::is_same_v<T, BFloat16>) {
        const float* tp = tab + 2 * r;
        for (; j + 16 <= h; j += 16) {
          __m512 x1, x2;
          load32(in + 2 * j, x1, x2);  // first and second features of pairs j..j+15
          const __m512 c = _mm512_loadu_ps(tp + j), sn = _mm512_loadu_ps(tp + h + j);
          store32(out + 2 * j, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, sn)),
                  _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, sn)));
        }
      }
      for (; 2 * j < r; j += 8) {
        const int i = 2 * j;
        const __mmask16 m = lanes(r - i);
        const bool full = i + 16 <= r;
        const __m512 x = full ? load16(in + i) : load16(in + i, m);
        const __m512 xs = _mm512_permute_ps(x, 0xB1);
        const __m512 c = full ? _mm512_loadu_ps(tab + i) : _mm512_maskz_loadu_ps(m, tab + i);
        const __m512 s =
            full ? _mm512_loadu_ps(tab + r + i) : _mm512_maskz_loadu_ps(m, tab + r + i);
        const __m512 y = _mm512_fmadd_ps(x, c, _mm512_mul_ps(xs, s));
        full ? store16(out + i, y) : store16(out + i, y, m);
      }
    } else {
      if constexpr (std::is_same_v<T, BFloat16>) {
        const float* tp = tab + 2 * r;
        for (; j + 32 <= h; j += 32) {
          __m512 x1l, x1h, x2l, x2h;
          load32(in + j, x1l, x1h);
          load32(in + h + j, x2l, x2h);
          const __m512 cl = _mm512_loadu_ps(tp + j), ch = _mm512_loadu_ps(tp + j + 16);
          const __m512 sl = _mm512_loadu_ps(tp + h + j), sh = _mm512_loadu_ps(tp + h + j + 16);
          store32(out + j, _mm512_fmsub_ps(x1l, cl, _mm512_mul_ps(x2l, sl)),
                  _mm512_fmsub_ps(x1h, ch, _mm512_mul_ps(x2h, sh)));
          store32(out + h + j, _mm512_fmadd_ps(x2l, cl, _mm512_mul_ps(x1l, sl)),
                  _mm512_fmadd_ps(x2h, ch, _mm512_mul_ps(x1h, sh)));
        }
      }
      for (; j < h; j += 16) {
        const __mmask16 m = lanes(h - j);
        const bool full = j + 16 <= h;
        const __m512 x1 = full ? load16(in + j) : load16(in + j, m);
        const __m512 x2 = full ? load16(in + h + j) : load16(in + h + j, m);
        const __m512 c = full ? _mm512_loadu_ps(tab + j) : _mm512_maskz_loadu_ps(m, tab + j);
        const __m512 s =
            full ? _mm512_loadu_ps(tab + h + j) : _mm512_maskz_loadu_ps(m, tab + h + j);
        const __m512 y1 = _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s));
        const __m512 y2 = _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s));
        if (full) {
          store16(out + j, y1);
          store16(out + h + j, y2);
        } else {
          store16(out + j, y1, m);
          store16(out + h + j, y2, m);
        }
      }
    }
    if (copy_pass && D > r) std::memcpy(out + r, in + r, sizeof(T) * size_t(D - r));
  }
  // n heads at in + i * si (out + i * so) rotated with the table held in
  // registers (up to 16 of the 32 zmm registers for rotary_dim 128), loaded
  // once per token instead of once per head; each head first hints a later
  // one into L1 (Ahead). For the unrolled rotary dims;
  // the same arithmetic as rotate(), so the same bits.
  template <class T, bool Interleaved, class A>
    requires(R > 0 && !std::is_same_v<T, double>)
  __attribute__((always_inline)) static void rotate_heads(const T* in, T* out, int64_t si,
                                                          int64_t so, int64_t n, const float* tab,
                                                          int D, bool copy_pass,
                                                          const Ahead<T>& pf) {
    constexpr int h = R / 2;
    constexpr int kHeadBytes = R * int(sizeof(T));
    const bool pass = copy_pass && D > R;
    const T* const first = in;
    if constexpr (std::is_same_v<T, BFloat16>) {
      const float* tp = tab + 2 * R;
      if constexpr (Interleaved) {
        constexpr int K = h / 16;  // blocks of 16 pairs (32 elements)
        __m512 c[K], sn[K];
#pragma GCC unroll 8
        for (int k = 0; k < K; ++k) {
          c[k] = _mm512_loadu_ps(tp + 16 * k);
          sn[k] = _mm512_loadu_ps(tp + h + 16 * k);
        }
        for (int64_t i = 0; i < n; ++i, in += si, out += so) {
          pf.template hint<kHeadBytes>(first, i, n, si);
#pragma GCC unroll 8
          for (int k = 0; k < K; ++k) {
            __m512 x1, x2;
            load32(in + 32 * k, x1, x2);
            store32(out + 32 * k, _mm512_fmsub_ps(x1, c[k], _mm512_mul_ps(x2, sn[k])),
                    _mm512_fmadd_ps(x2, c[k], _mm512_mul_ps(x1, sn[k])));
          }
          if (pass) std::memcpy(out + R, in + R, sizeof(T) * size_t(D - R));
        }
      } else {
        constexpr int K = h / 32;  // blocks of 32 pairs
        __m512 cl[K], ch[K], sl[K], sh[K];
#pragma GCC unroll 8
        for (int k = 0; k < K; ++k) {
          cl[k] = _mm512_loadu_ps(tp + 32 * k);
          ch[k] = _mm512_loadu_ps(tp + 32 * k + 16);
          sl[k] = _mm512_loadu_ps(tp + h + 32 * k);
          sh[k] = _mm512_loadu_ps(tp + h + 32 * k + 16);
        }
        for (int64_t i = 0; i < n; ++i, in += si, out += so) {
          pf.template hint<kHeadBytes>(first, i, n, si);
#pragma GCC unroll 8
          for (int k = 0; k < K; ++k) {
            __m512 x1l, x1h, x2l, x2h;
            load32(in + 32 * k, x1l, x1h);
            load32(in + h + 32 * k, x2l, x2h);
            store32(out + 32 * k, _mm512_fmsub_ps(x1l, cl[k], _mm512_mul_ps(x2l, sl[k])),
                    _mm512_fmsub_ps(x1h, ch[k], _mm512_mul_ps(x2h, sh[k])));
            store32(out + h + 32 * k, _mm512_fmadd_ps(x2l, cl[k], _mm512_mul_ps(x1l, sl[k])),
                    _mm512_fmadd_ps(x2h, ch[k], _mm512_mul_ps(x1h, sh[k])));
          }
          if (pass) std::memcpy(out + R, in + R, sizeof(T) * size_t(D - R));
        }
      }
    } else if constexpr (Interleaved) {
      constexpr int K = R / 16;
      __m512 c[K], s[K];
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) {
        c[k] = _mm512_loadu_ps(tab + 16 * k);
        s[k] = _mm512_loadu_ps(tab + R + 16 * k);
      }
      for (int64_t i = 0; i < n; ++i, in += si, out += so) {
        pf.template hint<kHeadBytes>(first, i, n, si);
#pragma GCC unroll 8
        for (int k = 0; k < K; ++k) {
          const __m512 x = load16(in + 16 * k);
          const __m512 xs = _mm512_permute_ps(x, 0xB1);
          store16(out + 16 * k, _mm512_fmadd_ps(x, c[k], _mm512_mul_ps(xs, s[k])));
        }
        if (pass) std::memcpy(out + R, in + R, sizeof(T) * size_t(D - R));
      }
    } else {
      constexpr int K = h / 16;
      __m512 c[K], s[K];
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) {
        c[k] = _mm512_loadu_ps(tab + 16 * k);
        s[k] = _mm512_loadu_ps(tab + h + 16 * k);
      }
      for (int64_t i = 0; i < n; ++i, in += si, out += so) {
        pf.template hint<kHeadBytes>(first, i, n, si);
#pragma GCC unroll 8
        for (int k = 0; k < K; ++k) {
          const __m512 x1 = load16(in + 16 * k), x2 = load16(in + h + 16 * k);
          store16(out + 16 * k, _mm512_fmsub_ps(x1, c[k], _mm512_mul_ps(x2, s[k])));
          store16(out + h + 16 * k, _mm512_fmadd_ps(x2, c[k], _mm512_mul_ps(x1, s[k])));
        }
        if (pass) std::memcpy(out + R, in + R, sizeof(T) * size_t(D - R));
      }
    }
  }
  // float64: the portable loop, compiled for AVX-512.
  template <class T, bool Interleaved, class A>
  static void rotate(const double* in, double* out, const double* tab, int r, int D,
                     bool copy_pass) {
    ScalarHead::rotate<double, Interleaved, double>(in, out, tab, r, D, copy_pass);
  }
};

inline void rotate_tokens_avx512_body(const RopeParams& p, int64_t begin, int64_t end) {
  rotate_tokens_unrolled<Avx512Head>(p, begin, end);
}

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

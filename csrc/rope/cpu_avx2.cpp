// AVX2 + FMA + F16C build of the CPU kernel. Compiled for those extensions
// whatever the global flags; only called after a runtime CPU check.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2,fma,f16c")
#define ROPE_HAVE_AVX2 1
#include <immintrin.h>
#endif

#include "cpu_kernel.h"

namespace rope {
namespace cpu {
namespace detail {

#if ROPE_HAVE_AVX2

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

struct Avx2Head {
  // float / Half / BFloat16: eight lanes at a time, scalar tail.
  template <class T, bool Interleaved, class A>
  static void rotate(const T* in, T* out, const float* tab, int r, int D, bool copy_pass) {
    const int h = r / 2;
    int j = 0;
    if (Interleaved) {
      // x = (a0 b0 a1 b1 ..): y = x * (c0 c0 c1 c1 ..) + swap(x) * (-s0 s0 -s1 s1 ..)
      for (; 2 * j + 8 <= r; j += 4) {
        const __m256 x = load8(in + 2 * j);
        const __m256 xs = _mm256_permute_ps(x, 0xB1);
        const __m256 y = _mm256_fmadd_ps(x, _mm256_loadu_ps(tab + 2 * j),
                                         _mm256_mul_ps(xs, _mm256_loadu_ps(tab + r + 2 * j)));
        store8(out + 2 * j, y);
      }
    } else {
      for (; j + 8 <= h; j += 8) {
        const __m256 x1 = load8(in + j);
        const __m256 x2 = load8(in + h + j);
        const __m256 c = _mm256_loadu_ps(tab + j);
        const __m256 s = _mm256_loadu_ps(tab + h + j);
        store8(out + j, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
        store8(out + h + j, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
      }
    }
    ScalarHead::rotate<T, Interleaved, A>(in, out, tab, r, D, copy_pass, j);
  }
  // float64: the portable loop, compiled for AVX2.
  template <class T, bool Interleaved, class A>
  static void rotate(const double* in, double* out, const double* tab, int r, int D,
                     bool copy_pass) {
    ScalarHead::rotate<double, Interleaved, double>(in, out, tab, r, D, copy_pass);
  }
};

void rotate_tokens_avx2(const RopeParams& p, int64_t begin, int64_t end) {
  dispatch_types(p, [&]<class T, class CS, class Pos, bool IL>() {
    rotate_tokens_impl<T, CS, Pos, IL, Avx2Head>(p, begin, end);
  });
}

bool avx2_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

#else

void rotate_tokens_avx2(const RopeParams&, int64_t, int64_t) {}
bool avx2_supported() { return false; }

#endif

}  // namespace detail
}  // namespace cpu
}  // namespace rope

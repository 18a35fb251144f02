// AVX-512 (F/BW/VL/DQ + BF16) build of the CPU kernel, bf16 outputs converted by the AVX512_BF16
// instruction vcvtneps2bf16; called only after a run-time CPU check (cpu/kernel.cpp). The kernel
// body is cpu/avx512_kernel.h. On other architectures this file is empty.
//
// As in cpu/avx2.cpp, the standard headers come before the target pragma and
// ROPE_ISA gives the rope headers' inline code names of its own
// (rope::avx512_bf16::...): no AVX-512 copy of shared code can stand in for
// the portable one at link time (tests/test_layers.py checks the objects).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../params.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC 12's AVX-512 intrinsics start from a self-initialised "undefined"
// vector, which -Wmaybe-uninitialized and -Wuninitialized report once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#define ROPE_ISA avx512_bf16
#define ROPE_AVX512_HW_BF16 1
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

#include "avx512_kernel.h"
#include "avx512_norm.h"

void rope::cpu::detail::rotate_tokens_avx512_bf16(const RopeParams& p, int64_t begin, int64_t end) {
  host::rotate_tokens_avx512_body(p, begin, end);
}

void rope::cpu::detail::norm_rotate_tokens_avx512_bf16(const NormParams& np, int64_t begin,
                                                       int64_t end) {
  host::norm_rotate_tokens_avx512_body(np, begin, end);
}

#endif

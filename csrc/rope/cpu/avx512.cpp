// AVX-512 (F/BW/VL/DQ) build of the CPU kernel, bf16 outputs rounded with integer instructions;
// called only after a run-time CPU check (cpu/kernel.cpp). The kernel body is
// cpu/avx512_kernel.h. On other architectures this file is empty.
//
// As in cpu/avx2.cpp, the standard headers come before the target pragma and
// ROPE_ISA gives the rope headers' inline code names of its own
// (rope::avx512::...): no AVX-512 copy of shared code can stand in for
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
#define ROPE_ISA avx512
#define ROPE_AVX512_HW_BF16 0
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

#include "avx512_kernel.h"
#include "avx512_norm.h"
#include "avx512_rows.h"

void rope::cpu::detail::rotate_tokens_avx512(const RopeParams& p, int64_t begin, int64_t end) {
  host::rotate_tokens_avx512_body(p, begin, end);
}

int64_t rope::cpu::detail::angle_rows_avx512(const AngleRows& ar, int64_t begin, int64_t end) {
  return host::angle_rows(ar, begin, end);
}

// bf16 without the AVX512_BF16 conversion: heads that are not rotated whole (partial rotary,
// rotary_offset) take the AVX2 head, whose bf16 rounding in 8-lane halves measured faster than the
// 16-lane integer rounding there (benchmarks/cpu-serving.md); the same bits.
void rope::cpu::detail::norm_rotate_tokens_avx512(const NormParams& np, int64_t begin,
                                                  int64_t end) {
  if (np.rope.x_dtype == DType::kBFloat16 && np.rope.rotary_dim != np.rope.head_dim)
    return norm_rotate_tokens_avx2(np, begin, end);
  host::norm_rotate_tokens_avx512_body(np, begin, end);
}

const rope::cpu::RowOps rope::cpu::detail::kRowsAvx512{
    {host::quant_row16<float>, host::quant_row<double>, host::quant_row16<Half>,
     host::quant_row16<BFloat16>},
    host::dequant_row16,
    host::copy_row_nt64,
    host::store_fence512,
    false};

#endif

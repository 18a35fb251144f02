// One thread's arithmetic of two AVX-512 serving kernels on data in L1 / L2, from the project's own
// headers: the fp8 quantization of bf16 rows (avx512_rows.h, ns per value) and the QK-RMSNorm +
// rotary head loop (avx512_norm.h, ns per head of 128 bf16). No memory traffic and no call cost:
// the cost of the instructions alone. benchmarks/cpu-zen4.md. Build and run:
//   g++ -std=c++20 -O3 -fno-fast-math -ffp-contract=off -I csrc/rope -I csrc/rope/cpu
//       benchmarks/kernel_speed.cpp -o /tmp/kernel_speed  (one line)
//   /tmp/kernel_speed
// -DHW_BF16=0 times the base AVX-512 build. -DNORM_HEADER='"path"' times another copy of
// avx512_norm.h (what-if edits), -DROWS_HEADER likewise.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "params.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#ifndef HW_BF16
#define HW_BF16 1  // -DHW_BF16=0: the base AVX-512 build (bf16 rounded by integer instructions)
#endif
#if HW_BF16
#define ROPE_ISA avx512_bf16
#define ROPE_AVX512_HW_BF16 1
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#else
#define ROPE_ISA avx512
#define ROPE_AVX512_HW_BF16 0
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#include "avx512_kernel.h"
#ifndef NORM_HEADER
#define NORM_HEADER "avx512_norm.h"
#endif
#ifndef ROWS_HEADER
#define ROWS_HEADER "avx512_rows.h"
#endif
#include NORM_HEADER
#include ROWS_HEADER

using namespace rope;

// Best of 15 runs of f (which does `units` units of work), in ns per unit.
template <class F>
double best_ns(F f, double units) {
  double best = 1e30;
  for (int run = 0; run < 15; ++run) {
    const auto t = std::chrono::steady_clock::now();
    f();
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count();
    best = std::min(best, ns / units);
  }
  return best;
}

static BFloat16 bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint16_t h = uint16_t(b >> 16);
  BFloat16 r;
  std::memcpy(&r, &h, 2);
  return r;
}

int main() {
  // fp8 rows: 4096 bf16 values (8 KiB), e4m3, at an exact (1.0) and a corrected (0.02) quotient.
  constexpr int kValues = 4096, kRowReps = 2000;
  std::vector<BFloat16> row(kValues);
  std::vector<uint8_t> codes(kValues);
  for (int i = 0; i < kValues; ++i) row[size_t(i)] = bf16(std::sin(float(i) * 0.37f) * 3.0f);
  for (float scale : {1.0f, 0.02f}) {
    const double ns = best_ns(
        [&] {
          for (int r = 0; r < kRowReps; ++r)
            host::quant_row16<BFloat16>(row.data(), codes.data(), kValues, scale, Fp8::kE4M3,
                                        false);
        },
        double(kRowReps) * kValues);
    std::printf("fp8 rows, bf16 -> e4m3, scale %-4g  %.3f ns per value\n", scale, ns);
  }

  // QK norm: 32 tokens of 40 heads of 128 bf16 (320 KiB read, 320 KiB written: the input stays as
  // drawn, no denormal ever reaches the stores), half-split pairing, the cos / sin of one angle per
  // pair.
  constexpr int kDim = 128, kHeads = 40, kTokens = 32, kNormReps = 200;
  std::vector<BFloat16> heads(size_t(kTokens) * kHeads * kDim), out(heads.size());
  for (size_t i = 0; i < heads.size(); ++i) heads[i] = bf16(std::sin(float(i) * 0.37f) * 3.0f);
  alignas(64) static float tab[kDim];
  for (int i = 0; i < kDim / 2; ++i) {
    tab[i] = std::cos(float(i) * 0.1f);
    tab[kDim / 2 + i] = std::sin(float(i) * 0.1f);
  }
  static host::NormWeights<float> nw;
  for (int i = 0; i < kDim; ++i) nw.w[i] = 1.0f + 0.01f * float(i);
  const host::Ahead<BFloat16> pf{};
  const double ns = best_ns(
      [&] {
        for (int r = 0; r < kNormReps; ++r)
          for (int t = 0; t < kTokens; ++t) {
            const size_t at = size_t(t) * kHeads * kDim;
            host::Avx512Norm<kDim>::norm_heads<BFloat16, false, float>(
                heads.data() + at, out.data() + at, kDim, kDim, kHeads, nw, tab, 1e-6, pf);
          }
      },
      double(kNormReps) * kTokens * kHeads);
  std::printf("QK norm + rotary, bf16, head_dim 128   %.2f ns per head (%s)\n", ns,
              HW_BF16 ? "avx512_bf16" : "avx512");
}

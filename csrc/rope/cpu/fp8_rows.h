// Row kernel of the serving ops on the CPU: the fp8 quantization of one row
// (KV-cache rows, fp8 q). Three sets: the portable template here, the AVX2
// build (cpu/avx2.cpp) and the AVX-512 one (cpu/avx512_rows.h), which both
// AVX-512 instruction sets use. All compute the same bits (saturate, round to
// nearest even). Torch-free.
#pragma once

#include <cstdint>
#include <cstring>

#include "../serving.h"

namespace rope {
namespace cpu {

// Function tables indexed by DType (float32, float64, float16, bfloat16),
// and the cache-row copy.
struct RowOps {
  // dst[0, n) = quantize_fp8(x[i], scale, t) (serving.h). stream: a KV-cache
  // row of a call that writes many, which the AVX-512 kernel writes with
  // non-temporal stores where whole aligned 64-byte blocks allow (as copy
  // does; then the thread calls fence() after its last row).
  void (*quant[4])(const void* x, uint8_t* dst, int64_t n, float scale, Fp8 t, bool stream);
  // dst[0, n) = fp8_to_float(codes[i], t) * scale (serving.h): fp8 rows read back as float32 (the
  // re-rotation of an fp8 key cache).
  void (*dequant)(const uint8_t* codes, float* dst, int64_t n, float scale, Fp8 t);
  // dst[0, bytes) = x[0, bytes): a KV-cache row of a call that writes many
  // (kv_cache.cpp: kStreamMinBytes). The vector builds write whole aligned
  // rows with non-temporal stores (a row is written once, to a line not in
  // cache: no read for ownership); a thread calls fence() after its last
  // row, before the op returns.
  void (*copy)(const void* x, void* dst, int64_t bytes);
  void (*fence)();
  // Whether a call that quantizes many 16-bit values looks them up in a table
  // made by quant (kv_cache.cpp, Fp8Tables): where quant costs more than a
  // lookup per value (the portable and AVX2 kernels), not where it costs less
  // (AVX-512: benchmarks/cpu-fp8-rows.md).
  bool tables;
};

// The row kernels of the instruction set in use (cpu/kernel.cpp).
const RowOps& row_ops();

namespace detail {
extern const RowOps kRowsScalar;
extern const RowOps kRowsAvx2;
extern const RowOps kRowsAvx512;
}  // namespace detail

}  // namespace cpu

inline namespace ROPE_ISA {
namespace host {

template <class T>
void quant_row(const void* xv, uint8_t* dst, int64_t n, float scale, Fp8 t, bool) {
  const T* x = static_cast<const T*>(xv);
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize_fp8(float(to_acc(x[i])), scale, t);
}

// 1 / scale when scale is a power of two (1.0 included) whose reciprocal is a
// normal float, else 0. Then x / scale == x * (1 / scale) for every x: both
// are the same exact value rounded once (also under FTZ / DAZ, the reciprocal
// being normal), and a product costs less than a quotient.
inline float exact_reciprocal(float scale) {
  uint32_t b;
  std::memcpy(&b, &scale, sizeof b);
  const uint32_t e = (b >> 23) & 0xff;
  return (b & 0x7fffff) == 0 && e >= 1 && e <= 253 ? 1.0f / scale : 0.0f;
}

// How the vector row kernels (avx2_rows.h, avx512_rows.h) form x / scale: by the division (every
// scale), by the product with an exact reciprocal (exact_reciprocal: a positive power of two), or
// by the product corrected with two fused multiply-adds (Markstein: with r = 1 / scale correctly
// rounded and q = x * r, the error e = x - q * scale is exact and q + e * r rounds to x / scale)
// for a positive scale in [2^-60, 2^60]. There every term is a normal float (also under FTZ / DAZ)
// wherever the quotient is 2^-43 or more; a code other than zero needs 2^-17. |x| is clamped to
// 2 * max * scale first, so no product overflows and every clamped value still saturates.
enum class Quotient { kDivide, kProduct, kCorrected };

inline Quotient quotient_of(float scale) {
  if (exact_reciprocal(scale) > 0) return Quotient::kProduct;
  return scale >= 0x1p-60f && scale <= 0x1p60f ? Quotient::kCorrected : Quotient::kDivide;
}

inline void copy_row(const void* x, void* dst, int64_t bytes) {
  std::memcpy(dst, x, size_t(bytes));
}
inline void no_fence() {}

// The float of each fp8 code (fp8_to_float), per type.
inline const float* fp8_values(Fp8 t) {
  static const auto tables = [] {
    struct {
      float v[2][256];
    } r{};
    for (int b = 0; b < 256; ++b) {
      r.v[0][b] = fp8_to_float(uint8_t(b), Fp8::kE4M3);
      r.v[1][b] = fp8_to_float(uint8_t(b), Fp8::kE5M2);
    }
    return r;
  }();
  return tables.v[t == Fp8::kE4M3 ? 0 : 1];
}

// The portable dequantization: a lookup per code.
inline void dequant_row(const uint8_t* codes, float* dst, int64_t n, float scale, Fp8 t) {
  const float* v = fp8_values(t);
  for (int64_t i = 0; i < n; ++i) dst[i] = v[codes[i]] * scale;
}

// The portable table.
inline constexpr cpu::RowOps kPortableRows{
    {quant_row<float>, quant_row<double>, quant_row<Half>, quant_row<BFloat16>},
    dequant_row,
    copy_row,
    no_fence,
    true};

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

// Row kernel of the serving ops on the CPU: the fp8 quantization of one row
// (KV-cache rows, fp8 q). Two sets: the portable template here, and the AVX2
// build (cpu_avx2.cpp), which the AVX-512 instruction sets use too. Both
// compute the same bits (saturate, round to nearest even). Torch-free.
#pragma once

#include <cstdint>

#include "serving.h"

namespace rope {
namespace cpu {

// Function tables indexed by DType (float32, float64, float16, bfloat16).
struct RowOps {
  // dst[0, n) = quantize_fp8(x[i], scale, t) (serving.h).
  void (*quant[4])(const void* x, uint8_t* dst, int64_t n, float scale, Fp8 t);
};

// The row kernels of the instruction set in use (cpu_kernel.cpp).
const RowOps& row_ops();

namespace detail {
extern const RowOps kRowsScalar;
extern const RowOps kRowsAvx2;
}  // namespace detail

}  // namespace cpu

inline namespace ROPE_ISA {
namespace host {

template <class T>
void quant_row(const void* xv, uint8_t* dst, int64_t n, float scale, Fp8 t) {
  const T* x = static_cast<const T*>(xv);
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize_fp8(float(to_acc(x[i])), scale, t);
}

// The portable table.
inline constexpr cpu::RowOps kPortableRows{
    {quant_row<float>, quant_row<double>, quant_row<Half>, quant_row<BFloat16>}};

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

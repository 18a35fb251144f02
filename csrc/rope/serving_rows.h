// Row kernels of the serving ops on the CPU: the RMSNorm of one head and the
// fp8 quantization of one row. Two sets: the portable templates here, and the
// AVX2 build (cpu_avx2.cpp), which the AVX-512 instruction sets use too (the
// rows are memory-bound). Both compute the same bits: the sum of squares runs
// in 16 fixed lanes added in order, products are not fused, and the
// conversions round to nearest even. Torch-free.
#pragma once

#include <cstdint>

#include "serving.h"

namespace rope {
namespace cpu {

// Function tables indexed by DType (float32, float64, float16, bfloat16).
struct RowOps {
  // y[0, n) = x * rms * w, rounded to x's dtype, with rms the RMSNorm scale
  // (rms_inverse) of x[0, n); w holds n floats (doubles for float64). y may be x.
  void (*norm[4])(const void* x, void* y, const void* w, int n, double eps);
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

constexpr int kNormLanes = 16;

// The sum of the 16 lanes, in order.
template <class A>
A lane_total(const A (&part)[kNormLanes]) {
  A s = 0;
  for (int k = 0; k < kNormLanes; ++k) s += part[k];
  return s;
}

template <class T>
void norm_row(const void* xv, void* yv, const void* wv, int n, double eps) {
  using A = typename Acc<T>::type;
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const A* w = static_cast<const A*>(wv);
  A part[kNormLanes] = {};
  for (int i = 0; i < n; i += kNormLanes)
    for (int k = 0; k < kNormLanes && i + k < n; ++k) {
      const A v = to_acc(x[i + k]);
      part[k] += v * v;
    }
  const A rms = rms_inverse<A>(lane_total(part), n, eps);
  for (int i = 0; i < n; ++i) y[i] = Store<T>::from(to_acc(x[i]) * rms * w[i]);
}

template <class T>
void quant_row(const void* xv, uint8_t* dst, int64_t n, float scale, Fp8 t) {
  const T* x = static_cast<const T*>(xv);
  for (int64_t i = 0; i < n; ++i) dst[i] = quantize_fp8(float(to_acc(x[i])), scale, t);
}

// The portable table.
inline constexpr cpu::RowOps kPortableRows{
    {norm_row<float>, norm_row<double>, norm_row<Half>, norm_row<BFloat16>},
    {quant_row<float>, quant_row<double>, quant_row<Half>, quant_row<BFloat16>}};

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

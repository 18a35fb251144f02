// Per-pair math of rope_ext, shared by the CPU and CUDA kernels: bit-exact
// fp16/bf16 conversions, the rotation of one feature pair, the pairing of
// features, and the index math of RopeParams (params.h). Torch-free.
//
// Every function here is inline. A translation unit compiled for another
// instruction set (the AVX2 CPU kernel) defines ROPE_ISA before including
// this header, so that its copies get names of their own (rope::avx2::...)
// and can never stand in for the portable ones at link time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "params.h"

#if defined(__CUDACC__)
#define ROPE_HD __host__ __device__ __forceinline__
#define ROPE_UNROLL _Pragma("unroll")
#else
#define ROPE_HD inline
#define ROPE_UNROLL
#endif

#ifndef ROPE_ISA
#define ROPE_ISA portable
#endif

namespace rope {
inline namespace ROPE_ISA {

// ---------------------------------------------------------------------------
// Bit-exact conversions (round to nearest even), identical on host and device.

ROPE_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

ROPE_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

ROPE_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Round to nearest even; a NaN keeps its sign and top payload bits, made quiet (as AVX-512 BF16's
// vcvtneps2bf16). On the GPU the hardware conversion gives the same bits but for NaN (its canonical
// NaN), which is replaced.
ROPE_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
#if defined(__CUDA_ARCH__)
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
#endif
}

// IEEE half <-> float without F16C or CUDA intrinsics (exact, handles
// subnormals, infinities and NaN).
ROPE_HD float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r =
      sign | (two_w < (1u << 27) ? float_to_bits(denormalized) : float_to_bits(normalized));
  return bits_to_float(r);
}

ROPE_HD uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  // The hardware conversion, but for NaN (its canonical NaN): the sign and 0x7E00, as below.
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return f != f ? uint16_t(((float_to_bits(f) >> 16) & 0x8000u) | 0x7E00u) : h;
#else
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

// Arithmetic type: float for every storage type but double.
template <class T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

ROPE_HD float to_acc(float v) { return v; }
ROPE_HD double to_acc(double v) { return v; }
ROPE_HD float to_acc(Half v) { return half_to_float(v.bits); }
ROPE_HD float to_acc(BFloat16 v) { return bf16_to_float(v.bits); }

template <class T>
struct Store;
template <>
struct Store<float> {
  ROPE_HD static float from(float v) { return v; }
};
template <>
struct Store<double> {
  ROPE_HD static double from(double v) { return v; }
};
template <>
struct Store<Half> {
  ROPE_HD static Half from(float v) { return Half{float_to_half(v)}; }
};
template <>
struct Store<BFloat16> {
  ROPE_HD static BFloat16 from(float v) { return BFloat16{float_to_bf16(v)}; }
};

// ---------------------------------------------------------------------------
// A product rounded once, and a fused multiply-add (a b + c rounded once),
// whatever the compiler's contraction setting: the host builds compile with
// -ffp-contract=off and nvcc with --fmad=true, so the grouping is written
// here and nowhere left to the compiler.
ROPE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ROPE_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
ROPE_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
ROPE_HD double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The rotation of one feature pair (x1, x2) by the angle whose cosine and sine
// are (c, s):  y1 = x1 c - x2 s,  y2 = x2 c + x1 s.  The inverse rotation (and
// the gradient) is the same map with s negated.
//
// One grouping on every path, so that the portable and vector CPU kernels, the
// host emulation and the GPU give the same bits: the product with s is rounded,
// then x c is added to it in one fused multiply-add,
//   y1 = fma(x1, c, x2 (-s)),  y2 = fma(x2, c, x1 s)
// (the vector kernels' fmsub / fmadd onto a rounded product). s is negated
// rather than the product, so that a NaN x2 keeps its sign, as in fmsub.
template <class A>
ROPE_HD void rotate_pair(A x1, A x2, A c, A s, A& y1, A& y2) {
  y1 = fma_rn(x1, c, mul_rn(x2, -s));
  y2 = fma_rn(x2, c, mul_rn(x1, s));
}

// Index of the two features of pair j within a head.
//   half-split (GPT-NeoX, HF rotate_half): (j, j + rotary_dim/2)
//   interleaved (GPT-J, RoFormer, complex form): (2j, 2j + 1)
ROPE_HD void pair_index(bool interleaved, int j, int rotary_dim, int& i1, int& i2) {
  i1 = interleaved ? 2 * j : j;
  i2 = interleaved ? 2 * j + 1 : j + rotary_dim / 2;
}

// Bytes per element of a DType.
ROPE_HD int dtype_size(DType t) { return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2; }

// Offsets of one token in positions, and in the input and output of each tensor.
struct TokenOffsets {
  int64_t pos;
  int64_t in[2];
  int64_t out[2];
};

ROPE_HD TokenOffsets token_offsets(const RopeParams& p, int64_t token) {
  if (p.n_tok_dims == 1)  // one token dim (the usual [T, H, D]): no division
    return {token * p.pos_stride[0],
            {token * p.t[0].in_tok_stride[0], token * p.t[1].in_tok_stride[0]},
            {token * p.t[0].out_tok_stride[0], token * p.t[1].out_tok_stride[0]}};
  TokenOffsets o{0, {0, 0}, {0, 0}};
  for (int d = p.n_tok_dims - 1; d >= 0; --d) {
    const int64_t i = token % p.tok_size[d];
    token /= p.tok_size[d];
    o.pos += i * p.pos_stride[d];
    for (int t = 0; t < 2; ++t) {
      o.in[t] += i * p.t[t].in_tok_stride[d];
      o.out[t] += i * p.t[t].out_tok_stride[d];
    }
  }
  return o;
}

// The offsets of a token with at most one token dim (the serving ops' [T, H,
// D]; token 0 when there is none): no division.
ROPE_HD TokenOffsets token_offsets_1d(const RopeParams& p, int64_t token) {
  return {token * p.pos_stride[0],
          {token * p.t[0].in_tok_stride[0], token * p.t[1].in_tok_stride[0]},
          {token * p.t[0].out_tok_stride[0], token * p.t[1].out_tok_stride[0]}};
}

// The offsets of a head with at most one head dim (head 0 when there is none).
ROPE_HD void head_offsets_1d(const RotTensor& t, int64_t head, int64_t& in, int64_t& out) {
  in = head * t.in_head_stride[0];
  out = head * t.out_head_stride[0];
}

// Inside the per-head loops: several head dims hold fewer than 2^31 heads
// (make_params), so their index splits in 32-bit arithmetic, without a 64-bit
// division subroutine.
ROPE_HD void head_offsets(const RotTensor& t, int64_t head, int64_t& in, int64_t& out) {
  if (t.n_head_dims <= 1) return head_offsets_1d(t, head, in, out);
  in = 0;
  out = 0;
  uint32_t rest = uint32_t(head);
  for (int d = t.n_head_dims - 1; d >= 0; --d) {
    const uint32_t size = uint32_t(t.head_size[d]), i = rest % size;
    rest /= size;
    in += int64_t(i) * t.in_head_stride[d];
    out += int64_t(i) * t.out_head_stride[d];
  }
}

template <class Pos>
ROPE_HD int64_t load_position(const RopeParams& p, int64_t offset) {
  return int64_t(static_cast<const Pos*>(p.positions)[offset]);
}

ROPE_HD bool position_in_cache(const RopeParams& p, int64_t pos) {
  return pos >= 0 && pos < p.n_cache_rows;
}

ROPE_HD bool is_mrope(const RopeParams& p) { return p.n_axes > 0; }

// Several position axes: the axis whose position rotates pair j. Contiguous
// sections (Qwen2-VL, Qwen2.5-VL: t, h, w; FLUX, Wan: one run per axis): the
// first section[0] pairs, then the next section[1], and so on. Interleaved
// (Qwen3-VL, n axes): pair j takes axis a = j % n when a > 0 and j < n *
// section[a], else axis 0 (with 3: pairs 1, 4, 7, .. below 3h height, pairs
// 2, 5, 8, .. below 3w width, all others temporal). Alternating
// (ERNIE-4.5-VL, n axes, sections 1 .. n-1 equal): axes 1 .. n-1 take turns
// from pair 0, pair j on axis 1 + j % (n - 1) while j < (n - 1) section[1],
// then axis 0 (with 3: h, w, h, w, .. then t).
// Fixed-count loops over the bounds (params.h), constant indices: no local
// memory on the GPU, and no division but the j % n of n > 3 turns.
ROPE_HD int mrope_row(const RopeParams& p, int j) {
  int a = 0;
  if (p.axis_layout != AxisLayout::kContiguous) {
    // The turn of pair j: axis j % n interleaved, axis 1 + j % (n - 1) alternating.
    const int n = p.axis_period;
    const int r = (n == 3 ? j % 3 : n == 2 ? j & 1 : j % n) + p.axis_first;
    ROPE_UNROLL
    for (int s = 1; s < kMaxAxes; ++s) a = s == r && j < p.axis_bound[s] ? s : a;
    return a;
  }
  ROPE_UNROLL
  for (int s = 0; s + 1 < kMaxAxes; ++s) a += j >= p.axis_bound[s];
  return a;
}

// Calls f.template operator()<T, CS, Pos, Interleaved>() for the runtime types of p.
template <class F>
void dispatch_types(const RopeParams& p, F&& f) {
  auto with_pairing = [&](auto t, auto cs, auto pos) {
    using T = decltype(t);
    using CS = decltype(cs);
    using Pos = decltype(pos);
    if (p.interleaved)
      f.template operator()<T, CS, Pos, true>();
    else
      f.template operator()<T, CS, Pos, false>();
  };
  auto with_pos = [&](auto t, auto cs) {
    if (p.pos_int64)
      with_pairing(t, cs, int64_t{});
    else
      with_pairing(t, cs, int32_t{});
  };
  auto with_cs = [&](auto t) {
    using T = decltype(t);
    if (p.cs_dtype == DType::kFloat32)
      with_pos(t, float{});
    else
      with_pos(t, T{});
  };
  switch (p.x_dtype) {
    case DType::kFloat32:
      return with_cs(float{});
    case DType::kFloat64:
      return with_cs(double{});
    case DType::kFloat16:
      return with_cs(Half{});
    case DType::kBFloat16:
      return with_cs(BFloat16{});
  }
}

}  // namespace ROPE_ISA
}  // namespace rope

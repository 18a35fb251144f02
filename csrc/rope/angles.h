// cos and sin of a position times a frequency, in double precision, the same
// bits on every CPU and on the GPU: the rows of the tables (rope_ext's
// cos_sin_rows) and of the table-free mode (RopeParams::freqs) come from
// here. Torch-free.
//
// The angle is the exact product p f of two doubles. It is taken in turns,
// t = p g with g = f / (2 pi) a double-double (relative error 2^-104), so
// that whole turns drop out exactly whatever p; the remaining quarter turn
// becomes radians in double-double arithmetic and goes to fdlibm's kernels
// (k_sin.c, k_cos.c, which take the low part). Every product is written as
// mul_rn or fma_rn (rope.h), never left to the compiler's contraction, so
// the host builds and nvcc compute the same double. The result is within a
// few double ulps of the exact cos and sin: rounded to float32 it is the
// correctly rounded value, or one ulp off when the exact one lies within
// about 2^-50 relative of a rounding boundary.
#pragma once

#include "rope.h"

namespace rope {
inline namespace ROPE_ISA {

// 1 / (2 pi) and pi / 2 as double-doubles.
constexpr double kInv2PiHi = 0x1.45f306dc9c883p-3, kInv2PiLo = -0x1.6b01ec5417056p-57;
constexpr double kPio2Hi = 0x1.921fb54442d18p+0, kPio2Lo = 0x1.1a62633145c07p-54;
// Quarter turns past this (an angle of about 3.5e15 rad) are refused: NaN.
constexpr double kMaxQuarterTurns = 0x1.0p51;

// x rounded to the nearest integer, ties to even, for |x| < 2^51 (the
// addition rounds away the fraction): no library call, so it vectorizes.
ROPE_HD double round_even(double x) {
  constexpr double kShift = 0x1.8p52;
  return (x + kShift) - kShift;
}

// sin(x + y) for |x| <= pi/4 + 2^-40, |y| <= ulp(x) / 2 (fdlibm's __kernel_sin, iy = 1).
ROPE_HD double kernel_sin(double x, double y) {
  constexpr double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03,
                   S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06,
                   S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
  const double z = mul_rn(x, x), w = mul_rn(z, z);
  const double r = S2 + mul_rn(z, S3 + mul_rn(z, S4)) + mul_rn(mul_rn(z, w), S5 + mul_rn(z, S6));
  const double v = mul_rn(z, x);
  return x - ((mul_rn(z, mul_rn(0.5, y) - mul_rn(v, r)) - y) - mul_rn(v, S1));
}

// cos(x + y), as kernel_sin (fdlibm's __kernel_cos).
ROPE_HD double kernel_cos(double x, double y) {
  constexpr double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03,
                   C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07,
                   C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
  const double z = mul_rn(x, x), w = mul_rn(z, z);
  const double r = mul_rn(z, C1 + mul_rn(z, C2 + mul_rn(z, C3))) +
                   mul_rn(mul_rn(w, w), C4 + mul_rn(z, C5 + mul_rn(z, C6)));
  const double hz = mul_rn(0.5, z), u = 1.0 - hz;
  return u + (((1.0 - u) - hz) + (mul_rn(z, r) - mul_rn(x, y)));
}

// c = a cos(p f), s = a sin(p f). NaN when p f is not finite or past
// kMaxQuarterTurns quarter turns. Odd in p: sin(-p f) = -sin(p f) bit for bit.
ROPE_HD void angle_cos_sin(double p, double f, double a, double& c, double& s) {
  // g = f / (2 pi) in turns, then t = p g: both as double-doubles, products exact.
  const double g_hi = mul_rn(f, kInv2PiHi);
  const double g_lo = fma_rn(f, kInv2PiLo, fma_rn(f, kInv2PiHi, -g_hi));
  const double t_hi = mul_rn(p, g_hi);
  const double t_lo = fma_rn(p, g_lo, fma_rn(p, g_hi, -t_hi));
  // Quarter turns v = 4 t (exact); q the nearest whole one, w = v - q in [-1/2, 1/2] (its high
  // part exact: a double less its nearest integer).
  const double v_hi = mul_rn(4.0, t_hi), v_lo = mul_rn(4.0, t_lo);
  // Past kMaxQuarterTurns (or NaN) what follows computes nonsense that ends multiplied by NaN.
  const bool valid = fabs(v_hi) < kMaxQuarterTurns;  // false for NaN
  const double q = round_even(v_hi);
  const double w_hi = v_hi - q;
  // r = w pi / 2 radians, |r| <= pi/4 + tiny, as r_hi + r_lo.
  // (v_lo may outweigh w_hi's product when w_hi is tiny: a full two-sum.)
  const double r0 = mul_rn(w_hi, kPio2Hi);
  const double r1 = fma_rn(w_hi, kPio2Hi, -r0) + (mul_rn(w_hi, kPio2Lo) + mul_rn(v_lo, kPio2Hi));
  const double r_hi = r0 + r1, b = r_hi - r0;
  const double r_lo = (r0 - (r_hi - b)) + (r1 - b);
  const double sr = kernel_sin(r_hi, r_lo), cr = kernel_cos(r_hi, r_lo);
  // The quadrant q mod 4 (floor(q / 4) with no tie: q / 4 - 3/8 is never halfway).
  const double m = q - mul_rn(4.0, round_even(mul_rn(q, 0.25) - 0.375));
  // (One comparison per choice: the compiler vectorizes selects, not their conjunctions.)
  const bool odd = fabs(m - 2.0) == 1.0;  // m = 1 or 3
  const double sv = odd ? cr : sr, cv = odd ? sr : cr;
  const double sn = m >= 2.0 ? -sv : sv, cn = fabs(m - 1.5) < 1.0 ? -cv : cv;  // m = 1 or 2
  const double nan = valid ? 1.0 : NAN;
  c = mul_rn(mul_rn(cn, a), nan);
  s = mul_rn(mul_rn(sn, a), nan);
}

// The table-free rows (params.h AngleRows). Position `off` of p as a double:
// NaN for an int64 beyond 2^53, which a double would not hold exactly.
template <class Pos>
ROPE_HD double position_value(const RopeParams& p, int64_t off) {
  const Pos v = static_cast<const Pos*>(p.positions)[off];
  if constexpr (sizeof(Pos) == 8 && Pos(0.5) == Pos(0)) {  // int64
    constexpr int64_t kExact = int64_t(1) << 53;
    return v >= -kExact && v <= kExact ? double(v) : NAN;
  }
  return double(v);
}

// Offset in the positions of the position that rotates pair j of the token
// whose positions start at pos_off (its axis's, with several axes).
ROPE_HD int64_t pair_position_offset(const RopeParams& p, int64_t pos_off, int j) {
  return is_mrope(p) ? pos_off + mrope_row(p, j) * p.pos_section_stride : pos_off;
}

// Stores pair j's cos and sin in `row` (cos half, then sin half).
template <class R>
ROPE_HD void store_angle(R* row, int h, int j, double p, const double* freqs) {
  double c, s;
  angle_cos_sin(p, freqs[j], freqs[h + j], c, s);
  row[j] = R(c);
  row[h + j] = R(s);
}

// Calls f.template operator()<Pos, R>() for the positions' and rows' types.
template <class F>
void dispatch_angle_rows(const AngleRows& ar, F&& f) {
  auto with_rows = [&](auto pos) {
    if (ar.rows_dtype == DType::kFloat64)
      f.template operator()<decltype(pos), double>();
    else
      f.template operator()<decltype(pos), float>();
  };
  switch (ar.rope.pos_type) {
    case PosType::kInt32:
      return with_rows(int32_t{});
    case PosType::kInt64:
      return with_rows(int64_t{});
    case PosType::kFloat32:
      return with_rows(float{});
    case PosType::kFloat64:
      return with_rows(double{});
  }
}

}  // namespace ROPE_ISA
}  // namespace rope

// Torch-free check of the aarch64 NEON build of the CPU kernel (cpu/neon.cpp)
// against the portable build and a float64 reference. Built and run by
// tests/test_neon.py (cross-compiled, run under qemu-aarch64):
//
//   aarch64-linux-gnu-g++ -std=c++20 -I csrc/rope tests/native/neon_check.cpp
//       csrc/rope/cpu/kernel.cpp csrc/rope/cpu/neon.cpp -o neon_check
//
// For every case (dtype, pairing, head_dim/rotary_dim, tokens, in/out of
// place, inverse, strided heads, positions outside the cache, NaN/inf inputs):
//   * NEON vs scalar: bit-identical in every dtype (both compute rope.h's
//     rotate_pair: a fused multiply-add onto the rounded product with s);
//   * float32: NEON equals, bit for bit, that formula evaluated here with
//     std::fma, in the vector loops and in the tail;
//   * NEON vs a float64 rotation of the same (dtype-rounded) inputs and fp32
//     cos/sin: within 4 eps(dtype) of the pair's largest input;
//   * fp16 / bf16: the NEON output equals, bit for bit, the NEON fp32 output
//     for the widened inputs rounded by rope.h's float_to_half / float_to_bf16
//     (NaN stays NaN);
//   * pass-through features copied (out of place) or untouched (in place),
//     gaps between heads untouched, tokens outside the cache NaN.
// NaN is compared as NaN only: its sign and payload are not reproducible
// across builds (aarch64 propagates the payload of the first NaN operand, and
// compilers commute the operands of a multiplication), and fp16 conversions
// keep payloads that float_to_half drops.
// Prints one line per failing case, then `neon_check: N cases, F failures`;
// the exit code is 1 on any failure.
#if !defined(__aarch64__)
#include <cstdio>

int main() {
  std::puts("neon_check: needs aarch64");
  return 2;
}
#else

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../../csrc/rope/cpu/kernel.h"

using namespace rope;

namespace {

struct Case {
  DType dtype;
  bool interleaved;
  int D, r;
  int T;
  bool inplace, inverse;
  bool strided;  // gaps between heads (and a different layout out of place)
  bool oob;      // some positions outside the cache
  bool pos64;    // int64 positions (else int32)
  bool special;  // NaN, inf, huge and tiny inputs
  bool cs_x;     // cos/sin in x's dtype (else float32)
  unsigned seed;
};

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "?";
}

std::string name(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s %s D=%d r=%d T=%d %s%s%s%s%s%s%s", dtype_name(c.dtype),
                c.interleaved ? "interleaved" : "half-split", c.D, c.r, c.T,
                c.inplace ? "in-place" : "out-of-place", c.inverse ? " inverse" : "",
                c.strided ? " strided" : "", c.oob ? " oob" : "", c.pos64 ? " pos64" : " pos32",
                c.special ? " special" : "", c.cs_x ? " cs=x" : "");
  return buf;
}

// Per dtype: eps (ulp at 1), smallest subnormal, conversions.
template <class T>
struct Traits;
template <>
struct Traits<float> {
  static constexpr DType kDType = DType::kFloat32;
  static constexpr double kEps = 0x1p-23, kTiny = 0x1p-149, kMax = 0x1.fffffep127;
  static float from(double v) { return float(v); }
};
template <>
struct Traits<double> {
  static constexpr DType kDType = DType::kFloat64;
  static constexpr double kEps = 0x1p-50, kTiny = 0x1p-1074, kMax = 0x1.fffffffffffffp1023;
  static double from(double v) { return v; }
};
template <>
struct Traits<Half> {
  static constexpr DType kDType = DType::kFloat16;
  static constexpr double kEps = 0x1p-10, kTiny = 0x1p-24, kMax = 65504.0;
  static Half from(double v) { return Half{float_to_half(float(v))}; }
};
template <>
struct Traits<BFloat16> {
  static constexpr DType kDType = DType::kBFloat16;
  static constexpr double kEps = 0x1p-7, kTiny = 0x1p-133, kMax = 0x1.fep127;
  static BFloat16 from(double v) { return BFloat16{float_to_bf16(float(v))}; }
};

template <class T>
double val(T x) {
  return double(to_acc(x));
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// One tensor: [T, H, D] with head stride S_in (S_out) and token stride H * S.
struct Layout {
  int H;
  int64_t s_in, s_out;  // head strides
  int64_t off_in, off_out;
  size_t n_in, n_out;
};

Layout layout(const Case& c, int H) {
  Layout l;
  l.H = H;
  l.s_in = c.D + (c.strided ? 3 : 0);
  l.off_in = c.strided ? 1 : 0;
  l.s_out = c.inplace ? l.s_in : c.D + (c.strided ? 5 : 0);
  l.off_out = c.inplace ? l.off_in : (c.strided ? 2 : 0);
  l.n_in = size_t(l.off_in + int64_t(c.T) * H * l.s_in);
  l.n_out = size_t(l.off_out + int64_t(c.T) * H * l.s_out);
  return l;
}

// Buffers of one run: per tensor, input and output (the same in place).
template <class T>
struct Run {
  std::vector<T> in[2], out[2];
};

template <class T>
T sentinel() {
  T v;
  std::memset(&v, 0x7b, sizeof v);
  return v;
}

constexpr int kRows = 64;  // cache rows
constexpr int kGuard = 2;  // finite rows before and after the cache: reading them would show

struct Inputs {
  std::vector<int64_t> pos;
  std::vector<char> cs;  // guard rows, n_rows rows, guard rows; float32 or x's dtype
  int64_t cs_stride;
};

template <class T>
Inputs make_cache(const Case& c, std::mt19937& rng) {
  Inputs in;
  std::uniform_int_distribution<int64_t> pick(0, kRows - 1);
  for (int t = 0; t < c.T; ++t) in.pos.push_back(pick(rng));
  if (c.oob) {
    in.pos[c.T > 1 ? 1 : 0] = kRows;  // just past the end
    if (c.T > 3) in.pos[3] = -1;
    if (c.T > 5) in.pos[5] = c.pos64 ? (int64_t(1) << 40) : std::numeric_limits<int32_t>::max();
    if (c.T > 7) in.pos[7] = c.pos64 ? std::numeric_limits<int64_t>::min() : -kRows;
  }
  in.cs_stride = c.r + (c.strided ? 4 : 0);
  const size_t n = size_t((kRows + 2 * kGuard) * in.cs_stride);
  const int h = c.r / 2;
  auto fill = [&](auto zero) {
    using CS = decltype(zero);
    std::vector<CS> v(n, Traits<CS>::from(0.5));  // guards: finite
    for (int row = 0; row < kRows; ++row)
      for (int j = 0; j < h; ++j) {
        const double inv = std::pow(10000.0, -2.0 * j / c.r);
        const double a = double(row) * inv;
        CS* p = v.data() + (row + kGuard) * in.cs_stride;
        p[j] = Traits<CS>::from(std::cos(a));
        p[h + j] = Traits<CS>::from(std::sin(a));
      }
    if constexpr (std::is_same_v<CS, float>) {
      if (c.special && c.T > 2 && !c.oob) {
        // NaNs whose low 16 bits are set (a quiet one that a rounding bias would
        // carry into the sign, and a signalling one): bf16 must keep them NaN.
        float* p = v.data() + (in.pos[2] + kGuard) * in.cs_stride;
        p[0] = bits_to_float(0x7fffffffu);
        p[h + (h > 1 ? 1 : 0)] = bits_to_float(0x7f80ffffu);
      }
    }
    in.cs.resize(n * sizeof(CS));
    std::memcpy(in.cs.data(), v.data(), in.cs.size());
  };
  if (c.cs_x)
    fill(T{});
  else
    fill(float{});
  return in;
}

// Random inputs of dtype T (gaps hold the sentinel).
template <class T>
std::vector<T> make_input(const Case& c, const Layout& l, std::mt19937& rng) {
  std::vector<T> v(l.n_in, sentinel<T>());
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  std::uniform_int_distribution<int> scale(-6, 6), pct(0, 99);
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Per dtype: close to its largest finite value, and in its subnormal range.
  const double huge = std::is_same_v<T, Half> ? 6.0e4 : std::is_same_v<T, double> ? 1e308 : 3e38;
  const double tiny = std::is_same_v<T, Half> ? 3e-6 : std::is_same_v<T, double> ? 1e-310 : 3e-39;
  for (int t = 0; t < c.T; ++t)
    for (int hd = 0; hd < l.H; ++hd) {
      const double sc = std::ldexp(1.0, scale(rng));
      T* p = v.data() + l.off_in + (int64_t(t) * l.H + hd) * l.s_in;
      for (int i = 0; i < c.D; ++i) {
        double x = u(rng) * sc;
        const int q = pct(rng);
        if (q < 3) x = q == 0 ? -0.0 : 0.0;
        if (c.special && q >= 90) {
          const double sp[] = {nan,  inf,   -inf,       huge,     -huge,
                               tiny, -tiny, huge * 0.7, tiny * 3, -nan};
          x = sp[q - 90];
        }
        p[i] = Traits<T>::from(x);
      }
    }
  return v;
}

RopeParams make_params(const Case& c, const Layout lq, const Layout lk, const Inputs& in,
                       const void* x_in[2], void* x_out[2]) {
  RopeParams p;
  std::memset(&p, 0, sizeof p);
  const Layout* ls[2] = {&lq, &lk};
  for (int ti = 0; ti < 2; ++ti) {
    const Layout& l = *ls[ti];
    RotTensor& t = p.t[ti];
    t.in = x_in[ti];
    t.out = x_out[ti];
    t.copy_pass = !c.inplace;
    t.n_head_dims = 1;
    t.n_heads = l.H;
    t.head_size[0] = l.H;
    t.in_head_stride[0] = l.s_in;
    t.out_head_stride[0] = l.s_out;
    t.in_tok_stride[0] = l.H * l.s_in;
    t.out_tok_stride[0] = l.H * l.s_out;
  }
  p.n_tensors = 2;
  p.n_tok_dims = 1;
  p.n_tokens = c.T;
  p.tok_size[0] = c.T;
  p.pos_stride[0] = 1;
  p.positions = nullptr;  // set by the caller
  const size_t cs_size = c.cs_x ? size_t(dtype_size(c.dtype)) : sizeof(float);
  p.cos_sin = in.cs.data() + size_t(kGuard * in.cs_stride) * cs_size;
  p.cs_row_stride = in.cs_stride;
  p.n_cache_rows = kRows;
  p.head_dim = c.D;
  p.rotary_dim = c.r;
  p.interleaved = c.interleaved;
  p.inverse = c.inverse;
  p.x_dtype = c.dtype;
  p.cs_dtype = c.cs_x ? c.dtype : DType::kFloat32;
  p.pos_int64 = c.pos64;
  return p;
}

using Kernel = void (*)(const RopeParams&, int64_t, int64_t);

// Runs `k` on copies of the inputs `x` (of type U) and returns the outputs.
template <class U>
Run<U> run(Kernel k, const Case& c, const Layout& lq, const Layout& lk, const Inputs& in,
           const std::vector<U> x[2], DType dtype) {
  Run<U> r;
  const Layout* ls[2] = {&lq, &lk};
  const void* xin[2];
  void* xout[2];
  for (int ti = 0; ti < 2; ++ti) {
    r.in[ti] = x[ti];
    xin[ti] = r.in[ti].data() + ls[ti]->off_in;
    if (c.inplace) {
      xout[ti] = r.in[ti].data() + ls[ti]->off_in;
    } else {
      r.out[ti].assign(ls[ti]->n_out, sentinel<U>());
      xout[ti] = r.out[ti].data() + ls[ti]->off_out;
    }
  }
  Case cc = c;
  cc.dtype = dtype;
  RopeParams p = make_params(cc, lq, lk, in, xin, xout);
  std::vector<int32_t> pos32(in.pos.begin(), in.pos.end());
  p.positions = c.pos64 ? static_cast<const void*>(in.pos.data()) : pos32.data();
  if (c.cs_x && dtype != c.dtype) std::abort();  // the fp32 rerun uses float32 cos/sin only
  // Two calls over split token ranges: begin/end are honoured.
  const int64_t mid = c.T / 2;
  k(p, 0, mid);
  k(p, mid, c.T);
  if (c.inplace)
    for (int ti = 0; ti < 2; ++ti) r.out[ti] = r.in[ti];
  return r;
}

struct Stats {
  int64_t compared = 0, differ = 0;
  double max_diff_eps = 0;  // |neon - scalar| / (eps * pair scale)
};
Stats g_stats[4];

template <class T>
std::string check(const Case& c, std::mt19937& rng) {
  const Layout lq = layout(c, 5), lk = layout(c, 2);
  const Inputs in = make_cache<T>(c, rng);
  const std::vector<T> x[2] = {make_input<T>(c, lq, rng), make_input<T>(c, lk, rng)};
  const Run<T> sc = run<T>(cpu::detail::rotate_tokens_scalar, c, lq, lk, in, x, c.dtype);
  const Run<T> ne = run<T>(cpu::detail::rotate_tokens_neon, c, lq, lk, in, x, c.dtype);

  // fp16 / bf16: NEON in fp32 on the widened inputs (out of place, same layout).
  constexpr bool kNarrow = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
  Run<float> wide;
  if (kNarrow && !c.cs_x) {
    std::vector<float> xf[2];
    for (int ti = 0; ti < 2; ++ti)
      for (const T& v : x[ti]) xf[ti].push_back(float(to_acc(v)));
    wide = run<float>(cpu::detail::rotate_tokens_neon, c, lq, lk, in, xf, DType::kFloat32);
  }

  char msg[512];
  const int h = c.r / 2;
  const double eps = Traits<T>::kEps, tiny = Traits<T>::kTiny;
  Stats& st = g_stats[int(c.dtype)];
  const Layout* ls[2] = {&lq, &lk};
  for (int ti = 0; ti < 2; ++ti) {
    const Layout& l = *ls[ti];
    const char* tn = ti ? "k" : "q";
    if (std::is_same_v<T, double>)
      for (size_t o = 0; o < l.n_out; ++o) {
        const T a = ne.out[ti][o], b = sc.out[ti][o];
        if (!same_bits(a, b) && !(std::isnan(val(a)) && std::isnan(val(b)))) {
          std::snprintf(msg, sizeof msg, "%s: float64 element %zu: NEON %a, scalar %a", tn, o,
                        val(a), val(b));
          return msg;
        }
      }
    // Gaps (and, in place, everything outside the heads) untouched.
    std::vector<bool> head_elem(l.n_out, false);
    for (int t = 0; t < c.T; ++t) {
      const int64_t pos = in.pos[t];
      const bool inside = pos >= 0 && pos < kRows;
      const char* row = in.cs.data() + size_t((pos + kGuard) * in.cs_stride) *
                                           (c.cs_x ? sizeof(T) : sizeof(float));
      for (int hd = 0; hd < l.H; ++hd) {
        const int64_t bi = l.off_in + (int64_t(t) * l.H + hd) * l.s_in;
        const int64_t bo = l.off_out + (int64_t(t) * l.H + hd) * l.s_out;
        for (int i = 0; i < c.D; ++i) head_elem[size_t(bo + i)] = true;
        // Pass-through features: copied or untouched.
        for (int i = c.r; i < c.D; ++i)
          if (!same_bits(ne.out[ti][size_t(bo + i)], x[ti][size_t(bi + i)])) {
            std::snprintf(msg, sizeof msg, "%s token %d head %d feature %d: pass-through changed",
                          tn, t, hd, i);
            return msg;
          }
        for (int j = 0; j < h; ++j) {
          int i1, i2;
          pair_index(c.interleaved, j, c.r, i1, i2);
          const int idx[2] = {i1, i2};
          const double x1 = val(x[ti][size_t(bi + i1)]), x2 = val(x[ti][size_t(bi + i2)]);
          double ref[2], ref_c = 0, ref_s = 0;
          if (inside) {
            double cv, sv;
            if (c.cs_x) {
              cv = val(reinterpret_cast<const T*>(row)[j]);
              sv = val(reinterpret_cast<const T*>(row)[h + j]);
            } else {
              cv = reinterpret_cast<const float*>(row)[j];
              sv = reinterpret_cast<const float*>(row)[h + j];
            }
            if (c.inverse) sv = -sv;
            ref_c = cv;
            ref_s = sv;
            ref[0] = x1 * cv - x2 * sv;
            ref[1] = x2 * cv + x1 * sv;
          } else {
            ref[0] = ref[1] = std::numeric_limits<double>::quiet_NaN();
          }
          // float32: one fused multiply-add onto the rounded product with s,
          // in the vector loops and in the tail alike.
          float fused[2] = {0, 0};
          if (std::is_same_v<T, float> && inside) {
            const float f1 = float(x1), f2 = float(x2), cf = float(ref_c), sf = float(ref_s);
            fused[0] = std::fma(f1, cf, f2 * -sf);
            fused[1] = std::fma(f2, cf, f1 * sf);
          }
          const double m = std::max(std::fabs(x1), std::fabs(x2));
          const bool finite_in = std::isfinite(x1) && std::isfinite(x2);
          for (int e = 0; e < 2; ++e) {
            const size_t o = size_t(bo + idx[e]);
            const double a = val(ne.out[ti][o]), b = val(sc.out[ti][o]);
            const char* what = nullptr;
            double diff = 0;
            if (!inside) {
              if (!std::isnan(a)) what = "token outside the cache not NaN";
            } else if (!std::isfinite(a) || !std::isfinite(b)) {
              if (!(std::isnan(a) && std::isnan(b)) && a != b)
                what = "non-finite differs from scalar";
              else if (finite_in && std::fabs(ref[e]) < 0.99 * Traits<T>::kMax)
                what = "non-finite from finite inputs";
            } else {
              diff = std::fabs(a - b);
              ++st.compared;
              if (diff != 0) ++st.differ;
              if (m > 0) st.max_diff_eps = std::max(st.max_diff_eps, diff / (eps * m));
              if (diff != 0)
                what = "NEON differs from scalar";
              else if (m == 0 && std::signbit(a) != std::signbit(b))
                what = "sign of zero (from zero inputs) differs from scalar";
              else if (finite_in && std::fabs(a - ref[e]) > 4 * eps * m + tiny)
                what = "NEON off the float64 reference by more than 4 eps";
            }
            if (!what && std::is_same_v<T, float> && inside) {
              const float got = float(a);
              if (std::isnan(got) ? !std::isnan(fused[e]) : !same_bits(got, fused[e])) {
                std::snprintf(msg, sizeof msg,
                              "%s token %d head %d feature %d: float32 %a, the AVX2 formula "
                              "gives %a",
                              tn, t, hd, idx[e], a, double(fused[e]));
                return msg;
              }
            }
            if (!what && kNarrow && !c.cs_x && inside) {
              // Rounding: the fp32 NEON result on the widened inputs, rounded by rope.h.
              const float w = wide.out[ti][o];
              const T want = Store<T>::from(w);
              const T got = ne.out[ti][o];
              if (std::isnan(w) ? !std::isnan(a) : !same_bits(want, got)) {
                std::snprintf(msg, sizeof msg,
                              "%s token %d head %d feature %d: fp32 %a rounds to %a, NEON "
                              "gave %a",
                              tn, t, hd, idx[e], double(w), val(want), a);
                return msg;
              }
            }
            if (what) {
              std::snprintf(msg, sizeof msg,
                            "%s token %d head %d feature %d: %s (x = %a, %a; neon %a, scalar %a, "
                            "ref %a)",
                            tn, t, hd, idx[e], what, x1, x2, a, b, ref[e]);
              return msg;
            }
          }
        }
      }
    }
    for (size_t o = 0; o < l.n_out; ++o)
      if (!head_elem[o] && !same_bits(ne.out[ti][o], c.inplace ? x[ti][o] : sentinel<T>())) {
        std::snprintf(msg, sizeof msg, "%s: element %zu outside the heads written", tn, o);
        return msg;
      }
  }
  return "";
}

}  // namespace

int main() {
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
  const int dims[][2] = {{128, 128}, {64, 64}, {96, 96}, {80, 40},
                         {256, 64},  {36, 36}, {6, 2},   {130, 130}};
  std::vector<Case> cases;
  unsigned seed = 1;
  for (DType dt : dtypes)
    for (int il = 0; il < 2; ++il)
      for (const auto& d : dims)
        for (int T : {1, 9})
          for (int inplace = 0; inplace < 2; ++inplace)
            for (int inv = 0; inv < 2; ++inv) {
              // The base case, then variants: strided heads, positions outside the
              // cache, NaN/inf inputs, cos/sin in x's dtype.
              const Case base{.dtype = dt,
                              .interleaved = bool(il),
                              .D = d[0],
                              .r = d[1],
                              .T = T,
                              .inplace = bool(inplace),
                              .inverse = bool(inv),
                              .strided = false,
                              .oob = false,
                              .pos64 = bool((T + inv) & 1),
                              .special = false,
                              .cs_x = false,
                              .seed = seed++};
              cases.push_back(base);
              if (inv) continue;
              Case v = base;
              v.strided = true;
              v.seed = seed++;
              cases.push_back(v);
              v = base;
              v.oob = true;
              v.pos64 = bool(inplace);  // both position dtypes
              v.seed = seed++;
              cases.push_back(v);
              if (T == 9) {
                v = base;
                v.special = true;
                v.pos64 = bool(inplace);
                v.seed = seed++;
                cases.push_back(v);
                v = base;
                v.strided = true;
                v.cs_x = true;
                v.pos64 = !v.pos64;
                v.seed = seed++;
                cases.push_back(v);
              }
            }

  int failures = 0;
  for (const Case& c : cases) {
    std::mt19937 rng(c.seed);
    std::string err;
    switch (c.dtype) {
      case DType::kFloat32:
        err = check<float>(c, rng);
        break;
      case DType::kFloat64:
        err = check<double>(c, rng);
        break;
      case DType::kFloat16:
        err = check<Half>(c, rng);
        break;
      case DType::kBFloat16:
        err = check<BFloat16>(c, rng);
        break;
    }
    if (!err.empty()) {
      ++failures;
      std::printf("FAIL %s: %s\n", name(c).c_str(), err.c_str());
    }
  }
  for (DType dt : dtypes) {
    const Stats& s = g_stats[int(dt)];
    std::printf("neon_check: %s: %" PRId64 " of %" PRId64
                " rotated outputs differ from scalar, at most %.3g eps x the pair's largest "
                "input\n",
                dtype_name(dt), s.differ, s.compared, s.max_diff_eps);
  }
  std::printf("neon_check: %zu cases, %d failures\n", cases.size(), failures);
  return failures ? 1 : 0;
}

#endif  // __aarch64__

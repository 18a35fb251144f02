// The table-free rows on the CPU (params.h AngleRows): every token's cos/sin
// row from its positions and the frequencies, with the per-pair function of
// angles.h (the GPU's and the tables'). Included by cpu/kernel.h, so each
// instruction set compiles its own copy. Torch-free.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "../angles.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

inline uint64_t bits_of(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}

// The cos and sin of n pairs, in a loop the compiler vectorizes (no branch, no
// library call, no aliasing).
inline void angle_pairs(int n, const double* __restrict pos, const double* __restrict freq,
                        const double* __restrict factor, double* __restrict c,
                        double* __restrict s) {
  for (int j = 0; j < n; ++j) angle_cos_sin(pos[j], freq[j], factor[j], c[j], s[j]);
}

// Rows of tokens [begin, end): per token, each pair's position (its axis's),
// then the cos and sin of the pairs whose position differs, bit for bit, from
// the previous token's (the same function of the same values gives the same
// bits): along a grid of positions (frame, row, column) most pairs carry over.
// The pairs to compute are gathered into a dense run for the vector loop.
// Returns the first token with a NaN in its row (no angle), or -1.
template <class Pos, class R>
int64_t angle_rows_impl(const AngleRows& ar, int64_t begin, int64_t end) {
  const RopeParams& p = ar.rope;
  const int h = p.rotary_dim / 2, n_axes = is_mrope(p) ? p.n_axes : 1;
  const size_t hs = static_cast<size_t>(h);
  std::vector<double> buf(9 * hs);
  double *pos = buf.data(), *last = pos + hs, *c = last + hs, *s = c + hs;
  double *gp = s + hs, *gf = gp + hs, *ga = gf + hs, *gc = ga + hs, *gs = gc + hs;
  std::vector<int> axis(hs), todo(hs);
  for (int j = 0; j < h; ++j) axis[j] = is_mrope(p) ? mrope_row(p, j) : 0;
  const double* freq = p.freqs;
  const double* factor = p.freqs + h;
  int64_t first_nan = -1;
  for (int64_t token = begin; token < end; ++token) {
    const int64_t off = token_offsets(p, token).pos;
    double at[kMaxAxes];
    for (int a = 0; a < n_axes; ++a) at[a] = position_value<Pos>(p, off + a * p.pos_section_stride);
    for (int j = 0; j < h; ++j) pos[j] = at[axis[j]];
    int n = 0;
    for (int j = 0; j < h; ++j)
      if (token == begin || bits_of(pos[j]) != bits_of(last[j])) todo[n++] = j;
    if (n == h) {
      angle_pairs(h, pos, freq, factor, c, s);
    } else if (n > 0) {
      for (int i = 0; i < n; ++i)
        gp[i] = pos[todo[i]], gf[i] = freq[todo[i]], ga[i] = factor[todo[i]];
      angle_pairs(n, gp, gf, ga, gc, gs);
      for (int i = 0; i < n; ++i) c[todo[i]] = gc[i], s[todo[i]] = gs[i];
    }
    std::swap(pos, last);
    R* row = static_cast<R*>(ar.rows) + token * p.rotary_dim;
    bool nan = false;
    for (int j = 0; j < h; ++j) {
      row[j] = R(c[j]);
      row[h + j] = R(s[j]);
      nan |= c[j] != c[j];
    }
    if (nan && first_nan < 0) first_nan = token;
    if (ar.index) ar.index[token] = token;
  }
  return first_nan;
}

inline int64_t angle_rows(const AngleRows& ar, int64_t begin, int64_t end) {
  int64_t first_nan = -1;
  dispatch_angle_rows(
      ar, [&]<class Pos, class R>() { first_nan = angle_rows_impl<Pos, R>(ar, begin, end); });
  return first_nan;
}

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

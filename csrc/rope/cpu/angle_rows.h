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

// Rows of tokens [begin, end): per token, the cos and sin of the pairs whose
// position differs, bit for bit, from the previous token's (the same function
// of the same values gives the same bits): along a grid of positions (frame,
// row, column) most pairs carry over. Pairs come in runs of one axis (one run
// per axis for contiguous sections, one for a single position); a run whose
// axis moved is computed whole. Many short runs (interleaved sections) are
// gathered pair by pair into one dense run instead. Returns the first token
// with a NaN in its row (no angle), or -1.
template <class Pos, class R>
int64_t angle_rows_impl(const AngleRows& ar, int64_t begin, int64_t end) {
  const RopeParams& p = ar.rope;
  const int h = p.rotary_dim / 2, n_axes = is_mrope(p) ? p.n_axes : 1;
  const size_t hs = static_cast<size_t>(h);
  std::vector<double> buf(8 * hs);
  double *pos = buf.data(), *c = pos + hs, *s = c + hs;
  double *gp = s + hs, *gf = gp + hs, *ga = gf + hs, *gc = ga + hs, *gs = gc + hs;
  std::vector<int> axis(hs), todo(hs), run_start;
  for (int j = 0; j < h; ++j) {
    axis[j] = is_mrope(p) ? mrope_row(p, j) : 0;
    if (j == 0 || axis[j] != axis[j - 1]) run_start.push_back(j);
  }
  run_start.push_back(h);
  const int n_runs = int(run_start.size()) - 1;
  const bool by_runs = n_runs <= n_axes;
  const double* freq = p.freqs;
  const double* factor = p.freqs + h;
  uint64_t last[kMaxAxes] = {};
  int64_t first_nan = -1;
  for (int64_t token = begin; token < end; ++token) {
    const int64_t off = token_offsets(p, token).pos;
    double at[kMaxAxes];
    bool moved[kMaxAxes];
    for (int a = 0; a < n_axes; ++a) {
      at[a] = position_value<Pos>(p, off + a * p.pos_section_stride);
      moved[a] = token == begin || bits_of(at[a]) != last[a];
      last[a] = bits_of(at[a]);
    }
    if (by_runs) {
      for (int r = 0; r < n_runs; ++r) {
        const int j0 = run_start[r], n = run_start[r + 1] - j0, a = axis[j0];
        if (!moved[a]) continue;
        std::fill(pos + j0, pos + j0 + n, at[a]);
        angle_pairs(n, pos + j0, freq + j0, factor + j0, c + j0, s + j0);
      }
    } else {
      int n = 0;
      for (int j = 0; j < h; ++j)
        if (moved[axis[j]]) todo[n++] = j;
      for (int i = 0; i < n; ++i)
        gp[i] = at[axis[todo[i]]], gf[i] = freq[todo[i]], ga[i] = factor[todo[i]];
      angle_pairs(n, gp, gf, ga, gc, gs);
      for (int i = 0; i < n; ++i) c[todo[i]] = gc[i], s[todo[i]] = gs[i];
    }
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

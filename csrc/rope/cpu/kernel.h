// CPU rotary kernel internals: the token loop, shared by the portable build
// (cpu/kernel.cpp) and the vector builds (cpu/avx2.cpp, cpu/avx512*.cpp,
// cpu/neon.cpp). Torch-free.
//
// Everything defined here lives in rope::ROPE_ISA (see rope.h): each
// instruction set compiles its own copy under its own names.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "../rope.h"
#include "cpu.h"

namespace rope {
namespace cpu {
namespace detail {
// The vector builds, one translation unit each, compiled for their own
// instruction set: call one only when this CPU supports it (cpu/kernel.cpp
// checks). On another architecture their files compile to nothing and these
// are not defined.
void rotate_tokens_avx2(const RopeParams& p, int64_t begin, int64_t end);
void rotate_tokens_avx512(const RopeParams& p, int64_t begin, int64_t end);
void rotate_tokens_avx512_bf16(const RopeParams& p, int64_t begin, int64_t end);
void rotate_tokens_neon(const RopeParams& p, int64_t begin, int64_t end);
// The portable build.
void rotate_tokens_scalar(const RopeParams& p, int64_t begin, int64_t end);
// The fused QK-RMSNorm + rotary (cpu/qk_norm.h): portable, AVX2 and AVX-512 builds.
void norm_rotate_tokens_scalar(const NormParams& np, int64_t begin, int64_t end);
void norm_rotate_tokens_avx2(const NormParams& np, int64_t begin, int64_t end);
void norm_rotate_tokens_avx512(const NormParams& np, int64_t begin, int64_t end);
void norm_rotate_tokens_avx512_bf16(const NormParams& np, int64_t begin, int64_t end);
// The table-free rows (angle_rows_impl): portable, AVX2 and AVX-512 builds.
int64_t angle_rows_scalar(const AngleRows& ar, int64_t begin, int64_t end);
int64_t angle_rows_avx2(const AngleRows& ar, int64_t begin, int64_t end);
int64_t angle_rows_avx512(const AngleRows& ar, int64_t begin, int64_t end);
}  // namespace detail
}  // namespace cpu

inline namespace ROPE_ISA {
namespace host {

// Table of ScalarHead: built per token from one cos/sin row (layout below).
struct ScalarTable {
  // Floats of table per rotary feature: the table has kTabPerFeature * rotary_dim entries.
  static constexpr int kTabPerFeature = 2;

  // Fills tab from `row` (cos half, then sin half); sin is multiplied by `sign`.
  template <class T, class CS, bool Interleaved, class A>
  static void build_table(const CS* row, A sign, A* tab, int r) {
    const int h = r / 2;
    for (int j = 0; j < h; ++j) {
      const A c = A(to_acc(row[j]));
      const A s = sign * A(to_acc(row[h + j]));
      if (Interleaved) {
        tab[2 * j] = tab[2 * j + 1] = c;
        tab[r + 2 * j] = -s;
        tab[r + 2 * j + 1] = s;
      } else {
        tab[j] = c;
        tab[h + j] = s;
      }
    }
  }
};

// Portable rotation of one head; `tab` holds, per token,
//   half-split:  c[0..h), s[0..h)                       (h = rotary_dim/2)
//   interleaved: c duplicated per element [0..r), then (-s, +s) per pair [r..2r)
// with the sign of s already flipped for the inverse rotation.
struct ScalarHead : ScalarTable {
  template <class T, bool Interleaved, class A>
  static void rotate(const T* in, T* out, const A* tab, int r, int D, bool copy_pass,
                     int j_begin = 0) {
    const int h = r / 2;
    for (int j = j_begin; j < h; ++j) {
      int i1, i2;
      pair_index(Interleaved, j, r, i1, i2);
      const A c = Interleaved ? tab[2 * j] : tab[j];
      const A s = Interleaved ? tab[r + 2 * j + 1] : tab[h + j];
      A y1, y2;
      rotate_pair<A>(to_acc(in[i1]), to_acc(in[i2]), c, s, y1, y2);
      out[i1] = Store<T>::from(y1);
      out[i2] = Store<T>::from(y2);
    }
    if (copy_pass && D > r) std::memcpy(out + r, in + r, sizeof(T) * size_t(D - r));
  }
};

// Software prefetch of a head loop (cpu.h, prefetch_distance): before head i
// of a token's n heads (at `in`, stride si) is read, head i + d is hinted into
// L1 (or L2 when l2: cpu.h, prefetch_level), or past the token's last head, head i + d - n of the
// next token's (at `next`; nullptr for the last token of the call). So every hinted line is one the
// loop reads next, and none lies outside the tensor. d = 0: no hints.
template <class T>
struct Ahead {
  const T* next = nullptr;
  int64_t d = 0;  // at most n
  bool l2 = false;

  // The head that head i hints (nullptr: none).
  constexpr const T* target(const T* in, int64_t i, int64_t n, int64_t si) const {
    if (d == 0) return nullptr;
    return i + d < n ? in + (i + d) * si : next ? next + (i + d - n) * si : nullptr;
  }
  // The hint of head i: the `bytes` bytes from the first element of its target.
  __attribute__((always_inline)) void hint(const T* in, int64_t i, int64_t n, int64_t si,
                                           int64_t bytes) const {
    if (const T* h = target(in, i, n, si))
      for (int64_t x = 0; x < bytes; x += 64) line(reinterpret_cast<const char*>(h) + x);
  }
  // The same for heads of Bytes bytes (the unrolled head loops).
  template <int Bytes>
  __attribute__((always_inline)) void hint(const T* in, int64_t i, int64_t n, int64_t si) const {
    if (const T* h = target(in, i, n, si)) {
#pragma GCC unroll 16
      for (int x = 0; x < Bytes; x += 64) line(reinterpret_cast<const char*>(h) + x);
    }
  }
  // One line's hint: prefetcht0 or prefetcht1.
  __attribute__((always_inline)) void line(const char* a) const {
    if (l2)
      __builtin_prefetch(a, 0, 2);
    else
      __builtin_prefetch(a, 0, 3);
  }
};

// Two tokens of three heads (stride 2) one after the other: head i of the
// first hints head i + d of the pair, for every d up to n (a pointer outside
// the array would not compile here); the last token hints only its own heads.
static_assert([] {
  int heads[12] = {};
  for (int64_t d = 1; d <= 3; ++d)
    for (int64_t i = 0; i < 3; ++i) {
      if (Ahead<int>{heads + 6, d}.target(heads, i, 3, 2) != heads + 2 * (i + d)) return false;
      const int* last = Ahead<int>{nullptr, d}.target(heads + 6, i, 3, 2);
      if (last != (i + d < 3 ? heads + 6 + 2 * (i + d) : nullptr)) return false;
    }
  return Ahead<int>{heads + 6, 0}.target(heads, 0, 3, 2) == nullptr;
}());

// The heads a head loop of the call `p` hints ahead (Ahead::d) for heads of
// `head_bytes` bytes: none for a call that does not hint (cpu.h, hints), else
// prefetch_distance() in whole heads.
inline int64_t heads_ahead(const RopeParams& p, int64_t head_bytes) {
  if (!cpu::hints(p, head_bytes)) return 0;
  return (cpu::prefetch_distance() + head_bytes - 1) / head_bytes;
}

// Offsets of the heads of one tensor, walked in order without divisions.
struct HeadWalker {
  const RotTensor& t;
  int64_t idx[kMaxDims] = {};
  int64_t in = 0, out = 0;

  explicit HeadWalker(const RotTensor& t_) : t(t_) {}
  // Moves to the next head (odometer over the head dims, innermost last).
  void next() {
    for (int d = t.n_head_dims - 1; d >= 0; --d) {
      in += t.in_head_stride[d];
      out += t.out_head_stride[d];
      if (++idx[d] < t.head_size[d]) return;
      in -= t.in_head_stride[d] * t.head_size[d];
      out -= t.out_head_stride[d] * t.head_size[d];
      idx[d] = 0;
    }
  }
};

// The cos/sin table of one token for Head (its layout: Head::build_table):
// per token, one position and one cos/sin row are read (MRoPE: three
// positions, each pair from the row of its section), with the sign of sin
// flipped for the inverse rotation.
template <class T, class CS, class Pos, bool Interleaved, class Head>
class TokenTable {
 public:
  using A = typename Acc<T>::type;

  explicit TokenTable(const RopeParams& p)
      : p_(p),
        tab_(size_t(Head::kTabPerFeature) * size_t(p.rotary_dim)),
        mrope_(is_mrope(p)),
        merged_(mrope_ ? size_t(p.rotary_dim) : 0),
        section_(mrope_ ? size_t(p.rotary_dim / 2) : 0) {
    for (size_t j = 0; j < section_.size(); ++j) section_[j] = uint8_t(mrope_row(p, int(j)));
  }

  // The table of the token at offsets o.
  const A* build(const TokenOffsets& o) {
    const RopeParams& p = p_;
    const int r = p.rotary_dim;
    const CS* cs = static_cast<const CS*>(p.cos_sin);
    const A sign = p.inverse ? A(-1) : A(1);
    A* tab = tab_.data();
    if (mrope_) {
      // Each pair from the row of its section's position (NaN where that is
      // outside the cache), then the table as usual.
      const int h = r / 2;
      const int n = p.n_axes;
      const CS* rows[kMaxAxes];
      bool all_in = true, all_equal = true;
      for (int s = 0; s < n; ++s) {
        const int64_t ps = load_position<Pos>(p, o.pos + s * p.pos_section_stride);
        rows[s] = position_in_cache(p, ps) ? cs + ps * p.cs_row_stride : nullptr;
        all_in = all_in && rows[s];
        all_equal = all_equal && rows[s] == rows[0];
      }
      // Text tokens (equal positions on every axis) take the plain table; a
      // head type may build the others' from the axes' rows directly, or else
      // from the merged row.
      bool built = all_in && all_equal;
      if (built) {
        Head::template build_table<T, CS, Interleaved, A>(rows[0], sign, tab, r);
      } else if constexpr (requires {
                             Head::template build_table_mrope<T, CS, Interleaved, A>(
                                 rows, n, section_.data(), sign, tab, r);
                           }) {
        built = all_in && Head::template build_table_mrope<T, CS, Interleaved, A>(
                              rows, n, section_.data(), sign, tab, r);
      }
      if (!built) {
        CS* m = merged_.data();
        if (all_in && p.axis_layout == AxisLayout::kContiguous) {
          // Contiguous sections: one run of pairs per axis, cos and sin halves each.
          for (int s = 0, j0 = 0; s < n; j0 += p.mrope_section[s++]) {
            const CS* row = rows[s];
            for (int j = j0; j < j0 + p.mrope_section[s]; ++j) {
              m[j] = row[j];
              m[h + j] = row[h + j];
            }
          }
        } else {
          for (int j = 0; j < h; ++j) {
            const CS* row = rows[section_[j]];
            const CS nan = Store<CS>::from(std::numeric_limits<float>::quiet_NaN());
            m[j] = row ? row[j] : nan;
            m[h + j] = row ? row[h + j] : nan;
          }
        }
        Head::template build_table<T, CS, Interleaved, A>(m, sign, tab, r);
      }
    } else if (const int64_t pos = load_position<Pos>(p, o.pos); !position_in_cache(p, pos)) {
      // Never read outside the cache: the rotated features become NaN.
      std::fill(tab_.begin(), tab_.end(), std::numeric_limits<A>::quiet_NaN());
    } else {
      Head::template build_table<T, CS, Interleaved, A>(cs + pos * p.cs_row_stride, sign, tab, r);
    }
    return tab;
  }

 private:
  const RopeParams& p_;
  std::vector<A> tab_;
  bool mrope_;
  std::vector<CS> merged_;        // MRoPE: the token's cos/sin row, pair by pair
  std::vector<uint8_t> section_;  // MRoPE: the section of each pair
};

// Rotates tokens [begin, end): per token, the table (TokenTable), then every
// head of q and k is rotated with it by Head::rotate.
template <class T, class CS, class Pos, bool Interleaved, class Head>
void rotate_tokens_impl(const RopeParams& p, int64_t begin, int64_t end) {
  using A = typename Acc<T>::type;
  const int r = p.rotary_dim;
  const int off = p.rot_offset;
  const int D = p.head_dim - off;  // features from the first rotated one to the end
  TokenTable<T, CS, Pos, Interleaved, Head> table(p);
  const int64_t head_bytes = int64_t(D) * int64_t(sizeof(T));
  const int64_t ahead = heads_ahead(p, head_bytes);
  const bool l2 = cpu::prefetch_level() == 2;

  for (int64_t token = begin; token < end; ++token) {
    TokenOffsets o = token_offsets(p, token);
    if (p.tok_rows) o.in[0] = o.out[0] = p.tok_rows[token];
    TokenOffsets next{};                                    // the next token's, for the prefetch
    const bool has_next = ahead && token + 1 < p.n_tokens;  // (maybe another thread's)
    if (has_next) {
      next = token_offsets(p, token + 1);
      if (p.tok_rows) next.in[0] = p.tok_rows[token + 1];
    }
    const A* tab = table.build(o);
    for (int ti = 0; ti < p.n_tensors; ++ti) {
      const RotTensor& t = p.t[ti];
      // Heads are addressed from their first rotated feature; features before
      // it (rot_offset > 0) are copied after the rotation.
      const T* in = static_cast<const T*>(t.in) + o.in[ti] + off;
      T* out = static_cast<T*>(t.out) + o.out[ti] + off;
      const bool copy_pass = t.copy_pass;
      if (t.n_head_dims <= 1) {
        const int64_t si = t.n_head_dims ? t.in_head_stride[0] : 0;
        const int64_t so = t.n_head_dims ? t.out_head_stride[0] : 0;
        const Ahead<T> pf{has_next ? static_cast<const T*>(t.in) + next.in[ti] + off : nullptr,
                          std::min(ahead, t.n_heads), l2};
        if constexpr (requires {
                        Head::template rotate_heads<T, Interleaved, A>(in, out, si, so, int64_t{},
                                                                       tab, D, copy_pass, pf);
                      }) {
          // A head type that keeps the table in registers across the heads.
          Head::template rotate_heads<T, Interleaved, A>(in, out, si, so, t.n_heads, tab, D,
                                                         copy_pass, pf);
        } else {
          for (int64_t head = 0; head < t.n_heads; ++head) {
            pf.hint(in, head, t.n_heads, si, head_bytes);
            Head::template rotate<T, Interleaved, A>(in + head * si, out + head * so, tab, r, D,
                                                     copy_pass);
          }
        }
      } else {
        HeadWalker w(t);
        for (int64_t head = 0; head < t.n_heads; ++head, w.next())
          Head::template rotate<T, Interleaved, A>(in + w.in, out + w.out, tab, r, D, copy_pass);
      }
      if (copy_pass && off > 0) {
        HeadWalker w(t);
        for (int64_t head = 0; head < t.n_heads; ++head, w.next())
          std::memcpy(out - off + w.out, in - off + w.in, sizeof(T) * size_t(off));
      }
    }
  }
}

// rotate_tokens_impl with the head type Head<R> of a vector build: the rotary
// dims of most models (64, 128) get fully unrolled head loops, others Head<0>.
template <template <int> class Head>
void rotate_tokens_unrolled(const RopeParams& p, int64_t begin, int64_t end) {
  dispatch_types(p, [&]<class T, class CS, class Pos, bool IL>() {
    switch (p.rotary_dim) {
      case 64:
        return rotate_tokens_impl<T, CS, Pos, IL, Head<64>>(p, begin, end);
      case 128:
        return rotate_tokens_impl<T, CS, Pos, IL, Head<128>>(p, begin, end);
      default:
        return rotate_tokens_impl<T, CS, Pos, IL, Head<0>>(p, begin, end);
    }
  });
}

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

#include "angle_rows.h"

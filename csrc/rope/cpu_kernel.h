// CPU rotary kernel: the token loop, shared by the portable build and the
// AVX2 build. Torch-free; the caller splits tokens over threads.
#pragma once

#include <limits>
#include <vector>

#include "rope.h"

namespace rope {
namespace cpu {

// Rotates tokens [begin, end) of every tensor in `p`, dispatching on dtypes,
// pairing and the instruction set of this machine.
void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end);

// Instruction set used by rotate_tokens on this machine: "avx2" or "scalar".
const char* isa();

namespace detail {

// Portable rotation of one head; `tab` holds, per token,
//   half-split:  c[0..h), s[0..h)                       (h = rotary_dim/2)
//   interleaved: c duplicated per element [0..r), then (-s, +s) per pair [r..2r)
// with the sign of s already flipped for the inverse rotation.
struct ScalarHead {
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

template <class T, class CS, class Pos, bool Interleaved, class Head>
void rotate_tokens_impl(const RopeParams& p, int64_t begin, int64_t end) {
  using A = typename Acc<T>::type;
  const int r = p.rotary_dim;
  const int h = r / 2;
  const int D = p.head_dim;
  std::vector<A> tab(2 * size_t(r));
  const CS* cs = static_cast<const CS*>(p.cos_sin);
  const A sign = p.inverse ? A(-1) : A(1);

  for (int64_t token = begin; token < end; ++token) {
    const TokenOffsets o = token_offsets(p, token);
    const int64_t pos = load_position<Pos>(p, o.pos);
    if (!position_in_cache(p, pos)) {
      // Never read outside the cache: the rotated features become NaN.
      std::fill(tab.begin(), tab.end(), std::numeric_limits<A>::quiet_NaN());
    } else {
      const CS* row = cs + pos * p.cs_row_stride;
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
    for (int ti = 0; ti < p.n_tensors; ++ti) {
      const RotTensor& t = p.t[ti];
      const T* in = static_cast<const T*>(t.in) + o.in[ti];
      T* out = static_cast<T*>(t.out) + o.out[ti];
      const bool copy_pass = t.in != t.out;
      for (int64_t head = 0; head < t.n_heads; ++head) {
        int64_t hin, hout;
        head_offsets(t, head, hin, hout);
        Head::template rotate<T, Interleaved, A>(in + hin, out + hout, tab.data(), r, D, copy_pass);
      }
    }
  }
}

void rotate_tokens_avx2(const RopeParams& p, int64_t begin, int64_t end);
bool avx2_supported();

}  // namespace detail
}  // namespace cpu
}  // namespace rope

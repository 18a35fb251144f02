// CPU kernel of the fused QK-RMSNorm + rotary: the token loop and the
// portable head, shared by the portable build (cpu/kernel.cpp), the AVX2
// build (cpu/avx2.cpp) and the AVX-512 builds (cpu/avx512_norm.h), whose head
// types vectorize the same steps. Per token,
// the RMSNorm scale of each head (sum of squares), then one pass per head:
// every feature normalised (x * rms * w, rounded to the storage type) and, for
// the rotary features, rotated in registers before the one store. Torch-free.
//
// Every instruction set computes the same normalised values, bit for bit: the
// sum of squares runs in 16 fixed lanes (lane k takes features i = k mod 16,
// in order; the lanes are then added as lane_total's tree), products are not
// fused, and (x * rms) * w is rounded to nearest even. Only the rotation
// itself may fuse its multiply-adds, as in rotate_tokens.
#pragma once

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "../serving.h"
#include "kernel.h"

namespace rope {
inline namespace ROPE_ISA {
namespace host {

constexpr int kNormLanes = 16;

// The sum of the 16 lanes as a tree: lane k + lane k + 8, then k + 4, k + 2,
// k + 1 (the vector builds add whole vectors in the same order).
template <class A>
A lane_total(const A (&part)[kNormLanes]) {
  A t[8];
  for (int k = 0; k < 8; ++k) t[k] = part[k] + part[k + 8];
  for (int k = 0; k < 4; ++k) t[k] = t[k] + t[k + 4];
  for (int k = 0; k < 2; ++k) t[k] = t[k] + t[k + 2];
  return t[0] + t[1];
}

// weight + weight_offset of q or k, as A, for each feature of a head (`w`),
// and a copy of the rotated features' weights in the lane order of the head
// type's vector loads (`rot`, Head::weights_in_lane_order; unused by the
// portable head).
template <class A>
struct NormWeights {
  A w[kMaxNormHeadDim];
  A rot[kMaxNormHeadDim];
};

// out[i] = w[i] + offset for i < n, as A, every NaN the canonical one (the
// same NaN for every instruction set).
template <class A>
void load_weights(const void* w, DType t, A offset, A* out, int n) {
  auto load = [&](auto* p) {
    for (int i = 0; i < n; ++i) {
      const A v = A(to_acc(p[i])) + offset;
      out[i] = v == v ? v : std::numeric_limits<A>::quiet_NaN();
    }
  };
  switch (t) {
    case DType::kFloat32:
      return load(static_cast<const float*>(w));
    case DType::kFloat64:
      return load(static_cast<const double*>(w));
    case DType::kFloat16:
      return load(static_cast<const Half*>(w));
    case DType::kBFloat16:
      return load(static_cast<const BFloat16*>(w));
  }
}

// x * rms * w rounded to T, back in the arithmetic type.
template <class T, class A>
inline A normed(T x, A rms, A w) {
  return A(to_acc(Store<T>::from(to_acc(x) * rms * w)));
}

// Pairs [j_begin, r/2) of a head: normalised, rotated, stored. `tab` in
// ScalarHead's layout (every head type's table starts with it); in and out
// point at the head's first feature, the rotated features start at `off`.
template <class T, bool Interleaved, class A>
inline void norm_rotate_pairs(const T* in, T* out, const A* w, A rms, const A* tab, int r, int off,
                              int j_begin) {
  const int h = r / 2;
  for (int j = j_begin; j < h; ++j) {
    int i1, i2;
    pair_index(Interleaved, j, r, i1, i2);
    i1 += off;
    i2 += off;
    const A c = Interleaved ? tab[2 * j] : tab[j];
    const A s = Interleaved ? tab[r + 2 * j + 1] : tab[h + j];
    A y1, y2;
    rotate_pair<A>(normed(in[i1], rms, w[i1]), normed(in[i2], rms, w[i2]), c, s, y1, y2);
    out[i1] = Store<T>::from(y1);
    out[i2] = Store<T>::from(y2);
  }
}

// Features [begin, end) of a head that are not rotated: normalised and stored.
template <class T, class A>
inline void norm_pass(const T* in, T* out, const A* w, A rms, int begin, int end) {
  for (int i = begin; i < end; ++i) out[i] = Store<T>::from(to_acc(in[i]) * rms * w[i]);
}

// The portable head: norm_scale gives a head's RMSNorm scale, norm_rotate
// normalises and rotates the head with it (two steps: see the token loop).
struct PortableNorm {
  template <class T, class A>
  static A norm_scale(const T* in, int D, double eps) {
    A part[kNormLanes] = {};
    for (int i = 0; i < D; i += kNormLanes)
      for (int k = 0; k < kNormLanes && i + k < D; ++k) {
        const A v = to_acc(in[i + k]);
        part[k] += v * v;
      }
    return rms_inverse<A>(lane_total(part), D, eps);
  }

  template <class T, bool Interleaved, class A>
  static void norm_rotate(const T* in, T* out, const NormWeights<A>& nw, const A* tab, int r,
                          int off, int D, A rms) {
    norm_pass<T, A>(in, out, nw.w, rms, 0, off);
    norm_rotate_pairs<T, Interleaved, A>(in, out, nw.w, rms, tab, r, off, 0);
    norm_pass<T, A>(in, out, nw.w, rms, off + r, D);
  }
};

// QK-RMSNorm + rotary of tokens [begin, end) of np: per token the table
// (TokenTable of Head), then each head of q and k by the head type's
// norm_scale and norm_rotate when it has them, else by PortableNorm's (and
// the scales eight heads at a time by its norm_scales8, when it has one).
template <class T, class CS, class Pos, bool Interleaved, class Head>
void norm_rotate_tokens_impl(const NormParams& np, int64_t begin, int64_t end) {
  using A = typename Acc<T>::type;
  const RopeParams& p = np.rope;
  const int D = p.head_dim, r = p.rotary_dim, off = p.rot_offset;
  NormWeights<A> nw[2];
  for (int t = 0; t < 2; ++t) {
    load_weights(np.weight[t], np.w_dtype[t], A(np.weight_offset), nw[t].w, D);
    if constexpr (requires {
                    Head::template weights_in_lane_order<T, Interleaved, A>(nw[t], r, off);
                  })
      Head::template weights_in_lane_order<T, Interleaved, A>(nw[t], r, off);
  }
  // The head type's norm_scale / norm_rotate, or the portable ones.
  using N = std::conditional_t<requires(const T* x) { Head::template norm_scale<T, A>(x, 0, 0.0); },
                               Head, PortableNorm>;
  TokenTable<T, CS, Pos, Interleaved, Head> table(p);
  std::vector<A> scales(size_t(std::max(p.t[0].n_heads, p.t[1].n_heads)));
  const int64_t head_bytes = int64_t(D) * int64_t(sizeof(T));
  const int64_t ahead = heads_ahead(p, head_bytes);  // the prefetch (Ahead)
  const bool l2 = cpu::prefetch_level() == 2;
  for (int64_t token = begin; token < end; ++token) {
    const TokenOffsets o = token_offsets(p, token);
    const bool has_next = ahead && token + 1 < p.n_tokens;
    const TokenOffsets next = has_next ? token_offsets(p, token + 1) : TokenOffsets{};
    const A* tab = table.build(o);
    for (int t = 0; t < 2; ++t) {
      const int64_t n = p.t[t].n_heads;
      const T* in = static_cast<const T*>(p.t[t].in) + o.in[t];
      T* out = static_cast<T*>(p.t[t].out) + o.out[t];
      // The hints of a tensor with at most one head dim (heads at in + i * si).
      const bool flat = p.t[t].n_head_dims <= 1;
      const int64_t si = p.t[t].n_head_dims ? p.t[t].in_head_stride[0] : 0;
      const Ahead<T> pf{has_next ? static_cast<const T*>(p.t[t].in) + next.in[t] : nullptr,
                        flat ? std::min(ahead, n) : 0, l2};
      // The scales of all the token's heads first: independent chains of
      // dependent operations, which the CPU overlaps (head by head, each
      // chain would stall the rotation that needs it).
      if constexpr (requires {
                      Head::template norm_heads<T, Interleaved, A>(in, out, int64_t{}, int64_t{},
                                                                   int64_t{}, nw[t], tab, 0.0, pf);
                    }) {
        // A head type that does each whole head in one pass, in registers.
        if (r == D && flat) {
          const int64_t so = p.t[t].n_head_dims ? p.t[t].out_head_stride[0] : 0;
          Head::template norm_heads<T, Interleaved, A>(in, out, si, so, n, nw[t], tab, np.eps, pf);
          continue;
        }
      }
      HeadWalker w(p.t[t]);
      int64_t head = 0;
      if constexpr (requires(const T* const* x, A* s) { N::norm_scales8(x, 0, 0.0, s); }) {
        if (D % 16 == 0)
          for (; head + 8 <= n; head += 8) {
            const T* heads[8];
            for (int k = 0; k < 8; ++k, w.next()) {
              heads[k] = in + w.in;
              pf.hint(in, head + k, n, si, head_bytes);
            }
            N::norm_scales8(heads, D, np.eps, &scales[size_t(head)]);
          }
      }
      for (; head < n; ++head, w.next()) {
        pf.hint(in, head, n, si, head_bytes);
        scales[size_t(head)] = N::template norm_scale<T, A>(in + w.in, D, np.eps);
      }
      HeadWalker v(p.t[t]);
      for (int64_t head = 0; head < n; ++head, v.next())
        N::template norm_rotate<T, Interleaved, A>(in + v.in, out + v.out, nw[t], tab, r, off, D,
                                                   scales[size_t(head)]);
    }
  }
}

}  // namespace host
}  // namespace ROPE_ISA
}  // namespace rope

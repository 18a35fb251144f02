// CUDA bodies of the serving ops, torch-free, in the style of cuda/rotary.cuh:
// a launch plan chosen on the host and host-device functions that one thread
// (or one warp, in phases) runs. cuda/cache_launch.cu and cuda/norm_launch.cu wrap them in
// __global__ kernels; csrc/ops/emulated/ runs them on the CPU over the same grid.
//
// RoPE + KV-cache write (cache_thread): the rotary tile of rotary_thread (a
// block per token, lanes over units of a head, rows over heads) with the rows
// running over the q heads, then the k heads, then the v heads. A k lane
// stores its rotated unit both in k and in the key cache; a v lane copies its
// unit of v to the value cache. One launch for q, k and v.
//
// QK-RMSNorm + rotary (norm_phase1 / norm_phase2): a group of lanes per
// (token, head), as many lanes as the head has units (at most 32), so a warp
// holds 32 / group heads and no lane idles for D = 64-512. Phase 1: each lane
// sums the squares of its units. The group's partial sums meet in shared
// memory and every lane adds them in the same fixed order (group_total), so
// the GPU and the host emulation compute the same norm. Phase 2: each lane
// reads its units again (its own bytes, from L1), normalises, scales, rounds
// to the activation dtype, rotates and stores them. Nothing is kept between
// the phases but the sum, so no head size costs registers.
#pragma once

#include "../serving.h"
#include "rotary.cuh"

namespace rope {
namespace gpu {

// ---------------------------------------------------------------------------
// RoPE + KV-cache write.

struct CacheLaunch {
  Launch grid;        // the tile (grid_x/y, block_x/y), n_rot_units, n_pass_units, vectorized
  int64_t n_v_units;  // units of vec_width features of a v head
};

// Whether the 16-byte path is aligned for every tensor the cache op touches.
inline bool can_vectorize_cache(const CacheParams& cp) {
  RopeParams p = cp.rope;
  p.t[1].copy_pass = true;  // k's pass-through features are read for the cache
  if (!can_vectorize(p)) return false;
  const int64_t V = 16 / dtype_size(p.x_dtype);
  if (cp.k_rot_offset % V != 0 || (cp.k_dim - p.rotary_dim) % V != 0) return false;
  if (p.n_tokens == 0) return true;
  if (cp.v_dim % V != 0) return false;
  if (cp.n_kv_heads > 0 && cp.v_dim > 0) {
    if (reinterpret_cast<uintptr_t>(cp.v) % 16 || cp.v_tok_stride % V || cp.v_head_stride % V)
      return false;
  }
  if (cp.cache_fp8 == Fp8::kNone) {
    for (const PagedCache* c : {&cp.key_cache, &cp.value_cache})
      if (reinterpret_cast<uintptr_t>(c->data) % 16 || c->block_stride % V || c->row_stride % V ||
          c->head_stride % V)
        return false;
  }
  return true;
}

inline CacheLaunch plan_cache_launch(const CacheParams& cp, int64_t num_sms,
                                     bool force_scalar = false) {
  const RopeParams& p = cp.rope;
  CacheLaunch l{};
  l.grid.vectorized = !force_scalar && can_vectorize_cache(cp);
  const int64_t v = l.grid.vectorized ? 16 / dtype_size(p.x_dtype) : 1;
  const int64_t ppu = p.interleaved ? (v > 1 ? v / 2 : 1) : v;
  l.grid.n_rot_units = (p.rotary_dim / 2) / ppu;
  // Pass-through units: as many as the tensor (q or k) with the most.
  const int64_t pass = p.head_dim > cp.k_dim ? p.head_dim : cp.k_dim;
  l.grid.n_pass_units = (pass - p.rotary_dim) / v;
  l.n_v_units = cp.v_dim / v;
  const int64_t qk_lanes = l.grid.n_rot_units + l.grid.n_pass_units;
  const int64_t lanes = qk_lanes > l.n_v_units ? qk_lanes : l.n_v_units;
  shape_grid(l.grid, lanes, p.t[0].n_heads + 2 * cp.n_kv_heads, p.n_tokens, num_sms);
  return l;
}

// Whether any of q, k and v has a head to rotate or copy (q alone when k and v have
// no heads). No token: the empty token dim of q and k makes their head counts 0.
inline bool cache_has_work(const CacheParams& cp, const CacheLaunch& l) {
  return cp.rope.n_tokens > 0 && l.grid.block_x > 0 &&
         cp.rope.t[0].n_heads + cp.rope.t[1].n_heads + cp.n_kv_heads > 0;
}

// Stores N values of T as fp8 bits (element by element).
template <class T, int N>
ROPE_HD void store_fp8(uint8_t* dst, const T (&x)[N], float scale, Fp8 t) {
  note_write(dst, N);
  ROPE_UNROLL
  for (int i = 0; i < N; ++i) dst[i] = quantize_fp8(float(to_acc(x[i])), scale, t);
}

// Stores N values of (slot, head) at feature f of a cache of T or fp8.
template <bool Vectorized, class T, int N>
ROPE_HD void store_cache(const CacheParams& cp, const PagedCache& c, float scale, int64_t row,
                         int64_t head, int64_t f, const T (&x)[N]) {
  const int64_t off = row + head * c.head_stride + f;
  if (cp.cache_fp8 != Fp8::kNone)
    store_fp8(static_cast<uint8_t*>(c.data) + off, x, scale, cp.cache_fp8);
  else
    store_n<Vectorized>(static_cast<T*>(c.data) + off, x);
}

ROPE_HD float scale_or_one(const float* s) {
  if (!s) return 1.0f;
  note_read(s, sizeof(float));
  return *s;
}

// Element i of page-table tensor `which` reported as read.
ROPE_HD void note_page_read(const PageTable& pt, const void* x, int which, int64_t i) {
  const int64_t size = (pt.int64_mask >> which) & 1u ? 8 : 4;
  note_read(static_cast<const char*>(x) + i * size, size);
}

// token_slot, its reads of slot_mapping or of the page table reported.
ROPE_HD int64_t slot_of(const CacheParams& cp, int64_t token) {
  if (cp.pages.batch) {
    const PageTable& pt = cp.pages;
    const PageSlot s = page_slot(pt, cp.block_size, token);
    if (token < pt.n_tokens) {
      note_page_read(pt, pt.batch, 0, token);
      note_page_read(pt, pt.pos, 1, token);
    }
    if (s.b >= 0) {
      note_page_read(pt, pt.indptr, 3, s.b);
      note_page_read(pt, pt.indptr, 3, s.b + 1);
      if (pt.last_len) note_page_read(pt, pt.last_len, 4, s.b);
    }
    if (s.page >= 0) note_page_read(pt, pt.indices, 2, s.page);
    return s.slot;
  }
  if (token < cp.n_slots) note_read(cp.slots + token, sizeof(int64_t));
  return token_slot(cp, token);
}

template <class T, class CS, class Pos, bool Interleaved, bool Vectorized>
ROPE_HD void cache_thread(const CacheParams& cp, const CacheLaunch& cl, const Coord& c) {
  const RopeParams& p = cp.rope;
  const Launch& l = cl.grid;
  constexpr int V = vec_width<T, Vectorized>();
  constexpr int P = pairs_per_unit<T, Interleaved, Vectorized>();
  const int64_t h = p.rotary_dim / 2;
  const int64_t n_qk = l.n_rot_units + l.n_pass_units;
  const int64_t n_lanes = n_qk > cl.n_v_units ? n_qk : cl.n_v_units;
  const int64_t hq = p.t[0].n_heads, hk = cp.n_kv_heads;
  const int64_t heads = hq + 2 * hk;
  const bool q8 = cp.q_fp8 != Fp8::kNone;
  const bool fp8_cache = cp.cache_fp8 != Fp8::kNone;
  const float q_scale = q8 ? scale_or_one(cp.q_scale) : 1.0f;
  const float k_scale = fp8_cache ? scale_or_one(cp.key_cache.scale) : 1.0f;
  const float v_scale = fp8_cache ? scale_or_one(cp.value_cache.scale) : 1.0f;

  for (int64_t token = c.bx; token < p.n_tokens; token += c.gdx) {
    const TokenOffsets o = token_offsets_1d(p, token);  // [T, H, D]: one token dim, one head dim
    const int64_t slot = slot_of(cp, token);
    // The token's cache rows (slot_offset), outside the loops over heads.
    const int64_t k_row = slot >= 0 ? slot_offset(cp.key_cache, cp.block_size, slot) : 0;
    const int64_t v_row = slot >= 0 ? slot_offset(cp.value_cache, cp.block_size, slot) : 0;
    for (int64_t lane = c.tx; lane < n_lanes; lane += c.bdx) {
      const bool rot = lane < l.n_rot_units;
      const int64_t j0 = lane * P;  // first pair of this unit
      for (int64_t head = c.ty + c.by * c.bdy; head < heads; head += c.bdy * c.gdy) {  // per head
        if (head >= hq + hk) {
          // v: copied to the value cache.
          if (slot < 0 || lane >= cl.n_v_units) continue;
          const int64_t hv = head - hq - hk;
          const T* src = static_cast<const T*>(cp.v) + token * cp.v_tok_stride +
                         hv * cp.v_head_stride + lane * V;
          T x[V];
          load_n<Vectorized>(src, x);
          store_cache<Vectorized>(cp, cp.value_cache, v_scale, v_row, hv, lane * V, x);
          continue;
        }
        if (lane >= n_qk) continue;
        const int ti = head < hq ? 0 : 1;
        const int64_t hh = ti ? head - hq : head;
        int64_t hin, hout;
        head_offsets_1d(p.t[ti], hh, hin, hout);
        const T* in = static_cast<const T*>(p.t[ti].in) + (ti ? o.in[1] : o.in[0]) + hin;
        T* out = static_cast<T*>(p.t[ti].out) + (ti ? o.out[1] : o.out[0]) + hout;
        const bool to_q8 = ti == 0 && q8;
        uint8_t* q8_out =
            to_q8 ? static_cast<uint8_t*>(cp.q8) + token * cp.q8_tok_stride + hh * cp.q8_head_stride
                  : nullptr;
        const bool to_cache = ti == 1 && slot >= 0;
        // The tensor's rotated features start at r0 (q: rot_offset; k: k_rot_offset).
        const int r0 = ti ? cp.k_rot_offset : p.rot_offset;
        if (!rot) {
          // Pass-through features: [0, r0), then [r0 + rotary_dim, the tensor's head size).
          const int f = int(lane - l.n_rot_units) * V;
          if (f >= (ti ? cp.k_dim : p.head_dim) - p.rotary_dim) continue;
          const int e = f < r0 ? f : f + p.rotary_dim;
          if (!(to_q8 || to_cache || p.t[ti].copy_pass)) continue;  // in place, nothing to store
          T x[V];
          load_n<Vectorized>(in + e, x);
          if (to_q8)
            store_fp8(q8_out + e, x, q_scale, cp.q_fp8);
          else if (p.t[ti].copy_pass)
            store_n<Vectorized>(out + e, x);
          if (to_cache) store_cache<Vectorized>(cp, cp.key_cache, k_scale, k_row, hh, e, x);
          continue;
        }
        // The unit's cos/sin, read per head (from L1 after the first head): kept across heads, as
        // the rotary kernel does, they would not fit in the registers beside the cache's state.
        CS cv[P], sv[P];  // as stored: 16-bit values stay packed
        unit_cos_sin<CS, Pos, Vectorized>(p, o.pos, j0, cv, sv);
        if (ti == 0 && cp.q_inverse) {
          ROPE_UNROLL
          for (int k = 0; k < P; ++k) sv[k] = negated(sv[k]);
        }
        if (Interleaved) {
          constexpr bool VecPairs = Vectorized && (2 * P == V);
          T y[2 * P];
          rotate_unit<VecPairs>(in + r0, j0, cv, sv, y);
          if (to_q8)
            store_fp8(q8_out + r0 + 2 * j0, y, q_scale, cp.q_fp8);
          else
            store_n<VecPairs>(out + r0 + 2 * j0, y);
          if (to_cache) store_cache<VecPairs>(cp, cp.key_cache, k_scale, k_row, hh, r0 + 2 * j0, y);
        } else {
          T y1[P], y2[P];
          rotate_unit<Vectorized>(in + r0, h, j0, cv, sv, y1, y2);
          if (to_q8) {
            store_fp8(q8_out + r0 + j0, y1, q_scale, cp.q_fp8);
            store_fp8(q8_out + r0 + h + j0, y2, q_scale, cp.q_fp8);
          } else {
            store_n<Vectorized>(out + r0 + j0, y1);
            store_n<Vectorized>(out + r0 + h + j0, y2);
          }
          if (to_cache) {
            store_cache<Vectorized>(cp, cp.key_cache, k_scale, k_row, hh, r0 + j0, y1);
            store_cache<Vectorized>(cp, cp.key_cache, k_scale, k_row, hh, r0 + h + j0, y2);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// QK-RMSNorm + rotary: a group of lanes per (token, head), 32 / group items per warp.

constexpr int kWarp = 32;
constexpr int kNormWarps = 4;  // warps per block

struct NormLaunch {
  int64_t grid_x;        // blocks of kWarp x kNormWarps threads, striding over the warps' items
  int64_t n_items;       // n_tokens * (q heads + k heads)
  int64_t n_warp_items;  // warps of items: n_items / (kWarp / group), rounded up
  int64_t n_rot_units, n_pass_units;
  int64_t group;  // lanes per item: the power of two >= units per head, at most kWarp
  // A thread's next item is grid_x * kNormWarps * (kWarp / group) further: step_tokens tokens and
  // step_heads heads (of per_token = q heads + k heads, below 2^31) on.
  int64_t step_tokens;
  int32_t per_token, step_heads;
  bool vectorized;
};

inline NormLaunch plan_norm_launch(const NormParams& np, int64_t num_sms,
                                   bool force_scalar = false) {
  RopeParams p = np.rope;
  p.t[0].copy_pass = p.t[1].copy_pass = true;  // pass-through features are normalised and stored
  NormLaunch l{};
  l.vectorized = !force_scalar && can_vectorize(p);
  const int64_t v = l.vectorized ? 16 / dtype_size(p.x_dtype) : 1;
  const int64_t ppu = p.interleaved ? (v > 1 ? v / 2 : 1) : v;
  l.n_rot_units = (p.rotary_dim / 2) / ppu;
  l.n_pass_units = (p.head_dim - p.rotary_dim) / v;
  l.group = 1;
  while (l.group < kWarp && l.group < l.n_rot_units + l.n_pass_units) l.group *= 2;
  l.n_items = p.n_tokens * (p.t[0].n_heads + p.t[1].n_heads);
  const int64_t per_warp = kWarp / l.group;
  l.n_warp_items = (l.n_items + per_warp - 1) / per_warp;
  const int64_t blocks = (l.n_warp_items + kNormWarps - 1) / kNormWarps;
  const int64_t resident = 16 * (num_sms < 1 ? 1 : num_sms);
  l.grid_x = blocks < resident ? blocks : resident;
  const int64_t per_token = p.t[0].n_heads + p.t[1].n_heads,
                step = l.grid_x * kNormWarps * per_warp;
  l.per_token = int32_t(per_token);
  l.step_tokens = per_token > 0 ? step / per_token : 0;
  l.step_heads = per_token > 0 ? int32_t(step % per_token) : 0;
  return l;
}

// Where (token, head) `item` lives: the tensor (0 q, 1 k), its input and output.
template <class T>
struct NormItem {
  int ti;
  int64_t pos;
  const T* in;
  T* out;
};

// A norm item: head `head` (q's heads, then k's) of token `token`, item
// token * l.per_token + head. A thread's loop over items carries (token,
// head) from one item to the next without a division (next_item).
struct NormAt {
  int64_t token;
  int32_t head;
};

ROPE_HD NormAt norm_at(const NormLaunch& l, int64_t item) {
  return {item / l.per_token, int32_t(item % l.per_token)};
}

ROPE_HD void next_item(const NormLaunch& l, NormAt& at) {
  at.token += l.step_tokens;
  at.head += l.step_heads;
  if (at.head >= l.per_token) at.head -= l.per_token, ++at.token;
}

template <class T>
ROPE_HD NormItem<T> norm_item(const NormParams& np, NormAt at) {
  const RopeParams& p = np.rope;
  const int64_t head = at.head;
  const int ti = head < p.t[0].n_heads ? 0 : 1;
  const TokenOffsets o = token_offsets_1d(p, at.token);  // [T, H, D]
  int64_t hin, hout;
  head_offsets_1d(p.t[ti], ti ? head - p.t[0].n_heads : head, hin, hout);
  return {ti, o.pos, static_cast<const T*>(p.t[ti].in) + (ti ? o.in[1] : o.in[0]) + hin,
          static_cast<T*>(p.t[ti].out) + (ti ? o.out[1] : o.out[0]) + hout};
}

// Pair j0 .. j0 + P of a head's rotary part: x[0..P) the first features of the pairs, x[P..2P) the
// second (interleaved pairs as stored, half-split pairs from both halves).
template <bool Interleaved, bool Vectorized, class T, int N>
ROPE_HD void load_pairs(const T* rot, int64_t h, int64_t j0, T (&x)[N]) {
  constexpr int P = N / 2, V = 16 / int(sizeof(T));
  if (Interleaved) {
    T y[2 * P];
    load_n<Vectorized && (2 * P == V)>(rot + 2 * j0, y);
    ROPE_UNROLL
    for (int k = 0; k < P; ++k) x[k] = y[2 * k], x[P + k] = y[2 * k + 1];
  } else {
    T x1[P], x2[P];
    load_n<Vectorized>(rot + j0, x1);
    load_n<Vectorized>(rot + h + j0, x2);
    ROPE_UNROLL
    for (int k = 0; k < P; ++k) x[k] = x1[k], x[P + k] = x2[k];
  }
}

// Phase 1 of lane `gl` of the group on `item`: the sum of the squares of the lane's units (units
// gl, gl + group, ..: rotary ones, then pass-through ones).
template <class T, class CS, class Pos, bool Interleaved, bool Vectorized>
ROPE_HD typename Acc<T>::type norm_phase1(const NormParams& np, const NormLaunch& l, NormAt item,
                                          int gl) {
  using A = typename Acc<T>::type;
  const RopeParams& p = np.rope;
  constexpr int V = vec_width<T, Vectorized>();
  constexpr int P = pairs_per_unit<T, Interleaved, Vectorized>();
  const NormItem<T> it = norm_item<T>(np, item);
  A sum = 0;
  for (int64_t u = gl; u < l.n_rot_units; u += l.group) {
    T x[2 * P];
    load_pairs<Interleaved, Vectorized>(it.in + p.rot_offset, p.rotary_dim / 2, u * P, x);
    ROPE_UNROLL
    for (int k = 0; k < 2 * P; ++k) sum += A(to_acc(x[k])) * A(to_acc(x[k]));
  }
  for (int64_t u = gl; u < l.n_pass_units; u += l.group) {
    const int64_t f = u * V;
    T x[V];
    load_n<Vectorized>(it.in + (f < p.rot_offset ? f : f + p.rotary_dim), x);
    ROPE_UNROLL
    for (int k = 0; k < V; ++k) sum += A(to_acc(x[k])) * A(to_acc(x[k]));
  }
  return sum;
}

// The sum of a group's partial sums, in a fixed order.
template <class A>
ROPE_HD A group_total(const A* partial, int64_t group) {
  A t = 0;
  for (int64_t i = 0; i < group; ++i) t += partial[i];
  return t;
}

// x * rms * (w[f] + weight_offset), rounded to T (the norm's output), as A.
template <class T, class A>
ROPE_HD A normed(const NormParams& np, int ti, A x, A rms, int f) {
  note_read(static_cast<const char*>(np.weight[ti]) + int64_t(f) * dtype_size(np.w_dtype[ti]),
            size_t(dtype_size(np.w_dtype[ti])));
  const A w = load_weight<A>(np.weight[ti], np.w_dtype[ti], f) + A(np.weight_offset);
  return A(to_acc(Store<T>::from(x * rms * w)));
}

// Phase 2 of lane `gl` of the group on `item`, given the head's sum of squares: reads its units
// again (the lane's own bytes, just read: from L1), normalises, scales, rounds, rotates and stores
// them.
template <class T, class CS, class Pos, bool Interleaved, bool Vectorized>
ROPE_HD void norm_phase2(const NormParams& np, const NormLaunch& l, NormAt item, int gl,
                         typename Acc<T>::type total) {
  using A = typename Acc<T>::type;
  const RopeParams& p = np.rope;
  constexpr int V = vec_width<T, Vectorized>();
  constexpr int P = pairs_per_unit<T, Interleaved, Vectorized>();
  // Feature indices in int: a head has at most kMaxNormHeadDim features.
  const int h = p.rotary_dim / 2, r0 = p.rot_offset, group = int(l.group);
  const NormItem<T> it = norm_item<T>(np, item);
  const A rms = rms_inverse<A>(total, p.head_dim, np.eps);
  for (int u = gl; u < int(l.n_rot_units); u += group) {
    const int j0 = u * P;
    CS cv[P], sv[P];  // as stored: 16-bit values stay packed
    unit_cos_sin<CS, Pos, Vectorized>(p, it.pos, j0, cv, sv);
    T x[2 * P];
    load_pairs<Interleaved, Vectorized>(it.in + r0, h, j0, x);
    T y[2 * P];
    ROPE_UNROLL
    for (int k = 0; k < P; ++k) {
      // Features of pair j0 + k: (2j, 2j + 1) interleaved, (j, j + h) half-split.
      const int i1 = Interleaved ? 2 * k : k, i2 = Interleaved ? 2 * k + 1 : P + k;
      const int f1 = Interleaved ? r0 + 2 * (j0 + k) : r0 + j0 + k;
      const int f2 = Interleaved ? f1 + 1 : f1 + h;
      A y1, y2;
      rotate_pair<A>(normed<T>(np, it.ti, A(to_acc(x[k])), rms, f1),
                     normed<T>(np, it.ti, A(to_acc(x[P + k])), rms, f2), A(to_acc(cv[k])),
                     A(to_acc(sv[k])), y1, y2);
      y[i1] = Store<T>::from(y1);
      y[i2] = Store<T>::from(y2);
    }
    if (Interleaved) {
      store_n<Vectorized && (2 * P == V)>(it.out + r0 + 2 * j0, y);
    } else {
      T y1[P], y2[P];
      ROPE_UNROLL
      for (int k = 0; k < P; ++k) y1[k] = y[k], y2[k] = y[P + k];
      store_n<Vectorized>(it.out + r0 + j0, y1);
      store_n<Vectorized>(it.out + r0 + h + j0, y2);
    }
  }
  for (int u = gl; u < int(l.n_pass_units); u += group) {
    const int f = u * V;
    const int e = f < r0 ? f : f + p.rotary_dim;
    T x[V], y[V];
    load_n<Vectorized>(it.in + e, x);
    ROPE_UNROLL
    for (int k = 0; k < V; ++k)
      y[k] = Store<T>::from(normed<T>(np, it.ti, A(to_acc(x[k])), rms, e + k));
    store_n<Vectorized>(it.out + e, y);
  }
}

}  // namespace gpu
}  // namespace rope

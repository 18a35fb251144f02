// CUDA body of the re-rotation of cached keys (rope_ext::rerotate_kv_cache_),
// torch-free, in the style of cuda/rotary.cuh: the rotary tile (a block per
// token, lanes over units of the rotated features, rows over heads) at the
// token's slot's row of the cache, by the table row |delta| (inversely for a
// negative delta). fp8 caches take a scalar path: each pair dequantized,
// rotated in float32 and requantized with the cache's scale.
// cuda/rerotate_launch.cu wraps it in a __global__ kernel; csrc/ops/emulated/
// runs it on the CPU over the same grid.
#pragma once

#include <type_traits>

#include "../serving.h"
#include "rotary.cuh"

namespace rope {
namespace gpu {

inline Launch plan_rerotate_launch(const RerotateParams& rp, int64_t num_sms,
                                   bool force_scalar = false) {
  const RopeParams& p = rp.rope;
  Launch l{};
  const int64_t V = 16 / dtype_size(p.x_dtype);
  // A token's row is its slot's: the block and row strides keep the 16-byte alignment too.
  l.vectorized = !force_scalar && rp.fp8 == Fp8::kNone && can_vectorize(p) &&
                 rp.cache.block_stride % V == 0 && rp.cache.row_stride % V == 0;
  const int64_t v = l.vectorized ? V : 1;
  const int64_t ppu = p.interleaved ? (v > 1 ? v / 2 : 1) : v;
  l.n_rot_units = (p.rotary_dim / 2) / ppu;
  l.n_pass_units = 0;
  // No token: no grid (shape_grid spreads the heads of each token over blocks).
  if (p.n_tokens > 0) shape_grid(l, l.n_rot_units, p.t[0].n_heads, p.n_tokens, num_sms);
  return l;
}

inline bool rerotate_has_work(const RerotateParams& rp, const Launch& l) {
  return rp.rope.n_tokens > 0 && rp.rope.t[0].n_heads > 0 && l.n_rot_units > 0;
}

// The token's cache row (element offset of its rotated features) and table
// row; false when nothing is done for it (slot -1 or outside the cache, a
// delta no table row holds).
template <class Pos>
ROPE_HD bool rerotate_token(const RerotateParams& rp, int64_t token, int64_t& base, int64_t& row,
                            bool& inverse) {
  const RopeParams& p = rp.rope;
  note_read(rp.slots + token, sizeof(int64_t));
  const int64_t slot = rp.slots[token];
  if (slot < 0 || slot >= rp.n_cache_slots) return false;
  row = shift_row(position_at<Pos>(p, token * p.pos_stride[0]), p.n_cache_rows, inverse);
  base = slot_offset(rp.cache, rp.block_size, slot) + p.rot_offset;
  return row >= 0;
}

// fp8 caches: one pair per lane.
template <class CS, class Pos, bool Interleaved>
ROPE_HD void rerotate_fp8_thread(const RerotateParams& rp, const Launch& l, const Coord& c) {
  const RopeParams& p = rp.rope;
  const float scale =
      rp.cache.scale ? (note_read(rp.cache.scale, sizeof(float)), *rp.cache.scale) : 1.0f;
  for (int64_t token = c.bx; token < p.n_tokens; token += c.gdx) {
    int64_t base = 0, row = 0;
    bool inverse = false;
    if (!rerotate_token<Pos>(rp, token, base, row, inverse)) continue;
    for (int64_t j = c.tx; j < l.n_rot_units; j += c.bdx) {
      float cv[1], sv[1];
      row_cos_sin<CS, false>(p, row, j, inverse, cv, sv);
      int i1, i2;
      pair_index(Interleaved, int(j), p.rotary_dim, i1, i2);
      for (int64_t head = c.ty + c.by * c.bdy; head < p.t[0].n_heads;
           head += c.bdy * c.gdy) {  // per head
        uint8_t* x = static_cast<uint8_t*>(rp.cache.data) + base + head * rp.cache.head_stride;
        note_read(x + i1, 1);
        note_read(x + i2, 1);
        float y1, y2;
        rotate_pair<float>(mul_rn(fp8_to_float(x[i1], rp.fp8), scale),
                           mul_rn(fp8_to_float(x[i2], rp.fp8), scale), cv[0], sv[0], y1, y2);
        note_write(x + i1, 1);
        note_write(x + i2, 1);
        x[i1] = quantize_fp8(y1, scale, rp.fp8);
        x[i2] = quantize_fp8(y2, scale, rp.fp8);
      }
    }
  }
}

template <class T, class CS, class Pos, bool Interleaved, bool Vectorized>
ROPE_HD void rerotate_thread(const RerotateParams& rp, const Launch& l, const Coord& c) {
  if constexpr (std::is_same_v<T, float> && !Vectorized) {
    if (rp.fp8 != Fp8::kNone) return rerotate_fp8_thread<CS, Pos, Interleaved>(rp, l, c);
  }
  using A = typename Acc<T>::type;
  const RopeParams& p = rp.rope;
  constexpr int P = pairs_per_unit<T, Interleaved, Vectorized>();
  const int64_t h = p.rotary_dim / 2;
  for (int64_t token = c.bx; token < p.n_tokens; token += c.gdx) {
    int64_t base = 0, row = 0;
    bool inverse = false;
    if (!rerotate_token<Pos>(rp, token, base, row, inverse)) continue;
    for (int64_t lane = c.tx; lane < l.n_rot_units; lane += c.bdx) {
      const int64_t j0 = lane * P;
      A cv[P], sv[P];
      row_cos_sin<CS, Vectorized>(p, row, j0, inverse, cv, sv);
      for (int64_t head = c.ty + c.by * c.bdy; head < p.t[0].n_heads;
           head += c.bdy * c.gdy) {  // per head
        T* x = static_cast<T*>(p.t[0].out) + base + head * rp.cache.head_stride;
        if (Interleaved) {
          constexpr bool VecPairs = Vectorized && (2 * P == vec_width<T, Vectorized>());
          T y[2 * P];
          rotate_unit<VecPairs>(x, j0, cv, sv, y);
          store_n<VecPairs>(x + 2 * j0, y);
        } else {
          T y1[P], y2[P];
          rotate_unit<Vectorized>(x, h, j0, cv, sv, y1, y2);
          store_n<Vectorized>(x + j0, y1);
          store_n<Vectorized>(x + h + j0, y2);
        }
      }
    }
  }
}

}  // namespace gpu
}  // namespace rope

// The table-free rows on the GPU (params.h AngleRows), torch-free: one thread
// per (token, pair), blocks striding over tokens. The launcher
// (cuda/angles_launch.cu) and the host emulation run angle_rows_thread over
// the grid plan_angle_rows chooses; the CPU builds the same rows with the same
// per-pair function (angles.h), so a row is the same bits on every device.
#pragma once

#include "../angles.h"
#include "rotary.cuh"

namespace rope {
namespace gpu {

inline Launch plan_angle_rows(const AngleRows& ar, int64_t num_sms) {
  Launch l{};
  const int64_t h = ar.rope.rotary_dim / 2, resident = 16 * (num_sms < 1 ? 1 : num_sms);
  l.block_x = h < 128 ? h : 128;
  l.block_y = 1;
  l.grid_x = ar.rope.n_tokens < resident ? ar.rope.n_tokens : resident;
  l.grid_y = 1;
  return l;
}

template <class Pos, class R>
ROPE_HD void angle_rows_thread(const AngleRows& ar, const Coord& c) {
  const RopeParams& p = ar.rope;
  const int h = p.rotary_dim / 2;
  for (int64_t token = c.bx; token < p.n_tokens; token += c.gdx) {
    const int64_t off = token_offsets(p, token).pos;
    R* row = static_cast<R*>(ar.rows) + token * p.rotary_dim;
    for (int64_t j = c.tx; j < h; j += c.bdx) {
      const int64_t po = pair_position_offset(p, off, int(j));
      note_read(static_cast<const Pos*>(p.positions) + po, sizeof(Pos));
      note_read(p.freqs + j, sizeof(double));
      note_read(p.freqs + h + j, sizeof(double));
      note_write(row + j, sizeof(R));
      note_write(row + h + j, sizeof(R));
      store_angle(row, h, int(j), position_value<Pos>(p, po), p.freqs);
    }
    if (ar.index && c.tx == 0) {
      note_write(ar.index + token, sizeof(int64_t));
      ar.index[token] = token;
    }
  }
}

}  // namespace gpu
}  // namespace rope

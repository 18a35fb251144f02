// CPU kernel of the re-rotation of cached keys (cpu/cpu.h): each token's
// cache row (every head) is one token of the vectorized rotation kernel of
// rotate_tokens, at its slot's row, by the table row |delta| (inversely for a
// negative delta): the bits of apply_rotary on that row. fp8 rows go through
// a float32 scratch: dequantized, rotated, requantized by the row kernel.
#include <vector>

#include "cpu.h"
#include "fp8_rows.h"

namespace rope {
namespace cpu {

void rerotate_tokens(const RerotateParams& rp, int64_t begin, int64_t end) {
  const RopeParams& p = rp.rope;
  const int64_t hk = p.t[0].n_heads, R = p.rotary_dim, hs = rp.cache.head_stride;
  const bool fp8 = rp.fp8 != Fp8::kNone;
  const float scale = fp8 && rp.cache.scale ? *rp.cache.scale : 1.0f;
  thread_local std::vector<float> scratch;
  if (fp8) scratch.resize(size_t(hk * R));
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = rp.slots[t];
    if (slot < 0 || slot >= rp.n_cache_slots) continue;
    const int64_t off = t * p.pos_stride[0];
    const int64_t delta =
        p.pos_int64 ? load_position<int64_t>(p, off) : load_position<int32_t>(p, off);
    bool inverse = false;
    int64_t row = shift_row(delta, p.n_cache_rows, inverse);
    if (row < 0) continue;  // checked before the call: never taken
    // One token: the slot's row, its position the table row.
    RopeParams r = p;
    r.n_tok_dims = 0;
    r.n_tokens = 1;
    r.positions = &row;
    r.pos_int64 = true;
    r.inverse = inverse;
    const int64_t row_off = slot_offset(rp.cache, rp.block_size, slot);
    if (!fp8) {
      char* x = static_cast<char*>(rp.cache.data) + row_off * dtype_size(p.x_dtype);
      r.t[0].in = r.t[0].out = x;
      rotate_tokens(r, 0, 1);
      continue;
    }
    // fp8: the rotated features of every head into the scratch [hk, R], as float32.
    uint8_t* codes = static_cast<uint8_t*>(rp.cache.data) + row_off + p.rot_offset;
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t j = 0; j < R; ++j)
        scratch[h * R + j] = fp8_to_float(codes[h * hs + j], rp.fp8) * scale;
    r.head_dim = r.rotary_dim;
    r.rot_offset = 0;
    r.t[0].in = r.t[0].out = scratch.data();
    r.t[0].in_head_stride[0] = r.t[0].out_head_stride[0] = R;
    rotate_tokens(r, 0, 1);
    const auto quant = row_ops().quant[int(DType::kFloat32)];
    for (int64_t h = 0; h < hk; ++h)
      quant(scratch.data() + h * R, codes + h * hs, R, scale, rp.fp8);
  }
}

}  // namespace cpu
}  // namespace rope

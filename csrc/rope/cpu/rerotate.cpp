// CPU kernel of the re-rotation of cached keys (cpu/cpu.h): each token's
// cache row (every head) is one token of the vectorized rotation kernel of
// rotate_tokens, at its slot's row, by the table row |delta| (inversely for a
// negative delta): the bits of apply_rotary on that row. fp8 rows go through
// a float32 scratch: dequantized, rotated, requantized by the row kernel.
#include <array>
#include <vector>

#include "cpu.h"
#include "fp8_rows.h"

namespace rope {
namespace cpu {
namespace {

// float of each fp8 code (fp8_to_float), per type: a lookup per element.
const float* fp8_values(Fp8 t) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> v{};
    for (int b = 0; b < 256; ++b) {
      v[0][b] = fp8_to_float(uint8_t(b), Fp8::kE4M3);
      v[1][b] = fp8_to_float(uint8_t(b), Fp8::kE5M2);
    }
    return v;
  }();
  return tables[t == Fp8::kE4M3 ? 0 : 1].data();
}

}  // namespace

void rerotate_tokens(const RerotateParams& rp, int64_t begin, int64_t end) {
  const RopeParams& p = rp.rope;
  const int64_t hk = p.t[0].n_heads, R = p.rotary_dim, hs = rp.cache.head_stride;
  const int64_t bs = rp.block_size, es = dtype_size(p.x_dtype);
  const bool fp8 = rp.fp8 != Fp8::kNone;
  const float scale = fp8 && rp.cache.scale ? *rp.cache.scale : 1.0f;
  const float* values = fp8 ? fp8_values(rp.fp8) : nullptr;
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> rows;  // |delta| of the tokens of a run
  if (fp8) scratch.resize(size_t(hk * R));
  auto shift = [&](int64_t t, bool& inverse) {
    const int64_t off = t * p.pos_stride[0];
    const int64_t d = p.pos_int64 ? load_position<int64_t>(p, off) : load_position<int32_t>(p, off);
    return shift_row(d, p.n_cache_rows, inverse);
  };
  for (int64_t t = begin; t < end;) {
    const int64_t slot = rp.slots[t];
    bool inverse = false;
    const int64_t row = slot >= 0 && slot < rp.n_cache_slots ? shift(t, inverse) : -1;
    if (row < 0) {  // slot -1 (the others were checked before the call)
      ++t;
      continue;
    }
    const int64_t row_off = slot_offset(rp.cache, bs, slot);
    RopeParams r = p;
    r.inverse = inverse;
    r.pos_int64 = true;
    if (!fp8) {
      // A run of tokens at consecutive rows of one block, shifted the same way, is one call of the
      // rotation (its rows at the cache's row stride, its positions the shifts).
      rows.assign(1, row);
      int64_t n = 1;
      for (bool inv = false; t + n < end && rp.slots[t + n] == slot + n && (slot + n) % bs != 0;
           ++n) {
        const int64_t next = shift(t + n, inv);
        if (next < 0 || inv != inverse) break;
        rows.push_back(next);
      }
      r.n_tok_dims = 1;
      r.n_tokens = r.tok_size[0] = n;
      r.pos_stride[0] = 1;
      r.positions = rows.data();
      r.t[0].in = r.t[0].out = static_cast<char*>(rp.cache.data) + row_off * es;
      r.t[0].in_tok_stride[0] = r.t[0].out_tok_stride[0] = rp.cache.row_stride;
      rotate_tokens(r, 0, n);
      t += n;
      continue;
    }
    // fp8: the rotated features of every head into the scratch [hk, R], as float32; one token.
    int64_t pos = row;
    r.n_tok_dims = 0;
    r.n_tokens = 1;
    r.positions = &pos;
    uint8_t* codes = static_cast<uint8_t*>(rp.cache.data) + row_off + p.rot_offset;
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t j = 0; j < R; ++j) scratch[h * R + j] = values[codes[h * hs + j]] * scale;
    r.head_dim = r.rotary_dim;
    r.rot_offset = 0;
    r.t[0].in = r.t[0].out = scratch.data();
    r.t[0].in_head_stride[0] = r.t[0].out_head_stride[0] = R;
    rotate_tokens(r, 0, 1);
    const auto quant = row_ops().quant[int(DType::kFloat32)];
    for (int64_t h = 0; h < hk; ++h)
      quant(scratch.data() + h * R, codes + h * hs, R, scale, rp.fp8);
    ++t;
  }
}

}  // namespace cpu
}  // namespace rope

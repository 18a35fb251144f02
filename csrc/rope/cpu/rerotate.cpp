// CPU kernel of the re-rotation of cached keys (cpu/cpu.h): each token's
// cache row (every head) is one token of the vectorized rotation kernel of
// rotate_tokens, at its slot's row (RopeParams::tok_rows), by the table row
// |delta| (inversely for a negative delta): the bits of apply_rotary on that
// row. fp8 rows go through
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
  const bool fp8 = rp.fp8 != Fp8::kNone;
  auto shift = [&](int64_t t, bool& inverse) {
    const int64_t slot = rp.slots[t];
    if (slot < 0 || slot >= rp.n_cache_slots) return int64_t(-1);  // slot -1 (others checked)
    const int64_t off = t * p.pos_stride[0];
    const int64_t d = p.pos_int64 ? load_position<int64_t>(p, off) : load_position<int32_t>(p, off);
    return shift_row(d, p.n_cache_rows, inverse);
  };
  if (!fp8) {
    // One rotation call per direction: its tokens are the rows (tok_rows) of the tokens shifted
    // that way, their positions the table rows |delta|.
    thread_local std::vector<int64_t> rows, offsets;
    for (const bool backward : {false, true}) {
      rows.clear();
      offsets.clear();
      for (int64_t t = begin; t < end; ++t) {
        bool inverse = false;
        const int64_t row = shift(t, inverse);
        if (row < 0 || inverse != backward) continue;
        rows.push_back(row);
        offsets.push_back(slot_offset(rp.cache, rp.block_size, rp.slots[t]));
      }
      if (rows.empty()) continue;
      RopeParams r = p;
      r.inverse = backward;
      r.n_tok_dims = 1;
      r.n_tokens = r.tok_size[0] = int64_t(rows.size());
      r.positions = rows.data();
      r.pos_int64 = true;
      r.pos_stride[0] = 1;
      r.tok_rows = offsets.data();
      rotate_tokens(r, 0, r.n_tokens);
    }
    return;
  }
  // fp8, a token at a time: the rotated features of every head into the scratch [hk, R] as float32,
  // rotated, requantized.
  const float scale = rp.cache.scale ? *rp.cache.scale : 1.0f;
  const float* values = fp8_values(rp.fp8);
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(hk * R));
  const auto quant = row_ops().quant[int(DType::kFloat32)];
  for (int64_t t = begin; t < end; ++t) {
    bool inverse = false;
    int64_t row = shift(t, inverse);
    if (row < 0) continue;
    RopeParams r = p;
    r.inverse = inverse;
    r.n_tok_dims = 0;
    r.n_tokens = 1;
    r.positions = &row;
    r.pos_int64 = true;
    uint8_t* codes = static_cast<uint8_t*>(rp.cache.data) +
                     slot_offset(rp.cache, rp.block_size, rp.slots[t]) + p.rot_offset;
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t j = 0; j < R; ++j) scratch[h * R + j] = values[codes[h * hs + j]] * scale;
    r.head_dim = r.rotary_dim;
    r.rot_offset = 0;
    r.t[0].in = r.t[0].out = scratch.data();
    r.t[0].in_head_stride[0] = r.t[0].out_head_stride[0] = R;
    rotate_tokens(r, 0, 1);
    for (int64_t h = 0; h < hk; ++h)
      quant(scratch.data() + h * R, codes + h * hs, R, scale, rp.fp8, false);
  }
}

}  // namespace cpu
}  // namespace rope

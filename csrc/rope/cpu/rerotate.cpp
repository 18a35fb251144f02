// CPU kernel of the re-rotation of cached keys (cpu/cpu.h): each token's
// cache row (every head) is one token of the vectorized rotation kernel of
// rotate_tokens, at its slot's row (RopeParams::tok_rows), by the table row
// |delta| (inversely for a negative delta): the bits of apply_rotary on that
// row. fp8 rows go through a float32 scratch a run of tokens at a time:
// dequantized, rotated, requantized by the row kernels (fp8_rows.h).
#include <algorithm>
#include <vector>

#include "cpu.h"
#include "fp8_rows.h"

namespace rope {
namespace cpu {
namespace {

// Floats of the fp8 path's scratch (128 KiB: a run of tokens' rows stays in L2).
constexpr int64_t kScratchFloats = int64_t(1) << 15;

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
  // fp8, runs of tokens whose rows fill at most kScratchFloats: the rotated features of every
  // head dequantized into the float32 scratch [n, hk, R], rotated by one call per direction (as
  // above, each token at its scratch row), requantized.
  const float scale = rp.cache.scale ? *rp.cache.scale : 1.0f;
  const int64_t row_floats = hk * R;
  const int64_t chunk = std::max<int64_t>(1, kScratchFloats / std::max<int64_t>(row_floats, 1));
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> rows, offsets;
  thread_local std::vector<uint8_t*> cells;
  scratch.resize(size_t(std::min(chunk, end - begin) * row_floats));
  const RowOps& ops = row_ops();
  const auto quant = ops.quant[int(DType::kFloat32)];
  // The rows sit at random slots, which no hardware prefetcher foresees: while a token is
  // dequantized, the next token's rotated codes are hinted (cpu.h, prefetch_distance; none when 0).
  const bool hints = prefetch_distance() > 0, l2 = prefetch_level() == 2;
  auto hint = [&](int64_t t) {
    const int64_t slot = t < end ? rp.slots[t] : -1;
    if (!hints || slot < 0 || slot >= rp.n_cache_slots) return;
    const char* c = static_cast<const char*>(rp.cache.data) +
                    slot_offset(rp.cache, rp.block_size, slot) + p.rot_offset;
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t x = 0; x < R; x += 64) {
        if (l2)
          __builtin_prefetch(c + h * hs + x, 0, 2);
        else
          __builtin_prefetch(c + h * hs + x, 0, 3);
      }
  };
  for (int64_t first = begin; first < end; first += chunk) {
    const int64_t last = std::min(end, first + chunk);
    for (const bool backward : {false, true}) {
      rows.clear();
      offsets.clear();
      cells.clear();
      for (int64_t t = first; t < last; ++t) {
        if (!backward) hint(t + 1);  // the second pass finds the rows the first one hinted
        bool inverse = false;
        const int64_t row = shift(t, inverse);
        if (row < 0 || inverse != backward) continue;
        uint8_t* codes = static_cast<uint8_t*>(rp.cache.data) +
                         slot_offset(rp.cache, rp.block_size, rp.slots[t]) + p.rot_offset;
        float* x = scratch.data() + int64_t(rows.size()) * row_floats;
        for (int64_t h = 0; h < hk; ++h) ops.dequant(codes + h * hs, x + h * R, R, scale, rp.fp8);
        offsets.push_back(int64_t(rows.size()) * row_floats);
        rows.push_back(row);
        cells.push_back(codes);
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
      r.head_dim = r.rotary_dim;
      r.rot_offset = 0;
      r.t[0].in = r.t[0].out = scratch.data();
      r.t[0].in_head_stride[0] = r.t[0].out_head_stride[0] = R;
      rotate_tokens(r, 0, r.n_tokens);
      for (size_t i = 0; i < cells.size(); ++i)
        for (int64_t h = 0; h < hk; ++h)
          quant(scratch.data() + int64_t(i) * row_floats + h * R, cells[i] + h * hs, R, scale,
                rp.fp8, false);
    }
  }
}

}  // namespace cpu
}  // namespace rope

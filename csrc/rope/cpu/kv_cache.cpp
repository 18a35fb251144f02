// CPU kernel of the RoPE + KV-cache write (cpu/cpu.h). It works a few tokens at
// a time, so that what the rotation writes is still in cache for the row stores: the
// rotation is the vectorized kernel of rotate_tokens, the fp8 quantization of
// a row is the row kernel (cpu/fp8_rows.h) of the same instruction set, or a
// table made by it (Fp8Tables), and the cache stores are row copies. (The
// fused QK norm is cpu/qk_norm.h.)
#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"
#include "fp8_rows.h"

namespace rope {
namespace cpu {
namespace {

// Tokens per step: their rotation (one call of the rotation kernel), then
// their cache rows (k's read back from L1 / L2). Eight amortise the call's
// setup over more tokens than one did, whose row stores overlapped the next
// token's rotation instead (benchmarks/cpu-serving.md).
constexpr int64_t kStepTokens = 8;

int64_t pos_size(const RopeParams& p) { return p.pos_int64 ? 8 : 4; }

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, double>) return DType::kFloat64;
  if constexpr (std::is_same_v<T, Half>) return DType::kFloat16;
  return DType::kBFloat16;
}

// p restricted to tokens [begin, end), renumbered from 0 (p has at most one token dim).
RopeParams slice_tokens(const RopeParams& p, int64_t begin, int64_t end) {
  RopeParams s = p;
  if (p.n_tok_dims == 0) return s;  // a single token
  const int64_t es = dtype_size(p.x_dtype);
  s.positions = static_cast<const char*>(p.positions) + begin * p.pos_stride[0] * pos_size(p);
  for (int t = 0; t < p.n_tensors; ++t) {
    s.t[t].in = static_cast<const char*>(p.t[t].in) + begin * p.t[t].in_tok_stride[0] * es;
    s.t[t].out = static_cast<char*>(p.t[t].out) + begin * p.t[t].out_tok_stride[0] * es;
  }
  s.tok_size[0] = end - begin;
  s.n_tokens = end - begin;
  return s;
}

// Element offset of (token, head) of rope tensor t (input side).
int64_t row_offset(const RopeParams& p, int t, int64_t token, int64_t head) {
  int64_t hin, hout;
  head_offsets(p.t[t], head, hin, hout);
  return token_offsets(p, token).in[t] + hin;
}

// fp8 by table. A 16-bit type has 65536 values: a call that quantizes many
// values of one with one scale first runs the row kernel once over every bit
// pattern, then looks each value up (a load, where the row kernel spends
// about 30 vector operations per 8 values on AVX2). The bits are the row
// kernel's. A table costs about what quantizing 65536 values does, so a
// tensor gets one from kTableMinValues values in the call; each thread
// builds its own. Only for row kernels slower than a lookup (RowOps::tables).
constexpr int64_t kTableMinValues = int64_t(4) << 16;

// A scale read on the host (the CPU op's tensors): the value, 1 when absent.
float scale_value(const float* s) { return s ? *s : 1.0f; }

template <class T>
constexpr bool kTableType = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <class T>
void quantize_row(const T* x, uint8_t* dst, int64_t n, float scale, Fp8 t, const uint8_t* table,
                  bool stream) {
  if constexpr (kTableType<T>) {
    if (table) {
      int64_t i = 0;
      static_assert(std::endian::native == std::endian::little, "byte k of w is dst[i + k]");
      for (; i + 8 <= n; i += 8) {  // eight lookups, one store
        uint64_t w = 0;
        for (int k = 0; k < 8; ++k) w |= uint64_t(table[x[i + k].bits]) << (8 * k);
        std::memcpy(dst + i, &w, sizeof w);
      }
      for (; i < n; ++i) dst[i] = table[x[i].bits];
      return;
    }
  }
  row_ops().quant[int(dtype_of<T>())](x, dst, n, scale, t, stream);
}

// The tables of a call's fp8 outputs (nullptr: the row kernel).
struct Fp8Tables {
  const uint8_t* q = nullptr;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;

  template <class T>
  static Fp8Tables make(const CacheParams& cp) {
    Fp8Tables f;
    if constexpr (kTableType<T>) {
      if (!row_ops().tables) return f;
      const RopeParams& p = cp.rope;
      const int64_t n = p.n_tokens;
      const bool fp8 = cp.cache_fp8 != Fp8::kNone;
      if (cp.q_fp8 != Fp8::kNone && n * p.t[0].n_heads * p.head_dim >= kTableMinValues)
        f.q = build<T>(0, scale_value(cp.q_scale), cp.q_fp8);
      if (fp8 && n * cp.n_kv_heads * cp.k_dim >= kTableMinValues)
        f.k = build<T>(1, scale_value(cp.key_cache.scale), cp.cache_fp8);
      if (fp8 && n * cp.n_kv_heads * cp.v_dim >= kTableMinValues)
        f.v = build<T>(2, scale_value(cp.value_cache.scale), cp.cache_fp8);
    }
    return f;
  }

 private:
  // Table `which` of this thread: table[b] = the fp8 bits of the T with bits b.
  template <class T>
  static const uint8_t* build(int which, float scale, Fp8 t) {
    thread_local std::vector<uint8_t> store;
    store.resize(size_t(3) << 16);
    uint8_t* table = store.data() + (size_t(which) << 16);
    T x[256];
    for (int base = 0; base < (1 << 16); base += 256) {
      for (int i = 0; i < 256; ++i) x[i].bits = uint16_t(base + i);
      row_ops().quant[int(dtype_of<T>())](x, table + base, 256, scale, t, false);
    }
    return table;
  }
};

// A call whose cache rows (copied, or quantized to fp8) add up to kStreamMinBytes or more writes
// them with streaming stores: no read for ownership of lines it will not read again (a new token's
// slot is a line no call has touched for a while: 16 or more Llama-3-8B tokens from memory took
// 25-35% less on a Zen 4, benchmarks/cpu-zen4.md). A smaller call, a decode step of a few tokens,
// stores plainly: its few rows skip the store fence, and stay in cache for the attention next.
constexpr int64_t kStreamMinBytes = int64_t(64) << 10;

template <class T>
bool streams_rows(const CacheParams& cp) {
  const int64_t tokens = cp.pages.batch ? cp.pages.n_tokens : cp.n_slots;
  const int64_t es = cp.cache_fp8 == Fp8::kNone ? int64_t(sizeof(T)) : 1;
  return tokens * cp.n_kv_heads * (cp.k_dim + cp.v_dim) * es >= kStreamMinBytes;
}

// Stores one row of n values of T into a cache row (a copy, or fp8); `row`:
// the slot's offset in the cache (slot_offset).
template <class T>
void store_row(const T* x, const CacheParams& cp, const PagedCache& c, int64_t row, int64_t head,
               int64_t n, float scale, const uint8_t* table, bool stream) {
  const int64_t off = row + head * c.head_stride;
  if (cp.cache_fp8 != Fp8::kNone)
    quantize_row(x, static_cast<uint8_t*>(c.data) + off, n, scale, cp.cache_fp8, table, stream);
  else if (stream)
    row_ops().copy(x, static_cast<T*>(c.data) + off, n * int64_t(sizeof(T)));
  else
    std::memcpy(static_cast<T*>(c.data) + off, x, size_t(n) * sizeof(T));
}

// A hint of the line at x into L1. Inline assembly on x86: gcc drops a __builtin_prefetch from a
// loop that does nothing else.
inline void hint_line(const char* x) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*x));
#else
  __builtin_prefetch(x, 1, 3);
#endif
}

// Hints the rows that tokens [begin, end) write into cache c (rows of `dim` values of `es` bytes)
// before the step rotates them: a new token's slot is on a page that no call has touched for a
// while, and its page walk then overlaps the rotation instead of stalling the stores. The first and
// last line of each run of contiguous heads, so every page of the run; the other lines are left to
// the stores (hinting them as well measured no faster: benchmarks/cpu-zen4.md).
void hint_rows(const CacheParams& cp, const PagedCache& c, int64_t dim, int64_t es, int64_t begin,
               int64_t end) {
  const bool one_run = c.head_stride == dim;  // the token's heads follow each other
  const int64_t runs = one_run ? 1 : cp.n_kv_heads;
  const int64_t last = (one_run ? cp.n_kv_heads : 1) * dim * es - 1;
  if (last < 0) return;  // empty rows
  for (int64_t token = begin; token < end; ++token) {
    const int64_t slot = token_slot(cp, token);
    if (slot < 0) continue;
    const char* row = static_cast<const char*>(c.data) + slot_offset(c, cp.block_size, slot) * es;
    for (int64_t r = 0; r < runs; ++r) {
      const char* x = row + r * c.head_stride * es;
      hint_line(x);
      hint_line(x + last);
    }
  }
}

// Whether k rotates apart from q: its features differ from q's (MLA's k_pe), or q is rotated
// back (inverse), or goes to fp8.
bool rotates_k_apart(const CacheParams& cp) {
  const RopeParams& p = cp.rope;
  return cp.k_dim != p.head_dim || cp.k_rot_offset != p.rot_offset || cp.q_inverse ||
         cp.q_fp8 != Fp8::kNone;
}

template <class T>
void cache_step(const CacheParams& cp, const Fp8Tables& tables, int64_t begin, int64_t end,
                bool stream) {
  const RopeParams& p = cp.rope;
  const int64_t n = end - begin, hq = p.t[0].n_heads, D = p.head_dim;
  const int64_t es = cp.cache_fp8 == Fp8::kNone ? int64_t(sizeof(T)) : 1;
  hint_rows(cp, cp.key_cache, cp.k_dim, es, begin, end);
  hint_rows(cp, cp.value_cache, cp.v_dim, es, begin, end);
  // The call's params, not a slice of the step: its head loops prefetch as for the whole call.
  if (!rotates_k_apart(cp)) {
    rotate_tokens(p, begin, end);
  } else {
    RopeParams rk = p;  // k in place
    rk.n_tensors = 1;
    rk.t[0] = p.t[1];
    rk.head_dim = cp.k_dim;
    rk.rot_offset = cp.k_rot_offset;
    rotate_tokens(rk, begin, end);
  }
  // q apart of its dtype was rotated by rotate_and_cache_tokens, for all its tokens at once
  if (cp.q_fp8 != Fp8::kNone) {
    // q: rotated into a row-major scratch of q's dtype, then quantized.
    thread_local std::vector<T> scratch;
    scratch.resize(size_t(n * hq * D));
    RopeParams rq = slice_tokens(p, begin, end);
    rq.n_tensors = 1;
    rq.inverse = cp.q_inverse;
    RotTensor& t = rq.t[0];
    t.out = scratch.data();
    t.copy_pass = true;
    if (rq.n_tok_dims == 1) t.out_tok_stride[0] = hq * D;
    if (t.n_head_dims == 1) t.out_head_stride[0] = D;
    rotate_tokens(rq, 0, n);
    const float scale = scale_value(cp.q_scale);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hq; ++h)
        quantize_row(
            scratch.data() + (i * hq + h) * D,
            static_cast<uint8_t*>(cp.q8) + (begin + i) * cp.q8_tok_stride + h * cp.q8_head_stride,
            D, scale, cp.q_fp8, tables.q, false);  // q_out, read by the attention next
  }
  const float k_scale = scale_value(cp.key_cache.scale);
  const float v_scale = scale_value(cp.value_cache.scale);
  // Heads per row-kernel call: all of a token's heads at once where their rows follow each other
  // both in the input and in the cache (heads contiguous in a packed qkv and in an NHD cache).
  const int64_t hk = cp.n_kv_heads;
  const RotTensor& kt = p.t[1];
  const int64_t kn = kt.n_head_dims == 1 && kt.in_head_stride[0] == cp.k_dim &&
                             cp.key_cache.head_stride == cp.k_dim
                         ? hk
                         : 1;
  const int64_t vn =
      cp.v_head_stride == cp.v_dim && cp.value_cache.head_stride == cp.v_dim ? hk : 1;
  for (int64_t token = begin; token < end; ++token) {
    const int64_t slot = token_slot(cp, token);
    if (slot < 0) continue;
    const int64_t k_row = slot_offset(cp.key_cache, cp.block_size, slot);
    const int64_t v_row = slot_offset(cp.value_cache, cp.block_size, slot);
    for (int64_t h = 0; h < hk; h += kn) {
      const T* k = static_cast<const T*>(kt.in) + row_offset(p, 1, token, h);
      store_row(k, cp, cp.key_cache, k_row, h, kn * cp.k_dim, k_scale, tables.k, stream);
    }
    for (int64_t h = 0; h < hk; h += vn) {
      const T* v = static_cast<const T*>(cp.v) + token * cp.v_tok_stride + h * cp.v_head_stride;
      store_row(v, cp, cp.value_cache, v_row, h, vn * cp.v_dim, v_scale, tables.v, stream);
    }
  }
}

template <class F>
void dispatch_x(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kFloat16:
      return f(Half{});
    case DType::kBFloat16:
      return f(BFloat16{});
  }
}

}  // namespace

void rotate_and_cache_tokens(const CacheParams& cp, int64_t begin, int64_t end) {
  dispatch_x(cp.rope.x_dtype, [&](auto x) {
    using T = decltype(x);
    const Fp8Tables tables = Fp8Tables::make<T>(cp);
    if (rotates_k_apart(cp) && cp.q_fp8 == Fp8::kNone) {
      // q apart, in place or to q_out of its dtype: one rotation of all the tokens (the steps below
      // are for k's cache rows, read back from L1)
      RopeParams rq = cp.rope;
      rq.n_tensors = 1;
      rq.inverse = cp.q_inverse;
      rotate_tokens(rq, begin, end);
    }
    const bool stream = streams_rows<T>(cp);
    for (int64_t b = begin; b < end; b += kStepTokens)
      cache_step<T>(cp, tables, b, std::min(end, b + kStepTokens), stream);
    if (stream) row_ops().fence();  // the streaming stores of this thread's rows
  });
}

}  // namespace cpu
}  // namespace rope

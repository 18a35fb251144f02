// CPU kernel of the RoPE + KV-cache write (cpu.h). It works a token at a
// time, so that what the rotation writes is still in L1 for the row stores: the
// rotation is the vectorized kernel of rotate_tokens, the fp8 quantization of
// a row is the row kernel (serving_rows.h) of the same instruction set, and
// the cache stores are row copies. (The fused QK norm is norm_kernel.h.)
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"
#include "serving_rows.h"

namespace rope {
namespace cpu {
namespace {

// Tokens per step. One: a token's cache rows are written (and its v read)
// right after its rotation, from L1, and the memory traffic of those rows
// overlaps the next token's rotation. Steps of 8 tokens, which rotate 8 and
// then write 8 tokens' rows, took 4-7% longer (4096-token prefill with
// Llama-3-8B shapes, bf16 and fp8 caches, Zen 1).
constexpr int64_t kStepTokens = 1;

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

template <class T>
void quantize_row(const T* x, uint8_t* dst, int64_t n, float scale, Fp8 t) {
  row_ops().quant[int(dtype_of<T>())](x, dst, n, scale, t);
}

// Stores one row of n values of T into a cache row (a copy, or fp8).
template <class T>
void store_row(const T* x, const CacheParams& cp, const PagedCache& c, int64_t slot, int64_t head,
               int64_t n, float scale) {
  const int64_t off = cache_offset(c, cp.block_size, slot, head);
  if (cp.cache_fp8 != Fp8::kNone)
    quantize_row(x, static_cast<uint8_t*>(c.data) + off, n, scale, cp.cache_fp8);
  else
    row_ops().copy(x, static_cast<T*>(c.data) + off, n * int64_t(sizeof(T)));
}

template <class T>
void cache_step(const CacheParams& cp, int64_t begin, int64_t end) {
  const RopeParams& p = cp.rope;
  const RopeParams r = slice_tokens(p, begin, end);
  const int64_t n = end - begin, hq = p.t[0].n_heads, D = p.head_dim;
  if (cp.q_fp8 == Fp8::kNone) {
    rotate_tokens(r, 0, n);
  } else {
    RopeParams rk = r;  // k in place
    rk.n_tensors = 1;
    rk.t[0] = r.t[1];
    rotate_tokens(rk, 0, n);
    // q: rotated into a row-major scratch of q's dtype, then quantized.
    thread_local std::vector<T> scratch;
    scratch.resize(size_t(n * hq * D));
    RopeParams rq = r;
    rq.n_tensors = 1;
    RotTensor& t = rq.t[0];
    t.out = scratch.data();
    t.copy_pass = true;
    if (rq.n_tok_dims == 1) t.out_tok_stride[0] = hq * D;
    if (t.n_head_dims == 1) t.out_head_stride[0] = D;
    rotate_tokens(rq, 0, n);
    const float scale = cp.q_scale ? *cp.q_scale : 1.0f;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hq; ++h)
        quantize_row(
            scratch.data() + (i * hq + h) * D,
            static_cast<uint8_t*>(cp.q8) + (begin + i) * cp.q8_tok_stride + h * cp.q8_head_stride,
            D, scale, cp.q_fp8);
  }
  const bool fp8 = cp.cache_fp8 != Fp8::kNone;
  const float k_scale = fp8 && cp.key_cache.scale ? *cp.key_cache.scale : 1.0f;
  const float v_scale = fp8 && cp.value_cache.scale ? *cp.value_cache.scale : 1.0f;
  for (int64_t token = begin; token < end; ++token) {
    const int64_t slot = token_slot(cp, token);
    if (slot < 0) continue;
    for (int64_t h = 0; h < cp.n_kv_heads; ++h) {
      const T* k = static_cast<const T*>(p.t[1].in) + row_offset(p, 1, token, h);
      store_row(k, cp, cp.key_cache, slot, h, D, k_scale);
      const T* v = static_cast<const T*>(cp.v) + token * cp.v_tok_stride + h * cp.v_head_stride;
      store_row(v, cp, cp.value_cache, slot, h, cp.v_dim, v_scale);
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
    for (int64_t b = begin; b < end; b += kStepTokens)
      cache_step<T>(cp, b, std::min(end, b + kStepTokens));
  });
  row_ops().fence();  // the streaming stores of this thread's rows
}

}  // namespace cpu
}  // namespace rope

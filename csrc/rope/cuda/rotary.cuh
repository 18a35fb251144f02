// CUDA rotary kernel, torch-free: the launch shape (plan_launch) and the body
// each thread runs (rotary_thread), a host-device function. The launcher
// (cuda/rotary_launch.cu) calls it from a __global__ wrapper over the grid that
// plan_launch chose; the host emulation (csrc/ops/emulated/) calls it
// over the same grid on the CPU, so the indexing is tested without a GPU.
//
// Work split. A block handles one token at a time (grid-stride over tokens in
// x). Its threads form a (lanes x head-rows) tile: lane `tx` owns one "unit" of
// a head (a group of feature pairs, or of pass-through features when out of
// place) and keeps that unit's cos/sin in registers while it walks the heads
// of q and then k (stride blockDim.y * gridDim.y). When tokens are few
// (decode), gridDim.y > 1 splits the heads over blocks to fill the GPU.
#pragma once

#include <stdexcept>

#include "../rope.h"

namespace rope {
namespace gpu {

// Registers per thread every kernel fits in (tests/test_cuda_resources.py reads the built library):
// __launch_bounds__(threads, min_blocks(threads)) asks for that many resident blocks of `threads`
// threads in an SM's 64K registers.
constexpr int kMaxRegisters = 64;
constexpr int min_blocks(int threads) { return 65536 / (threads * kMaxRegisters); }

// Block and thread coordinates (the CUDA built-ins, or loop variables).
struct Coord {
  int64_t bx, by, tx, ty;
  int64_t bdx, bdy, gdx, gdy;
};

#if defined(__CUDACC__)
// The running thread's coordinates (what every __global__ wrapper passes its body).
__device__ __forceinline__ Coord this_thread() {
  return {blockIdx.x, blockIdx.y, threadIdx.x, threadIdx.y,
          blockDim.x, blockDim.y, gridDim.x,   gridDim.y};
}
#endif

// A naturally aligned word of 4, 8 or 16 bytes: the unit of one vector
// access (CUDA's built-in vector types on the GPU, so that nvcc emits single
// 64/128-bit loads and stores; a plain aligned struct on the host).
template <int Bytes>
struct Word;
#if defined(__CUDACC__)
template <>
struct Word<16> {
  using type = uint4;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<4> {
  using type = uint32_t;
};
#else
template <int Bytes>
struct alignas(Bytes) HostWord {
  uint32_t w[Bytes / 4];
};
template <int Bytes>
struct Word {
  using type = HostWord<Bytes>;
};
#endif

// Every global access of a body is reported through note_read / note_write (before it happens). On
// the GPU they are empty. The host emulation (ROPE_EMULATION, csrc/ops/emulated/) sets an
// AccessLog that finds two threads of one launch touching one byte, one of them writing (a race on
// the GPU), and that can undo a launch's writes to run it again in another order.
#if defined(ROPE_EMULATION)
struct AccessLog {
  virtual void read(const void* p, size_t bytes) = 0;
  virtual void write(void* p, size_t bytes) = 0;
};
inline thread_local AccessLog* access_log = nullptr;
inline void note_read(const void* p, size_t bytes) {
  if (access_log) access_log->read(p, bytes);
}
inline void note_write(void* p, size_t bytes) {
  if (access_log) access_log->write(p, bytes);
}
#else
ROPE_HD void note_read(const void*, size_t) {}
ROPE_HD void note_write(void*, size_t) {}
#endif

// The token's position at `offset` of the positions tensor.
template <class Pos>
ROPE_HD int64_t position_at(const RopeParams& p, int64_t offset) {
  note_read(static_cast<const Pos*>(p.positions) + offset, sizeof(Pos));
  return load_position<Pos>(p, offset);
}

// Bits of the elements of one vector access as 32-bit words, and back.
template <class T, int N>
ROPE_HD void to_words(const T* e, uint32_t* w) {
  if constexpr (sizeof(T) == 2) {
    for (int i = 0; i < N / 2; ++i) {
      uint16_t a, b;
      memcpy(&a, &e[2 * i], 2);
      memcpy(&b, &e[2 * i + 1], 2);
      w[i] = uint32_t(a) | (uint32_t(b) << 16);
    }
  } else {
    memcpy(w, e, sizeof(T) * N);
  }
}
template <class T, int N>
ROPE_HD void from_words(const uint32_t* w, T* e) {
  if constexpr (sizeof(T) == 2) {
    for (int i = 0; i < N / 2; ++i) {
      const uint16_t a = uint16_t(w[i] & 0xffffu), b = uint16_t(w[i] >> 16);
      memcpy(&e[2 * i], &a, 2);
      memcpy(&e[2 * i + 1], &b, 2);
    }
  } else {
    memcpy(e, w, sizeof(T) * N);
  }
}

#if defined(__CUDACC__)
ROPE_HD void set_word(uint4& d, const uint32_t* w) { d = make_uint4(w[0], w[1], w[2], w[3]); }
ROPE_HD void set_word(uint2& d, const uint32_t* w) { d = make_uint2(w[0], w[1]); }
ROPE_HD void get_word(const uint4& d, uint32_t* w) {
  w[0] = d.x, w[1] = d.y, w[2] = d.z, w[3] = d.w;
}
ROPE_HD void get_word(const uint2& d, uint32_t* w) { w[0] = d.x, w[1] = d.y; }
#else
template <int Bytes>
void set_word(HostWord<Bytes>& d, const uint32_t* w) {
  for (int i = 0; i < Bytes / 4; ++i) d.w[i] = w[i];
}
template <int Bytes>
void get_word(const HostWord<Bytes>& d, uint32_t* w) {
  for (int i = 0; i < Bytes / 4; ++i) w[i] = d.w[i];
}
#endif
ROPE_HD void set_word(uint32_t& d, const uint32_t* w) { d = w[0]; }
ROPE_HD void get_word(const uint32_t& d, uint32_t* w) { w[0] = d; }

// One global access of a whole word. On the GPU through the ld/st.global
// intrinsics, which keep the access a single 64/128-bit instruction (a plain
// dereference may be split into 32-bit accesses once the word is unpacked):
// activations through L2 only (.cg: each is read once), the cos/sin table
// (ReadOnly: never written while a kernel runs, every written tensor is checked
// disjoint from it, and re-read by every head of a token) through the read-only
// data cache (__ldg, ld.global.nc).
template <class W, bool ReadOnly = false>
ROPE_HD W load_word(const void* p) {
#if defined(__CUDA_ARCH__)
  if constexpr (ReadOnly)
    return __ldg(reinterpret_cast<const W*>(p));
  else
    return __ldcg(reinterpret_cast<const W*>(p));
#else
  return *reinterpret_cast<const W*>(p);
#endif
}
template <class W>
ROPE_HD void store_word(void* p, const W& w) {
#if defined(__CUDA_ARCH__)
  __stcg(reinterpret_cast<W*>(p), w);
#else
  *reinterpret_cast<W*>(p) = w;
#endif
}

ROPE_HD void assert_aligned(const void* ptr, int bytes) {
#if !defined(__CUDA_ARCH__)
  if (reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) != 0)
    throw std::logic_error("rope_ext: misaligned vector access in the CUDA kernel body");
#endif
}

// Elements of T per vector access when moving N of them (at most 16 bytes).
template <class T, int N>
constexpr int chunk_of() {
  return int(N * sizeof(T)) > 16 ? int(16 / sizeof(T)) : N;
}

// dst[0..N) = src[0..N); as 16-byte (or smaller, naturally aligned) vector
// accesses when Vectorized, element by element otherwise (ReadOnly: see
// load_word).
template <bool Vectorized, class T, int N, bool ReadOnly = false>
ROPE_HD void load_n(const T* src, T (&dst)[N]) {
  note_read(src, N * sizeof(T));
  // A single read-only element of 4 or 8 bytes (float64 interleaved: one pair per unit) is a word
  // too.
  if constexpr (Vectorized && (N > 1 || (ReadOnly && sizeof(T) >= 4))) {
    constexpr int chunk = chunk_of<T, N>();
    using W = typename Word<chunk* int(sizeof(T))>::type;
    ROPE_UNROLL
    for (int i = 0; i < N; i += chunk) {
      assert_aligned(src + i, int(sizeof(W)));
      uint32_t w[sizeof(W) / 4];
      get_word(load_word<W, ReadOnly>(src + i), w);
      from_words<T, chunk>(w, dst + i);
    }
  } else {
    ROPE_UNROLL
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

template <bool Vectorized, class T, int N>
ROPE_HD void store_n(T* dst, const T (&src)[N]) {
  note_write(dst, N * sizeof(T));
  if constexpr (Vectorized && N > 1) {
    constexpr int chunk = chunk_of<T, N>();
    using W = typename Word<chunk* int(sizeof(T))>::type;
    ROPE_UNROLL
    for (int i = 0; i < N; i += chunk) {
      assert_aligned(dst + i, int(sizeof(W)));
      uint32_t w[sizeof(W) / 4];
      to_words<T, chunk>(src + i, w);
      W word;
      set_word(word, w);
      store_word(dst + i, word);
    }
  } else {
    ROPE_UNROLL
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

// Elements per 16-byte access (1 on the scalar path) and pairs per unit.
template <class T, bool Vectorized>
constexpr int vec_width() {
  return Vectorized ? int(16 / sizeof(T)) : 1;
}
template <class T, bool Interleaved, bool Vectorized>
constexpr int pairs_per_unit() {
  return Interleaved ? (vec_width<T, Vectorized>() > 1 ? vec_width<T, Vectorized>() / 2 : 1)
                     : vec_width<T, Vectorized>();
}

// Launch shape, chosen on the host from the problem shape.
struct Launch {
  int64_t grid_x, grid_y, block_x, block_y;
  int64_t n_rot_units;   // per head: units of pairs_per_unit pairs
  int64_t n_pass_units;  // per head: units of vec_width pass-through features (0 in place)
  bool vectorized;
};

// Whether some tensor with work copies its pass-through features.
inline bool any_copy_pass(const RopeParams& p) {
  for (int t = 0; t < p.n_tensors; ++t)
    if (p.t[t].copy_pass && p.t[t].n_heads > 0) return true;
  return false;
}

// Whether every access of the vector path is aligned (for the element sizes
// of x and of the cache).
inline bool can_vectorize(const RopeParams& p) {
  const int x_size = dtype_size(p.x_dtype), cs_size = dtype_size(p.cs_dtype);
  const int64_t V = 16 / x_size;
  const int64_t r = p.rotary_dim, h = r / 2, D = p.head_dim;
  if (p.interleaved ? r % V != 0 : h % V != 0) return false;
  if (p.rot_offset % V != 0) return false;
  if (any_copy_pass(p) && (r % V != 0 || (D - r) % V != 0)) return false;
  for (int t = 0; t < p.n_tensors; ++t) {
    const RotTensor& rt = p.t[t];
    if (rt.n_heads == 0 || p.n_tokens == 0) continue;  // never accessed
    if (reinterpret_cast<uintptr_t>(rt.in) % 16 || reinterpret_cast<uintptr_t>(rt.out) % 16)
      return false;
    for (int d = 0; d < p.n_tok_dims; ++d)
      if (rt.in_tok_stride[d] % V || rt.out_tok_stride[d] % V) return false;
    for (int d = 0; d < rt.n_head_dims; ++d)
      if (rt.in_head_stride[d] % V || rt.out_head_stride[d] % V) return false;
  }
  const int64_t ppu = p.interleaved ? (V > 1 ? V / 2 : 1) : V;
  const int64_t chunk = ppu * cs_size > 16 ? 16 : ppu * cs_size;
  return reinterpret_cast<uintptr_t>(p.cos_sin) % chunk == 0 &&
         (p.cs_row_stride * cs_size) % chunk == 0 && (h * cs_size) % chunk == 0;
}

// The grid and block of a (lanes x head-rows) tile per token: sets grid_x,
// grid_y, block_x and block_y of l.
inline void shape_grid(Launch& l, int64_t lanes, int64_t heads, int64_t n_tokens, int64_t num_sms) {
  l.block_x = lanes < 256 ? lanes : 256;
  // About 128 threads per block, each walking a few heads with its cos/sin.
  const int64_t rows = l.block_x < 128 ? 128 / l.block_x : 1;
  l.block_y = heads < 1 ? 1 : (rows < heads ? rows : heads);
  // Prefill: as many blocks as fit on the GPU at once (16 blocks of <= 128
  // threads per SM), each striding over tokens.
  const int64_t resident = 16 * (num_sms < 1 ? 1 : num_sms);
  l.grid_x = n_tokens < resident ? n_tokens : resident;
  l.grid_y = 1;
  const int64_t target = 4 * num_sms;  // blocks that fill the GPU
  if (n_tokens < target && heads > 0) {
    // Few tokens (decode): spread the heads of each token over blocks.
    const int64_t per_token = (target + n_tokens - 1) / n_tokens;
    const int64_t rows_needed = (heads + per_token - 1) / per_token;
    if (rows_needed < l.block_y) l.block_y = rows_needed;
    l.grid_y = (heads + l.block_y - 1) / l.block_y;
    if (l.grid_y > 65535) l.grid_y = 65535;
  }
}

// The grid and block a launch on a GPU with `num_sms` SMs uses (the launcher
// and the host emulation both take it from here). force_scalar disables the
// 16-byte vector path (tests).
inline Launch plan_launch(const RopeParams& p, int64_t num_sms, bool force_scalar = false) {
  Launch l{};
  l.vectorized = !force_scalar && can_vectorize(p);
  const int64_t v = l.vectorized ? 16 / dtype_size(p.x_dtype) : 1;
  const int64_t ppu = p.interleaved ? (v > 1 ? v / 2 : 1) : v;
  l.n_rot_units = (p.rotary_dim / 2) / ppu;
  l.n_pass_units = any_copy_pass(p) ? (p.head_dim - p.rotary_dim) / v : 0;
  const int64_t lanes = l.n_rot_units + l.n_pass_units;
  int64_t heads = 0;
  for (int t = 0; t < p.n_tensors; ++t) heads += p.t[t].n_heads;
  shape_grid(l, lanes, heads, p.n_tokens, num_sms);
  return l;
}

// Whether the launch has any work (no block is launched otherwise).
inline bool has_work(const RopeParams& p, const Launch& l) {
  int64_t heads = 0;
  for (int t = 0; t < p.n_tensors; ++t) heads += p.t[t].n_heads;
  return p.n_tokens > 0 && heads > 0 && l.n_rot_units + l.n_pass_units > 0;
}

// A table value as C: the accumulator type (converted), or the table's own type (kept packed,
// converted where it is used: 16-bit cos/sin held as loaded take half the registers).
template <class C, class CS>
ROPE_HD C table_value(CS v) {
  if constexpr (std::is_same_v<C, CS>)
    return v;
  else
    return C(to_acc(v));
}
ROPE_HD float negated(float v) { return -v; }
ROPE_HD double negated(double v) { return -v; }
ROPE_HD Half negated(Half v) { return Half{uint16_t(v.bits ^ 0x8000u)}; }
ROPE_HD BFloat16 negated(BFloat16 v) { return BFloat16{uint16_t(v.bits ^ 0x8000u)}; }

// cos and sin (sin negated when `inverse`) of pairs [j0, j0 + P) from row
// `row` (in the cache) of the table.
template <class CS, bool Vectorized, class C, int P>
ROPE_HD void row_cos_sin(const RopeParams& p, int64_t row, int64_t j0, bool inverse, C (&cv)[P],
                         C (&sv)[P]) {
  const CS* r = static_cast<const CS*>(p.cos_sin) + row * p.cs_row_stride;
  CS cr[P], sr[P];
  load_n<Vectorized, CS, P, true>(r + j0, cr);
  load_n<Vectorized, CS, P, true>(r + p.rotary_dim / 2 + j0, sr);
  ROPE_UNROLL
  for (int k = 0; k < P; ++k) {
    cv[k] = table_value<C>(cr[k]);
    sv[k] = table_value<C>(inverse ? negated(sr[k]) : sr[k]);
  }
}

// cos and sin (sin negated when p.inverse) of pairs [j0, j0 + P) for the
// token whose positions start at offset pos_off; NaN for a position outside
// the cache (never read).
template <class CS, class Pos, bool Vectorized, class C, int P>
ROPE_HD void unit_cos_sin(const RopeParams& p, int64_t pos_off, int64_t j0, C (&cv)[P],
                          C (&sv)[P]) {
  const int64_t h = p.rotary_dim / 2;
  const CS* cs = static_cast<const CS*>(p.cos_sin);
  if (is_mrope(p)) {
    // MRoPE: each pair from the row of its section's position.
    ROPE_UNROLL
    for (int k = 0; k < P; ++k) {
      const int j = int(j0) + k;
      const int64_t pos = position_at<Pos>(p, pos_off + mrope_row(p, j) * p.pos_section_stride);
      if (position_in_cache(p, pos)) {
        const CS* row = cs + pos * p.cs_row_stride;
        note_read(row + j, sizeof(CS));
        note_read(row + h + j, sizeof(CS));
        cv[k] = table_value<C>(row[j]);
        sv[k] = table_value<C>(p.inverse ? negated(row[h + j]) : row[h + j]);
      } else {
        cv[k] = sv[k] = Store<C>::from(NAN);
      }
    }
    return;
  }
  const int64_t pos = position_at<Pos>(p, pos_off);
  if (position_in_cache(p, pos)) {
    row_cos_sin<CS, Vectorized>(p, pos, j0, p.inverse, cv, sv);
  } else {
    // Never read outside the cache: this token's rotated features are NaN.
    ROPE_UNROLL
    for (int k = 0; k < P; ++k) cv[k] = sv[k] = Store<C>::from(NAN);
  }
}

// One unit of P interleaved pairs from pair j0 of a head's rotary part `in`:
// y[2k], y[2k + 1] are pair j0 + k rotated by (cv[k], sv[k]).
template <bool Vectorized, class T, class C, int P>
ROPE_HD void rotate_unit(const T* in, int64_t j0, const C (&cv)[P], const C (&sv)[P],
                         T (&y)[2 * P]) {
  using A = typename Acc<T>::type;
  T x[2 * P];
  load_n<Vectorized>(in + 2 * j0, x);
  ROPE_UNROLL
  for (int k = 0; k < P; ++k) {
    A y1, y2;
    rotate_pair<A>(to_acc(x[2 * k]), to_acc(x[2 * k + 1]), A(to_acc(cv[k])), A(to_acc(sv[k])), y1,
                   y2);
    y[2 * k] = Store<T>::from(y1);
    y[2 * k + 1] = Store<T>::from(y2);
  }
}

// One unit of P half-split pairs from pair j0 (features j0 + k and h + j0 + k
// of a head's rotary part `in`): y1[k], y2[k] are pair j0 + k rotated.
template <bool Vectorized, class T, class C, int P>
ROPE_HD void rotate_unit(const T* in, int64_t h, int64_t j0, const C (&cv)[P], const C (&sv)[P],
                         T (&y1)[P], T (&y2)[P]) {
  using A = typename Acc<T>::type;
  T x1[P], x2[P];
  load_n<Vectorized>(in + j0, x1);
  load_n<Vectorized>(in + h + j0, x2);
  ROPE_UNROLL
  for (int k = 0; k < P; ++k) {
    A a, b;
    rotate_pair<A>(to_acc(x1[k]), to_acc(x2[k]), A(to_acc(cv[k])), A(to_acc(sv[k])), a, b);
    y1[k] = Store<T>::from(a);
    y2[k] = Store<T>::from(b);
  }
}

// The body of one CUDA thread.
template <class T, class CS, class Pos, bool Interleaved, bool Vectorized>
ROPE_HD void rotary_thread(const RopeParams& p, const Launch& l, const Coord& c) {
  using A = typename Acc<T>::type;
  constexpr int V = vec_width<T, Vectorized>();
  constexpr int P = pairs_per_unit<T, Interleaved, Vectorized>();
  const int64_t h = p.rotary_dim / 2;
  const int64_t n_lanes = l.n_rot_units + l.n_pass_units;
  const int64_t q_heads = p.t[0].n_heads;
  const int64_t heads = q_heads + (p.n_tensors > 1 ? p.t[1].n_heads : 0);

  for (int64_t token = c.bx; token < p.n_tokens; token += c.gdx) {
    const TokenOffsets o = token_offsets(p, token);
    for (int64_t lane = c.tx; lane < n_lanes; lane += c.bdx) {
      const bool rot = lane < l.n_rot_units;
      const int64_t j0 = lane * P;  // first pair of this unit
      A cv[P] = {}, sv[P] = {};
      if (rot) unit_cos_sin<CS, Pos, Vectorized>(p, o.pos, j0, cv, sv);
      for (int64_t head = c.ty + c.by * c.bdy; head < heads; head += c.bdy * c.gdy) {  // per head
        const int ti = head < q_heads ? 0 : 1;
        int64_t hin, hout;
        head_offsets(p.t[ti], ti ? head - q_heads : head, hin, hout);
        const T* in = static_cast<const T*>(p.t[ti].in) + (ti ? o.in[1] : o.in[0]) + hin;
        T* out = static_cast<T*>(p.t[ti].out) + (ti ? o.out[1] : o.out[0]) + hout;
        if (!rot) {
          if (!p.t[ti].copy_pass) continue;  // in place: already in the output
          // Pass-through features: [0, rot_offset), then [rot_offset + rotary_dim, head_dim).
          const int64_t f = (lane - l.n_rot_units) * V;
          const int64_t e = f < p.rot_offset ? f : f + p.rotary_dim;
          T x[V];
          load_n<Vectorized>(in + e, x);
          store_n<Vectorized>(out + e, x);
          continue;
        }
        in += p.rot_offset;
        out += p.rot_offset;
        if (Interleaved) {
          constexpr bool VecPairs = Vectorized && (2 * P == V);
          T y[2 * P];
          rotate_unit<VecPairs>(in, j0, cv, sv, y);
          store_n<VecPairs>(out + 2 * j0, y);
        } else {
          T y1[P], y2[P];
          rotate_unit<Vectorized>(in, h, j0, cv, sv, y1, y2);
          store_n<Vectorized>(out + j0, y1);
          store_n<Vectorized>(out + h + j0, y2);
        }
      }
    }
  }
}

// Calls f.template operator()<T, CS, Pos, Interleaved, Vectorized>().
template <class F>
void dispatch_cuda(const RopeParams& p, bool vectorized, F&& f) {
  dispatch_types(p, [&]<class T, class CS, class Pos, bool IL>() {
    if (vectorized)
      f.template operator()<T, CS, Pos, IL, true>();
    else
      f.template operator()<T, CS, Pos, IL, false>();
  });
}

}  // namespace gpu
}  // namespace rope

// CPU kernels of the rope_ext ops.
#include <strings.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <vector>

#include "../rope/angles.h"
#include "../rope/cpu/cpu.h"
#include "../rope/rope.h"
#include "binding.h"

namespace rope_ext {
namespace {

void check_positions_cpu(const rope::RopeParams& p) {
  int64_t value = 0;
  const int64_t token = first_bad_position(p, &value);
  ROPE_CHECK(std::out_of_range, token < 0, "positions must be in [0, cos_sin.shape[0]) = [0, ",
             p.n_cache_rows, "), got ", value);
}

// Whether torch's OpenMP workers sleep between parallel regions (OMP_WAIT_POLICY=passive).
bool workers_sleep() {
  static const bool passive = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy && strcasecmp(policy, "passive") == 0;
  }();
  return passive;
}

// Bytes a thread should move (read + written) before splitting pays for waking
// another one. While torch's OpenMP workers still spin from the last parallel
// region, waking them costs about as much as rotating 256 KiB; when they sleep
// about 100 us, so a thread then takes 1 MiB
// (benchmarks/cpu-serving.md, "Intel Xeon with AVX-512"). Smaller steps stay on the calling
// thread; larger ones split into one contiguous block of tokens per thread
// (torch::stable::parallel_for, so torch.set_num_threads applies).
int64_t min_bytes_per_chunk() { return workers_sleep() ? int64_t(1) << 20 : int64_t(256) << 10; }

// The grain is in the rotation's bytes. While the workers spin, an op with more arithmetic per byte
// counts each of its bytes that many times (its measured ratio to the rotation, rounded up:
// benchmarks/cpu-zen4.md), so that a decode step of a few tokens splits once its work pays for the
// wake-up. Sleeping workers take longer to wake than the work of any step the larger grain keeps on
// one thread, and there the bytes count once.
constexpr int64_t kNormWork = 3;
constexpr int64_t kFp8CacheWork = 2;

// One parallel pass over tokens of bytes_per_token each, of `work` times the rotation's arithmetic
// per byte: the calling thread alone below two threads' worth of min_bytes_per_chunk(), else blocks
// of at least that much each (parallel_for alone would split any call over its grain in halves).
template <class F>
void over_tokens(int64_t n_tokens, int64_t bytes_per_token, F&& f, int64_t work = 1) {
  const int64_t weighted = bytes_per_token * (workers_sleep() ? 1 : work);
  const int64_t grain =
      std::max<int64_t>(1, min_bytes_per_chunk() / std::max<int64_t>(1, weighted));
  const int64_t blocks = n_tokens / grain;
  if (blocks < 2) return f(int64_t(0), n_tokens);  // no call into the thread pool
  torch::stable::parallel_for(0, n_tokens, 1 + (n_tokens - 1) / blocks,
                              [&](int64_t begin, int64_t end) { f(begin, end); });
}

void launch_cpu(const rope::RopeParams& p, const Tensor&) {
  int64_t per_token = 0;  // bytes read + written per token
  for (int t = 0; t < p.n_tensors; ++t) per_token += 2 * p.t[t].n_heads * p.head_dim;
  over_tokens(p.n_tokens, per_token * rope::dtype_size(p.x_dtype),
              [&](int64_t begin, int64_t end) { rope::cpu::rotate_tokens(p, begin, end); });
}

void launch_cache_cpu(const rope::CacheParams& p, const Tensor&) {
  const int64_t es = rope::dtype_size(p.rope.x_dtype);
  const int64_t per_token =
      es * (2 * (p.rope.t[0].n_heads + p.rope.t[1].n_heads) * p.rope.head_dim +
            2 * p.n_kv_heads * (p.rope.head_dim + p.v_dim));
  over_tokens(
      p.rope.n_tokens, per_token,
      [&](int64_t begin, int64_t end) { rope::cpu::rotate_and_cache_tokens(p, begin, end); },
      p.cache_fp8 != rope::Fp8::kNone ? kFp8CacheWork : 1);
}

// The QK norm splits by the bytes of its q and k, at its work per byte (kNormWork) while OpenMP's
// workers spin; with sleeping workers, at their bytes alone (benchmarks/cpu-serving.md, "Threads").
void launch_norm_cpu(const rope::NormParams& p, const Tensor&) {
  const int64_t per_token = 2 * rope::dtype_size(p.rope.x_dtype) *
                            (p.rope.t[0].n_heads + p.rope.t[1].n_heads) * p.rope.head_dim;
  over_tokens(
      p.rope.n_tokens, per_token,
      [&](int64_t begin, int64_t end) { rope::cpu::norm_rotate_tokens(p, begin, end); }, kNormWork);
}

// The re-rotation splits by the bytes of its cache rows' rotated features (read and written).
void launch_rerotate_cpu(const rope::RerotateParams& p, const Tensor&) {
  const int64_t es = p.fp8 != rope::Fp8::kNone ? 1 : rope::dtype_size(p.rope.x_dtype);
  const int64_t per_token = 2 * es * p.rope.t[0].n_heads * p.rope.rotary_dim;
  over_tokens(p.rope.n_tokens, per_token,
              [&](int64_t begin, int64_t end) { rope::cpu::rerotate_tokens(p, begin, end); });
}

// The table-free rows, and the check that every angle could be formed: a NaN
// in a row is a position (or frequency) that gives none, raised before the op
// writes anything.
void launch_rows_cpu(const rope::AngleRows& ar, const Tensor&) {
  const rope::RopeParams& p = ar.rope;
  const int64_t per_token = int64_t(p.rotary_dim) * 64;  // about the cost of its pairs
  std::atomic<int64_t> first_nan{p.n_tokens};
  over_tokens(p.n_tokens, per_token, [&](int64_t begin, int64_t end) {
    const int64_t t = rope::cpu::angle_rows(ar, begin, end);
    int64_t seen = first_nan.load();
    while (t >= 0 && t < seen && !first_nan.compare_exchange_weak(seen, t)) {
    }
  });
  const int64_t t = first_nan.load();
  if (t == p.n_tokens) return;
  const int h = p.rotary_dim / 2;
  const int64_t off = rope::token_offsets(p, t).pos;
  int j = 0;
  double pos = 0, c = 0, s = 0;
  rope::dispatch_angle_rows(ar, [&]<class Pos, class>() {
    for (;; ++j) {
      pos = rope::position_value<Pos>(p, rope::pair_position_offset(p, off, j));
      rope::angle_cos_sin(pos, p.freqs[j], p.freqs[h + j], c, s);
      if (c != c || j + 1 == h) break;
    }
    pos = double(static_cast<const Pos*>(p.positions)[rope::pair_position_offset(p, off, j)]);
  });
  ROPE_CHECK(ValueError, false,
             "positions must give finite angles with the frequencies (finite, |position| <= "
             "2^53, |position * frequency| < 3.5e15): token ",
             t, " has position ", pos, " for pair ", j, " (frequency ", p.freqs[j], ", factor ",
             p.freqs[h + j], ")");
}

// The table-free rows of a call: one buffer per calling thread, grown to the
// largest call's rows and kept (fresh pages for every call would cost more
// than computing the rows), written by the call's workers.
void* host_scratch_cpu(size_t bytes) {
  thread_local std::vector<std::max_align_t> buffer;
  const size_t words = (bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t) + 4;
  if (buffer.size() < words) buffer.resize(words);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(std::max_align_t);
}

constexpr Backend kCpu{check_positions_cpu, launch_cpu,      launch_cache_cpu, launch_norm_cpu,
                       launch_rerotate_cpu, launch_rows_cpu, host_scratch_cpu};

std::string cpu_isa() { return rope::cpu::isa(); }
bool cpu_isa_supported(std::string name) { return rope::cpu::isa_supported(name.c_str()); }
bool set_cpu_isa(std::string name) { return rope::cpu::set_isa(name.c_str()); }
int64_t cpu_prefetch() { return rope::cpu::prefetch_distance(); }
bool set_cpu_prefetch(int64_t bytes) { return rope::cpu::set_prefetch_distance(bytes); }
int64_t cpu_prefetch_level() { return rope::cpu::prefetch_level(); }
bool set_cpu_prefetch_level(int64_t level) { return rope::cpu::set_prefetch_level(level); }

}  // namespace
}  // namespace rope_ext

STABLE_TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  rope_ext::impl_ops<rope_ext::kCpu>(m);
  m.impl("_page_table_slots", TORCH_BOX(&rope_ext::page_table_slots_op));
}

// An op without tensor arguments dispatches to its CompositeImplicitAutograd kernel.
STABLE_TORCH_LIBRARY_IMPL(rope_ext, CompositeImplicitAutograd, m) {
  m.impl("_cpu_isa", TORCH_BOX(&rope_ext::cpu_isa));
  m.impl("_cpu_isa_supported", TORCH_BOX(&rope_ext::cpu_isa_supported));
  m.impl("_set_cpu_isa", TORCH_BOX(&rope_ext::set_cpu_isa));
  m.impl("_cpu_prefetch", TORCH_BOX(&rope_ext::cpu_prefetch));
  m.impl("_set_cpu_prefetch", TORCH_BOX(&rope_ext::set_cpu_prefetch));
  m.impl("_cpu_prefetch_level", TORCH_BOX(&rope_ext::cpu_prefetch_level));
  m.impl("_set_cpu_prefetch_level", TORCH_BOX(&rope_ext::set_cpu_prefetch_level));
}

// Portable CPU kernel and the run-time choice of instruction set (cpu/cpu.h).
#include "kernel.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "cpu.h"
#include "fp8_rows.h"
#include "qk_norm.h"

namespace rope {
namespace cpu {

const RowOps detail::kRowsScalar = host::kPortableRows;

void detail::rotate_tokens_scalar(const RopeParams& p, int64_t begin, int64_t end) {
  dispatch_types(p, [&]<class T, class CS, class Pos, bool IL>() {
    host::rotate_tokens_impl<T, CS, Pos, IL, host::ScalarHead>(p, begin, end);
  });
}

void detail::norm_rotate_tokens_scalar(const NormParams& np, int64_t begin, int64_t end) {
  dispatch_types(np.rope, [&]<class T, class CS, class Pos, bool IL>() {
    host::norm_rotate_tokens_impl<T, CS, Pos, IL, host::ScalarHead>(np, begin, end);
  });
}

int64_t detail::angle_rows_scalar(const AngleRows& ar, int64_t begin, int64_t end) {
  return host::angle_rows(ar, begin, end);
}

namespace {

using Kernel = void (*)(const RopeParams&, int64_t, int64_t);
using NormKernel = void (*)(const NormParams&, int64_t, int64_t);
using RowsKernel = int64_t (*)(const AngleRows&, int64_t, int64_t);

struct Isa {
  const char* name;
  int rank;  // the environment variable's order: the best set of rank <= the one asked for
  Kernel kernel;
  bool (*supported)();
  NormKernel norm;     // the fused QK-RMSNorm + rotary
  const RowOps* rows;  // the serving ops' row kernels
  RowsKernel angles;   // the table-free rows
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// __builtin_cpu_supports reads the cpuid results cached by __builtin_cpu_init.
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
bool always() { return true; }

constexpr Isa kIsas[] = {
    {"scalar", 0, detail::rotate_tokens_scalar, always, detail::norm_rotate_tokens_scalar,
     &detail::kRowsScalar, detail::angle_rows_scalar},
    {"avx2", 1, detail::rotate_tokens_avx2, has_avx2, detail::norm_rotate_tokens_avx2,
     &detail::kRowsAvx2, detail::angle_rows_avx2},
    {"avx512", 2, detail::rotate_tokens_avx512, has_avx512, detail::norm_rotate_tokens_avx512,
     &detail::kRowsAvx512, detail::angle_rows_avx512},
    {"avx512_bf16", 3, detail::rotate_tokens_avx512_bf16, has_avx512_bf16,
     detail::norm_rotate_tokens_avx512_bf16, &detail::kRowsAvx512, detail::angle_rows_avx512},
};
#elif defined(__aarch64__)
bool always() { return true; }  // Advanced SIMD is part of every aarch64 CPU
constexpr Isa kIsas[] = {
    {"scalar", 0, detail::rotate_tokens_scalar, always, detail::norm_rotate_tokens_scalar,
     &detail::kRowsScalar, detail::angle_rows_scalar},
    {"neon", 1, detail::rotate_tokens_neon, always, detail::norm_rotate_tokens_scalar,
     &detail::kRowsScalar, detail::angle_rows_scalar},
};
#else
bool always() { return true; }
constexpr Isa kIsas[] = {
    {"scalar", 0, detail::rotate_tokens_scalar, always, detail::norm_rotate_tokens_scalar,
     &detail::kRowsScalar, detail::angle_rows_scalar},
};
#endif
constexpr int kNumIsas = int(sizeof(kIsas) / sizeof(kIsas[0]));

// Rank of a name of any architecture, or -1.
int rank_of(const char* name) {
  static constexpr struct {
    const char* name;
    int rank;
  } kRanks[] = {{"scalar", 0}, {"avx2", 1}, {"neon", 1}, {"avx512", 2}, {"avx512_bf16", 3}};
  for (const auto& r : kRanks)
    if (std::strcmp(r.name, name) == 0) return r.rank;
  return -1;
}

int find(const char* name) {
  for (int i = 0; i < kNumIsas; ++i)
    if (std::strcmp(kIsas[i].name, name) == 0) return i;
  return -1;
}

int initial_choice() {
  const char* env = std::getenv("ROPE_EXT_CPU_ISA");
  const int cap = env && rank_of(env) >= 0 ? rank_of(env) : 1 << 30;
  int best = 0;
  for (int i = 0; i < kNumIsas; ++i)
    if (kIsas[i].rank <= cap && kIsas[i].supported()) best = i;
  return best;
}

std::atomic<int>& current() {
  static std::atomic<int> index{initial_choice()};
  return index;
}

// The vendor's defaults (cpu.h): {distance, level}.
struct PrefetchDefault {
  int64_t bytes;
  int level;
};

PrefetchDefault vendor_prefetch() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return {kIntelPrefetch, 1};
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__builtin_cpu_is("amd") && __get_cpuid(1, &a, &b, &c, &d) &&
      ((a >> 8) & 0xf) + ((a >> 20) & 0xff) >= 0x19)  // family 19h on: Zen 3, Zen 4, Zen 5
    return {kAmdPrefetch, 2};
#endif
  return {0, 1};
}

// The integer in the environment variable `name` when it holds one in [lo, hi], else `fallback`.
int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  if (const char* env = std::getenv(name)) {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    if (*env && !*end && v >= lo && v <= hi) return v;
  }
  return fallback;
}

std::atomic<int64_t>& prefetch() {
  static std::atomic<int64_t> bytes{
      env_int("ROPE_EXT_CPU_PREFETCH", 0, kMaxPrefetch, vendor_prefetch().bytes)};
  return bytes;
}

std::atomic<int>& level() {
  static std::atomic<int> l{
      int(env_int("ROPE_EXT_CPU_PREFETCH_LEVEL", 1, 2, vendor_prefetch().level))};
  return l;
}

}  // namespace

void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end) {
  kIsas[current().load(std::memory_order_relaxed)].kernel(p, begin, end);
}

void norm_rotate_tokens(const NormParams& np, int64_t begin, int64_t end) {
  kIsas[current().load(std::memory_order_relaxed)].norm(np, begin, end);
}

int64_t angle_rows(const AngleRows& ar, int64_t begin, int64_t end) {
  return kIsas[current().load(std::memory_order_relaxed)].angles(ar, begin, end);
}

const RowOps& row_ops() { return *kIsas[current().load(std::memory_order_relaxed)].rows; }

const char* isa() { return kIsas[current().load(std::memory_order_relaxed)].name; }

bool isa_supported(const char* name) {
  const int i = find(name);
  return i >= 0 && kIsas[i].supported();
}

int64_t prefetch_distance() { return prefetch().load(std::memory_order_relaxed); }

int prefetch_level() { return level().load(std::memory_order_relaxed); }

bool hints(const RopeParams& p, int64_t head_bytes) {
  const int64_t min_bytes = prefetch_level() == 2 ? kL2PrefetchMinBytes : kPrefetchMinBytes;
  double heads = 0;  // the product in doubles: an expanded input's sizes may overflow int64
  for (int t = 0; t < p.n_tensors; ++t) heads += double(p.t[t].n_heads);
  return prefetch_distance() > 0 && head_bytes > 0 &&
         double(p.n_tokens) * heads * double(head_bytes) >= double(min_bytes);
}

bool set_prefetch_level(int64_t l) {
  if (l != 1 && l != 2) return false;
  level().store(int(l), std::memory_order_relaxed);
  return true;
}

bool set_prefetch_distance(int64_t bytes) {
  if (bytes < 0 || bytes > kMaxPrefetch) return false;
  prefetch().store(bytes, std::memory_order_relaxed);
  return true;
}

bool set_isa(const char* name) {
  if (!isa_supported(name)) return false;
  current().store(find(name), std::memory_order_relaxed);
  return true;
}

}  // namespace cpu
}  // namespace rope

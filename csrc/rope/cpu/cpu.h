// The CPU kernel's entry points. Torch-free; the caller (csrc/ops/ops_cpu.cpp)
// splits the tokens over threads.
#pragma once

#include <cstdint>

#include "../params.h"

namespace rope {
namespace cpu {

// Rotates tokens [begin, end) of every tensor in `p` (0 <= begin <= end <=
// p.n_tokens) with the instruction set chosen for this process (isa()).
// Positions must have been checked to lie in the cache (a position outside
// it still reads nothing and yields NaN). Distinct token ranges may run on
// different threads at once.
void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end);

// RoPE + KV-cache write of tokens [begin, end) of `cp` (cpu/kv_cache.cpp):
// rotates q and k (q into cp.q8 when q_out is fp8), then stores rotated k and
// v in the caches. Positions and slots must have been checked; distinct token
// ranges may run on different threads at once (distinct slots assumed).
void rotate_and_cache_tokens(const CacheParams& cp, int64_t begin, int64_t end);

// Re-rotation of the cached keys of tokens [begin, end) of `rp`
// (cpu/rerotate.cpp). Slots and deltas must have been checked (distinct
// slots, |delta| in the table); distinct token ranges may run on different
// threads at once.
void rerotate_tokens(const RerotateParams& rp, int64_t begin, int64_t end);

// The table-free rows of tokens [begin, end) of `ar` (params.h AngleRows;
// cpu/kernel.h angle_rows_impl). Distinct token ranges may run on different
// threads at once. Returns the first token of the range whose row holds a
// NaN (a position or frequency that gives no angle), or -1.
int64_t angle_rows(const AngleRows& ar, int64_t begin, int64_t end);

// QK-RMSNorm + rotary of tokens [begin, end) of `np` (cpu/kv_cache.cpp).
void norm_rotate_tokens(const NormParams& np, int64_t begin, int64_t end);

// Instruction sets of the CPU kernel, each a build of its own:
//   "scalar"       portable C++ (any CPU)
//   "avx2"         x86-64 AVX2 + FMA + F16C, 8 fp32 lanes
//   "avx512"       x86-64 AVX-512 F/BW/VL/DQ, 16 fp32 lanes, masked tails,
//                  bf16 rounded with integer instructions
//   "avx512_bf16"  "avx512" with the AVX512_BF16 conversion (vcvtneps2bf16)
//   "neon"         aarch64 Advanced SIMD, 4 fp32 lanes
// All compute in fp32 (fp64 for float64 inputs) and give the same results
// up to the fused multiply-adds of the vector paths (see README).
//
// The choice is made once, at the first call of any function here: the best
// set this CPU supports, or, when the environment variable ROPE_EXT_CPU_ISA
// names one, the best supported set no higher than it (scalar < avx2 = neon <
// avx512 < avx512_bf16). An unknown name is ignored (the Python package
// rejects it at import).
const char* isa();

// Whether `name` is one of the sets above and this CPU runs it.
bool isa_supported(const char* name);

// Makes `name` the set in use from now on, for calls that start after this
// returns; false (and no change) when !isa_supported(name). For tests and
// benchmarks that compare sets in one process.
bool set_isa(const char* name);

// Software prefetch in the token loops: before a head is rotated (or
// normalised), the head prefetch_distance() bytes further on in the loop's
// order (rounded up to whole heads: a later head of the token, or one of the
// next token's) is hinted into the cache level prefetch_level() (1: L1,
// `prefetcht0`; 2: L2, `prefetcht1`; kernel.h, Ahead), so that memory keeps
// streaming while the vector units work; a distance of 0 hints nothing. Both
// are set once, at the first call: from the environment variables
// ROPE_EXT_CPU_PREFETCH (bytes, 0 to kMaxPrefetch) and
// ROPE_EXT_CPU_PREFETCH_LEVEL (1 or 2) when they hold one, else by the CPU's
// vendor: 2048 bytes into L1 on Intel, 8192 bytes into L2 on AMD from family 19h
// (Zen 3 on; measured on a Xeon and a Zen 4: benchmarks/cpu-serving.md,
// benchmarks/cpu-zen4.md), none on others.
constexpr int64_t kMaxPrefetch = int64_t(1) << 20;
constexpr int64_t kIntelPrefetch = 2048;
constexpr int64_t kAmdPrefetch = 8192;
int64_t prefetch_distance();
int prefetch_level();

// Whether the call `p`, of rotated heads of `head_bytes` bytes, hints memory
// ahead: prefetch_distance() > 0 and its heads hold enough bytes (a smaller
// call, a decode step of a few tokens, finds its lines mostly in cache
// already, and the hints would only slow it). Hints into L1 wait for
// kPrefetchMinBytes (on a Xeon, 64 warm tokens in place took 3-5% longer with
// them); hints into L2 start at kL2PrefetchMinBytes (on a Zen 4, 64
// Llama-3-8B tokens from memory took 20-30% less with them in the cache write
// and the QK norm, 32 warm ones the same): benchmarks/cpu-serving.md,
// cpu-zen4.md. Defined in kernel.cpp, the portable build: an inline function
// here would be compiled into the vector builds too, and the linker could keep
// their copy.
constexpr int64_t kPrefetchMinBytes = int64_t(1) << 20;
constexpr int64_t kL2PrefetchMinBytes = int64_t(256) << 10;
bool hints(const RopeParams& p, int64_t head_bytes);

// Makes `bytes` the prefetch distance from now on; false (and no change)
// outside [0, kMaxPrefetch]. For tests and benchmarks.
bool set_prefetch_distance(int64_t bytes);

// Makes `level` (1 or 2) the cache level of the hints from now on; false
// (and no change) for another value. For tests and benchmarks.
bool set_prefetch_level(int64_t level);

}  // namespace cpu
}  // namespace rope

// The CPU kernel's entry points. Torch-free; the caller (csrc/ops/ops_cpu.cpp)
// splits the tokens over threads.
#pragma once

#include <cstdint>

#include "params.h"

namespace rope {
namespace cpu {

// Rotates tokens [begin, end) of every tensor in `p` (0 <= begin <= end <=
// p.n_tokens), choosing the instruction set of this machine at run time.
// Positions must have been checked to lie in the cache (a position outside
// it still reads nothing and yields NaN). Distinct token ranges may run on
// different threads at once.
void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end);

// Instruction set rotate_tokens uses on this machine: "avx2" or "scalar".
const char* isa();

}  // namespace cpu
}  // namespace rope

// Test support: the CUDA body of the table-free rows (rope/cuda/angles.cuh) run
// on the CPU over its grid (launch.h), for the emulated ops' table-free calls.
#include "emulated.h"

#define ROPE_EMULATION 1  // the bodies report their global accesses (launch.h)
#include "../../rope/cuda/angles.cuh"
#include "launch.h"

namespace rope_ext {

void emulated_angle_rows(const rope::AngleRows& ar, const Tensor&) {
  // A grid of a few SMs, so that blocks stride over the tokens.
  const auto l = rope::gpu::plan_angle_rows(ar, 2);
  if (ar.rope.n_tokens == 0) return;
  rope::dispatch_angle_rows(ar, [&]<class Pos, class R>() {
    run_grid(l, [&](const rope::gpu::Coord& c) { rope::gpu::angle_rows_thread<Pos, R>(ar, c); });
  });
}

}  // namespace rope_ext

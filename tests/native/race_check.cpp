// The emulated launch's checks (csrc/ops/emulated/launch.h) on toy bodies: a data race between two
// threads (a read and a write, two writes), a result that depends on the order threads run in, and
// a race-free launch that must pass and leave its result. Prints one line per case; exit 0 when
// every case behaves as expected.
#define ROPE_EMULATION 1
#include <cstdio>
#include <string>

#include "../../csrc/ops/emulated/launch.h"

namespace {

using rope::gpu::note_read;
using rope::gpu::note_write;
using rope_ext::AccessRecorder;

// Thread i stores x[i] + 1 into y[i]: no two threads share a byte.
void disjoint(int64_t i, const float* x, float* y) {
  note_read(x + i, sizeof(float));
  const float v = x[i] + 1;
  note_write(y + i, sizeof(float));
  y[i] = v;
}

// Thread i stores y[i + 1] + 1 into y[i]: thread i reads what thread i + 1 writes.
void reads_neighbour(int64_t i, int64_t n, float* y) {
  float v = 0;
  if (i + 1 < n) note_read(y + i + 1, sizeof(float)), v = y[i + 1];
  note_write(y + i, sizeof(float));
  y[i] = v + 1;
}

// Every thread stores its index into y[0].
void same_slot(int64_t i, float* y) {
  note_write(y, sizeof(float));
  y[0] = float(i);
}

// Thread i stores a count of the threads that ran before it (an unreported shared counter).
int counter = 0;
void order_dependent(int64_t i, float* y) {
  note_write(y + i, sizeof(float));
  y[i] = float(counter++);
}

template <class Body>
std::string outcome(int64_t n, Body&& body) {
  try {
    rope_ext::run_launch(
        n, [&](int64_t i, AccessRecorder& log) { log.thread = i, body(i); },
        [](int64_t t) { return "thread " + std::to_string(t); });
    return "ok";
  } catch (const std::logic_error& e) {
    return e.what();
  }
}

bool expect(const char* name, const std::string& got, const char* want) {
  const bool pass = got.find(want) != std::string::npos;
  std::printf("%s %s: %s\n", pass ? "PASS" : "FAIL", name, got.c_str());
  return pass;
}

}  // namespace

int main() {
  constexpr int64_t n = 64;
  float x[n], y[n];
  for (int64_t i = 0; i < n; ++i) x[i] = float(i), y[i] = -1;
  bool ok = expect("disjoint", outcome(n, [&](int64_t i) { disjoint(i, x, y); }), "ok");
  for (int64_t i = 0; i < n; ++i) ok = ok && y[i] == x[i] + 1;
  std::printf("%s disjoint result kept\n", ok ? "PASS" : "FAIL");
  ok &= expect("read-write", outcome(n, [&](int64_t i) { reads_neighbour(i, n, y); }),
               "data race in the CUDA kernel body: thread 0 reads a byte that thread 1 writes");
  ok &= expect("write-write", outcome(n, [&](int64_t i) { same_slot(i, y); }),
               "thread 1 writes a byte that thread 0 writes");
  ok &= expect("order", outcome(n, [&](int64_t i) { order_dependent(i, y); }),
               "depends on the order its threads run in");
  return ok ? 0 : 1;
}

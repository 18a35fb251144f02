// Test support (ROPE_EXT_TESTING=1 builds only): a CUDA launch run on the CPU so that what only
// parallel hardware shows still fails a test. run_launch runs the launch's threads one after
// another, twice: in launch order, and again in a shuffled order after undoing the first run's
// writes. Each run records every global access the bodies report (rope::gpu::note_read /
// note_write) and fails when a byte that one thread writes is read or written by another (a data
// race on the GPU); the two runs must write the same bytes with the same values.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef ROPE_EMULATION
#error "include emulated/launch.h after defining ROPE_EMULATION (before the CUDA bodies)"
#endif
#include "../../rope/cuda/rotary.cuh"

namespace rope_ext {

// The global accesses of one run of a launch, by thread.
class AccessRecorder final : public rope::gpu::AccessLog {
 public:
  int64_t thread = 0;  // the thread whose accesses are being reported

  void read(const void* p, size_t n) override { reads_.push_back({address(p), n, thread}); }
  void write(void* p, size_t n) override {
    writes_.push_back({address(p), n, thread});
    const auto* b = static_cast<const uint8_t*>(p);
    before_.insert(before_.end(), b, b + n);
  }

  // Throws std::logic_error naming the two threads (name(thread)) when a byte written by one thread
  // is read or written by another.
  template <class Name>
  void check_races(Name&& name) const {
    const std::vector<Access> written = segments(name);
    for (const Access& r : reads_) {
      // The segments that start before the read ends, back to the first one that ends after it
      // starts.
      auto it = std::upper_bound(written.begin(), written.end(), r.at + r.n,
                                 [](uintptr_t end, const Access& w) { return end <= w.at; });
      while (it != written.begin()) {
        --it;
        if (it->at + it->n <= r.at) break;
        if (it->thread != r.thread) race(name(it->thread), name(r.thread), "reads");
      }
    }
  }

  // Every byte written, with its value now: the written segments and their bytes.
  std::pair<std::vector<std::pair<uintptr_t, size_t>>, std::vector<uint8_t>> written() const {
    std::pair<std::vector<std::pair<uintptr_t, size_t>>, std::vector<uint8_t>> out;
    for (const Access& w : segments([](int64_t) { return std::string(); })) {
      out.first.emplace_back(w.at, w.n);
      const auto* b = reinterpret_cast<const uint8_t*>(w.at);
      out.second.insert(out.second.end(), b, b + w.n);
    }
    return out;
  }

  // Puts back what every write overwrote, the last write first.
  void undo() const {
    size_t end = before_.size();
    for (auto w = writes_.rbegin(); w != writes_.rend(); ++w) {
      end -= w->n;
      std::memcpy(reinterpret_cast<void*>(w->at), before_.data() + end, w->n);
    }
  }

 private:
  struct Access {
    uintptr_t at;
    size_t n;
    int64_t thread;
  };
  static uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
  // The written bytes as disjoint segments sorted by address, each written by one thread; throws
  // when two threads write one byte.
  template <class Name>
  std::vector<Access> segments(Name&& name) const {
    std::vector<Access> w(writes_);
    std::stable_sort(w.begin(), w.end(),
                     [](const Access& a, const Access& b) { return a.at < b.at; });
    std::vector<Access> out;
    for (const Access& a : w) {
      // Sorted by start, so a can only overlap the last segment.
      if (!out.empty() && a.at < out.back().at + out.back().n) {
        Access& last = out.back();
        if (last.thread != a.thread) race(name(last.thread), name(a.thread), "writes");
        last.n = std::max(last.at + last.n, a.at + a.n) - last.at;
      } else {
        out.push_back(a);
      }
    }
    return out;
  }
  [[noreturn]] static void race(const std::string& writer, const std::string& other,
                                const char* verb) {
    throw std::logic_error("rope_ext: data race in the CUDA kernel body: " + other + " " + verb +
                           " a byte that " + writer + " writes");
  }
  std::vector<Access> reads_, writes_;
  std::vector<uint8_t> before_;  // the bytes each write overwrote, in write order
};

// Sets the log the bodies report to, for the life of the object.
class Recording {
 public:
  explicit Recording(AccessRecorder& log) { rope::gpu::access_log = &log; }
  ~Recording() { rope::gpu::access_log = nullptr; }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
};

// Runs unit(i, log) for the n units of a launch (threads, or warps that set log.thread per lane),
// first in order 0..n-1, then, after undoing that run's writes, in a shuffled order; checks both
// runs for races (name(thread) names a thread in the message) and that they leave the same bytes.
template <class Unit, class Name>
void run_launch(int64_t n, Unit&& unit, Name&& name) {
  std::vector<int64_t> order(size_t(n > 0 ? n : 0));
  std::iota(order.begin(), order.end(), int64_t{0});
  auto run = [&](AccessRecorder& log) {
    const Recording on(log);
    for (const int64_t i : order) unit(i, log);
    log.check_races(name);
  };
  AccessRecorder first;
  run(first);
  const auto bytes = first.written();
  if (order.size() < 2) return;
  first.undo();
  std::shuffle(order.begin(), order.end(), std::mt19937_64(uint64_t(n)));
  AccessRecorder second;
  run(second);
  if (second.written() != bytes)
    throw std::logic_error(
        "rope_ext: the CUDA kernel body's result depends on the order its threads run in");
}

// run_launch over every thread of a rotary-style grid g: thread(coord).
template <class F>
void run_grid(const rope::gpu::Launch& g, F&& thread) {
  const int64_t per_block = g.block_x * g.block_y, n = per_block * g.grid_x * g.grid_y;
  auto coord = [&](int64_t i) {
    const int64_t b = i / per_block, t = i % per_block;
    return rope::gpu::Coord{b % g.grid_x, b / g.grid_x, t % g.block_x, t / g.block_x,
                            g.block_x,    g.block_y,    g.grid_x,      g.grid_y};
  };
  run_launch(
      n,
      [&](int64_t i, AccessRecorder& log) {
        log.thread = i;
        thread(coord(i));
      },
      [&](int64_t i) {
        const auto c = coord(i);
        std::ostringstream s;
        s << "thread (" << c.tx << ", " << c.ty << ") of block (" << c.bx << ", " << c.by << ")";
        return s.str();
      });
}

}  // namespace rope_ext

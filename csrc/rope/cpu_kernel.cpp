// Portable CPU kernel and the run-time choice between it and the AVX2 build.
#include "cpu_kernel.h"

#include "cpu.h"

namespace rope {
namespace cpu {

namespace {
bool use_avx2() {
  static const bool ok = detail::avx2_supported();
  return ok;
}
}  // namespace

bool detail::avx2_supported() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end) {
  if (use_avx2()) return detail::rotate_tokens_avx2(p, begin, end);
  dispatch_types(p, [&]<class T, class CS, class Pos, bool IL>() {
    host::rotate_tokens_impl<T, CS, Pos, IL, host::ScalarHead>(p, begin, end);
  });
}

const char* isa() { return use_avx2() ? "avx2" : "scalar"; }

}  // namespace cpu
}  // namespace rope

// Portable CPU kernel and the runtime choice between it and the AVX2 build.
#include "cpu_kernel.h"

namespace rope {
namespace cpu {

namespace {
bool use_avx2() {
  static const bool ok = detail::avx2_supported();
  return ok;
}
}  // namespace

void rotate_tokens(const RopeParams& p, int64_t begin, int64_t end) {
  if (use_avx2()) return detail::rotate_tokens_avx2(p, begin, end);
  dispatch_types(p, [&]<class T, class CS, class Pos, bool IL>() {
    detail::rotate_tokens_impl<T, CS, Pos, IL, detail::ScalarHead>(p, begin, end);
  });
}

const char* isa() { return use_avx2() ? "avx2" : "scalar"; }

}  // namespace cpu
}  // namespace rope

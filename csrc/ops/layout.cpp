#include "layout.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <utility>
#include <vector>

namespace rope_ext {
namespace {

std::array<int32_t, 2> device_codes(const Tensor& t) {
  std::array<int32_t, 2> c{};
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &c[0]));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &c[1]));
  return c;
}

}  // namespace

Layout::Layout(IntRef sizes, IntRef strides, int64_t elem_size, int64_t address)
    : size(sizes), stride(strides), element_size(elem_size), data(address) {
  int64_t below = 0, above = 0;  // elements before and after the first one
  for (int64_t d = 0; d < dim(); ++d) {
    if (size[d] == 0) return;  // no element: lo == hi
    const int64_t span = (size[d] - 1) * stride[d];
    (span < 0 ? below : above) += span;
  }
  lo = data + below * element_size;
  hi = data + (above + 1) * element_size;
}

Arg::Arg(const Tensor& t) : tensor_(&t), defined_(t.defined()), dtype_(), device_{} {
  if (!defined_) return;
  dtype_ = dtype_of(t);
  device_ = device_codes(t);
  layout_ = Layout(t);
}

Arg::Arg(const Arg& base, IntRef sizes, IntRef strides, int64_t offset)
    : tensor_(base.tensor_), defined_(true), dtype_(base.dtype_), device_(base.device_) {
  if (sizes.size() > size_t(kMaxViewDims) || strides.size() != sizes.size())
    throw std::logic_error("Arg view: at most 4 dims, as many strides as sizes");
  const size_t n = sizes.size();
  std::copy_n(sizes.begin(), n, view_size_);
  std::copy_n(strides.begin(), n, view_stride_);
  const Layout& b = base.layout_;
  layout_ = Layout(IntRef(view_size_, n), IntRef(view_stride_, n), b.element_size,
                   b.data + offset * b.element_size);
  // A view reaches only bytes of its base: a kernel given it cannot leave the base's storage.
  if (layout_.lo != layout_.hi && (b.lo == b.hi || layout_.lo < b.lo || layout_.hi > b.hi))
    throw std::logic_error("Arg view: reaches outside its base tensor");
}

bool Arg::same_device(const Tensor& t) const { return device_ == device_codes(t); }

namespace {

// Dims of t as (size, byte stride), size-1 dims dropped, innermost last, with
// contiguous neighbours merged. Returns the byte length of the innermost run.
int64_t runs_of(const Layout& t, std::vector<std::pair<int64_t, int64_t>>& outer) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size[d] != 1) dims.emplace_back(t.size[d], t.stride[d] * t.element_size);
  std::sort(dims.begin(), dims.end(),
            [](auto& a, auto& b) { return std::abs(a.second) > std::abs(b.second); });
  int64_t run = t.element_size;
  while (!dims.empty() && dims.back().second == run) {
    run *= dims.back().first;
    dims.pop_back();
  }
  // Outer dims that nest exactly (blocks of rows: [blocks, block_size] of a cache view) are one.
  outer.clear();
  for (const auto& [size, stride] : dims) {
    if (!outer.empty() && stride > 0 && outer.back().second == size * stride)
      outer.back() = {outer.back().first * size, stride};
    else
      outer.emplace_back(size, stride);
  }
  return run;
}

// A layout as rows: n rows `stride` bytes apart, each a contiguous run of
// `bytes` (every dim after the first contiguous in row-major order, size-1
// dims aside; stride >= bytes > 0 when there are several rows); bytes = 0
// when it is not one.
struct Rows {
  int64_t n = 1, stride = 0, bytes = 0;
};

Rows rows_of(const Layout& t) {
  int64_t run = 1;  // elements
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size[d] == 1) continue;
    if (t.stride[d] != run) return {};
    run *= t.size[d];
  }
  const int64_t n = t.dim() ? t.size[0] : 1;  // (the stride of a single row may be anything)
  Rows r{n, n > 1 ? t.stride[0] * t.element_size : 0, run * t.element_size};
  if (r.n > 1 && r.stride < r.bytes) return {};  // rows that overlap or step backwards
  return r;
}

// Byte offsets (from `base`) of every run start.
std::vector<int64_t> run_starts(const Layout& t, int64_t base,
                                const std::vector<std::pair<int64_t, int64_t>>& outer) {
  std::vector<int64_t> starts{t.data - base};
  for (auto [size, stride] : outer) {
    std::vector<int64_t> next;
    next.reserve(starts.size() * size);
    for (int64_t s : starts)
      for (int64_t i = 0; i < size; ++i) next.push_back(s + i * stride);
    starts.swap(next);
  }
  std::sort(starts.begin(), starts.end());
  return starts;
}

}  // namespace

bool self_overlaps(const Layout& t) {
  if (t.numel() <= 1) return false;
  // Strides that nest in the order of the dims, innermost last (a view of a
  // row-major tensor): no element twice, decided without sorting.
  int64_t reach = 1;
  for (int64_t d = t.dim() - 1; d >= 0 && reach > 0; --d) {
    if (t.size[d] <= 1) continue;
    const int64_t stride = std::abs(t.stride[d]);
    reach = stride < reach ? 0 : stride * (t.size[d] - 1) + reach;
  }
  if (reach > 0) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size[d] <= 1) continue;
    if (t.stride[d] == 0) return true;
    dims.emplace_back(t.size[d], std::abs(t.stride[d]));
  }
  std::sort(dims.begin(), dims.end(), [](auto& a, auto& b) { return a.second < b.second; });
  reach = 1;
  bool nested = true;
  for (auto [size, stride] : dims) {
    if (stride < reach) {
      nested = false;
      break;
    }
    reach = stride * (size - 1) + reach;
  }
  if (nested) return false;
  constexpr int64_t kMaxRuns = int64_t(1) << 22;
  std::vector<std::pair<int64_t, int64_t>> outer;
  const int64_t run = runs_of(t, outer);
  int64_t n_runs = 1;
  for (auto [size, stride] : outer)
    if ((n_runs *= size) > kMaxRuns) return true;
  const auto starts = run_starts(t, t.data, outer);
  for (size_t i = 1; i < starts.size(); ++i)
    if (starts[i] - starts[i - 1] < run) return true;
  return false;
}

bool overlaps(const Layout& a, const Layout& b) {
  if (a.lo == a.hi || b.lo == b.hi || a.hi <= b.lo || b.hi <= a.lo) return false;
  const int64_t pa = a.data, pb = b.data;
  // n rows one stride S apart in both (q, k and v sliced from one packed tensor):
  // runs [pa + i S, +la) and [pb + j S, +lb) meet iff some m = j - i in
  // [-(n - 1), n - 1] has pb - pa + m S in (-lb, la).
  const Rows ra = rows_of(a), rb = rows_of(b);
  if (ra.bytes && rb.bytes && ra.n == rb.n && (ra.n == 1 || ra.stride == rb.stride)) {
    if (ra.n == 1) return true;  // two runs whose extents meet
    const int64_t n = ra.n, S = ra.stride, delta = pb - pa;
    auto floor_div = [](int64_t x, int64_t y) {
      return x / y - ((x % y != 0) && ((x < 0) != (y < 0)));
    };
    const int64_t m_lo = std::max(-(n - 1), floor_div(-rb.bytes - delta, S) + 1);
    const int64_t m_hi = std::min(n - 1, -floor_div(-(ra.bytes - delta), S) - 1);
    return m_lo <= m_hi;
  }
  std::vector<std::pair<int64_t, int64_t>> oa, ob;
  const int64_t la = runs_of(a, oa), lb = runs_of(b, ob);
  // General case: list every contiguous run of both and sweep.
  const int64_t base = std::min(pa, pb);
  const auto sa = run_starts(a, base, oa), sb = run_starts(b, base, ob);
  size_t i = 0, j = 0;
  while (i < sa.size() && j < sb.size()) {
    if (sa[i] + la <= sb[j])
      ++i;
    else if (sb[j] + lb <= sa[i])
      ++j;
    else
      return true;
  }
  return false;
}

}  // namespace rope_ext

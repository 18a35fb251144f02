// A tensor's memory layout, and whether written elements overlap: the checks
// that make an in-place write safe (every element written once, nothing the
// call reads overwritten under it).
#pragma once

#include <cstdint>

#include "binding.h"

namespace rope_ext {

// A tensor's layout, read once (every query is a call into libtorch).
struct Layout {
  IntRef size, stride;  // views of the tensor's own (it outlives the Layout)
  int64_t element_size;
  int64_t data;  // address of the first element
  explicit Layout(const Tensor& t)
      : size(t.sizes()),
        stride(t.strides()),
        element_size(int64_t(t.element_size())),
        data(reinterpret_cast<int64_t>(t.data_ptr())) {}
  int64_t dim() const { return int64_t(size.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : size) n *= s;
    return n;
  }
};

// Whether two elements of t share memory. Strides that nest (each steps over
// everything the smaller ones reach) cannot overlap; strides that interleave
// (sizes [2, 3], strides [3, 2]) are decided exactly by listing the contiguous
// runs, or reported as overlapping when there are too many runs to list.
bool self_overlaps(const Layout& t);

// Whether a and b share an element. Tensors of different storages never do
// (their byte extents are disjoint), so only addresses are compared.
bool overlaps(const Layout& a, const Layout& b);

}  // namespace rope_ext

// A tensor's memory layout and the argument checks' view of a tensor (Arg),
// and whether written elements overlap: the checks that make an in-place
// write safe (every element written once, nothing the call reads overwritten
// under it).
#pragma once

#include <array>
#include <cstdint>

#include "checks.h"

namespace rope_ext {

// A tensor's layout, read once (every query is a call into libtorch), and the
// byte extent [lo, hi) of its elements (lo == hi: no element), which decides
// most overlap checks alone.
struct Layout {
  IntRef size, stride;  // views of the tensor's own, or of an Arg's (either outlives the Layout)
  int64_t element_size = 0;
  int64_t data = 0;  // address of the first element
  int64_t lo = 0, hi = 0;
  Layout() = default;  // no element
  Layout(IntRef sizes, IntRef strides, int64_t elem_size, int64_t address);
  explicit Layout(const Tensor& t)
      : Layout(t.sizes(), t.strides(), int64_t(t.element_size()),
               reinterpret_cast<int64_t>(t.data_ptr())) {}
  int64_t dim() const { return int64_t(size.size()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : size) n *= s;
    return n;
  }
};

// A tensor argument as the checks read it: each property queried once (every
// query is a call into libtorch), behind the Tensor queries the checks use. A
// view made from another Arg (the q and k columns of a packed qkv) needs no
// tensor and no call. Not copyable: a view's layout points into it.
class Arg {
 public:
  explicit Arg(const Tensor& t);
  // base's elements from element `offset` on, with these sizes and strides
  // (at most kMaxViewDims dims).
  Arg(const Arg& base, IntRef sizes, IntRef strides, int64_t offset);
  Arg(const Arg&) = delete;
  Arg& operator=(const Arg&) = delete;

  bool defined() const { return defined_; }
  int64_t dim() const { return layout_.dim(); }
  int64_t size(int64_t d) const { return layout_.size[d]; }
  int64_t stride(int64_t d) const { return layout_.stride[d]; }
  IntRef sizes() const { return layout_.size; }
  IntRef strides() const { return layout_.stride; }
  void* data_ptr() const { return reinterpret_cast<void*>(layout_.data); }
  torch::headeronly::ScalarType scalar_type() const { return dtype_; }
  const Layout& layout() const { return layout_; }
  // The tensor, or a view's base (its device, for messages).
  const Tensor& tensor() const { return *tensor_; }
  bool same_device(const Arg& o) const { return device_ == o.device_; }
  bool same_device(const Tensor& t) const;

 private:
  static constexpr int kMaxViewDims = 4;
  const Tensor* tensor_;
  bool defined_;
  torch::headeronly::ScalarType dtype_;
  std::array<int32_t, 2> device_;  // the shim's device type and index (no Device built)
  Layout layout_;
  int64_t view_size_[kMaxViewDims], view_stride_[kMaxViewDims];
};

inline torch::headeronly::ScalarType dtype_of(const Arg& a) { return a.scalar_type(); }
inline bool same_device(const Arg& a, const Arg& b) { return a.same_device(b); }
inline bool same_device(const Tensor& t, const Arg& a) { return a.same_device(t); }
inline std::string device_str(const Arg& a) { return device_str(a.tensor()); }

// Whether two elements of t share memory. Strides that nest (each steps over
// everything the smaller ones reach) cannot overlap; strides that interleave
// (sizes [2, 3], strides [3, 2]) are decided exactly by listing the contiguous
// runs, or reported as overlapping when there are too many runs to list.
bool self_overlaps(const Layout& t);

// Whether a and b share an element. Tensors of different storages never do
// (their byte extents are disjoint), so only addresses are compared.
bool overlaps(const Layout& a, const Layout& b);

}  // namespace rope_ext

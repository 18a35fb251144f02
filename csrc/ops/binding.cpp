#include "binding.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "../rope/rope.h"

namespace rope_ext {

using torch::headeronly::ScalarType;
using ValueError = std::invalid_argument;

std::string shape_str(IntRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::vector<int64_t> sizes_of(const Tensor& t) {
  const auto s = t.sizes();
  return {s.begin(), s.end()};
}

std::vector<int64_t> strides_of(const Tensor& t) {
  const auto s = t.strides();
  return {s.begin(), s.end()};
}

namespace {

struct Dim {
  int64_t size;
  std::array<int64_t, 5> stride;  // positions, q in, q out, k in, k out
};

// Dims of one tensor on the stack (no allocation per call): at most kMaxRank.
constexpr int64_t kMaxRank = 64;
struct Dims {
  std::array<Dim, kMaxRank> d;
  size_t n = 0;
  void push_back(const Dim& x) { d[n++] = x; }
  size_t size() const { return n; }
  bool empty() const { return n == 0; }
  Dim& back() { return d[n - 1]; }
  const Dim& operator[](size_t i) const { return d[i]; }
  const Dim* begin() const { return d.data(); }
  const Dim* end() const { return d.data() + n; }
};

bool is_supported_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half ||
         t == ScalarType::BFloat16;
}

rope::DType to_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return rope::DType::kFloat32;
    case ScalarType::Double:
      return rope::DType::kFloat64;
    case ScalarType::Half:
      return rope::DType::kFloat16;
    default:
      return rope::DType::kBFloat16;
  }
}

std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  return str(t.is_cuda() ? "cuda:" : "device ", int(t.get_device_index()));
}

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

void check_input(const Tensor& x, const char* name) {
  ROPE_CHECK(TypeError, x.defined(), name, " must be a tensor, got None");
  ROPE_CHECK(TypeError, is_supported_float(x.scalar_type()), name,
             " must be a floating tensor (float32, float64, float16 or bfloat16), got ",
             x.scalar_type());
  const int64_t dim = x.dim();
  ROPE_CHECK(ValueError, dim <= kMaxRank, name, " must have at most ", kMaxRank, " dims, got ",
             dim);
  ROPE_CHECK(ValueError, dim >= 1, name,
             " must have at least one dim [..., head_dim], got a scalar");
  const int64_t d = x.size(dim - 1);
  ROPE_CHECK(ValueError, d <= rope::kMaxHeadDim, name, ".shape[-1] (head_dim) must be at most ",
             rope::kMaxHeadDim, ", got ", d);
  ROPE_CHECK(ValueError, d <= 1 || x.stride(dim - 1) == 1, name,
             " must have a contiguous last dim (stride 1), got strides ", shape_str(x.strides()));
}

// Byte extent [lo, hi) of the elements of t.
std::pair<int64_t, int64_t> extent(const Layout& t) {
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size[d] - 1) * t.stride[d];
    (span < 0 ? lo : hi) += span;
  }
  const int64_t es = t.element_size;
  return {t.data + lo * es, t.data + (hi + 1) * es};
}

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
  outer = dims;
  return run;
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

// Whether two elements of t share memory. Strides that nest (each steps over
// everything the smaller ones reach) cannot overlap; strides that interleave
// (sizes [2, 3], strides [3, 2]) are decided exactly by listing the contiguous
// runs, or reported as overlapping when there are too many runs to list.
bool self_overlaps(const Layout& t) {
  if (t.numel() <= 1) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size[d] <= 1) continue;
    if (t.stride[d] == 0) return true;
    dims.emplace_back(t.size[d], std::abs(t.stride[d]));
  }
  std::sort(dims.begin(), dims.end(), [](auto& a, auto& b) { return a.second < b.second; });
  int64_t reach = 1;
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

// Whether a and b share an element. Tensors of different storages never do
// (their byte extents are disjoint), so only addresses are compared.
bool overlaps(const Layout& a, const Layout& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [alo, ahi] = extent(a);
  const auto [blo, bhi] = extent(b);
  if (ahi <= blo || bhi <= alo) return false;
  std::vector<std::pair<int64_t, int64_t>> oa, ob;
  const int64_t la = runs_of(a, oa), lb = runs_of(b, ob);
  const int64_t pa = a.data, pb = b.data;
  if (oa.size() == 1 && ob.size() == 1 && oa[0] == ob[0] && oa[0].second > 0) {
    // Same single outer dim (q and k sliced from one packed tensor): runs
    // [pa + i S, +la) and [pb + j S, +lb) meet iff some m = j - i in
    // (-(n-1), n-1) has pb - pa + m S in (-lb, la).
    const int64_t n = oa[0].first, S = oa[0].second, delta = pb - pa;
    auto floor_div = [](int64_t x, int64_t y) {
      return x / y - ((x % y != 0) && ((x < 0) != (y < 0)));
    };
    const int64_t m_lo = std::max(-(n - 1), floor_div(-lb - delta, S) + 1);
    const int64_t m_hi = std::min(n - 1, -floor_div(-(la - delta), S) - 1);
    return m_lo <= m_hi;
  }
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

// Drops size-1 dims and merges neighbours that are contiguous in every stride.
Dims coalesce(const Dims& dims, int n_strides) {
  Dims out;
  for (const Dim& d : dims) {
    if (d.size == 1) continue;
    if (!out.empty() && d.size != 0 && out.back().size != 0) {
      Dim& prev = out.back();
      bool mergeable = true;
      for (int s = 0; s < n_strides; ++s)
        mergeable = mergeable && prev.stride[s] == d.stride[s] * d.size;
      if (mergeable) {
        prev.size *= d.size;
        prev.stride = d.stride;
        continue;
      }
    }
    out.push_back(d);
  }
  return out;
}

void fill_heads(rope::RotTensor& t, const Dims& dims) {
  ROPE_CHECK(ValueError, dims.size() <= size_t(rope::kMaxDims),
             "too many batch dims that cannot be merged (at most ", rope::kMaxDims, ")");
  t.n_head_dims = int(dims.size());
  t.n_heads = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    t.head_size[i] = dims[i].size;
    t.in_head_stride[i] = dims[i].stride[0];
    t.out_head_stride[i] = dims[i].stride[1];
    t.n_heads *= dims[i].size;
  }
}

}  // namespace

void check_writable(const Tensor& q, const Tensor* k) {
  const Layout ql(q);
  ROPE_CHECK(ValueError, !self_overlaps(ql),
             "q has elements that overlap in memory (expanded or stride-0 view, strides ",
             shape_str(ql.stride), "); an in-place rotation needs a writable tensor");
  if (!k) return;
  const Layout kl(*k);
  ROPE_CHECK(ValueError, !self_overlaps(kl),
             "k has elements that overlap in memory (expanded or stride-0 view, strides ",
             shape_str(kl.stride), "); an in-place rotation needs a writable tensor");
  ROPE_CHECK(ValueError, !overlaps(ql, kl),
             "q and k overlap in memory; an in-place rotation needs separate tensors");
}

rope::RopeParams make_params(const Tensor& q_in, const Tensor& q_out, const Tensor* k_in,
                             const Tensor* k_out, const Tensor& positions, const Tensor& cos_sin,
                             bool interleaved, bool inverse, int64_t rotary_offset,
                             const Sections& mrope_section, bool mrope_interleaved,
                             const char* q_name, bool per_token) {
  const char* xname = q_name ? q_name : (k_in ? "q" : "x");
  check_input(q_in, xname);
  const ScalarType dtype = q_in.scalar_type();
  const Layout qi(q_in);
  const Layout qo = &q_out == &q_in ? qi : Layout(q_out);
  const int64_t head_dim = qi.size.back();
  std::optional<Layout> ki, ko;
  if (k_in) {
    check_input(*k_in, "k");
    ROPE_CHECK(TypeError, k_in->scalar_type() == dtype, "k must have the dtype of q (", dtype,
               "), got ", k_in->scalar_type());
    ROPE_CHECK(ValueError, k_in->device() == q_in.device(), "k must be on the device of q (",
               device_str(q_in), "), got ", device_str(*k_in));
    ki.emplace(*k_in);
    ko = k_out == k_in ? ki : std::optional<Layout>(Layout(*k_out));
    ROPE_CHECK(ValueError, ki->dim() == qi.dim(), "k must have the rank of q (", qi.dim(),
               "), got shape ", shape_str(ki->size));
    ROPE_CHECK(ValueError, ki->size.back() == head_dim, "k must have the head_dim of q (", head_dim,
               "), got ", ki->size.back());
  }

  ROPE_CHECK(TypeError, cos_sin.defined(), "cos_sin must be a tensor, got None");
  const IntRef cs_size = cos_sin.sizes(), cs_stride = cos_sin.strides();
  ROPE_CHECK(ValueError, cs_size.size() == 2,
             "cos_sin must have shape [positions, rotary_dim], got shape ", shape_str(cs_size));
  const ScalarType cs_dtype = cos_sin.scalar_type();
  ROPE_CHECK(TypeError, cs_dtype == ScalarType::Float || cs_dtype == dtype,
             "cos_sin must be float32 or the dtype of ", xname, " (", dtype, "), got ", cs_dtype);
  ROPE_CHECK(ValueError, cos_sin.device() == q_in.device(), "cos_sin must be on the device of ",
             xname, " (", device_str(q_in), "), got ", device_str(cos_sin));
  const int64_t rotary_dim = cs_size[1];
  ROPE_CHECK(ValueError, rotary_dim > 0 && rotary_dim % 2 == 0,
             "rotary_dim (cos_sin.shape[-1]) must be even and positive, got ", rotary_dim);
  ROPE_CHECK(ValueError, rotary_dim <= head_dim, "rotary_dim (cos_sin.shape[-1] = ", rotary_dim,
             ") must be <= head_dim (", xname, ".shape[-1] = ", head_dim, ")");
  ROPE_CHECK(ValueError, rotary_offset >= 0 && rotary_offset <= head_dim - rotary_dim,
             "rotary_offset must be in [0, head_dim - rotary_dim] = [0, ", head_dim - rotary_dim,
             "] (", xname, ".shape[-1] = ", head_dim,
             ", rotary_dim = cos_sin.shape[-1] = ", rotary_dim, "), got ", rotary_offset);
  ROPE_CHECK(ValueError, cs_stride[1] == 1, "cos_sin must have a contiguous last dim, got strides ",
             shape_str(cs_stride));

  ROPE_CHECK(TypeError, positions.defined(), "positions must be a tensor, got None");
  const ScalarType pos_dtype = positions.scalar_type();
  ROPE_CHECK(TypeError, pos_dtype == ScalarType::Int || pos_dtype == ScalarType::Long,
             "positions must be an int32 or int64 tensor, got ", pos_dtype);
  ROPE_CHECK(ValueError, positions.device() == q_in.device(), "positions must be on the device of ",
             xname, " (", device_str(q_in), "), got ", device_str(positions));

  // MRoPE: positions [3, ...]; the broadcast below is of positions[0] (its
  // sizes and strides, same data pointer), and sections 1 and 2 sit at the
  // same offsets plus a multiple of stride(0).
  const bool mrope = mrope_section.has_value();
  ROPE_CHECK(ValueError, mrope || !mrope_interleaved, "mrope_interleaved needs mrope_section");
  int mrope_sec[3] = {0, 0, 0};
  int64_t section_stride = 0;
  IntRef pos_sizes = positions.sizes(), pos_strides = positions.strides();
  if (mrope) {
    const auto& sec = *mrope_section;
    const bool ok = sec.size() == 3 && sec[0] >= 0 && sec[1] >= 0 && sec[2] >= 0 &&
                    sec[0] + sec[1] + sec[2] == rotary_dim / 2;
    ROPE_CHECK(ValueError, ok,
               "mrope_section must be 3 non-negative ints (temporal, height, width) summing "
               "to rotary_dim / 2 = ",
               rotary_dim / 2, ", got ", shape_str(sec));
    ROPE_CHECK(ValueError, !pos_sizes.empty() && pos_sizes[0] == 3,
               "positions must have a leading section dim of size 3 ([3, ...]) with "
               "mrope_section, got shape ",
               shape_str(pos_sizes));
    for (int s = 0; s < 3; ++s) mrope_sec[s] = int(sec[s]);
    section_stride = pos_strides[0];
    pos_sizes = pos_sizes.slice(1);
    pos_strides = pos_strides.slice(1);
  }

  const int64_t n = qi.dim() - 1;
  const IntRef qb = qi.size.slice(0, n);
  const IntRef kb = ki ? ki->size.slice(0, n) : qb;
  auto not_broadcastable = [&](const char* target, IntRef shape) {
    return str("positions of shape ", shape_str(pos_sizes), " must be broadcastable to ", target,
               ".shape[:-1] = ", shape_str(shape));
  };
  // per_token: positions [T] for q [T, H, D] read as [T, 1] (one trailing dim of size 1).
  const int64_t virt = per_token && int64_t(pos_sizes.size()) == n - 1 ? 1 : 0;
  const int64_t pos_dim = int64_t(pos_sizes.size()) + virt;
  ROPE_CHECK(ValueError, pos_dim <= n, not_broadcastable(xname, qb));

  Dims tok, qh, kh;
  for (int64_t d = 0; d < n; ++d) {
    const int64_t pd = d - (n - pos_dim);
    const bool real = pd >= 0 && pd < pos_dim - virt;
    const int64_t psize = real ? pos_sizes[pd] : 1;
    const int64_t pstride = real && psize > 1 ? pos_strides[pd] : 0;
    ROPE_CHECK(ValueError, psize == 1 || psize == qb[d], not_broadcastable(xname, qb));
    ROPE_CHECK(ValueError, psize == 1 || psize == kb[d], not_broadcastable("k", kb));
    const int64_t qin = qi.stride[d], qout = qo.stride[d];
    const int64_t kin = ki ? ki->stride[d] : 0, kout = ko ? ko->stride[d] : 0;
    if (pstride != 0) {
      tok.push_back(Dim{psize, {pstride, qin, qout, kin, kout}});
    } else {
      qh.push_back(Dim{qb[d], {qin, qout}});
      kh.push_back(Dim{kb[d], {kin, kout}});
    }
  }
  tok = coalesce(tok, 5);
  ROPE_CHECK(ValueError, tok.size() <= size_t(rope::kMaxDims),
             "too many batch dims that cannot be merged (at most ", rope::kMaxDims, ")");

  rope::RopeParams p{};
  p.n_tensors = k_in ? 2 : 1;
  p.n_tok_dims = int(tok.size());
  p.n_tokens = 1;
  for (size_t i = 0; i < tok.size(); ++i) {
    p.tok_size[i] = tok[i].size;
    p.pos_stride[i] = tok[i].stride[0];
    for (int t = 0; t < 2; ++t) {
      p.t[t].in_tok_stride[i] = tok[i].stride[1 + 2 * t];
      p.t[t].out_tok_stride[i] = tok[i].stride[2 + 2 * t];
    }
    p.n_tokens *= tok[i].size;
  }
  // A separate output gets the pass-through features copied; in place (the
  // same memory with the same layout) they are already there.
  auto same = [](const Layout& a, const Layout& b) {
    return a.data == b.data && a.stride.equals(b.stride);
  };
  p.t[0].in = reinterpret_cast<void*>(qi.data);
  p.t[0].out = reinterpret_cast<void*>(qo.data);
  p.t[0].copy_pass = !same(qi, qo);
  fill_heads(p.t[0], coalesce(qh, 2));
  if (k_in) {
    p.t[1].in = reinterpret_cast<void*>(ki->data);
    p.t[1].out = reinterpret_cast<void*>(ko->data);
    p.t[1].copy_pass = !same(*ki, *ko);
    fill_heads(p.t[1], coalesce(kh, 2));
  }
  p.positions = positions.data_ptr();
  for (int i = 0; i < 3; ++i) p.mrope_section[i] = mrope_sec[i];
  p.mrope_interleaved = mrope_interleaved;
  p.pos_section_stride = section_stride;
  p.pos_int64 = pos_dtype == ScalarType::Long;
  p.cos_sin = cos_sin.data_ptr();
  p.cs_row_stride = cs_stride[0];
  p.n_cache_rows = cs_size[0];
  p.head_dim = int(head_dim);
  p.rotary_dim = int(rotary_dim);
  p.rot_offset = int(rotary_offset);
  p.interleaved = interleaved;
  p.inverse = inverse;
  p.x_dtype = to_dtype(dtype);
  p.cs_dtype = to_dtype(cs_dtype);
  return p;
}

int64_t first_bad_position(const rope::RopeParams& p, int64_t* value) {
  const int sections = rope::is_mrope(p) ? 3 : 1;
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    const int64_t base = rope::token_offsets(p, t).pos;
    for (int s = 0; s < sections; ++s) {
      const int64_t off = base + s * p.pos_section_stride;
      const int64_t pos =
          p.pos_int64 ? rope::load_position<int64_t>(p, off) : rope::load_position<int32_t>(p, off);
      if (!rope::position_in_cache(p, pos)) {
        *value = pos;
        return t;
      }
    }
  }
  return -1;
}

namespace {

void run(const rope::RopeParams& p, const Tensor& q, const Backend& backend) {
  int64_t heads = 0;
  for (int t = 0; t < p.n_tensors; ++t) heads += p.t[t].n_heads;
  if (p.n_tokens == 0 || heads == 0) return;  // empty: nothing to read or write
  if (backend.check_positions) backend.check_positions(p);
  backend.launch(p, q);
}

// Output for x: x's layout (empty_like), unless that leaves the last dim
// strided, as it does for some expanded inputs (sizes [1, 2, 3], strides
// [1, 0, 1] give [1, 1, 2]); then row-major.
Tensor empty_output(const Tensor& x) {
  Tensor out = torch::stable::empty_like(x);
  const int64_t dim = out.dim();
  if (dim > 0 && out.size(dim - 1) > 1 && out.stride(dim - 1) != 1)
    out = torch::stable::empty(x.sizes(), x.scalar_type(), std::nullopt, x.device());
  return out;
}

}  // namespace

Tensor rotary(const Tensor& x, const Tensor& positions, const Tensor& cos_sin, bool interleaved,
              bool inverse, int64_t rotary_offset, const Sections& mrope_section,
              bool mrope_interleaved, const Backend& backend) {
  check_input(x, "x");
  Tensor out = empty_output(x);
  const auto p = make_params(x, out, nullptr, nullptr, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  run(p, x, backend);
  return out;
}

std::tuple<Tensor, Tensor> rotary_qk(const Tensor& q, const Tensor& k, const Tensor& positions,
                                     const Tensor& cos_sin, bool interleaved, bool inverse,
                                     int64_t rotary_offset, const Sections& mrope_section,
                                     bool mrope_interleaved, const Backend& backend) {
  check_input(q, "q");
  check_input(k, "k");
  Tensor q_out = empty_output(q), k_out = empty_output(k);
  const auto p = make_params(q, q_out, &k, &k_out, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  run(p, q, backend);
  return {q_out, k_out};
}

void rotary_qk_(const Tensor& q, const std::optional<Tensor>& k, const Tensor& positions,
                const Tensor& cos_sin, bool interleaved, bool inverse, int64_t rotary_offset,
                const Sections& mrope_section, bool mrope_interleaved, const Backend& backend) {
  const Tensor* kp = k.has_value() && k->defined() ? &*k : nullptr;
  const auto p = make_params(q, q, kp, kp, positions, cos_sin, interleaved, inverse, rotary_offset,
                             mrope_section, mrope_interleaved, "q");
  check_writable(q, kp);
  run(p, q, backend);
}

}  // namespace rope_ext

// ---------------------------------------------------------------------------
// Serving ops.

namespace rope_ext {
namespace {

// The fp8 storage of a tensor of dtype t, or kNone.
rope::Fp8 fp8_of(ScalarType t) {
  return t == ScalarType::Float8_e4m3fn ? rope::Fp8::kE4M3
         : t == ScalarType::Float8_e5m2 ? rope::Fp8::kE5M2
                                        : rope::Fp8::kNone;
}

// A [T, H, dim] tensor with a contiguous last dim.
void check_3d(const Tensor& x, const char* name, const char* shape) {
  ROPE_CHECK(TypeError, x.defined(), name, " must be a tensor, got None");
  ROPE_CHECK(ValueError, x.dim() == 3, name, " must be ", shape, ", got shape ",
             shape_str(x.sizes()));
  ROPE_CHECK(ValueError, x.size(2) <= 1 || x.stride(2) == 1, name,
             " must have a contiguous last dim (stride 1), got strides ", shape_str(x.strides()));
}

// A one-element float32 scale on x's device (null when absent).
const float* scale_ptr(const std::optional<Tensor>& s, const char* name, const Tensor& x) {
  if (!s.has_value() || !s->defined()) return nullptr;
  ROPE_CHECK(TypeError, s->scalar_type() == ScalarType::Float, name,
             " must be a float32 tensor of one element, got ", s->scalar_type());
  ROPE_CHECK(ValueError, s->numel() == 1, name, " must have one element, got shape ",
             shape_str(s->sizes()));
  ROPE_CHECK(ValueError, s->device() == x.device(), name, " must be on the device of q (",
             device_str(x), "), got ", device_str(*s));
  return static_cast<const float*>(s->data_ptr());
}

void check_disjoint(const Layout& a, const char* an, const Layout& b, const char* bn) {
  ROPE_CHECK(ValueError, !overlaps(a, b), an, " and ", bn,
             " overlap in memory; they must be separate tensors");
}

void check_no_self_overlap(const Layout& t, const char* name) {
  ROPE_CHECK(ValueError, !self_overlaps(t), name,
             " has elements that overlap in memory (expanded or stride-0 view, strides ",
             shape_str(t.stride), "); it is written in place");
}

// The rotation's tokens must be the T rows of q, one position each.
void check_tokens(const rope::RopeParams& p, int64_t T) {
  ROPE_CHECK(ValueError, p.n_tok_dims <= 1 && (p.n_tokens == T || T <= 1),
             "positions must hold one position per token of q (", T,
             " tokens) with a nonzero stride: [T] (or [3, T] with mrope_section)");
}

}  // namespace

rope::CacheParams make_cache_params(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
    const Tensor& cos_sin, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, const std::optional<Tensor>& q_out,
    const std::optional<Tensor>& q_scale, bool interleaved, const std::string& layout,
    int64_t rotary_offset, const Sections& mrope_section, bool mrope_interleaved) {
  check_3d(q, "q", "[T, Hq, D]");
  check_3d(k, "k", "[T, Hk, D]");
  check_3d(v, "v", "[T, Hk, Dv]");
  const int64_t T = q.size(0), Hk = k.size(1), D = q.size(2), Dv = v.size(2);
  ROPE_CHECK(ValueError, k.size(0) == T && v.size(0) == T, "q, k and v must have the same tokens T",
             " (dim 0), got shapes ", shape_str(q.sizes()), ", ", shape_str(k.sizes()), ", ",
             shape_str(v.sizes()));
  ROPE_CHECK(ValueError, v.size(1) == Hk, "v must have the heads of k (", Hk, "), got shape ",
             shape_str(v.sizes()));
  ROPE_CHECK(TypeError, v.scalar_type() == q.scalar_type(), "v must have the dtype of q (",
             q.scalar_type(), "), got ", v.scalar_type());
  ROPE_CHECK(ValueError, v.device() == q.device(), "v must be on the device of q (", device_str(q),
             "), got ", device_str(v));

  const Tensor* qo = q_out.has_value() && q_out->defined() ? &*q_out : nullptr;
  const rope::Fp8 q_fp8 = qo ? fp8_of(qo->scalar_type()) : rope::Fp8::kNone;
  if (qo) {
    ROPE_CHECK(TypeError, qo->scalar_type() == q.scalar_type() || q_fp8 != rope::Fp8::kNone,
               "q_out must have the dtype of q (", q.scalar_type(),
               ") or be float8_e4m3fn / float8_e5m2, got ", qo->scalar_type());
    ROPE_CHECK(ValueError, sizes_of(*qo) == sizes_of(q), "q_out must have the shape of q (",
               shape_str(q.sizes()), "), got ", shape_str(qo->sizes()));
    ROPE_CHECK(ValueError, qo->device() == q.device(), "q_out must be on the device of q (",
               device_str(q), "), got ", device_str(*qo));
    ROPE_CHECK(ValueError, D <= 1 || qo->stride(2) == 1,
               "q_out must have a contiguous last dim (stride 1), got strides ",
               shape_str(qo->strides()));
  }
  const bool q_direct = qo && q_fp8 == rope::Fp8::kNone;
  rope::CacheParams cp{};
  cp.rope = make_params(q, q_direct ? *qo : q, &k, &k, positions, cos_sin, interleaved, false,
                        rotary_offset, mrope_section, mrope_interleaved, "q", true);
  check_tokens(cp.rope, T);
  const float* qs = scale_ptr(q_scale, "q_scale", q);
  if (q_fp8 != rope::Fp8::kNone) {
    cp.q_fp8 = q_fp8;
    cp.q8 = qo->data_ptr();
    cp.q8_tok_stride = qo->stride(0);
    cp.q8_head_stride = qo->stride(1);
    cp.q_scale = qs;
  }

  ROPE_CHECK(ValueError, layout == "NHD" || layout == "HND", "layout must be 'NHD' or 'HND', got '",
             layout, "'");
  const bool nhd = layout == "NHD";
  for (const auto& [c, name] :
       {std::pair{&key_cache, "key_cache"}, {&value_cache, "value_cache"}}) {
    ROPE_CHECK(TypeError, c->defined(), name, " must be a tensor, got None");
    ROPE_CHECK(ValueError, c->dim() == 4, name, " must be 4-d ",
               nhd ? "[num_blocks, block_size, Hk, dim]" : "[num_blocks, Hk, block_size, dim]",
               " (layout='", layout, "'), got shape ", shape_str(c->sizes()));
    ROPE_CHECK(ValueError, c->device() == q.device(), name, " must be on the device of q (",
               device_str(q), "), got ", device_str(*c));
    ROPE_CHECK(ValueError, c->size(3) <= 1 || c->stride(3) == 1, name,
               " must have a contiguous last dim (stride 1), got strides ",
               shape_str(c->strides()));
  }
  const ScalarType cache_dtype = key_cache.scalar_type();
  cp.cache_fp8 = fp8_of(cache_dtype);
  ROPE_CHECK(TypeError, cache_dtype == q.scalar_type() || cp.cache_fp8 != rope::Fp8::kNone,
             "key_cache must have the dtype of q (", q.scalar_type(),
             ") or be float8_e4m3fn / float8_e5m2, got ", cache_dtype);
  ROPE_CHECK(TypeError, value_cache.scalar_type() == cache_dtype,
             "value_cache must have the dtype of key_cache (", cache_dtype, "), got ",
             value_cache.scalar_type());
  const int64_t NB = key_cache.size(0), BS = key_cache.size(nhd ? 1 : 2);
  const std::vector<int64_t> want_k =
      nhd ? std::vector<int64_t>{NB, BS, Hk, D} : std::vector<int64_t>{NB, Hk, BS, D};
  const std::vector<int64_t> want_v =
      nhd ? std::vector<int64_t>{NB, BS, Hk, Dv} : std::vector<int64_t>{NB, Hk, BS, Dv};
  ROPE_CHECK(ValueError, sizes_of(key_cache) == want_k, "key_cache must have shape ",
             shape_str(want_k), " for k of shape ", shape_str(k.sizes()), " (layout='", layout,
             "'), got ", shape_str(key_cache.sizes()));
  ROPE_CHECK(ValueError, sizes_of(value_cache) == want_v, "value_cache must have shape ",
             shape_str(want_v), " for v of shape ", shape_str(v.sizes()), " (layout='", layout,
             "'), got ", shape_str(value_cache.sizes()));
  auto paged = [&](const Tensor& c, const float* scale) {
    rope::PagedCache pc{};
    pc.data = c.data_ptr();
    pc.block_stride = c.stride(0);
    pc.row_stride = c.stride(nhd ? 1 : 2);
    pc.head_stride = c.stride(nhd ? 2 : 1);
    pc.scale = scale;
    return pc;
  };
  const bool fp8 = cp.cache_fp8 != rope::Fp8::kNone;
  const float* ks = scale_ptr(k_scale, "k_scale", q);
  const float* vs = scale_ptr(v_scale, "v_scale", q);
  cp.key_cache = paged(key_cache, fp8 ? ks : nullptr);
  cp.value_cache = paged(value_cache, fp8 ? vs : nullptr);
  cp.block_size = BS;
  cp.n_cache_slots = NB * BS;

  ROPE_CHECK(TypeError, slot_mapping.defined(), "slot_mapping must be a tensor, got None");
  ROPE_CHECK(TypeError, slot_mapping.scalar_type() == ScalarType::Long,
             "slot_mapping must be an int64 tensor, got ", slot_mapping.scalar_type());
  ROPE_CHECK(ValueError, slot_mapping.dim() == 1 && slot_mapping.size(0) <= T,
             "slot_mapping must be [T'] with T' <= T = ", T, ", got shape ",
             shape_str(slot_mapping.sizes()));
  ROPE_CHECK(ValueError, slot_mapping.size(0) <= 1 || slot_mapping.stride(0) == 1,
             "slot_mapping must be contiguous, got strides ", shape_str(slot_mapping.strides()));
  ROPE_CHECK(ValueError, slot_mapping.device() == q.device(),
             "slot_mapping must be on the device of q (", device_str(q), "), got ",
             device_str(slot_mapping));
  cp.slots = static_cast<const int64_t*>(slot_mapping.data_ptr());
  cp.n_slots = slot_mapping.size(0);

  cp.v = v.data_ptr();
  cp.v_tok_stride = v.stride(0);
  cp.v_head_stride = v.stride(1);
  cp.v_dim = int(Dv);
  cp.n_kv_heads = Hk;

  // What is written must not overlap itself or anything else the call reads or writes.
  // (Each layout read once: every query of a tensor is a call into libtorch.)
  const Layout lq(q), lk(k), lv(v), lkc(key_cache), lvc(value_cache);
  const Layout lqo = qo ? Layout(*qo) : lq;
  const char* q_target = qo ? "q_out" : "q";
  check_no_self_overlap(lqo, q_target);
  check_no_self_overlap(lk, "k");
  check_no_self_overlap(lkc, "key_cache");
  check_no_self_overlap(lvc, "value_cache");
  check_disjoint(lqo, q_target, lk, "k");
  if (qo) check_disjoint(lqo, "q_out", lq, "q");
  check_disjoint(lk, "k", lv, "v");
  check_disjoint(lkc, "key_cache", lvc, "value_cache");
  for (const auto& [c, cn] : {std::pair{&lkc, "key_cache"}, {&lvc, "value_cache"}})
    for (const auto& [x, xn] : {std::pair{&lq, "q"}, {&lk, "k"}, {&lv, "v"}})
      check_disjoint(*c, cn, *x, xn);
  return cp;
}

int64_t first_bad_slot(const rope::CacheParams& cp, int64_t* value) {
  for (int64_t t = 0; t < cp.n_slots; ++t) {
    const int64_t s = cp.slots[t];
    if (s != -1 && (s < 0 || s >= cp.n_cache_slots)) {
      *value = s;
      return t;
    }
  }
  return -1;
}

void rotary_qk_cache_(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                      const Tensor& cos_sin, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                      const std::optional<Tensor>& v_scale, const std::optional<Tensor>& q_out,
                      const std::optional<Tensor>& q_scale, bool interleaved,
                      const std::string& layout, int64_t rotary_offset,
                      const Sections& mrope_section, bool mrope_interleaved,
                      const Backend& backend) {
  const auto cp = make_cache_params(q, k, v, positions, cos_sin, key_cache, value_cache,
                                    slot_mapping, k_scale, v_scale, q_out, q_scale, interleaved,
                                    layout, rotary_offset, mrope_section, mrope_interleaved);
  if (cp.rope.n_tokens == 0 || q.size(0) == 0) return;
  if (backend.check_positions) {
    // A backend that reads host memory checks positions and slots before any write.
    backend.check_positions(cp.rope);
    int64_t value = 0;
    const int64_t t = first_bad_slot(cp, &value);
    ROPE_CHECK(std::out_of_range, t < 0,
               "slot_mapping must hold -1 or slots in [0, num_blocks * block_size) = [0, ",
               cp.n_cache_slots, "), got ", value, " for token ", t);
  }
  backend.launch_cache(cp, q);
}

rope::NormParams make_norm_params(const Tensor& q, const Tensor& q_out, const Tensor& k,
                                  const Tensor& k_out, const Tensor& q_weight,
                                  const Tensor& k_weight, const Tensor& positions,
                                  const Tensor& cos_sin, double eps, bool interleaved,
                                  double weight_offset, int64_t rotary_offset,
                                  const Sections& mrope_section, bool mrope_interleaved) {
  check_3d(q, "q", "[T, Hq, D]");
  check_3d(k, "k", "[T, Hk, D]");
  const int64_t T = q.size(0), D = q.size(2);
  ROPE_CHECK(ValueError, k.size(0) == T, "q and k must have the same tokens T (dim 0), got shapes ",
             shape_str(q.sizes()), ", ", shape_str(k.sizes()));
  ROPE_CHECK(ValueError, D <= rope::kMaxNormHeadDim, "head_dim (q.shape[-1]) must be at most ",
             rope::kMaxNormHeadDim, " for the fused QK norm, got ", D);
  ROPE_CHECK(ValueError, eps >= 0 && eps < 1e30, "eps must be a non-negative finite number, got ",
             eps);
  rope::NormParams np{};
  np.rope = make_params(q, q_out, &k, &k_out, positions, cos_sin, interleaved, false, rotary_offset,
                        mrope_section, mrope_interleaved, "q", true);
  check_tokens(np.rope, T);
  int i = 0;
  for (const auto& [w, name] : {std::pair{&q_weight, "q_weight"}, {&k_weight, "k_weight"}}) {
    ROPE_CHECK(TypeError, w->defined(), name, " must be a tensor, got None");
    ROPE_CHECK(TypeError, is_supported_float(w->scalar_type()), name,
               " must be a floating tensor (float32, float64, float16 or bfloat16), got ",
               w->scalar_type());
    ROPE_CHECK(ValueError, w->dim() == 1 && w->size(0) == D, name, " must be [D] = [", D,
               "], got shape ", shape_str(w->sizes()));
    ROPE_CHECK(ValueError, D <= 1 || w->stride(0) == 1, name, " must be contiguous, got strides ",
               shape_str(w->strides()));
    ROPE_CHECK(ValueError, w->device() == q.device(), name, " must be on the device of q (",
               device_str(q), "), got ", device_str(*w));
    np.weight[i] = w->data_ptr();
    np.w_dtype[i] = to_dtype(w->scalar_type());
    ++i;
  }
  np.eps = eps;
  np.weight_offset = weight_offset;
  return np;
}

namespace {

void run_norm(const rope::NormParams& np, const Tensor& q, const Backend& backend) {
  if (np.rope.n_tokens == 0 || np.rope.t[0].n_heads + np.rope.t[1].n_heads == 0) return;
  if (backend.check_positions) backend.check_positions(np.rope);
  backend.launch_norm(np, q);
}

}  // namespace

void qk_norm_rotary_(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                     const Tensor& k_weight, const Tensor& positions, const Tensor& cos_sin,
                     double eps, bool interleaved, double weight_offset, int64_t rotary_offset,
                     const Sections& mrope_section, bool mrope_interleaved,
                     const Backend& backend) {
  const auto np =
      make_norm_params(q, q, k, k, q_weight, k_weight, positions, cos_sin, eps, interleaved,
                       weight_offset, rotary_offset, mrope_section, mrope_interleaved);
  check_writable(q, &k);
  run_norm(np, q, backend);
}

namespace {

// The view of t with these sizes and strides whose first element is t's
// element `offset` (in storage order), made by the C shim itself: a view op
// through the dispatcher would cost microseconds per call.
Tensor raw_view(const Tensor& t, IntRef sizes, IntRef strides, int64_t offset) {
  AtenTensorHandle ret = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch__reinterpret_tensor(
      t.get(), int64_t(sizes.size()), sizes.data(), strides.data(), offset, &ret));
  return Tensor(ret);
}

}  // namespace

void qk_norm_rotary_packed_(const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                            int64_t num_heads_v, const Tensor& q_weight, const Tensor& k_weight,
                            const Tensor& positions, const Tensor& cos_sin, double eps,
                            bool interleaved, double weight_offset, int64_t rotary_offset,
                            const Sections& mrope_section, bool mrope_interleaved,
                            const Backend& backend) {
  ROPE_CHECK(TypeError, qkv.defined(), "qkv must be a tensor, got None");
  ROPE_CHECK(ValueError, qkv.dim() == 2, "qkv must be [T, (Hq+Hk+Hv)*D], got shape ",
             shape_str(qkv.sizes()));
  ROPE_CHECK(ValueError, num_heads_q >= 1 && num_heads_k >= 1 && num_heads_v >= 0,
             "head counts must be ints, q and k >= 1, v >= 0; got (", num_heads_q, ", ",
             num_heads_k, ", ", num_heads_v, ")");
  const int64_t heads = num_heads_q + num_heads_k + num_heads_v, width = qkv.size(1);
  ROPE_CHECK(ValueError, width % heads == 0, "qkv.shape[-1] = ", width,
             " is not a multiple of Hq+Hk+Hv = ", heads);
  ROPE_CHECK(ValueError, width <= 1 || qkv.stride(1) == 1,
             "qkv must have a contiguous last dim (stride 1), got strides ",
             shape_str(qkv.strides()));
  const int64_t T = qkv.size(0), D = width / heads;
  const int64_t q_shape[3] = {T, num_heads_q, D}, k_shape[3] = {T, num_heads_k, D};
  const int64_t strides[3] = {qkv.stride(0), D, 1};
  const Tensor q = raw_view(qkv, q_shape, strides, 0);
  const Tensor k = raw_view(qkv, k_shape, strides, num_heads_q * D);
  qk_norm_rotary_(q, k, q_weight, k_weight, positions, cos_sin, eps, interleaved, weight_offset,
                  rotary_offset, mrope_section, mrope_interleaved, backend);
}

std::tuple<Tensor, Tensor> qk_norm_rotary(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                          const Tensor& k_weight, const Tensor& positions,
                                          const Tensor& cos_sin, double eps, bool interleaved,
                                          double weight_offset, int64_t rotary_offset,
                                          const Sections& mrope_section, bool mrope_interleaved,
                                          const Backend& backend) {
  check_3d(q, "q", "[T, Hq, D]");
  check_3d(k, "k", "[T, Hk, D]");
  check_input(q, "q");
  check_input(k, "k");
  Tensor q_out = empty_output(q), k_out = empty_output(k);
  const auto np =
      make_norm_params(q, q_out, k, k_out, q_weight, k_weight, positions, cos_sin, eps, interleaved,
                       weight_offset, rotary_offset, mrope_section, mrope_interleaved);
  run_norm(np, q, backend);
  return {q_out, k_out};
}

}  // namespace rope_ext

#include "binding.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <sstream>
#include <utility>
#include <vector>

#include "../rope/rope.h"

namespace rope_ext {
namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

rope::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return rope::DType::kFloat32;
    case at::kDouble:
      return rope::DType::kFloat64;
    case at::kHalf:
      return rope::DType::kFloat16;
    default:
      return rope::DType::kBFloat16;
  }
}

void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK_TYPE(x.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()), name,
                   " must be a floating tensor (float32, float64, float16 or bfloat16), got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, name,
                    " must have at least one dim [..., head_dim], got a scalar");
  TORCH_CHECK_VALUE(x.size(-1) <= rope::kMaxHeadDim, name, ".shape[-1] (head_dim) must be at most ",
                    rope::kMaxHeadDim, ", got ", x.size(-1));
  TORCH_CHECK_VALUE(x.size(-1) <= 1 || x.stride(-1) == 1, name,
                    " must have a contiguous last dim (stride 1), got strides ",
                    shape_str(x.strides()));
}

// Byte extent [lo, hi) of the elements of t.
std::pair<int64_t, int64_t> extent(const at::Tensor& t) {
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size(d) - 1) * t.stride(d);
    (span < 0 ? lo : hi) += span;
  }
  const int64_t base = reinterpret_cast<int64_t>(t.data_ptr());
  const int64_t es = t.element_size();
  return {base + lo * es, base + (hi + 1) * es};
}

// Dims of t as (size, byte stride), size-1 dims dropped, innermost last, with
// contiguous neighbours merged. Returns the byte length of the innermost run.
int64_t runs_of(const at::Tensor& t, std::vector<std::pair<int64_t, int64_t>>& outer) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) dims.emplace_back(t.size(d), t.stride(d) * t.element_size());
  std::sort(dims.begin(), dims.end(),
            [](auto& a, auto& b) { return std::abs(a.second) > std::abs(b.second); });
  int64_t run = t.element_size();
  while (!dims.empty() && dims.back().second == run) {
    run *= dims.back().first;
    dims.pop_back();
  }
  outer = dims;
  return run;
}

// Byte offsets (from `base`) of every run start.
std::vector<int64_t> run_starts(const at::Tensor& t, int64_t base,
                                const std::vector<std::pair<int64_t, int64_t>>& outer) {
  std::vector<int64_t> starts{reinterpret_cast<int64_t>(t.data_ptr()) - base};
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
bool self_overlaps(const at::Tensor& t) {
  if (t.numel() <= 1) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    if (t.stride(d) == 0) return true;
    dims.emplace_back(t.size(d), std::abs(t.stride(d)));
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
  const auto starts = run_starts(t, reinterpret_cast<int64_t>(t.data_ptr()), outer);
  for (size_t i = 1; i < starts.size(); ++i)
    if (starts[i] - starts[i - 1] < run) return true;
  return false;
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto [alo, ahi] = extent(a);
  const auto [blo, bhi] = extent(b);
  if (ahi <= blo || bhi <= alo) return false;
  std::vector<std::pair<int64_t, int64_t>> oa, ob;
  const int64_t la = runs_of(a, oa), lb = runs_of(b, ob);
  const int64_t pa = reinterpret_cast<int64_t>(a.data_ptr());
  const int64_t pb = reinterpret_cast<int64_t>(b.data_ptr());
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

struct Dim {
  int64_t size;
  std::array<int64_t, 5> stride;  // positions, q in, q out, k in, k out
};

// Drops size-1 dims and merges neighbours that are contiguous in every stride.
std::vector<Dim> coalesce(const std::vector<Dim>& dims, int n_strides) {
  std::vector<Dim> out;
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

void fill_heads(rope::RotTensor& t, const std::vector<Dim>& dims) {
  TORCH_CHECK_VALUE(dims.size() <= size_t(rope::kMaxDims),
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

void check_writable(const at::Tensor& q, const at::Tensor* k) {
  TORCH_CHECK_VALUE(!self_overlaps(q),
                    "q has elements that overlap in memory (expanded or stride-0 view, strides ",
                    shape_str(q.strides()), "); an in-place rotation needs a writable tensor");
  if (!k) return;
  TORCH_CHECK_VALUE(!self_overlaps(*k),
                    "k has elements that overlap in memory (expanded or stride-0 view, strides ",
                    shape_str(k->strides()), "); an in-place rotation needs a writable tensor");
  TORCH_CHECK_VALUE(!overlaps(q, *k),
                    "q and k overlap in memory; an in-place rotation needs separate tensors");
}

rope::RopeParams make_params(const at::Tensor& q_in, const at::Tensor& q_out,
                             const at::Tensor* k_in, const at::Tensor* k_out,
                             const at::Tensor& positions, const at::Tensor& cos_sin,
                             bool interleaved, bool inverse, int64_t rotary_offset,
                             at::OptionalIntArrayRef mrope_section, bool mrope_interleaved,
                             const char* q_name) {
  const char* xname = q_name ? q_name : (k_in ? "q" : "x");
  check_input(q_in, xname);
  if (k_in) {
    check_input(*k_in, "k");
    TORCH_CHECK_TYPE(k_in->scalar_type() == q_in.scalar_type(), "k must have the dtype of q (",
                     q_in.scalar_type(), "), got ", k_in->scalar_type());
    TORCH_CHECK_VALUE(k_in->device() == q_in.device(), "k must be on the device of q (",
                      q_in.device(), "), got ", k_in->device());
    TORCH_CHECK_VALUE(k_in->dim() == q_in.dim(), "k must have the rank of q (", q_in.dim(),
                      "), got shape ", shape_str(k_in->sizes()));
    TORCH_CHECK_VALUE(k_in->size(-1) == q_in.size(-1), "k must have the head_dim of q (",
                      q_in.size(-1), "), got ", k_in->size(-1));
  }

  TORCH_CHECK_TYPE(cos_sin.defined(), "cos_sin must be a tensor, got None");
  TORCH_CHECK_VALUE(cos_sin.dim() == 2,
                    "cos_sin must have shape [positions, rotary_dim], got shape ",
                    shape_str(cos_sin.sizes()));
  TORCH_CHECK_TYPE(
      cos_sin.scalar_type() == at::kFloat || cos_sin.scalar_type() == q_in.scalar_type(),
      "cos_sin must be float32 or the dtype of ", xname, " (", q_in.scalar_type(), "), got ",
      cos_sin.scalar_type());
  TORCH_CHECK_VALUE(cos_sin.device() == q_in.device(), "cos_sin must be on the device of ", xname,
                    " (", q_in.device(), "), got ", cos_sin.device());
  const int64_t rotary_dim = cos_sin.size(1);
  const int64_t head_dim = q_in.size(-1);
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0,
                    "rotary_dim (cos_sin.shape[-1]) must be even and positive, got ", rotary_dim);
  TORCH_CHECK_VALUE(rotary_dim <= head_dim, "rotary_dim (cos_sin.shape[-1] = ", rotary_dim,
                    ") must be <= head_dim (", xname, ".shape[-1] = ", head_dim, ")");
  TORCH_CHECK_VALUE(rotary_offset >= 0 && rotary_offset <= head_dim - rotary_dim,
                    "rotary_offset must be in [0, head_dim - rotary_dim] = [0, ",
                    head_dim - rotary_dim, "] (", xname, ".shape[-1] = ", head_dim,
                    ", rotary_dim = cos_sin.shape[-1] = ", rotary_dim, "), got ", rotary_offset);
  TORCH_CHECK_VALUE(cos_sin.stride(1) == 1, "cos_sin must have a contiguous last dim, got strides ",
                    shape_str(cos_sin.strides()));

  TORCH_CHECK_TYPE(positions.defined(), "positions must be a tensor, got None");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong,
                   "positions must be an int32 or int64 tensor, got ", positions.scalar_type());
  TORCH_CHECK_VALUE(positions.device() == q_in.device(), "positions must be on the device of ",
                    xname, " (", q_in.device(), "), got ", positions.device());

  // MRoPE: positions [3, ...]; the broadcast below is of positions[0] (sizes
  // and strides without the leading dim, same data pointer), and sections 1
  // and 2 sit at the same offsets plus a multiple of stride(0).
  const bool mrope = mrope_section.has_value();
  TORCH_CHECK_VALUE(mrope || !mrope_interleaved, "mrope_interleaved needs mrope_section");
  int mrope_sec[3] = {0, 0, 0};
  int64_t section_stride = 0;
  at::IntArrayRef pos_sizes = positions.sizes(), pos_strides = positions.strides();
  if (mrope) {
    const auto sec = *mrope_section;
    const bool ok = sec.size() == 3 && sec[0] >= 0 && sec[1] >= 0 && sec[2] >= 0 &&
                    sec[0] + sec[1] + sec[2] == rotary_dim / 2;
    TORCH_CHECK_VALUE(ok,
                      "mrope_section must be 3 non-negative ints (temporal, height, width) summing "
                      "to rotary_dim / 2 = ",
                      rotary_dim / 2, ", got ", shape_str(sec));
    TORCH_CHECK_VALUE(positions.dim() >= 1 && positions.size(0) == 3,
                      "positions must have a leading section dim of size 3 ([3, ...]) with "
                      "mrope_section, got shape ",
                      shape_str(positions.sizes()));
    for (int s = 0; s < 3; ++s) mrope_sec[s] = int(sec[s]);
    section_stride = positions.stride(0);
    pos_sizes = pos_sizes.slice(1);
    pos_strides = pos_strides.slice(1);
  }

  const int64_t n = q_in.dim() - 1;
  const at::IntArrayRef qb = q_in.sizes().slice(0, n);
  const at::IntArrayRef kb = k_in ? k_in->sizes().slice(0, n) : qb;
  auto not_broadcastable = [&](const char* target, at::IntArrayRef shape) {
    return c10::str("positions of shape ", shape_str(pos_sizes), " must be broadcastable to ",
                    target, ".shape[:-1] = ", shape_str(shape));
  };
  const int64_t pos_dim = int64_t(pos_sizes.size());
  TORCH_CHECK_VALUE(pos_dim <= n, not_broadcastable(xname, qb));

  std::vector<Dim> tok, qh, kh;
  for (int64_t d = 0; d < n; ++d) {
    const int64_t pd = d - (n - pos_dim);
    const int64_t psize = pd >= 0 ? pos_sizes[pd] : 1;
    const int64_t pstride = pd >= 0 && psize > 1 ? pos_strides[pd] : 0;
    TORCH_CHECK_VALUE(psize == 1 || psize == qb[d], not_broadcastable(xname, qb));
    TORCH_CHECK_VALUE(psize == 1 || psize == kb[d], not_broadcastable("k", kb));
    const int64_t qin = q_in.stride(d), qout = q_out.stride(d);
    const int64_t kin = k_in ? k_in->stride(d) : 0, kout = k_out ? k_out->stride(d) : 0;
    if (pstride != 0) {
      tok.push_back(Dim{psize, {pstride, qin, qout, kin, kout}});
    } else {
      qh.push_back(Dim{qb[d], {qin, qout}});
      kh.push_back(Dim{kb[d], {kin, kout}});
    }
  }
  tok = coalesce(tok, 5);
  TORCH_CHECK_VALUE(tok.size() <= size_t(rope::kMaxDims),
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
  // A separate output gets the pass-through features copied; in place they
  // are already there.
  p.t[0].in = q_in.data_ptr();
  p.t[0].out = q_out.data_ptr();
  p.t[0].copy_pass = !q_out.is_same(q_in);
  fill_heads(p.t[0], coalesce(qh, 2));
  if (k_in) {
    p.t[1].in = k_in->data_ptr();
    p.t[1].out = k_out->data_ptr();
    p.t[1].copy_pass = !k_out->is_same(*k_in);
    fill_heads(p.t[1], coalesce(kh, 2));
  }
  p.positions = positions.data_ptr();
  for (int i = 0; i < 3; ++i) p.mrope_section[i] = mrope_sec[i];
  p.mrope_interleaved = mrope_interleaved;
  p.pos_section_stride = section_stride;
  p.pos_int64 = positions.scalar_type() == at::kLong;
  p.cos_sin = cos_sin.data_ptr();
  p.cs_row_stride = cos_sin.stride(0);
  p.n_cache_rows = cos_sin.size(0);
  p.head_dim = int(head_dim);
  p.rotary_dim = int(rotary_dim);
  p.rot_offset = int(rotary_offset);
  p.interleaved = interleaved;
  p.inverse = inverse;
  p.x_dtype = to_dtype(q_in.scalar_type());
  p.cs_dtype = to_dtype(cos_sin.scalar_type());
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
void run(const rope::RopeParams& p, const at::Tensor& q, const Backend& backend) {
  int64_t heads = 0;
  for (int t = 0; t < p.n_tensors; ++t) heads += p.t[t].n_heads;
  if (p.n_tokens == 0 || heads == 0) return;  // empty: nothing to read or write
  if (backend.check_positions) backend.check_positions(p);
  backend.launch(p, q);
}
}  // namespace

namespace {
// Output for x: x's layout (empty_like), unless that leaves the last dim
// strided, as it does for some expanded inputs (sizes [1, 2, 3], strides
// [1, 0, 1] give [1, 1, 2]); then row-major.
at::Tensor empty_output(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x);
  if (out.dim() > 0 && out.size(-1) > 1 && out.stride(-1) != 1)
    out = at::empty_like(x, at::MemoryFormat::Contiguous);
  return out;
}
}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                  bool interleaved, bool inverse, int64_t rotary_offset,
                  at::OptionalIntArrayRef mrope_section, bool mrope_interleaved,
                  const Backend& backend) {
  check_input(x, "x");
  at::Tensor out = empty_output(x);
  const auto p = make_params(x, out, nullptr, nullptr, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  run(p, x, backend);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& positions, const at::Tensor& cos_sin,
                                             bool interleaved, bool inverse, int64_t rotary_offset,
                                             at::OptionalIntArrayRef mrope_section,
                                             bool mrope_interleaved, const Backend& backend) {
  check_input(q, "q");
  check_input(k, "k");
  at::Tensor q_out = empty_output(q), k_out = empty_output(k);
  const auto p = make_params(q, q_out, &k, &k_out, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  run(p, q, backend);
  return {q_out, k_out};
}

void rotary_qk_(const at::Tensor& q, const std::optional<at::Tensor>& k,
                const at::Tensor& positions, const at::Tensor& cos_sin, bool interleaved,
                bool inverse, int64_t rotary_offset, at::OptionalIntArrayRef mrope_section,
                bool mrope_interleaved, const Backend& backend) {
  const at::Tensor* kp = k.has_value() && k->defined() ? &*k : nullptr;
  const auto p = make_params(q, q, kp, kp, positions, cos_sin, interleaved, inverse, rotary_offset,
                             mrope_section, mrope_interleaved, "q");
  check_writable(q, kp);
  run(p, q, backend);
}

}  // namespace rope_ext

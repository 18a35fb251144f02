#include "binding.h"

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <utility>
#include <vector>

#include "../rope/rope.h"
#include "layout.h"

namespace rope_ext {

using torch::headeronly::ScalarType;

std::string shape_str(IntRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

ScalarType dtype_of(const Tensor& t) {
  int32_t code = -1;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &code));
  // ScalarType + 1 of each dtype code seen so far (0: not yet); the mapping is fixed.
  static std::atomic<int16_t> seen[64];
  if (code < 0 || code >= 64) return t.scalar_type();
  int16_t v = seen[code].load(std::memory_order_relaxed);
  if (v == 0) {
    v = int16_t(int(t.scalar_type()) + 1);
    seen[code].store(v, std::memory_order_relaxed);
  }
  return ScalarType(v - 1);
}

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
  // The kernels split a head index over several dims in 32-bit arithmetic (rope.h, head_offsets).
  ROPE_CHECK(ValueError, t.n_head_dims <= 1 || t.n_heads <= INT32_MAX,
             "the batch dims around the positions' dims (the heads each position applies to) must "
             "hold at most 2^31 - 1 heads when they cannot be merged into one dim, got ",
             t.n_heads);
}

}  // namespace

void check_input(const Arg& x, const char* name) {
  ROPE_CHECK(TypeError, x.defined(), name, " must be a tensor, got None");
  ROPE_CHECK(TypeError, is_supported_float(dtype_of(x)), name,
             " must be a floating tensor (float32, float64, float16 or bfloat16), got ",
             dtype_of(x));
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

void check_disjoint(const Layout& a, const char* an, const Layout& b, const char* bn) {
  ROPE_CHECK(ValueError, !overlaps(a, b), an, " and ", bn,
             " overlap in memory; they must be separate tensors");
}

void check_writable(const Arg& q, const Arg* k) {
  const Layout& ql = q.layout();
  ROPE_CHECK(ValueError, !self_overlaps(ql),
             "q has elements that overlap in memory (expanded or stride-0 view, strides ",
             shape_str(ql.stride), "); an in-place rotation needs a writable tensor");
  if (!k) return;
  const Layout& kl = k->layout();
  ROPE_CHECK(ValueError, !self_overlaps(kl),
             "k has elements that overlap in memory (expanded or stride-0 view, strides ",
             shape_str(kl.stride), "); an in-place rotation needs a writable tensor");
  ROPE_CHECK(ValueError, !overlaps(ql, kl),
             "q and k overlap in memory; an in-place rotation needs separate tensors");
}

rope::RopeParams make_params(const Arg& q_in, const Arg& q_out, const Arg* k_in, const Arg* k_out,
                             const Tensor& positions, const Tensor& cos_sin, bool interleaved,
                             bool inverse, int64_t rotary_offset, const Sections& mrope_section,
                             int64_t mrope_interleaved, const char* q_name, bool token_major,
                             const char* k_name, bool k_rotary_only) {
  const char* xname = q_name ? q_name : (k_in ? "q" : "x");
  check_input(q_in, xname);
  const ScalarType dtype = dtype_of(q_in);
  const Layout& qi = q_in.layout();
  const Layout& qo = q_out.layout();
  const int64_t head_dim = qi.size.back();
  const Layout* ki = k_in ? &k_in->layout() : nullptr;
  const Layout* ko = k_out ? &k_out->layout() : nullptr;
  if (k_in) {
    check_input(*k_in, k_name);
    ROPE_CHECK(TypeError, dtype_of(*k_in) == dtype, k_name, " must have the dtype of q (", dtype,
               "), got ", dtype_of(*k_in));
    ROPE_CHECK(ValueError, same_device(*k_in, q_in), k_name, " must be on the device of q (",
               device_str(q_in), "), got ", device_str(*k_in));
    ROPE_CHECK(ValueError, ki->dim() == qi.dim(), k_name, " must have the rank of q (", qi.dim(),
               "), got shape ", shape_str(ki->size));
    ROPE_CHECK(ValueError, k_rotary_only || ki->size.back() == head_dim, k_name,
               " must have the head_dim of q (", head_dim, "), got ", ki->size.back());
  }

  // cos_sin: a table [positions, rotary_dim], or (the table-free mode) float64 [rotary_dim]: each
  // pair's frequency, then the factor of its cos and sin (RopeParams::freqs).
  ROPE_CHECK(TypeError, cos_sin.defined(), "cos_sin must be a tensor, got None");
  const IntRef cs_size = cos_sin.sizes(), cs_stride = cos_sin.strides();
  const bool table_free = cs_size.size() == 1;
  ROPE_CHECK(ValueError, cs_size.size() == 2 || table_free,
             "cos_sin must have shape [positions, rotary_dim] (a table) or [rotary_dim] "
             "(frequencies), got shape ",
             shape_str(cs_size));
  const ScalarType cs_dtype = dtype_of(cos_sin);
  if (table_free)
    ROPE_CHECK(TypeError, cs_dtype == ScalarType::Double,
               "cos_sin of shape [rotary_dim] (frequencies, then factors) must be float64, got ",
               cs_dtype);
  else
    ROPE_CHECK(TypeError, cs_dtype == ScalarType::Float || cs_dtype == dtype,
               "cos_sin must be float32 or the dtype of ", xname, " (", dtype, "), got ", cs_dtype);
  ROPE_CHECK(ValueError, same_device(cos_sin, q_in), "cos_sin must be on the device of ", xname,
             " (", device_str(q_in), "), got ", device_str(cos_sin));
  const int64_t rotary_dim = cs_size.back();
  ROPE_CHECK(ValueError, rotary_dim > 0 && rotary_dim % 2 == 0,
             "rotary_dim (cos_sin.shape[-1]) must be even and positive, got ", rotary_dim);
  ROPE_CHECK(ValueError, rotary_dim <= head_dim, "rotary_dim (cos_sin.shape[-1] = ", rotary_dim,
             ") must be <= head_dim (", xname, ".shape[-1] = ", head_dim, ")");
  ROPE_CHECK(ValueError, rotary_offset >= 0 && rotary_offset <= head_dim - rotary_dim,
             "rotary_offset must be in [0, head_dim - rotary_dim] = [0, ", head_dim - rotary_dim,
             "] (", xname, ".shape[-1] = ", head_dim,
             ", rotary_dim = cos_sin.shape[-1] = ", rotary_dim, "), got ", rotary_offset);
  ROPE_CHECK(ValueError, cs_stride.back() == 1,
             "cos_sin must have a contiguous last dim, got strides ", shape_str(cs_stride));
  ROPE_CHECK(ValueError, !k_rotary_only || ki->size.back() == rotary_dim, k_name,
             ".shape[-1] must be rotary_dim (cos_sin.shape[-1] = ", rotary_dim, "), got ",
             ki->size.back());

  ROPE_CHECK(TypeError, positions.defined(), "positions must be a tensor, got None");
  const ScalarType pos_dtype = dtype_of(positions);
  const bool float_pos = pos_dtype == ScalarType::Float || pos_dtype == ScalarType::Double;
  ROPE_CHECK(TypeError, pos_dtype == ScalarType::Int || pos_dtype == ScalarType::Long || float_pos,
             "positions must be an int32 or int64 tensor (float32 or float64 with frequencies), "
             "got ",
             pos_dtype);
  ROPE_CHECK(TypeError, table_free || !float_pos, "positions must be an int32 or int64 tensor ",
             "with a cos_sin table (float positions need frequencies, cos_sin [rotary_dim]), got ",
             pos_dtype);
  ROPE_CHECK(ValueError, same_device(positions, q_in), "positions must be on the device of ", xname,
             " (", device_str(q_in), "), got ", device_str(positions));

  // Several position axes (MRoPE): positions [n_axes, ...]; the broadcast
  // below is of positions[0] (its sizes and strides, same data pointer), and
  // the other axes sit at the same offsets plus a multiple of stride(0).
  const bool mrope = mrope_section.has_value();
  ROPE_CHECK(ValueError, mrope_interleaved >= 0 && mrope_interleaved <= 2,
             "mrope_interleaved must be False (contiguous sections), True (interleaved, Qwen3-VL) "
             "or 2 (alternating, ERNIE-4.5-VL), got ",
             mrope_interleaved);
  ROPE_CHECK(ValueError, mrope || !mrope_interleaved, "mrope_interleaved needs mrope_section");
  const auto layout = rope::AxisLayout(mrope_interleaved);
  int mrope_sec[rope::kMaxAxes] = {};
  int n_axes = 0;
  int64_t section_stride = 0;
  IntRef pos_sizes = positions.sizes(), pos_strides = positions.strides();
  if (mrope) {
    const auto& sec = *mrope_section;
    // Each section is bounded before the sum, which then cannot overflow.
    const int64_t half = rotary_dim / 2;
    bool ok = !sec.empty() && sec.size() <= size_t(rope::kMaxAxes);
    int64_t sum = 0;
    for (size_t s = 0; ok && s < sec.size(); ++s) ok = sec[s] >= 0 && sec[s] <= half, sum += sec[s];
    ok = ok && sum == half;
    ROPE_CHECK(ValueError, ok, "mrope_section must be 1 to ", rope::kMaxAxes,
               " non-negative ints (pairs per position axis, e.g. temporal, height, width) "
               "summing to rotary_dim / 2 = ",
               rotary_dim / 2, ", got ", shape_str(sec));
    n_axes = int(sec.size());
    ROPE_CHECK(ValueError, !pos_sizes.empty() && pos_sizes[0] == n_axes,
               "positions must have a leading axis dim of size len(mrope_section) = ", n_axes,
               " ([", n_axes, ", ...]) with mrope_section, got shape ", shape_str(pos_sizes));
    for (int s = 0; s < n_axes; ++s) mrope_sec[s] = int(sec[s]);
    bool alternates = n_axes > 1;
    for (int s = 2; s < n_axes; ++s) alternates = alternates && sec[s] == sec[1];
    ROPE_CHECK(ValueError, layout != rope::AxisLayout::kAlternating || alternates,
               "alternating axes (mrope_interleaved=2) take turns: mrope_section needs at least "
               "2 axes, the same count for each after the first, got ",
               shape_str(sec));
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
  // The positions rule (README, "Positions"; rope_ext/positions.py): positions of the rank of
  // x.shape[:-1], a scalar, or positions whose last dim is 1 broadcast as they are. Any other shape
  // would align a token dim with the heads when sizes coincide: rejected, except in the token-major
  // ops ([T, H, D]), where [T] is one position per token, read as [T, 1].
  const int64_t rank = int64_t(pos_sizes.size());
  const bool explicit_heads = rank == 0 || rank >= n || pos_sizes.back() == 1;
  ROPE_CHECK(ValueError, explicit_heads || (token_major && rank == n - 1), "positions of shape ",
             shape_str(pos_sizes), " are ambiguous for ", xname, ".shape[:-1] = ", shape_str(qb),
             ": give them the rank of ", xname,
             ".shape[:-1] with a 1 where they broadcast (positions[..., None] for [T] with "
             "[T, H, D], [B, S, 1] for [B, S, H, D], [B, 1, S] for [B, H, S, D])");
  const int64_t virt = explicit_heads ? 0 : 1;
  const int64_t pos_dim = rank + virt;
  ROPE_CHECK(ValueError, pos_dim <= n, not_broadcastable(xname, qb));

  Dims tok, qh, kh;
  for (int64_t d = 0; d < n; ++d) {
    const int64_t pd = d - (n - pos_dim);
    const bool real = pd >= 0 && pd < pos_dim - virt;
    const int64_t psize = real ? pos_sizes[pd] : 1;
    const int64_t pstride = real && psize > 1 ? pos_strides[pd] : 0;
    ROPE_CHECK(ValueError, psize == 1 || psize == qb[d], not_broadcastable(xname, qb));
    ROPE_CHECK(ValueError, psize == 1 || psize == kb[d], not_broadcastable(k_name, kb));
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
  p.n_axes = n_axes;
  for (int i = 0, end = 0; i < rope::kMaxAxes; ++i) {
    p.mrope_section[i] = mrope_sec[i];
    end += mrope_sec[i];
    switch (layout) {
      case rope::AxisLayout::kInterleaved:
        p.axis_bound[i] = n_axes * mrope_sec[i];
        break;
      case rope::AxisLayout::kAlternating:
        p.axis_bound[i] = i > 0 && i < n_axes ? (n_axes - 1) * mrope_sec[1] : 0;
        break;
      default:
        p.axis_bound[i] = i + 1 < n_axes ? end : std::numeric_limits<int>::max();
    }
  }
  p.axis_layout = layout;
  p.axis_first = layout == rope::AxisLayout::kAlternating;
  p.axis_period = n_axes - p.axis_first;
  p.pos_section_stride = section_stride;
  p.pos_int64 = pos_dtype == ScalarType::Long;
  p.pos_type = pos_dtype == ScalarType::Int     ? rope::PosType::kInt32
               : pos_dtype == ScalarType::Long  ? rope::PosType::kInt64
               : pos_dtype == ScalarType::Float ? rope::PosType::kFloat32
                                                : rope::PosType::kFloat64;
  p.freqs = table_free ? static_cast<const double*>(cos_sin.data_ptr()) : nullptr;
  p.cos_sin = table_free ? nullptr : cos_sin.data_ptr();
  p.cs_row_stride = table_free ? 0 : cs_stride[0];
  p.n_cache_rows = table_free ? 0 : cs_size[0];
  p.head_dim = int(head_dim);
  p.rotary_dim = int(rotary_dim);
  p.rot_offset = int(rotary_offset);
  p.interleaved = interleaved;
  p.inverse = inverse;
  p.x_dtype = to_dtype(dtype);
  p.cs_dtype = table_free ? angle_rows_dtype(p) : to_dtype(cs_dtype);
  // What is written must not hold the positions or the table, which every thread reads.
  const Layout lpos(positions), lcs(cos_sin);
  const char* qo_name = &q_out == &q_in ? xname : "q_out";
  check_disjoint(qo, qo_name, lpos, "positions");
  check_disjoint(qo, qo_name, lcs, "cos_sin");
  if (ko) {
    const char* ko_name = k_out == k_in ? k_name : "k_out";
    check_disjoint(*ko, ko_name, lpos, "positions");
    check_disjoint(*ko, ko_name, lcs, "cos_sin");
  }
  return p;
}

int64_t first_bad_position(const rope::RopeParams& p, int64_t* value) {
  const int sections = rope::is_mrope(p) ? p.n_axes : 1;
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

rope::DType angle_rows_dtype(const rope::RopeParams& p) {
  return p.x_dtype == rope::DType::kFloat64 ? rope::DType::kFloat64 : rope::DType::kFloat32;
}

std::optional<AngleRowsHeld> bind_angle_rows(rope::RopeParams& p, const Tensor& q,
                                             RowsLauncher launch_rows, HostScratch host_scratch) {
  if (!p.freqs) return std::nullopt;
  const rope::DType dtype = angle_rows_dtype(p);
  const int64_t n_rows = p.n_tokens * p.rotary_dim;
  AngleRowsHeld held;
  rope::AngleRows ar{p, nullptr, dtype, nullptr};
  if (host_scratch) {
    const size_t row_bytes = size_t(n_rows) * size_t(rope::dtype_size(dtype));
    char* scratch = static_cast<char*>(host_scratch(row_bytes + size_t(p.n_tokens) * 8));
    ar.rows = scratch;
    ar.index = reinterpret_cast<int64_t*>(scratch + row_bytes);  // rows: whole 8-byte words
  } else {
    const ScalarType st = dtype == rope::DType::kFloat64 ? ScalarType::Double : ScalarType::Float;
    held.rows = torch::stable::empty({n_rows}, st, std::nullopt, q.device());
    held.index = torch::stable::empty({p.n_tokens}, ScalarType::Long, std::nullopt, q.device());
    ar.rows = held.rows->data_ptr();
    ar.index = static_cast<int64_t*>(held.index->data_ptr());
  }
  launch_rows(ar, q);
  // The kernels read the rows as a table whose row t is token t's: position t, from positions
  // laid out as the tokens are counted (the last token dim fastest).
  p.freqs = nullptr;
  p.positions = ar.index;
  p.pos_type = rope::PosType::kInt64;
  p.pos_int64 = true;
  for (int64_t d = p.n_tok_dims - 1, stride = 1; d >= 0; stride *= p.tok_size[d--])
    p.pos_stride[d] = stride;
  p.n_axes = 0;
  p.axis_layout = rope::AxisLayout::kContiguous;
  p.pos_section_stride = 0;
  p.cos_sin = ar.rows;
  p.cs_row_stride = p.rotary_dim;
  p.n_cache_rows = p.n_tokens;
  p.cs_dtype = dtype;
  return held;
}

Tensor angle_rows_op(const Backend& backend, const Tensor& positions, const Tensor& freqs) {
  ROPE_CHECK(ValueError, positions.dim() == 1, "positions must have shape [n], got shape ",
             shape_str(positions.sizes()));
  ROPE_CHECK(ValueError, freqs.dim() == 1 && freqs.size(0) > 0 && freqs.size(0) % 2 == 0,
             "freqs must have shape [rotary_dim] (rotary_dim even and positive), got shape ",
             shape_str(freqs.sizes()));
  ROPE_CHECK(TypeError, dtype_of(freqs) == ScalarType::Double, "freqs must be float64, got ",
             dtype_of(freqs));
  ROPE_CHECK(ValueError, freqs.stride(0) == 1, "freqs must be contiguous, got strides ",
             shape_str(freqs.strides()));
  const ScalarType pd = dtype_of(positions);
  ROPE_CHECK(TypeError,
             pd == ScalarType::Int || pd == ScalarType::Long || pd == ScalarType::Float ||
                 pd == ScalarType::Double,
             "positions must be int32, int64, float32 or float64, got ", pd);
  ROPE_CHECK(ValueError,
             freqs.get_device_index() == positions.get_device_index() &&
                 freqs.device().type() == positions.device().type(),
             "freqs must be on the device of positions (", device_str(positions), "), got ",
             device_str(freqs));
  ROPE_CHECK(ValueError, freqs.size(0) <= rope::kMaxHeadDim, "rotary_dim must be at most 2^29");
  const int64_t n = positions.size(0);
  Tensor rows = torch::stable::empty({n, freqs.size(0)}, ScalarType::Double, std::nullopt,
                                     positions.device());
  rope::AngleRows ar{};
  rope::RopeParams& p = ar.rope;
  p.n_tok_dims = 1;
  p.n_tokens = p.tok_size[0] = n;
  p.pos_stride[0] = positions.stride(0);
  p.positions = positions.data_ptr();
  p.pos_type = pd == ScalarType::Int     ? rope::PosType::kInt32
               : pd == ScalarType::Long  ? rope::PosType::kInt64
               : pd == ScalarType::Float ? rope::PosType::kFloat32
                                         : rope::PosType::kFloat64;
  p.freqs = static_cast<const double*>(freqs.data_ptr());
  p.rotary_dim = int(freqs.size(0));
  ar.rows = rows.data_ptr();
  ar.rows_dtype = rope::DType::kFloat64;
  if (n > 0) backend.launch_rows(ar, positions);
  return rows;
}

namespace {

void run(rope::RopeParams p, const Tensor& q, const Backend& backend) {
  int64_t heads = 0;
  for (int t = 0; t < p.n_tensors; ++t) heads += p.t[t].n_heads;
  if (p.n_tokens == 0 || heads == 0) return;  // empty: nothing to read or write
  const auto rows = bind_angle_rows(p, q, backend.launch_rows, backend.host_scratch);
  if (backend.check_positions) backend.check_positions(p);
  backend.launch(p, q);
}

}  // namespace

// Output for x: x's layout (empty_like), unless that leaves the last dim
// strided, as it does for some expanded inputs (sizes [1, 2, 3], strides
// [1, 0, 1] give [1, 1, 2]); then row-major.
Tensor empty_output(const Tensor& x) {
  Tensor out = torch::stable::empty_like(x);
  const int64_t dim = out.dim();
  if (dim > 0 && out.size(dim - 1) > 1 && out.stride(dim - 1) != 1)
    out = torch::stable::empty(x.sizes(), dtype_of(x), std::nullopt, x.device());
  return out;
}

Tensor rotary(const Backend& backend, const Tensor& x, const Tensor& positions,
              const Tensor& cos_sin, bool interleaved, bool inverse, int64_t rotary_offset,
              const Sections& mrope_section, int64_t mrope_interleaved) {
  const Arg xa(x);
  check_input(xa, "x");
  Tensor out = empty_output(x);
  const auto p = make_params(xa, Arg(out), nullptr, nullptr, positions, cos_sin, interleaved,
                             inverse, rotary_offset, mrope_section, mrope_interleaved);
  run(p, x, backend);
  return out;
}

std::tuple<Tensor, Tensor> rotary_qk(const Backend& backend, const Tensor& q, const Tensor& k,
                                     const Tensor& positions, const Tensor& cos_sin,
                                     bool interleaved, bool inverse, int64_t rotary_offset,
                                     const Sections& mrope_section, int64_t mrope_interleaved) {
  const Arg qa(q), ka(k);
  check_input(qa, "q");
  check_input(ka, "k");
  Tensor q_out = empty_output(q), k_out = empty_output(k);
  const Arg qo(q_out), ko(k_out);
  const auto p = make_params(qa, qo, &ka, &ko, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  run(p, q, backend);
  return {q_out, k_out};
}

void rotary_qk_(const Backend& backend, const Tensor& q, const std::optional<Tensor>& k,
                const Tensor& positions, const Tensor& cos_sin, bool interleaved, bool inverse,
                int64_t rotary_offset, const Sections& mrope_section, int64_t mrope_interleaved) {
  const Arg qa(q);
  std::optional<Arg> ka;
  if (k.has_value() && k->defined()) ka.emplace(*k);
  const Arg* kp = ka ? &*ka : nullptr;
  const auto p = make_params(qa, qa, kp, kp, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved, "q");
  check_writable(qa, kp);
  run(p, q, backend);
}

}  // namespace rope_ext

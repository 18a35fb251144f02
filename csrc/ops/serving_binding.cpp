// Binding of the serving ops (rope_ext::rotary_qk_cache_, qk_norm_rotary_,
// qk_norm_rotary, qk_norm_rotary_packed_): argument checks with user-facing
// messages, kernel parameters from tensors, and the op bodies.
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "../rope/rope.h"
#include "binding.h"
#include "layout.h"

namespace rope_ext {

using torch::headeronly::ScalarType;

rope::Fp8 fp8_of(ScalarType t) {
  return t == ScalarType::Float8_e4m3fn ? rope::Fp8::kE4M3
         : t == ScalarType::Float8_e5m2 ? rope::Fp8::kE5M2
                                        : rope::Fp8::kNone;
}

namespace {

// A [T, H, dim] tensor with a contiguous last dim.
void check_3d(const Arg& x, const char* name, const char* shape) {
  ROPE_CHECK(TypeError, x.defined(), name, " must be a tensor, got None");
  ROPE_CHECK(ValueError, x.dim() == 3, name, " must be ", shape, ", got shape ",
             shape_str(x.sizes()));
  ROPE_CHECK(ValueError, x.size(2) <= 1 || x.stride(2) == 1, name,
             " must have a contiguous last dim (stride 1), got strides ", shape_str(x.strides()));
}

}  // namespace

const float* scale_ptr(const std::optional<Tensor>& s, const char* name, const Arg& x,
                       const char* x_name) {
  if (!s.has_value() || !s->defined()) return nullptr;
  ROPE_CHECK(TypeError, dtype_of(*s) == ScalarType::Float, name,
             " must be a float32 tensor of one element, got ", dtype_of(*s));
  ROPE_CHECK(ValueError, s->numel() == 1, name, " must have one element, got shape ",
             shape_str(s->sizes()));
  ROPE_CHECK(ValueError, same_device(*s, x), name, " must be on the device of ", x_name, " (",
             device_str(x), "), got ", device_str(*s));
  return static_cast<const float*>(s->data_ptr());
}

void check_no_self_overlap(const Layout& t, const char* name) {
  ROPE_CHECK(ValueError, !self_overlaps(t), name,
             " has elements that overlap in memory (expanded or stride-0 view, strides ",
             shape_str(t.stride), "); it is written in place");
}

namespace {

// The rotation's tokens must be the T rows of q, one position each. The kernels then take one
// token dim and one head dim (token_offsets_1d, head_offsets_1d), which [T, H, D] tensors have.
void check_tokens(const rope::RopeParams& p, int64_t T) {
  ROPE_CHECK(ValueError, p.n_tok_dims <= 1 && (p.n_tokens == T || T <= 1),
             "positions must hold one position per token of q (", T,
             " tokens) with a nonzero stride: [T] (or [n_axes, T] with mrope_section)");
  ROPE_CHECK(std::logic_error,
             p.n_tokens == 0 || p.t[0].n_heads + p.t[1].n_heads == 0 ||
                 (p.t[0].n_head_dims <= 1 && p.t[1].n_head_dims <= 1),
             "q and k of [T, H, D] with heads over several dims");
}

}  // namespace

namespace {

// The names a cache write's messages give its tensors: the GQA op's, or the MLA op's (whose k and v
// are views of k_pe and kv_c, and whose two caches are the column ranges of one kv_cache).
struct CacheNames {
  const char *k, *v, *key_cache, *value_cache, *k_scale, *v_scale;
};
constexpr CacheNames kGqaNames{"k", "v", "key_cache", "value_cache", "k_scale", "v_scale"};
constexpr CacheNames kMlaNames{"k_pe", "kv_c", "kv_cache", "kv_cache", "kv_scale", "kv_scale"};

// The checks and kernel parameters of a cache write. mla: k is k_pe [T, 1, rotary_dim], rotated
// whole, and the messages use the MLA op's names.
rope::CacheParams cache_params(const Arg& q, const Arg& k, const Arg& v, const Tensor& positions,
                               const Tensor& cos_sin, const Arg& key_cache, const Arg& value_cache,
                               const std::optional<Tensor>& slot_mapping_arg,
                               const std::optional<Tensor>& k_scale,
                               const std::optional<Tensor>& v_scale, const Arg* qo,
                               const std::optional<Tensor>& q_scale, bool interleaved,
                               const std::string& layout, int64_t rotary_offset,
                               const Sections& mrope_section, int64_t mrope_interleaved,
                               bool inverse, const PageTableArg& page_table, bool mla) {
  const CacheNames& n = mla ? kMlaNames : kGqaNames;
  check_3d(q, "q", "[T, Hq, D]");
  check_3d(k, n.k, "[T, Hk, D]");
  check_3d(v, n.v, "[T, Hk, Dv]");
  const int64_t T = q.size(0), Hk = k.size(1), Dv = v.size(2);
  ROPE_CHECK(ValueError, Dv <= rope::kMaxHeadDim, n.v, ".shape[-1] must be at most ",
             rope::kMaxHeadDim, ", got ", Dv);
  ROPE_CHECK(ValueError, k.size(0) == T && v.size(0) == T, "q, ", n.k, " and ", n.v,
             " must have the same tokens T (dim 0), got shapes ", shape_str(q.sizes()), ", ",
             shape_str(k.sizes()), ", ", shape_str(v.sizes()));
  ROPE_CHECK(ValueError, v.size(1) == Hk, n.v, " must have the heads of ", n.k, " (", Hk,
             "), got shape ", shape_str(v.sizes()));
  ROPE_CHECK(TypeError, dtype_of(v) == dtype_of(q), n.v, " must have the dtype of q (", dtype_of(q),
             "), got ", dtype_of(v));
  ROPE_CHECK(ValueError, same_device(v, q), n.v, " must be on the device of q (", device_str(q),
             "), got ", device_str(v));

  const rope::Fp8 q_fp8 = qo ? fp8_of(dtype_of(*qo)) : rope::Fp8::kNone;
  if (qo) {
    ROPE_CHECK(TypeError, dtype_of(*qo) == dtype_of(q) || q_fp8 != rope::Fp8::kNone,
               "q_out must have the dtype of q (", dtype_of(q),
               ") or be float8_e4m3fn / float8_e5m2, got ", dtype_of(*qo));
    ROPE_CHECK(ValueError, qo->sizes().equals(q.sizes()), "q_out must have the shape of q (",
               shape_str(q.sizes()), "), got ", shape_str(qo->sizes()));
    ROPE_CHECK(ValueError, same_device(*qo, q), "q_out must be on the device of q (", device_str(q),
               "), got ", device_str(*qo));
    ROPE_CHECK(ValueError, q.size(2) <= 1 || qo->stride(2) == 1,
               "q_out must have a contiguous last dim (stride 1), got strides ",
               shape_str(qo->strides()));
  }
  const bool q_direct = qo && q_fp8 == rope::Fp8::kNone;
  rope::CacheParams cp{};
  cp.rope = make_params(q, q_direct ? *qo : q, &k, &k, positions, cos_sin, interleaved, false,
                        rotary_offset, mrope_section, mrope_interleaved, "q", true, n.k, mla);
  check_tokens(cp.rope, T);
  cp.k_dim = mla ? cp.rope.rotary_dim : cp.rope.head_dim;
  cp.k_rot_offset = mla ? 0 : cp.rope.rot_offset;
  cp.q_inverse = inverse;
  const int64_t Dk = cp.k_dim;
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
       {std::pair{&key_cache, n.key_cache}, {&value_cache, n.value_cache}}) {
    ROPE_CHECK(TypeError, c->defined(), name, " must be a tensor, got None");
    ROPE_CHECK(ValueError, c->dim() == 4, name, " must be 4-d ",
               nhd ? "[num_blocks, block_size, Hk, dim]" : "[num_blocks, Hk, block_size, dim]",
               " (layout='", layout, "'), got shape ", shape_str(c->sizes()));
    ROPE_CHECK(ValueError, same_device(*c, q), name, " must be on the device of q (", device_str(q),
               "), got ", device_str(*c));
    ROPE_CHECK(ValueError, c->size(3) <= 1 || c->stride(3) == 1, name,
               " must have a contiguous last dim (stride 1), got strides ",
               shape_str(c->strides()));
  }
  const ScalarType cache_dtype = dtype_of(key_cache);
  cp.cache_fp8 = fp8_of(cache_dtype);
  ROPE_CHECK(TypeError, cache_dtype == dtype_of(q) || cp.cache_fp8 != rope::Fp8::kNone, n.key_cache,
             " must have the dtype of q (", dtype_of(q),
             ") or be float8_e4m3fn / float8_e5m2, got ", cache_dtype);
  ROPE_CHECK(TypeError, dtype_of(value_cache) == cache_dtype, n.value_cache,
             " must have the dtype of ", n.key_cache, " (", cache_dtype, "), got ",
             dtype_of(value_cache));
  const int64_t NB = key_cache.size(0), BS = key_cache.size(nhd ? 1 : 2);
  const int64_t want_k[4] = {NB, nhd ? BS : Hk, nhd ? Hk : BS, Dk};
  const int64_t want_v[4] = {NB, nhd ? BS : Hk, nhd ? Hk : BS, Dv};
  ROPE_CHECK(ValueError, key_cache.sizes().equals(want_k), n.key_cache, " must have shape ",
             shape_str(want_k), " for ", n.k, " of shape ", shape_str(k.sizes()), " (layout='",
             layout, "'), got ", shape_str(key_cache.sizes()));
  ROPE_CHECK(ValueError, value_cache.sizes().equals(want_v), n.value_cache, " must have shape ",
             shape_str(want_v), " for ", n.v, " of shape ", shape_str(v.sizes()), " (layout='",
             layout, "'), got ", shape_str(value_cache.sizes()));
  auto paged = [&](const Arg& c, const float* scale) {
    rope::PagedCache pc{};
    pc.data = c.data_ptr();
    pc.block_stride = c.stride(0);
    pc.row_stride = c.stride(nhd ? 1 : 2);
    pc.head_stride = c.stride(nhd ? 2 : 1);
    pc.scale = scale;
    return pc;
  };
  const bool fp8 = cp.cache_fp8 != rope::Fp8::kNone;
  const float* ks = scale_ptr(k_scale, n.k_scale, q);
  const float* vs = scale_ptr(v_scale, n.v_scale, q);
  cp.key_cache = paged(key_cache, fp8 ? ks : nullptr);
  cp.value_cache = paged(value_cache, fp8 ? vs : nullptr);
  cp.block_size = BS;
  cp.n_cache_slots = NB * BS;

  // The slots: slot_mapping, or a page table.
  ROPE_CHECK(ValueError, !(page_table.has_value() && slot_mapping_arg.has_value()),
             "slot_mapping must be None when page_table is given (one of them places the tokens)");
  std::vector<std::pair<Layout, const char*>> index_reads;  // every thread reads these
  if (page_table.has_value()) {
    cp.pages = page_table_params(*page_table, q, "q", T, NB);
    for (size_t i = 0; i < page_table->size(); ++i)
      index_reads.emplace_back(Layout((*page_table)[i]), "page_table");
  } else {
    ROPE_CHECK(TypeError, slot_mapping_arg.has_value(),
               "slot_mapping must be a tensor, got None (or pass page_table)");
    const Tensor& slot_mapping = *slot_mapping_arg;
    ROPE_CHECK(TypeError, dtype_of(slot_mapping) == ScalarType::Long,
               "slot_mapping must be an int64 tensor, got ", dtype_of(slot_mapping));
    ROPE_CHECK(ValueError, slot_mapping.dim() == 1 && slot_mapping.size(0) <= T,
               "slot_mapping must be [T'] with T' <= T = ", T, ", got shape ",
               shape_str(slot_mapping.sizes()));
    ROPE_CHECK(ValueError, slot_mapping.size(0) <= 1 || slot_mapping.stride(0) == 1,
               "slot_mapping must be contiguous, got strides ", shape_str(slot_mapping.strides()));
    ROPE_CHECK(ValueError, same_device(slot_mapping, q),
               "slot_mapping must be on the device of q (", device_str(q), "), got ",
               device_str(slot_mapping));
    cp.slots = static_cast<const int64_t*>(slot_mapping.data_ptr());
    cp.n_slots = slot_mapping.size(0);
    index_reads.emplace_back(Layout(slot_mapping), "slot_mapping");
  }

  cp.v = v.data_ptr();
  cp.v_tok_stride = v.stride(0);
  cp.v_head_stride = v.stride(1);
  cp.v_dim = int(Dv);
  cp.n_kv_heads = Hk;

  // What is written must not overlap itself or anything else the call reads or writes.
  const Layout &lq = q.layout(), &lk = k.layout(), &lv = v.layout();
  const Layout &lkc = key_cache.layout(), &lvc = value_cache.layout();
  const Layout& lqo = qo ? qo->layout() : lq;
  const char* q_target = qo ? "q_out" : "q";
  check_no_self_overlap(lqo, q_target);
  check_no_self_overlap(lk, n.k);
  check_no_self_overlap(lkc, n.key_cache);
  check_no_self_overlap(lvc, n.value_cache);
  check_disjoint(lqo, q_target, lk, n.k);
  check_disjoint(lqo, q_target, lv, n.v);
  if (qo) {
    check_disjoint(lqo, "q_out", lq, "q");
    check_disjoint(lq, "q", lk, n.k);  // q is read while k is rotated in place
  }
  check_disjoint(lk, n.k, lv, n.v);
  check_disjoint(lkc, n.key_cache, lvc, n.value_cache);
  for (const auto& [c, cn] : {std::pair{&lkc, n.key_cache}, {&lvc, n.value_cache}})
    for (const auto& [x, xn] : {std::pair{&lq, "q"}, {&lk, n.k}, {&lv, n.v}})
      check_disjoint(*c, cn, *x, xn);
  // Nor may it hold the positions, the table, the slots or a scale, which every thread reads.
  const Layout none;
  const Layout lpos(positions), lcs(cos_sin);
  const Layout lks = ks ? Layout(*k_scale) : none, lvs = vs ? Layout(*v_scale) : none;
  const Layout lqs = qs ? Layout(*q_scale) : none;
  for (const auto& [w, wn] :
       {std::pair{&lqo, q_target}, {&lk, n.k}, {&lkc, n.key_cache}, {&lvc, n.value_cache}}) {
    for (const auto& [r, rn] : {std::pair{&lpos, "positions"},
                                {&lcs, "cos_sin"},
                                {&lks, n.k_scale},
                                {&lvs, n.v_scale},
                                {&lqs, "q_scale"}})
      check_disjoint(*w, wn, *r, rn);
    for (const auto& [r, rn] : index_reads) check_disjoint(*w, wn, r, rn);
  }
  return cp;
}

}  // namespace

rope::CacheParams make_cache_params(
    const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& positions,
    const Tensor& cos_sin, const Tensor& key_cache_t, const Tensor& value_cache_t,
    const std::optional<Tensor>& slot_mapping, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, const std::optional<Tensor>& q_out,
    const std::optional<Tensor>& q_scale, bool interleaved, const std::string& layout,
    int64_t rotary_offset, const Sections& mrope_section, int64_t mrope_interleaved, bool inverse,
    const PageTableArg& page_table) {
  const Arg q(q_t), k(k_t), v(v_t), key_cache(key_cache_t), value_cache(value_cache_t);
  std::optional<Arg> q_out_arg;
  if (q_out.has_value() && q_out->defined()) q_out_arg.emplace(*q_out);
  return cache_params(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale,
                      v_scale, q_out_arg ? &*q_out_arg : nullptr, q_scale, interleaved, layout,
                      rotary_offset, mrope_section, mrope_interleaved, inverse, page_table, false);
}

rope::CacheParams make_mla_cache_params(
    const Tensor& q_t, const Tensor& kv_c_t, const Tensor& k_pe_t, const Tensor& positions,
    const Tensor& cos_sin, const Tensor& kv_cache_t, const std::optional<Tensor>& slot_mapping,
    const std::optional<Tensor>& kv_scale, const std::optional<Tensor>& q_out,
    const std::optional<Tensor>& q_scale, bool interleaved, int64_t rotary_offset, bool inverse,
    const PageTableArg& page_table) {
  const Arg q(q_t), kv_c(kv_c_t), k_pe(k_pe_t), kv_cache(kv_cache_t);
  for (const auto& [x, name] : {std::pair{&q, "q"}, {&kv_c, "kv_c"}, {&k_pe, "k_pe"}})
    ROPE_CHECK(TypeError, x->defined(), name, " must be a tensor, got None");
  ROPE_CHECK(TypeError, kv_cache.defined(), "kv_cache must be a tensor, got None");
  check_3d(q, "q", "[T, H, D] (D = nope + rope features)");
  ROPE_CHECK(ValueError, kv_c.dim() == 2, "kv_c must be [T, kv_lora_rank], got shape ",
             shape_str(kv_c.sizes()));
  ROPE_CHECK(ValueError, k_pe.dim() == 2 || (k_pe.dim() == 3 && k_pe.size(1) == 1),
             "k_pe must be [T, rotary_dim] or [T, 1, rotary_dim], got shape ",
             shape_str(k_pe.sizes()));
  const int64_t T = q.size(0), L = kv_c.size(1), R = k_pe.size(k_pe.dim() - 1);
  ROPE_CHECK(ValueError, kv_c.size(0) == T && k_pe.size(0) == T,
             "q, kv_c and k_pe must have the same tokens T (dim 0), got shapes ",
             shape_str(q.sizes()), ", ", shape_str(kv_c.sizes()), ", ", shape_str(k_pe.sizes()));
  ROPE_CHECK(ValueError, L <= 1 || kv_c.stride(1) == 1,
             "kv_c must have a contiguous last dim (stride 1), got strides ",
             shape_str(kv_c.strides()));
  ROPE_CHECK(ValueError, R <= 1 || k_pe.stride(k_pe.dim() - 1) == 1,
             "k_pe must have a contiguous last dim (stride 1), got strides ",
             shape_str(k_pe.strides()));
  // (a table the rotation rejects is reported by its own check)
  if (cos_sin.defined() && cos_sin.dim() == 2 && cos_sin.size(1) > 0 && cos_sin.size(1) % 2 == 0)
    ROPE_CHECK(ValueError, R == cos_sin.size(1),
               "k_pe.shape[-1] must be rotary_dim (cos_sin.shape[-1] = ", cos_sin.size(1),
               "), got ", R);
  check_no_self_overlap(k_pe.layout(), "k_pe");
  ROPE_CHECK(ValueError, kv_cache.dim() == 3,
             "kv_cache must be [num_blocks, block_size, kv_lora_rank + rotary_dim], got shape ",
             shape_str(kv_cache.sizes()));
  ROPE_CHECK(ValueError, kv_cache.size(2) == L + R,
             "kv_cache.shape[-1] must be kv_lora_rank + rotary_dim = ", L, " + ", R, " = ", L + R,
             " (kv_c.shape[-1] + k_pe.shape[-1]), got ", kv_cache.size(2));
  ROPE_CHECK(ValueError, kv_cache.size(2) <= 1 || kv_cache.stride(2) == 1,
             "kv_cache must have a contiguous last dim (stride 1), got strides ",
             shape_str(kv_cache.strides()));
  // k and v of the cache write: k_pe and kv_c as one head each; the caches: kv_cache's columns
  // [L, L + R) and [0, L), one head each.
  const int64_t k_sizes[3] = {T, 1, R}, k_strides[3] = {k_pe.stride(0), R, 1};
  const int64_t v_sizes[3] = {T, 1, L}, v_strides[3] = {kv_c.stride(0), L, 1};
  const int64_t NB = kv_cache.size(0), BS = kv_cache.size(1);
  const int64_t kc_sizes[4] = {NB, BS, 1, R}, vc_sizes[4] = {NB, BS, 1, L};
  const int64_t c_strides[4] = {kv_cache.stride(0), kv_cache.stride(1), L + R, 1};
  const Arg k(k_pe, k_sizes, k_strides, 0), v(kv_c, v_sizes, v_strides, 0);
  const Arg key_cache(kv_cache, kc_sizes, c_strides, L),
      value_cache(kv_cache, vc_sizes, c_strides, 0);
  std::optional<Arg> q_out_arg;
  if (q_out.has_value() && q_out->defined()) q_out_arg.emplace(*q_out);
  return cache_params(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, kv_scale,
                      kv_scale, q_out_arg ? &*q_out_arg : nullptr, q_scale, interleaved, "NHD",
                      rotary_offset, std::nullopt, false, inverse, page_table, true);
}

void check_slots(const int64_t* slots, int64_t n, int64_t n_cache_slots, const char* what,
                 const char* source) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slots[t];
    ROPE_CHECK(std::out_of_range, s == -1 || (s >= 0 && s < n_cache_slots),
               "slot_mapping must hold -1 or slots in [0, num_blocks * block_size) = [0, ",
               n_cache_slots, "), got ", s, " for token ", t);
  }
  // Two tokens that name one slot (-1 aside) would write its row twice, in an order the GPU does
  // not fix.
  int64_t last = -1;
  bool increasing = true;  // the usual slot mapping: no sort needed
  for (int64_t t = 0; t < n && increasing; ++t)
    if (slots[t] >= 0) increasing = slots[t] > last, last = slots[t];
  if (increasing) return;
  std::vector<std::pair<int64_t, int64_t>> st;  // (slot, token)
  st.reserve(size_t(n));
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] >= 0) st.emplace_back(slots[t], t);
  std::sort(st.begin(), st.end());
  for (size_t i = 1; i < st.size(); ++i)
    ROPE_CHECK(ValueError, st[i].first != st[i - 1].first, source, " holds slot ", st[i].first,
               " twice (tokens ", st[i - 1].second, " and ", st[i].second, "); ", what);
}

namespace {

// A cache write's positions and slots checked (a backend that reads host memory), then its launch.
void run_cache(rope::CacheParams cp, const Tensor& q, const Backend& backend) {
  if (cp.rope.n_tokens == 0 || q.size(0) == 0) return;
  const auto rows = bind_angle_rows(cp.rope, q, backend.launch_rows, backend.host_scratch);
  if (backend.check_positions) {
    backend.check_positions(cp.rope);
    constexpr const char* kWhy = "each token's k and v need a slot of their own";
    if (cp.pages.batch) {
      const std::vector<int64_t> slots = page_table_slots(cp.pages, cp.block_size);
      check_slots(slots.data(), int64_t(slots.size()), cp.n_cache_slots, kWhy, "page_table");
    } else {
      check_slots(cp.slots, cp.n_slots, cp.n_cache_slots, kWhy);
    }
  }
  backend.launch_cache(cp, q);
}

}  // namespace

void rotary_qk_cache_(const Backend& backend, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& positions, const Tensor& cos_sin, const Tensor& key_cache,
                      const Tensor& value_cache, const std::optional<Tensor>& slot_mapping,
                      const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                      const std::optional<Tensor>& q_out, const std::optional<Tensor>& q_scale,
                      bool interleaved, const std::string& layout, int64_t rotary_offset,
                      const Sections& mrope_section, int64_t mrope_interleaved, bool inverse,
                      const PageTableArg& page_table) {
  run_cache(make_cache_params(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping,
                              k_scale, v_scale, q_out, q_scale, interleaved, layout, rotary_offset,
                              mrope_section, mrope_interleaved, inverse, page_table),
            q, backend);
}

void mla_rotary_cache_(const Backend& backend, const Tensor& q, const Tensor& kv_c,
                       const Tensor& k_pe, const Tensor& positions, const Tensor& cos_sin,
                       const Tensor& kv_cache, const std::optional<Tensor>& slot_mapping,
                       const std::optional<Tensor>& kv_scale, const std::optional<Tensor>& q_out,
                       const std::optional<Tensor>& q_scale, bool interleaved,
                       int64_t rotary_offset, bool inverse, const PageTableArg& page_table) {
  run_cache(
      make_mla_cache_params(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping, kv_scale,
                            q_out, q_scale, interleaved, rotary_offset, inverse, page_table),
      q, backend);
}

rope::NormParams make_norm_params(const Arg& q, const Arg& q_out, const Arg& k, const Arg& k_out,
                                  const Tensor& q_weight, const Tensor& k_weight,
                                  const Tensor& positions, const Tensor& cos_sin, double eps,
                                  bool interleaved, double weight_offset, int64_t rotary_offset,
                                  const Sections& mrope_section, int64_t mrope_interleaved) {
  check_3d(q, "q", "[T, Hq, D]");
  check_3d(k, "k", "[T, Hk, D]");
  const int64_t T = q.size(0), D = q.size(2);
  ROPE_CHECK(ValueError, k.size(0) == T, "q and k must have the same tokens T (dim 0), got shapes ",
             shape_str(q.sizes()), ", ", shape_str(k.sizes()));
  ROPE_CHECK(ValueError, D <= rope::kMaxNormHeadDim, "head_dim (q.shape[-1]) must be at most ",
             rope::kMaxNormHeadDim, " for the fused QK norm, got ", D);
  ROPE_CHECK(ValueError, eps >= 0 && eps < 1e30, "eps must be a non-negative finite number, got ",
             eps);
  ROPE_CHECK(ValueError, std::isfinite(weight_offset), "weight_offset must be finite, got ",
             weight_offset);
  rope::NormParams np{};
  np.rope = make_params(q, q_out, &k, &k_out, positions, cos_sin, interleaved, false, rotary_offset,
                        mrope_section, mrope_interleaved, "q", true);
  check_tokens(np.rope, T);
  // The kernels carry a (token, head) item's head in 32 bits (cuda/serving.cuh, ItemCursor).
  ROPE_CHECK(ValueError, q.size(1) + k.size(1) <= INT32_MAX,
             "q and k must have at most 2^31 - 1 heads together, got ", q.size(1), " + ",
             k.size(1));
  int i = 0;
  for (const auto& [w, name] : {std::pair{&q_weight, "q_weight"}, {&k_weight, "k_weight"}}) {
    ROPE_CHECK(TypeError, w->defined(), name, " must be a tensor, got None");
    ROPE_CHECK(TypeError, is_supported_float(dtype_of(*w)), name,
               " must be a floating tensor (float32, float64, float16 or bfloat16), got ",
               dtype_of(*w));
    ROPE_CHECK(ValueError, w->dim() == 1 && w->size(0) == D, name, " must be [D] = [", D,
               "], got shape ", shape_str(w->sizes()));
    ROPE_CHECK(ValueError, D <= 1 || w->stride(0) == 1, name, " must be contiguous, got strides ",
               shape_str(w->strides()));
    ROPE_CHECK(ValueError, same_device(*w, q), name, " must be on the device of q (", device_str(q),
               "), got ", device_str(*w));
    np.weight[i] = w->data_ptr();
    np.w_dtype[i] = to_dtype(dtype_of(*w));
    ++i;
    const Layout lw(*w);
    check_disjoint(q_out.layout(), &q_out == &q ? "q" : "q_out", lw, name);
    check_disjoint(k_out.layout(), &k_out == &k ? "k" : "k_out", lw, name);
  }
  np.eps = eps;
  np.weight_offset = weight_offset;
  return np;
}

namespace {

void run_norm(rope::NormParams np, const Tensor& q, const Backend& backend) {
  if (np.rope.n_tokens == 0 || np.rope.t[0].n_heads + np.rope.t[1].n_heads == 0) return;
  const auto rows = bind_angle_rows(np.rope, q, backend.launch_rows, backend.host_scratch);
  if (backend.check_positions) backend.check_positions(np.rope);
  backend.launch_norm(np, q);
}

void norm_in_place(const Arg& q, const Arg& k, const Tensor& q_weight, const Tensor& k_weight,
                   const Tensor& positions, const Tensor& cos_sin, double eps, bool interleaved,
                   double weight_offset, int64_t rotary_offset, const Sections& mrope_section,
                   int64_t mrope_interleaved, const Backend& backend) {
  const auto np =
      make_norm_params(q, q, k, k, q_weight, k_weight, positions, cos_sin, eps, interleaved,
                       weight_offset, rotary_offset, mrope_section, mrope_interleaved);
  check_writable(q, &k);
  run_norm(np, q.tensor(), backend);
}

}  // namespace

void qk_norm_rotary_(const Backend& backend, const Tensor& q, const Tensor& k,
                     const Tensor& q_weight, const Tensor& k_weight, const Tensor& positions,
                     const Tensor& cos_sin, double eps, bool interleaved, double weight_offset,
                     int64_t rotary_offset, const Sections& mrope_section,
                     int64_t mrope_interleaved) {
  norm_in_place(Arg(q), Arg(k), q_weight, k_weight, positions, cos_sin, eps, interleaved,
                weight_offset, rotary_offset, mrope_section, mrope_interleaved, backend);
}

void qk_norm_rotary_packed_(const Backend& backend, const Tensor& qkv_t, int64_t num_heads_q,
                            int64_t num_heads_k, int64_t num_heads_v, const Tensor& q_weight,
                            const Tensor& k_weight, const Tensor& positions, const Tensor& cos_sin,
                            double eps, bool interleaved, double weight_offset,
                            int64_t rotary_offset, const Sections& mrope_section,
                            int64_t mrope_interleaved) {
  ROPE_CHECK(TypeError, qkv_t.defined(), "qkv must be a tensor, got None");
  const Arg qkv(qkv_t);
  ROPE_CHECK(ValueError, qkv.dim() == 2, "qkv must be [T, (Hq+Hk+Hv)*D], got shape ",
             shape_str(qkv.sizes()));
  ROPE_CHECK(TypeError, is_supported_float(dtype_of(qkv)),
             "qkv must be a floating tensor (float32, float64, float16 or bfloat16), got ",
             dtype_of(qkv));
  // Each count is bounded before the sum, which then cannot overflow.
  constexpr int64_t kMaxHeads = (int64_t(1) << 31) - 1;
  ROPE_CHECK(ValueError,
             num_heads_q >= 1 && num_heads_k >= 1 && num_heads_v >= 0 && num_heads_q <= kMaxHeads &&
                 num_heads_k <= kMaxHeads && num_heads_v <= kMaxHeads,
             "head counts must be ints, q and k in [1, 2^31 - 1], v in [0, 2^31 - 1]; got (",
             num_heads_q, ", ", num_heads_k, ", ", num_heads_v, ")");
  const int64_t heads = num_heads_q + num_heads_k + num_heads_v, width = qkv.size(1);
  ROPE_CHECK(ValueError, width % heads == 0, "qkv.shape[-1] = ", width,
             " is not a multiple of Hq+Hk+Hv = ", heads);
  ROPE_CHECK(ValueError, width <= 1 || qkv.stride(1) == 1,
             "qkv must have a contiguous last dim (stride 1), got strides ",
             shape_str(qkv.strides()));
  check_no_self_overlap(qkv.layout(), "qkv");
  const int64_t T = qkv.size(0), D = width / heads;
  const int64_t q_shape[3] = {T, num_heads_q, D}, k_shape[3] = {T, num_heads_k, D};
  const int64_t strides[3] = {qkv.stride(0), D, 1};
  // q and k as views of qkv's layout (no tensors made for them: a view costs microseconds).
  const Arg q(qkv, q_shape, strides, 0), k(qkv, k_shape, strides, num_heads_q * D);
  norm_in_place(q, k, q_weight, k_weight, positions, cos_sin, eps, interleaved, weight_offset,
                rotary_offset, mrope_section, mrope_interleaved, backend);
}

std::tuple<Tensor, Tensor> qk_norm_rotary(const Backend& backend, const Tensor& q, const Tensor& k,
                                          const Tensor& q_weight, const Tensor& k_weight,
                                          const Tensor& positions, const Tensor& cos_sin,
                                          double eps, bool interleaved, double weight_offset,
                                          int64_t rotary_offset, const Sections& mrope_section,
                                          int64_t mrope_interleaved) {
  const Arg qa(q), ka(k);
  check_3d(qa, "q", "[T, Hq, D]");
  check_3d(ka, "k", "[T, Hk, D]");
  check_input(qa, "q");
  check_input(ka, "k");
  Tensor q_out = empty_output(q), k_out = empty_output(k);
  const auto np =
      make_norm_params(qa, Arg(q_out), ka, Arg(k_out), q_weight, k_weight, positions, cos_sin, eps,
                       interleaved, weight_offset, rotary_offset, mrope_section, mrope_interleaved);
  run_norm(np, q, backend);
  return {q_out, k_out};
}

}  // namespace rope_ext

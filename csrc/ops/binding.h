// Binding layer shared by every backend, on the LibTorch stable ABI
// (torch/csrc/stable, header-only torch/headeronly): kernel parameters from
// tensors and the op bodies: binding.cpp (the rotary ops), serving_binding.cpp
// (the serving ops). The checks' vocabulary is checks.h; layout.h reads each
// tensor argument once and checks overlaps of what is written. A backend only
// supplies how to run the kernel.
#pragma once

#include <torch/csrc/stable/library.h>

#include <tuple>
#include <type_traits>

#include "checks.h"
#include "layout.h"

namespace rope_ext {

// Builds the table-free rows of ar (params.h AngleRows) on q's device.
using RowsLauncher = void (*)(const rope::AngleRows& ar, const Tensor& q);
// Host memory of at least `bytes`, 64-byte aligned, for the table-free rows of
// one call on the calling thread (valid until its next call).
using HostScratch = void* (*)(size_t bytes);

struct Backend {
  // Raise if a position is outside [0, cos_sin.size(0)); null when the
  // backend cannot look at positions without a host synchronisation.
  void (*check_positions)(const rope::RopeParams& p);
  // Rotate every token of p.
  void (*launch)(const rope::RopeParams& p, const Tensor& q);
  // RoPE + KV-cache write of every token of p (slots checked when
  // check_positions is set: such a backend reads host memory).
  void (*launch_cache)(const rope::CacheParams& p, const Tensor& q);
  // QK-RMSNorm + rotary of every token of p.
  void (*launch_norm)(const rope::NormParams& p, const Tensor& q);
  // Re-rotation of the cached keys of every token of p (slots and deltas
  // checked when check_positions is set).
  void (*launch_rerotate)(const rope::RerotateParams& p, const Tensor& key_cache);
  // The table-free rows (CPU: raises for a position whose angle cannot be formed),
  // in host_scratch's memory (CPU), else in tensors on the device.
  RowsLauncher launch_rows;
  HostScratch host_scratch;
};

// rope_ext::rotary
Tensor rotary(const Backend& backend, const Tensor& x, const Tensor& positions,
              const Tensor& cos_sin, bool interleaved, bool inverse, int64_t rotary_offset,
              const Sections& mrope_section, int64_t mrope_interleaved);

// rope_ext::rotary_qk
std::tuple<Tensor, Tensor> rotary_qk(const Backend& backend, const Tensor& q, const Tensor& k,
                                     const Tensor& positions, const Tensor& cos_sin,
                                     bool interleaved, bool inverse, int64_t rotary_offset,
                                     const Sections& mrope_section, int64_t mrope_interleaved);

// rope_ext::rotary_qk_ (in place)
void rotary_qk_(const Backend& backend, const Tensor& q, const std::optional<Tensor>& k,
                const Tensor& positions, const Tensor& cos_sin, bool interleaved, bool inverse,
                int64_t rotary_offset, const Sections& mrope_section, int64_t mrope_interleaved);

// rope_ext::rotary_qk_cache_ (RoPE + KV-cache write)
void rotary_qk_cache_(const Backend& backend, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& positions, const Tensor& cos_sin, const Tensor& key_cache,
                      const Tensor& value_cache, const std::optional<Tensor>& slot_mapping,
                      const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                      const std::optional<Tensor>& q_out, const std::optional<Tensor>& q_scale,
                      bool interleaved, const std::string& layout, int64_t rotary_offset,
                      const Sections& mrope_section, int64_t mrope_interleaved, bool inverse,
                      const PageTableArg& page_table);

// rope_ext::mla_rotary_cache_ (RoPE + MLA latent-cache write)
void mla_rotary_cache_(const Backend& backend, const Tensor& q, const Tensor& kv_c,
                       const Tensor& k_pe, const Tensor& positions, const Tensor& cos_sin,
                       const Tensor& kv_cache, const std::optional<Tensor>& slot_mapping,
                       const std::optional<Tensor>& kv_scale, const std::optional<Tensor>& q_out,
                       const std::optional<Tensor>& q_scale, bool interleaved,
                       int64_t rotary_offset, bool inverse, const PageTableArg& page_table);

// rope_ext::rerotate_kv_cache_: its checks and kernel parameters
// (rerotate_binding.cpp), and the op.
rope::RerotateParams make_rerotate_params(const Tensor& key_cache, const Tensor& slot_mapping,
                                          const Tensor& delta, const Tensor& cos_sin,
                                          const std::optional<Tensor>& k_scale, bool interleaved,
                                          const std::string& layout, int64_t rotary_offset);
void rerotate_kv_cache_(const Backend& backend, const Tensor& key_cache, const Tensor& slot_mapping,
                        const Tensor& delta, const Tensor& cos_sin,
                        const std::optional<Tensor>& k_scale, bool interleaved,
                        const std::string& layout, int64_t rotary_offset);

// rope_ext::qk_norm_rotary_ (in place) and rope_ext::qk_norm_rotary
void qk_norm_rotary_(const Backend& backend, const Tensor& q, const Tensor& k,
                     const Tensor& q_weight, const Tensor& k_weight, const Tensor& positions,
                     const Tensor& cos_sin, double eps, bool interleaved, double weight_offset,
                     int64_t rotary_offset, const Sections& mrope_section,
                     int64_t mrope_interleaved);
std::tuple<Tensor, Tensor> qk_norm_rotary(const Backend& backend, const Tensor& q, const Tensor& k,
                                          const Tensor& q_weight, const Tensor& k_weight,
                                          const Tensor& positions, const Tensor& cos_sin,
                                          double eps, bool interleaved, double weight_offset,
                                          int64_t rotary_offset, const Sections& mrope_section,
                                          int64_t mrope_interleaved);

// rope_ext::qk_norm_rotary_packed_: qk_norm_rotary_ on the q and k columns of a packed qkv.
void qk_norm_rotary_packed_(const Backend& backend, const Tensor& qkv, int64_t num_heads_q,
                            int64_t num_heads_k, int64_t num_heads_v, const Tensor& q_weight,
                            const Tensor& k_weight, const Tensor& positions, const Tensor& cos_sin,
                            double eps, bool interleaved, double weight_offset,
                            int64_t rotary_offset, const Sections& mrope_section,
                            int64_t mrope_interleaved);

// The QK norm's default eps, as the schemas give it (registration.cpp).
constexpr double kDefaultNormEps = 1e-6;

// The .plain and .scaled overloads: the ops above with every other option at
// its default.
inline void rotary_qk_plain(const Backend& b, const Tensor& q, const std::optional<Tensor>& k,
                            const Tensor& positions, const Tensor& cos_sin) {
  rotary_qk_(b, q, k, positions, cos_sin, false, false, 0, std::nullopt, false);
}
inline void rotary_qk_cache_scaled(const Backend& b, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& positions, const Tensor& cos_sin,
                                   const Tensor& key_cache, const Tensor& value_cache,
                                   const std::optional<Tensor>& slot_mapping, const Tensor& k_scale,
                                   const Tensor& v_scale) {
  rotary_qk_cache_(b, q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale,
                   v_scale, std::nullopt, std::nullopt, false, "NHD", 0, std::nullopt, false, false,
                   std::nullopt);
}
inline void rotary_qk_cache_plain(const Backend& b, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& positions, const Tensor& cos_sin,
                                  const Tensor& key_cache, const Tensor& value_cache,
                                  const std::optional<Tensor>& slot_mapping) {
  rotary_qk_cache_(b, q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping,
                   std::nullopt, std::nullopt, std::nullopt, std::nullopt, false, "NHD", 0,
                   std::nullopt, false, false, std::nullopt);
}
inline void rotary_qk_cache_paged(const Backend& b, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& positions, const Tensor& cos_sin,
                                  const Tensor& key_cache, const Tensor& value_cache,
                                  const std::optional<Tensor>& slot_mapping,
                                  const std::vector<Tensor>& page_table) {
  rotary_qk_cache_(b, q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping,
                   std::nullopt, std::nullopt, std::nullopt, std::nullopt, false, "NHD", 0,
                   std::nullopt, false, false, page_table);
}
inline void qk_norm_rotary_packed_plain(const Backend& b, const Tensor& qkv, int64_t num_heads_q,
                                        int64_t num_heads_k, int64_t num_heads_v,
                                        const Tensor& q_weight, const Tensor& k_weight,
                                        const Tensor& positions, const Tensor& cos_sin) {
  qk_norm_rotary_packed_(b, qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight,
                         positions, cos_sin, kDefaultNormEps, false, 0.0, 0, std::nullopt, false);
}

inline void rerotate_plain(const Backend& b, const Tensor& key_cache, const Tensor& slot_mapping,
                           const Tensor& delta, const Tensor& cos_sin) {
  rerotate_kv_cache_(b, key_cache, slot_mapping, delta, cos_sin, std::nullopt, false, "NHD", 0);
}
inline void rerotate_scaled(const Backend& b, const Tensor& key_cache, const Tensor& slot_mapping,
                            const Tensor& delta, const Tensor& cos_sin, const Tensor& k_scale) {
  rerotate_kv_cache_(b, key_cache, slot_mapping, delta, cos_sin, k_scale, false, "NHD", 0);
}

// rope_ext::_angle_rows: float64 rows [n, rotary_dim] of positions [n] and
// frequencies [rotary_dim] (binding.cpp).
Tensor angle_rows_op(const Backend& backend, const Tensor& positions, const Tensor& freqs);

// Op body F (its backend first) as a kernel of backend B: the other
// parameters by value, as TORCH_BOX unboxes them.
template <auto F, const Backend& B, class Signature = decltype(F)>
struct Kernel;
template <auto F, const Backend& B, class R, class... Args>
struct Kernel<F, B, R (*)(const Backend&, Args...)> {
  static R call(std::remove_cvref_t<Args>... args) { return F(B, args...); }
};

template <auto F, const Backend& B>
void impl(torch::stable::detail::StableLibrary& m, const char* name) {
  constexpr auto kernel = &Kernel<F, B>::call;
  m.impl(name, TORCH_BOX(kernel));
}

// Registers every op's kernel of backend B (ops_cpu.cpp, ops_cuda.cu).
template <const Backend& B>
void impl_ops(torch::stable::detail::StableLibrary& m) {
  impl<&rotary, B>(m, "rotary");
  impl<&rotary_qk, B>(m, "rotary_qk");
  impl<&rotary_qk_, B>(m, "rotary_qk_");
  impl<&rotary_qk_cache_, B>(m, "rotary_qk_cache_");
  impl<&mla_rotary_cache_, B>(m, "mla_rotary_cache_");
  impl<&rerotate_kv_cache_, B>(m, "rerotate_kv_cache_");
  impl<&qk_norm_rotary_, B>(m, "qk_norm_rotary_");
  impl<&qk_norm_rotary, B>(m, "qk_norm_rotary");
  impl<&qk_norm_rotary_packed_, B>(m, "qk_norm_rotary_packed_");
  impl<&rotary_qk_plain, B>(m, "rotary_qk_.plain");
  impl<&rotary_qk_cache_plain, B>(m, "rotary_qk_cache_.plain");
  impl<&rotary_qk_cache_scaled, B>(m, "rotary_qk_cache_.scaled");
  impl<&rotary_qk_cache_paged, B>(m, "rotary_qk_cache_.paged");
  impl<&qk_norm_rotary_packed_plain, B>(m, "qk_norm_rotary_packed_.plain");
  impl<&rerotate_plain, B>(m, "rerotate_kv_cache_.plain");
  impl<&rerotate_scaled, B>(m, "rerotate_kv_cache_.scaled");
  impl<&angle_rows_op, B>(m, "_angle_rows");
}

// Shared checks of the serving ops (serving_binding.cpp). The fp8 storage of
// dtype t, or kNone. A one-element float32 scale on x's device (named x_name),
// null when absent. ValueError when t has elements that overlap (it is
// written in place). Slots -1 or in [0, n_cache_slots) (std::out_of_range)
// and distinct (ValueError ending with `what`).
rope::Fp8 fp8_of(torch::headeronly::ScalarType t);
const float* scale_ptr(const std::optional<Tensor>& s, const char* name, const Arg& x,
                       const char* x_name = "q");
void check_no_self_overlap(const Layout& t, const char* name);
void check_slots(const int64_t* slots, int64_t n, int64_t n_cache_slots, const char* what,
                 const char* source = "slot_mapping");

// The page table of a cache write (page_table.cpp): its checks and kernel
// parameters (x: the tensor whose device it must be on; n_tokens: T), and
// every token's slot (-1: not written), checked (IndexError for a token it
// cannot place, ValueError for a bad kv_last_page_len).
rope::PageTable page_table_params(const std::vector<Tensor>& page_table, const Arg& x,
                                  const char* x_name, int64_t n_tokens, int64_t n_blocks);
std::vector<int64_t> page_table_slots(const rope::PageTable& pt, int64_t block_size);
// rope_ext::_page_table_slots (CPU): page_table_slots of a page table in host
// memory, its slots distinct too, as an int64 tensor.
Tensor page_table_slots_op(std::vector<Tensor> page_table, int64_t block_size, int64_t num_blocks);

// Checks the arguments of the serving ops and returns their kernel parameters
// (no data touched). q_out / k_out of make_norm_params may be q / k. The MLA
// cache write is the cache write of k_pe and kv_c into kv_cache's two column
// ranges (rope::CacheParams).
rope::CacheParams make_mla_cache_params(
    const Tensor& q, const Tensor& kv_c, const Tensor& k_pe, const Tensor& positions,
    const Tensor& cos_sin, const Tensor& kv_cache, const std::optional<Tensor>& slot_mapping,
    const std::optional<Tensor>& kv_scale, const std::optional<Tensor>& q_out,
    const std::optional<Tensor>& q_scale, bool interleaved, int64_t rotary_offset, bool inverse,
    const PageTableArg& page_table);
rope::CacheParams make_cache_params(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
    const Tensor& cos_sin, const Tensor& key_cache, const Tensor& value_cache,
    const std::optional<Tensor>& slot_mapping, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, const std::optional<Tensor>& q_out,
    const std::optional<Tensor>& q_scale, bool interleaved, const std::string& layout,
    int64_t rotary_offset, const Sections& mrope_section, int64_t mrope_interleaved, bool inverse,
    const PageTableArg& page_table);
rope::NormParams make_norm_params(const Arg& q, const Arg& q_out, const Arg& k, const Arg& k_out,
                                  const Tensor& q_weight, const Tensor& k_weight,
                                  const Tensor& positions, const Tensor& cos_sin, double eps,
                                  bool interleaved, double weight_offset, int64_t rotary_offset,
                                  const Sections& mrope_section, int64_t mrope_interleaved);

// Checks the arguments and returns the kernel parameters for in -> out
// (out may be in). Throws the exceptions above, naming the argument (q_name,
// default "q" with k and "x" without; k_name); touches no data. Positions
// follow the one rule of every op (README, "Positions"); token_major (the ops
// on [T, H, D]) also reads positions [T] as [T, 1], one position per token.
// k_rotary_only: k holds rotary_dim features, all rotated (MLA's k_pe; only
// the cache write's kernels take it, through CacheParams::k_dim).
rope::RopeParams make_params(const Arg& q_in, const Arg& q_out, const Arg* k_in, const Arg* k_out,
                             const Tensor& positions, const Tensor& cos_sin, bool interleaved,
                             bool inverse, int64_t rotary_offset, const Sections& mrope_section,
                             int64_t mrope_interleaved, const char* q_name = nullptr,
                             bool token_major = false, const char* k_name = "k",
                             bool k_rotary_only = false);

// The table-free mode (cos_sin given as frequencies): when p.freqs is set,
// every token's cos/sin row built by launch_rows on q's device, and p
// rewritten to read them as a table (row t is token t's; p.freqs null). The
// rows go to host_scratch (a host backend: no allocation per call), or to
// tensors on q's device, held until the kernel is enqueued. Else nothing.
struct AngleRowsHeld {
  std::optional<Tensor> rows, index;
};
std::optional<AngleRowsHeld> bind_angle_rows(rope::RopeParams& p, const Tensor& q,
                                             RowsLauncher launch_rows,
                                             HostScratch host_scratch = nullptr);
// The rows' dtype: float64 for float64 inputs, else float32.
rope::DType angle_rows_dtype(const rope::RopeParams& p);

// Checks that `q` (and `k`) may be written in place: no element is reached
// twice, and q and k share no element.
void check_writable(const Arg& q, const Arg* k);

// ValueError naming a and b when they share an element.
void check_disjoint(const Layout& a, const char* an, const Layout& b, const char* bn);

// First token whose position is outside the cache, or -1.
int64_t first_bad_position(const rope::RopeParams& p, int64_t* value);

// x (named `name` in messages) is a floating tensor [..., head_dim] with a
// contiguous last dim.
void check_input(const Arg& x, const char* name);

// A new tensor for the result of x: x's layout (empty_like), unless that
// leaves the last dim strided; then row-major.
Tensor empty_output(const Tensor& x);

}  // namespace rope_ext

// Binding layer shared by every backend, on the LibTorch stable ABI
// (torch/csrc/stable, header-only torch/headeronly): argument checks with
// user-facing messages, kernel parameters from tensors, and the op bodies:
// binding.cpp (the rotary ops), serving_binding.cpp (the serving ops),
// layout.h (each tensor argument read once, overlap checks of what is
// written). A backend only supplies how to run the kernel.
//
// Errors are standard exceptions, which reach Python as: std::invalid_argument
// -> ValueError, std::out_of_range -> IndexError. A wrong type or dtype throws
// TypeError below (an std::invalid_argument, so ValueError from the bare op,
// its message tagged); the Python API re-raises those as TypeError.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../rope/params.h"

namespace rope_ext {

using torch::stable::Tensor;
using Sections = std::optional<std::vector<int64_t>>;
using IntRef = torch::headeronly::IntHeaderOnlyArrayRef;
class Arg;  // layout.h

// A wrong type or dtype. Its message starts with kTypeErrorTag, then the
// argument's name; rope_ext/ops.py re-raises a ValueError whose message starts
// with the tag as TypeError, without the tag.
inline constexpr const char* kTypeErrorTag = "[type] ";
struct TypeError : std::invalid_argument {
  explicit TypeError(const std::string& message) : std::invalid_argument(kTypeErrorTag + message) {}
};

// The message of the parts streamed in order.
template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Throws E(str(message parts...)) unless cond; the message is built only then.
#define ROPE_CHECK(E, cond, ...)             \
  do {                                       \
    if (!(cond)) [[unlikely]]                \
      throw E(::rope_ext::str(__VA_ARGS__)); \
  } while (0)

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
};

// rope_ext::rotary
Tensor rotary(const Tensor& x, const Tensor& positions, const Tensor& cos_sin, bool interleaved,
              bool inverse, int64_t rotary_offset, const Sections& mrope_section,
              bool mrope_interleaved, const Backend& backend);

// rope_ext::rotary_qk
std::tuple<Tensor, Tensor> rotary_qk(const Tensor& q, const Tensor& k, const Tensor& positions,
                                     const Tensor& cos_sin, bool interleaved, bool inverse,
                                     int64_t rotary_offset, const Sections& mrope_section,
                                     bool mrope_interleaved, const Backend& backend);

// rope_ext::rotary_qk_ (in place)
void rotary_qk_(const Tensor& q, const std::optional<Tensor>& k, const Tensor& positions,
                const Tensor& cos_sin, bool interleaved, bool inverse, int64_t rotary_offset,
                const Sections& mrope_section, bool mrope_interleaved, const Backend& backend);

// The three ops on one backend, as kernels to register (TORCH_BOX(&rotary_on<kCpu>)).
template <const Backend& B>
Tensor rotary_on(Tensor x, Tensor positions, Tensor cos_sin, bool interleaved, bool inverse,
                 int64_t rotary_offset, Sections mrope_section, bool mrope_interleaved) {
  return rotary(x, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
                mrope_interleaved, B);
}

template <const Backend& B>
std::tuple<Tensor, Tensor> rotary_qk_on(Tensor q, Tensor k, Tensor positions, Tensor cos_sin,
                                        bool interleaved, bool inverse, int64_t rotary_offset,
                                        Sections mrope_section, bool mrope_interleaved) {
  return rotary_qk(q, k, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
                   mrope_interleaved, B);
}

template <const Backend& B>
void rotary_qk_inplace_on(Tensor q, std::optional<Tensor> k, Tensor positions, Tensor cos_sin,
                          bool interleaved, bool inverse, int64_t rotary_offset,
                          Sections mrope_section, bool mrope_interleaved) {
  rotary_qk_(q, k, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section,
             mrope_interleaved, B);
}

// rope_ext::rotary_qk_cache_ (RoPE + KV-cache write)
void rotary_qk_cache_(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                      const Tensor& cos_sin, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                      const std::optional<Tensor>& v_scale, const std::optional<Tensor>& q_out,
                      const std::optional<Tensor>& q_scale, bool interleaved,
                      const std::string& layout, int64_t rotary_offset,
                      const Sections& mrope_section, bool mrope_interleaved,
                      const Backend& backend);

// rope_ext::qk_norm_rotary_ (in place) and rope_ext::qk_norm_rotary
void qk_norm_rotary_(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                     const Tensor& k_weight, const Tensor& positions, const Tensor& cos_sin,
                     double eps, bool interleaved, double weight_offset, int64_t rotary_offset,
                     const Sections& mrope_section, bool mrope_interleaved, const Backend& backend);
std::tuple<Tensor, Tensor> qk_norm_rotary(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                          const Tensor& k_weight, const Tensor& positions,
                                          const Tensor& cos_sin, double eps, bool interleaved,
                                          double weight_offset, int64_t rotary_offset,
                                          const Sections& mrope_section, bool mrope_interleaved,
                                          const Backend& backend);

// rope_ext::qk_norm_rotary_packed_: qk_norm_rotary_ on the q and k columns of a packed qkv.
void qk_norm_rotary_packed_(const Tensor& qkv, int64_t num_heads_q, int64_t num_heads_k,
                            int64_t num_heads_v, const Tensor& q_weight, const Tensor& k_weight,
                            const Tensor& positions, const Tensor& cos_sin, double eps,
                            bool interleaved, double weight_offset, int64_t rotary_offset,
                            const Sections& mrope_section, bool mrope_interleaved,
                            const Backend& backend);

template <const Backend& B>
void qk_norm_rotary_packed_on(Tensor qkv, int64_t num_heads_q, int64_t num_heads_k,
                              int64_t num_heads_v, Tensor q_weight, Tensor k_weight,
                              Tensor positions, Tensor cos_sin, double eps, bool interleaved,
                              double weight_offset, int64_t rotary_offset, Sections mrope_section,
                              bool mrope_interleaved) {
  qk_norm_rotary_packed_(qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions,
                         cos_sin, eps, interleaved, weight_offset, rotary_offset, mrope_section,
                         mrope_interleaved, B);
}

template <const Backend& B>
void rotary_qk_cache_on(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin,
                        Tensor key_cache, Tensor value_cache, Tensor slot_mapping,
                        std::optional<Tensor> k_scale, std::optional<Tensor> v_scale,
                        std::optional<Tensor> q_out, std::optional<Tensor> q_scale,
                        bool interleaved, std::string layout, int64_t rotary_offset,
                        Sections mrope_section, bool mrope_interleaved) {
  rotary_qk_cache_(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale,
                   v_scale, q_out, q_scale, interleaved, layout, rotary_offset, mrope_section,
                   mrope_interleaved, B);
}

template <const Backend& B>
void qk_norm_rotary_inplace_on(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight,
                               Tensor positions, Tensor cos_sin, double eps, bool interleaved,
                               double weight_offset, int64_t rotary_offset, Sections mrope_section,
                               bool mrope_interleaved) {
  qk_norm_rotary_(q, k, q_weight, k_weight, positions, cos_sin, eps, interleaved, weight_offset,
                  rotary_offset, mrope_section, mrope_interleaved, B);
}

template <const Backend& B>
std::tuple<Tensor, Tensor> qk_norm_rotary_on(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight,
                                             Tensor positions, Tensor cos_sin, double eps,
                                             bool interleaved, double weight_offset,
                                             int64_t rotary_offset, Sections mrope_section,
                                             bool mrope_interleaved) {
  return qk_norm_rotary(q, k, q_weight, k_weight, positions, cos_sin, eps, interleaved,
                        weight_offset, rotary_offset, mrope_section, mrope_interleaved, B);
}

// The QK norm's default eps, as the schemas give it (registration.cpp).
constexpr double kDefaultNormEps = 1e-6;

// The .plain overloads: the ops above with every option at its default.
template <const Backend& B>
void rotary_qk_plain_on(Tensor q, std::optional<Tensor> k, Tensor positions, Tensor cos_sin) {
  rotary_qk_(q, k, positions, cos_sin, false, false, 0, std::nullopt, false, B);
}

template <const Backend& B>
void rotary_qk_cache_plain_on(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin,
                              Tensor key_cache, Tensor value_cache, Tensor slot_mapping) {
  rotary_qk_cache_(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, std::nullopt,
                   std::nullopt, std::nullopt, std::nullopt, false, "NHD", 0, std::nullopt, false,
                   B);
}

template <const Backend& B>
void rotary_qk_cache_scaled_on(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin,
                               Tensor key_cache, Tensor value_cache, Tensor slot_mapping,
                               Tensor k_scale, Tensor v_scale) {
  rotary_qk_cache_(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale,
                   v_scale, std::nullopt, std::nullopt, false, "NHD", 0, std::nullopt, false, B);
}

template <const Backend& B>
void qk_norm_rotary_packed_plain_on(Tensor qkv, int64_t num_heads_q, int64_t num_heads_k,
                                    int64_t num_heads_v, Tensor q_weight, Tensor k_weight,
                                    Tensor positions, Tensor cos_sin) {
  qk_norm_rotary_packed_(qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions,
                         cos_sin, kDefaultNormEps, false, 0.0, 0, std::nullopt, false, B);
}

// Registers every op's kernel of backend B (ops_cpu.cpp, ops_cuda.cu).
template <const Backend& B>
void impl_ops(torch::stable::detail::StableLibrary& m) {
  m.impl("rotary", TORCH_BOX(&rotary_on<B>));
  m.impl("rotary_qk", TORCH_BOX(&rotary_qk_on<B>));
  m.impl("rotary_qk_", TORCH_BOX(&rotary_qk_inplace_on<B>));
  m.impl("rotary_qk_cache_", TORCH_BOX(&rotary_qk_cache_on<B>));
  m.impl("qk_norm_rotary_", TORCH_BOX(&qk_norm_rotary_inplace_on<B>));
  m.impl("qk_norm_rotary", TORCH_BOX(&qk_norm_rotary_on<B>));
  m.impl("qk_norm_rotary_packed_", TORCH_BOX(&qk_norm_rotary_packed_on<B>));
  m.impl("rotary_qk_.plain", TORCH_BOX(&rotary_qk_plain_on<B>));
  m.impl("rotary_qk_cache_.plain", TORCH_BOX(&rotary_qk_cache_plain_on<B>));
  m.impl("rotary_qk_cache_.scaled", TORCH_BOX(&rotary_qk_cache_scaled_on<B>));
  m.impl("qk_norm_rotary_packed_.plain", TORCH_BOX(&qk_norm_rotary_packed_plain_on<B>));
}

// Checks the arguments of the serving ops and returns their kernel parameters
// (no data touched). q_out / k_out of make_norm_params may be q / k.
rope::CacheParams make_cache_params(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
    const Tensor& cos_sin, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, const std::optional<Tensor>& q_out,
    const std::optional<Tensor>& q_scale, bool interleaved, const std::string& layout,
    int64_t rotary_offset, const Sections& mrope_section, bool mrope_interleaved);
rope::NormParams make_norm_params(const Arg& q, const Arg& q_out, const Arg& k, const Arg& k_out,
                                  const Tensor& q_weight, const Tensor& k_weight,
                                  const Tensor& positions, const Tensor& cos_sin, double eps,
                                  bool interleaved, double weight_offset, int64_t rotary_offset,
                                  const Sections& mrope_section, bool mrope_interleaved);

// Checks the arguments and returns the kernel parameters for in -> out
// (out may be in). Throws the exceptions above, naming the argument (q_name,
// default "q" with k and "x" without); touches no data. Positions follow the
// one rule of every op (README, "Positions"); token_major (the ops on
// [T, H, D]) also reads positions [T] as [T, 1], one position per token.
rope::RopeParams make_params(const Arg& q_in, const Arg& q_out, const Arg* k_in, const Arg* k_out,
                             const Tensor& positions, const Tensor& cos_sin, bool interleaved,
                             bool inverse, int64_t rotary_offset, const Sections& mrope_section,
                             bool mrope_interleaved, const char* q_name = nullptr,
                             bool token_major = false);

// Checks that `q` (and `k`) may be written in place: no element is reached
// twice, and q and k share no element.
void check_writable(const Arg& q, const Arg* k);

// First token whose position is outside the cache, or -1.
int64_t first_bad_position(const rope::RopeParams& p, int64_t* value);

// "[2, 3]"
std::string shape_str(IntRef s);

// "cpu", "cuda:0"
std::string device_str(const Tensor& t);

// t.scalar_type() from the shim's dtype code: Tensor::scalar_type() converts
// it with one call into libtorch per candidate dtype (about 45 ns on a 2 GHz
// Zen 1, more than the rest of a check). (Devices: Arg, layout.h.)
torch::headeronly::ScalarType dtype_of(const Tensor& t);

// float32, float64, float16 or bfloat16, and its kernel dtype.
bool is_supported_float(torch::headeronly::ScalarType t);
rope::DType to_dtype(torch::headeronly::ScalarType t);

// x (named `name` in messages) is a floating tensor [..., head_dim] with a
// contiguous last dim.
void check_input(const Arg& x, const char* name);

// A new tensor for the result of x: x's layout (empty_like), unless that
// leaves the last dim strided; then row-major.
Tensor empty_output(const Tensor& x);

}  // namespace rope_ext

// Binding layer shared by every backend: argument checks with user-facing
// messages, construction of rope::RopeParams from tensors, and the three op
// bodies. A backend only supplies how to run the kernel.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../rope/params.h"

namespace rope_ext {

struct Backend {
  // Raise if a position is outside [0, cos_sin.size(0)); null when the
  // backend cannot look at positions without a host synchronisation.
  void (*check_positions)(const rope::RopeParams& p);
  // Rotate every token of p.
  void (*launch)(const rope::RopeParams& p, const at::Tensor& q);
};

// rope_ext::rotary
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                  bool interleaved, bool inverse, int64_t rotary_offset,
                  at::OptionalIntArrayRef mrope_section, bool mrope_interleaved,
                  const Backend& backend);

// rope_ext::rotary_qk
std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& positions, const at::Tensor& cos_sin,
                                             bool interleaved, bool inverse, int64_t rotary_offset,
                                             at::OptionalIntArrayRef mrope_section,
                                             bool mrope_interleaved, const Backend& backend);

// rope_ext::rotary_qk_ (in place)
void rotary_qk_(const at::Tensor& q, const std::optional<at::Tensor>& k,
                const at::Tensor& positions, const at::Tensor& cos_sin, bool interleaved,
                bool inverse, int64_t rotary_offset, at::OptionalIntArrayRef mrope_section,
                bool mrope_interleaved, const Backend& backend);

// Checks the arguments and returns the kernel parameters for in -> out
// (out may be in). Throws ValueError / TypeError / IndexError-style c10
// errors naming the argument (q_name, default "q" with k and "x" without);
// touches no data.
rope::RopeParams make_params(const at::Tensor& q_in, const at::Tensor& q_out,
                             const at::Tensor* k_in, const at::Tensor* k_out,
                             const at::Tensor& positions, const at::Tensor& cos_sin,
                             bool interleaved, bool inverse, int64_t rotary_offset,
                             at::OptionalIntArrayRef mrope_section, bool mrope_interleaved,
                             const char* q_name = nullptr);

// Checks that `q` (and `k`) may be written in place: no element is reached
// twice, and q and k share no element.
void check_writable(const at::Tensor& q, const at::Tensor* k);

// First token whose position is outside the cache, or -1.
int64_t first_bad_position(const rope::RopeParams& p, int64_t* value);

}  // namespace rope_ext

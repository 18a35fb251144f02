// The vocabulary of the argument checks, shared by layout.h and the op
// bodies: the tensor type of the LibTorch stable ABI, the exceptions and how
// Python sees them, and the helpers that name a tensor in a message.
//
// Errors are standard exceptions, which reach Python as: std::invalid_argument
// -> ValueError, std::out_of_range -> IndexError. A wrong type or dtype throws
// TypeError below (an std::invalid_argument, so ValueError from the bare op,
// its message tagged); the Python API re-raises those as TypeError.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../rope/params.h"

namespace rope_ext {

using torch::stable::Tensor;
using Sections = std::optional<std::vector<int64_t>>;
// A cache write's page_table (Tensor[]?): see page_table.cpp.
using PageTableArg = std::optional<std::vector<Tensor>>;
using IntRef = torch::headeronly::IntHeaderOnlyArrayRef;
using ValueError = std::invalid_argument;

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

// "[2, 3]"
std::string shape_str(IntRef s);

// "cpu", "cuda:0"
std::string device_str(const Tensor& t);

// t.scalar_type() from the shim's dtype code (Tensor::scalar_type() makes one
// call into libtorch per candidate dtype). Devices: Arg, layout.h.
torch::headeronly::ScalarType dtype_of(const Tensor& t);

// float32, float64, float16 or bfloat16, and its kernel dtype.
bool is_supported_float(torch::headeronly::ScalarType t);
rope::DType to_dtype(torch::headeronly::ScalarType t);

}  // namespace rope_ext

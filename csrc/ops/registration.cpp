// Every schema of the rope_ext namespace. Backends register their kernels in
// ops_cpu.cpp and ops_cuda.cu (a separate library, loaded when torch has CUDA).
#include <torch/csrc/stable/library.h>

#if defined(ROPE_EXT_PYTHON_MODULE)
#include <Python.h>
extern "C" {
// Makes the library importable as rope_ext._C so that the static
// registrations below run on import; it exposes no Python functions.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
}
#endif

STABLE_TORCH_LIBRARY(rope_ext, m) {
  // Rotates x [..., head_dim] by cos_sin[positions] (positions broadcast to
  // x.shape[:-1]): features [rotary_offset, rotary_offset + rotary_dim), with
  // rotary_dim = cos_sin.shape[-1]; the others are copied. With mrope_section
  // (t, h, w), positions is [3, ...] and each pair takes the position of its
  // section (contiguous, or interleaved with mrope_interleaved).
  m.def(
      "rotary(Tensor x, Tensor positions, Tensor cos_sin, bool interleaved=False, "
      "bool inverse=False, int rotary_offset=0, int[]? mrope_section=None, "
      "bool mrope_interleaved=False) -> Tensor");
  // rotary of q and of k with the same positions, in one launch.
  m.def(
      "rotary_qk(Tensor q, Tensor k, Tensor positions, Tensor cos_sin, bool interleaved=False, "
      "bool inverse=False, int rotary_offset=0, int[]? mrope_section=None, "
      "bool mrope_interleaved=False) -> (Tensor, Tensor)");
  // In-place rotary of q and (optionally) k, in one launch.
  m.def(
      "rotary_qk_(Tensor(a!) q, Tensor(b!)? k, Tensor positions, Tensor cos_sin, "
      "bool interleaved=False, bool inverse=False, int rotary_offset=0, "
      "int[]? mrope_section=None, bool mrope_interleaved=False) -> ()");
  // The CPU kernel's instruction sets (csrc/rope/cpu.h), implemented in
  // ops_cpu.cpp: the one in use ("scalar", "avx2", "avx512", "avx512_bf16",
  // "neon"), whether this CPU runs one, and a switch for tests and benchmarks.
  m.def("_cpu_isa() -> str");
  m.def("_cpu_isa_supported(str name) -> bool");
  m.def("_set_cpu_isa(str name) -> bool");
}

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
  // section (mrope_interleaved: 0 contiguous, 1 interleaved as Qwen3-VL, 2
  // alternating as ERNIE-4.5-VL; params.h AxisLayout).
  m.def(
      "rotary(Tensor x, Tensor positions, Tensor cos_sin, bool interleaved=False, "
      "bool inverse=False, int rotary_offset=0, int[]? mrope_section=None, "
      "int mrope_interleaved=0) -> Tensor");
  // rotary of q and of k with the same positions, in one launch.
  m.def(
      "rotary_qk(Tensor q, Tensor k, Tensor positions, Tensor cos_sin, bool interleaved=False, "
      "bool inverse=False, int rotary_offset=0, int[]? mrope_section=None, "
      "int mrope_interleaved=0) -> (Tensor, Tensor)");
  // In-place rotary of q and (optionally) k, in one launch.
  m.def(
      "rotary_qk_(Tensor(a!) q, Tensor(b!)? k, Tensor positions, Tensor cos_sin, "
      "bool interleaved=False, bool inverse=False, int rotary_offset=0, "
      "int[]? mrope_section=None, int mrope_interleaved=0) -> ()");
  // RoPE + KV-cache write: q [T, Hq, D] and k [T, Hk, D] rotated in place (q
  // into q_out instead when given, of q's dtype or fp8 with q_scale), then k
  // and v [T, Hk, Dv] stored at slot_mapping[t] of the paged caches ("NHD"
  // [blocks, block_size, Hk, D] or "HND" [blocks, Hk, block_size, D]), of q's
  // dtype or fp8 with k_scale / v_scale. positions [T] ([3, T] with
  // mrope_section), or any shape broadcasting to [T, Hq] ([T, 1]). Instead of
  // slot_mapping (None), page_table: FlashInfer's (batch_indices, positions,
  // kv_indices, kv_indptr[, kv_last_page_len]), each token's slot found in
  // the kernel.
  m.def(
      "rotary_qk_cache_(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos_sin, "
      "Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor? slot_mapping, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(e!)? q_out=None, Tensor? q_scale=None, "
      "bool interleaved=False, str layout=\"NHD\", int rotary_offset=0, "
      "int[]? mrope_section=None, int mrope_interleaved=0, bool inverse=False, "
      "Tensor[]? page_table=None) -> ()");
  // RoPE + MLA latent-cache write (DeepSeek-V2/V3): q [T, H, D] rotated in
  // place at features [rotary_offset, rotary_offset + rotary_dim) (into q_out
  // instead when given, the other features copied, of q's dtype or fp8 with
  // q_scale), k_pe [T, rotary_dim] ([T, 1, rotary_dim]) rotated in place, and
  // kv_c [T, kv_lora_rank] and the rotated k_pe stored side by side at
  // slot_mapping[t] of kv_cache [blocks, block_size, kv_lora_rank +
  // rotary_dim], of q's dtype or fp8 with kv_scale; or at the slots of a
  // page_table, as for rotary_qk_cache_.
  m.def(
      "mla_rotary_cache_(Tensor(a!) q, Tensor kv_c, Tensor(b!) k_pe, Tensor positions, "
      "Tensor cos_sin, Tensor(c!) kv_cache, Tensor? slot_mapping, Tensor? kv_scale=None, "
      "Tensor(d!)? q_out=None, Tensor? q_scale=None, bool interleaved=False, "
      "int rotary_offset=0, bool inverse=False, Tensor[]? page_table=None) -> ()");
  // Each token's slot (-1: not written) of a page table in host memory, as the
  // CPU cache ops find and check them (CPU only): the host check of an eager
  // CUDA call with position checks on.
  m.def("_page_table_slots(Tensor[] page_table, int block_size, int num_blocks) -> Tensor");
  // The cos/sin rows [n, rotary_dim] (float64) of positions [n] (int32, int64,
  // float32 or float64) with frequencies [rotary_dim] (float64: each pair's
  // frequency, then its factor): the rows of the table-free mode, and of
  // rope_ext.cos_sin_rows (so of every RopeCache table).
  m.def("_angle_rows(Tensor positions, Tensor freqs) -> Tensor");
  // Re-rotation of cached keys: every head of the key stored at slot
  // slot_mapping[t] of key_cache ("NHD" [blocks, block_size, Hk, D] or "HND"
  // [blocks, Hk, block_size, D], a float dtype or fp8 with k_scale) rotated in
  // place by delta[t] positions (delta [T], or one element for all; negative:
  // the inverse rotation), features [rotary_offset, rotary_offset +
  // rotary_dim). Slot -1 skips the token.
  m.def(
      "rerotate_kv_cache_(Tensor(a!) key_cache, Tensor slot_mapping, Tensor delta, "
      "Tensor cos_sin, Tensor? k_scale=None, bool interleaved=False, str layout=\"NHD\", "
      "int rotary_offset=0) -> ()");
  // QK-RMSNorm + rotary: each head of q [T, Hq, D] and k [T, Hk, D] RMS-
  // normalised over D (float32), scaled by weight + weight_offset, rounded to
  // the dtype, then rotated; in place, or into new tensors. positions as for
  // rotary_qk_cache_.
  m.def(
      "qk_norm_rotary_(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, "
      "Tensor positions, Tensor cos_sin, float eps=1e-06, bool interleaved=False, "
      "float weight_offset=0., int rotary_offset=0, int[]? mrope_section=None, "
      "int mrope_interleaved=0) -> ()");
  m.def(
      "qk_norm_rotary(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor positions, "
      "Tensor cos_sin, float eps=1e-06, bool interleaved=False, float weight_offset=0., "
      "int rotary_offset=0, int[]? mrope_section=None, int mrope_interleaved=0) "
      "-> (Tensor, Tensor)");
  // qk_norm_rotary_ on the q and k columns of a packed qkv [T, (Hq+Hk+Hv)*D].
  m.def(
      "qk_norm_rotary_packed_(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
      "Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin, float eps=1e-06, "
      "bool interleaved=False, float weight_offset=0., int rotary_offset=0, "
      "int[]? mrope_section=None, int mrope_interleaved=0) -> ()");
  // rotary_qk_, rotary_qk_cache_, qk_norm_rotary_packed_ and rerotate_kv_cache_
  // with every other argument at its default: the eager calls that pass no option (a decode
  // step) take these, since a boxed call costs time per schema argument,
  // passed or defaulted (benchmarks/cpu-serving.md). rotary_qk_cache_.scaled adds k_scale and
  // v_scale: fp8 caches, and callers that always pass scales (vLLM's); rotary_qk_cache_.paged adds
  // page_table (FlashInfer's callers); rerotate_kv_cache_.scaled adds k_scale (fp8 caches).
  m.def("rotary_qk_.plain(Tensor(a!) q, Tensor(b!)? k, Tensor positions, Tensor cos_sin) -> ()");
  m.def(
      "rotary_qk_cache_.plain(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, "
      "Tensor cos_sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor? slot_mapping) -> ()");
  m.def(
      "rotary_qk_cache_.scaled(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, "
      "Tensor cos_sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor? slot_mapping, "
      "Tensor k_scale, Tensor v_scale) -> ()");
  m.def(
      "rotary_qk_cache_.paged(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, "
      "Tensor cos_sin, Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor? slot_mapping, "
      "Tensor[] page_table) -> ()");
  m.def(
      "qk_norm_rotary_packed_.plain(Tensor(a!) qkv, int num_heads_q, int num_heads_k, "
      "int num_heads_v, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor cos_sin) -> ()");
  m.def(
      "rerotate_kv_cache_.plain(Tensor(a!) key_cache, Tensor slot_mapping, Tensor delta, "
      "Tensor cos_sin) -> ()");
  m.def(
      "rerotate_kv_cache_.scaled(Tensor(a!) key_cache, Tensor slot_mapping, Tensor delta, "
      "Tensor cos_sin, Tensor k_scale) -> ()");
  // The CPU kernel's instruction sets (csrc/rope/cpu/cpu.h), implemented in
  // ops_cpu.cpp: the one in use ("scalar", "avx2", "avx512", "avx512_bf16",
  // "neon"), whether this CPU runs one, and a switch for tests and benchmarks.
  m.def("_cpu_isa() -> str");
  m.def("_cpu_isa_supported(str name) -> bool");
  m.def("_set_cpu_isa(str name) -> bool");
  // Its software prefetch distance in bytes and cache level (cpu.h
  // prefetch_distance, prefetch_level), and switches for tests and benchmarks.
  m.def("_cpu_prefetch() -> int");
  m.def("_set_cpu_prefetch(int bytes) -> bool");
  m.def("_cpu_prefetch_level() -> int");
  m.def("_set_cpu_prefetch_level(int level) -> bool");
}

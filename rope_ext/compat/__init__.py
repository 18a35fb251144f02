"""Drop-in adapters: HF transformers, diffusers, vLLM-style servers, and two well-known RoPE code forms.

One submodule per source, every public name re-exported here (``from rope_ext.compat import X``):

* :mod:`.hf` - :func:`apply_rotary_pos_emb`, transformers' function (``q * cos + rotate_half(q) * sin``),
  same arguments, broadcasting, output dtypes and gradients, computed by rope_ext's op;
  :func:`patch_transformers` / :func:`unpatch_transformers` route a loaded model's RoPE through rope_ext
  (via :class:`HFRotaryAdapter`) once probes show rope_ext computes what its modules and functions do;
  :data:`SUPPORTED_MODEL_TYPES` are the tested model types, :func:`supported_model_types` those the
  installed transformers passes. Vision towers (Qwen2-VL to Qwen3-VL, GLM-4V, Pixtral, Llama 4) are patched
  too: :func:`vision_report` says what was swapped and skipped, :data:`TESTED_VISION_MODELS` the towers
  tested.
* :mod:`.diffusers` - :func:`patch_diffusers` / :func:`unpatch_diffusers` route a diffusers transformer's RoPE
  rotations (``apply_rotary_emb`` and the model-local rotation functions its attention processors call)
  through rope_ext's op on the model's own cos / sin, once probes show the op computes what each function
  does; :data:`TESTED_DIFFUSERS_MODELS` are the models tested.
* :mod:`.vllm` - :func:`rotary_embedding`, vLLM's in-place ``rotary_embedding(positions, query, key,
  head_size, cos_sin_cache, is_neox)`` on flattened ``[num_tokens, num_heads * head_size]`` tensors,
  :func:`fused_qk_norm_rope`, vLLM's fused QK RMSNorm + rotary on a packed qkv, and its MLA ops (DeepSeek's
  rotary fused with ``concat_and_cache_mla``) :func:`concat_and_cache_mla_rope_fused` and
  :func:`fuse_mla_decode_rope_q_concat_kv_insert`, same argument orders.
* :mod:`.sglang` - :func:`apply_rope_with_cos_sin_cache_inplace` (sgl_kernel's signature) with the
  optional fused KV-buffer write of :class:`FusedSetKVBufferArg`.
* :mod:`.flashinfer` - :func:`mla_rope_quantize_fp8`, FlashInfer's MLA RoPE + fp8 quantization (SGLang's
  TRT-LLM MLA backend calls it), same argument order.
* :mod:`.labml` - :class:`RotaryPositionalEmbeddings`, seq-first ``[seq, batch, heads, features]`` module
  rotating the first ``d`` features, half-split pairing (the layout of labml's annotated implementation).
* :mod:`.meta` - :func:`apply_rotary_emb` / :func:`precompute_freqs_cis`, Meta's Llama complex form
  (also transformers' Llama 4 per-batch ``freqs_cis``).
* :mod:`.torchtune` - ``RotaryPositionalEmbeddings``, torchtune's module (interleaved pairs,
  ``[b, s, n_h, h_d]``, ``forward(x, *, input_pos=None)``, ``cache`` / ``theta`` buffers, ``rope_init``),
  exported here as :class:`TorchtuneRotaryPositionalEmbeddings`.
"""

from __future__ import annotations

from .diffusers import TESTED_DIFFUSERS_MODELS, patch_diffusers, unpatch_diffusers
from .flashinfer import mla_rope_quantize_fp8
from .hf import (
    SUPPORTED_MODEL_TYPES,
    TESTED_VISION_MODELS,
    HFRotaryAdapter,
    apply_rotary_pos_emb,
    patch_transformers,
    supported_model_types,
    unpatch_transformers,
    vision_report,
)
from .labml import RotaryPositionalEmbeddings
from .meta import apply_rotary_emb, precompute_freqs_cis
from .sglang import FusedSetKVBufferArg, apply_rope_with_cos_sin_cache_inplace
from .torchtune import RotaryPositionalEmbeddings as TorchtuneRotaryPositionalEmbeddings
from .vllm import (
    concat_and_cache_mla_rope_fused,
    fuse_mla_decode_rope_q_concat_kv_insert,
    fused_qk_norm_rope,
    rotary_embedding,
)

__all__ = [
    "apply_rotary_pos_emb",
    "patch_transformers",
    "unpatch_transformers",
    "patch_diffusers",
    "unpatch_diffusers",
    "TESTED_DIFFUSERS_MODELS",
    "HFRotaryAdapter",
    "SUPPORTED_MODEL_TYPES",
    "supported_model_types",
    "TESTED_VISION_MODELS",
    "vision_report",
    "rotary_embedding",
    "fused_qk_norm_rope",
    "concat_and_cache_mla_rope_fused",
    "fuse_mla_decode_rope_q_concat_kv_insert",
    "mla_rope_quantize_fp8",
    "apply_rope_with_cos_sin_cache_inplace",
    "FusedSetKVBufferArg",
    "RotaryPositionalEmbeddings",
    "apply_rotary_emb",
    "precompute_freqs_cis",
    "TorchtuneRotaryPositionalEmbeddings",
]

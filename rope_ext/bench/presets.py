"""Model presets (attention shapes) and the sweep's defaults: token counts, dtypes, modes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ALL_MODES",
    "DECODE_CACHE_SLOTS",
    "DECODE_CONTEXT",
    "DECODE_TOKENS",
    "DTYPES",
    "KV_BLOCK_SIZE",
    "MODES",
    "QKNORM_EPS",
    "QKNORM_WEIGHT",
    "SERVING_MODES",
    "PREFILL_TOKENS",
    "PRESETS",
    "Preset",
    "dtype_name",
]


@dataclass(frozen=True)
class Preset:
    """Attention shape of a model: heads, head and rotary dims, pairing and rope base.

    ``mrope_section`` ``(t, h, w)``: an MRoPE model (Qwen2-VL, Qwen2.5-VL): its workloads have positions
    ``[3, T]`` (temporal, height, width) and pair ``j`` of the rotary dims takes the row of its section.
    """

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    base: float = 10000.0
    mrope_section: tuple[int, int, int] | None = None


# From each model's Hugging Face config.json: num_attention_heads, num_key_value_heads, head_dim,
# rotary_dim (head_dim times partial_rotary_factor / rotary_pct, or GPT-J's rotary_dim), pairing
# (interleaved for GPT-J and DeepSeek-V3's decoupled rope part) and rope_theta (10000 where it has none);
# for MRoPE models, rope_scaling.mrope_section.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("llama-2-7b", 32, 32, 128, 128, False, 1e4),
        Preset("codellama-7b", 32, 32, 128, 128, False, 1e6),
        Preset("llama-3-8b", 32, 8, 128, 128, False, 5e5),
        Preset("llama-3.1-8b", 32, 8, 128, 128, False, 5e5),
        Preset("llama-3-70b", 64, 8, 128, 128, False, 5e5),
        Preset("llama-3.2-1b", 32, 8, 64, 64, False, 5e5),
        Preset("mistral-7b", 32, 8, 128, 128, False, 1e4),
        Preset("qwen2-7b", 28, 4, 128, 128, False, 1e6),
        Preset("qwen2.5-7b", 28, 4, 128, 128, False, 1e6),
        Preset("qwen2.5-vl-7b", 28, 4, 128, 128, False, 1e6, (16, 24, 24)),
        Preset("gpt-neox-20b", 64, 64, 96, 24, False, 1e4),
        Preset("pythia-6.9b", 32, 32, 128, 32, False, 1e4),
        Preset("gpt-j-6b", 16, 16, 256, 64, True, 1e4),
        Preset("phi-2", 32, 32, 80, 32, False, 1e4),
        Preset("phi-3-mini", 32, 32, 96, 96, False, 1e4),
        Preset("deepseek-v3-rope", 128, 1, 64, 64, True, 1e4),
        Preset("gpt-oss-20b", 64, 8, 64, 64, False, 1.5e5),
        Preset("gemma-2-9b", 16, 8, 256, 256, False, 1e4),
        Preset("stablelm-3b", 32, 32, 80, 20, False, 1e4),
    ]
}

PREFILL_TOKENS = [128, 256, 512, 1024, 2048, 4096]
DECODE_TOKENS = [1, 4, 16, 64, 256]
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
MODES = ("inplace", "out", "backward")  # the default --mode
# The serving fusions, run only when --mode names them: RoPE + paged KV-cache write (caches of q's dtype,
# or float8_e4m3fn with k/v scales) and QK-RMSNorm + RoPE on a packed qkv.
SERVING_MODES = ("cache", "cache-fp8", "qknorm")
ALL_MODES = MODES + SERVING_MODES
# Paged KV cache of the cache modes: NHD blocks of KV_BLOCK_SIZE tokens (vLLM's default); a prefill's
# cache holds just its tokens (slots a random permutation of them), a decode step's DECODE_CACHE_SLOTS
# slots (its tokens written to random distinct ones).
KV_BLOCK_SIZE = 16
DECODE_CACHE_SLOTS = 4096
QKNORM_EPS = 1e-6  # Qwen3's rms_norm_eps
QKNORM_WEIGHT = 1.3  # |q_weight| = |k_weight| (random signs)
# Decode positions are drawn from [0, DECODE_CONTEXT): each token is the next one of its own sequence.
DECODE_CONTEXT = 8192


def dtype_name(dt: torch.dtype) -> str:
    """The command-line name of a dtype (``fp32``, ``bf16``, ...)."""
    return {v: k for k, v in DTYPES.items()}[dt]

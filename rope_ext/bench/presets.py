"""Model presets (attention shapes) and the sweep's defaults: token counts, dtypes, modes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ALL_MODES",
    "AXES_LAYOUTS",
    "Axes",
    "DECODE_CACHE_SLOTS",
    "DECODE_CONTEXT",
    "DECODE_TOKENS",
    "DTYPES",
    "KV_BLOCK_SIZE",
    "MLA_BLOCK_SIZE",
    "MLA_MODES",
    "MODES",
    "Mla",
    "QKNORM_EPS",
    "QKNORM_WEIGHT",
    "REROTATE_MODES",
    "SERVING_MODES",
    "PREFILL_TOKENS",
    "PRESETS",
    "Preset",
    "VISION_TARGETS",
    "dtype_name",
]

AXES_LAYOUTS = ("flux", "video", "image")


@dataclass(frozen=True)
class Axes:
    """Positions along several axes, each with its own frequencies (``RopeCache.for_axes``).

    ``dims``: the rotary features of each axis (diffusers' ``axes_dim``), their sum the preset's rotary dim;
    axis ``a`` rotates its features at ``base ** (-2i / dims[a])``, restarting per axis, and the ops take
    ``mrope_section = dims / 2`` with positions ``[len(dims), T]``. ``layout``: how a prefill of ``T``
    tokens is placed (:func:`~rope_ext.bench.workloads.axes_prefill_positions`):

    * ``flux``: text tokens (ids all zero), then the image's ``(0, row, column)`` on a square latent grid of
      ``isqrt(T - T // 9)`` rows (FLUX: 512 text tokens before a 64 x 64 grid of 4096 at ``T = 4608``);
    * ``video``: ``(frame, row, column)`` in raster order, frames of ``grid = (rows, columns)`` patches,
      the last frame partial when ``T`` is not a multiple of a frame;
    * ``image``: ``(row, column)`` of a square grid of patches in 2 x 2 merge blocks (Qwen2-VL's vision
      tower: ``get_vision_position_ids`` with ``spatial_merge_size=2``), its side the smallest even ``s``
      with ``s * s >= T``, its first ``T`` tokens.

    ``tokens``: the model's own prefill (``--tokens model``). ``model``: whose RoPE code the ``model-eager``
    and ``model-compile`` providers time (``flux``, ``wan``, ``qwen2-vl-vision``).
    """

    dims: tuple[int, ...]
    layout: str
    tokens: int
    model: str
    grid: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layout not in AXES_LAYOUTS:
            raise ValueError(f"layout must be one of {AXES_LAYOUTS}, got {self.layout!r}")
        want = {"flux": 3, "video": 3, "image": 2}[self.layout]
        if len(self.dims) != want or any(d <= 0 or d % 2 for d in self.dims):
            raise ValueError(f"a {self.layout} layout takes {want} positive even axis dims, got {self.dims}")
        if self.layout == "video" and len(self.grid) != 2:
            raise ValueError(f"a video layout needs grid=(rows, columns), got {self.grid}")

    @property
    def sections(self) -> tuple[int, ...]:
        """The ops' ``mrope_section``: each axis's number of pairs."""
        return tuple(d // 2 for d in self.dims)


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V2/V3): the shape of the MLA modes' inputs.

    The preset's ``head_dim`` and ``rotary_dim`` are ``qk_rope_head_dim`` (the decoupled rope part;
    ``kv_heads`` 1: k_pe is shared by all heads), so the rotary modes time ``q_pe [T, H, rope]`` and ``k_pe
    [T, 1, rope]`` alone, as vLLM's DeepSeek models rotate them; the MLA modes' ``q [T, H, qk_nope_head_dim
    + rope]`` holds the rope part after ``qk_nope_head_dim`` features that pass through, and ``kv_c [T,
    kv_lora_rank]`` is written beside the rotated k_pe in the latent cache (:mod:`~rope_ext.bench.mla`).
    """

    qk_nope_head_dim: int
    kv_lora_rank: int

    def __post_init__(self) -> None:
        if self.qk_nope_head_dim < 0 or self.kv_lora_rank <= 0:
            raise ValueError(f"an MLA shape needs qk_nope_head_dim >= 0 and kv_lora_rank > 0, got {self}")


@dataclass(frozen=True)
class Preset:
    """Attention shape of a model: heads, head and rotary dims, pairing and rope base.

    ``mrope_section`` ``(t, h, w)``: an MRoPE model (Qwen2-VL, Qwen2.5-VL): its workloads have positions
    ``[3, T]`` (temporal, height, width) and pair ``j`` of the rotary dims takes the row of its section, the
    frequencies those of one table over the whole rotary dim. ``axes``: a vision or diffusion model whose
    frequencies restart per axis (:class:`Axes`): positions ``[n_axes, T]``, the table
    ``RopeCache.for_axes(axes.dims, theta=base)``; prefills only (no decode step).
    """

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    base: float = 10000.0
    mrope_section: tuple[int, int, int] | None = None
    axes: Axes | None = None
    mla: Mla | None = None

    def __post_init__(self) -> None:
        if self.mla is not None and (
            self.sections is not None or self.kv_heads != 1 or self.head_dim != self.rotary_dim
        ):
            raise ValueError(
                "an MLA preset has one position per token, kv_heads 1 and head_dim == rotary_dim "
                "(the rope part)"
            )
        if self.axes is not None:
            if self.mrope_section is not None:
                raise ValueError("a preset has mrope_section or axes, not both")
            if sum(self.axes.dims) != self.rotary_dim:
                raise ValueError(f"axes dims {self.axes.dims} must sum to rotary_dim {self.rotary_dim}")

    @property
    def sections(self) -> tuple[int, ...] | None:
        """The ops' ``mrope_section``: the MRoPE sections, the axes' pairs, or None (one position a token)."""
        return self.axes.sections if self.axes is not None else self.mrope_section


# Vision and diffusion models, positions along several axes with per-axis frequencies:
# * flux: diffusers' FluxTransformer2DModel (FLUX.1-dev / schnell): 24 heads of attention_head_dim 128,
#   axes_dims_rope (16, 56, 56), FluxPosEmbed theta 10000, interleaved pairs (apply_rotary_emb,
#   use_real_unbind_dim=-1); a 1024 x 1024 image is a 64 x 64 latent of 4096 tokens after 512 text tokens.
# * wan2.1-14b / wan2.1-1.3b: diffusers' WanTransformer3DModel (Wan-AI/Wan2.1-T2V-14B-Diffusers: 5120 / 128
#   = 40 heads; Wan2.1-T2V-1.3B: 1536 / 128 = 12 heads), WanRotaryPosEmbed: t / h / w features 44 / 42 / 42
#   (h = w = 2 * (128 // 6)), theta 10000, interleaved pairs. Grid: WanPipeline's default 81 frames of
#   480 x 832 are 21 x 60 x 104 latents, 21 x 30 x 52 = 32760 tokens after the 1 x 2 x 2 patches.
# * qwen2-vl-vision: transformers' Qwen2VisionTransformerPretrainedModel (embed_dim 1280, 16 heads of 80):
#   Qwen2VLVisionRotaryEmbedding's 20 frequencies theta ** (-2i / 40) for the row and again for the column,
#   laid out (h, w, h, w) over the whole head, rotate_half pairs (apply_rotary_pos_emb_vision): axes
#   (40, 40) half-split over all 80 features. A 896 x 896 image is 64 x 64 patches of 14 pixels.
VISION_PRESETS = [
    Preset("flux", 24, 24, 128, 128, True, 1e4, axes=Axes((16, 56, 56), "flux", 4608, "flux")),
    Preset(
        "wan2.1-14b", 40, 40, 128, 128, True, 1e4, axes=Axes((44, 42, 42), "video", 32760, "wan", (30, 52))
    ),
    Preset(
        "wan2.1-1.3b", 12, 12, 128, 128, True, 1e4, axes=Axes((44, 42, 42), "video", 32760, "wan", (30, 52))
    ),
    Preset(
        "qwen2-vl-vision", 16, 16, 80, 80, False, 1e4, axes=Axes((40, 40), "image", 4096, "qwen2-vl-vision")
    ),
]

# The issue's targets for the vision presets' prefills on a CPU: rope_ext in place at frac_ceiling of the
# in-place stream, and speedup_vs_compile / speedup_vs_eager times the model's own RoPE code (model-compile,
# model-eager) on the same q and k.
VISION_TARGETS = {"frac_ceiling": 0.9, "speedup_vs_compile": 3.0, "speedup_vs_eager": 8.0}

# From each model's Hugging Face config.json: num_attention_heads, num_key_value_heads, head_dim,
# rotary_dim (head_dim times partial_rotary_factor / rotary_pct, or GPT-J's rotary_dim), pairing
# (interleaved for GPT-J and DeepSeek-V3's decoupled rope part) and rope_theta (10000 where it has none);
# for MRoPE models, rope_scaling.mrope_section. deepseek-v3: its MLA shape (num_attention_heads 128,
# qk_nope_head_dim 128, qk_rope_head_dim 64 (head_dim and rotary_dim), kv_lora_rank 512), interleaved pairs
# (vLLM's DeepSeek models pass is_neox_style=False), theta 10000 without its yarn scaling (the same work);
# its rotary modes time the same q_pe, k_pe as deepseek-v3-rope, its MLA modes the whole step (see Mla).
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
        Preset("deepseek-v3", 128, 1, 64, 64, True, 1e4, mla=Mla(qk_nope_head_dim=128, kv_lora_rank=512)),
        Preset("gpt-oss-20b", 64, 8, 64, 64, False, 1.5e5),
        Preset("gemma-2-9b", 16, 8, 256, 256, False, 1e4),
        Preset("stablelm-3b", 32, 32, 80, 20, False, 1e4),
        *VISION_PRESETS,
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
# or float8_e4m3fn with k/v scales), QK-RMSNorm + RoPE on a packed qkv, RoPE + MLA latent-cache write
# (a cache of q's dtype, or float8_e4m3fn with kv_scale; presets with an MLA shape only), and the keys of a
# paged KV cache rotated in place by per-token shifts (a cache of q's dtype, or float8_e4m3fn with k_scale;
# every preset).
MLA_MODES = ("mla", "mla-fp8")
REROTATE_MODES = ("rerotate", "rerotate-fp8")
SERVING_MODES = ("cache", "cache-fp8", "qknorm", *MLA_MODES, *REROTATE_MODES)
ALL_MODES = MODES + SERVING_MODES
# Paged KV cache of the cache and rerotate modes: NHD blocks of KV_BLOCK_SIZE tokens (vLLM's default); a
# prefill's cache holds just its tokens (slots a random permutation of them), a decode step's
# DECODE_CACHE_SLOTS slots (its tokens written to, or re-rotated at, random distinct ones).
KV_BLOCK_SIZE = 16
# The MLA modes' latent cache [num_blocks, MLA_BLOCK_SIZE, kv_lora_rank + rope]: blocks of 64 tokens (what
# vLLM's FlashMLA backend requires), slots drawn as for the KV cache.
MLA_BLOCK_SIZE = 64
DECODE_CACHE_SLOTS = 4096
QKNORM_EPS = 1e-6  # Qwen3's rms_norm_eps
QKNORM_WEIGHT = 1.3  # |q_weight| = |k_weight| (random signs)
# Decode positions are drawn from [0, DECODE_CONTEXT): each token is the next one of its own sequence.
DECODE_CONTEXT = 8192


def dtype_name(dt: torch.dtype) -> str:
    """The command-line name of a dtype (``fp32``, ``bf16``, ...)."""
    return {v: k for k, v in DTYPES.items()}[dt]

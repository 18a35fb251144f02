"""The vision and diffusion models' own RoPE code (presets with ``axes``): ``model-eager`` (the baseline of
those presets) and ``model-compile`` (``torch.compile`` of the same code), out of place on q and k.

Each model's pos-embed runs once, at build, outside the timed call (the model runs it once per forward and
shares it across its layers; this favours the model's code); the timed call is the rotation of q and k as
the attention processor does it, on the token-major ``[T, H, D]`` q and k (the models' ``[B, S, H, D]``
with ``B = 1``, or Qwen2-VL vision's ``[S, H, D]``):

* ``flux``: diffusers' ``FluxPosEmbed(theta, axes_dim)`` on the ids ``[T, 3]`` (float64 angles, float32
  cos / sin), then ``embeddings.apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` on q and on k;
* ``wan``: diffusers' ``WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len)`` on a latent of the video's
  frames (its first ``T`` tokens), then the function ``WanAttnProcessor.__call__`` defines and calls on
  q and k (``apply_rotary_emb(x, freqs_cos, freqs_sin)``);
* ``qwen2-vl-vision``: transformers' ``apply_rotary_pos_emb_vision(q, k, cos, sin)``, with cos / sin
  ``[T, 80]`` laid out as ``Qwen2VLVisionRotaryEmbedding`` lays them out (row frequencies, column
  frequencies, both again) from the workload's table. The module itself computes its angles in float32
  (an error of ~1e-5 at position 64, dozens of float32 ulps), which the float64 check would refuse; its
  layout and frequencies are checked against it in ``tests/test_bench_vision.py``.

The model's code runs as installed (diffusers, transformers); a provider skips when it is not importable.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..workloads import Case
from . import Runner, Skip, provider
from .hf import _have_cxx, _raise_recompile_limits

__all__ = ["model_rotation"]

# Wan's patch: a latent of F x 2h x 2w is F x h x w tokens.
WAN_PATCH = (1, 2, 2)


def _wan_processor_rotation() -> Callable[..., Tensor]:
    """The ``apply_rotary_emb`` that ``WanAttnProcessor.__call__`` defines and calls on q and k."""
    from diffusers.models.transformers import transformer_wan

    code = next(
        c
        for c in transformer_wan.WanAttnProcessor.__call__.__code__.co_consts
        if isinstance(c, types.CodeType) and c.co_name == "apply_rotary_emb"
    )
    return types.FunctionType(code, transformer_wan.__dict__, code.co_name)


def _flux(case: Case) -> tuple[Callable[..., tuple[Tensor, Tensor]], tuple[Any, ...], str]:
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    axes = case.preset.axes
    assert axes is not None
    ids = case.positions.T.to(torch.float32)  # [T, 3]: FLUX's txt_ids / img_ids, concatenated
    with torch.no_grad():
        cos, sin = FluxPosEmbed(theta=int(case.preset.base), axes_dim=list(axes.dims))(ids)

    def rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        q = apply_rotary_emb(q[None], (cos, sin), sequence_dim=1)
        k = apply_rotary_emb(k[None], (cos, sin), sequence_dim=1)
        return q[0], k[0]

    return rotate, (cos, sin), "diffusers FluxPosEmbed + embeddings.apply_rotary_emb"


def _wan(case: Case) -> tuple[Callable[..., tuple[Tensor, Tensor]], tuple[Any, ...], str]:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    axes = case.preset.axes
    assert axes is not None
    rows, cols = axes.grid
    frames = max(1, math.ceil(case.tokens / (rows * cols)))
    rope = WanRotaryPosEmbed(case.preset.head_dim, WAN_PATCH, max_seq_len=max(1024, frames, rows, cols))
    if (rope.t_dim, rope.h_dim, rope.w_dim) != axes.dims:
        raise Skip(f"WanRotaryPosEmbed splits head_dim {case.preset.head_dim} otherwise than {axes.dims}")
    latent = torch.empty(1, 0, frames * WAN_PATCH[0], rows * WAN_PATCH[1], cols * WAN_PATCH[2])
    with torch.no_grad():
        cos, sin = (t[:, : case.tokens].to(case.device) for t in rope(latent))  # [1, T, 1, D]
    fn = _wan_processor_rotation()

    def rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return fn(q[None], cos, sin)[0], fn(k[None], cos, sin)[0]

    return rotate, (cos, sin), "diffusers WanRotaryPosEmbed + WanAttnProcessor's apply_rotary_emb"


def _qwen2_vl_vision(case: Case) -> tuple[Callable[..., tuple[Tensor, Tensor]], tuple[Any, ...], str]:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    if case.interleaved:
        raise Skip("Qwen2-VL vision rotates half-split pairs (rotate_half)")
    cos, sin = case.hf_cos_sin(torch.float32)  # [T, 80]: (h, w) frequencies, then the same again
    return apply_rotary_pos_emb_vision, (cos, sin), "transformers qwen2_vl apply_rotary_pos_emb_vision"


_MODELS = {"flux": _flux, "wan": _wan, "qwen2-vl-vision": _qwen2_vl_vision}


def model_rotation(case: Case) -> tuple[Callable[..., tuple[Tensor, Tensor]], tuple[Any, ...], str]:
    """The model's rotation ``fn(q, k, *args) -> (q', k')`` for ``case`` (an axes preset), its pos-embed's
    outputs ``args`` (computed here, once) and a line naming the code. Raises :class:`Skip` for presets
    without axes, a pairing the model does not use, or the library not importable."""
    axes = case.preset.axes
    if axes is None or axes.model not in _MODELS:
        raise Skip("for presets of vision / diffusion models (axes)")
    if case.interleaved != case.preset.interleaved:
        raise Skip(f"{axes.model}'s code has its own pairing only")
    try:
        return _MODELS[axes.model](case)
    except ImportError as e:
        raise Skip(f"{axes.model}'s code not importable ({type(e).__name__}: {e})") from None


def _labelled(run: Runner, source: str) -> Runner:
    run.source = source  # type: ignore[attr-defined]
    return run


@provider("model-eager", "out", baseline=True)
def _model_eager(case: Case) -> Runner:
    fn, args, source = model_rotation(case)
    q, k = case.q, case.k
    return _labelled(lambda: fn(q, k, *args), source)


_compiled: dict[tuple, Callable[..., Any]] = {}


@provider("model-compile", "out")
def _model_compile(case: Case) -> Runner:
    if case.device.type == "cpu" and not _have_cxx():
        raise Skip("torch.compile on CPU needs a C++ compiler")
    fn, args, source = model_rotation(case)
    assert case.preset.axes is not None
    key = (case.preset.axes.model, tuple(case.q.shape), tuple(case.k.shape), case.dtype, case.device.type)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=False, fullgraph=True)
        _raise_recompile_limits()
    compiled = _compiled[key]
    q, k = case.q, case.k
    return _labelled(lambda: compiled(q, k, *args), f"torch.compile of {source}")

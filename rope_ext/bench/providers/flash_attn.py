"""flash-attn's ``apply_rotary_emb`` (CUDA only), in place and out of place; skipped when not importable."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ..workloads import Case, clones
from . import Runner, Skip, provider


def _flash_attn_cos_sin(case: Case) -> tuple[Tensor, Tensor]:
    h = case.rotary_dim // 2
    rows = case.cos_sin_rows()  # [T, rotary_dim]: per-token rows give arbitrary positions (and MRoPE)
    return rows[:, :h].contiguous(), rows[:, h:].contiguous()


def _flash_attn_fn(case: Case) -> Callable[..., Tensor]:
    try:
        from flash_attn.layers.rotary import apply_rotary_emb
    except Exception as e:
        raise Skip(f"flash-attn not importable ({type(e).__name__})") from None
    if case.device.type != "cuda":
        raise Skip("flash-attn rotary runs on CUDA only")
    return apply_rotary_emb


@provider("flash-attn", "inplace")
def _flash_attn_inplace(case: Case) -> Runner:
    fn = _flash_attn_fn(case)
    cos, sin = _flash_attn_cos_sin(case)
    q, k = clones(case)
    il = case.interleaved

    def run() -> tuple[Tensor, Tensor]:
        fn(q[None], cos, sin, interleaved=il, inplace=True)
        fn(k[None], cos, sin, interleaved=il, inplace=True)
        return q, k

    return run


@provider("flash-attn", "out")
def _flash_attn_out(case: Case) -> Runner:
    fn = _flash_attn_fn(case)
    cos, sin = _flash_attn_cos_sin(case)
    q, k, il = case.q, case.k, case.interleaved
    return lambda: (fn(q[None], cos, sin, interleaved=il)[0], fn(k[None], cos, sin, interleaved=il)[0])

"""FlashInfer's rope with a cos/sin cache, in place and out of place; skipped when not importable.

``cache`` mode: the rope in place, then ``flashinfer.page.append_paged_kv_cache`` (each token its own
request of one page, the slot's block, at the slot's offset); fp8 caches are not timed (that append
stores k and v as they are, no scale).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..workloads import Case, clones, split_qkv
from . import Runner, Skip, flat, provider


def _no_mrope(case: Case) -> None:
    if case.mrope_section is not None:
        raise Skip("MRoPE: flashinfer's cos/sin-cache rope takes one position per token")


@provider("flashinfer", "inplace")
def _flashinfer_inplace(case: Case) -> Runner:
    try:
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace
    except Exception as e:
        raise Skip(f"flashinfer not importable ({type(e).__name__})") from None
    _no_mrope(case)
    q, k = clones(case)
    pos, cs, d, neox = case.positions, case.cos_sin, case.preset.head_dim, not case.interleaved
    qf, kf = flat(q), flat(k)

    def run() -> tuple[Tensor, Tensor]:
        apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, d, cs, is_neox=neox)
        return q, k

    return run


@provider("flashinfer", "out")
def _flashinfer_out(case: Case) -> Runner:
    try:
        from flashinfer.rope import apply_rope_with_cos_sin_cache
    except Exception as e:
        raise Skip(f"flashinfer not importable ({type(e).__name__})") from None
    _no_mrope(case)
    pos, cs, d, neox = case.positions, case.cos_sin, case.preset.head_dim, not case.interleaved
    qf, kf = flat(case.q), flat(case.k)
    shapes = case.q.shape, case.k.shape

    def run() -> tuple[Tensor, Tensor]:
        qo, ko = apply_rope_with_cos_sin_cache(pos, qf, kf, d, cs, is_neox=neox)
        return qo.view(shapes[0]), ko.view(shapes[1])

    return run


@provider("flashinfer", "cache")
def _flashinfer_cache(case: Case) -> Runner:
    try:
        from flashinfer.page import append_paged_kv_cache
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace
    except Exception as e:
        raise Skip(f"flashinfer not importable ({type(e).__name__})") from None
    _no_mrope(case)
    q, k, v = split_qkv(case.packed_qkv(), case.preset.q_heads, case.preset.kv_heads)
    kc, vc = case.new_caches(False)
    pos, cs, d, neox = case.positions, case.cos_sin, case.preset.head_dim, not case.interleaved
    slots, bs, t = case.serving.slot_mapping, kc.shape[1], case.tokens
    i32 = dict(dtype=torch.int32, device=case.device)
    batch, offset = torch.arange(t, **i32), (slots % bs).to(torch.int32)
    pages, indptr, last = (slots // bs).to(torch.int32), torch.arange(t + 1, **i32), offset + 1
    qf, kf = flat(q), flat(k)

    def run() -> tuple[Tensor, ...]:
        apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, d, cs, is_neox=neox)
        append_paged_kv_cache(k, v, batch, offset, (kc, vc), pages, indptr, last, kv_layout="NHD")
        return q, k, kc, vc

    return run

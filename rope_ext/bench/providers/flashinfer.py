"""FlashInfer's rope with a cos/sin cache, in place and out of place; skipped when not importable."""

from __future__ import annotations

from torch import Tensor

from ..workloads import Case, clones
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

"""Liger-Kernel's Triton rope (CUDA only, half-split and full rotary); skipped when not importable."""

from __future__ import annotations

from torch import Tensor

from ..workloads import Case, clones
from . import Runner, Skip, provider


@provider("liger", "inplace")
def _liger(case: Case) -> Runner:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as e:
        raise Skip(f"liger-kernel not importable ({type(e).__name__})") from None
    if case.device.type != "cuda":
        raise Skip("liger rope runs on CUDA only")
    if case.interleaved or case.rotary_dim != case.preset.head_dim:
        raise Skip("liger rope: half-split pairing and full rotary only")
    cos, sin = case.hf_cos_sin()
    cos, sin = cos[None], sin[None]  # [1, T, D]
    q, k = clones(case)
    qv, kv = q[None].transpose(1, 2), k[None].transpose(1, 2)  # BHSD views of the token-major tensors

    def run() -> tuple[Tensor, Tensor]:
        qo, ko = LigerRopeFunction.apply(qv, kv, cos, sin)
        return qo.transpose(1, 2)[0], ko.transpose(1, 2)[0]

    return run

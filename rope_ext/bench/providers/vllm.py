"""vLLM's ``rotary_embedding`` custom op (in place); skipped with a note when vllm is not importable."""

from __future__ import annotations

from torch import Tensor

from ..workloads import Case, clones
from . import Runner, Skip, flat, provider


@provider("vllm", "inplace")
def _vllm(case: Case) -> Runner:
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception as e:  # ImportError, or a broken install
        raise Skip(f"vllm not importable ({type(e).__name__})") from None
    if case.mrope_section is not None:
        raise Skip("MRoPE: vllm's rotary_embedding op takes one position per token")
    q, k = clones(case)
    cache = case.cos_sin.to(case.dtype)  # vLLM matches the cache to the query dtype
    pos, d, neox = case.positions, case.preset.head_dim, not case.interleaved
    qf, kf = flat(q), flat(k)

    def run() -> tuple[Tensor, Tensor]:
        vllm_ops.rotary_embedding(pos, qf, kf, d, cache, neox)
        return q, k

    return run

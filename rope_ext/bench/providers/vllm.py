"""vLLM's custom ops; skipped with a note when vllm is not importable.

* ``inplace``: ``rotary_embedding``;
* ``cache`` / ``cache-fp8``: ``rotary_embedding`` then ``reshape_and_cache_flash`` (the two ops of its
  eager path; fp8 caches passed as their bytes with ``kv_cache_dtype="fp8"``, as vLLM allocates them);
* ``qknorm``: ``torch.ops._C.fused_qk_norm_rope`` on the packed qkv.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..workloads import Case, clones, split_qkv
from . import Runner, Skip, flat, provider


def _vllm_ops(case: Case) -> Any:
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception as e:  # ImportError, or a broken install
        raise Skip(f"vllm not importable ({type(e).__name__})") from None
    if case.mrope_section is not None:
        raise Skip("MRoPE: vllm's rotary_embedding op takes one position per token")
    return vllm_ops


@provider("vllm", "inplace")
def _vllm(case: Case) -> Runner:
    vllm_ops = _vllm_ops(case)
    q, k = clones(case)
    cache = case.cos_sin.to(case.dtype)  # vLLM matches the cache to the query dtype
    pos, d, neox = case.positions, case.preset.head_dim, not case.interleaved
    qf, kf = flat(q), flat(k)

    def run() -> tuple[Tensor, Tensor]:
        vllm_ops.rotary_embedding(pos, qf, kf, d, cache, neox)
        return q, k

    return run


def _vllm_cache(fp8: bool):
    def build(case: Case) -> Runner:
        vllm_ops = _vllm_ops(case)
        q, k, v = split_qkv(case.packed_qkv(), case.preset.q_heads, case.preset.kv_heads)
        kc, vc = case.new_caches(fp8)
        kca, vca = (kc.view(torch.uint8), vc.view(torch.uint8)) if fp8 else (kc, vc)
        s = case.serving
        cache = case.cos_sin.to(case.dtype)
        pos, d, neox, slots = case.positions, case.preset.head_dim, not case.interleaved, s.slot_mapping
        kvd, ks, vs = ("fp8" if fp8 else "auto"), s.k_scale, s.v_scale
        qf, kf = flat(q), flat(k)

        def run() -> tuple[Tensor, ...]:
            vllm_ops.rotary_embedding(pos, qf, kf, d, cache, neox)
            vllm_ops.reshape_and_cache_flash(k, v, kca, vca, slots, kvd, ks, vs)
            return q, k, kc, vc

        return run

    return build


provider("vllm", "cache")(_vllm_cache(False))
provider("vllm", "cache-fp8")(_vllm_cache(True))


@provider("vllm", "qknorm")
def _vllm_qknorm(case: Case) -> Runner:
    _vllm_ops(case)  # registers torch.ops._C
    op = getattr(getattr(torch.ops, "_C", None), "fused_qk_norm_rope", None)
    if op is None:
        raise Skip("this vllm has no fused_qk_norm_rope op")
    qkv = case.packed_qkv().flatten(1)
    p, s = case.preset, case.serving
    cache = case.cos_sin.to(case.dtype)
    args = (p.q_heads, p.kv_heads, p.kv_heads, p.head_dim, s.eps, s.q_weight, s.k_weight, cache)
    neox, pos = not case.interleaved, case.positions

    def run() -> tuple[Tensor, ...]:
        op(qkv, *args, neox, pos)
        return (qkv,)

    return run

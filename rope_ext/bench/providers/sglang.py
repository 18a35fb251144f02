"""SGLang's ``sgl_kernel.apply_rope_with_cos_sin_cache_inplace`` with its fused KV-buffer write
(``FusedSetKVBufferArg``), ``cache`` mode; skipped when not importable.

SGLang's buffers are token-slot ``[num_slots, Hkv * D]``: the NHD cache viewed so (a block size of 1), the
slots its ``cache_loc``. fp8 buffers are not timed (SGLang stores them through its own dtype views).
"""

from __future__ import annotations

from torch import Tensor

from ..workloads import Case, split_qkv
from . import Runner, Skip, flat, provider


@provider("sglang", "cache")
def _sglang_cache(case: Case) -> Runner:
    try:
        from sgl_kernel import FusedSetKVBufferArg, apply_rope_with_cos_sin_cache_inplace
    except Exception as e:
        raise Skip(f"sgl_kernel not importable ({type(e).__name__})") from None
    if case.mrope_section is not None:
        raise Skip("MRoPE: sgl_kernel's rope takes one position per token")
    q, k, v = split_qkv(case.packed_qkv(), case.preset.q_heads, case.preset.kv_heads)
    kc, vc = case.new_caches(False)
    pos, cs, d, neox = case.positions, case.cos_sin, case.preset.head_dim, not case.interleaved
    arg = FusedSetKVBufferArg(
        value=flat(v),
        k_buffer=kc.view(-1, kc.shape[-2] * d),
        v_buffer=vc.view(-1, vc.shape[-2] * d),
        k_scale=None,
        v_scale=None,
        cache_loc=case.serving.slot_mapping,
    )
    qf, kf = flat(q), flat(k)

    def run() -> tuple[Tensor, ...]:
        apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, d, cs, is_neox=neox, fused_set_kv_buffer_arg=arg)
        return q, k, kc, vc

    return run

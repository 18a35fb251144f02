"""rope_ext's own ops: in place, out of place and backward (``rope_ext.apply_rotary_qk[_]``); ``rope_ext
table-free`` the in-place rotation with frequencies instead of the table (each token's cos/sin computed).

MRoPE presets pass ``mrope_section`` with their ``[3, T, 1]`` positions. ``rope_ext+varlen`` (packed
workloads): ``rope_ext.varlen_positions`` then the rotation in place, timed together.

Serving modes, on views q, k, v of a packed qkv:

* ``cache`` / ``cache-fp8``: ``rope_ext`` is the fused ``rope_ext.apply_rotary_qk_and_cache_``;
  ``rope_ext unfused`` (the baseline) the two-op eager path of a server without the fusion:
  ``apply_rotary_qk_`` in place, then ``index_copy_`` of k's and v's rows into the caches viewed as
  ``[num_slots, Hkv, D]`` (fp8 caches: :func:`rope_ext.reference.quantize_fp8`'s torch ops first, and
  the copy on the caches' bytes, as CPU torch has no fp8 ``index_copy_``); ``rope_ext page table`` the
  fused op placing the same tokens through FlashInfer's page table (``page_table=``, int32): each token a
  request of one page (``kv_indices = slot // block_size``, ``positions = slot % block_size``, the token
  the last entry), the form of a decode batch, so that it writes the slots of the others;
* ``qknorm``: ``rope_ext`` is the fused ``rope_ext.apply_qk_norm_rotary_`` on the packed ``[T, (Hq +
  2 Hkv) * D]``; its unfused references are in :mod:`.hf`.

MLA modes (``mla``, ``mla-fp8``; inputs :func:`rope_ext.bench.mla.mla_tensors`): ``rope_ext`` is the fused
``rope_ext.apply_mla_rotary_and_cache_`` (q's rope part at ``rotary_offset = qk_nope_head_dim``, ``kv_scale``
for the fp8 cache); its unfused references are in :mod:`.hf`.

Rerotate modes (``rerotate``, ``rerotate-fp8``; inputs :mod:`rope_ext.bench.rerotate`): ``rope_ext`` is
``rope_ext.rerotate_kv_cache_`` on a fresh copy of the cache with the per-token int64 deltas (``k_scale`` for
the fp8 cache); its unfused references (gather, rotate, ``index_copy_``) are in :mod:`.hf`.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rope_ext
from rope_ext.reference import quantize_fp8

from ..rerotate import rerotate_tensors
from ..workloads import FP8_CACHE_DTYPE, Case, clones, split_qkv
from . import Runner, Skip, mla_tensors, provider


@provider("rope_ext", "inplace")
def _rope_ext_inplace(case: Case) -> Runner:
    q, k = clones(case)
    pos, cs, il, sec = case.rope_positions, case.cos_sin, case.interleaved, case.mrope_section
    apply = rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, Tensor]:
        apply(q, k, pos, cs, interleaved=il, mrope_section=sec)
        return q, k

    return run


@provider("rope_ext table-free", "inplace")
def _rope_ext_table_free(case: Case) -> Runner:
    """The in-place rotation with ``cos_sin`` given as frequencies: each token's row computed in the op."""
    q, k = clones(case)
    pos, freqs, il, sec = case.rope_positions, case.freqs, case.interleaved, case.mrope_section
    apply = rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, Tensor]:
        apply(q, k, pos, freqs, interleaved=il, mrope_section=sec)
        return q, k

    return run


@provider("rope_ext", "out")
def _rope_ext_out(case: Case) -> Runner:
    q, k = case.q, case.k
    pos, cs, il, sec = case.rope_positions, case.cos_sin, case.interleaved, case.mrope_section
    apply = rope_ext.apply_rotary_qk
    return lambda: apply(q, k, pos, cs, interleaved=il, mrope_section=sec)


@provider("rope_ext", "backward")
def _rope_ext_backward(case: Case) -> Runner:
    q, k = (t.clone().requires_grad_(True) for t in (case.q, case.k))
    outs = rope_ext.apply_rotary_qk(
        q,
        k,
        case.rope_positions,
        case.cos_sin,
        interleaved=case.interleaved,
        mrope_section=case.mrope_section,
    )
    grads = (case.grad_q, case.grad_k)
    return lambda: torch.autograd.grad(outs, (q, k), grads, retain_graph=True)


@provider("rope_ext+varlen", "inplace")
def _rope_ext_varlen(case: Case) -> Runner:
    if case.cu_seqlens is None:
        raise Skip("for packed workloads (--seqs)")
    q, k = clones(case)
    cu, tokens, cs, il = case.cu_seqlens, case.tokens, case.cos_sin, case.interleaved
    positions, apply = rope_ext.varlen_positions, rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, Tensor]:
        apply(q, k, positions(cu, total_tokens=tokens)[:, None], cs, interleaved=il)
        return q, k

    return run


def _cache_inputs(case: Case, fp8: bool):
    """Fresh views q, k, v of a packed qkv and zeroed caches (fp8: ``FP8_CACHE_DTYPE``)."""
    q, k, v = split_qkv(case.packed_qkv(), case.preset.q_heads, case.preset.kv_heads)
    return q, k, v, *case.new_caches(fp8)


def _rope_ext_cache(fp8: bool):
    def build(case: Case) -> Runner:
        q, k, v, kc, vc = _cache_inputs(case, fp8)
        s = case.serving
        pos, cs, slots = case.positions, case.cos_sin, s.slot_mapping
        il, sec = case.interleaved, case.mrope_section
        scales = {"k_scale": s.k_scale, "v_scale": s.v_scale} if fp8 else {}
        apply = rope_ext.apply_rotary_qk_and_cache_

        def run() -> tuple[Tensor, ...]:
            apply(q, k, v, pos, cs, kc, vc, slots, interleaved=il, mrope_section=sec, **scales)
            return q, k, kc, vc

        return run

    return build


def page_table_of(slots: Tensor, block_size: int) -> rope_ext.PageTable:
    """A page table (int32) that places token t at ``slots[t]``: each token a request of one page."""
    i32, t = torch.int32, slots.shape[0]
    rows = (slots % block_size).to(i32)
    return rope_ext.PageTable(
        torch.arange(t, dtype=i32),
        rows,
        (slots // block_size).to(i32),
        torch.arange(t + 1, dtype=i32),
        rows + 1,
    )


def _rope_ext_cache_paged(fp8: bool):
    def build(case: Case) -> Runner:
        q, k, v, kc, vc = _cache_inputs(case, fp8)
        s = case.serving
        pos, cs, il, sec = case.positions, case.cos_sin, case.interleaved, case.mrope_section
        table = page_table_of(s.slot_mapping, kc.shape[1])
        scales = {"k_scale": s.k_scale, "v_scale": s.v_scale} if fp8 else {}
        apply = rope_ext.apply_rotary_qk_and_cache_

        def run() -> tuple[Tensor, ...]:
            apply(q, k, v, pos, cs, kc, vc, page_table=table, interleaved=il, mrope_section=sec, **scales)
            return q, k, kc, vc

        return run

    return build


def _rope_ext_cache_unfused(fp8: bool):
    def build(case: Case) -> Runner:
        q, k, v, kc, vc = _cache_inputs(case, fp8)
        s = case.serving
        pos, cs, slots = case.rope_positions, case.cos_sin, s.slot_mapping
        il, sec = case.interleaved, case.mrope_section
        hk, d = case.preset.kv_heads, case.preset.head_dim
        apply = rope_ext.apply_rotary_qk_
        if not fp8:
            kf, vf = kc.view(-1, hk, d), vc.view(-1, hk, d)

            def run() -> tuple[Tensor, ...]:
                apply(q, k, pos, cs, interleaved=il, mrope_section=sec)
                kf.index_copy_(0, slots, k)
                vf.index_copy_(0, slots, v)
                return q, k, kc, vc

            return run
        kb, vb = kc.view(torch.uint8).view(-1, hk, d), vc.view(torch.uint8).view(-1, hk, d)
        ks, vs, u8 = s.k_scale, s.v_scale, torch.uint8

        def run_fp8() -> tuple[Tensor, ...]:
            apply(q, k, pos, cs, interleaved=il, mrope_section=sec)
            kb.index_copy_(0, slots, quantize_fp8(k, ks, FP8_CACHE_DTYPE).view(u8))
            vb.index_copy_(0, slots, quantize_fp8(v, vs, FP8_CACHE_DTYPE).view(u8))
            return q, k, kc, vc

        return run_fp8

    return build


for _mode, _fp8 in (("cache", False), ("cache-fp8", True)):
    provider("rope_ext", _mode)(_rope_ext_cache(_fp8))
    provider("rope_ext page table", _mode)(_rope_ext_cache_paged(_fp8))
    provider("rope_ext unfused", _mode, baseline=True)(_rope_ext_cache_unfused(_fp8))
del _mode, _fp8


def _rope_ext_mla(fp8: bool):
    def build(case: Case) -> Runner:
        q, kv_c, k_pe, cache = mla_tensors(case, fp8)
        m = case.mla
        pos, cs, slots = case.positions, case.cos_sin, m.slot_mapping
        opts = {"rotary_offset": m.q_nope.shape[-1], "interleaved": case.interleaved}
        if fp8:
            opts["kv_scale"] = m.kv_scale
        apply = rope_ext.apply_mla_rotary_and_cache_

        def run() -> tuple[Tensor, ...]:
            apply(q, kv_c, k_pe, pos, cs, cache, slots, **opts)
            return q, k_pe, cache

        return run

    return build


provider("rope_ext", "mla")(_rope_ext_mla(False))
provider("rope_ext", "mla-fp8")(_rope_ext_mla(True))


def _rope_ext_rerotate(fp8: bool):
    def build(case: Case) -> Runner:
        cache = rerotate_tensors(case, fp8)
        s = case.rerotate
        slots, delta, cs = s.slot_mapping, s.delta, case.cos_sin
        opts = {"interleaved": case.interleaved, **({"k_scale": s.k_scale} if fp8 else {})}
        apply = rope_ext.rerotate_kv_cache_

        def run() -> tuple[Tensor, ...]:
            apply(cache, slots, delta, cs, **opts)
            return (cache,)

        return run

    return build


provider("rope_ext", "rerotate")(_rope_ext_rerotate(False))
provider("rope_ext", "rerotate-fp8")(_rope_ext_rerotate(True))


@provider("rope_ext", "qknorm")
def _rope_ext_qknorm(case: Case) -> Runner:
    if case.mrope_section is not None:
        raise Skip("qknorm: one position per token (its reference takes no MRoPE)")
    qkv = case.packed_qkv().flatten(1)
    p, s = case.preset, case.serving
    pos, cs, il = case.positions, case.cos_sin, case.interleaved
    apply = rope_ext.apply_qk_norm_rotary_
    heads, qw, kw = (p.q_heads, p.kv_heads, p.kv_heads), s.q_weight, s.k_weight

    def run() -> tuple[Tensor, ...]:
        apply(qkv, *heads, qw, kw, pos, cs, eps=s.eps, interleaved=il)
        return (qkv,)

    return run


def _forced_isa(isa: str, build):
    """``build``'s runner with the CPU kernel switched to ``isa`` for each call (and back after it).

    Prefill only: the two switches cost about as much as a decode step.
    """

    def build_forced(case: Case) -> Runner:
        if case.device.type != "cpu":
            raise Skip("forced CPU instruction sets are for --device cpu")
        if case.phase != "prefill":
            raise Skip("forced CPU instruction sets time prefill only")
        if not torch.ops.rope_ext._cpu_isa_supported(isa):
            raise Skip(f"this CPU does not run the {isa} kernel")
        run = build(case)
        switch = torch.ops.rope_ext._set_cpu_isa
        default = rope_ext._cpu_isa()

        def run_forced() -> tuple[Tensor, Tensor]:
            switch(isa)
            try:
                return run()
            finally:
                switch(default)

        return run_forced

    return build_forced


# rope_ext[scalar], rope_ext[avx2], ...: one CPU kernel build each, compared in one run (opt-in).
for _isa in rope_ext.ops.CPU_ISAS:
    provider(f"rope_ext[{_isa}]", "inplace", opt_in=True)(_forced_isa(_isa, _rope_ext_inplace))
    provider(f"rope_ext[{_isa}]", "out", opt_in=True)(_forced_isa(_isa, _rope_ext_out))
del _isa

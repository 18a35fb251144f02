"""The sizes of tests/test_onnx.py and its serving ops' cases: each a call on the model's q and k (and what it
writes) and its other inputs for t tokens (float32 caches, cast to fp8 in the graph where asked)."""

from __future__ import annotations

import torch

import rope_ext

HQ, HK, D = 4, 2, 16  # as test_onnx.py's q [T, HQ, D] and k [T, HK, D]
P = 64  # cos_sin rows
BLOCKS, BLOCK_SIZE = 8, 4
FP8 = torch.float8_e4m3fn


def _cache_extra(layout="NHD", fp8=False, q_out=False):
    """float32 caches (cast to fp8 in the graph where ``fp8``), ``t - 1`` slots, one of them -1."""

    def extra(t):
        g = torch.Generator().manual_seed(t + 7)
        shape = (BLOCKS, BLOCK_SIZE, HK, D) if layout == "NHD" else (BLOCKS, HK, BLOCK_SIZE, D)
        slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: t - 1]
        slots[1] = -1
        out = {"key_cache": torch.randn(shape, generator=g), "value_cache": torch.randn(shape, generator=g)}
        out["slot_mapping"] = slots
        if fp8:
            out.update(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.01]))
        if q_out:
            out["q_out"] = torch.zeros(t, HQ, D)
        if q_out and fp8:
            out["q_scale"] = torch.tensor([0.02])
        return out

    return extra


def _cache(layout="NHD", fp8=False, **kw):
    def call(q, k, p, cs, key_cache, value_cache, slot_mapping, q_out=None, **scales):
        if fp8:  # the caches and q_out in fp8 (the model's inputs and outputs stay float32)
            key_cache, value_cache = key_cache.to(FP8), value_cache.to(FP8)
            q_out = None if q_out is None else q_out.to(FP8)
        v = k * 3 - 1
        rope_ext.apply_rotary_qk_and_cache_(
            q, k, v, p, cs, key_cache, value_cache, slot_mapping, layout=layout, q_out=q_out, **scales, **kw
        )
        written = (key_cache, value_cache) + (() if q_out is None else (q_out,))
        return (q, k) + tuple(t.float() for t in written)

    return call


def _mla_extra(fp8=False, q_out=False):
    """An MLA cache [BLOCKS, BLOCK_SIZE, D + rd] of float32 (cast to fp8 in the graph where ``fp8``)."""

    def extra(t):
        g = torch.Generator().manual_seed(t + 11)
        slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: t - 1]
        slots[1] = -1
        out = {"kv_cache": torch.randn(BLOCKS, BLOCK_SIZE, D + 8, generator=g), "slot_mapping": slots}
        if fp8:
            out["kv_scale"] = torch.tensor([0.05])
        if q_out:
            out["q_out"] = torch.zeros(t, HQ, D)
        if q_out and fp8:
            out["q_scale"] = torch.tensor([0.02])
        return out

    return extra


def _mla(fp8=False, **kw):
    """q's last 8 features rotated (rotary_offset = D - 8, DeepSeek's nope + rope); k_pe and kv_c views of
    k (k_pe: head 0's first 8 features, rotated in place; kv_c: head 1)."""

    def call(q, k, p, cs, kv_cache, slot_mapping, q_out=None, **scales):
        if fp8:
            kv_cache = kv_cache.to(FP8)
            q_out = None if q_out is None else q_out.to(FP8)
        k_pe, kv_c = k[:, 0, :8], k[:, 1]
        rope_ext.apply_mla_rotary_and_cache_(
            q, kv_c, k_pe, p, cs, kv_cache, slot_mapping, rotary_offset=D - 8, q_out=q_out, **scales, **kw
        )
        written = (kv_cache,) + (() if q_out is None else (q_out,))
        return (q, k) + tuple(t.float() for t in written)

    return call


def _rerotate_extra(layout="NHD", fp8=False):
    """A cache, ``t - 1`` slots (one -1) and a shift per slot, of both signs."""

    def extra(t):
        g = torch.Generator().manual_seed(t + 13)
        shape = (BLOCKS, BLOCK_SIZE, HK, D) if layout == "NHD" else (BLOCKS, HK, BLOCK_SIZE, D)
        slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: t - 1]
        slots[1] = -1
        delta = torch.randint(-P + 1, P, (t - 1,), generator=g)
        out = {"key_cache": torch.randn(shape, generator=g), "slot_mapping": slots, "delta": delta}
        if fp8:
            out["k_scale"] = torch.tensor([0.05])
        return out

    return extra


def _rerotate(fp8=False, **kw):
    """The cached keys at the slots shifted (q and k pass through)."""

    def call(q, k, p, cs, key_cache, slot_mapping, delta, **scales):
        key_cache = key_cache.to(FP8) if fp8 else key_cache * 1  # not the model's input: shifts add up
        rope_ext.rerotate_kv_cache_(key_cache, slot_mapping, delta, cs, **scales, **kw)
        return q, k, key_cache.float()

    return call

"""The sizes of tests/test_onnx.py and its serving ops' cases: each a call on the model's q and k (and what it
writes) and its other inputs for t tokens (float32 caches, cast to fp8 in the graph where asked)."""

from __future__ import annotations

import torch

import rope_ext

HQ, HK, D = 4, 2, 16  # as test_onnx.py's q [T, HQ, D] and k [T, HK, D]
P = 64  # cos_sin rows
BLOCKS, BLOCK_SIZE = 8, 4
FP8 = torch.float8_e4m3fn
PAGES = (3, 2, 3)  # the pages of the page table's requests (BLOCKS in all)
PAGE_TABLE = ("batch_indices", "page_positions", "kv_indices", "kv_indptr", "kv_last_page_len")
TOKEN_DIMS = ("slot_mapping", "q_out", "delta", "batch_indices", "page_positions")  # [T'] or [T]


def page_table(t: int, g: torch.Generator, last_page_len: bool = True) -> dict:
    """FlashInfer's page table (int32) of ``t - 1`` tokens, the second one of request -1 (not written): the
    BLOCKS pages in random order among len(PAGES) requests, each request's last page ``kv_last_page_len``
    rows long (a full page without it), each token a distinct entry of its request."""
    last = torch.randint(1, BLOCK_SIZE + 1, (len(PAGES),), generator=g) if last_page_len else None
    lengths = [
        (n - 1) * BLOCK_SIZE + (BLOCK_SIZE if last is None else int(last[b])) for b, n in enumerate(PAGES)
    ]
    entries = torch.tensor([(b, e) for b, n in enumerate(lengths) for e in range(n)])
    picked = entries[torch.randperm(len(entries), generator=g)[: t - 1]]
    picked[1, 0] = -1
    indptr = torch.tensor([0, *PAGES]).cumsum(0)
    table = (picked[:, 0], picked[:, 1], torch.randperm(BLOCKS, generator=g), indptr, last)
    return {n: x.int() for n, x in zip(PAGE_TABLE, table, strict=True) if x is not None}


def _slots_or_table(t: int, g: torch.Generator, paged: bool, last_page_len: bool = True) -> dict:
    """``t - 1`` slots, one of them -1; or a page table (:func:`page_table`)."""
    if paged:
        return page_table(t, g, last_page_len)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: t - 1]
    slots[1] = -1
    return {"slot_mapping": slots}


def _placement(slot_mapping, rest: dict) -> dict:
    """The call's slot_mapping, or its page_table (the PAGE_TABLE entries of ``rest``, taken out of it)."""
    if slot_mapping is not None:
        return {"slot_mapping": slot_mapping}
    return {"page_table": rope_ext.PageTable(*(rest.pop(n, None) for n in PAGE_TABLE))}


def _cache_extra(layout="NHD", fp8=False, q_out=False, paged=False, last_page_len=True):
    """float32 caches (cast to fp8 in the graph where ``fp8``), ``t - 1`` slots, one of them -1 (or a page
    table of as many tokens, one of them not written)."""

    def extra(t):
        g = torch.Generator().manual_seed(t + 7)
        shape = (BLOCKS, BLOCK_SIZE, HK, D) if layout == "NHD" else (BLOCKS, HK, BLOCK_SIZE, D)
        out = {"key_cache": torch.randn(shape, generator=g), "value_cache": torch.randn(shape, generator=g)}
        out.update(_slots_or_table(t, g, paged, last_page_len))
        if fp8:
            out.update(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.01]))
        if q_out:
            out["q_out"] = torch.zeros(t, HQ, D)
        if q_out and fp8:
            out["q_scale"] = torch.tensor([0.02])
        return out

    return extra


def _cache(layout="NHD", fp8=False, **kw):
    def call(q, k, p, cs, key_cache, value_cache, slot_mapping=None, q_out=None, **scales):
        if fp8:  # the caches and q_out in fp8 (the model's inputs and outputs stay float32)
            key_cache, value_cache = key_cache.to(FP8), value_cache.to(FP8)
            q_out = None if q_out is None else q_out.to(FP8)
        v = k * 3 - 1
        where = _placement(slot_mapping, scales)
        rope_ext.apply_rotary_qk_and_cache_(
            q, k, v, p, cs, key_cache, value_cache, layout=layout, q_out=q_out, **where, **scales, **kw
        )
        written = (key_cache, value_cache) + (() if q_out is None else (q_out,))
        return (q, k) + tuple(t.float() for t in written)

    return call


def _mla_extra(fp8=False, q_out=False, paged=False):
    """An MLA cache [BLOCKS, BLOCK_SIZE, D + rd] of float32 (cast to fp8 in the graph where ``fp8``)."""

    def extra(t):
        g = torch.Generator().manual_seed(t + 11)
        out = {"kv_cache": torch.randn(BLOCKS, BLOCK_SIZE, D + 8, generator=g)}
        out.update(_slots_or_table(t, g, paged))
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

    def call(q, k, p, cs, kv_cache, slot_mapping=None, q_out=None, **scales):
        if fp8:
            kv_cache = kv_cache.to(FP8)
            q_out = None if q_out is None else q_out.to(FP8)
        k_pe, kv_c = k[:, 0, :8], k[:, 1]
        where = _placement(slot_mapping, scales)
        rope_ext.apply_mla_rotary_and_cache_(
            q, kv_c, k_pe, p, cs, kv_cache, rotary_offset=D - 8, q_out=q_out, **where, **scales, **kw
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

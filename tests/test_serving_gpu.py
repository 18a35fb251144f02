"""The serving ops on a GPU: CUDA-graph capture and replay with new positions and slot mappings (every serving
op, with position checks on and off), bitwise determinism, skipped out-of-range slots, and agreement with the
references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA

import rope_ext
from rope_ext import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]

T, HQ, HK, D, NB, BS = 48, 32, 8, 128, 64, 16


def _cache_inputs(cache_dtype=torch.bfloat16, layout="NHD"):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(T, HQ + 2 * HK, D, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (T,), device="cuda", generator=g)
    cs = rope_ext.RopeCache(D, 500000.0, max_positions=4096, device="cuda").cos_sin
    shape = (NB, BS, HK, D) if layout == "NHD" else (NB, HK, BS, D)
    kc = torch.randn(shape, device="cuda", generator=g).to(cache_dtype)
    vc = torch.randn(shape, device="cuda", generator=g).to(cache_dtype)
    slots = torch.randperm(NB * BS, device="cuda", generator=g)[:T]
    scale = torch.tensor([0.25], device="cuda")
    return qkv, pos, cs, kc, vc, slots, scale


def _split(qkv):
    return qkv[:, :HQ], qkv[:, HQ : HQ + HK], qkv[:, HQ + HK :]


def _check(qkv, qkv0, pos, cs, kc, vc, kc0, vc0, slots, scale, layout="NHD"):
    """q and k rotated (within an ulp of the float64 reference: one rounding of a float32 rotation), and
    the caches holding exactly the rotated k (as left in k) and v, as the reference stores them."""
    q, k, _ = _split(qkv)
    q0, k0, v0 = _split(qkv0)
    for got, x in ((q, q0), (k, k0)):
        want = reference.rotary_hadamard(x, pos[:, None], cs)
        err = (got.double() - want).abs().max().item()
        assert err <= torch.finfo(got.dtype).eps * want.abs().max().item()
    want_kc, want_vc = reference.kv_cache_write(
        k, v0, kc0, vc0, slots, layout=layout, k_scale=scale, v_scale=scale
    )
    assert torch.equal(kc.view(torch.uint8), want_kc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_vc.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_write_graph_replay_with_new_slots(cache_dtype, layout):
    qkv, pos, cs, kc, vc, slots, scale = _cache_inputs(cache_dtype, layout)
    qkv0, kc0, vc0 = qkv.clone(), kc.clone(), vc.clone()
    q, k, v = _split(qkv)
    kw = dict(layout=layout, k_scale=scale, v_scale=scale)
    rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots, **kw)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        qkv.copy_(qkv0)
        kc.copy_(kc0)
        vc.copy_(vc0)
        pos.copy_(torch.randint(0, 4096, (T,), device="cuda", generator=g))
        new = torch.randperm(NB * BS, device="cuda", generator=g)[:T]
        new[::7] = -1  # padding tokens: rotated, not written
        slots.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        _check(qkv, qkv0, pos, cs, kc, vc, kc0, vc0, slots, scale, layout)


def _page_table(slots: torch.Tensor) -> rope_ext.PageTable:
    """A page table (int32) placing token t at slots[t] (-1: batch index -1): requests of one page each."""
    i32, t = torch.int32, slots.shape[0]
    rows = (slots.clamp_min(0) % BS).to(i32)
    batch = torch.arange(t, dtype=i32, device="cuda").masked_fill(slots < 0, -1)
    indptr = torch.arange(t + 1, dtype=i32, device="cuda")
    return rope_ext.PageTable(batch, rows, (slots.clamp_min(0) // BS).to(i32), indptr, rows + 1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_page_table_graph_replay_with_new_tables(layout):
    """The page table is read by the kernel: a captured call replays with new tables copied into it."""
    qkv, pos, cs, kc, vc, slots, scale = _cache_inputs(torch.float8_e4m3fn, layout)
    qkv0, kc0, vc0 = qkv.clone(), kc.clone(), vc.clone()
    q, k, v = _split(qkv)
    table = _page_table(slots)
    kw = dict(layout=layout, k_scale=scale, v_scale=scale, page_table=table)
    rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, **kw)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        qkv.copy_(qkv0)
        kc.copy_(kc0)
        vc.copy_(vc0)
        new = torch.randperm(NB * BS, device="cuda", generator=g)[:T]
        new[::5] = -1
        for dst, src in zip(table, _page_table(new), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _check(qkv, qkv0, pos, cs, kc, vc, kc0, vc0, new, scale, layout)


def test_cache_write_deterministic_and_fp8_q_out():
    qkv, pos, cs, kc, vc, slots, scale = _cache_inputs(torch.float8_e4m3fn)
    runs = []
    for _ in range(2):
        x, a, b = qkv.clone(), kc.clone(), vc.clone()
        q, k, v = _split(x)
        q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device="cuda")
        rope_ext.apply_rotary_qk_and_cache_(
            q, k, v, pos, cs, a, b, slots, k_scale=scale, v_scale=scale, q_out=q8, q_scale=scale
        )
        runs.append((x, a, b, q8))
    for r0, r1 in zip(runs[0], runs[1], strict=True):
        assert torch.equal(r0.view(torch.uint8), r1.view(torch.uint8))
    x, _, _, q8 = runs[0]
    assert torch.equal(_split(x)[0], _split(qkv)[0])  # q read only
    rotated = reference.rotary_hadamard(_split(qkv)[0], pos[:, None], cs).to(qkv.dtype)
    want = reference.quantize_fp8(rotated, scale, q8.dtype)
    # the rotation rounded to bf16 may differ by an ulp from the reference's, then one fp8 step at most
    diff = (q8.float() - want.float()).abs()
    assert (diff <= 2**-3 * want.float().abs().clamp_min(2**-6) + 1e-12).all()


def test_out_of_range_slot_skipped_or_raises():
    qkv, pos, cs, kc, vc, slots, _ = _cache_inputs()
    slots[3] = NB * BS + 5
    kc0 = kc.clone()
    q, k, v = _split(qkv)
    rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots)
    torch.cuda.synchronize()
    written = torch.zeros(NB * BS, dtype=torch.bool, device="cuda")
    written[slots[slots < NB * BS]] = True
    assert torch.equal(kc.view(NB * BS, HK, D)[~written], kc0.view(NB * BS, HK, D)[~written])
    rope_ext.set_position_checks(True)
    try:
        with pytest.raises(IndexError, match="slot_mapping"):
            rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots)
    finally:
        rope_ext.set_position_checks(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80, 512])
def test_qk_norm_rotary_on_gpu(dtype, head_dim):
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    qkv = (torch.randn(T, (HQ + 2 * HK) * head_dim, device="cuda", generator=g) * 3).to(dtype)
    qw, kw = (torch.randn(head_dim, device="cuda", generator=g) for _ in range(2))
    pos = torch.randint(0, 4096, (T,), device="cuda", generator=g)
    cs = rope_ext.RopeCache(head_dim, max_positions=4096, device="cuda").cos_sin
    want = reference.qk_norm_rotary(qkv, HQ, HK, HK, qw, kw, pos, cs)
    out = qkv.clone()
    graph = torch.cuda.CUDAGraph()
    rope_ext.apply_qk_norm_rotary_(out, HQ, HK, HK, qw, kw, pos, cs)  # warm-up
    out.copy_(qkv)
    with torch.cuda.graph(graph):
        rope_ext.apply_qk_norm_rotary_(out, HQ, HK, HK, qw, kw, pos, cs)
    out.copy_(qkv)
    graph.replay()
    torch.cuda.synchronize()
    # two ulps of the dtype: the float32 norm may round one ulp away from the float64 reference's
    err = (out.double() - want.double()).abs().max().item()
    assert err <= 2 * torch.finfo(dtype).eps * want.double().abs().max().item()
    again = qkv.clone()
    rope_ext.apply_qk_norm_rotary_(again, HQ, HK, HK, qw, kw, pos, cs)
    assert torch.equal(again, out)  # deterministic (fixed-order warp sum)


# ---------------------------------------------------------------------------------------------------------
# Capture and replay of every serving op, position checks off and on (host checks are skipped while the
# stream captures): after new inputs (values, positions, slots) are copied into the captured tensors, a
# replay writes the bits an eager call on those inputs writes. ``make`` draws the tensors a call reads and
# writes; ``call`` runs the op on them and returns what it wrote (its outputs, or the tensors it updated).

P = 1024  # rows of the cos/sin tables


def _tables():
    caches = {d: rope_ext.RopeCache(d, 500000.0, max_positions=P, device="cuda") for d in (D, D // 2)}
    return {d: c.cos_sin for d, c in caches.items()} | {"freqs": caches[D].frequencies_on()}


def _make(g, cache_dtype=None, layout="NHD", q8=False, mla=False):
    t = dict(
        qkv=torch.randn(T, HQ + 2 * HK, D, device="cuda", generator=g).to(torch.bfloat16),
        pos=torch.randint(0, P, (T,), device="cuda", generator=g),
        qw=torch.randn(D, device="cuda", generator=g),
        kw=torch.randn(D, device="cuda", generator=g),
    )
    if cache_dtype is not None:
        shape = (NB, BS, HK, D) if layout == "NHD" else (NB, HK, BS, D)
        t["kc"], t["vc"] = (torch.randn(shape, device="cuda", generator=g).to(cache_dtype) for _ in "kv")
        slots = torch.randperm(NB * BS, device="cuda", generator=g)[:T]
        t["slots"] = torch.where(torch.rand(T, device="cuda", generator=g) < 0.2, -1, slots)  # padding
        t["scale"] = torch.rand(1, device="cuda", generator=g) + 0.25
    if q8:
        t["q8"] = torch.zeros(T, HQ, D, device="cuda").to(torch.float8_e5m2)
    if mla:  # an fp8 MLA latent cache [NB, BS, D + D // 2]
        t["mla"] = torch.randn(NB, BS, D + D // 2, device="cuda", generator=g).to(torch.float8_e4m3fn)
    return t


def _cache_bf16(t, cs):
    q, k, v = _split(t["qkv"])
    rope_ext.apply_rotary_qk_and_cache_(q, k, v, t["pos"], cs[D], t["kc"], t["vc"], t["slots"])
    return [t["qkv"], t["kc"], t["vc"]]


def _cache_fp8(t, cs):
    q, k, v = _split(t["qkv"])
    sc = t["scale"]
    rope_ext.apply_rotary_qk_and_cache_(
        q, k, v, t["pos"], cs[D // 2], t["kc"], t["vc"], t["slots"], layout="HND", interleaved=True,
        k_scale=sc, v_scale=sc, q_out=t["q8"], q_scale=sc, rotary_offset=D // 4,
    )  # fmt: skip
    return [t["qkv"], t["kc"], t["vc"], t["q8"]]


def _mla(t, cs):
    # q heads rotated at their last D // 2 features; kv_c and k_pe: one k and one v head of qkv
    q, k, v = _split(t["qkv"])
    rope_ext.apply_mla_rotary_and_cache_(
        q, v[:, 0], k[:, 0, : D // 2], t["pos"], cs[D // 2], t["mla"], t["slots"], rotary_offset=D // 2,
        interleaved=True, kv_scale=t["scale"],
    )  # fmt: skip
    return [t["qkv"], t["mla"]]


def _rerotate(t, cs):
    # the keys of the bf16 cache shifted by per-token deltas of both signs (positions, every other negated)
    sign = 1 - 2 * (torch.arange(T, device="cuda") % 2)
    rope_ext.rerotate_kv_cache_(t["kc"], t["slots"], t["pos"] * sign, cs[D])
    return [t["kc"]]


def _qk_norm(t, cs):
    q, k, _ = _split(t["qkv"])
    return list(rope_ext.apply_qk_norm_rotary(q, k, t["qw"], t["kw"], t["pos"], cs[D], eps=1e-5))


def _qk_norm_packed(t, cs):
    qkv = t["qkv"].flatten(1)
    rope_ext.apply_qk_norm_rotary_(qkv, HQ, HK, HK, t["qw"], t["kw"], t["pos"], cs[D // 2], interleaved=True)
    return [t["qkv"]]


def _rotary_qk(t, cs):
    q, k, _ = _split(t["qkv"])
    rope_ext.apply_rotary_qk_(q, k, t["pos"][:, None], cs[D // 2], rotary_offset=D // 2)
    return [t["qkv"]]


def _rotary_qk_table_free(t, cs):
    """Frequencies instead of the table: the rows' launch and its buffer inside the captured graph."""
    q, k, _ = _split(t["qkv"])
    rope_ext.apply_rotary_qk_(q, k, t["pos"][:, None] / 3.0, cs["freqs"])
    return [t["qkv"]]


CAPTURED = {  # op: (make's options, call)
    "cache-bf16": (dict(cache_dtype=torch.bfloat16), _cache_bf16),
    "cache-fp8": (dict(cache_dtype=torch.float8_e4m3fn, layout="HND", q8=True), _cache_fp8),
    "mla-fp8": (dict(cache_dtype=torch.bfloat16, mla=True), _mla),
    "rerotate": (dict(cache_dtype=torch.bfloat16), _rerotate),
    "qk-norm": ({}, _qk_norm),
    "qk-norm-packed": ({}, _qk_norm_packed),
    "rotary-qk-inplace": ({}, _rotary_qk),
    "rotary-qk-table-free": ({}, _rotary_qk_table_free),
}


@pytest.mark.parametrize("checks", [False, True], ids=["checks-off", "checks-on"])
@pytest.mark.parametrize("op", list(CAPTURED))
def test_graph_replay_equals_eager(op, checks):
    opts, call = CAPTURED[op]
    cs = _tables()

    def make(seed):
        return _make(torch.Generator(device="cuda").manual_seed(seed), **opts)

    static = make(0)
    rope_ext.set_position_checks(checks)
    try:
        call({n: t.clone() for n, t in static.items()}, cs)  # eager warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = call(static, cs)
        for seed in (1, 2):
            new = make(seed)
            for n, t in static.items():
                t.copy_(new[n])
            graph.replay()
            want = call({n: t.clone() for n, t in new.items()}, cs)
            torch.cuda.synchronize()
            for i, (got, w) in enumerate(zip(outs, want, strict=True)):
                same = torch.equal(got.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
                assert same, f"{op}: output {i} of the replay differs from eager"
        if checks:  # still checked outside capture
            bad = {n: t.clone() for n, t in static.items()}
            bad["pos"][3] = P
            with pytest.raises(IndexError, match="positions|delta"):
                call(bad, cs)
    finally:
        rope_ext.set_position_checks(False)

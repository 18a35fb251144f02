"""rerotate_kv_cache_ refusing bad calls before any write (every tensor keeps its bits), its position checks
on CUDA, opcheck, torch.compile and a hypothesis agreement draw. The matrix, accuracy and drift are in
test_rerotate.py."""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, NO_CUDA, NO_EMULATION, make_cos_sin
from _rerotate_helpers import (
    DTYPES,
    E4M3,
    E5M2,
    FP8,
    HAS_EMU,
    N_POS,
    OPS,
    VIEWS,
    bits,
    build,
    check,
    default_threads,
    dtype_id,
    emulated,
    one_thread,  # noqa: F401 - the autouse fixture: one thread for the references in this module
    run_checked,
    same_bits,
)
from _strategies import property_settings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.library import opcheck

import rope_ext


def _set(key, fn):
    """Replaces argument ``key`` with ``fn(a[key])`` (``fn`` a value: that value)."""
    return lambda a: a.update({key: fn(a[key]) if callable(fn) else fn})


def _at(key, i, value, dtype=None):
    """Element i of tensor argument ``key`` set to ``value`` (the tensor converted to ``dtype`` first)."""

    def change(a):
        t = a[key].clone() if dtype is None else a[key].to(dtype)
        t[i] = value
        a[key] = t

    return change


def _in_cache(key, n, dtype=None):
    """Argument ``key`` replaced by n elements (of ``dtype``) of the cache's own memory."""

    def change(a):
        cache = a["key_cache"]
        flat = cache.view(-1) if dtype is None else cache.view(dtype).view(-1)
        a[key] = flat[:n] if key != "cos_sin" else flat[: n * a["cos_sin"].shape[1]].view(n, -1)

    return change


def _f64_cache(a):
    a["key_cache"] = torch.randn(a["key_cache"].shape, dtype=torch.float64)
    a["cos_sin"] = a["cos_sin"].double()


def _dup(a):
    s = a["slot_mapping"].clone()
    s[4] = s[0]
    a["slot_mapping"] = s


VE, TE, IE = ValueError, TypeError, IndexError
N_SLOTS = 4 * 4  # the good call's cache: 4 blocks of 4 rows
# (id, change to a good call, exception, message). The good call: a float32 NHD cache [4, 4, 2, 32], T = 6,
# every slot named, one shift per token, a [32, 16] table at rotary_offset 8; fp8 entries ("-fp8") on an
# e4m3 cache with k_scale.
REJECTED = [
    ("slot-minus-2", _at("slot_mapping", 1, -2), IE, r"slot_mapping must hold -1 or slots in \[0, .*got -2"),
    ("slot-num-slots", _at("slot_mapping", 1, N_SLOTS), IE, f"slot_mapping must hold .*got {N_SLOTS}"),
    ("slot-int64-max", _at("slot_mapping", 1, 2**63 - 1), IE, f"slot_mapping must hold .*got {2**63 - 1}"),
    ("slot-int64-min", _at("slot_mapping", 1, -(2**63)), IE, f"slot_mapping must hold .*got {-(2**63)}"),
    ("slot-duplicate", _dup, VE, "slot_mapping holds slot .* twice"),
    ("delta-plus-P", _at("delta", 2, 32), IE, r"delta must be in \(-cos_sin.shape\[0\], .*got 32"),
    ("delta-minus-P", _at("delta", 2, -32), IE, "delta must be in .*got -32"),
    ("delta-int64-max", _at("delta", 2, 2**63 - 1), IE, f"delta must be in .*got {2**63 - 1}"),
    ("delta-int64-min", _at("delta", 2, -(2**63)), IE, f"delta must be in .*got {-(2**63)}"),
    ("delta-int32-min", _at("delta", 2, -(2**31), torch.int32), IE, f"delta must be in .*got {-(2**31)}"),
    ("delta-one-P", _set("delta", torch.tensor([32])), IE, "delta must be in .*got 32"),
    ("delta-int-P", _set("delta", 32), IE, "delta must be in .*got 32"),
    ("delta-int-minus-P", _set("delta", -32), IE, "delta must be in .*got -32"),
    ("delta-int-2**63", _set("delta", 2**63), IE, f"delta must be in .*got {2**63}"),
    ("delta-int-minus-2**63", _set("delta", -(2**63)), IE, f"delta must be in .*got {-(2**63)}"),
    ("delta-int-minus-2**63-1", _set("delta", -(2**63) - 1), IE, f"delta must be in .*got {-(2**63) - 1}"),
    ("offset-minus-1", _set("rotary_offset", -1), VE, r"rotary_offset must be in \[0, head_dim - rot"),
    ("offset-too-big", _set("rotary_offset", 17), VE, r"rotary_offset must be .* = \[0, 16\], got 17"),
    ("offset-int64-max", _set("rotary_offset", 2**63 - 1), VE, f"rotary_offset must be in .*got {2**63 - 1}"),
    ("offset-float", _set("rotary_offset", 8.0), TE, "rotary_offset must be an int"),
    ("cache-int8", _set("key_cache", lambda c: torch.zeros(c.shape, dtype=torch.int8)), TE,
     "key_cache must be a float or fp8 tensor"),
    ("delta-float", _set("delta", lambda d: d.float()), TE, "delta must be an int32 or int64 tensor"),
    ("delta-python-float", _set("delta", 1.0), TE, "delta must be a torch.Tensor, got float"),
    ("delta-bool", _set("delta", True), TE, "delta must be a torch.Tensor, got bool"),
    ("slots-int32", _set("slot_mapping", lambda s: s.int()), TE, "slot_mapping must be an int64 tensor"),
    ("cos_sin-f64", _set("cos_sin", lambda c: c.double()), TE,
     r"cos_sin must be float32 or the dtype of key_cache \(Float\), got Double"),
    ("k_scale-f64-fp8", _set("k_scale", torch.tensor([0.5]).double()), TE, "k_scale must be a float32"),
    ("k_scale-f64", _set("k_scale", torch.tensor([0.5]).double()), TE, "k_scale must be a float32"),
    ("k_scale-two-fp8", _set("k_scale", torch.tensor([0.5, 0.5])), VE, "k_scale must have one element"),
    ("k_scale-int-fp8", _set("k_scale", torch.tensor([2])), TE, "k_scale must be a float32"),
    ("cos_sin-f16-fp8", _set("cos_sin", lambda c: c.half()), TE, "cos_sin must be float32 or the dtype"),
    ("cos_sin-fp8-fp8", _set("cos_sin", lambda c: c.to(E4M3)), TE, "cos_sin must be float32 for an fp8 key"),
    ("cache-3d", _set("key_cache", lambda c: c[0]), VE, r"key_cache must be 4-d \[num_blocks, block_size"),
    ("cache-5d", _set("key_cache", lambda c: c[None]), VE, "key_cache must be 4-d"),
    ("slots-2d", _set("slot_mapping", lambda s: s[None]), VE, r"slot_mapping must be \[T\], got shape \[1,"),
    ("delta-short", _set("delta", lambda d: d[:5]), VE, r"delta must be \[T\] .*T = 6.*got shape \[5\]"),
    ("delta-2d", _set("delta", lambda d: d[None]), VE, r"delta must be \[T\] .*got shape \[1, 6\]"),
    ("delta-empty", _set("delta", lambda d: d[:0]), VE, r"delta must be \[T\] .*got shape \[0\]"),
    ("cache-expanded", _set("key_cache", lambda c: c[:1].expand_as(c)), VE,
     r"key_cache has elements that overlap in memory \(expanded"),
    ("cache-last-dim", _set("key_cache", lambda c: c.repeat(1, 1, 1, 2)[..., ::2]), VE,
     "key_cache must have a contiguous last dim"),
    ("cos_sin-in-cache", _in_cache("cos_sin", 32), VE, "key_cache and cos_sin overlap in memory"),
    ("slots-in-cache", lambda a: (_f64_cache(a), _in_cache("slot_mapping", 6, torch.int64)(a)), VE,
     "key_cache and slot_mapping overlap in memory"),
    ("delta-in-cache", lambda a: (_f64_cache(a), _in_cache("delta", 6, torch.int64)(a)), VE,
     "key_cache and delta overlap in memory"),
    ("k_scale-in-cache", _in_cache("k_scale", 1), VE, "key_cache and k_scale overlap in memory"),
    ("layout-lower", _set("layout", "nhd"), VE, "layout must be 'NHD' or 'HND', got 'nhd'"),
    ("layout-int", _set("layout", 1), TE, "layout must be 'NHD' or 'HND', got int"),
    ("cos_sin-odd", _set("cos_sin", lambda c: c[:, :15]), VE, r"rotary_dim \(cos_sin.shape\[-1\]\) must"),
    ("cos_sin-wide", _set("cos_sin", lambda c: torch.cat([c, c, c], 1)), VE, r"must be <= head_dim"),
    ("cos_sin-1d-float32", _set("cos_sin", lambda c: c[0]), TE, r"cos_sin of shape \[rotary_dim\] .*float64"),
    ("cos_sin-3d", _set("cos_sin", lambda c: c[None]), VE, r"cos_sin must have shape \[positions, rotary_d"),
    ("freqs-odd", _set("cos_sin", lambda c: c[0, :15].double()), VE, r"rotary_dim \(cos_sin.shape\[-1\]\)"),
    ("slots-list", _set("slot_mapping", lambda s: s.tolist()), TE, "slot_mapping must be a torch.Tensor"),
    ("cache-none", _set("key_cache", None), TE, "key_cache must be a torch.Tensor, got NoneType"),
    ("slots-none", _set("slot_mapping", None), TE, "slot_mapping must be a torch.Tensor, got NoneType"),
    ("delta-none", _set("delta", None), TE, "delta must be a torch.Tensor, got NoneType"),
    ("cos_sin-none", _set("cos_sin", None), TE, "cos_sin must be a torch.Tensor, got NoneType"),
]  # fmt: skip
# Checks of the API alone (Python types, and the CPU op's range checks, which the CUDA body replaces by
# skipping the token): not checks of the emulated op.
NO_EMU_CHECK = {r[0] for r in REJECTED if r[2] is IE} | {
    "offset-float", "delta-python-float", "delta-bool", "layout-int", "slots-list", "slot-duplicate",
    "cache-none", "slots-none", "delta-none", "cos_sin-none",
}  # fmt: skip


def _good_call(fp8: bool) -> dict:
    g = torch.Generator().manual_seed(11)
    dtype = E4M3 if fp8 else torch.float32
    cache = (torch.randn(4, 4, 2, 32, generator=g) * 3).to(dtype)
    return dict(
        key_cache=cache, slot_mapping=torch.randperm(N_SLOTS, generator=g)[:6],
        delta=torch.tensor([3, -5, 0, 31, -31, 1]), cos_sin=make_cos_sin(32, 16), layout="NHD",
        interleaved=fp8, k_scale=torch.tensor([0.5]) if fp8 else None, rotary_offset=8,
    )  # fmt: skip


REJECTED_CALLS = [
    pytest.param(*r, path, id=f"{r[0]}-{path}")
    for path in ("api", "emulated")
    for r in REJECTED
    if path == "api" or r[0] not in NO_EMU_CHECK
]


@pytest.mark.parametrize("name,change,exc,match,path", REJECTED_CALLS)
def test_rejected_call_writes_nothing(name, change, exc, match, path):
    """Each bad call raises the right exception, naming the argument, before anything is written: the cache
    (and every other tensor) keeps its bits. The emulated op raises ValueError for the API's TypeError."""
    a = _good_call(fp8=name.endswith("-fp8"))
    change(a)
    if path == "emulated":
        if not HAS_EMU:
            pytest.skip(NO_EMULATION)
        exc = ValueError if exc is TypeError else exc
    before = {n: (t, t.clone()) for n, t in a.items() if isinstance(t, torch.Tensor)}
    if isinstance(a["key_cache"], torch.Tensor) and a["key_cache"]._base is not None:
        base = a["key_cache"]._base
        before["cache base"] = (base, base.clone())
    with pytest.raises(exc, match=match):
        with default_threads():
            rope_ext.rerotate_kv_cache_(**a) if path == "api" else emulated(a, 132, False)
    for n, (t, t0) in before.items():
        assert torch.equal(bits(t), bits(t0)), f"{n} changed by a rejected call"


def test_requires_grad_raises_and_writes_nothing():
    a = _good_call(fp8=False)
    a["key_cache"].requires_grad_(True)
    before = a["key_cache"].detach().clone()
    with pytest.raises(RuntimeError, match="key_cache requires grad.*no_grad"):
        rope_ext.rerotate_kv_cache_(**a)
    assert torch.equal(bits(a["key_cache"].detach()), bits(before))
    with torch.no_grad():  # the same call is fine without grad mode
        rope_ext.rerotate_kv_cache_(**a)
    assert not torch.equal(a["key_cache"].detach(), before)


def test_position_checks_on_cuda():
    """With rope_ext.set_position_checks(True), eager CUDA calls raise as the CPU op does, nothing written."""
    if not HAS_CUDA:
        pytest.skip(NO_CUDA)
    cases = [(_at("slot_mapping", 1, N_SLOTS), IE), (_at("delta", 2, -32), IE), (_dup, VE)]
    rope_ext.set_position_checks(True)
    try:
        for change, exc in cases:
            a = _good_call(fp8=False)
            change(a)
            a = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in a.items()}
            before = a["key_cache"].clone()
            with pytest.raises(exc):
                rope_ext.rerotate_kv_cache_(**a)
            assert torch.equal(a["key_cache"], before)
    finally:
        rope_ext.set_position_checks(False)


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile.


def test_opcheck():
    # test_schema compares mutated arguments with torch.allclose, which has no fp8 kernel: fp8 calls skip it.
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for dtype, kw in (
        (torch.bfloat16, dict(interleaved=True, R=32, offset=64)),
        (torch.float32, dict(layout="HND", delta="one", delta_dtype=torch.int32, slots="mixed")),
        (torch.float64, dict(cs_dtype=torch.float64, block_size=1)),
        (E4M3, dict(layout="HND", R=64, offset=32, slots="mixed")),
        (E5M2, dict(interleaved=True, scale=None, delta="one")),
    ):
        c = build(
            dtype, **{"T": 5, "Hk": 2, "D": 128, "block_size": 4, "specials": False, "slots": "all", **kw}
        )
        args = (c.key_cache, c.slot_mapping, c.delta, c.cos_sin, c.k_scale, c.interleaved, c.layout,
                c.rotary_offset)  # fmt: skip
        utils = no_schema if dtype in FP8 else ("test_schema", *no_schema)
        opcheck(OPS.rerotate_kv_cache_.default, args, test_utils=utils)


def _compiled_body(cache, base, slots, delta, cos_sin, k_scale):
    """A cache view given as an argument (HND, interleaved, offset, per-token shifts), then a view made in
    the graph (NHD, a Python int shift), then a read of the first cache after the in-place ops."""
    kw = dict(k_scale=k_scale, rotary_offset=16)
    rope_ext.rerotate_kv_cache_(cache, slots, delta, cos_sin, layout="HND", interleaved=True, **kw)
    rope_ext.rerotate_kv_cache_(base.narrow(0, 1, base.shape[0] - 3), slots, -7, cos_sin, **kw)
    return cache.float() * 2


def _compile_inputs(dtype, T):
    """The arguments of _compiled_body and the two cases they come from (the second: its NHD call)."""
    kw = dict(T=T, D=64, R=32, offset=16, block_size=4, seed=T)
    hnd = build(dtype, layout="HND", view="heads", interleaved=True, delta_dtype=torch.int32, **kw)
    nhd = build(dtype, layout="NHD", view="blocks", **kw)  # a view of blocks 1 .. nb of its base
    nhd.slot_mapping, nhd.delta = hnd.slot_mapping, -7
    return [hnd.key_cache, nhd.base, hnd.slot_mapping, hnd.delta, hnd.cos_sin, hnd.k_scale], hnd, nhd


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=dtype_id)
def test_compile_fullgraph_matches_eager(dtype, backend, dynamic):
    """torch.compile(fullgraph=True) writes what eager writes, bit for bit, on cache views (passed in, and
    made in the graph; the guards around them kept) and returns the same read of the cache after it;
    dynamic=True runs two token counts through one graph."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_body, fullgraph=True, backend=backend, dynamic=dynamic)
    for T in (9, 21) if dynamic else (7,):  # no size of one run equal to another by chance
        args, hnd, nhd = _compile_inputs(dtype, T)
        snapshots = hnd.snapshot(), nhd.snapshot()
        args2, hnd2, nhd2 = _compile_inputs(dtype, T)
        got, want = compiled(*args), _compiled_body(*args2)
        assert same_bits(got, want), "compiled and eager read different caches"
        assert same_bits(hnd.base, hnd2.base) and same_bits(nhd.base, nhd2.base), "compiled and eager differ"
        check(hnd, snapshots[0])  # and both are the definition
        check(nhd, snapshots[1])
    assert counters["stats"]["unique_graphs"] == 1, "recompiled"


# ---------------------------------------------------------------------------------------------------------
# Property test: random shapes, dtypes, shifts, slots and views against the definition.


@st.composite
def rerotate_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    D = 2 * draw(st.one_of(st.integers(1, 12), st.integers(1, 128)))
    R = 2 * draw(st.integers(1, D // 2))
    same_table = dtype not in FP8 and dtype != torch.float32 and draw(st.booleans())
    kw = dict(
        D=D, R=R, offset=draw(st.sampled_from([0, D - R, (D - R) // 2])), Hk=draw(st.integers(1, 4)),
        block_size=draw(st.sampled_from([1, 3, 16])), layout=draw(st.sampled_from(["NHD", "HND"])),
        interleaved=draw(st.booleans()), T=draw(st.integers(0, 24)),
        slots=draw(st.sampled_from(["all", "mixed", "none"])),
        delta=draw(st.sampled_from(["tokens", "one", "0d", "int"])),
        delta_dtype=draw(st.sampled_from([torch.int32, torch.int64])), view=draw(st.sampled_from(VIEWS)),
        cs_dtype=dtype if same_table else torch.float32, scale=draw(st.sampled_from([None, 0.37, 3.0])),
        n_pos=draw(st.sampled_from([2, 7, N_POS])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip
    kw["T"] = min(kw["T"], 4000 // (kw["Hk"] * D))  # keeps a draw to a few milliseconds
    return dtype, kw


@property_settings(ci=300)
@given(drawn=rerotate_cases())
def test_property_matches_definition(drawn):
    """Random dtype, head_dim, rotary_dim and offset, heads, block size, layout, pairing, T, slot pattern,
    shift kind and dtype, cache view, table dtype and length, k_scale: the CPU op writes the definition."""
    dtype, kw = drawn
    run_checked(build(dtype, **kw), "cpu")

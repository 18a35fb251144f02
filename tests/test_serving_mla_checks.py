"""apply_mla_rotary_and_cache_ refusing bad calls before any write (every tensor keeps its bits), the
float64 reference's own checks, opcheck, torch.compile and a hypothesis agreement draw. The matrix is in
test_serving_mla.py."""

from __future__ import annotations

import pytest
import torch
from _helpers import NO_EMULATION
from _serving_cache_helpers import (
    _one_thread,  # noqa: F401 - the autouse fixture: one thread in this module
    same_bits,
)
from _serving_mla_helpers import (
    FP8,
    HAS_EMU,
    N_POS,
    OPS,
    build,
    check,
    emulated,
    run_checked,
)
from _strategies import property_settings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.library import opcheck

import rope_ext
from rope_ext import reference

E4M3, E5M2 = FP8
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DSV3 = dict(H=4, nope=128, R=64, L=512)  # DeepSeek-V3 / Kimi-K2's MLA sizes, few heads

# ---------------------------------------------------------------------------------------------------------
# Rejected calls: the right exception naming the argument, and nothing written.


def _set(key, fn, src=None):
    """Replaces argument ``key`` with ``fn(a[src or key])`` (``fn`` a value: that value)."""
    return lambda a: a.update({key: fn(a[src or key]) if callable(fn) else fn})


def _slot(i, value):
    """slot_mapping[i] = value ("twice": token 0's slot)."""

    def change(a):
        s = a["slot_mapping"]
        s[i] = s[0] if value == "twice" else value

    return change


def _n_slots(a):
    a["slot_mapping"][2] = a["kv_cache"].shape[0] * a["kv_cache"].shape[1]


def _cache_holds(name):
    """kv_c or k_pe a view of the cache's rows (a cache of q's dtype)."""

    def change(a):
        L = a["kv_c"].shape[-1]
        a["kv_cache"] = torch.zeros(a["kv_cache"].shape, dtype=a["q"].dtype)
        rows = a["kv_cache"].view(-1, a["kv_cache"].shape[-1])[: a["q"].shape[0]]
        a[name] = rows[:, :L] if name == "kv_c" else rows[:, L:]

    return change


def _k_pe_narrow(a):
    """k_pe two features short, the cache fitting kv_c and that k_pe."""
    a["k_pe"] = a["k_pe"][:, :-2]
    a["kv_cache"] = a["kv_cache"][..., :-2]


def _q_out_holds_k_pe(a):
    a["q_out"] = torch.zeros_like(a["q"])
    a["k_pe"] = a["q_out"][:, 0, : a["k_pe"].shape[-1]]


def _fp8_q_out(scale):
    return lambda a: a.update(q_out=torch.zeros(a["q"].shape, dtype=E4M3), q_scale=scale)


VE, TE, IE = ValueError, TypeError, IndexError
OFFSET = "rotary_offset must be in"
SLOT = "slot_mapping must hold -1 or slots in"
# (id, change to a good call, exception of the API, message). The emulated op raises ValueError for the
# API's TypeError; it has no check of positions or slots against the table and cache (NO_EMU_CHECK), and
# arguments of the wrong Python type fail in its argument parsing.
REJECTED = [
    ("offset-minus-1", _set("rotary_offset", -1), VE, OFFSET),
    ("offset-2^31", _set("rotary_offset", 2**31), VE, OFFSET),
    ("offset-2^63-1", _set("rotary_offset", 2**63 - 1), VE, OFFSET),
    ("offset-past-D", _set("rotary_offset", 17), VE, OFFSET),  # D = 24, R = 8
    ("offset-float", _set("rotary_offset", 16.0), TE, "rotary_offset must be an int"),
    ("slot-2^63-1", _slot(1, 2**63 - 1), IE, SLOT),
    ("slot-minus-2", _slot(4, -2), IE, SLOT),
    ("slot-n_slots", _n_slots, IE, SLOT),
    ("slot-twice", _slot(3, "twice"), VE, "slot_mapping holds slot .* twice"),
    ("kv_c-f16", _set("kv_c", lambda x: x.half()), TE, "kv_c must have the dtype of q"),
    ("k_pe-f64", _set("k_pe", lambda x: x.double()), TE, "k_pe must have the dtype of q"),
    ("kv_cache-int8", _set("kv_cache", lambda c: c.view(torch.int8)), TE, "kv_cache must have the dtype"),
    ("kv_cache-f16", _set("kv_cache", lambda c: c.half()), TE, "kv_cache must have the dtype of q"),
    ("slots-int32", _set("slot_mapping", lambda s: s.int()), TE, "slot_mapping must be an int64 tensor"),
    ("positions-float", _set("positions", lambda p: p.float()), TE, "positions must be an int32 or int64"),
    ("q-2d", _set("q", lambda q: q[:, 0]), VE, r"q must be \[T, H, D\]"),
    ("kv_c-3d", _set("kv_c", lambda x: x[:, None]), VE, r"kv_c must be \[T, kv_lora_rank\]"),
    ("k_pe-T-2-R", _set("k_pe", lambda x: torch.stack([x, x], 1)), VE, r"k_pe must be \[T, rotary_dim\] or"),
    ("k_pe-R-2", _k_pe_narrow, VE, r"k_pe\.shape\[-1\] must be rotary_dim \(cos_sin\.shape\[-1\] = 8\)"),
    ("k_pe-R-2-cache-R", _set("k_pe", lambda x: x[:, :-2]), VE, r"k_pe\.shape\[-1\]"),
    ("kv_cache-L+R-2", _set("kv_cache", lambda c: c[..., :-2]), VE, r"kv_cache\.shape\[-1\] must be kv_lora"),
    ("kv_cache-4d", _set("kv_cache", lambda c: c[:, :, None]), VE, r"kv_cache must be \[num_blocks, block"),
    ("kv_cache-2d", _set("kv_cache", lambda c: c[0]), VE, r"kv_cache must be \[num_blocks, block"),
    ("kv_c-tokens", _set("kv_c", lambda x: x[1:]), VE, "q, kv_c and k_pe must have the same tokens"),
    ("k_pe-tokens", _set("k_pe", lambda x: x[:-1]), VE, "q, kv_c and k_pe must have the same tokens"),
    ("slots-long", _set("slot_mapping", torch.arange(7)), VE, r"slot_mapping must be \[T'\] with T' <= T"),
    ("slots-strided", _set("slot_mapping", torch.arange(12)[::2]), VE, "slot_mapping must be contiguous"),
    ("q_out-is-q", _set("q_out", lambda q: q, "q"), VE, "q_out and q overlap"),
    ("kv_cache-holds-kv_c", _cache_holds("kv_c"), VE, "kv_cache and kv_c overlap"),
    ("kv_cache-holds-k_pe", _cache_holds("k_pe"), VE, "kv_cache and k_pe overlap"),
    ("k_pe-in-q", _set("k_pe", lambda q: q[:, 1, 16:], "q"), VE, "q and k_pe overlap"),
    ("k_pe-in-kv_c", _set("k_pe", lambda x: x[:, :8], "kv_c"), VE, "k_pe and kv_c overlap"),
    ("q_out-holds-k_pe", _q_out_holds_k_pe, VE, "q_out and k_pe overlap"),
    ("q-expanded", _set("q", lambda q: q[:1].expand(q.shape)), VE, "q has elements that overlap"),
    ("k_pe-expanded", _set("k_pe", lambda x: x[:1].expand(x.shape)), VE, "k_pe has elements that overlap"),
    ("kv_cache-expanded", _set("kv_cache", lambda c: c[:1].expand_as(c)), VE, "kv_cache has elements that"),
    ("kv_c-last-dim", _set("kv_c", lambda x: x.t().contiguous().t()), VE, "kv_c must have a contiguous last"),
    ("positions-past-table", _set("positions", lambda p: p + N_POS), IE, r"positions must be in \[0, "),
    ("positions-negative", _set("positions", lambda p: p - N_POS), IE, r"positions must be in \[0, "),
    ("positions-short", _set("positions", lambda p: p[:3]), VE, r"positions of shape \[3\] must be"),
    ("kv_scale-f64", _set("kv_scale", torch.tensor([0.5]).double()), TE, "kv_scale must be a float32"),
    ("kv_scale-2", _set("kv_scale", torch.tensor([0.5, 0.5])), VE, "kv_scale must have one element"),
    ("q_scale-2", _fp8_q_out(torch.ones(2)), VE, "q_scale must have one element"),
    ("q_scale-f16", _fp8_q_out(torch.ones(1, dtype=torch.float16)), TE, "q_scale must be a float32"),
    ("q_out-shape", _set("q_out", lambda q: q[..., :8].clone(), "q"), VE, "q_out must have the shape of q"),
    ("q_out-dtype", _set("q_out", lambda q: q.half(), "q"), TE, "q_out must have the dtype of q"),
    ("cos_sin-odd", _set("cos_sin", lambda c: c[:, :7]), VE, r"rotary_dim \(cos_sin.shape\[-1\]\) must be"),
] + [
    (f"{n}-None", _set(n, None), TE, rf"(^|\W){n} must be a")
    for n in ("q", "kv_c", "k_pe", "positions", "cos_sin", "kv_cache", "slot_mapping")
]  # fmt: skip
NO_EMU_CHECK = {"offset-float", "slot-2^63-1", "slot-minus-2", "slot-n_slots", "slot-twice"}
NO_EMU_CHECK |= {"positions-past-table", "positions-negative"}


def _good_call() -> dict:
    """float32, T = 6, H = 2, D = 16 nope + 8 rope, L = 32, an e4m3 cache of 20 slots, every token written."""
    kw = dict(T=6, H=2, nope=16, R=8, L=32, block_size=4, cache_dtype=E4M3, slots="all", packed=True)
    return build(torch.float32, **kw).args()


@pytest.mark.parametrize("path", ["api", "emulated"])
@pytest.mark.parametrize("name,change,exc,match", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_call_writes_nothing(name, change, exc, match, path):
    """Each bad call raises the right exception, naming the argument, before anything is written."""
    a = _good_call()
    change(a)
    if path == "emulated":
        if not HAS_EMU:
            pytest.skip(NO_EMULATION)
        if name in NO_EMU_CHECK:
            pytest.skip("not a check of the emulated op (Python-level, or skipped there by design)")
        exc = ValueError if exc is TypeError else exc
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc, match=match):
        rope_ext.apply_mla_rotary_and_cache_(**a) if path == "api" else emulated(a, 132, False)
    for n, t in before.items():
        assert same_bits(a[n], t), f"{n} changed by a rejected call"


def test_duplicate_slot_is_a_data_race_on_emulation():
    """The CUDA op does not check slots (position checks off): two tokens writing one row race, which the
    emulation reports (the API refuses the call on the CPU: test_rejected_call_writes_nothing)."""
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    a = _good_call()
    _slot(3, "twice")(a)
    with pytest.raises(RuntimeError, match="data race"):
        emulated(a, 132, False)


@pytest.mark.parametrize("name", ["q", "kv_c", "k_pe", "kv_cache", "q_out"])
def test_requires_grad_raises_and_writes_nothing(name):
    a = _good_call()
    a["kv_cache"] = torch.zeros(a["kv_cache"].shape)  # a float cache can require grad
    a["q_out"] = torch.zeros_like(a["q"])
    if name in ("kv_c", "k_pe"):
        a[name] = a[name].clone()
    a[name].requires_grad_(True)
    before = {n: t.detach().clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(RuntimeError, match=f"{name} requires grad.*no_grad"):
        rope_ext.apply_mla_rotary_and_cache_(**a)
    for n, t in before.items():
        assert same_bits(a[n].detach(), t), n
    with torch.no_grad():  # the same call is fine without grad mode
        rope_ext.apply_mla_rotary_and_cache_(**a)
    want = reference.mla_cache_write(**{**before, "rotary_offset": 16, "interleaved": False, "q_scale": None})
    assert not same_bits(a["kv_cache"].detach(), before["kv_cache"]), "the call under no_grad wrote nothing"
    assert torch.allclose(a["q_out"].detach().double(), want[0], rtol=0, atol=1e-5)


def test_reference_leaves_its_inputs_and_refuses_bad_slots():
    """reference.mla_cache_write returns new tensors, and raises ValueError for slots it cannot place."""
    c = build(torch.bfloat16, cache_dtype=E4M3, q_out=E5M2, slots="all", packed=True)
    s = c.snapshot()
    q, k_pe, cache = reference.mla_cache_write(**c.args())
    assert q.dtype == E5M2 and k_pe.dtype == torch.float64 and cache.dtype == E4M3
    for name, before in s.items():
        assert same_bits(getattr(c, name), before), f"the reference changed {name}"
    for bad in (-2, c.kv_cache.shape[0] * c.kv_cache.shape[1], int(c.slot_mapping[0])):
        a = c.args()
        a["slot_mapping"] = c.slot_mapping.clone()
        a["slot_mapping"][2] = bad
        with pytest.raises(ValueError, match="slot"):
            reference.mla_cache_write(**a)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_reference_agrees_with_the_matrix_form(interleaved):
    """The reference's rotations against reference.rotary_matrix (another form of the map), and its cache
    rows against the rounded rotation and kv_c as they are, row by row."""
    c = build(torch.float32, interleaved=interleaved, nope=16, R=16, extra=8, slots="mixed", kv_scale=None)
    q, k_pe, cache = reference.mla_cache_write(**c.args())
    pos = c.positions[:, None]
    kw = dict(interleaved=interleaved)
    torch.testing.assert_close(q, reference.rotary_matrix(c.q, pos, c.cos_sin, rotary_offset=16, **kw))
    torch.testing.assert_close(k_pe, reference.rotary_matrix(c.k_pe[:, None], pos, c.cos_sin, **kw)[:, 0])
    rows = cache.reshape(-1, c.lora + c.rotary_dim)
    for t, slot in enumerate(c.slot_mapping.tolist()):
        if slot >= 0:
            assert same_bits(rows[slot], torch.cat([c.kv_c[t], k_pe[t].float()])), t
    written = set(c.slot_mapping.tolist()) - {-1}
    kept = [i for i in range(rows.shape[0]) if i not in written]
    assert same_bits(rows[kept], c.kv_cache.reshape(-1, rows.shape[-1])[kept])


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile.


def test_opcheck():
    # test_schema compares mutated arguments with torch.allclose, which has no fp8 kernel: fp8 calls skip it.
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for dtype, kw in (
        (torch.float16, dict(interleaved=True, nope=16, R=16, extra=8)),
        (torch.float32, dict(q_out="same", kpe="3d", packed=True, slots="short")),
        (torch.bfloat16, dict(cache_dtype=E4M3, q_out=E5M2, cache_view="blocks")),
        (torch.float32, dict(cache_dtype=E5M2, packed=True, cache_view="cols", T=2, kv_scale=None)),
    ):
        c = build(dtype, **{"T": 5, "H": 2, "block_size": 4, **kw})
        a = c.args()
        args = [a[n] for n in ("q", "kv_c", "k_pe", "positions", "cos_sin", "kv_cache", "slot_mapping")]
        args += [a[n] for n in ("kv_scale", "q_out", "q_scale", "interleaved", "rotary_offset")]
        fp8 = "cache_dtype" in kw or kw.get("q_out") in FP8
        opcheck(
            OPS.mla_rotary_cache_.default,
            tuple(args),
            test_utils=no_schema if fp8 else ("test_schema", *no_schema),
        )


T_C, H_C, NOPE_C, R_C, L_C, LAYER = 9, 2, 32, 16, 64, 1  # the compiled calls' sizes
D_C = NOPE_C + R_C


def _compiled_body(separate: list, packed: list):
    """(a) separate q, kv_c, k_pe (a narrow()-view fp8 cache with kv_scale, fp8 q_out, interleaved); (b)
    DeepSeek's layout: q a view of the q projection, kv_c / k_pe of the kv_a projection, split here, and the
    layer's cache a view of the all-layer cache (vLLM's kv_cache[layer]), taken here."""
    q, kv_c, k_pe, pos, cs, cache, slots, kv_scale, q_out, q_scale = separate
    kw = dict(rotary_offset=NOPE_C, interleaved=True, kv_scale=kv_scale, q_out=q_out, q_scale=q_scale)
    rope_ext.apply_mla_rotary_and_cache_(q, kv_c, k_pe, pos, cs, cache, slots, **kw)
    q_proj, kv_a, pos, cs, caches, slots = packed
    q2 = q_proj.view(q_proj.shape[0], H_C, D_C)
    kv_c2, k_pe2 = kv_a.split([L_C, R_C], dim=-1)
    k_pe2 = k_pe2.unsqueeze(1)
    rope_ext.apply_mla_rotary_and_cache_(
        q2, kv_c2, k_pe2, pos, cs, caches[LAYER], slots, rotary_offset=NOPE_C
    )
    return k_pe2 * 2  # read after the in-place op (exact: no reduction order to differ)


def _compile_inputs(T: int):
    sizes = dict(T=T, H=H_C, nope=NOPE_C, R=R_C, L=L_C, seed=T)
    a = build(torch.float16, cache_dtype=E4M3, q_out=E5M2, interleaved=True, cache_view="blocks", **sizes)
    b = build(torch.bfloat16, packed=True, q_layout="contiguous", **sizes)
    others = build(torch.bfloat16, **dict(sizes, seed=T + 1)).cache_base  # the other layers' (guards)
    b.cache_base = torch.stack([others, b.cache_base, others.flip(0)])  # [layers, blocks, block_size, L + R]
    b.kv_cache = b.cache_base[LAYER]
    sep = [a.q, a.kv_c, a.k_pe, a.positions, a.cos_sin, a.kv_cache, a.slot_mapping, a.kv_scale, a.q_out]
    sep += [a.q_scale]
    packed = [b.q.view(T, -1), b.proj, b.positions, b.cos_sin, b.cache_base, b.slot_mapping]
    return a, b, sep, packed


@pytest.mark.parametrize(
    "backend,dynamic", [("aot_eager", False), ("aot_eager", True), ("inductor", False)], ids=str
)
def test_compile_fullgraph_matches_eager(backend, dynamic):
    """torch.compile(fullgraph=True) writes what eager writes, bit for bit, and what the references say;
    dynamic=True runs two token counts through one graph."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_body, fullgraph=True, dynamic=dynamic, backend=backend)
    for T in (T_C, 21) if dynamic else (T_C,):
        a, b, sep, packed = _compile_inputs(T)
        snaps = a.snapshot(), b.snapshot()
        sep2, packed2 = ([t.clone() for t in ts] for ts in (sep, packed))
        got, want = compiled(sep, packed), _compiled_body(sep2, packed2)
        for x, y in zip([got, *sep, *packed], [want, *sep2, *packed2], strict=True):
            assert same_bits(x, y), "compiled and eager differ"
        check(a, snaps[0])
        check(b, snaps[1])
    assert counters["stats"]["unique_graphs"] == 1, "recompiled"


def test_compile_decode_one_token():
    """A decode step of one token (positions [1], as eager takes them) compiles with fullgraph=True and writes
    what eager writes (the fake kernel must accept what the op accepts)."""
    torch._dynamo.reset()
    compiled = torch.compile(_compiled_body, fullgraph=True, backend="aot_eager")
    a, b, sep, packed = _compile_inputs(1)
    snaps = a.snapshot(), b.snapshot()
    sep2, packed2 = ([t.clone() for t in ts] for ts in (sep, packed))
    got, want = compiled(sep, packed), _compiled_body(sep2, packed2)
    for x, y in zip([got, *sep, *packed], [want, *sep2, *packed2], strict=True):
        assert same_bits(x, y), "compiled and eager differ"
    check(a, snaps[0])
    check(b, snaps[1])


# ---------------------------------------------------------------------------------------------------------
# Property test: random shapes, caches, q_out, views and slot patterns, the CPU op and the emulated body.


@st.composite
def mla_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    R = 2 * draw(st.integers(1, 40))
    kw = dict(
        T=draw(st.integers(0, 40)), H=draw(st.integers(1, 8)), R=R,
        nope=draw(st.sampled_from([0, 0, 8, 16, 128, draw(st.integers(0, 40))])),
        extra=draw(st.sampled_from([0, 0, 0, 8, draw(st.integers(1, 9))])),
        L=draw(st.sampled_from([512, 64, 32, draw(st.integers(1, 160))])),
        interleaved=draw(st.booleans()), block_size=draw(st.sampled_from([1, 3, 16, 64])),
        cache_dtype=draw(st.sampled_from([None, None, E4M3, E5M2])),
        q_out=draw(st.sampled_from([None, None, "same", E4M3, E5M2])),
        slots=draw(st.sampled_from(["all", "mixed", "short", "none"])),
        packed=draw(st.booleans()), kpe=draw(st.sampled_from(["2d", "3d"])),
        q_layout=draw(st.sampled_from(["head-major", "padded", "contiguous"])),
        cache_view=draw(st.sampled_from([None, "blocks", "rows", "cols"])),
        kv_scale=draw(st.sampled_from([None, 0.37, 4.0])), q_scale=draw(st.sampled_from([None, 0.61])),
        scale=draw(st.sampled_from([1.0, 0.01, 300.0])), seed=draw(st.integers(0, 2**31 - 1)),
        pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])), strided_tables=draw(st.booleans()),
        q_out_view=draw(st.booleans()),
    )  # fmt: skip
    per_token = kw["H"] * (kw["nope"] + R + kw["extra"]) + kw["L"] + R
    kw["T"] = min(kw["T"], 12000 // per_token)  # keeps a draw to a few milliseconds
    return dict(kw, dtype=dtype), draw(st.sampled_from([1, 4, 132])), draw(st.booleans())


@property_settings()  # the existing ops' draws: 500 (more under the 'long' profile)
@given(drawn=mla_cases())
def test_property_matches_reference(drawn):
    """Random dtype, pairing, heads, nope / rope / extra features, kv_lora_rank, T, block size, cache dtype
    and view, q_out, scales, layouts and slot pattern; the CPU op and the emulated body (drawn grid and path)
    against the references, and the emulated body against the CPU op's bits."""
    kw, num_sms, force_scalar = drawn
    run_checked(kw, "cpu")
    if HAS_EMU:
        run_checked(kw, (num_sms, force_scalar))

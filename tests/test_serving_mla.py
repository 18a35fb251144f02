"""apply_mla_rotary_and_cache_ (RoPE + MLA latent-cache write, DeepSeek-V2/V3) against float64 references.

Held to the standards of the GQA cache op's tests (test_serving_cache.py): each call runs on the CPU op (the
public API), on the CUDA kernel body run on the host (``_cuda_emulated_mla``, vector and scalar path, several
grid shapes) and, with a GPU, on the CUDA op. q and k_pe must agree with ``reference.mla_cache_write`` at
the project tolerance (pass-through features bit-exact); the latent cache must equal, bit for bit, a
pure-PyTorch model that index_puts ``cat(kv_c, rotated k_pe as written to k_pe)`` into a clone of the
guard-filled cache (``reference.quantize_fp8`` for fp8 caches); every backend must give the CPU op's bits.
The op is also the GQA cache op on views (``as_gqa``), bit for bit; it gives one result on every CPU
instruction set; bad calls raise, naming the argument, before anything is written; opcheck and
torch.compile; a property test over random shapes and options.

The cases, backends and checks live in ``_serving_mla_helpers.py``.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import NO_EMULATION
from _serving_cache_helpers import (
    EMU_BACKENDS,
    MATRIX,
    _one_thread,  # noqa: F401 - the autouse fixture: one thread in this module
    same_bits,
)
from _serving_cache_helpers import emulated as gqa_emulated
from _serving_mla_helpers import (
    BACKENDS,
    FP8,
    HAS_EMU,
    N_POS,
    OPS,
    as_gqa,
    build,
    check,
    emulated,
    outputs,
    run,
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
ISAS = [i for i in ("scalar", "avx2", "avx512", "avx512_bf16", "neon") if OPS._cpu_isa_supported(i)]

# ---------------------------------------------------------------------------------------------------------
# The matrix: dtypes x pairings x shapes / views / caches / q_out x backends.

# (build kwargs, whether the emulated body takes the 16-byte path: True / False on every dtype and pairing,
# None where it depends on them, e.g. R = 8 half-split in a 16-bit dtype has 4 pairs, not a whole vector).
CONFIGS = {
    "dsv3-bs16-packed-kpe3d": (dict(DSV3, block_size=16, packed=True, kpe="3d"), True),
    "dsv3-bs64-e4m3-qout8": (
        dict(
            DSV3,
            block_size=64,
            cache_dtype=E4M3,
            q_out=E4M3,
            cache_view="blocks",
            q_layout="padded",
            q_out_view=True,
        ),
        True,
    ),
    "dsv3-bs64-e5m2-qout-noscale": (
        dict(DSV3, block_size=64, q_out="same", cache_dtype=E5M2, kv_scale=None, slots="short", packed=True),
        True,
    ),
    "small": ({}, None),
    "small-kpe3d-int32pos-all": (
        dict(kpe="3d", pos_dtype=torch.int32, slots="all", q_layout="contiguous"),
        None,
    ),
    "small-packed-e5m2-cols": (dict(packed=True, cache_dtype=E5M2, cache_view="cols"), None),
    "small-none-rows-strided-tables": (
        dict(slots="none", cache_view="rows", block_size=4, strided_tables=True),
        None,
    ),
    "rope-only": (dict(nope=0, R=32, L=64), True),
    "rope-only-e4m3-qout8-noscale": (
        dict(nope=0, R=32, L=64, cache_dtype=E4M3, q_out=E5M2, q_scale=None, packed=True, kpe="3d"),
        True,
    ),
    "rope-mid-strided-tables": (dict(nope=16, R=16, extra=8, strided_tables=True, cache_dtype=E5M2), True),
    "rope-mid-qout-short-rows": (
        dict(
            nope=16,
            R=16,
            extra=8,
            q_out="same",
            q_out_view=True,
            slots="short",
            cache_view="rows",
            block_size=1,
        ),
        True,
    ),
    "odd-l20-r6": (dict(nope=10, R=6, L=20, block_size=5), None),
    "odd-l21-e4m3-qout8-cols": (
        dict(
            nope=7,
            R=6,
            extra=3,
            L=21,
            block_size=3,
            cache_dtype=E4M3,
            q_out=E4M3,
            packed=True,
            cache_view="cols",
        ),
        False,
    ),
}


@pytest.mark.parametrize("backend", MATRIX)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_reference_and_cache_model(config, dtype, interleaved, backend):
    """Every config on every dtype and pairing: the reference, the cache model, the CPU op's bits."""
    kw, vectorized = CONFIGS[config]
    seed = 100 * list(CONFIGS).index(config) + 10 * DTYPES.index(dtype) + interleaved
    run_checked(dict(kw, dtype=dtype, interleaved=interleaved, seed=seed), backend, vectorized)


EXTRA_GRIDS = {"emu-4sm": (4, False), "emu-7sm-scalar": (7, True), "emu-100000sm": (100_000, False)}


@pytest.mark.parametrize("backend", EMU_BACKENDS + list(EXTRA_GRIDS))
@pytest.mark.parametrize(
    "config", ["dsv3-bs64-e4m3-qout8", "small-packed-e5m2-cols", "rope-mid-qout-short-rows", "odd-l20-r6"]
)
def test_every_grid_gives_the_cpu_bits(config, backend):
    """The emulated CUDA body on every grid shape and path: the references, and the CPU op's bits."""
    kw, _ = CONFIGS[config]
    spec = BACKENDS.get(backend) or EXTRA_GRIDS[backend]
    run_checked(dict(kw, dtype=torch.bfloat16, interleaved=True, seed=5), spec)


def _decode(T: int, backend: str) -> None:
    for dtype, cache in ((torch.bfloat16, E4M3), (torch.float32, None)):
        kw = dict(DSV3, dtype=dtype, T=T, cache_dtype=cache, slots="all" if T < 3 else "mixed", kpe="3d")
        run_checked(dict(kw, q_out="same" if T == 2 else None, packed=T % 2 == 1), backend)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_decode_shapes(T, backend):
    """Decode: T = 1..4 (on the emulated grid the heads of a token spread over blocks)."""
    _decode(T, backend)


@pytest.mark.parametrize("backend", ["cpu", *EMU_BACKENDS])
@pytest.mark.parametrize("q_out", [None, "same", E4M3])
def test_no_tokens_is_a_no_op(q_out, backend):
    """T = 0 writes nothing: q, k_pe, q_out and every byte of the cache keep their bits."""
    c = build(torch.bfloat16, T=0, cache_dtype=E5M2, q_out=q_out, slots="all")
    s = c.snapshot()
    run(c, backend)
    for name, before in s.items():
        assert same_bits(getattr(c, name), before), f"{name} changed"


def _out_of_range_slot(bad, backend: str, fp8: bool) -> None:
    kw = dict(dtype=torch.float16, T=9, slots="all", cache_dtype=E4M3 if fp8 else None, packed=True)
    c = build(**kw)
    n_slots = c.kv_cache.shape[0] * c.kv_cache.shape[1]
    c.slot_mapping[3] = n_slots if bad == "n_slots" else bad
    c.slot_mapping[7] = -1
    s = c.snapshot()
    run(c, backend)
    check(c, s, backend)  # the model skips the token; q and k_pe are still checked rotated


@pytest.mark.parametrize("bad", [-7, -2, 10**6, 2**63 - 1, "n_slots"])
def test_out_of_range_slot_is_skipped_on_emulation(bad):
    """The CUDA body never writes outside the cache: that token's row is skipped, the others written."""
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    for backend in EMU_BACKENDS:
        _out_of_range_slot(bad, backend, backend == "emu-1sm")


@pytest.mark.parametrize("fp8", [False, True], ids=["f16-cache", "e4m3-cache"])
@pytest.mark.parametrize("bad", [-7, -2, 10**6, "n_slots"])
def test_out_of_range_slot_is_skipped_on_cuda(bad, fp8):
    """What the CUDA op documents (position checks off, the default): the token's write is skipped."""
    _out_of_range_slot(bad, "cuda", fp8)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_fp8_saturation_inf_nan(dtype, fp8, backend):
    """Huge values and infinities saturate to +-FP8_MAX and NaN stays NaN, in kv_c (copied), in the
    pass-through features of an fp8 q_out and in huge rotated k_pe; the checks hold every bit to the model."""
    c = build(dtype, T=8, H=2, nope=8, R=16, extra=8, L=24, cache_dtype=fp8, q_out=fp8, slots="all")
    c.kv_scale, c.q_scale = torch.tensor([0.25]), torch.tensor([0.25])
    m = reference.FP8_MAX[fp8]
    big = min(torch.finfo(dtype).max, 1e6)
    special = torch.tensor([big, -big, float("inf"), -float("inf"), float("nan"), big / 2, 1.01 * m / 4, 3.0])
    special = special.to(dtype)
    for x in (c.kv_c, c.q[..., :8], c.q[..., 24:]):
        x.copy_(special.repeat(x.numel() // 8).view(x.shape))
    c.k_pe[0] = big  # rotated at position 0: +-big, still far out of range
    c.positions[0] = 0
    s = c.snapshot()
    run(c, backend)
    check(c, s, backend)
    rows = c.kv_cache.reshape(-1, 40)[c.slot_mapping].float()
    q_pass = c.q_out[..., :8].float()
    for got in (rows[:, :24], q_pass):
        want = torch.tensor([m, -m, m, -m, 0.0, m, m, 12.0]).repeat(got.numel() // 8).view(got.shape)
        nan = torch.zeros(8, dtype=torch.bool)
        nan[4] = True
        nan = nan.repeat(got.numel() // 8).view(got.shape)
        assert bool(got[nan].isnan().all()) and torch.equal(got[~nan], want[~nan])
    assert bool((rows[0, 24:] == m).all()), "huge rotated k_pe saturates"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_read_only_kv_c_may_be_expanded(backend):
    """kv_c is only read: an expanded (stride-0) kv_c is a valid input, its one row stored at every slot."""
    c = build(torch.bfloat16, cache_dtype=E4M3, q_out=E5M2)
    c.kv_c = c.kv_c[:1].expand(c.kv_c.shape)
    s = c.snapshot()
    run(c, backend)
    check(c, s, backend)


# ---------------------------------------------------------------------------------------------------------
# The GQA cache op on views: the MLA op is apply_rotary_qk_and_cache_ on q's rope columns, k_pe and kv_c as
# one head each and kv_cache's two column ranges, bit for bit.

EQUIV = {
    "dsv3-packed-kpe3d": dict(DSV3, block_size=16, packed=True, kpe="3d"),
    "dsv3-e4m3-qout8": dict(DSV3, block_size=64, cache_dtype=E4M3, q_out=E5M2, slots="short"),
    "mid-qout-rows": dict(nope=16, R=16, extra=8, q_out="same", cache_view="rows"),
    "rope-only-e5m2": dict(nope=0, R=32, L=64, cache_dtype=E5M2, kv_scale=None, cache_view="cols"),
    "odd": dict(nope=7, R=6, extra=3, L=21, block_size=3, cache_dtype=E4M3, packed=True),
}


def _gqa_call(c, backend) -> None:
    a = as_gqa(c.args())
    if backend == "cpu":
        rope_ext.apply_rotary_qk_and_cache_(**a)
    else:
        a |= dict(layout="NHD", rotary_offset=0, mrope_section=None, mrope_interleaved=False)
        gqa_emulated(a, *BACKENDS[backend])


@pytest.mark.parametrize("backend", ["cpu", "emu-132sm", "emu-1sm-scalar"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("config", list(EQUIV))
def test_equals_the_gqa_cache_op_on_views(config, dtype, interleaved, backend):
    if backend != "cpu" and not HAS_EMU:
        pytest.skip(NO_EMULATION)
    kw = dict(EQUIV[config], dtype=dtype, interleaved=interleaved, seed=list(EQUIV).index(config))
    mla, gqa = build(**kw), build(**kw)
    run(mla, backend)
    _gqa_call(gqa, backend)
    lo, hi = mla.rotary_offset, mla.rotary_offset + mla.rotary_dim
    assert same_bits(mla.q, gqa.q), "q"
    assert same_bits(mla.k_pe, gqa.k_pe), "k_pe"
    assert same_bits(mla.cache_base, gqa.cache_base), "kv_cache (rows and guards)"
    if mla.q_out is not None:
        assert same_bits(mla.q_out[..., lo:hi], gqa.q_out[..., lo:hi]), "q_out's rope features"
        # The GQA call leaves q_out's other features alone; the MLA op copies q's there (fp8: quantized).
        assert same_bits(gqa.q_out[..., :lo], build(**kw).q_out[..., :lo]), "GQA wrote outside its view"
        for cols in (slice(0, lo), slice(hi, None)):
            want = mla.q[..., cols]
            if mla.q_out.dtype in FP8:
                scale = 1.0 if mla.q_scale is None else mla.q_scale
                want = reference.quantize_fp8(want, scale, mla.q_out.dtype)
            assert same_bits(mla.q_out[..., cols], want), "q_out's pass-through features"


# ---------------------------------------------------------------------------------------------------------
# Every CPU instruction set gives the same bits.

ISA_CONFIGS = {
    "dsv3-e4m3-qout8": dict(DSV3, block_size=64, cache_dtype=E4M3, q_out=E4M3, packed=True),
    "dsv3-qout": dict(DSV3, block_size=16, q_out="same", kpe="3d", slots="short"),
    "odd-e5m2": dict(nope=7, R=6, extra=3, L=21, block_size=3, cache_dtype=E5M2, q_out=E5M2),
    "mid-rows": dict(nope=16, R=16, extra=8, cache_view="rows"),
    # 4 * 65536 values and more of one tensor: the CPU op quantizes 16-bit values through a table
    # (cpu/kv_cache.cpp), here for q_out (T H D), k_pe (T R) and kv_c (T L).
    "fp8-tables": dict(
        T=4096, H=1, nope=32, R=64, L=64, block_size=64, cache_dtype=E4M3, q_out=E5M2, scale=30.0
    ),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("config", list(ISA_CONFIGS))
def test_every_cpu_instruction_set_gives_the_same_bits(config, dtype, interleaved):
    kw = dict(ISA_CONFIGS[config], dtype=dtype, interleaved=interleaved, seed=3)
    results = {}
    default = rope_ext._cpu_isa()
    for isa in ISAS:
        previous = rope_ext._set_cpu_isa(isa)
        try:
            assert rope_ext._cpu_isa() == isa
            c = build(**kw)
            s = c.snapshot()
            run(c, "cpu")
        finally:
            rope_ext._set_cpu_isa(previous)
        if isa == ISAS[0] or config != "fp8-tables":
            check(c, s)
        results[isa] = outputs(c)
    assert rope_ext._cpu_isa() == default, "the instruction set was not restored"
    for isa, got in results.items():
        for x, y in zip(got, results[ISAS[0]], strict=True):
            assert same_bits(x, y), f"{isa} differs from {ISAS[0]}"


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

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
    OPS,
    as_gqa,
    build,
    check,
    outputs,
    run,
    run_checked,
)

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

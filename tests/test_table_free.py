"""The table-free mode: ``cos_sin`` given as frequencies (float64 ``[rotary_dim]``, each pair's frequency then
its factor), the rows computed in the kernels from the positions, which may be fractional and have no table
to fit in.

* the rows' accuracy: cos and sin within one float32 ulp of the exact values (mpmath) for integer positions
  up to 2^24 and for float positions as given, on every CPU instruction set and on the emulated CUDA body;
* the same bits as the table path wherever both apply (every op, backend, dtype, pairing, axis layout), since
  every table comes from the same function;
* fractional positions against the float64 reference; hostile positions and frequencies refused before any
  write (NaN on the GPU paths); opcheck, ``torch.compile(fullgraph=True)``, autograd, hypothesis.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from _helpers import DTYPES, assert_close_to_reference, skip_without_emulation
from backends import BACKENDS, device_of, rotate_qk
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import rope_ext
from rope_ext import RopeCache, reference
from rope_ext.cache import cos_sin_rows
from rope_ext.ops import CPU_ISAS, _set_cpu_isa

_ops = torch.ops.rope_ext
_ISAS = [i for i in CPU_ISAS if torch.ops.rope_ext._cpu_isa_supported(i)]
# (rotary_dim, mrope_section, mrope_interleaved): plain, contiguous, interleaved and alternating axes.
LAYOUTS = [
    (64, None, False),
    (96, (8, 20, 20), False),
    (64, (4, 14, 14), True),
    (28, (14,), False),
    (64, (10, 11, 11), "alternating"),
]


def _cache(rotary_dim, dtype=torch.float32, **kw):
    return RopeCache(rotary_dim, 10000.0, max_positions=512, dtype=dtype, **kw)


def _ulps(got: np.ndarray, exact: list) -> int:
    """Float32 ulps between ``got`` (float32 values) and the exact values (mpmath)."""
    worst = 0
    for g, e in zip(got.tolist(), exact, strict=True):
        e32 = np.float32(float(e))
        worst = max(worst, abs(int(np.float32(g).view(np.int32)) - int(e32.view(np.int32))))
    return worst


def _exact_rows(pos, inv):
    mpmath.mp.prec = 120
    cos, sin = [], []
    for p in pos:
        for f in inv:
            a = mpmath.mpf(float(p)) * mpmath.mpf(float(f))
            cos.append(mpmath.cos(a))
            sin.append(mpmath.sin(a))
    return cos, sin


def _accuracy_cases():
    g = torch.Generator().manual_seed(7)
    ints = torch.cat([
        torch.tensor([0, 1, 2, 355, 103993, 833719, 5419351, 2**24 - 1, 2**24]),
        torch.randint(0, 2**24 + 1, (40,), generator=g),
    ])  # fmt: skip
    floats = torch.cat(
        [torch.tensor([0.5, -3.25, 1e-3, 4095.75]), (torch.rand(20, generator=g) - 0.3) * 5000]
    )
    inv = torch.cat([
        RopeCache(128, 500000.0, max_positions=1).inv_freq[::9],
        RopeCache.for_axes([16, 56, 56], 10000.0, max_positions=1).inv_freq[::11],
        torch.tensor([1.0, 0.5, 0.123456789]),
    ]).double()  # fmt: skip
    return ints, floats, inv


@pytest.mark.parametrize("kind", ["int64", "int32", "float64", "float32"])
def test_rows_within_one_float32_ulp_of_the_exact_values(kind):
    """cos and sin of ``p f`` (the exact product) against mpmath: float32-rounded within one ulp (in practice
    correctly rounded) on every CPU set, for integer positions up to 2^24 and float positions as given."""
    ints, floats, inv = _accuracy_cases()
    pos = ints.to(getattr(torch, kind)) if kind.startswith("int") else floats.to(getattr(torch, kind))
    cos, sin = _exact_rows(pos.double(), inv)
    freqs = rope_ext.frequencies(inv)
    previous = rope_ext._cpu_isa()
    try:
        for isa in _ISAS:
            _set_cpu_isa(isa)
            rows = _ops._angle_rows(pos, freqs).float()
            h = len(inv)
            assert _ulps(rows[:, :h].reshape(-1).numpy(), cos) <= 1, isa
            assert _ulps(rows[:, h:].reshape(-1).numpy(), sin) <= 1, isa
    finally:
        _set_cpu_isa(previous)


def test_emulated_rows_are_the_cpu_rows():
    """The CUDA body's rows (host emulation) are the CPU's bits: rotating the unit pair (1, 0) of a float32
    head by a row gives the row's cos and sin exactly."""
    skip_without_emulation()
    ints, floats, inv = _accuracy_cases()
    freqs = rope_ext.frequencies(inv, 0.75)
    h = len(inv)
    for pos in (ints, floats):
        x = torch.zeros(len(pos), 1, 2 * h)
        x[..., :h] = 1.0
        out, _ = rotate_qk("emu-tokens", x, None, pos[:, None], freqs, interleaved=False)
        rows = _ops._angle_rows(pos, freqs).float()
        assert torch.equal(out[:, 0], rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_same_bits_as_the_table(backend, dtype, interleaved, inplace):
    """Every layout of positions and axes: frequencies and the table of the same cache rotate alike, bit for
    bit (float64 inputs read float64 rows: the table is then float64 too)."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(1)
    for R, sec, mil in LAYOUTS:
        cache = _cache(R, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
        n = 1 if sec is None else len(sec)
        q = torch.randn(11, 3, R + 6, generator=g).to(device, dtype)
        k = torch.randn(11, 2, R + 6, generator=g).to(device, dtype)
        pos = torch.randint(0, 512, (n, 11, 1) if sec else (11, 1), generator=g).to(device)
        kw = dict(interleaved=interleaved, mrope_section=sec, mrope_interleaved=mil, rotary_offset=4)
        outs = []
        for cs in (cache.cos_sin, cache.frequencies_on(device)):
            qo, ko = (q.clone(), k.clone()) if inplace else (q, k)
            outs.append(rotate_qk(backend, qo, ko, pos, cs, inplace=inplace, **kw))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (R, sec)


def test_same_bits_as_the_table_on_every_cpu_set():
    previous = rope_ext._cpu_isa()
    cache = _cache(128)
    q = torch.randn(37, 4, 128, dtype=torch.bfloat16)
    pos = torch.randint(0, 512, (37, 1))
    try:
        for isa in _ISAS:
            _set_cpu_isa(isa)
            a = rope_ext.apply_rotary(q, pos, cache.cos_sin)
            assert torch.equal(a, rope_ext.apply_rotary(q, pos, cache.frequencies_on())), isa
    finally:
        _set_cpu_isa(previous)


@pytest.mark.parametrize("mil", [False, True], ids=["sections", "interleaved-sections"])
def test_grid_positions_same_bits_as_the_table_on_every_cpu_set(mil):
    """A (frame, row, column) grid, as video models lay tokens out: most pairs keep the previous token's
    angle (the CPU computes only the axes that moved), and the rows are still the table's bit for bit."""
    previous = rope_ext._cpu_isa()
    cache = _cache(96)
    f, r, c = torch.meshgrid(torch.arange(3), torch.arange(5), torch.arange(7), indexing="ij")
    ids = torch.stack([f.flatten(), r.flatten(), c.flatten()])[..., None]  # [3, 105, 1]
    q = torch.randn(105, 2, 96, dtype=torch.bfloat16)
    kw = dict(interleaved=True, mrope_section=(16, 16, 16), mrope_interleaved=mil)
    try:
        for isa in _ISAS:
            _set_cpu_isa(isa)
            a = rope_ext.apply_rotary(q, ids, cache.cos_sin, **kw)
            assert torch.equal(a, rope_ext.apply_rotary(q, ids, cache.frequencies_on(), **kw)), isa
    finally:
        _set_cpu_isa(previous)


def _serving_inputs(g, T=9, Hq=4, Hk=2, D=64, dtype=torch.bfloat16):
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    k = torch.randn(T, Hk, D, generator=g).to(dtype)
    v = torch.randn(T, Hk, D, generator=g).to(dtype)
    return q, k, v, torch.randint(0, 512, (T,), generator=g)


@pytest.mark.parametrize("emulated", [False, True], ids=["cpu", "emu"])
def test_serving_ops_same_bits_as_the_table(emulated):
    """The cache write, the MLA cache write and the QK norm: frequencies and the table agree bit for bit."""
    if emulated:
        skip_without_emulation()
    g = torch.Generator().manual_seed(2)
    cache = _cache(64)
    results = []
    for cs in (cache.cos_sin, cache.frequencies_on()):
        q, k, v, pos = _serving_inputs(torch.Generator().manual_seed(3))
        kc, vc = torch.zeros(4, 4, 2, 64, dtype=q.dtype), torch.zeros(4, 4, 2, 64, dtype=q.dtype)
        slots = torch.randperm(16, generator=torch.Generator().manual_seed(4))[:9]
        w = torch.rand(64, generator=g.manual_seed(5)) + 0.5
        qn, kn = torch.empty_like(q), torch.empty_like(k)
        q_pe, kv_c, k_pe = q.clone(), torch.randn(9, 32, generator=g).to(q.dtype), k[:, :1].clone()
        mla_cache = torch.zeros(4, 4, 96, dtype=q.dtype)
        if emulated:
            _ops._cuda_emulated_cache(
                q, k, v, pos, cs, kc, vc, slots, None, None, None, None, False, "NHD", 4, False
            )
            _ops._cuda_emulated_norm(q, k, qn, kn, w, w, pos, cs, 1e-6, False, 0.0, 4, False)
            _ops._cuda_emulated_mla(
                q_pe, kv_c, k_pe, pos, cs, mla_cache, slots, None, None, None, False, 0, 4, False
            )
        else:
            rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots)
            qn, kn = rope_ext.apply_qk_norm_rotary(q, k, w, w, pos, cs)
            rope_ext.apply_mla_rotary_and_cache_(q_pe, kv_c, k_pe, pos, cs, mla_cache, slots)
        results.append((q, k, kc, vc, qn, kn, q_pe, k_pe, mla_cache))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("emulated", [False, True], ids=["cpu", "emu"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_rerotate_same_bits_as_the_table(emulated, cache_dtype):
    """Cached keys shifted by signed deltas: each delta's own row (sin(-x) = -sin(x) bit for bit) against the
    table's row ``|delta|`` taken inversely for a negative one; and float deltas against the float64
    rotation."""
    if emulated:
        skip_without_emulation()
    g = torch.Generator().manual_seed(6)
    cache = _cache(64)
    kc0 = (torch.randn(4, 8, 2, 64, generator=g) * 0.5).to(cache_dtype)
    slots = torch.randperm(32, generator=g)[:12]
    slots[3] = -1
    delta = torch.randint(-511, 512, (12,), generator=g)
    scale = torch.tensor([0.5]) if cache_dtype == torch.float8_e4m3fn else None
    outs = []
    for cs in (cache.cos_sin, cache.frequencies_on()):
        kc = kc0.clone()
        if emulated:
            _ops._cuda_emulated_rerotate(kc, slots, delta, cs, scale, True, "NHD", 0, 4, False)
        else:
            rope_ext.rerotate_kv_cache_(kc, slots, delta, cs, interleaved=True, k_scale=scale)
        outs.append(kc)
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    if cache_dtype == torch.float32 and not emulated:
        kc = kc0.clone()
        fdelta = delta.double() / 7
        rope_ext.rerotate_kv_cache_(kc, slots, fdelta, cache.frequencies_on(), interleaved=True)
        rows = torch.cat(
            [torch.cos(fdelta[:, None] * cache.inv_freq), torch.sin(fdelta[:, None] * cache.inv_freq)], -1
        )
        keep = slots >= 0
        x = kc0.view(32, 2, 64)[slots[keep]]
        ref = reference.rotary_hadamard(
            x, torch.arange(int(keep.sum()))[:, None], rows[keep], interleaved=True
        )
        assert_close_to_reference(kc.view(32, 2, 64)[slots[keep]], ref, float(x.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fractional_positions_match_the_float64_reference(backend, dtype):
    """Float positions (LTX-Video's fractional coordinates, FLUX's float ids), negative ones and integer
    positions past any table: the rotation by ``cos/sin(p f)`` in float64, within the ops' tolerance."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(9)
    inv = RopeCache.for_axes([16, 24, 24], 10000.0, max_positions=1).inv_freq
    freqs = rope_ext.frequencies(inv, 1.25).to(device)
    q = torch.randn(3, 13, 5, 64, generator=g).to(device, dtype)
    for pos in (
        (torch.rand(3, 13, 1, generator=g) - 0.2) * 800,
        (torch.rand(3, 13, 1, generator=g) * 64).float(),
        torch.randint(10**7, 2**24, (3, 13, 1), generator=g),
    ):
        pos = pos.to(device)
        out, _ = rotate_qk(backend, q, None, pos, freqs, interleaved=True, mrope_section=(8, 12, 12))
        table = torch.cat([torch.cos(pos.double().reshape(3, -1, 1) * inv) * 1.25,
                           torch.sin(pos.double().reshape(3, -1, 1) * inv) * 1.25], -1)  # fmt: skip
        flat = torch.arange(13).reshape(1, 13, 1).expand(3, 13, 1) + torch.arange(3).reshape(3, 1, 1) * 13
        ref = reference.rotary_hadamard(
            q.cpu(), flat, table.reshape(39, -1), interleaved=True, mrope_section=(8, 12, 12)
        )
        assert_close_to_reference(out.cpu(), ref, float(q.abs().max()))


def test_negative_positions_are_the_inverse_rotation():
    """sin(-x) = -sin(x) bit for bit: position -p rotates as ``inverse=True`` at p."""
    freqs = _cache(64).frequencies_on()
    q = torch.randn(20, 3, 64)
    pos = torch.randint(0, 10**6, (20, 1))
    assert torch.equal(
        rope_ext.apply_rotary(q, -pos, freqs), rope_ext.apply_rotary(q, pos, freqs, inverse=True)
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 2.0**60])
def test_positions_without_an_angle_are_refused_before_any_write(bad):
    freqs = _cache(64).frequencies_on()
    q, k = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    q0, k0 = q.clone(), k.clone()
    pos = torch.arange(5.0)[:, None]
    pos[3] = bad
    with pytest.raises(ValueError, match="token 3 has position"):
        rope_ext.apply_rotary_qk_(q, k, pos, freqs)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    skip_without_emulation()
    out, _ = rotate_qk("emu-tokens", q, None, pos, freqs, interleaved=False)
    assert out[3].isnan().any() and not out[[0, 1, 2, 4]].isnan().any()


@pytest.mark.parametrize("value", [2**53 + 1, -(2**53) - 1, 2**63 - 1, -(2**63)])
def test_int64_positions_past_2_53_are_refused(value):
    """A double holds every int64 up to 2^53 exactly; past it the angle would not be the position's. (Low
    frequencies, so that 2^53 itself gives an angle.)"""
    freqs = rope_ext.frequencies(_cache(64).inv_freq * 1e-5)
    q = torch.randn(3, 1, 64)
    with pytest.raises(ValueError, match="token 1 has position"):
        rope_ext.apply_rotary(q, torch.tensor([[0], [value], [1]]), freqs)
    assert not rope_ext.apply_rotary(q, torch.tensor([[0], [2**53], [-(2**53)]]), freqs).isnan().any()


def test_argument_errors():
    q = torch.randn(4, 2, 64)
    freqs = _cache(64).frequencies_on()
    pos = torch.arange(4)[:, None]
    cases = [
        (TypeError, "frequencies, then factors\\) must be float64", (pos, freqs.float())),
        (ValueError, "must be even", (pos, freqs[:63])),
        (ValueError, r"or \[rotary_dim\]", (pos, freqs.reshape(1, 2, 32))),
        (TypeError, "float positions need frequencies", (pos.double(), _cache(64).cos_sin)),
        (TypeError, "positions must be", (pos.half(), freqs)),
        (ValueError, "rotary_dim", (pos, torch.cat([freqs, freqs]))),
    ]
    for error, match, (p, cs) in cases:
        with pytest.raises(error, match=match):
            rope_ext.apply_rotary(q, p, cs)
    with pytest.raises(TypeError, match="delta must be"):
        rope_ext.rerotate_kv_cache_(
            torch.zeros(2, 4, 1, 64), torch.tensor([0]), torch.ones(1), _cache(64).cos_sin
        )
    for args, error in (
        ((pos, freqs), ValueError),  # positions [n, 1]
        ((pos[:, 0], freqs.float()), TypeError),
        ((pos[:, 0].half(), freqs), TypeError),
        ((pos[:, 0], freqs[:5]), ValueError),
    ):
        with pytest.raises(error):
            _call_rows(*args)


def _call_rows(*args):
    try:
        return _ops._angle_rows(*args)
    except ValueError as e:
        raise rope_ext.checks.retyped(e) from None


def test_cos_sin_rows_and_the_table_are_the_kernels_rows():
    """RopeCache's table is built by the kernels' function: equal to the float64 rows rounded once, and
    within 2^-52 (relative to 1) of torch's float64 cos/sin of the same angles."""
    cache = RopeCache(128, 500000.0, max_positions=3000, scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 1024})  # fmt: skip
    rows = cos_sin_rows(torch.arange(3000), cache.inv_freq, cache.attention_factor)
    assert torch.equal(rows.float(), cache.cos_sin)
    ang = torch.arange(3000, dtype=torch.float64)[:, None] * cache.inv_freq
    a = cache.attention_factor
    ref = torch.cat([torch.cos(ang) * a, torch.sin(ang) * a], -1)
    assert (rows - ref).abs().max().item() < 3000 * 2.0**-52 + 1e-15
    assert torch.equal(cache.frequencies_on(), rope_ext.frequencies(cache.inv_freq, a))


def test_opcheck_and_compile():
    cache = _cache(64)
    freqs = cache.frequencies_on()
    q, k = torch.randn(6, 3, 64), torch.randn(6, 2, 64)
    fpos = torch.rand(6, 1, dtype=torch.float64) * 100
    opcheck(_ops.rotary.default, (q, fpos, freqs))
    opcheck(_ops.rotary_qk.default, (q, k, fpos.float(), freqs))
    opcheck(_ops.rotary_qk_.default, (q.clone(), k.clone(), fpos, freqs))
    opcheck(_ops._angle_rows.default, (torch.arange(7), freqs))
    w = torch.rand(64) + 0.5
    opcheck(_ops.qk_norm_rotary.default, (q, k, w, w, fpos[:, 0], freqs))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, pos, freqs):
        return rope_ext.apply_rotary_qk(q, k, pos, freqs)

    a, b = f(q, k, fpos, freqs)
    ea, eb = rope_ext.apply_rotary_qk(q, k, fpos, freqs)
    assert torch.equal(a, ea) and torch.equal(b, eb)


def test_gradient_is_the_inverse_rotation():
    freqs = _cache(32, dtype=torch.float64).frequencies_on()
    x = torch.randn(5, 2, 32, dtype=torch.float64, requires_grad=True)
    pos = torch.rand(5, 1, dtype=torch.float64) * 50
    torch.autograd.gradcheck(lambda x: rope_ext.apply_rotary(x, pos, freqs), (x,))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 24).map(lambda h: 2 * h),
    st.integers(1, 20),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_hypothesis_table_free_is_the_table_of_its_own_positions(
    rotary_dim, tokens, dtype, interleaved, seed
):
    """Any positions (integer, negative, fractional, large) and frequencies: the rotation equals the table
    path over a table made of exactly those positions' rows (``cos_sin_rows``)."""
    g = torch.Generator().manual_seed(seed)
    h = rotary_dim // 2
    freqs = torch.cat(
        [
            torch.rand(h, generator=g, dtype=torch.float64) * 2,
            torch.rand(h, generator=g, dtype=torch.float64) + 0.5,
        ]
    )
    pos = (torch.rand(tokens, generator=g, dtype=torch.float64) - 0.5) * 10.0 ** float(
        torch.randint(0, 9, (1,), generator=g)
    )
    x = torch.randn(tokens, 3, rotary_dim + 2, generator=g).to(dtype)
    rows = _ops._angle_rows(pos, freqs).to(torch.float64 if dtype == torch.float64 else torch.float32)
    table_path = rope_ext.apply_rotary(x, torch.arange(tokens)[:, None], rows, interleaved=interleaved)
    assert torch.equal(rope_ext.apply_rotary(x, pos[:, None], freqs, interleaved=interleaved), table_path)
    assert math.isfinite(float(rows.abs().max()))


def test_two_threads_each_with_their_rows():
    """Each calling thread builds its rows in a buffer of its own: concurrent calls of different sizes from
    two threads give each the single-threaded result."""
    import threading

    freqs = _cache(64).frequencies_on()
    cases = []
    for seed, tokens in ((0, 300), (1, 37)):
        g = torch.Generator().manual_seed(seed)
        x, pos = torch.randn(tokens, 4, 64, generator=g), torch.rand(tokens, 1, generator=g) * 1000
        cases.append((x, pos, rope_ext.apply_rotary(x, pos, freqs)))
    errors = []

    def work(x, pos, want):
        for _ in range(200):
            if not torch.equal(rope_ext.apply_rotary(x, pos, freqs), want):
                errors.append("mismatch")
                return

    threads = [threading.Thread(target=work, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors

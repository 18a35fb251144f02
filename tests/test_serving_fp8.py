"""apply_rotary_qk_and_cache_ with fp8 caches and q_out: saturation, infinities, NaN, and the conversion
against torch's over the whole range (and the CPU op's tables of every 16-bit value).

The cases, backends and checks are test_serving_cache.py's (``_serving_cache_helpers.py``).
"""

from __future__ import annotations

import pytest
import torch
from _serving_cache_helpers import (
    BACKENDS,
    FP8,
    _one_thread,  # noqa: F401 - the autouse fixture: one thread in this module
    build,
    check,
    run,
    same_bits,
)

import rope_ext
from rope_ext import ops, reference

# ---------------------------------------------------------------------------------------------------------
# fp8: saturation, infinities, NaN, and the conversion against torch's over the whole range.


def _assert_saturated(got: torch.Tensor, m: float) -> None:
    """``got [..., 8]`` (fp8) holds the quantized SPECIAL values: +-m, +-m, NaN, m, m, 12."""
    got = got.float().reshape(-1, 8)
    want = torch.tensor([m, -m, m, -m, 0.0, m, m, 12.0])
    assert bool((got[:, [0, 1, 2, 3, 5, 6, 7]] == want[[0, 1, 2, 3, 5, 6, 7]]).all()), got[:2]
    assert bool(got[:, 4].isnan().all()), "NaN must stay NaN"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_fp8_saturation_inf_nan(dtype, fp8, backend):
    """Huge values and infinities saturate to +-FP8_MAX, NaN stays NaN: in v (copied), in the pass-through
    features of k (not rotated) and of an fp8 q_out, and in huge rotated values of k."""
    c = build(dtype, T=8, Hq=2, Hk=2, D=32, rotary_dim=16, cache_dtype=fp8, q_out=fp8, slots="all")
    sc = 0.25  # x / scale = 4 x
    c.k_scale, c.v_scale, c.q_scale = (torch.tensor([sc]) for _ in range(3))
    m = reference.FP8_MAX[fp8]
    big = min(torch.finfo(dtype).max, 1e6)  # 4 big > 57344: out of range for both fp8 types
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([big, -big, inf, -inf, nan, big / 2, 1.01 * m * sc, 3.0]).to(dtype)
    for x in (c.v, c.k[..., 16:], c.q[..., 16:]):
        x.copy_(special.repeat(x.numel() // 8).view(x.shape))
    c.k[0, :, :16] = big  # rotated at position 0: +-big, still far out of range
    c.positions[0] = 0
    s = c.snapshot()
    run(c, backend)
    check(c, s, backend)
    rows = c.slot_mapping // 16, c.slot_mapping % 16  # NHD, block_size 16: the rows written
    _assert_saturated(c.value_cache[rows], m)
    _assert_saturated(c.key_cache[rows][..., 16:], m)
    _assert_saturated(c.q_out[..., 16:], m)
    assert bool((c.key_cache[rows][0, :, :16].float() == m).all()), "huge rotated k saturates"


def _fp8_probe_values(fp8, n: int, gen) -> torch.Tensor:
    """Random signs and magnitudes 1e-9..1e6 (subnormals, underflow to +-0, saturation), every fp8 code,
    every midpoint between neighbouring codes (ties to even) and the float32 neighbours of each midpoint."""
    mag = 10 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 15 - 9)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = codes[codes.isfinite()].unique()  # sorted, -0 merged into 0
    mid = (finite[1:] + finite[:-1]) / 2
    near = torch.cat(
        [mid, mid.nextafter(torch.tensor(float("inf"))), mid.nextafter(torch.tensor(-float("inf")))]
    )
    return torch.cat([(mag * sign).float(), codes, near, torch.tensor([-0.0, 0.0])])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-20, 2.0**40, 0.37], ids=["1", "2^-20", "2^40", "0.37"])
def test_fp8_conversion_bit_exact_against_torch(scale, fp8, backend):
    """v (written as is) covers the range of v / v_scale; the cache holds exactly torch's .to(fp8) of the
    float32 quotient. Powers of two are multiplied by their reciprocal on the CPU (the same bits), 0.37
    divides."""
    gen = torch.Generator().manual_seed(5)
    vals = _fp8_probe_values(fp8, 6000, gen)
    Dv = 16
    T = -(-vals.numel() // (2 * Dv))
    vals = torch.cat([vals, torch.randn(T * 2 * Dv - vals.numel(), generator=gen)])
    vals = vals[torch.randperm(vals.numel(), generator=gen)]
    c = build(torch.float32, T=T, Hq=1, Hk=2, D=16, Dv=Dv, cache_dtype=fp8, slots="all", block_size=32)
    c.v.copy_((vals.double() * scale).float().view(T, 2, Dv))
    c.v_scale = torch.tensor([scale])
    s = c.snapshot()
    run(c, backend)
    check(c, s, backend)
    got = c.value_cache.reshape(-1, 2, Dv)[c.slot_mapping]
    m = reference.FP8_MAX[fp8]
    assert same_bits(got, (c.v / c.v_scale).clamp(-m, m).to(fp8))


@pytest.mark.parametrize("isa", [i for i in ops.CPU_ISAS if torch.ops.rope_ext._cpu_isa_supported(i)])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("v_scale", [0.015, 2.0**-3, -0.37], ids=["0.015", "2^-3", "-0.37"])
def test_fp8_tables_every_16_bit_value(dtype, fp8, isa, v_scale):
    """A CPU call that quantizes 4 * 65536 values or more of one 16-bit tensor looks them up in a table of
    every bit pattern (cpu/kv_cache.cpp) where the instruction set's row kernel is slower than a lookup
    (portable, AVX2), and runs the row kernel on every value elsewhere (AVX-512). Here q (to an fp8 q_out),
    k and v have that many values each, v holds every pattern of its dtype four times (infinities, NaNs,
    subnormals, both zeros), and every written bit must be the reference's in every set: a table built
    wrong, or a row kernel wrong for one pattern, fails here. v's scale takes each way of forming the quotient
    (cpu/avx512_rows.h, Quotient): corrected product, exact product, division."""
    gen = torch.Generator().manual_seed(11)
    T, H, D = 256, 8, 128  # T * H * D = 4 * 65536
    c = build(dtype, T=T, Hq=H, Hk=H, D=D, cache_dtype=fp8, q_out=fp8, slots="all", seed=3)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    c.v.copy_(every.repeat(4)[torch.randperm(4 << 16, generator=gen)].view(c.v.shape))
    c.k_scale, c.v_scale, c.q_scale = torch.tensor([0.02]), torch.tensor([v_scale]), torch.tensor([3.7])
    s = c.snapshot()
    previous = rope_ext._set_cpu_isa(isa)
    try:
        run(c, "cpu")
    finally:
        rope_ext._set_cpu_isa(previous)
    check(c, s, "cpu")
    m = reference.FP8_MAX[fp8]
    rows = c.value_cache.reshape(-1, H, D)[c.slot_mapping]
    assert same_bits(rows, (c.v.float() / c.v_scale).clamp(-m, m).to(fp8))


@pytest.mark.parametrize("tokens", [5, 8, 13, 40])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_tokens_split_over_threads_keep_their_bits(cache_dtype, tokens):
    """Llama-3-8B heads, bf16: the CPU cache write splits its tokens over two threads from a step's bytes (an
    fp8 cache's counted twice while OpenMP's workers spin: its rows' arithmetic, ops_cpu.cpp). Each token
    must be rotated and written exactly once: q, k and both caches hold one thread's bits."""
    gen = torch.Generator().manual_seed(tokens)
    q0, k0, v = (torch.randn(tokens, h, 128, generator=gen).bfloat16() for h in (32, 8, 8))
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos_sin = rope_ext.RopeCache(128, max_positions=512).ensure(512).cos_sin
    slots = torch.randperm(64 * 16, generator=gen)[:tokens]
    scale = torch.tensor([0.02]) if cache_dtype != torch.bfloat16 else None
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            q, k = q0.clone(), k0.clone()
            caches = [torch.zeros(64, 16, 8, 128, dtype=cache_dtype) for _ in range(2)]
            rope_ext.apply_rotary_qk_and_cache_(
                q, k, v, positions, cos_sin, *caches, slots, k_scale=scale, v_scale=scale
            )
            results.append([t.view(torch.uint8) for t in (q, k, *caches)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)

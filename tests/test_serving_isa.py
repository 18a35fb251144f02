"""The serving ops' CPU kernels under every instruction set this CPU runs: the fp8 row kernels
(csrc/rope/cpu/fp8_rows.h) and the QK norm (csrc/rope/cpu/qk_norm.h).

The RMSNorm of a head and the fp8 quantization of a row compute the same bits in the portable and the
AVX2 builds (16 fixed summation lanes added as a tree, no fused products, round to nearest even), so: fp8
cache rows are
bit-exact against torch's own conversion of ``x / scale`` saturated (special values and every tail length
included), and the normalised pass-through features of the fused QK-norm (no rotation between) are
bit-identical across sets, head by head or eight heads at a time.
"""

from __future__ import annotations

import pytest
import torch

import rope_ext
from rope_ext import reference

ISAS = [
    i for i in ("scalar", "avx2", "avx512", "avx512_bf16", "neon") if torch.ops.rope_ext._cpu_isa_supported(i)
]


@pytest.fixture(params=ISAS)
def isa(request):
    previous = rope_ext._set_cpu_isa(request.param)
    yield request.param
    rope_ext._set_cpu_isa(previous)


def _specials(n: int, g: torch.Generator) -> torch.Tensor:
    """Values over the whole fp8 range and past it: subnormal, normal, ties, huge, inf, NaN, signed zeros."""
    mag = torch.exp2(torch.empty(n).uniform_(-24, 20, generator=g))
    x = mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[::17] = float("inf")
    x[5::19] = float("-inf")
    x[7::23] = float("nan")
    x[3::29] = -0.0
    x[11::31] = 448.0 + 16.0  # e4m3 tie between 448 and the (absent) 480: saturates
    return x


def _fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an fp8 tensor, every NaN as 0x7f: the sign of a NaN is not part of the contract (torch's
    float16 -> float32 conversion drops it, the kernels keep it)."""
    return torch.where(t.float().isnan(), 0x7F, t.view(torch.uint8).int())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [2, 6, 8, 18, 64, 130])
def test_fp8_cache_rows_bit_exact(isa, fp8, dtype, dim):
    g = torch.Generator().manual_seed(dim)
    T, H = 9, 3
    k = _specials(T * H * dim, g).to(dtype).reshape(T, H, dim)
    v = _specials(T * H * dim, g).to(dtype).reshape(T, H, dim)
    q = torch.randn(T, 2, dim, generator=g).to(dtype)
    cs = reference.cos_sin_table(16, 2).float()
    cs[:, 0], cs[:, 1] = 1.0, 0.0  # the identity rotation: the cache rows are k and v as given
    kc = torch.zeros(4, 4, H, dim, dtype=fp8)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(16, generator=g)[:T]
    ks, vs = torch.tensor([0.37]), torch.tensor([3.5])
    rope_ext.apply_rotary_qk_and_cache_(
        q, k, v, torch.zeros(T, dtype=torch.long), cs, kc, vc, slots, k_scale=ks, v_scale=vs
    )
    want_k, want_v = reference.kv_cache_write(
        k, v, torch.zeros_like(kc), torch.zeros_like(vc), slots, k_scale=ks, v_scale=vs
    )
    assert torch.equal(_fp8_bits(kc), _fp8_bits(want_k))
    assert torch.equal(_fp8_bits(vc), _fp8_bits(want_v))


def _midpoints(fp8) -> torch.Tensor:
    """Every fp8 code as float32, every midpoint between neighbouring finite codes (ties to even) and the
    float32 neighbours of each midpoint, with both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = codes[codes.isfinite()].unique()
    mid = (finite[1:] + finite[:-1]) / 2
    inf = torch.tensor(float("inf"))
    x = torch.cat([codes, mid, mid.nextafter(inf), mid.nextafter(-inf)])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(
    "scale",
    [1.0, 2.0**-20, 0.37, 0.0234, 1.5 * 2.0**-60, 1.5 * 2.0**59, -0.37, 1.3 * 2.0**-70, 1.7e20],
    ids=["1", "2^-20", "0.37", "0.0234", "1.5*2^-60", "1.5*2^59", "-0.37", "1.3*2^-70", "1.7e20"],
)
@pytest.mark.parametrize("dim", [64, 130])
def test_fp8_rows_midpoints_bit_exact(isa, fp8, scale, dim):
    """float32 v rows of 64 values and more (the AVX-512 kernel's 64-value step, then 16, then a masked
    tail) holding every code, midpoint and midpoint neighbour times the scale: the cache holds torch's
    conversion of the saturated quotient, bit for bit, in every set. Positive powers of two multiply by the
    reciprocal (the same bits); the AVX-512 kernel corrects the product for other positive scales in
    [2^-60, 2^60] and divides for the rest (negative, tiny, huge), as the other sets do for all of them."""
    g = torch.Generator().manual_seed(dim)
    vals = _midpoints(fp8)
    H = 2
    T = -(-vals.numel() // (H * dim))
    vals = torch.cat([vals, _specials(T * H * dim - vals.numel(), g)])
    v = (vals[torch.randperm(vals.numel(), generator=g)].double() * scale).float().view(T, H, dim)
    k = torch.randn(T, H, dim, generator=g)
    q = torch.randn(T, 1, dim, generator=g)
    cs = reference.cos_sin_table(T, 2).float()
    kc = torch.zeros(T, 1, H, dim, dtype=fp8)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(T, generator=g)
    vs = torch.tensor([scale])
    rope_ext.apply_rotary_qk_and_cache_(
        q, k, v, torch.zeros(T, dtype=torch.long), cs, kc, vc, slots, k_scale=vs, v_scale=vs
    )
    m = reference.FP8_MAX[fp8]
    want = (v / vs).clamp(-m, m).to(fp8)
    assert torch.equal(_fp8_bits(vc[slots, 0]), _fp8_bits(want))


@pytest.mark.parametrize(
    "scale, fp8",
    [
        (0.37, torch.float8_e4m3fn),
        (0.0234, torch.float8_e5m2),
        (2.0**-3, torch.float8_e4m3fn),
        (-0.37, torch.float8_e5m2),
        (1.3 * 2.0**-70, torch.float8_e4m3fn),
    ],
)
def test_fp8_rows_random_bit_patterns(isa, scale, fp8):
    """2^20 float32 bit patterns drawn uniformly (every exponent equally: subnormals, NaNs, infinities, huge
    and tiny values) quantized in every set: torch's conversion of the saturated quotient, bit for bit. The
    whole 2^32 patterns: benchmarks/fp8_exhaustive.py (benchmarks/cpu-fp8-rows.md)."""
    g = torch.Generator().manual_seed(13)
    H, D = 8, 128
    T = (1 << 20) // (H * D)
    bits = torch.randint(-(1 << 31), 1 << 31, (T, H, D), generator=g, dtype=torch.int64)
    v = bits.to(torch.int32).view(torch.float32)
    q, k = torch.zeros(T, 1, D), torch.zeros(T, H, D)
    kc = torch.zeros(T, 1, H, D, dtype=fp8)
    vc = torch.zeros_like(kc)
    sc = torch.tensor([scale])
    cs = torch.cat([torch.ones(1, D // 2), torch.zeros(1, D // 2)], dim=1)
    pos = torch.zeros(T, dtype=torch.long)
    rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, torch.arange(T), k_scale=sc, v_scale=sc)
    m = reference.FP8_MAX[fp8]
    assert torch.equal(_fp8_bits(vc[:, 0]), _fp8_bits((v / sc).clamp(-m, m).to(fp8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [8, 40, 130, 512])
def test_qk_norm_pass_features_identical_across_sets(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    T, Hq, Hk, Hv = 7, 11, 8, 1  # AVX2 sums eight heads at a time (D a multiple of 16), the rest one by one
    qkv = (torch.randn(T, (Hq + Hk + Hv) * dim, generator=g) * 4).to(dtype)
    qkv.unflatten(-1, (Hq + Hk + Hv, dim))[:, 1::3] *= 1e-3  # heads of unequal scales
    qw, kw = torch.randn(dim, generator=g), torch.randn(dim, generator=g).to(dtype)
    pos = torch.randint(0, 32, (T,), generator=g)
    cs = reference.cos_sin_table(32, 2).float()  # one rotated pair: the other features are the norm's output
    outs = {}
    for name in ISAS:
        previous = rope_ext._set_cpu_isa(name)
        try:
            out = qkv.clone()
            rope_ext.apply_qk_norm_rotary_(out, Hq, Hk, Hv, qw, kw, pos, cs, weight_offset=0.5)
            outs[name] = out.unflatten(-1, (Hq + Hk + Hv, dim))[..., 2:]
        finally:
            rope_ext._set_cpu_isa(previous)
    first = outs[ISAS[0]]
    for name, out in outs.items():
        assert torch.equal(out, first), name
    want = reference.qk_norm_rotary(qkv, Hq, Hk, Hv, qw, kw, pos, cs, weight_offset=0.5)
    want = want.unflatten(-1, (Hq + Hk + Hv, dim))[..., 2:]
    # 16-bit dtypes: the float32 norm's error (a few float32 ulps) is far below the dtype's ulp, so its
    # rounding lands at most one ulp from the float64 reference's. float32: the error of the float32 sum
    # of squares over up to 512 features and of the three products, bounded by 64 ulps.
    ulps = 64.0 if dtype == torch.float32 else 1.0
    ulp = torch.finfo(dtype).eps * want.double().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((first.double() - want.double()).abs() <= ulps * ulp * 1.0001).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [26, 48, 64, 128, 160])
def test_qk_norm_rotated_features_identical_across_sets(interleaved, dtype, dim):
    """Under the identity rotation (cos 1, sin 0) of every feature, the rotated features are the normalised
    values themselves (x * 1 - y * 0 is x in any rounding): every set's rotation paths (bf16 16-lane blocks,
    8-lane blocks, scalar tails: dims 26, 48, 64, 128, 160 reach each) normalise to the bits of the portable
    pass-through path."""
    g = torch.Generator().manual_seed(dim + interleaved)
    T, Hq, Hk, Hv = 5, 10, 8, 1
    qkv = (torch.randn(T, (Hq + Hk + Hv) * dim, generator=g) * 4).to(dtype)
    qw, kw = torch.randn(dim, generator=g), torch.randn(dim, generator=g).to(dtype)
    pos = torch.randint(0, 8, (T,), generator=g)

    def identity(width):
        return torch.cat([torch.ones(8, width // 2), torch.zeros(8, width // 2)], dim=1)

    def run(name, width):
        previous = rope_ext._set_cpu_isa(name)
        try:
            out = qkv.clone()
            rope_ext.apply_qk_norm_rotary_(
                out, Hq, Hk, Hv, qw, kw, pos, identity(width), interleaved=interleaved, weight_offset=0.25
            )
            return out.unflatten(-1, (Hq + Hk + Hv, dim))[:, : Hq + Hk]
        finally:
            rope_ext._set_cpu_isa(previous)

    passed = run("scalar", 2)  # features 2.. normalised by the pass-through path
    for name in ISAS:
        got = run(name, dim)
        assert torch.equal(got[..., 2:], passed[..., 2:]), name
        assert torch.equal(got, run("scalar", dim)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_norm_many_heads_identical_across_sets(dtype):
    """Many values, so that a scale one float32 ulp off shows in some 16-bit output: every set's RMSNorm
    scales (AVX2: eight heads at a time) are the portable build's, head for head."""
    g = torch.Generator().manual_seed(7)
    T, Hq, Hk, Hv, dim = 192, 13, 8, 0, 128
    qkv = torch.randn(T, (Hq + Hk) * dim, generator=g) * torch.exp2(
        torch.randint(-6, 7, (T, (Hq + Hk) * dim), generator=g)
    )
    qkv = qkv.to(dtype)
    qw, kw = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    pos = torch.randint(0, 32, (T,), generator=g)
    cs = reference.cos_sin_table(32, 2).float()
    outs = {}
    for name in ISAS:
        previous = rope_ext._set_cpu_isa(name)
        try:
            out = qkv.clone()
            rope_ext.apply_qk_norm_rotary_(out, Hq, Hk, Hv, qw, kw, pos, cs)
            outs[name] = out.unflatten(-1, (Hq + Hk, dim))[..., 2:]
        finally:
            rope_ext._set_cpu_isa(previous)
    for name, out in outs.items():
        assert torch.equal(out, outs["scalar"]), name


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 96, 128])
def test_qk_norm_whole_heads_special_values_identical_across_sets(interleaved, dtype, dim):
    """Heads rotated whole (rotary_dim = head_dim: the vector sets' one-pass head loop for 64 and 128, the
    two-pass one for 96) give the portable build's bits with NaN, infinities, zero heads and outputs that
    round to subnormals (tiny weights), for odd and even head counts (the loop's last head)."""
    g = torch.Generator().manual_seed(dim * 2 + interleaved)
    T, Hq, Hk, Hv = 7, 13, 8, 1
    qkv = torch.randn(T, (Hq + Hk + Hv) * dim, generator=g) * torch.exp2(
        torch.randint(-4, 5, (T, (Hq + Hk + Hv) * dim), generator=g)
    )
    heads = qkv.view(T, Hq + Hk + Hv, dim)
    heads[0, 1, 3] = float("nan")
    heads[1, 2, 5] = float("inf")
    heads[2, 14, 0] = float("-inf")
    heads[3, 4] = 0.0
    qkv = qkv.to(dtype)
    qw = torch.randn(dim, generator=g)
    kw = torch.randn(dim, generator=g) * 1e-39  # normalised k rounds to subnormals (or zero)
    kw[::7] = 1.0
    pos = torch.randint(0, 64, (T,), generator=g)
    cs = reference.cos_sin_table(64, dim).float()

    def run(name):
        previous = rope_ext._set_cpu_isa(name)
        try:
            out = qkv.clone()
            rope_ext.apply_qk_norm_rotary_(out, Hq, Hk, Hv, qw, kw, pos, cs, interleaved=interleaved)
            return out
        finally:
            rope_ext._set_cpu_isa(previous)

    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    want = run("scalar")
    assert want.isnan().any() and (want != 0).any()
    for name in ISAS:
        assert torch.equal(run(name).view(bits), want.view(bits)), name


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float32, torch.float8_e5m2),
    ],
)
def test_cache_write_streamed_rows_equal_one_token_calls(isa, dtype, cache_dtype):
    """A call whose cache rows (copied, or quantized to fp8) add up to 64 KiB or more writes them with
    streaming stores (the vector sets; fp8: AVX-512), a decode step with plain stores: the same bytes, and
    the rows of the slots not named stay as they were."""
    g = torch.Generator().manual_seed(7)
    T, Hq, Hk, D, bs = 520, 4, 8, 128, 16
    assert T * Hk * 2 * D * cache_dtype.itemsize >= 64 << 10
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dtype)
    slots = torch.randperm(2 * T, generator=g)[:T]
    slots[::37] = -1  # padding: not written
    cs = reference.cos_sin_table(64, D).float()
    positions = torch.randint(0, 64, (T,), generator=g)
    caches = torch.randn(2, 2 * T // bs, bs, Hk, D, generator=g).to(cache_dtype)
    results = []
    for per_token in (False, True):
        x, c = qkv.clone(), caches.clone()
        q, k, v = (t.view(T, -1, D) for t in x.split([Hq * D, Hk * D, Hk * D], dim=1))
        steps = [slice(t, t + 1) for t in range(T)] if per_token else [slice(0, T)]
        for s in steps:
            rope_ext.apply_rotary_qk_and_cache_(q[s], k[s], v[s], positions[s], cs, c[0], c[1], slots[s])
        results.append((x, c))
    (x1, c1), (x2, c2) = results
    assert torch.equal(x1.view(torch.uint8), x2.view(torch.uint8))
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    unwritten = torch.ones(2 * T, dtype=torch.bool)
    unwritten[slots[slots >= 0]] = False
    assert torch.equal(c1.flatten(1, 2)[:, unwritten], caches.flatten(1, 2)[:, unwritten])

"""The float64 references for the serving fusions in rope_ext.reference: ``rms_norm``, ``qk_norm_rotary`` (and
its differentiable ``qk_norm_rotary_unfused``), ``quantize_fp8`` and ``kv_cache_write``, checked against hand
computations, torch's own ops and transformers-style eager code."""

from __future__ import annotations

import math

import pytest
import torch

import rope_ext
from rope_ext import reference
from rope_ext.bench.baselines import hf_apply_rotary_pos_emb

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# NaNs with a payload: guard values whose bits must survive untouched.
GUARD = {torch.float32: 0x7FC00123, torch.float16: 0x7E01, torch.bfloat16: 0x7FC1}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in FP8:
        return t.view(torch.uint8)
    return t.view(INT_VIEW[t.dtype])


def _table(rotary_dim: int, positions: int = 64) -> torch.Tensor:
    return rope_ext.RopeCache(rotary_dim, max_positions=positions).cos_sin


# rms_norm ------------------------------------------------------------------------------------------------


def test_rms_norm_by_hand_and_torch():
    g = _gen(0)
    x = torch.randn(5, 3, 16, generator=g)
    w = torch.randn(16, generator=g)
    eps = 1e-5
    out = reference.rms_norm(x, w, eps)
    assert out.dtype == torch.float64 and out.shape == x.shape
    rows = x.double().reshape(-1, 16).tolist()
    weights = w.tolist()
    by_hand = []
    for row in rows:
        rms = math.sqrt(math.fsum(u * u for u in row) / 16 + eps)
        by_hand.append([u / rms * wj for u, wj in zip(row, weights, strict=True)])
    torch.testing.assert_close(
        out.reshape(-1, 16), torch.tensor(by_hand, dtype=torch.float64), rtol=1e-14, atol=0
    )
    expected = torch.nn.functional.rms_norm(x.double(), (16,), w.double(), eps)
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_weight_offset(dtype):
    g = _gen(1)
    x = torch.randn(7, 32, generator=g).to(dtype)
    w = (0.1 * torch.randn(32, generator=g)).to(dtype)
    out = reference.rms_norm(x, w, 1e-6, weight_offset=1.0)
    assert out.dtype == torch.float64
    assert torch.equal(out, reference.rms_norm(x, w.double() + 1.0, 1e-6))
    assert torch.equal(reference.rms_norm(x, w, 1e-6), reference.rms_norm(x.double(), w.double(), 1e-6))


# qk_norm_rotary ------------------------------------------------------------------------------------------

HEADS = [(4, 2, 2), (2, 2, 2), (3, 1, 1)]
# (D, rotary_dim, interleaved, weight_offset)
SHAPES = [(16, 16, False, 0.0), (16, 16, True, 1.0), (16, 8, False, 1.0), (32, 16, True, 0.0)]
ACT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _qkv(dtype, heads, d, seed, tokens=6):
    g = _gen(seed)
    hq, hk, hv = heads
    qkv = (2.0 * torch.randn(tokens, (hq + hk + hv) * d, generator=g)).to(dtype)
    q_weight = (1.0 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    k_weight = (1.0 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    return qkv, q_weight, k_weight, positions


def _split(t, heads, d):
    hq, hk, _ = heads
    x = t.reshape(t.shape[0], -1, d)
    return x[:, :hq], x[:, hq : hq + hk], x[:, hq + hk :]


def _cos_sin_rows(cos_sin, positions, interleaved, dtype):
    rows = cos_sin[positions].to(dtype)
    h = cos_sin.shape[-1] // 2
    c, s = rows[:, :h], rows[:, h:]
    if interleaved:
        return c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    return torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)


def _eager(qkv, heads, d, q_weight, k_weight, positions, cos_sin, eps, interleaved, weight_offset):
    """transformers' unfused path in the activation dtype: Qwen3's RMSNorm (weight_offset 0) or Gemma's
    (weight_offset 1), then ``apply_rotary_pos_emb`` with cos/sin in the activation dtype."""
    dtype = qkv.dtype
    q, k, v = _split(qkv, heads, d)

    def norm(h, w):
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        if weight_offset:
            return (hf * (weight_offset + w.float())).to(dtype)
        return w * hf.to(dtype)

    cos, sin = _cos_sin_rows(cos_sin, positions, interleaved, dtype)
    qr, kr = hf_apply_rotary_pos_emb(norm(q, q_weight), norm(k, k_weight), cos, sin, interleaved)
    return torch.cat([qr, kr, v], dim=1).reshape(qkv.shape)


@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("d, rotary_dim, interleaved, weight_offset", SHAPES)
def test_qk_norm_rotary_hand_composition(dtype, heads, d, rotary_dim, interleaved, weight_offset):
    qkv, q_weight, k_weight, positions = _qkv(dtype, heads, d, seed=d + rotary_dim + sum(heads))
    _bits(qkv)[0, -1] = GUARD[dtype]
    v_before = _split(qkv, heads, d)[2].clone()
    cos_sin = _table(rotary_dim)
    eps = 1e-6
    out = reference.qk_norm_rotary(
        qkv,
        *heads,
        q_weight,
        k_weight,
        positions,
        cos_sin,
        eps=eps,
        interleaved=interleaved,
        weight_offset=weight_offset,
    )
    assert out.shape == qkv.shape and out.dtype == dtype
    q, k, v = _split(qkv, heads, d)
    oq, ok, ov = _split(out, heads, d)
    assert torch.equal(_bits(ov), _bits(v_before))

    def norm(h, w):
        h = h.double()
        return (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + weight_offset)).to(
            dtype
        )

    cos, sin = _cos_sin_rows(cos_sin, positions, interleaved, torch.float64)
    nq, nk = norm(q, q_weight), norm(k, k_weight)
    eq, ek = hf_apply_rotary_pos_emb(nq.double(), nk.double(), cos, sin, interleaved)
    assert torch.equal(oq, eq.to(dtype))
    assert torch.equal(ok, ek.to(dtype))
    assert torch.equal(oq[..., rotary_dim:], nq[..., rotary_dim:])
    assert torch.equal(ok[..., rotary_dim:], nk[..., rotary_dim:])


@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("heads", HEADS[:2])
@pytest.mark.parametrize("d, rotary_dim, interleaved, weight_offset", SHAPES)
def test_qk_norm_rotary_vs_eager(dtype, heads, d, rotary_dim, interleaved, weight_offset):
    """Within a few ulps of transformers' unfused code run in the activation dtype."""
    qkv, q_weight, k_weight, positions = _qkv(dtype, heads, d, seed=100 + d + rotary_dim)
    if weight_offset:
        q_weight, k_weight = q_weight - 1, k_weight - 1
    cos_sin = _table(rotary_dim)
    args = (qkv, *heads, q_weight, k_weight, positions, cos_sin)
    out = reference.qk_norm_rotary(*args, eps=1e-6, interleaved=interleaved, weight_offset=weight_offset)
    eager = _eager(qkv, heads, d, q_weight, k_weight, positions, cos_sin, 1e-6, interleaved, weight_offset)
    err = (out.double() - eager.double()).abs().amax(dim=-1)
    scale = out.double().abs().amax(dim=-1)
    assert (err <= 4 * torch.finfo(dtype).eps * scale).all()


def _exact_norm_heads(tokens, heads, d, g):
    """Heads whose mean square is exactly ``4 * 4^e``: groups of 8 integers with squares summing to 32, signed
    and shuffled, times ``2^e``; with ``eps=0`` their RMSNorm is a division by a power of two."""
    groups = torch.tensor([[5, 1, 1, 1, 1, 1, 1, 1], [3, 3, 3, 1, 1, 1, 1, 1], [4, 2, 2, 2, 1, 1, 1, 1]])
    n = tokens * heads * (d // 8)
    vals = groups[torch.randint(0, 3, (n,), generator=g)].float()
    perm = torch.rand(n, 8, generator=g).argsort(dim=-1)
    vals = vals.gather(1, perm) * (torch.randint(0, 2, (n, 8), generator=g) * 2 - 1)
    scale = torch.exp2(torch.randint(-3, 4, (tokens, heads, 1), generator=g).float())
    return vals.reshape(tokens, heads, d) * scale


@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("d, rotary_dim, interleaved, weight_offset", SHAPES)
def test_qk_norm_rotary_exact_where_eager_is_exact(dtype, d, rotary_dim, interleaved, weight_offset):
    """With power-of-two RMS, few-bit weights and ``eps=0`` the norm is exact in every dtype: the output then
    equals transformers' eager code bit for bit at position 0 (cos 1, sin 0) and on pass-through features."""
    heads, tokens = (4, 2, 2), 8
    g = _gen(7 + d + rotary_dim)
    qkv = _exact_norm_heads(tokens, sum(heads), d, g).reshape(tokens, -1).to(dtype)
    sign = torch.randint(0, 2, (2, d), generator=g) * 2 - 1
    w = (torch.randint(1, 16, (2, d), generator=g) * sign / 8).to(dtype)
    if weight_offset:
        w = w - weight_offset
    positions = torch.randint(1, 64, (tokens,), generator=g)
    positions[::3] = 0
    cos_sin = _table(rotary_dim)
    args = (qkv, *heads, w[0], w[1], positions, cos_sin)
    out = reference.qk_norm_rotary(*args, eps=0.0, interleaved=interleaved, weight_offset=weight_offset)
    eager = _eager(qkv, heads, d, w[0], w[1], positions, cos_sin, 0.0, interleaved, weight_offset)
    at0 = positions == 0
    assert torch.equal(_bits(out[at0]), _bits(eager[at0]))
    o, e = out.reshape(tokens, -1, d), eager.reshape(tokens, -1, d)
    assert torch.equal(_bits(o[..., rotary_dim:]), _bits(e[..., rotary_dim:]))
    err = (out.double() - eager.double()).abs().amax(dim=-1)
    assert (err <= 4 * torch.finfo(dtype).eps * out.double().abs().amax(dim=-1)).all()


def test_qk_norm_rotary_does_not_modify_input_and_rejects_bad_shapes():
    qkv, qw, kw, pos = _qkv(torch.bfloat16, (2, 1, 1), 16, seed=3)
    before = qkv.clone()
    reference.qk_norm_rotary(qkv, 2, 1, 1, qw, kw, pos, _table(16))
    assert torch.equal(_bits(qkv), _bits(before))
    with pytest.raises(ValueError):
        reference.qk_norm_rotary(qkv, 2, 2, 1, qw, kw, pos, _table(16))
    with pytest.raises(ValueError):
        reference.qk_norm_rotary(qkv, 2, 1, 1, qw, kw, pos, _table(32))
    with pytest.raises(ValueError):
        reference.qk_norm_rotary(qkv, 2, 1, 1, qw, kw, pos[:-1], _table(16))


@pytest.mark.parametrize("rotary_dim, interleaved, weight_offset", [(8, False, 0.0), (4, True, 1.0)])
def test_qk_norm_rotary_unfused_gradcheck(rotary_dim, interleaved, weight_offset):
    g = _gen(11)
    q = torch.randn(3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    qw = (1 + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)).requires_grad_()
    kw = (1 + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)).requires_grad_()
    pos = torch.tensor([0, 5, 17])
    cos_sin = _table(rotary_dim).double()

    def f(q, k, qw, kw):
        return reference.qk_norm_rotary_unfused(
            q, k, qw, kw, pos, cos_sin, eps=1e-6, interleaved=interleaved, weight_offset=weight_offset
        )

    assert torch.autograd.gradcheck(f, (q, k, qw, kw))
    qkv = torch.cat([q, k, k], dim=1).detach().reshape(3, -1)
    fused = reference.qk_norm_rotary(
        qkv,
        2,
        1,
        1,
        qw.detach(),
        kw.detach(),
        pos,
        cos_sin,
        eps=1e-6,
        interleaved=interleaved,
        weight_offset=weight_offset,
    )
    uq, uk = f(q, k, qw, kw)
    assert torch.equal(fused.reshape(3, 4, 8)[:, :2], uq.detach())
    assert torch.equal(fused.reshape(3, 4, 8)[:, 2:3], uk.detach())


# quantize_fp8 and kv_cache_write -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_fp8_saturates_keeps_nan_and_rounds_like_torch(dtype):
    m = reference.FP8_MAX[dtype]
    assert m == torch.finfo(dtype).max
    scale = torch.tensor([0.37], dtype=torch.float32)
    g = _gen(5)
    x = torch.cat(
        [
            torch.randn(64, generator=g) * 40,
            torch.tensor([float("nan"), float("inf"), -float("inf"), 3 * m, -3 * m, m * 0.37, -m * 0.37]),
        ]
    ).to(torch.bfloat16)
    out = reference.quantize_fp8(x, scale, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    expected = (x.float() / scale).clamp(-m, m).to(dtype)
    assert torch.equal(_bits(out), _bits(expected))
    f = out.float()
    assert torch.isnan(f[64]) and not torch.isnan(f[65:]).any()
    assert f[65:].tolist()[:4] == [m, -m, m, -m]
    assert f.nan_to_num(0.0).abs().max() <= m
    assert torch.equal(_bits(reference.quantize_fp8(x, 0.37, dtype)), _bits(out))


def test_quantize_fp8_rounds_to_nearest_even():
    x = torch.tensor([1.0625, 1.1875, -1.0625, 1.25 + 1 / 32])
    out = reference.quantize_fp8(x, torch.tensor([1.0]), torch.float8_e4m3fn).float()
    assert out.tolist() == [1.0, 1.25, -1.0, 1.25]
    out = reference.quantize_fp8(x, torch.tensor([1.0]), torch.float8_e5m2).float()
    assert out.tolist() == [1.0, 1.25, -1.0, 1.25]


def _caches(layout, num_blocks, block_size, hk, d, dv, dtype, g):
    """Caches full of guard bits: a NaN with a payload for float caches, random bytes for fp8 ones."""

    def one(dim):
        shape = (num_blocks, block_size, hk, dim) if layout == "NHD" else (num_blocks, hk, block_size, dim)
        if dtype in FP8:
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
        return torch.full(shape, GUARD[dtype], dtype=INT_VIEW[dtype]).view(dtype)

    return one(d), one(dv)


def _expected(x, cache, slots, layout, scale):
    out = cache.clone()
    bs = cache.shape[1] if layout == "NHD" else cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        val = x[t]
        if cache.dtype in FP8:
            m = torch.finfo(cache.dtype).max
            val = (val.float() / scale).clamp(-m, m).to(cache.dtype)
        if layout == "NHD":
            out[s // bs, s % bs] = val
        else:
            out[s // bs, :, s % bs] = val
    return out


def _slots(n_slots, tokens, written, g):
    slots = torch.randperm(n_slots, generator=g)[:written].clone()
    slots[torch.randperm(written, generator=g)[:2]] = -1
    return slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_cache_write(layout, block_size, dtype):
    g = _gen(block_size)
    tokens, hk, d, dv = 12, 2, 8, 4
    num_blocks = max(2, 40 // block_size)
    k = torch.randn(tokens, hk, d, generator=g).to(dtype)
    v = torch.randn(tokens, hk, dv, generator=g).to(dtype)
    kc, vc = _caches(layout, num_blocks, block_size, hk, d, dv, dtype, g)
    kc0, vc0 = kc.clone(), vc.clone()
    slots = _slots(num_blocks * block_size, tokens, 9, g)
    out_k, out_v = reference.kv_cache_write(k, v, kc, vc, slots, layout=layout)
    assert torch.equal(_bits(kc), _bits(kc0)) and torch.equal(_bits(vc), _bits(vc0))
    assert torch.equal(_bits(out_k), _bits(_expected(k, kc0, slots, layout, None)))
    assert torch.equal(_bits(out_v), _bits(_expected(v, vc0, slots, layout, None)))
    assert torch.isnan(out_k.float()).sum() == kc0.numel() - 7 * hk * d
    ignored = reference.kv_cache_write(
        k, v, kc, vc, slots, layout=layout, k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0])
    )
    assert torch.equal(_bits(ignored[0]), _bits(out_k)) and torch.equal(_bits(ignored[1]), _bits(out_v))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("block_size", [1, 16])
def test_kv_cache_write_fp8(layout, dtype, block_size):
    g = _gen(20 + block_size)
    tokens, hk, d = 10, 2, 8
    m = torch.finfo(dtype).max
    k_scale, v_scale = torch.tensor([0.25]), torch.tensor([3.7])
    k = (torch.randn(tokens, hk, d, generator=g) * 80).to(torch.bfloat16)
    v = (torch.randn(tokens, hk, d, generator=g) * 80).to(torch.bfloat16)
    k[0, 0, :4] = torch.tensor([float("nan"), float("inf"), 2 * m, -2 * m])
    v[0, 1, :4] = torch.tensor([-float("inf"), float("nan"), 4 * m, -4 * m])
    num_blocks = max(2, 24 // block_size)
    kc, vc = _caches(layout, num_blocks, block_size, hk, d, d, dtype, g)
    slots = _slots(num_blocks * block_size, tokens, 8, g)
    slots[slots == 3] = slots[0].item()
    slots[0] = 3
    out_k, out_v = reference.kv_cache_write(
        k, v, kc, vc, slots, layout=layout, k_scale=k_scale, v_scale=v_scale
    )
    assert out_k.dtype == dtype
    assert torch.equal(_bits(out_k), _bits(_expected(k, kc, slots, layout, k_scale)))
    assert torch.equal(_bits(out_v), _bits(_expected(v, vc, slots, layout, v_scale)))
    b, o = 3 // block_size, 3 % block_size
    sk = (out_k[b, o] if layout == "NHD" else out_k[b, :, o]).float()
    sv = (out_v[b, o] if layout == "NHD" else out_v[b, :, o]).float()
    assert torch.isnan(sk[0, 0]) and sk[0, 1:4].tolist() == [m, m, -m]
    assert torch.isnan(sv[1, 1]) and sv[1, [0, 2, 3]].tolist() == [-m, m, -m]
    unscaled = reference.kv_cache_write(k, v, kc, vc, slots, layout=layout)
    assert torch.equal(_bits(unscaled[0]), _bits(_expected(k, kc, slots, layout, torch.tensor(1.0))))


def test_kv_cache_write_rejects_bad_slots():
    g = _gen(9)
    k = torch.randn(4, 1, 8, generator=g)
    kc, vc = _caches("NHD", 2, 4, 1, 8, 8, torch.float32, g)
    write = reference.kv_cache_write
    for bad in ([0, 8], [-2, 1], [1, 1], [0, 1, 2, 3, 4]):
        with pytest.raises(ValueError):
            write(k, k, kc, vc, torch.tensor(bad))
    with pytest.raises(ValueError):
        write(k, k, kc, vc, torch.tensor([0, 1]), layout="NDH")
    with pytest.raises(TypeError):
        write(k, k, kc.double(), vc.double(), torch.tensor([0, 1]))
    out_k, _ = write(k, k, kc, vc, torch.tensor([-1, 7, -1]))
    assert torch.equal(out_k[1, 3], k[1]) and torch.isnan(out_k.reshape(8, 8)[:7]).all()

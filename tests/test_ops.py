"""The rotary ops against the float64 references, on every backend (CPU, CUDA, CUDA body emulated)."""

from __future__ import annotations

import pytest
import torch
from _helpers import DTYPES, assert_close_to_reference, requires_emulation
from backends import BACKENDS, device_of, emulate, rotate_qk

import rope_ext
from rope_ext import reference

# (rotary_dim, head_dim): partial rotary of GPT-NeoX, Phi-2/StableLM-like, Phi-2, GPT-J; then full.
DIMS = [(24, 96), (20, 80), (32, 80), (64, 256), (64, 64), (128, 128), (256, 256)]
LAYOUTS = ["thd", "bshd", "bshd-shared", "bhsd", "sbhd"]


def make_qk(layout, dtype, device, *, head_dim, hq=4, hk=2, b=2, s=5, n_positions=4096, gen=None):
    """Random q, k (GQA head counts) and positions in `layout`, each tensor laid out as that layout
    would be in memory (BHSD is a permuted BSHD buffer, SBHD is seq-major)."""
    g = gen or torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)

    def pos(*shape):
        return torch.randint(0, n_positions, shape, generator=g).to(device)

    if layout == "thd":
        t = b * s
        return rnd(t, hq, head_dim), rnd(t, hk, head_dim), pos(t, 1)
    if layout == "bshd":
        return rnd(b, s, hq, head_dim), rnd(b, s, hk, head_dim), pos(b, s, 1)
    if layout == "bshd-shared":
        return rnd(b, s, hq, head_dim), rnd(b, s, hk, head_dim), pos(s, 1)
    if layout == "bhsd":
        q = rnd(b, s, hq, head_dim).transpose(1, 2)
        k = rnd(b, s, hk, head_dim).transpose(1, 2)
        return q, k, pos(b, 1, s)
    if layout == "sbhd":
        return rnd(s, b, hq, head_dim), rnd(s, b, hk, head_dim), pos(s, 1, 1)
    raise ValueError(layout)


def check(out, x, positions, cos_sin, interleaved, inverse=False):
    ref = reference.rotary_hadamard(x, positions, cos_sin, interleaved=interleaved, inverse=inverse)
    assert_close_to_reference(out.cpu(), ref.cpu(), x.abs().max().item())


# ---------------------------------------------------------------------------------------------
# References


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim,head_dim", [(8, 8), (24, 96), (64, 64), (32, 80)])
def test_three_references_agree(interleaved, rotary_dim, head_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 2, head_dim, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 5000, (3, 7, 1), generator=g)
    cs = reference.cos_sin_table(5000, rotary_dim, 500000.0)
    for inverse in (False, True):
        a = reference.rotary_matrix(x, pos, cs, interleaved=interleaved, inverse=inverse)
        b = reference.rotary_complex(x, pos, cs, interleaved=interleaved, inverse=inverse)
        c = reference.rotary_hadamard(x, pos, cs, interleaved=interleaved, inverse=inverse)
        assert (a - b).abs().max() < 1e-12 and (a - c).abs().max() < 1e-12
        assert torch.equal(c[..., rotary_dim:], x[..., rotary_dim:])
    # The rotation preserves the norm of each pair, and inverse undoes it.
    y = reference.rotary_hadamard(x, pos, cs, interleaved=interleaved)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-12)
    back = reference.rotary_hadamard(y, pos, cs, interleaved=interleaved, inverse=True)
    assert (back - x).abs().max() < 1e-12


def test_seed_worked_example():
    """x = [0.0, 0.1, ..., 0.7] at position 2, interleaved, base 10000 (the seed notebook)."""
    x = torch.arange(8, dtype=torch.float32) / 10
    cache = rope_ext.RopeCache(8, 10000.0, max_positions=4)
    out = rope_ext.apply_rotary(x[None], torch.tensor([2]), cache.cos_sin, interleaved=True)[0]
    expected = torch.tensor([-0.0909, -0.0416, 0.1364, 0.3338, 0.3899, 0.5079, 0.5986, 0.7012])
    assert torch.allclose(out, expected, atol=5e-5)
    ref = reference.rotary_matrix(x[None], torch.tensor([2]), reference.cos_sin_table(4, 8), interleaved=True)
    assert torch.allclose(ref[0].float(), expected, atol=5e-5)


# ---------------------------------------------------------------------------------------------
# Ops vs reference


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim,head_dim", DIMS)
def test_dims_dtypes(backend, dtype, interleaved, rotary_dim, head_dim):
    dev = device_of(backend)
    q, k, pos = make_qk("thd", dtype, dev, head_dim=head_dim)
    cs = rope_ext.RopeCache(rotary_dim, 10000.0, max_positions=4096, device=dev).cos_sin
    for inplace in (False, True):
        qi, ki = (q.clone(), k.clone()) if inplace else (q, k)
        qo, ko = rotate_qk(backend, qi, ki, pos, cs, interleaved=interleaved, inplace=inplace)
        check(qo, q, pos, cs, interleaved)
        check(ko, k, pos, cs, interleaved)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_layouts(backend, layout, dtype, interleaved):
    dev = device_of(backend)
    q, k, pos = make_qk(layout, dtype, dev, head_dim=128)
    cs = rope_ext.RopeCache(128, 500000.0, max_positions=4096, device=dev).cos_sin
    for inplace in (False, True):
        qi, ki = (q.clone(), k.clone()) if inplace else (q, k)
        qo, ko = rotate_qk(backend, qi, ki, pos, cs, interleaved=interleaved, inplace=inplace)
        check(qo, q, pos, cs, interleaved)
        check(ko, k, pos, cs, interleaved)
        if not inplace:
            assert qo.shape == q.shape and qo.dtype == q.dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32, 20])
def test_packed_qkv_slices(backend, dtype, rotary_dim):
    """q, k, v sliced from one packed [T, (Hq + 2 Hk) * D] tensor: rotated with no copy; v untouched."""
    dev = device_of(backend)
    t, hq, hk, d = 9, 4, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype=dtype, device=dev)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :]
    pos = torch.randint(0, 1000, (t, 1), generator=g).to(dev)
    cs = rope_ext.RopeCache(rotary_dim, max_positions=1000, device=dev).cos_sin
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    qo, ko = rotate_qk(backend, q, k, pos, cs, interleaved=False)
    check(qo, q0, pos, cs, False)
    check(ko, k0, pos, cs, False)
    qo, ko = rotate_qk(backend, q, k, pos, cs, interleaved=False, inplace=True)
    assert qo.data_ptr() == q.data_ptr()
    check(q, q0, pos, cs, False)
    check(k, k0, pos, cs, False)
    assert torch.equal(v, v0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_and_strided(backend):
    dev = device_of(backend)
    g = torch.Generator().manual_seed(4)
    base = torch.randn(6, 3, 10, 64, generator=g).to(dev)
    x = base.transpose(0, 2)[::2, :, ::3]  # [5, 3, 2, 64], steps on non-last dims
    pos = torch.randint(0, 100, (5, 1, 2), generator=g).to(dev)
    cs = rope_ext.RopeCache(48, max_positions=100, device=dev).cos_sin
    for il in (False, True):
        out, _ = rotate_qk(backend, x, None, pos, cs, interleaved=il)
        check(out, x, pos, cs, il)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
def test_positions_unsorted_repeated_large(backend, pos_dtype):
    dev = device_of(backend)
    n = 1_000_001
    cs = rope_ext.RopeCache(16, 10000.0, max_positions=n, device=dev).cos_sin
    g = torch.Generator().manual_seed(5)
    pos = torch.tensor([1_000_000, 3, 3, 0, 999_999, 524_288, 3, 77], dtype=pos_dtype).to(dev)[:, None]
    x = torch.randn(8, 3, 32, generator=g).to(dev)
    for il in (False, True):
        out, _ = rotate_qk(backend, x, None, pos, cs, interleaved=il)
        check(out, x, pos, cs, il)
    assert torch.equal(out[1], rotate_qk(backend, x[1:2], None, pos[1:2], cs, interleaved=True)[0][0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_in_x_dtype(backend, dtype):
    """cos_sin may be float32 or x's dtype; the result uses the cache values as given."""
    dev = device_of(backend)
    q, k, pos = make_qk("thd", dtype, dev, head_dim=64)
    cs = rope_ext.RopeCache(64, max_positions=4096, device=dev, dtype=dtype).cos_sin
    qo, ko = rotate_qk(backend, q, k, pos, cs, interleaved=False)
    check(qo, q, pos, cs, False)
    check(ko, k, pos, cs, False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_qk_equals_two_calls_and_inverse(backend, interleaved):
    dev = device_of(backend)
    q, k, pos = make_qk("bshd", torch.float32, dev, head_dim=80)
    cs = rope_ext.RopeCache(32, max_positions=4096, device=dev).cos_sin
    qo, ko = rotate_qk(backend, q, k, pos, cs, interleaved=interleaved)
    q1, _ = rotate_qk(backend, q, None, pos, cs, interleaved=interleaved)
    k1, _ = rotate_qk(backend, k, None, pos, cs, interleaved=interleaved)
    assert torch.equal(qo, q1) and torch.equal(ko, k1)
    back, _ = rotate_qk(backend, qo, None, pos, cs, interleaved=interleaved, inverse=True)
    assert (back - q).abs().max().item() < 1e-5
    check(back, qo, pos, cs, interleaved, inverse=True)
    # inverse on the q+k ops, out of place and in place: the reference's inverse rotation, both tensors.
    qb, kb = rotate_qk(backend, qo, ko, pos, cs, interleaved=interleaved, inverse=True)
    check(qb, qo, pos, cs, interleaved, inverse=True)
    check(kb, ko, pos, cs, interleaved, inverse=True)
    qi, ki = qo.clone(), ko.clone()
    rotate_qk(backend, qi, ki, pos, cs, interleaved=interleaved, inverse=True, inplace=True)
    assert torch.equal(qi, qb) and torch.equal(ki, kb)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_matches_out_of_place_bitwise(backend):
    dev = device_of(backend)
    for dtype in DTYPES:
        q, k, pos = make_qk("bshd", dtype, dev, head_dim=96)
        cs = rope_ext.RopeCache(96, max_positions=4096, device=dev).cos_sin
        qo, ko = rotate_qk(backend, q, k, pos, cs, interleaved=False)
        qi, ki = q.clone(), k.clone()
        rotate_qk(backend, qi, ki, pos, cs, interleaved=False, inplace=True)
        assert torch.equal(qo, qi) and torch.equal(ko, ki)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seq_first_half_of_features(backend):
    """[S, B, H, D] rotating only the first half of the features, half-split pairing (labml style)."""
    dev = device_of(backend)
    s, b, h, d = 12, 2, 3, 64
    x = torch.randn(s, b, h, d, generator=torch.Generator().manual_seed(6)).to(dev)
    cs = rope_ext.RopeCache(d // 2, max_positions=s, device=dev).cos_sin
    pos = torch.arange(s, device=dev)[:, None, None]
    out, _ = rotate_qk(backend, x, None, pos, cs, interleaved=False)
    check(out, x, pos, cs, False)
    # Straight from the annotated module's math.
    theta = 1.0 / (10000 ** (torch.arange(0, d // 2, 2, dtype=torch.float64) / (d // 2)))
    idx = torch.einsum("n,d->nd", torch.arange(s, dtype=torch.float64), theta)
    idx = torch.cat([idx, idx], dim=1)
    xr = x.double().cpu()
    x_rope, x_pass = xr[..., : d // 2], xr[..., d // 2 :]
    neg_half = torch.cat([-x_rope[..., d // 4 :], x_rope[..., : d // 4]], dim=-1)
    expected = torch.cat(
        [x_rope * idx.cos()[:, None, None, :] + neg_half * idx.sin()[:, None, None, :], x_pass], dim=-1
    )
    assert (out.double().cpu() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_is_noop(backend):
    dev = device_of(backend)
    cs = rope_ext.RopeCache(8, max_positions=4, device=dev).cos_sin
    for shape, pshape in [((0, 2, 8), (0, 1)), ((3, 0, 8), (3, 1)), ((0, 8), (0,))]:
        x = torch.empty(shape, device=dev)
        pos = torch.zeros(pshape, dtype=torch.long, device=dev)
        out, _ = rotate_qk(backend, x, None, pos, cs, interleaved=False)
        assert out.shape == x.shape
        rotate_qk(backend, x, None, pos, cs, interleaved=False, inplace=True)


@requires_emulation
def test_emulated_grids_and_paths():
    """The emulation really exercises both grid shapes and both access paths."""
    q, k, pos = make_qk("thd", torch.bfloat16, "cpu", head_dim=128)
    cs = rope_ext.RopeCache(128, max_positions=4096).cos_sin
    _, _, tokens = emulate("emu-tokens", q, k, pos, cs, interleaved=False)
    _, _, heads = emulate("emu-heads", q, k, pos, cs, interleaved=False)
    _, _, scalar = emulate("emu-scalar", q, k, pos, cs, interleaved=False)
    assert tokens[1] == 1 and tokens[4] == 1  # token grid, vectorized
    assert heads[1] > 1 and heads[4] == 1  # heads split over blocks
    assert scalar[4] == 0
    # Many tokens: fewer blocks than tokens, each block strides over tokens.
    q2, k2, pos2 = make_qk("thd", torch.float16, "cpu", head_dim=64, b=10, s=10)
    cs64 = rope_ext.RopeCache(64, max_positions=4096).cos_sin
    qo, ko, launch = emulate("emu-tokens", q2, k2, pos2, cs64, interleaved=True)
    assert launch[0] < q2.shape[0]
    check(qo, q2, pos2, cs64, True)
    check(ko, k2, pos2, cs64, True)
    # Misaligned slice (offset of one element): scalar path is chosen automatically.
    buf = torch.randn(10, 4, 129).to(torch.bfloat16)
    x = buf[..., 1:]
    _, _, launch = emulate("emu-tokens", x, None, pos, cs, interleaved=False)
    assert launch[4] == 0


@requires_emulation
@pytest.mark.parametrize("interleaved", [False, True])
def test_emulated_out_of_cache_positions_give_nan(interleaved):
    """On CUDA a position outside the cache never reads outside it: that token's rotated features
    are NaN, pass-through features and other tokens are exact."""
    x = torch.randn(4, 3, 64)
    cs = rope_ext.RopeCache(32, max_positions=10).cos_sin
    pos = torch.tensor([1, 10, -1, 9])[:, None]
    out, _, _ = emulate("emu-tokens", x, None, pos, cs, interleaved=interleaved)
    assert out[1:3, :, :32].isnan().all() and not out[[0, 3]].isnan().any()
    assert torch.equal(out[..., 32:], x[..., 32:])
    good = torch.tensor([0, 3])
    check(out[good], x[good], pos[good], cs, interleaved)

"""``rope_ext.compat.TorchtuneRotaryPositionalEmbeddings`` (``rope_ext.compat.torchtune``) against
torchtune's ``RotaryPositionalEmbeddings``.

torchtune itself is not a test dependency: importing any part of it imports the whole package, which
requires torchao, datasets, torchdata and more. Its module's cache build and forward (torchtune 0.6.1,
``torchtune/modules/position_embeddings.py``, BSD-3-Clause, Meta) are transcribed below instead, with
the cache passed in and the arithmetic dtype a parameter; float32 is torchtune's own computation and
float64 the reference of the accuracy contract.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _helpers import DTYPES, assert_close_to_reference
from test_scaling import inv_rel_tol, ulp32

from rope_ext import compat, reference
from rope_ext.compat import TorchtuneRotaryPositionalEmbeddings as RoPE
from rope_ext.compat import labml
from rope_ext.compat import torchtune as tt_compat


def torchtune_cache(dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtune's ``rope_init`` / ``build_rope_cache``: float32 ``theta [dim // 2]`` and
    ``cache [max_seq_len, dim // 2, 2]``."""
    theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    seq_idx = torch.arange(max_seq_len, dtype=theta.dtype, device=theta.device)
    idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
    return theta, cache


def torchtune_forward(x, cache, input_pos=None, compute_dtype=torch.float32):
    """torchtune's ``forward`` on ``x [b, s, n_h, h_d]``: interleaved pairs, ``[x0 c - x1 s, x1 c + x0 s]``.
    Returns ``compute_dtype`` (torchtune then casts with ``type_as(x)``)."""
    seq_len = x.size(1)
    rope_cache = cache[:seq_len] if input_pos is None else cache[input_pos]
    xshaped = x.to(compute_dtype).reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.to(compute_dtype).view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    return x_out.flatten(3)


DIM, MAX, BASE = 64, 512, 5e5
B, S, H = 2, 37, 3


def _input_pos(kind: str):
    g = torch.Generator().manual_seed(5)
    if kind == "none":
        return None
    if kind == "batch":  # [b, s]: packed samples restart, a KV-cache step continues
        return torch.randint(0, MAX, (B, S), generator=g)
    if kind == "batch1":
        return torch.arange(100, 100 + S)[None, :]
    return torch.arange(7, 7 + S)  # [s]


@pytest.mark.parametrize("kind", ["none", "batch", "batch1", "seq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_torchtune_formula(dtype, kind):
    torch.manual_seed(0)
    m = RoPE(DIM, MAX, BASE)
    x = torch.randn(B, S, H, DIM).to(dtype)
    ip = _input_pos(kind)
    out = m(x, input_pos=ip)
    assert out.shape == x.shape and out.dtype == dtype
    ref = torchtune_forward(x, m.cache.double(), ip, torch.float64)
    assert_close_to_reference(out, ref, x.abs().max().item())
    # torchtune's float32 arithmetic on the same cache meets the contract too (the reference is its formula)
    theirs = torchtune_forward(x, m.cache, ip).type_as(x)
    assert_close_to_reference(theirs, ref, x.abs().max().item())


def test_cache_buffers_equal_torchtunes_formula():
    """``theta`` / ``cache`` have torchtune's shapes, dtypes and layout; the values are the float64 formula
    rounded to float32 (within one ulp of exact). torchtune's float32 computation differs from them by its
    angle error, bounded as in test_scaling: ``a * rel_err(theta_j) + ulp32(a) / 2`` plus a few ulps of its
    float32 cos / sin."""
    dim, n, base = 128, 8192, 5e5
    m = RoPE(dim, n, base)
    tt_theta, tt_cache = torchtune_cache(dim, n, base)
    assert m.theta.shape == tt_theta.shape and m.theta.dtype == torch.float32
    assert m.cache.shape == tt_cache.shape == (n, dim // 2, 2) and m.cache.dtype == torch.float32
    inv64 = reference.inv_freq(dim, base)
    assert torch.equal(m.theta, inv64.float())
    exact = reference.cos_sin_table(n, dim, base)  # float64 [n, dim]: cos half, then sin half
    exact = torch.stack([exact[:, : dim // 2], exact[:, dim // 2 :]], dim=-1)
    assert ((m.cache.double() - exact).abs() <= ulp32(exact)).all()
    assert torch.equal(m._cos_sin, torch.cat([m.cache[..., 0], m.cache[..., 1]], dim=-1))
    # torchtune's values
    rel_tol = inv_rel_tol(dim, base)
    assert (((tt_theta.double() - inv64) / inv64).abs() <= rel_tol).all()
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv64
    tol = (angle * rel_tol + ulp32(angle) / 2 + 4 * 2.0**-24)[..., None]
    diff = (tt_cache.double() - m.cache.double()).abs()
    assert (diff <= tol).all(), f"ratio {(diff / tol).max():.3g}"
    assert diff.max() > 1e-4  # the float32 angles of torchtune do drift at long positions


def test_same_interface_as_torchtune():
    assert compat.TorchtuneRotaryPositionalEmbeddings is tt_compat.RotaryPositionalEmbeddings
    assert tt_compat.RotaryPositionalEmbeddings.__name__ == "RotaryPositionalEmbeddings"
    assert compat.RotaryPositionalEmbeddings is labml.RotaryPositionalEmbeddings  # labml's name unchanged
    assert "TorchtuneRotaryPositionalEmbeddings" in compat.__all__
    sig = inspect.signature(RoPE)
    assert [(p.name, p.default) for p in sig.parameters.values()] == [
        ("dim", inspect.Parameter.empty),
        ("max_seq_len", 4096),
        ("base", 10_000),
    ]
    fwd = inspect.signature(RoPE.forward).parameters["input_pos"]
    assert fwd.kind is inspect.Parameter.KEYWORD_ONLY and fwd.default is None
    m = RoPE(32)
    assert (m.dim, m.max_seq_len, m.base) == (32, 4096, 10_000)
    assert m.state_dict() == {}  # non-persistent buffers, as torchtune's
    assert {"theta", "cache"} <= dict(m.named_buffers()).keys()


def _buffers(m):
    return {k: v.clone() for k, v in m.named_buffers()}


def test_rope_init_rebuilds_after_to_empty():
    m = RoPE(32, 64)
    want = _buffers(m)
    m.to_empty(device="cpu")
    for buf in m.buffers():
        buf.fill_(float("nan"))
    m.rope_init()
    got = _buffers(m)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_meta_device_flows():
    want = _buffers(RoPE(32, 64))
    x = torch.randn(1, 5, 2, 32)
    ref = RoPE(32, 64)(x)
    # built on the meta device, then to_empty + rope_init
    with torch.device("meta"):
        m = RoPE(32, 64)
    assert m.cache.is_meta and m.theta.is_meta
    m.to_empty(device="cpu")
    m.rope_init()
    assert all(torch.equal(v, want[k]) for k, v in m.named_buffers())
    assert torch.equal(m(x), ref)
    # torchtune's recipes: build on meta, load weights, then rope_init() under the target device
    with torch.device("meta"):
        m2 = RoPE(32, 64)
    with torch.device("cpu"):
        m2.rope_init()
    assert all(v.device.type == "cpu" and torch.equal(v, want[k]) for k, v in m2.named_buffers())


def test_build_rope_cache_other_length_and_bounds():
    m = RoPE(16, 8)
    x = torch.randn(1, 12, 1, 16)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(x)
    with pytest.raises(IndexError):
        m(x[:, :4], input_pos=torch.tensor([0, 1, 2, 8]))
    m.build_rope_cache(12)
    assert m.cache.shape == (12, 8, 2) and m._cos_sin.shape == (12, 16)
    ref = torchtune_forward(x, m.cache.double(), None, torch.float64)
    assert_close_to_reference(m(x), ref, x.abs().max().item())


@pytest.mark.parametrize("kind", ["none", "batch", "seq"])
def test_compile_fullgraph(kind):
    torch.manual_seed(1)
    m = RoPE(DIM, MAX, BASE)
    x = torch.randn(B, S, H, DIM)
    ip = _input_pos(kind)
    compiled = torch.compile(m, fullgraph=True)
    assert torch.equal(compiled(x, input_pos=ip), m(x, input_pos=ip))


def test_partial_dim_slice():
    """Partial rotary: the caller passes ``x[..., :dim]`` (a strided slice; its last dim is ``dim``)."""
    torch.manual_seed(2)
    full = torch.randn(B, S, H, 96)
    before = full.clone()
    x = full[..., :DIM]
    m = RoPE(DIM, MAX, BASE)
    ip = _input_pos("batch")
    out = m(x, input_pos=ip)
    assert torch.equal(full, before)
    assert_close_to_reference(
        out, torchtune_forward(x, m.cache.double(), ip, torch.float64), x.abs().max().item()
    )
    with pytest.raises(ValueError, match="h_d = dim = 64"):
        m(full)
    with pytest.raises(ValueError, match=r"\[b, s, n_h, h_d\]"):
        m(full[0, :, :, :DIM])


def test_bf16_module_keeps_a_float32_table():
    """``module.to(torch.bfloat16)`` converts ``cache`` (as torchtune's) but the op's table stays float32."""
    torch.manual_seed(3)
    m = RoPE(DIM, MAX, BASE).to(torch.bfloat16)
    assert m.cache.dtype == torch.bfloat16 and m.theta.dtype == torch.bfloat16
    assert m._cos_sin.dtype == torch.float32
    x = torch.randn(B, S, H, DIM, dtype=torch.bfloat16)
    ip = _input_pos("batch")
    exact_cache = torch.stack([m._cos_sin[:, : DIM // 2], m._cos_sin[:, DIM // 2 :]], dim=-1).double()
    assert_close_to_reference(
        m(x, input_pos=ip), torchtune_forward(x, exact_cache, ip, torch.float64), x.abs().max().item()
    )


def test_gradient_is_the_inverse_rotation():
    torch.manual_seed(4)
    m = RoPE(DIM, MAX, BASE)
    ip = _input_pos("batch")
    x = torch.randn(B, S, H, DIM, requires_grad=True)
    g = torch.randn(B, S, H, DIM)
    m(x, input_pos=ip).backward(g)
    x64 = x.detach().double().requires_grad_()
    torchtune_forward(x64, m.cache.double(), ip, torch.float64).backward(g.double())
    assert_close_to_reference(x.grad, x64.grad, g.abs().max().item())


@pytest.mark.parametrize("shape", [(S + 1,), (B, S + 1), (B + 1, S), (B, S, 1)], ids=str)
def test_bad_input_pos_raises(shape):
    m = RoPE(DIM, MAX, BASE)
    with pytest.raises(ValueError, match="input_pos"):
        m(torch.randn(B, S, H, DIM), input_pos=torch.zeros(shape, dtype=torch.long))


def test_bad_dim_raises():
    with pytest.raises(ValueError, match="dim must be a positive even int"):
        RoPE(63)

"""Gradients, opcheck and torch.compile for every op."""

from __future__ import annotations

import pytest
import torch
from backends import device_of
from torch.library import opcheck

import rope_ext

OPS = torch.ops.rope_ext


def samples(device, requires_grad=False):
    """(op, args) pairs covering dtypes, pairings, partial rotary, layouts and strides."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for il in (False, True):
            for rd, hd in ((64, 64), (24, 96)):
                cs = rope_ext.RopeCache(rd, max_positions=64, device=device).cos_sin
                q = torch.randn(2, 5, 4, hd, generator=g, dtype=torch.float64).to(device, dtype)
                k = torch.randn(2, 5, 2, hd, generator=g, dtype=torch.float64).to(device, dtype)
                pos = torch.randint(0, 64, (2, 5, 1), generator=g).to(device)
                qt = q.transpose(1, 2)  # BHSD view
                rg = requires_grad and dtype in (torch.float32, torch.float64)
                out.append((OPS.rotary.default, (q.requires_grad_(rg), pos, cs, il, False)))
                out.append(
                    (OPS.rotary.default, (qt.detach().requires_grad_(rg), pos.transpose(1, 2), cs, il, True))
                )
                out.append(
                    (
                        OPS.rotary_qk.default,
                        (q.detach().requires_grad_(rg), k.requires_grad_(rg), pos, cs, il, False),
                    )
                )
                out.append(
                    (OPS.rotary_qk_.default, (q.detach().clone(), k.detach().clone(), pos, cs, il, False))
                )
                out.append((OPS.rotary_qk_.default, (q.detach().clone(), None, pos.int(), cs, il, False)))
    return out


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_opcheck(backend):
    device = device_of(backend)
    for op, args in samples(device, requires_grad=True):
        opcheck(op, args)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck(backend, interleaved):
    device = device_of(backend)
    cs = rope_ext.RopeCache(24, max_positions=50, device=device, dtype=torch.float64).cos_sin
    x = torch.randn(3, 4, 2, 40, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(3, 4, 1, 40, dtype=torch.float64, device=device, requires_grad=True)
    pos = torch.randint(0, 50, (3, 4, 1), device=device)
    assert torch.autograd.gradcheck(
        lambda t: rope_ext.apply_rotary(t, pos, cs, interleaved=interleaved), (x,)
    )
    assert torch.autograd.gradcheck(
        lambda t: rope_ext.apply_rotary(t, pos, cs, interleaved=interleaved, inverse=True), (x,)
    )
    assert torch.autograd.gradcheck(
        lambda a, b: rope_ext.apply_rotary_qk(a, b, pos, cs, interleaved=interleaved), (x, k)
    )
    assert torch.autograd.gradgradcheck(
        lambda t: rope_ext.apply_rotary(t, pos, cs, interleaved=interleaved), (x,)
    )


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_gradient_is_inverse_rotation(backend):
    device = device_of(backend)
    cs = rope_ext.RopeCache(64, max_positions=100, device=device).cos_sin
    x = torch.randn(7, 3, 64, device=device, requires_grad=True)
    pos = torch.randint(0, 100, (7, 1), device=device)
    y = rope_ext.apply_rotary(x, pos, cs)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    assert torch.equal(dx, rope_ext.apply_rotary(g, pos, cs, inverse=True))
    # Forward then inverse is the identity; a broadcast (stride-0) gradient is accepted.
    back = rope_ext.apply_rotary(y, pos, cs, inverse=True)
    assert (back - x).abs().max().item() < 1e-6
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    # Only one output of rotary_qk used: the other input gets no (or a zero) gradient.
    q = torch.randn(7, 3, 64, device=device, requires_grad=True)
    k = torch.randn(7, 1, 64, device=device, requires_grad=True)
    qo, _ = rope_ext.apply_rotary_qk(q, k, pos, cs)
    qo.sum().backward()
    assert (k.grad is None or not k.grad.any()) and q.grad is not None
    assert torch.equal(q.grad, rope_ext.apply_rotary(torch.ones_like(qo), pos, cs, inverse=True))


def _fn_all_ops(q, k, pos, cs):
    a = rope_ext.apply_rotary(q, pos, cs)
    b, c = rope_ext.apply_rotary_qk(q, k, pos, cs, interleaved=True)
    q2, k2 = q.clone(), k.clone()
    rope_ext.apply_rotary_qk_(q2, k2, pos, cs)
    rope_ext.apply_rotary_qk_(b, None, pos, cs)
    return a + q2, b, c + k2


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_compile_fullgraph_matches_eager(backend):
    device = device_of(backend)
    torch._dynamo.reset()
    cs = rope_ext.RopeCache(32, max_positions=100, device=device).cos_sin
    q = torch.randn(2, 9, 4, 48, device=device)
    k = torch.randn(2, 9, 2, 48, device=device)
    pos = torch.randint(0, 100, (2, 9, 1), device=device)
    compiled = torch.compile(_fn_all_ops, fullgraph=True, backend="inductor")
    for got, want in zip(compiled(q, k, pos, cs), _fn_all_ops(q, k, pos, cs), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_compile_dynamic_no_recompile(backend):
    device = device_of(backend)
    torch._dynamo.reset()
    cs = rope_ext.RopeCache(64, max_positions=512, device=device).cos_sin
    counter = torch._dynamo.testing.CompileCounter()

    def f(x, pos):
        return rope_ext.apply_rotary(x, pos, cs) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for s in (17, 33, 100):
        x = torch.randn(2, s, 4, 64, device=device)
        pos = torch.arange(s, device=device)[:, None]
        assert torch.equal(compiled(x, pos), f(x, pos))
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_compile_training_step(backend):
    """Differentiable under torch.compile(fullgraph=True): gradients match eager."""
    device = device_of(backend)
    torch._dynamo.reset()
    cs = rope_ext.RopeCache(64, max_positions=64, device=device).cos_sin
    pos = torch.arange(16, device=device)[:, None]

    def loss(q, k):
        qr, kr = rope_ext.apply_rotary_qk(q, k, pos, cs)
        return (qr[:, :2] * kr).sum()

    q = torch.randn(16, 4, 64, device=device, requires_grad=True)
    k = torch.randn(16, 2, 64, device=device, requires_grad=True)
    ge = torch.autograd.grad(loss(q, k), (q, k))
    gc = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k), (q, k))
    for a, b in zip(ge, gc, strict=True):
        assert torch.allclose(a, b, atol=1e-5)

"""The in-place op is differentiable like any in-place op (training code rotates activations in place).

Before: ``apply_rotary_qk_`` on a tensor that requires grad gave no error and the gradient of the unrotated
tensor. Now autograd records the rotation; every gradient is compared with the out-of-place op's.
"""

from __future__ import annotations

import pytest
import torch

import rope_ext

T, D, R = 5, 16, 8


def _setup(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D, D, dtype=dtype, generator=g).requires_grad_()
    x = torch.randn(T, 1, D, dtype=dtype, generator=g)
    weights = torch.randn(3, D, dtype=dtype, generator=g)  # a loss that sees every feature differently
    positions = torch.randint(0, 40, (T, 1), generator=g)
    cs = rope_ext.RopeCache(R, max_positions=40, dtype=dtype).cos_sin
    return w, x, weights, positions, cs


def _packed(w, x):
    q = x @ w
    return torch.stack([q, 2 * q, q.flip(-1)], dim=1)  # [T, 3, 1, D]: q, k, v of a packed QKV tensor


def _loss_inplace(w, x, weights, positions, cs, interleaved=False):
    qkv = _packed(w, x)
    rope_ext.apply_rotary_qk_(qkv[:, 0], qkv[:, 1], positions, cs, interleaved=interleaved)
    return (qkv**2 * weights[None, :, None, :]).sum()


def _loss_out_of_place(w, x, weights, positions, cs, interleaved=False):
    qkv = _packed(w, x)
    q, k = rope_ext.apply_rotary_qk(qkv[:, 0], qkv[:, 1], positions, cs, interleaved=interleaved)
    out = torch.stack([q, k, qkv[:, 2]], dim=1)
    return (out**2 * weights[None, :, None, :]).sum()


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_qkv_views_gradient_equals_out_of_place(interleaved):
    w, x, weights, positions, cs = _setup()
    a = _loss_inplace(w, x, weights, positions, cs, interleaved)
    (ga,) = torch.autograd.grad(a, w)
    b = _loss_out_of_place(w, x, weights, positions, cs, interleaved)
    (gb,) = torch.autograd.grad(b, w)
    assert torch.equal(a, b)
    assert torch.allclose(ga, gb, rtol=0, atol=1e-12 * gb.abs().max().item())


def test_issue_example_gives_the_gradient_of_the_rotated_q():
    t = rope_ext.RopeCache(8, max_positions=4).cos_sin
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 8, requires_grad=True, generator=g)
    x, ws = torch.randn(4, 1, 8, generator=g), torch.randn(8, generator=g)
    q = x @ w
    rope_ext.apply_rotary_qk_(q, None, torch.arange(4)[:, None], t)
    (q * ws).sum().backward()
    w2 = w.detach().clone().requires_grad_()
    q2 = rope_ext.apply_rotary(x @ w2, torch.arange(4)[:, None], t)
    (q2 * ws).sum().backward()
    assert torch.allclose(w.grad, w2.grad, rtol=1e-6, atol=1e-6)
    unrotated = x.reshape(4, 8).t() @ ws.expand(4, 8)
    assert not torch.allclose(w.grad, unrotated, atol=1e-3)


def test_gradcheck_float64():
    w, x, weights, positions, cs = _setup()
    assert torch.autograd.gradcheck(lambda w_: _loss_inplace(w_, x, weights, positions, cs), (w,))
    assert torch.autograd.gradgradcheck(lambda w_: _loss_inplace(w_, x, weights, positions, cs), (w,))


def test_only_k_requires_grad():
    _, _, _, positions, cs = _setup()
    q = torch.randn(T, 2, D, dtype=torch.float64)
    kl = torch.randn(T, 1, D, dtype=torch.float64, requires_grad=True)
    k = kl * 1.0
    q_ref = rope_ext.apply_rotary(q, positions, cs)
    rope_ext.apply_rotary_qk_(q, k, positions, cs)
    assert torch.equal(q, q_ref) and not q.requires_grad
    (k * torch.arange(D)).sum().backward()
    kl2 = kl.detach().clone().requires_grad_()
    (rope_ext.apply_rotary(kl2, positions, cs) * torch.arange(D)).sum().backward()
    assert torch.allclose(kl.grad, kl2.grad, atol=1e-12)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_fullgraph_gradients_match_eager(dynamic):
    torch._dynamo.reset()
    w, x, weights, positions, cs = _setup(torch.float32)
    compiled = torch.compile(_loss_inplace, fullgraph=True, dynamic=dynamic)
    (gc,) = torch.autograd.grad(compiled(w, x, weights, positions, cs), w)
    (ge,) = torch.autograd.grad(_loss_out_of_place(w, x, weights, positions, cs), w)
    assert torch.allclose(gc, ge, rtol=1e-5, atol=1e-5 * ge.abs().max().item())


def test_rotary_embedding_inplace_is_differentiable():
    rope = rope_ext.RotaryEmbedding(D, rotary_dim=R, max_positions=64)
    g = torch.Generator().manual_seed(5)
    ql = torch.randn(2, T, 3, D, generator=g, requires_grad=True)
    kl = torch.randn(2, T, 1, D, generator=g, requires_grad=True)
    q, k = rope(ql * 1.0, kl * 1.0, inplace=True)
    (q.square().sum() + (k * 3).sum()).backward()
    ql2, kl2 = ql.detach().clone().requires_grad_(), kl.detach().clone().requires_grad_()
    q2, k2 = rope(ql2, kl2)
    (q2.square().sum() + (k2 * 3).sum()).backward()
    assert torch.allclose(ql.grad, ql2.grad, atol=1e-5) and torch.allclose(kl.grad, kl2.grad, atol=1e-5)


@pytest.mark.parametrize("view", [False, True])
def test_leaf_that_requires_grad_raises_before_writing(view):
    _, _, _, positions, cs = _setup()
    leaf = torch.randn(T, 2, D, dtype=torch.float64, requires_grad=True)
    before = leaf.detach().clone()
    target = leaf[:, :1] if view else leaf
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
        rope_ext.apply_rotary_qk_(target, None, positions, cs)
    assert torch.equal(leaf.detach(), before)


def test_leaf_under_no_grad_is_rotated_in_place():
    _, _, _, positions, cs = _setup()
    leaf = torch.randn(T, 2, D, dtype=torch.float64, requires_grad=True)
    expected = rope_ext.apply_rotary(leaf.detach(), positions, cs)
    with torch.no_grad():
        rope_ext.apply_rotary_qk_(leaf, None, positions, cs)
    assert torch.equal(leaf.detach(), expected)


def test_saved_input_modified_in_place_is_detected():
    _, _, _, positions, cs = _setup()
    a = torch.randn(T, 1, D, dtype=torch.float64, requires_grad=True)
    q = a * 1.0
    y = q.sin()  # saves q for backward
    rope_ext.apply_rotary_qk_(q, None, positions, cs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

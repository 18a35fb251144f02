"""The in-place op is differentiable like any in-place op (training code rotates activations in place).

Before: ``apply_rotary_qk_`` on a tensor that requires grad gave no error and the gradient of the unrotated
tensor. Now autograd records the rotation; every gradient is compared with the out-of-place op's.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwad

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


# ---------------------------------------------------------------------------------------------
# Views autograd does not let an in-place op modify: refused before the first write, with autograd's text.

H = 2
VIEW_KINDS = ["unbind", "split", "chunk", "no_grad", "no_grad_base", "inference_mode", "custom_function"]


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _views(kind: str, a: torch.Tensor, n: int = 3) -> list[torch.Tensor]:
    """``n`` views of the equal blocks of ``a``'s dim 1, made as ``kind`` says."""
    size = a.shape[1] // n

    def blocks(b):
        return [b[:, i * size : (i + 1) * size] for i in range(n)]

    if kind == "unbind":
        return list(a.unflatten(1, (n, size)).unbind(1))
    if kind == "split":
        return list(a.split(size, dim=1))
    if kind == "chunk":
        return list(a.chunk(n, dim=1))
    if kind == "custom_function":
        return blocks(_Identity.apply(a))
    with torch.inference_mode() if kind == "inference_mode" else torch.no_grad():
        return blocks(a[:] if kind == "no_grad_base" else a)


def _autograd_error(t: torch.Tensor) -> str:
    """The message of autograd's error for an in-place op on ``t`` (raised before its kernel runs)."""
    with pytest.raises(RuntimeError) as e:
        t.mul_(2)
    return str(e.value)


def _leaf(shape, seed):
    return torch.randn(
        *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    ).requires_grad_()


def _unchanged(tensors, before) -> bool:
    return all(torch.equal(t.detach(), b) for t, b in zip(tensors, before, strict=True))


def test_issue_example_raises_before_writing():
    w = torch.randn(4, 3, 2, 16, requires_grad=True)
    q, k, v = (w * 1.0).unbind(1)
    before = [t.detach().clone() for t in (q, k, w)]
    versions = (q._version, k._version)
    expected = _autograd_error((w * 1.0).unbind(1)[0])
    with pytest.raises(RuntimeError) as e:
        rope_ext.apply_rotary_qk_(q, k, torch.arange(4)[:, None], rope_ext.RopeCache(16).cos_sin)
    assert str(e.value) == expected
    assert _unchanged((q, k, w), before) and (q._version, k._version) == versions


@pytest.mark.parametrize("kind", VIEW_KINDS)
@pytest.mark.parametrize("refused", ["q", "k", "both"])
def test_refused_view_raises_autograd_error_before_writing(kind, refused):
    _, _, _, positions, cs = _setup()
    w, w2 = _leaf((T, 3 * H, D), 1), _leaf((T, 3 * H, D), 2)
    a, a2 = w * 1.0, w2 * 1.0
    views, plain = _views(kind, a), a2[:, :H]  # plain: a slice, which autograd rebases
    q = plain if refused == "k" else views[0]
    k = plain if refused == "q" else views[1]
    expected = _autograd_error(_views(kind, w * 1.0)[1 if refused == "k" else 0])  # q is checked first
    before = [t.detach().clone() for t in (a, a2)]
    versions = (q._version, k._version)
    with pytest.raises(RuntimeError) as e:
        rope_ext.apply_rotary_qk_(q, k, positions, cs)
    assert str(e.value) == expected
    assert _unchanged((a, a2), before) and (q._version, k._version) == versions


@pytest.mark.parametrize("kind", VIEW_KINDS)
@pytest.mark.parametrize("wrt", ["qkv", "weights"])
def test_qk_norm_refused_view_raises_autograd_error_before_writing(kind, wrt):
    """``apply_qk_norm_rotary_`` writes the normalised q and k into qkv: refused for the same views, also
    when only the weights require grad (the values written do)."""
    _, _, _, positions, cs = _setup()
    width = 4 * D  # Hq = 2, Hk = Hv = 1
    w = _leaf((T, 2 * width), 1).requires_grad_(wrt == "qkv")
    qkv = _views(kind, w * 1.0, 2)[0]
    weights = [_leaf((D,), 3 + i).requires_grad_(wrt == "weights") for i in range(2)]
    twin = _views(kind, w * 1.0, 2)[0]
    with pytest.raises(RuntimeError) as e:
        twin.mul_(weights[0][0] if wrt == "weights" else 2)
    before = qkv.detach().clone()
    with pytest.raises(RuntimeError) as e2:
        rope_ext.apply_qk_norm_rotary_(qkv, 2, 1, 1, *weights, positions.flatten(), cs)
    assert str(e2.value) == str(e.value)
    assert torch.equal(qkv.detach(), before)


def test_qk_norm_weights_that_require_grad_give_the_out_of_place_gradient():
    _, _, _, positions, cs = _setup()
    x = torch.randn(T, 4 * D, dtype=torch.float64)
    weights = [_leaf((D,), 3 + i) for i in range(2)]
    qkv = x.clone()
    rope_ext.apply_qk_norm_rotary_(qkv, 2, 1, 1, *weights, positions.flatten(), cs)
    (qkv * x).sum().backward()
    ref_weights = [t.detach().clone().requires_grad_() for t in weights]
    q, k = x[:, : 2 * D].unflatten(1, (2, D)), x[:, 2 * D : 3 * D].unflatten(1, (1, D))
    qo, ko = rope_ext.apply_qk_norm_rotary(q, k, *ref_weights, positions.flatten(), cs)
    (torch.cat([qo.flatten(1), ko.flatten(1), x[:, 3 * D :]], dim=1) * x).sum().backward()
    for t, ref in zip(weights, ref_weights, strict=True):
        assert torch.allclose(t.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_dual_tensor_raises_before_writing():
    """The recorded rotation has no forward-mode formula: a dual q is refused before it is rotated."""
    _, _, _, positions, cs = _setup()
    a = _leaf((T, H, D), 1) * 1.0
    with fwad.dual_level():
        q = fwad.make_dual(a, torch.ones_like(a))
        before = q.detach().clone()
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            rope_ext.apply_rotary_qk_(q, None, positions, cs)
        assert torch.equal(q.detach(), before)


def test_compiled_refused_views_raise_before_running():
    """Traced, the copy_ of the rotation into a view autograd refuses fails while tracing: nothing runs."""
    torch._dynamo.reset()
    _, _, _, positions, cs = _setup(torch.float32)
    a = _leaf((T, 3 * H, D), 1).float() * 1.0
    q, k, _ = _views("unbind", a)
    before = a.detach().clone()

    def rotate(q, k):
        rope_ext.apply_rotary_qk_(q, k, positions, cs)
        return q + k

    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        torch.compile(rotate, fullgraph=True)(q, k)
    assert torch.equal(a.detach(), before)

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
    for inverse in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b, inv=inverse: rope_ext.apply_rotary_qk(
                a, b, pos, cs, interleaved=interleaved, inverse=inv
            ),
            (x, k),
        )

        def in_place(a, b, inv=inverse):
            a, b = a.clone(), b.clone()
            rope_ext.apply_rotary_qk_(a, b, pos, cs, interleaved=interleaved, inverse=inv)
            return a, b

        assert torch.autograd.gradcheck(in_place, (x, k))
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
    d, e = rope_ext.apply_rotary_qk(a, k, pos, cs, inverse=True)
    rope_ext.apply_rotary_qk_(q2, e, pos, cs, inverse=True, interleaved=True)
    return a + q2, b, c + k2, d, e


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


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The rope_ext op overloads a call reaches."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rope_ext":
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _plain_cases(dtype):
    """(short overload, its args, the default overload's args with every option spelled out, the API call,
    the mutated argument indices) for rotary_qk_, rotary_qk_cache_ (.plain, and .scaled into fp8 caches),
    qk_norm_rotary_packed_ and rerotate_kv_cache_ (.plain, and .scaled for an fp8 cache)."""
    g = torch.Generator().manual_seed(5)
    T, Hq, Hk, D = 6, 4, 2, 64
    cs = rope_ext.RopeCache(D, max_positions=32).cos_sin
    pos = torch.randint(0, 32, (T,), generator=g)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dtype)
    q = qkv[:, : Hq * D].unflatten(-1, (Hq, D))
    k = qkv[:, Hq * D : (Hq + Hk) * D].unflatten(-1, (Hk, D))
    v = qkv[:, (Hq + Hk) * D :].unflatten(-1, (Hk, D))
    kc = torch.randn(4, 4, Hk, D, generator=g).to(dtype)
    vc = torch.randn(4, 4, Hk, D, generator=g).to(dtype)
    kc8, vc8 = (torch.randn(4, 4, Hk, D, generator=g).to(torch.float8_e4m3fn) for _ in range(2))
    scales = torch.tensor([0.02]), torch.tensor([0.015])
    slots = torch.tensor([3, -1, 9, 0, 15, 6])
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    heads = (Hq, Hk, Hk)
    delta = torch.tensor([5, -3, 0, 31, -31, 2])  # shifts of a re-rotation of the keys at the slots
    return [
        (
            OPS.rotary_qk_.plain,
            (q, k, pos[:, None], cs),
            (False, False, 0, None, False),
            lambda a: rope_ext.apply_rotary_qk_(*a),
            (0, 1),
        ),
        (
            OPS.rotary_qk_cache_.plain,
            (q, k, v, pos, cs, kc, vc, slots),
            (None, None, None, None, False, "NHD", 0, None, False),
            lambda a: rope_ext.apply_rotary_qk_and_cache_(*a),
            (0, 1, 5, 6),
        ),
        (
            OPS.rotary_qk_cache_.scaled,
            (q, k, v, pos, cs, kc8, vc8, slots, *scales),
            (None, None, False, "NHD", 0, None, False),
            lambda a: rope_ext.apply_rotary_qk_and_cache_(*a[:8], k_scale=a[8], v_scale=a[9]),
            (0, 1, 5, 6),
        ),
        (
            OPS.qk_norm_rotary_packed_.plain,
            (qkv, *heads, qw, kw, pos, cs),
            (1e-6, False, 0.0, 0, None, False),
            lambda a: rope_ext.apply_qk_norm_rotary_(*a),
            (0,),
        ),
        (
            OPS.rerotate_kv_cache_.plain,
            (kc, slots, delta, cs),
            (None, False, "NHD", 0),
            lambda a: rope_ext.rerotate_kv_cache_(*a),
            (0,),
        ),
        (
            OPS.rerotate_kv_cache_.scaled,
            (kc8, slots, delta, cs, scales[0]),
            (False, "NHD", 0),
            lambda a: rope_ext.rerotate_kv_cache_(*a[:4], k_scale=a[4]),
            (0,),
        ),
    ]


def _clone_args(args):
    """Fresh copies of the tensors (views of one qkv stay views of one copy)."""
    base = args[0]._base if isinstance(args[0], torch.Tensor) and args[0]._base is not None else None
    if base is None:
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    copy = base.clone()
    return tuple(
        copy.as_strided(a.shape, a.stride(), a.storage_offset())
        if isinstance(a, torch.Tensor) and a._base is base
        else (a.clone() if isinstance(a, torch.Tensor) else a)
        for a in args
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_overloads(dtype):
    """The .plain and .scaled overloads (every other option at its default, for the eager fast paths) write
    what the default overloads write with those defaults spelled out, bit for bit; the public API takes them
    when no other option is set; opcheck and torch.compile(fullgraph=True) pass."""
    for plain, args, defaults, api, mutated in _plain_cases(dtype):
        a, b, c = _clone_args(args), _clone_args(args), _clone_args(args)
        plain(*a)
        getattr(OPS, plain._schema.name.split("::")[1]).default(*b, *defaults)
        for i in mutated:
            assert torch.equal(a[i].view(torch.uint8), b[i].view(torch.uint8)), (plain, i)
            assert not torch.equal(a[i].view(torch.uint8), args[i].view(torch.uint8)), (plain, i)  # it wrote
        with _Recorder() as rec:
            api(c)
        assert rec.ops == [str(plain)], rec.ops
        for i in mutated:
            assert torch.equal(c[i].view(torch.uint8), a[i].view(torch.uint8)), (plain, i)
        # test_schema compares mutated arguments with torch.allclose, which has no fp8 kernel: fp8 skips it
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        fp8 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in args)
        opcheck(plain, _clone_args(args), test_utils=utils if fp8 else ("test_schema", *utils))
        torch._dynamo.reset()  # one lambda compiled per case and dtype: past dynamo's recompile limit
        compiled = torch.compile(lambda *t, op=plain: op(*t), fullgraph=True)
        d = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args)  # separate tensors
        compiled(*d)
        for i in mutated:
            assert torch.equal(d[i].view(torch.uint8), a[i].view(torch.uint8)), (plain, i)

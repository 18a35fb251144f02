"""``rotary_offset``: features ``[rotary_offset, rotary_offset + rotary_dim)`` rotate, all others pass
through (copied out of place, untouched in place), on every backend, with gradients, opcheck and compile.

The MLA layout ``[nope | rope]`` (DeepSeek) is the case ``rotary_offset = head_dim - rotary_dim``.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import DTYPES, assert_close_to_reference, make_cos_sin
from backends import BACKENDS, device_of, rotate_qk
from torch.library import opcheck

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
# (head_dim, rotary_dim, rotary_offset): MLA (128 nope + 64 rope), a rope part in the middle, offsets that
# break 16-byte alignment (the vector paths must fall back), odd pair counts, no offset.
SHAPES = [(192, 64, 128), (128, 64, 32), (96, 64, 8), (130, 128, 2), (40, 8, 5), (64, 64, 0), (72, 6, 33)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_offset_matches_reference(backend, dtype, interleaved, inplace):
    device = device_of(backend)
    g = torch.Generator().manual_seed(3)
    for D, R, off in SHAPES:
        q = torch.randn(6, 4, D, generator=g).to(device, dtype)
        k = torch.randn(6, 2, D, generator=g).to(device, dtype)
        pos = torch.randint(0, 50, (6, 1), generator=g).to(device)
        cs = make_cos_sin(50, R).to(device)
        q_in, k_in = q.clone(), k.clone()
        qo, ko = rotate_qk(
            backend, q_in, k_in, pos, cs, interleaved=interleaved, inplace=inplace, rotary_offset=off
        )
        for x, out in ((q, qo), (k, ko)):
            ref = reference.rotary_hadamard(
                x.cpu(), pos.cpu(), cs.cpu(), interleaved=interleaved, rotary_offset=off
            )
            assert_close_to_reference(out.cpu(), ref, float(x.abs().max()))
            assert torch.equal(out[..., :off], x[..., :off]), (D, R, off)
            assert torch.equal(out[..., off + R :], x[..., off + R :]), (D, R, off)


@pytest.mark.parametrize("interleaved", [False, True])
def test_offset_equals_rotating_the_slice(interleaved):
    """Rotating features [off, off + R) of a head is rotating the slice x[..., off:off + R] on its own."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 8, 192, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 40, (5, 1), generator=g)
    cs = make_cos_sin(40, 64)
    out = rope_ext.apply_rotary(q, pos, cs, interleaved=interleaved, rotary_offset=128)
    rope = rope_ext.apply_rotary(q[..., 128:].contiguous(), pos, cs, interleaved=interleaved)
    assert torch.equal(out[..., 128:], rope) and torch.equal(out[..., :128], q[..., :128])


def test_three_reference_forms_agree_at_an_offset():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 50, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 20, (3, 1), generator=g)
    cs = reference.cos_sin_table(20, 16)
    for il in (False, True):
        forms = [
            f(x, pos, cs, interleaved=il, rotary_offset=30)
            for f in (reference.rotary_matrix, reference.rotary_complex, reference.rotary_hadamard)
        ]
        torch.testing.assert_close(forms[0], forms[1], rtol=0, atol=1e-13)
        torch.testing.assert_close(forms[0], forms[2], rtol=0, atol=1e-13)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_at_an_offset(interleaved):
    cs = make_cos_sin(30, 12).double()
    x = torch.randn(3, 2, 20, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 1, 20, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 30, (3, 1))
    kw = dict(interleaved=interleaved, rotary_offset=5)
    assert torch.autograd.gradcheck(lambda t: rope_ext.apply_rotary(t, pos, cs, **kw), (x,))
    assert torch.autograd.gradcheck(lambda a, b: rope_ext.apply_rotary_qk(a, b, pos, cs, **kw), (x, k))

    def inplace(a, b):
        a, b = a * 1, b * 1
        rope_ext.apply_rotary_qk_(a, b, pos, cs, **kw)
        return a, b

    assert torch.autograd.gradcheck(inplace, (x, k))


def test_opcheck_at_an_offset():
    g = torch.Generator().manual_seed(6)
    cs = make_cos_sin(16, 8)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(4, 3, 24, generator=g).to(dtype)
        k = torch.randn(4, 1, 24, generator=g).to(dtype)
        pos = torch.randint(0, 16, (4, 1), generator=g)
        opcheck(OPS.rotary.default, (q.requires_grad_(dtype == torch.float32), pos, cs, False, False, 16))
        opcheck(OPS.rotary_qk.default, (q.detach(), k, pos, cs, True, True, 3))
        opcheck(OPS.rotary_qk_.default, (q.detach().clone(), k.clone(), pos, cs, False, False, 10))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_at_an_offset(dynamic):
    cs = make_cos_sin(64, 32)

    def f(qkv, pos):
        q, k = qkv[:, :, 0], qkv[:, :, 1]
        rope_ext.apply_rotary_qk_(q, k, pos, cs, rotary_offset=64)
        return rope_ext.apply_rotary(qkv[:, :, 2], pos, cs, interleaved=True, rotary_offset=16) * 2

    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(9, 4, 3, 96, generator=g)
    pos = torch.randint(0, 64, (9, 1), generator=g)
    a, b = qkv.clone(), qkv.clone()
    want = f(a, pos)
    got = torch.compile(f, fullgraph=True, dynamic=dynamic)(b, pos)
    assert torch.equal(got, want) and torch.equal(a, b)


def test_bad_offset_is_rejected_before_any_write():
    q = torch.randn(3, 2, 64)
    k = torch.randn(3, 1, 64)
    q0, k0 = q.clone(), k.clone()
    pos = torch.zeros(3, 1, dtype=torch.long)
    cs = make_cos_sin(4, 32)
    for off in (-1, 33, 64):
        with pytest.raises(
            ValueError, match=rf"rotary_offset must be in \[0, head_dim - rotary_dim\] = \[0, 32\].*got {off}"
        ):
            rope_ext.apply_rotary_qk_(q, k, pos, cs, rotary_offset=off)
        with pytest.raises(ValueError, match="rotary_offset must be in"):
            rope_ext.apply_rotary(q, pos, cs, rotary_offset=off)
        # Under compile the fake kernel raises the same ValueError (dynamo reports it wrapped).
        compiled = torch.compile(
            lambda a, o=off: rope_ext.apply_rotary(a, pos, cs, rotary_offset=o), fullgraph=True
        )
        with pytest.raises(
            (ValueError, torch._dynamo.exc.TorchRuntimeError), match="rotary_offset must be in"
        ):
            compiled(q)
    for off in (1.5, True, None):
        with pytest.raises(TypeError, match="rotary_offset must be an int"):
            rope_ext.apply_rotary_qk_(q, k, pos, cs, rotary_offset=off)
    assert torch.equal(q, q0) and torch.equal(k, k0)

"""In-place rotation of views of a packed QKV tensor under ``torch.compile(dynamic=True)``.

With torch 2.14.1, Inductor passes a custom op's mutated *view* argument to the kernel with its storage
offset dropped when shapes are dynamic (the ``aot_eager`` backend is fine). Minimal reproduction, no
rope_ext involved::

    import torch

    @torch.library.custom_op("repro::add_one_", mutates_args=("x",))
    def add_one_(x: torch.Tensor) -> None:
        x.add_(1)

    @add_one_.register_fake
    def _(x):
        return None

    def f(a):
        add_one_(a[:, :, 1])
        return a

    out = torch.compile(f, dynamic=True)(torch.zeros(2, 16, 3, 4, 8))
    print(out[0, 0, :, 0, 0])  # tensor([1., 0., 0.]): slice 0 was written, not slice 1

``rope_ext.apply_rotary_qk_`` therefore rotates views through the functional op and ``copy_`` while
compiling (``rope_ext.ops._rotate_in_place``); these tests hold it to the eager result.
"""

from __future__ import annotations

import pytest
import torch

import rope_ext

CS = rope_ext.RopeCache(64).cos_sin


def _k_none(qkv, p):
    rope_ext.apply_rotary_qk_(qkv[:, :, 1], None, p, CS)
    return qkv


def _q_and_k(qkv, p):
    rope_ext.apply_rotary_qk_(qkv[:, :, 0], qkv[:, :, 1], p, CS, interleaved=True)
    return qkv


@pytest.mark.parametrize("fn", [_k_none, _q_and_k], ids=["k-none", "q-and-k"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_compiled_in_place_views_match_eager(fn, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for seq in (16, 9, 23):  # several lengths: one graph when dynamic
        qkv = torch.randn(2, seq, 3, 4, 64, generator=g)
        p = torch.randperm(seq, generator=g)[:, None]
        expected = fn(qkv.clone(), p)
        assert torch.equal(compiled(qkv.clone(), p), expected)


def test_compiled_in_place_of_a_whole_tensor_stays_in_place():
    torch._dynamo.reset()

    def f(q, k, p):
        rope_ext.apply_rotary_qk_(q, k, p, CS)
        return q, k

    q, k, p = torch.randn(7, 4, 64), torch.randn(7, 2, 64), torch.arange(7)[:, None]
    qc, kc = q.clone(), k.clone()
    torch.compile(f, dynamic=True, fullgraph=True)(qc, kc, p)
    eq, ek = f(q.clone(), k.clone(), p)
    assert torch.equal(qc, eq) and torch.equal(kc, ek)

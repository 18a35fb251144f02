"""The op descriptions (rope_ext.specs) against what they describe.

Each public function writes its op's arguments once, in schema order, and its keyword defaults are the
schema's (a default that differed would make a call that leaves an option out differ from one that passes
the documented default). Every overload of every op is described, so that each gets a fake kernel and a
DTensor rule, and the short overloads are taken exactly when the options allow.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.utils._python_dispatch

import rope_ext
from rope_ext import specs

# Public function -> the op whose options it takes (by name: the public functions fix some, e.g. inverse).
PUBLIC = {
    rope_ext.apply_rotary: specs.ROTARY,
    rope_ext.apply_rotary_qk: specs.ROTARY_QK,
    rope_ext.apply_rotary_qk_: specs.ROTARY_QK_,
    rope_ext.apply_rotary_qk_and_cache_: specs.CACHE,
    rope_ext.apply_qk_norm_rotary: specs.QK_NORM,
    rope_ext.apply_qk_norm_rotary_: specs.QK_NORM_PACKED_,
}


@pytest.mark.parametrize("fn", list(PUBLIC), ids=lambda f: f.__name__)
def test_public_defaults_are_the_schemas(fn):
    spec = PUBLIC[fn]
    options = {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert options
    assert options == {n: spec.Args._field_defaults[n] for n in options}


def test_every_op_and_overload_is_described():
    described = {str(o) for spec in specs.OPS for o in spec.overloads}
    packets = [getattr(torch.ops.rope_ext, n) for n in dir(torch.ops.rope_ext) if not n.startswith("_")]
    ops = {f"rope_ext.{p.__name__}.{o}" for p in packets if hasattr(p, "overloads") for o in p.overloads()}
    assert described == ops


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The rope_ext overloads that run."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rope_ext":
            self.ops.append(func._overloadname)
        return func(*args, **(kwargs or {}))


def _ran(call) -> list[str]:
    with _Recorder() as rec:
        call()
    return rec.ops


def test_eager_calls_take_the_shortest_overload_that_holds_their_options():
    T, Hq, Hk, D = 3, 2, 1, 16
    cs = rope_ext.RopeCache(D, max_positions=8).cos_sin
    pos = torch.arange(T)
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    kc, vc = torch.zeros(2, 4, Hk, D), torch.zeros(2, 4, Hk, D)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    one, slots = torch.ones(1), torch.tensor([0, 1, 2])
    qkv, w = torch.randn(T, (Hq + 2 * Hk) * D), torch.ones(D)

    def qk_(**kw):
        return _ran(lambda: rope_ext.apply_rotary_qk_(q, k, pos[:, None], cs, **kw))

    def cache(kc=kc, vc=vc, **kw):
        return _ran(lambda: rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots, **kw))

    def norm(**kw):
        return _ran(lambda: rope_ext.apply_qk_norm_rotary_(qkv, Hq, Hk, Hk, w, w, pos, cs, **kw))

    assert qk_() == qk_(interleaved=0) == qk_(rotary_offset=0, mrope_interleaved=False) == ["plain"]
    # None is not a default (the op reads it as False, and gets it as it is)
    assert qk_(interleaved=None) == qk_(interleaved=True) == ["default"]
    assert cache() == ["plain"]
    assert cache(kc8, vc8, k_scale=one, v_scale=one) == ["scaled"]
    assert cache(kc8, vc8, k_scale=one) == cache(layout="NHD", interleaved=True) == ["default"]
    i32 = torch.int32
    table = rope_ext.PageTable(
        torch.zeros(T, dtype=i32), pos.to(i32), torch.tensor([0], dtype=i32), torch.tensor([0, 1], dtype=i32)
    )

    def paged(**kw):
        kw["page_table"] = table
        return _ran(lambda: rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, **kw))

    assert paged() == paged(layout="NHD", inverse=False) == ["paged"]
    assert paged(interleaved=True) == paged(k_scale=one, v_scale=one) == ["default"]
    assert norm() == norm(weight_offset=0, eps=1e-6) == ["plain"]
    assert norm(eps=1e-5) == norm(weight_offset=1) == ["default"]
    # The checked path chooses alike (here: position checks on, which only CUDA calls act on).
    rope_ext.set_position_checks(True)
    try:
        assert qk_() == cache() == norm() == ["plain"]
        assert cache(kc8, vc8, k_scale=one, v_scale=one) == ["scaled"]
    finally:
        rope_ext.set_position_checks(False)

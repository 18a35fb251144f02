"""Bad input: a Python exception naming the argument, raised before anything is written."""

from __future__ import annotations

import pytest
import torch

import rope_ext


def _good():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 64, generator=g)
    k = torch.randn(6, 2, 64, generator=g)
    pos = torch.randint(0, 32, (6, 1), generator=g)
    cs = rope_ext.RopeCache(32, max_positions=32).cos_sin
    return q, k, pos, cs


def _cases():
    q, k, pos, cs = _good()
    packed = torch.randn(6, 8, 64)
    yield "odd rotary_dim", ValueError, "rotary_dim", dict(cos_sin=torch.randn(32, 31))
    yield "rotary_dim > head_dim", ValueError, "head_dim", dict(cos_sin=torch.randn(32, 66))
    yield "float positions", TypeError, "positions", dict(positions=pos.float())
    yield "bool positions", TypeError, "positions", dict(positions=pos.bool())
    yield "positions not broadcastable", ValueError, "positions", dict(positions=pos[:5])
    yield (
        "positions too long",
        ValueError,
        "positions",
        dict(positions=torch.zeros(2, 6, 1, dtype=torch.long)),
    )
    yield "negative position", IndexError, "positions", dict(positions=torch.full((6, 1), -1))
    yield "position == P", IndexError, "positions", dict(positions=torch.full((6, 1), 32))
    yield "non-floating q", TypeError, "q", dict(q=torch.ones(6, 4, 64, dtype=torch.int32))
    yield "cos_sin rank 3", ValueError, "cos_sin", dict(cos_sin=cs[None])
    yield "cos_sin rank 1 not float64", TypeError, "cos_sin", dict(cos_sin=cs[0])
    yield "frequencies of odd length", ValueError, "rotary_dim", dict(cos_sin=cs[0, :-1].double())
    yield "cos_sin float64 for float32 q", TypeError, "cos_sin", dict(cos_sin=cs.double())
    yield "cos_sin on meta", ValueError, "device", dict(cos_sin=cs.to("meta"))
    yield "positions on meta", ValueError, "device", dict(positions=pos.to("meta"))
    yield "last dim strided", ValueError, "stride", dict(q=torch.randn(6, 4, 128)[..., ::2])
    yield "expanded target", ValueError, "overlap", dict(q=torch.randn(6, 1, 64).expand(6, 4, 64))
    yield "q and k overlap", ValueError, "overlap", dict(q=packed[:, :4], k=packed[:, 3:5])
    yield "k dtype differs", TypeError, "k", dict(k=k.double())
    yield "k head_dim differs", ValueError, "head_dim", dict(k=torch.randn(6, 2, 32))
    yield "positions not a tensor", TypeError, "positions", dict(positions=[0, 1, 2, 3, 4, 5])
    yield "q is None", TypeError, "q", dict(q=None)


@pytest.mark.parametrize("name,exc,word,override", list(_cases()), ids=[c[0] for c in _cases()])
def test_errors_leave_inputs_unchanged(name, exc, word, override):
    q, k, pos, cs = _good()
    args = dict(q=q, k=k, positions=pos, cos_sin=cs) | override
    before = [
        t.clone() if isinstance(t, torch.Tensor) and t.device.type != "meta" else t
        for t in (args["q"], args["k"])
    ]
    with pytest.raises(exc, match=word):
        rope_ext.apply_rotary_qk_(args["q"], args["k"], args["positions"], args["cos_sin"])
    for t, b in zip((args["q"], args["k"]), before, strict=True):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            assert torch.equal(t, b), f"{name}: input modified by a rejected call"
    # The out-of-place ops reject the same input (in-place-only conditions aside).
    if word != "overlap":
        with pytest.raises(exc, match=word):
            rope_ext.apply_rotary_qk(args["q"], args["k"], args["positions"], args["cos_sin"])
        if "k" not in override:
            with pytest.raises(exc, match=word if word != "q" else "x"):
                rope_ext.apply_rotary(args["q"], args["positions"], args["cos_sin"])


def test_messages_say_what_was_expected():
    q, k, pos, cs = _good()
    with pytest.raises(ValueError, match=r"rotary_dim .* must be <= head_dim \(x.shape\[-1\] = 64\)"):
        rope_ext.apply_rotary(q, pos, torch.randn(4, 128))
    with pytest.raises(IndexError, match=r"\[0, 32\), got 40"):
        rope_ext.apply_rotary(q, torch.full((6, 1), 40), cs)
    with pytest.raises(ValueError, match=r"broadcastable to x.shape\[:-1\] = \[6, 4\]"):
        rope_ext.apply_rotary(q, torch.zeros(5, 1, dtype=torch.long), cs)


def test_packed_qkv_is_not_overlap():
    qkv = torch.randn(6, 8, 64)
    q, k = qkv[:, :4], qkv[:, 4:6]
    pos = torch.zeros(6, 1, dtype=torch.long)
    rope_ext.apply_rotary_qk_(q, k, pos, rope_ext.RopeCache(64, max_positions=2).cos_sin)
    # Adjacent but disjoint column ranges, every stride pattern of the fast path.
    with pytest.raises(ValueError, match="overlap"):
        rope_ext.apply_rotary_qk_(
            qkv[:, :4], qkv[:, 3:7], pos, rope_ext.RopeCache(64, max_positions=2).cos_sin
        )
    with pytest.raises(ValueError, match="overlap"):
        rope_ext.apply_rotary_qk_(
            qkv[:, :4], qkv[:, :4], pos, rope_ext.RopeCache(64, max_positions=2).cos_sin
        )
    # Rows of one tensor interleaved with rows of another: no element shared.
    rope_ext.apply_rotary_qk_(qkv[0::2], qkv[1::2], pos[:3], rope_ext.RopeCache(64, max_positions=2).cos_sin)


def test_position_checks_flag_is_cpu_noop():
    q, _, pos, cs = _good()
    rope_ext.set_position_checks(True)
    try:
        rope_ext.apply_rotary(q, pos, cs)
    finally:
        rope_ext.set_position_checks(False)

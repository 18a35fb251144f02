"""In-place safety: every check runs before the first write, overlap is detected exactly, and a view of
a larger buffer is rotated without touching anything outside it.

Each rejected call is made on q and k that are views of one guarded buffer; afterwards the whole buffer,
the positions and the cos/sin table are bit-identical to before.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _helpers import assert_close_to_reference, make_cos_sin, requires_emulation
from _strategies import bits, property_settings
from hypothesis import example, given
from hypothesis import strategies as st

import rope_ext
from rope_ext import reference

ops = torch.ops.rope_ext
T, HQ, HK, D, R, P = 5, 4, 2, 16, 8, 32


def _packed(dtype=torch.float32):
    """A packed QKV buffer [T, HQ + 2 HK, D] and the q, k views of it (disjoint, accepted in place)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, HQ + 2 * HK, D, generator=gen).to(dtype)
    return qkv, qkv[:, :HQ], qkv[:, HQ : HQ + HK]


def _positions(dtype=torch.int64):
    return torch.tensor([3, 0, 31, 7, 7], dtype=dtype)[:, None]


def _valid():
    qkv, q, k = _packed()
    return dict(buf=qkv, q=q, k=k, positions=_positions(), cos_sin=make_cos_sin(P, R))


def _with(**changes):
    """A valid in-place call with some arguments replaced (values may be callables of the valid args)."""

    def make():
        a = _valid()
        for name, v in changes.items():
            a[name] = v(a) if callable(v) else v
        return a

    return make


# (id, arguments, exception type, words the message must contain)
BAD_CALLS = [
    ("odd-rotary-dim", _with(cos_sin=make_cos_sin(P, R)[:, :7]), ValueError, ["rotary_dim", "even"]),
    ("rotary-dim-gt-head-dim", _with(cos_sin=make_cos_sin(P, 2 * D)), ValueError, ["rotary_dim", "head_dim"]),
    ("float-positions", _with(positions=_positions().float()), TypeError, ["positions", "int"]),
    ("bool-positions", _with(positions=_positions().bool()), TypeError, ["positions", "int"]),
    (
        "positions-not-broadcastable",
        _with(positions=torch.zeros(T + 1, 1, dtype=torch.long)),
        ValueError,
        ["positions", "broadcastable"],
    ),
    (
        "positions-too-many-dims",
        _with(positions=torch.zeros(1, T, 1, dtype=torch.long)),
        ValueError,
        ["positions", "broadcastable"],
    ),
    (
        "positions-not-broadcastable-to-k",
        _with(positions=torch.zeros(T, HQ, dtype=torch.long)),
        ValueError,
        ["positions", "k"],
    ),
    (
        "negative-position",
        _with(positions=torch.tensor([[0], [1], [2], [3], [-1]])),
        IndexError,
        ["positions", "-1"],
    ),
    (
        "position-past-cache",
        _with(positions=torch.tensor([[0], [1], [2], [3], [P]])),
        IndexError,
        ["positions", str(P)],
    ),
    (
        "huge-position",
        _with(positions=torch.tensor([[0], [1], [2], [3], [2**62]])),
        IndexError,
        ["positions"],
    ),
    (
        "int32-position-past-cache",
        _with(positions=torch.tensor([[0], [1], [2], [3], [P]], dtype=torch.int32)),
        IndexError,
        ["positions"],
    ),
    ("integer-q", _with(q=lambda a: torch.zeros(T, HQ, D, dtype=torch.int32)), TypeError, ["q", "floating"]),
    ("integer-k", _with(k=lambda a: torch.zeros(T, HK, D, dtype=torch.int64)), TypeError, ["k", "floating"]),
    (
        "k-other-dtype",
        _with(k=lambda a: torch.zeros(T, HK, D, dtype=torch.float64)),
        TypeError,
        ["k", "dtype"],
    ),
    ("k-other-rank", _with(k=lambda a: torch.zeros(T, D)), ValueError, ["k", "rank"]),
    ("k-other-head-dim", _with(k=lambda a: torch.zeros(T, HK, D + 2)), ValueError, ["k", "head_dim"]),
    ("cos-sin-1d-float32", _with(cos_sin=make_cos_sin(P, R)[0]), TypeError, ["cos_sin", "float64"]),
    (
        "frequencies-nan-position",
        _with(cos_sin=make_cos_sin(P, R)[0].double(), positions=lambda a: a["positions"].double() / 0),
        ValueError,
        ["positions", "finite"],
    ),
    ("cos-sin-3d", _with(cos_sin=make_cos_sin(P, R)[None]), ValueError, ["cos_sin", "shape"]),
    (
        "cos-sin-float64",
        _with(cos_sin=make_cos_sin(P, R, dtype=torch.float64)),
        TypeError,
        ["cos_sin", "float32"],
    ),
    ("cos-sin-integer", _with(cos_sin=torch.zeros(P, R, dtype=torch.int32)), TypeError, ["cos_sin"]),
    (
        "cos-sin-strided-last-dim",
        _with(cos_sin=make_cos_sin(P, 2 * R)[:, ::2]),
        ValueError,
        ["cos_sin", "contiguous"],
    ),
    ("positions-on-meta", _with(positions=_positions().to("meta")), ValueError, ["positions", "device"]),
    ("cos-sin-on-meta", _with(cos_sin=make_cos_sin(P, R).to("meta")), ValueError, ["cos_sin", "device"]),
    ("k-on-meta", _with(k=lambda a: a["k"].to("meta")), ValueError, ["k", "device"]),
    ("q-last-dim-strided", _with(q=lambda a: a["buf"][:, :HQ, ::2]), ValueError, ["q", "stride"]),
    ("k-last-dim-strided", _with(k=lambda a: a["buf"][:, HQ : HQ + HK, ::2]), ValueError, ["k", "stride"]),
    ("q-expanded", _with(q=lambda a: a["buf"][:, :1].expand(T, HQ, D)), ValueError, ["q", "overlap"]),
    (
        "k-expanded",
        _with(k=lambda a: a["buf"][:, HQ : HQ + 1].expand(T, HK, D)),
        ValueError,
        ["k", "overlap"],
    ),
    (
        "q-stride-0-tokens",
        _with(q=lambda a: a["buf"][:1, :HQ].expand(T, HQ, D)),
        ValueError,
        ["q", "overlap"],
    ),
    (
        "q-overlapping-strides",
        _with(q=lambda a: a["buf"].as_strided((T, HQ, D), (D, D // 2, 1))),
        ValueError,
        ["q", "overlap"],
    ),
    ("k-is-q", _with(k=lambda a: a["q"]), ValueError, ["q and k", "overlap"]),
    (
        "k-overlaps-q",
        _with(k=lambda a: a["buf"][:, HQ - 1 : HQ - 1 + HK]),
        ValueError,
        ["q and k", "overlap"],
    ),
    (
        "k-overlaps-q-last-dim",
        _with(
            k=lambda a: a["buf"][:, HQ : HQ + HK].as_strided(
                (T, HK, D), ((HQ + 2 * HK) * D, D, 1), (HQ - 1) * D + D // 2
            )
        ),
        ValueError,
        ["q and k", "overlap"],
    ),
    ("k-reshaped-alias-of-q", _with(k=lambda a: a["buf"][:, :2].reshape(T, 2, D)), ValueError, ["overlap"]),
    (
        "k-other-storage-view-alias",
        _with(k=lambda a: a["buf"].view(-1)[D:].as_strided((T, HK, D), ((HQ + 2 * HK) * D, D, 1))),
        ValueError,
        ["overlap"],
    ),
]


def _snapshot(a):
    """Bit copies of every tensor of the call that is on the CPU."""
    return {
        name: bits(t).clone()
        for name, t in a.items()
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point()
    } | {
        name: t.clone()
        for name, t in a.items()
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_floating_point()
    }


def _assert_unchanged(a, snap):
    for name, before in snap.items():
        now = bits(a[name]) if a[name].is_floating_point() else a[name]
        assert torch.equal(now, before), f"{name} changed by a rejected call"


def _applies(case_id: str, exc, words, op: str) -> bool:
    """Whether a rejected call of BAD_CALLS is an error for `op` (other combinations are left out)."""
    if op == "apply_rotary_qk_-no-k":
        return not ("k" in words or case_id.startswith("k-") or case_id.endswith("-to-k"))
    if op == "emulated-inplace":
        # The CUDA body writes NaN for out-of-cache positions (tested below) and for positions without an
        # angle (tests/test_table_free.py) instead of raising, and the test-only emulation op has no meta
        # kernel.
        return exc is not IndexError and "meta" not in case_id and "nan-position" not in case_id
    if op == "out-of-place":
        return "overlap" not in words  # overlapping and expanded inputs are fine out of place
    return True


REJECTED = [
    pytest.param(
        case_id,
        make,
        exc,
        words,
        op,
        id=f"{op}-{case_id}",
        marks=requires_emulation if op == "emulated-inplace" else (),
    )
    for op in ["apply_rotary_qk_", "apply_rotary_qk_-no-k", "emulated-inplace", "out-of-place"]
    for case_id, make, exc, words in BAD_CALLS
    if _applies(case_id, exc, words, op)
]


@pytest.mark.parametrize("case_id, make, exc, words, op", REJECTED)
def test_rejected_call_changes_nothing(case_id, make, exc, words, op):
    """The call raises the documented exception naming the argument, and q, k (their whole buffer),
    positions and cos_sin keep their bits."""
    a = make()
    if op == "apply_rotary_qk_-no-k":
        a["k"] = None
    snap = _snapshot(a)
    if op == "emulated-inplace" and exc is TypeError:
        # The bare ops carry standard C++ exceptions only (stable ABI): a type error is a ValueError
        # there, with the same message; the Python API raises TypeError.
        exc = ValueError
    with pytest.raises(exc) as info:
        if op.startswith("apply_rotary_qk_"):
            rope_ext.apply_rotary_qk_(a["q"], a["k"], a["positions"], a["cos_sin"])
        elif op == "emulated-inplace":
            ops._cuda_emulated(
                a["q"], a["k"], a["q"], a["k"], a["positions"], a["cos_sin"], False, False, 4, False
            )
        else:
            rope_ext.apply_rotary_qk(a["q"], a["k"], a["positions"], a["cos_sin"])
    msg = str(info.value)
    for w in words:
        assert w in msg, f"message {msg!r} does not mention {w!r}"
    _assert_unchanged(a, snap)


def test_valid_base_call_is_accepted():
    """The unmodified call of BAD_CALLS works: q and k packed in one QKV buffer, v untouched."""
    a = _valid()
    buf0 = a["buf"].clone()
    rope_ext.apply_rotary_qk_(a["q"], a["k"], a["positions"], a["cos_sin"])
    x_max = buf0.abs().max().item()
    for sl in (slice(0, HQ), slice(HQ, HQ + HK)):
        ref = reference.rotary_hadamard(buf0[:, sl], a["positions"], a["cos_sin"])
        assert_close_to_reference(a["buf"][:, sl], ref, x_max)
    assert torch.equal(a["buf"][:, HQ + HK :], buf0[:, HQ + HK :])


@requires_emulation
@pytest.mark.parametrize("bad", [-1, P, 10**9])
@pytest.mark.parametrize("num_sms", [1, 100_000])
def test_cuda_body_out_of_cache_position_gives_nan_in_that_token_only(bad, num_sms):
    """The CUDA kernel body never reads outside the cache: a bad position makes that token's rotated
    features NaN; its pass-through features and every other token are exact."""
    qkv, q, k = _packed()
    before = qkv.clone()
    positions = torch.tensor([[3], [bad], [0], [31], [5]])
    cs = make_cos_sin(P, R)
    ops._cuda_emulated(q, k, q, k, positions, cs, False, False, num_sms, False)
    good = torch.tensor([3, 0, 0, 31, 5])[:, None]
    for got, x in ((q, before[:, :HQ]), (k, before[:, HQ : HQ + HK])):
        assert got[1, :, :R].isnan().all()
        assert torch.equal(got[1, :, R:], x[1, :, R:])
        rows = [0, 2, 3, 4]
        ref = reference.rotary_hadamard(x[rows], good[rows], cs)
        assert_close_to_reference(got[rows], ref, x.abs().max().item())
    assert torch.equal(qkv[:, HQ + HK :], before[:, HQ + HK :])


# --------------------------------------------------------------------------------------------
# Views of bigger buffers, packed QKV layouts.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_view_of_larger_buffer_leaves_the_rest_untouched(dtype, interleaved):
    """Rotating buf[1:-1, 1:3, 4:4+D] in place changes exactly those elements (NaN/Inf guards around)."""
    buf = torch.full((T + 2, HQ + 3, D + 9), float("nan"), dtype=dtype)
    buf[0] = float("inf")
    view = buf[1:-1, 1:3, 4 : 4 + D]
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    before = buf.clone()
    positions, cs = _positions(), make_cos_sin(P, R)
    rope_ext.apply_rotary_qk_(view, None, positions, cs, interleaved=interleaved)
    mask = torch.zeros(buf.shape, dtype=torch.bool)
    mask[1:-1, 1:3, 4 : 4 + D] = True
    assert torch.equal(bits(buf)[~mask], bits(before)[~mask])
    ref = reference.rotary_hadamard(before[1:-1, 1:3, 4 : 4 + D], positions, cs, interleaved=interleaved)
    assert_close_to_reference(view, ref, before[1:-1, 1:3, 4 : 4 + D].abs().max().item())


PACKED = {
    # name: (packed shape, q slice, k slice, positions)
    "THD-heads": ((6, 8, 16), (slice(None), slice(0, 4)), (slice(None), slice(4, 6)), (6, 1)),
    "BSHD-heads": (
        (2, 3, 8, 16),
        (slice(None), slice(None), slice(0, 4)),
        (slice(None), slice(None), slice(4, 6)),
        (3, 1),
    ),
    "SBHD-heads": (
        (3, 2, 8, 16),
        (slice(None), slice(None), slice(0, 4)),
        (slice(None), slice(None), slice(4, 6)),
        (3, 1, 1),
    ),
    "THD-features": (
        (6, 4, 48),
        (slice(None), slice(None), slice(0, 16)),
        (slice(None), slice(None), slice(16, 32)),
        (6, 1),
    ),
    "BHSD-heads": ((2, 8, 3, 16), (slice(None), slice(0, 4)), (slice(None), slice(4, 6)), (2, 1, 3)),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_qkv_is_accepted_in_place(name):
    """q and k sliced from one packed tensor share storage but no element: accepted, v untouched."""
    shape, qs, ks, pshape = PACKED[name]
    qkv = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    before = qkv.clone()
    q, k = qkv[qs], qkv[ks]
    positions = torch.randint(0, P, pshape, generator=torch.Generator().manual_seed(3))
    cs = make_cos_sin(P, R)
    rope_ext.apply_rotary_qk_(q, k, positions, cs)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[qs] = True
    mask[ks] = True
    assert torch.equal(qkv[~mask], before[~mask])
    for view, sl in ((q, qs), (k, ks)):
        assert_close_to_reference(view, reference.rotary_hadamard(before[sl], positions, cs), 5.0)


def test_flat_packed_qkv_view_is_accepted_in_place():
    """The vLLM layout: qkv [T, (HQ + 2 HK) * D], q = qkv[:, :HQ*D].view(T, HQ, D)."""
    qkv = torch.randn(T, (HQ + 2 * HK) * D)
    before = qkv.clone()
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D)
    rope_ext.apply_rotary_qk_(q, k, _positions(), make_cos_sin(P, R))
    assert torch.equal(qkv[:, (HQ + HK) * D :], before[:, (HQ + HK) * D :])
    ref = reference.rotary_hadamard(before[:, : HQ * D].view(T, HQ, D), _positions(), make_cos_sin(P, R))
    assert_close_to_reference(q, ref, before.abs().max().item())


def test_empty_expanded_target_is_a_no_op():
    """An empty tensor has no two elements in one place, whatever its strides."""
    q = torch.empty(0, 1, D).expand(0, 3, D)
    rope_ext.apply_rotary_qk_(q, None, torch.zeros(0, 1, dtype=torch.long), make_cos_sin(P, R))


def test_interleaved_strides_without_overlap_are_accepted():
    """Sizes [2, 3] with strides [3 D, 2 D] reach 6 distinct rows although the strides interleave."""
    buf = torch.randn(8 * D)
    before = buf.clone()
    q = buf.as_strided((2, 3, D), (3 * D, 2 * D, 1))
    positions = torch.tensor([[1], [2]])
    cs = make_cos_sin(P, R)
    rope_ext.apply_rotary_qk_(q, None, positions, cs)
    ref = reference.rotary_hadamard(before.as_strided((2, 3, D), (3 * D, 2 * D, 1)), positions, cs)
    assert_close_to_reference(q, ref, before.abs().max().item())
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[[0, 2, 4, 3, 5, 7]] = False
    assert torch.equal(buf.view(8, D)[untouched], before.view(8, D)[untouched])


# --------------------------------------------------------------------------------------------
# Overlap detection is exact: random strides in one small buffer, brute force as the oracle.


def _elements(shape, strides, offset):
    """Buffer indices of every element of an as_strided view."""
    return [
        offset + sum(i * s for i, s in zip(idx, strides, strict=True))
        for idx in itertools.product(*map(range, shape))
    ]


@st.composite
def strided_pairs(draw):
    """q and k as random as_strided views of one buffer (last dim contiguous), k possibly absent."""
    rank = draw(st.integers(2, 4))
    d = draw(st.sampled_from([2, 4, 6]))

    def one():
        shape = tuple(draw(st.integers(0, 3)) for _ in range(rank - 1)) + (d,)
        strides = tuple(draw(st.integers(0, 4 * d)) for _ in range(rank - 1)) + (1,)
        return shape, strides, draw(st.integers(0, 3 * d))

    q = one()
    k = None
    if draw(st.booleans()):
        shape, strides, off = one()
        # same broadcast (token) sizes as q in dim 0, so that positions [n, 1, ...] fit both
        k = ((q[0][0], *shape[1:]), strides, off)
    return q, k


@property_settings(300)
@given(pair=strided_pairs())
@example(pair=(((2, 3, 2), (6, 4, 1), 0), None))  # interleaved strides, no overlap
@example(pair=(((2, 3, 2), (3, 2, 1), 0), None))  # rows overlap
@example(pair=(((3, 2, 2), (8, 2, 1), 0), ((3, 1, 2), (8, 2, 1), 4)))  # packed, disjoint
@example(pair=(((3, 2, 2), (8, 2, 1), 0), ((3, 1, 2), (8, 2, 1), 3)))  # packed, one element shared
def test_overlap_detection_is_exact(pair):
    """In place is accepted iff no element of q (and k) is reached twice; then results are right."""
    (qs, qst, qo), k = pair
    q_el = _elements(qs, qst, qo)
    k_el = [] if k is None else _elements(*k)
    overlap = len(set(q_el)) < len(q_el) or len(set(k_el)) < len(k_el) or bool(set(q_el) & set(k_el))
    size = max(q_el + k_el + [0]) + 2
    buf = torch.randn(size, generator=torch.Generator().manual_seed(size))
    before = buf.clone()
    q = buf.as_strided(qs, qst, qo)
    kt = None if k is None else buf.as_strided(*k)
    positions = torch.arange(qs[0]).reshape(-1, *([1] * (len(qs) - 2))) % P
    cs = make_cos_sin(P, 2)
    if overlap:
        with pytest.raises(ValueError, match="overlap"):
            rope_ext.apply_rotary_qk_(q, kt, positions, cs)
        assert torch.equal(buf, before)
        return
    rope_ext.apply_rotary_qk_(q, kt, positions, cs)
    written = torch.zeros(size, dtype=torch.bool)
    written[q_el + k_el] = True
    assert torch.equal(buf[~written], before[~written])
    for shape, strides, off in [(qs, qst, qo)] + ([] if k is None else [k]):
        if 0 in shape:
            continue
        ref = reference.rotary_hadamard(before.as_strided(shape, strides, off), positions, cs)
        assert_close_to_reference(buf.as_strided(shape, strides, off), ref, before.abs().max().item())


def test_single_row_with_a_huge_stride():
    """The stride of a size-1 dim may be anything (2^62 here): a single row is rotated, and its overlap with
    another single row is decided from their elements, without arithmetic on that stride."""
    buf = torch.randn(256, generator=torch.Generator().manual_seed(0))
    before = buf.clone()
    q = buf.as_strided((1, 4, 8), (2**62, 8, 1))
    k = buf.as_strided((1, 2, 8), (2**61, 8, 1), 64)
    cs = make_cos_sin(P, 8)
    positions = torch.tensor([[3]])
    rope_ext.apply_rotary_qk_(q, k, positions, cs)
    ref = reference.rotary_hadamard(before.as_strided((1, 4, 8), (2**62, 8, 1)), positions, cs)
    assert_close_to_reference(q, ref, before.abs().max().item())
    rotated = buf.clone()
    with pytest.raises(ValueError, match="overlap"):
        rope_ext.apply_rotary_qk_(q, buf.as_strided((1, 2, 8), (2**61, 8, 1), 8), positions, cs)
    assert torch.equal(buf, rotated)

"""Randomized agreement with the float64 reference over shapes, layouts, strides, dtypes and pairings.

Every draw (tests/_strategies.py) is checked three ways: the result agrees with
``reference.rotary_hadamard`` at the project tolerance (pass-through features bit-exact), read-only
inputs are bit-identical afterwards, and no element outside the written views changed (guard values).
The CUDA kernel body is checked through its host emulation, on the vector and the scalar path.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close_to_reference, requires_emulation
from _strategies import Case, View, build, cases, property_settings, view_mask
from _strategies import bits as raw_bits
from hypothesis import example, given
from hypothesis import strategies as st

import rope_ext
from rope_ext import reference

ops = torch.ops.rope_ext


def test_output_of_expanded_input_has_contiguous_last_dim():
    """The regression EXPANDED_X directly: outputs keep a stride-1 last dim, eager and under FakeTensor."""
    x = torch.randn(6).as_strided((1, 1, 2, 3), (6, 1, 0, 1))
    positions = torch.zeros(1, 1, 1, dtype=torch.int32)
    cs = rope_ext.RopeCache(2, max_positions=1).cos_sin
    out = rope_ext.apply_rotary(x, positions, cs)
    q, k = rope_ext.apply_rotary_qk(x, x, positions, cs)
    assert out.stride(-1) == q.stride(-1) == k.stride(-1) == 1
    ref = reference.rotary_hadamard(x, positions, cs)
    for t in (out, q, k):
        assert_close_to_reference(t, ref, x.abs().max().item())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fake = ops.rotary.default(fx, mode.from_tensor(positions), mode.from_tensor(cs), False, False)
    assert fake.stride() == out.stride()


def expect_rotated(out: torch.Tensor, x: torch.Tensor, case: Case, positions, cos_sin) -> None:
    """``out`` is ``x`` rotated as ``case`` says: reference agreement, pass-through bit-exact."""
    assert out.shape == x.shape and out.dtype == x.dtype
    if out.numel() == 0:
        return
    ref = reference.rotary_hadamard(
        x, positions, cos_sin, interleaved=case.interleaved, inverse=case.inverse, **case.rope_kwargs()
    )
    lo, hi = case.rotary_offset, case.rotary_offset + case.rotary_dim
    for keep in (slice(0, lo), slice(hi, None)):
        assert torch.equal(raw_bits(out[..., keep]), raw_bits(x[..., keep])), "pass-through features changed"
    assert_close_to_reference(out[..., lo:hi], ref[..., lo:hi], x.abs().max().item())


def expect_untouched(after: torch.Tensor, before: torch.Tensor, written: list) -> None:
    """Buffer elements outside the ``written`` views kept their bits."""
    keep = torch.ones(after.numel(), dtype=torch.bool)
    for v in written:
        keep &= ~view_mask(v, after.numel())
    assert torch.equal(raw_bits(after)[keep], raw_bits(before)[keep]), "an element outside the view changed"


def run_checked(case: Case, call, *, inplace: bool, outs=None) -> None:
    """Builds ``case``, runs ``call(built)`` and checks results, inputs and guards.

    ``call`` returns the rotated q (and k) for out-of-place ops, None in place; ``outs`` are
    (buffer, view) pairs that the call writes besides the inputs (emulated out-of-place results).
    """
    b = build(case)
    snap = [buf.clone() for buf in b.bufs]
    pos_snap, cs_snap = b.positions.clone(), b.cos_sin.clone()
    q0 = case.q.of(snap[0])
    k0 = None if case.k is None else case.k.of(snap[b.k_buf])
    result = call(b)
    if inplace:
        q_res, k_res = b.q, b.k
        written = {0: [case.q]}
        if case.k is not None:
            written.setdefault(b.k_buf, []).append(case.k)
    else:
        q_res, k_res = result if isinstance(result, tuple) else (result, None)
        written = {}
    for i, buf in enumerate(b.bufs):
        expect_untouched(buf, snap[i], written.get(i, []))
    assert torch.equal(b.positions, pos_snap) and torch.equal(raw_bits(b.cos_sin), raw_bits(cs_snap))
    expect_rotated(q_res, q0, case, pos_snap, cs_snap)
    if k0 is not None:
        expect_rotated(k_res, k0, case, pos_snap, cs_snap)


# --------------------------------------------------------------------------------------------
# The public ops (CPU kernels).


# Found by the test below: an expanded input with a size-1 dim of stride 1 (sizes [1, 1, 2, 3], strides
# [6, 1, 0, 1]) got an output whose last dim had stride 2 (empty_like), which the kernels wrote as if
# contiguous.
EXPANDED_X = Case(
    dtype=torch.float32,
    head_dim=3,
    rotary_dim=2,
    q=View(shape=(1, 1, 2, 3), strides=(6, 1, 0, 1), offset=0),
    k=None,
    shared_buffer=False,
    pos=View(shape=(1, 1, 1), strides=(1, 1, 1), offset=0),
    pos_dtype=torch.int32,
    n_cache=1,
    cs_dtype=torch.float32,
    cs_pad=(0, 0),
    interleaved=False,
    inverse=False,
    scale=1.0,
    seed=0,
)


# Found by the long profile: cancellation. bfloat16 pair (0.898, -2.125) rotates to 1.7644e-6; float32
# arithmetic gives 1.7881e-6 (error 2.4e-8 = 1e-8 |x|, but 3.2 bf16 ulps of the tiny result).
CANCELLATION_BF16 = Case(
    dtype=torch.bfloat16,
    head_dim=263,
    rotary_dim=216,
    q=View(shape=(4, 1, 1, 263), strides=(265, 3180, 1590, 1), offset=2120),
    k=None,
    shared_buffer=False,
    pos=View(shape=(4, 1, 1), strides=(1, 1, 1), offset=0),
    pos_dtype=torch.int32,
    n_cache=19,
    cs_dtype=torch.float32,
    cs_pad=(0, 0),
    interleaved=False,
    inverse=False,
    scale=1.0,
    seed=47,
)
# float16 pair (68, 396) rotates to -0.0059856; float32 arithmetic gives -0.0059814 (1.09 ulp).
CANCELLATION_FP16 = Case(
    dtype=torch.float16,
    head_dim=441,
    rotary_dim=440,
    q=View(shape=(4, 3, 441), strides=(2658, 886, 1), offset=4),
    k=View(shape=(4, 3, 441), strides=(2652, 442, 1), offset=1),
    shared_buffer=False,
    pos=View(shape=(4, 3), strides=(3, 0), offset=0),
    pos_dtype=torch.int32,
    n_cache=18,
    cs_dtype=torch.float32,
    cs_pad=(0, 0),
    interleaved=True,
    inverse=True,
    scale=300.0,
    seed=3466,
)


@property_settings()
@given(case=cases(qk=False, inplace=False))
@example(case=EXPANDED_X)
@example(case=CANCELLATION_BF16)
def test_apply_rotary_matches_reference(case):
    """apply_rotary: out of place, forward and inverse, read-only input (may be expanded)."""
    run_checked(
        case,
        lambda b: rope_ext.apply_rotary(
            b.q,
            b.positions,
            b.cos_sin,
            interleaved=case.interleaved,
            inverse=case.inverse,
            **case.rope_kwargs(),
        ),
        inplace=False,
    )


def _qk(case: Case):
    def call(b):
        if case.inverse:  # the public wrapper has no inverse flag: the registered op has
            return ops.rotary_qk.default(
                b.q, b.k, b.positions, b.cos_sin, case.interleaved, True, *case.op_tail()
            )
        return rope_ext.apply_rotary_qk(
            b.q, b.k, b.positions, b.cos_sin, interleaved=case.interleaved, **case.rope_kwargs()
        )

    return call


@property_settings()
@given(case=cases(qk=True, inplace=False))
@example(case=EXPANDED_X.with_k(View(shape=(1, 1, 2, 3), strides=(3, 1, 0, 1), offset=0)))
def test_apply_rotary_qk_matches_reference(case):
    """apply_rotary_qk: q and k with other head counts, separate / shared / packed buffers."""
    run_checked(case, _qk(case), inplace=False)


def _qk_inplace(case: Case):
    def call(b):
        if case.inverse:
            ops.rotary_qk_.default(b.q, b.k, b.positions, b.cos_sin, case.interleaved, True, *case.op_tail())
        else:
            rope_ext.apply_rotary_qk_(
                b.q, b.k, b.positions, b.cos_sin, interleaved=case.interleaved, **case.rope_kwargs()
            )

    return call


@property_settings()
@given(case=st.one_of(cases(qk=True, inplace=True), cases(qk=False, inplace=True)))
@example(case=CANCELLATION_FP16)
def test_apply_rotary_qk_inplace_matches_reference(case):
    """apply_rotary_qk_: in place on views of bigger buffers, k optional, packed q/k accepted."""
    run_checked(case, _qk_inplace(case), inplace=True)


# --------------------------------------------------------------------------------------------
# The CUDA kernel body, run on the host over the CUDA grid.

NUM_SMS = st.sampled_from([1, 4, 16, 132, 100_000])


def _emulated(case: Case, num_sms: int, force_scalar: bool, inplace: bool, launch: list):
    def call(b):
        if inplace:
            q_out, k_out = b.q, b.k
        else:
            q_out = case.out.of(torch.full((case.out.end() + 3,), 7.0, dtype=case.dtype))
            k_out = None
            if b.k is not None:
                k_out = case.out_k.of(torch.full((case.out_k.end() + 3,), 7.0, dtype=case.dtype))
            launch.append((q_out, k_out))
        launch.append(
            ops._cuda_emulated(
                b.q,
                b.k,
                q_out,
                k_out,
                b.positions,
                b.cos_sin,
                case.interleaved,
                case.inverse,
                num_sms,
                force_scalar,
                *case.op_tail(),
            )
        )
        return None if inplace else (q_out, k_out)

    return call


def _check_out_guards(case: Case, launch: list) -> None:
    """Out-of-place emulation: elements of the output buffers outside the output views stay 7."""
    q_out, k_out = launch[0]
    for out, view in ((q_out, case.out), (k_out, case.out_k)):
        if out is None:
            continue
        buf = out.as_strided((view.end() + 3,), (1,), 0)
        keep = ~view_mask(view, buf.numel())
        assert bool((buf[keep] == 7).all()), "emulated kernel wrote outside its output view"


def _emulation_case(aligned: bool):
    return st.tuples(
        st.booleans(),
        st.booleans(),
    ).flatmap(
        lambda f: st.tuples(
            st.just(f[0]),
            cases(qk=f[1], inplace=f[0], aligned=aligned, emulated_out=not f[0]),
        )
    )


@requires_emulation
@pytest.mark.parametrize("force_scalar", [False, True], ids=["vector", "scalar"])
@property_settings(250)
@given(drawn=_emulation_case(aligned=False), num_sms=NUM_SMS)
def test_cuda_body_matches_reference(drawn, num_sms, force_scalar):
    """Emulated CUDA kernel on arbitrary layouts (vector path when the layout allows it)."""
    inplace, case = drawn
    launch: list = []
    run_checked(case, _emulated(case, num_sms, force_scalar, inplace, launch), inplace=inplace)
    if not inplace:
        _check_out_guards(case, launch)
    if force_scalar:
        assert launch[-1][4] == 0


# Found by the test below: out of place, an empty q made the CUDA body skip k's pass-through copy
# (empty tensors have null data pointers, so q's in == out read as "in place").
EMPTY_Q = Case(
    dtype=torch.float32,
    head_dim=32,
    rotary_dim=16,
    q=View(shape=(2, 0, 32), strides=(64, 32, 1), offset=0),
    k=View(shape=(2, 2, 32), strides=(64, 32, 1), offset=0),
    shared_buffer=True,
    pos=View(shape=(2, 1), strides=(0, 1), offset=0),
    pos_dtype=torch.int32,
    n_cache=1,
    cs_dtype=torch.float32,
    cs_pad=(0, 0),
    interleaved=False,
    inverse=False,
    scale=1.0,
    seed=0,
    out=View(shape=(2, 0, 32), strides=(32, 32, 1), offset=0),
    out_k=View(shape=(2, 2, 32), strides=(64, 32, 1), offset=0),
)


@requires_emulation
@pytest.mark.parametrize("force_scalar", [False, True], ids=["vector", "scalar"])
@property_settings(250)
@given(drawn=_emulation_case(aligned=True), num_sms=NUM_SMS)
@example(drawn=(False, EMPTY_Q), num_sms=1)
def test_cuda_body_aligned_matches_reference(drawn, num_sms, force_scalar):
    """Emulated CUDA kernel on layouts whose every access is 16-byte aligned: the vector path runs."""
    inplace, case = drawn
    launch: list = []
    run_checked(case, _emulated(case, num_sms, force_scalar, inplace, launch), inplace=inplace)
    if not inplace:
        _check_out_guards(case, launch)
    assert launch[-1][4] == (0 if force_scalar else 1)

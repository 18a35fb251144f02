"""The CPU kernel's vector paths (32- and 16-lane bf16, 16- and 8-lane fp32/fp16, masked and scalar tails,
strided heads) against the float64 reference and against bit-exact scalar rounding. test_cpu_isa.py runs
this file once per instruction set of the CPU."""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close_to_reference, make_cos_sin

import rope_ext
from rope_ext import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
# Whole vectors of 8, 16 and 32 lanes, and tails of 1, 2, 4, 15 pairs (masked AVX-512, scalar AVX2/NEON).
@pytest.mark.parametrize(
    "head_dim,rotary_dim",
    [(128, 128), (96, 96), (80, 40), (256, 64), (36, 36), (6, 2), (34, 34), (62, 62), (130, 130), (160, 160)],
)
def test_vector_paths_match_reference(dtype, interleaved, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(head_dim * 7 + rotary_dim)
    T = 9
    q = torch.randn(T, 5, head_dim, generator=g).to(dtype)
    k = torch.randn(T, 2, head_dim, generator=g).to(dtype)
    cs = make_cos_sin(4096, rotary_dim)
    pos = torch.randint(0, 4096, (T, 1), generator=g)
    qo, ko = rope_ext.apply_rotary_qk(q, k, pos, cs, interleaved=interleaved)
    for x, out in ((q, qo), (k, ko)):
        ref = reference.rotary_hadamard(x, pos, cs, interleaved=interleaved)
        assert_close_to_reference(out, ref, float(x.abs().max()))
    q2, k2 = q.clone(), k.clone()
    rope_ext.apply_rotary_qk_(q2, k2, pos, cs, interleaved=interleaved)
    assert torch.equal(q2, qo) and torch.equal(k2, ko)


@pytest.mark.parametrize("interleaved", [False, True])
def test_bf16_rounding_is_exact_and_keeps_nan(interleaved):
    """bf16 outputs equal the fp32 result rounded to nearest even; NaN inputs stay NaN."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)
    x[1, 2, 5] = float("nan")
    x[2, 0, 40] = float("inf")
    cs = make_cos_sin(64, 64)
    pos = torch.tensor([[3], [17], [63]])
    out = rope_ext.apply_rotary(x, pos, cs, interleaved=interleaved)
    fp32 = rope_ext.apply_rotary(x.float(), pos, cs, interleaved=interleaved)
    assert torch.equal(out.isnan(), fp32.isnan())
    assert torch.equal(torch.nan_to_num(out.float()), torch.nan_to_num(fp32.to(torch.bfloat16).float()))


def test_multiple_head_dims_and_strides():
    """Heads spread over several non-mergeable dims (the head walker) and a strided token dim."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 3, 4, 2, 70, generator=g).to(torch.bfloat16)
    x = base[:, :, 1:, :, :64]  # [6, 3, 3, 2, 64]: token dim 0, heads over dims 1-3
    cs = make_cos_sin(32, 48)
    pos = torch.tensor([0, 5, 9, 31, 2, 7]).view(6, 1, 1, 1)
    for il in (False, True):
        out = rope_ext.apply_rotary(x, pos, cs, interleaved=il)
        ref = reference.rotary_hadamard(x, pos, cs, interleaved=il)
        assert_close_to_reference(out, ref, float(x.abs().max()))


@pytest.mark.parametrize("interleaved", [False, True])
def test_nan_in_cos_sin_stays_nan_in_bf16(interleaved):
    """A NaN of any payload in a float32 cos/sin row gives NaN (never inf or a number) in bf16 outputs."""
    cs = make_cos_sin(8, 64).clone()
    cs.view(torch.int32)[3, 5] = 0x7FFFFFFF  # NaN whose rounding bias would carry into the sign
    cs.view(torch.int32)[3, 32 + 7] = -1  # 0xFFFFFFFF, a negative NaN
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    pos = torch.tensor([[3], [1]])
    for inverse in (False, True):
        out = rope_ext.apply_rotary(x, pos, cs, interleaved=interleaved, inverse=inverse).float()
        ref = rope_ext.apply_rotary(x.float(), pos, cs, interleaved=interleaved, inverse=inverse)
        assert torch.equal(out.isnan(), ref.isnan())
        assert out[0].isnan().any() and not out[1].isnan().any()

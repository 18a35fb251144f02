"""``inverse=True`` on the cache ops (DeepSeek-V4-style attention rotates back by the query's position): q
(or q_out) is rotated by the negative angle, k (k_pe) as always, since it goes to the cache. Checked bit for
bit against the rotation op (``apply_rotary(..., inverse=True)`` for q, the forward rotation for k), on the
CPU op and on the CUDA body run on the host (vector and scalar paths), with q in place, q_out of q's dtype
and fp8 q_out, both pairings, partial rotary at an offset."""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_EMULATION

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
T, HQ, HK, D, R, OFF = 7, 4, 2, 32, 16, 8
E4M3 = torch.float8_e4m3fn
SCALE = torch.tensor([0.43])


def _bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HQ, D, generator=g).to(dtype)
    k = torch.randn(T, HK, D, generator=g).to(dtype)
    v = torch.randn(T, HK, D, generator=g).to(dtype)
    pos = torch.randint(0, 64, (T,), generator=g)
    slots = torch.randperm(4 * 8, generator=g)[:T]
    slots[2] = -1
    return q, k, v, pos, slots


def _expected_q(q, pos, cs, il, q_out):
    qi = rope_ext.apply_rotary(q, pos[:, None], cs, interleaved=il, inverse=True, rotary_offset=OFF)
    return reference.quantize_fp8(qi, SCALE, E4M3) if q_out == "fp8" else qi


def _q_out(q_out, dtype):
    return None if q_out is None else torch.zeros(T, HQ, D, dtype=E4M3 if q_out == "fp8" else dtype)


@pytest.mark.parametrize("backend", ["cpu", "emulated-vector", "emulated-scalar"])
@pytest.mark.parametrize("q_out", [None, "same", "fp8"])
@pytest.mark.parametrize("il", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gqa_cache_op_rotates_q_back_and_k_forward(dtype, il, q_out, backend):
    if backend != "cpu" and not HAS_EMULATION:
        pytest.skip("no emulation library")
    cs = rope_ext.RopeCache(R, max_positions=64).cos_sin
    q, k, v, pos, slots = _inputs(dtype)
    q0, k0 = q.clone(), k.clone()
    kc, vc = torch.zeros(4, 8, HK, D, dtype=dtype), torch.zeros(4, 8, HK, D, dtype=dtype)
    qo = _q_out(q_out, dtype)
    opts = dict(q_out=qo, q_scale=SCALE, interleaved=il, rotary_offset=OFF)
    if backend == "cpu":
        rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots, inverse=True, **opts)
    else:
        OPS._cuda_emulated_cache(
            q, k, v, pos[:, None], cs, kc, vc, slots, None, None, qo, SCALE, il, "NHD", 4,
            backend == "emulated-scalar", OFF, None, False, True,
        )  # fmt: skip
    k_fwd = rope_ext.apply_rotary(k0, pos[:, None], cs, interleaved=il, rotary_offset=OFF)
    want_q = _expected_q(q0, pos, cs, il, q_out)
    assert torch.equal(_bits(q if qo is None else qo), _bits(want_q))
    assert torch.equal(k, k_fwd)
    if qo is not None:
        assert torch.equal(q, q0)  # read only
    written = slots >= 0
    assert torch.equal(kc.view(-1, HK, D)[slots[written]], k_fwd[written])


@pytest.mark.parametrize("backend", ["cpu", "emulated-vector", "emulated-scalar"])
@pytest.mark.parametrize("q_out", [None, "fp8"])
@pytest.mark.parametrize("il", [False, True], ids=["half", "interleaved"])
def test_mla_op_rotates_q_back_and_k_pe_forward(il, q_out, backend):
    if backend != "cpu" and not HAS_EMULATION:
        pytest.skip("no emulation library")
    dtype = torch.bfloat16
    cs = rope_ext.RopeCache(R, max_positions=64).cos_sin
    q, k, v, pos, slots = _inputs(dtype, seed=1)
    q = q[..., : OFF + R].contiguous()  # q [T, H, nope + rope], rope at OFF
    k_pe, kv_c = k[:, 0, :R].contiguous(), v[:, 0].contiguous()
    q0, k0 = q.clone(), k_pe.clone()
    cache = torch.zeros(4, 8, D + R, dtype=dtype)
    qo = None if q_out is None else torch.zeros(T, HQ, OFF + R, dtype=E4M3)
    if backend == "cpu":
        rope_ext.apply_mla_rotary_and_cache_(
            q, kv_c, k_pe, pos, cs, cache, slots, rotary_offset=OFF, interleaved=il, q_out=qo, q_scale=SCALE,
            inverse=True,
        )  # fmt: skip
    else:
        OPS._cuda_emulated_mla(
            q, kv_c, k_pe, pos, cs, cache, slots, None, qo, SCALE, il, OFF, 4, backend == "emulated-scalar",
            True,
        )  # fmt: skip
    want_q = _expected_q(q0, pos, cs, il, q_out)
    k_fwd = rope_ext.apply_rotary(k0, pos, cs, interleaved=il)
    assert torch.equal(_bits(q if qo is None else qo), _bits(want_q))
    assert torch.equal(k_pe, k_fwd)
    written = slots >= 0
    rows = cache.view(-1, D + R)[slots[written]]
    assert torch.equal(rows, torch.cat([kv_c, k_fwd], dim=-1)[written])


def test_inverse_undoes_the_forward_cache_rotation_of_q():
    """q rotated forward by one call and back by an inverse one (the caches written twice alike)."""
    cs = reference.cos_sin_table(64, R)  # float64 angles and values: cos^2 + sin^2 = 1 to 1e-16
    q, k, v, pos, slots = _inputs(torch.float64, seed=2)
    q0 = q.clone()
    kc, vc = torch.zeros(4, 8, HK, D, dtype=torch.float64), torch.zeros(4, 8, HK, D, dtype=torch.float64)
    rope_ext.apply_rotary_qk_and_cache_(q, k.clone(), v, pos, cs, kc, vc, slots, rotary_offset=OFF)
    back = dict(rotary_offset=OFF, inverse=True)
    rope_ext.apply_rotary_qk_and_cache_(q, k.clone(), v, pos, cs, kc, vc, slots, **back)
    torch.testing.assert_close(q, q0, rtol=0, atol=1e-14)


def test_inverse_traces_and_passes_opcheck():
    cs = rope_ext.RopeCache(R, max_positions=64).cos_sin
    q, k, v, pos, slots = _inputs(torch.float32, seed=3)
    kc, vc = torch.zeros(4, 8, HK, D), torch.zeros(4, 8, HK, D)
    args = (q.clone(), k.clone(), v, pos, cs, kc.clone(), vc.clone(), slots)
    torch.library.opcheck(
        OPS.rotary_qk_cache_.default,
        args,
        dict(interleaved=True, rotary_offset=OFF, inverse=True),
    )

    def f(q, k, kc, vc):
        rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots, rotary_offset=OFF, inverse=True)
        return q, k, kc

    eager = f(q.clone(), k.clone(), kc.clone(), vc.clone())
    compiled_f = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled = compiled_f(q.clone(), k.clone(), kc.clone(), vc.clone())
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)

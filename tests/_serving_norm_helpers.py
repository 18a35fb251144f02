"""Shared by the QK RMSNorm + rotary tests (test_serving_norm.py): the inputs (:func:`make_qkv`,
:func:`make_weights`), the runs on each backend (:func:`run`), the reference (:func:`expected`) and the
check against it (:func:`check`).

Backends: the CPU kernel through the public API, the CUDA kernel body run on the CPU through the test-only
op ``_cuda_emulated_norm`` (vector path, scalar path, grids of 1 and 132 SMs) and, on a machine with a GPU,
the CUDA kernel through the public API (qkv's storage, the weights, positions and table moved to the GPU,
the results copied back and checked on the host as the CPU kernel's).

Tolerance (:func:`check`). The reference (``reference.qk_norm_rotary``) normalises in float64, rounds the
norm output once to the activation dtype, rotates in float64 and rounds again. The kernels normalise in
float32 (another summation order), so a norm output next to a rounding tie may land one ulp away from the
reference's; the rotation carries that difference as ``dn1 c - dn2 s``, at most ``sqrt(2)`` ulps of the
head's magnitude M (``|c| + |s| <= sqrt(2)``), and the two final roundings differ by at most one more ulp:
``(1 + sqrt(2)) ulp(M) ~ 2.4 ulp``, so bfloat16/float16 are checked to 2.5 ulps of M, where M is the
largest magnitude of the head's float64 norm output and reference output. A tie is rare (float32 carries
16 more bits than bfloat16; about 1 element in 10^4 differs), so at least 99% of the q/k elements (all but
one in a tiny call) must also be bit-equal to the reference: a kernel that rounds differently (e.g. skips
the rounding between norm and rotary: ~30% differ) fails that. float32:
``1e-5 M`` (float32 sums of up to 512 squares, rsqrt, the scale and the rotation: a few 2^-24 relative
each, a few 1e-6 at worst); float64: ``1e-12 M`` (eps and weight_offset are used in float64 there,
test_float64_uses_float64_eps_and_weight_offset). The v heads must keep their bits.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, HAS_EMULATION, NO_CUDA, NO_EMULATION, requires_cuda, to_device, ulp
from _strategies import bits

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
HAS_NORM_EMULATION = HAS_EMULATION and hasattr(OPS, "_cuda_emulated_norm")
requires_norm_emulation = pytest.mark.skipif(not HAS_NORM_EMULATION, reason=NO_EMULATION)
HALF = (torch.float16, torch.bfloat16)
GQA, NO_V = (8, 2, 2), (8, 2, 0)
# backend -> (num_sms, force_scalar) of the emulated CUDA body; None for the CPU kernel, "cuda" for the CUDA
# kernel (public API).
BACKENDS = {
    "cpu": None,
    "emu-vec-132": (132, False),
    "emu-vec-1": (1, False),
    "emu-scalar-132": (132, True),
    "cuda": "cuda",
}
HOST_BACKENDS = {b: spec for b, spec in BACKENDS.items() if spec != "cuda"}
N_POS = 64


def backend_param(name):
    marks = {"cpu": [], "cuda": [requires_cuda]}.get(name, [requires_norm_emulation])
    return pytest.param(name, id=name, marks=marks)


def make_qkv(tokens, heads, d, dtype, *, layout="contiguous", seed=0, scale=2.0):
    """``(big, qkv)``: qkv ``[T, sum(heads) * d]`` is all of ``big`` or a strided view of a wider tensor:
    ``aligned`` keeps 16-byte alignment (the vector path stays applicable), ``odd`` breaks it."""
    g = torch.Generator().manual_seed(seed)
    width = sum(heads) * d
    lead, pad = {"contiguous": (0, 0), "aligned": (8, 16), "odd": (1, 3)}[layout]
    big = (torch.randn(tokens, width + pad, generator=g, dtype=torch.float64) * scale).to(dtype)
    return big, big[:, lead : lead + width]


def make_weights(d, dtype, weight_offset, seed=1):
    """q and k weights of ``dtype`` whose effective scale ``w + weight_offset`` is about 1 (Gemma: w ~ 0)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2, d, generator=g, dtype=torch.float64) * 0.3 + (1.0 - weight_offset)
    return w[0].to(dtype), w[1].to(dtype)


def split(qkv, hq, hk, hv):
    d = qkv.shape[-1] // (hq + hk + hv)
    q = qkv[:, : hq * d].unflatten(-1, (hq, d))
    k = qkv[:, hq * d : (hq + hk) * d].unflatten(-1, (hk, d))
    return q, k, qkv[:, (hq + hk) * d :]


def run(backend, qkv, heads, qw, kw, pos, cs, **opts):
    """Applies the op in place on ``qkv`` with ``backend`` (a name of BACKENDS, or ``(num_sms,
    force_scalar)``); returns the emulation's ``[grid_x, warps, vectorized]`` (None for the CPU and CUDA
    kernels)."""
    emulation = BACKENDS[backend] if isinstance(backend, str) else backend
    if emulation is None:
        rope_ext.apply_qk_norm_rotary_(qkv, *heads, qw, kw, pos, cs, **opts)
        return None
    if emulation == "cuda":
        if not HAS_CUDA:
            pytest.skip(NO_CUDA)
        (qkv_d, *rest), write_back = to_device([qkv, qw, kw, pos, cs], "cuda")
        rope_ext.apply_qk_norm_rotary_(qkv_d, *heads, *rest, **opts)
        write_back()
        return None
    if opts.get("mrope_section") is not None:
        pytest.skip("the emulated norm op takes no mrope_section")
    sms, scalar = emulation
    q, k, _ = split(qkv, *heads)
    o = dict(eps=1e-6, interleaved=False, weight_offset=0.0, rotary_offset=0) | opts
    return OPS._cuda_emulated_norm(
        q, k, q, k, qw, kw, pos[:, None], cs, o["eps"], o["interleaved"], o["weight_offset"], sms, scalar,
        o["rotary_offset"],
    )  # fmt: skip


def expected(
    qkv, heads, qw, kw, pos, cs, *, eps=1e-6, interleaved=False, weight_offset=0.0, rotary_offset=0,
    mrope_section=None, mrope_interleaved=False,
):  # fmt: skip
    """The reference result (``reference.qk_norm_rotary``; its recipe with the rotary part at
    ``rotary_offset`` or with MRoPE otherwise) and what :func:`check` needs: per head ``[T, Hq + Hk]``, the
    magnitude M (see the module docstring)."""
    opts = dict(eps=eps, interleaved=interleaved, weight_offset=weight_offset)
    q, k, v = split(qkv, *heads)
    normed = [reference.rms_norm(h, w, eps, weight_offset) for h, w in ((q, qw), (k, kw))]
    if rotary_offset == 0 and mrope_section is None:
        ref = reference.qk_norm_rotary(qkv, *heads, qw, kw, pos, cs, **opts)
    else:
        mrope = dict(mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
        rot = [
            reference.rotary_hadamard(
                n.to(qkv.dtype), pos.unsqueeze(-1), cs, interleaved=interleaved, rotary_offset=rotary_offset,
                **mrope,
            ).to(qkv.dtype)
            for n in normed
        ]  # fmt: skip
        ref = torch.cat([*rot, v.unflatten(-1, (heads[2], q.shape[-1]))], dim=1).flatten(1)
    n = torch.cat(normed, dim=1).abs().amax(-1)
    r = torch.cat(split(ref, *heads)[:2], dim=1).double().abs().amax(-1)
    return ref, torch.maximum(n, r)


def check(out, ref, tol, before, heads):
    """``out`` (qkv after the op) against ``ref`` at the tolerance of the module docstring; v bit-exact."""
    dtype = out.dtype
    assert torch.equal(bits(split(out, *heads)[2]), bits(split(before, *heads)[2])), "v heads changed"
    got = torch.cat(split(out, *heads)[:2], dim=1)
    want = torch.cat(split(ref, *heads)[:2], dim=1)
    if got.numel() == 0:
        return
    err = (got.double() - want.double()).abs()
    m = tol[..., None]
    if dtype in HALF:
        tol = 2.5 * ulp(m, dtype)
        differ = int((bits(got) != bits(want)).sum())
        assert differ <= 0.01 * got.numel() + 1, f"{differ} of {got.numel()} elements not bit-equal"
    else:
        tol = (1e-5 if dtype == torch.float32 else 1e-12) * m
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} elements beyond tolerance; worst error {err.max().item():.3g}, "
        f"{(err / tol).max().item():.3g} x tolerance"
    )


def vectorizable(q, k, cs, rotary_offset, interleaved):
    """Whether the CUDA body may use 16-byte accesses (its ``can_vectorize`` for the norm launch)."""
    v = 16 // q.element_size()
    r, d = cs.shape[-1], q.shape[-1]
    if (r if interleaved else r // 2) % v or rotary_offset % v or r % v or (d - r) % v:
        return False
    for t in (q, k):
        if t.numel() and (t.data_ptr() % 16 or t.stride(0) % v or t.stride(1) % v):
            return False
    chunk = min(16, (v // 2 if interleaved else v) * cs.element_size())
    c = cs.element_size()
    return cs.data_ptr() % chunk == 0 and cs.stride(0) * c % chunk == 0 and (r // 2) * c % chunk == 0

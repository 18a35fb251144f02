"""Ways to run the rotary kernels, so that every reference comparison covers each of them.

* ``cpu``        - the registered ops on CPU tensors (the AVX2 or portable CPU kernel);
* ``cuda``       - the registered ops on a GPU (skipped without one);
* ``emu-tokens`` - the CUDA kernel body run on the CPU over the token-parallel grid;
* ``emu-heads``  - the same over the grid that splits heads across blocks (few tokens, many SMs);
* ``emu-scalar`` - the CUDA body with 16-byte vector accesses disabled (the scalar fallback).

The ``emu-*`` backends need the test-only op ``_cuda_emulated`` (builds with ROPE_EXT_TESTING=1) and skip
without it.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, skip_without_emulation

import rope_ext
from rope_ext.checks import axis_layout

BACKENDS = ["cpu", "cuda", "emu-tokens", "emu-heads", "emu-scalar"]
EMULATION = {"emu-tokens": (1, False), "emu-heads": (100_000, False), "emu-scalar": (4, True)}


def device_of(backend: str) -> torch.device:
    if backend == "cuda":
        if not HAS_CUDA:
            pytest.skip("no CUDA device")
        return torch.device("cuda")
    if backend in EMULATION:
        skip_without_emulation()
    return torch.device("cpu")


def emulate(
    backend,
    q,
    k,
    positions,
    cos_sin,
    *,
    interleaved,
    inverse=False,
    inplace=False,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    """Runs the CUDA kernel body on the host; returns (q_out, k_out, launch)."""
    skip_without_emulation()
    num_sms, scalar = EMULATION[backend]
    q_out = q if inplace else torch.empty_like(q)
    k_out = None if k is None else (k if inplace else torch.empty_like(k))
    sec = None if mrope_section is None else list(mrope_section)
    launch = torch.ops.rope_ext._cuda_emulated(
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin,
        interleaved,
        inverse,
        num_sms,
        scalar,
        rotary_offset,
        sec,
        axis_layout(mrope_interleaved),
    )
    return q_out, k_out, launch


def rotate_qk(
    backend,
    q,
    k,
    positions,
    cos_sin,
    *,
    interleaved,
    inverse=False,
    inplace=False,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    """Rotates q (and k, which may be None) with `backend`; returns the rotated (q, k)."""
    kw = dict(
        interleaved=interleaved,
        rotary_offset=rotary_offset,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )
    if backend.startswith("emu"):
        q_out, k_out, _ = emulate(backend, q, k, positions, cos_sin, inverse=inverse, inplace=inplace, **kw)
        return q_out, k_out
    if inplace:
        rope_ext.apply_rotary_qk_(q, k, positions, cos_sin, inverse=inverse, **kw)
        return q, k
    if k is None:
        return rope_ext.apply_rotary(q, positions, cos_sin, inverse=inverse, **kw), None
    return rope_ext.apply_rotary_qk(q, k, positions, cos_sin, inverse=inverse, **kw)

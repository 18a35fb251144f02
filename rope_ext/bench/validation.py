"""Validation: every provider's output checked against the float64 reference before it is timed.

The reference is :func:`rope_ext.reference.rotary_hadamard` on the same inputs
(:meth:`~rope_ext.bench.workloads.Case.expected`); a provider that disagrees is reported as ``wrong``
and is not timed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .workloads import Case

__all__ = ["validate"]


def validate(case: Case, mode: str, out: tuple[Tensor, Tensor], tol_ulps: float) -> tuple[bool, float]:
    """Max error over q and k, in units of ``eps(dtype) * max|input|``; ok if within ``tol_ulps``.

    The unit is one rounding of the largest value: fp32/fp64 kernels land well under 1, HF-style
    arithmetic in bf16/fp16 (three roundings, cos/sin rounded to the dtype) lands at a few, and any real
    mistake (wrong pairing, sign, position, stride) is of order ``1 / eps``.
    """
    exp = case.expected(mode)
    inputs = (case.grad_q, case.grad_k) if mode == "backward" else (case.q, case.k)
    eps = torch.finfo(case.dtype).eps
    worst = 0.0
    for o, e, x in zip(out, exp, inputs, strict=True):
        if tuple(o.shape) != tuple(e.shape):
            return False, math.inf
        scale = eps * max(float(x.abs().max()), 1e-30) if x.numel() else 1.0
        err = float((o.detach().cpu().double() - e).abs().max()) if o.numel() else 0.0
        if math.isnan(err):
            return False, math.inf
        worst = max(worst, err / scale)
    return worst <= tol_ulps, worst

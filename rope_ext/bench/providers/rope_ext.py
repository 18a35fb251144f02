"""rope_ext's own ops: in place, out of place and backward (``rope_ext.apply_rotary_qk[_]``)."""

from __future__ import annotations

import torch
from torch import Tensor

import rope_ext

from ..workloads import Case, clones
from . import Runner, provider


@provider("rope_ext", "inplace")
def _rope_ext_inplace(case: Case) -> Runner:
    q, k = clones(case)
    pos, cs, il = case.positions[:, None], case.cos_sin, case.interleaved
    apply = rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, Tensor]:
        apply(q, k, pos, cs, interleaved=il)
        return q, k

    return run


@provider("rope_ext", "out")
def _rope_ext_out(case: Case) -> Runner:
    q, k = case.q, case.k
    pos, cs, il = case.positions[:, None], case.cos_sin, case.interleaved
    apply = rope_ext.apply_rotary_qk
    return lambda: apply(q, k, pos, cs, interleaved=il)


@provider("rope_ext", "backward")
def _rope_ext_backward(case: Case) -> Runner:
    q, k = (t.clone().requires_grad_(True) for t in (case.q, case.k))
    outs = rope_ext.apply_rotary_qk(q, k, case.positions[:, None], case.cos_sin, interleaved=case.interleaved)
    grads = (case.grad_q, case.grad_k)
    return lambda: torch.autograd.grad(outs, (q, k), grads, retain_graph=True)

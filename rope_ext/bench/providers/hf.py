"""The HF-style references: transformers' eager formula (the baseline) and its ``torch.compile``.

The formula is :func:`rope_ext.reference.hf_apply_rotary_pos_emb`, in the input dtype.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from rope_ext.reference import hf_apply_rotary_pos_emb

from ..workloads import Case
from . import Runner, Skip, provider


@provider("hf-eager", "out", baseline=True)
def _hf_eager(case: Case) -> Runner:
    # cos/sin are gathered and cast once, outside the timed call: HF builds them once per forward and
    # shares them across layers, so this favours the reference.
    cos, sin = case.hf_cos_sin()
    q, k, il = case.q, case.k, case.interleaved
    return lambda: hf_apply_rotary_pos_emb(q, k, cos, sin, il)


@provider("hf-eager", "backward", baseline=True)
def _hf_eager_backward(case: Case) -> Runner:
    cos, sin = case.hf_cos_sin()
    q, k = (t.clone().requires_grad_(True) for t in (case.q, case.k))
    outs = hf_apply_rotary_pos_emb(q, k, cos, sin, case.interleaved)
    grads = (case.grad_q, case.grad_k)
    return lambda: torch.autograd.grad(outs, (q, k), grads, retain_graph=True)


_compiled: dict[tuple, Callable[..., Any]] = {}


@provider("hf-compile", "out")
def _hf_compile(case: Case) -> Runner:
    if case.device.type == "cpu" and not _have_cxx():
        raise Skip("torch.compile on CPU needs a C++ compiler")
    il = case.interleaved
    # One compiled function per (pairing, shape, dtype, device): each is compiled once for its static
    # shape, and no recompile limit is ever reached in a sweep.
    key = (il, tuple(case.q.shape), tuple(case.k.shape), case.dtype, case.device.type)
    if key not in _compiled:
        _compiled[key] = torch.compile(
            lambda q, k, c, s: hf_apply_rotary_pos_emb(q, k, c, s, il), dynamic=False, fullgraph=True
        )
        from torch import _dynamo

        # Every entry shares one code object, whose recompile limit would otherwise end a sweep.
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(_dynamo.config, name):
                setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 1024))
    fn = _compiled[key]
    cos, sin = case.hf_cos_sin()
    q, k = case.q, case.k
    return lambda: fn(q, k, cos, sin)


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in ("c++", "g++", "clang++", os.environ.get("CXX", "c++")))

"""The HF-style references: transformers' eager formula (the baseline) and its ``torch.compile``.

The formula is :func:`rope_ext.bench.baselines.hf_apply_rotary_pos_emb`, in the input dtype.

``qknorm`` mode, on views of the packed qkv, written back into it (:func:`qk_norm_rotary_unfused`):

* ``eager unfused`` (the baseline): per-head RMSNorm in float32 as HF's Qwen3 ``Qwen3RMSNorm`` does
  (:func:`hf_rms_norm`) copied back into q and k, then ``rope_ext.apply_rotary_qk_`` on them;
* ``torch.compile unfused``: ``torch.compile`` (compiled and warmed up at build) of the pure-torch
  function :func:`qk_norm_rotary_unfused` (that norm, then
  :func:`~rope_ext.bench.baselines.hf_apply_rotary_pos_emb`, ``rotate_half``) on the q and k views, whose
  results are then ``copy_``-ed back into them, in the same timed call. The copy stays outside the graph:
  on the CPU, Inductor's in-graph ``copy_`` into the strided views (or into the whole qkv) is slower than
  returning the results and copying them eagerly. Its cos/sin are gathered by position and
  cast once, outside the timed call (as for ``hf-compile``: HF builds them once per forward). Both
  choices favour the reference.

MLA modes (``mla``, ``mla-fp8``), what a server without the fused op writes by hand
(:func:`rope_ext.bench.mla.mla_rotary_cache_unfused_`: the HF formula on q's rope slice ``q[..., nope:]``
and k_pe in their dtype, copied back into them, and the cache rows ``cat(kv_c, k_pe')``, quantized with
``kv_scale`` for the fp8 cache, put at the slots with ``index_copy_`` on the cache viewed as ``[num_slots,
kv_lora_rank + rope]``; fp8: on its bytes, as CPU torch has no fp8 ``index_copy_``), cos/sin gathered and
cast once, outside the timed call:

* ``eager unfused`` (the baseline): that function run eagerly;
* ``torch.compile unfused``: that function compiled whole (and warmed up at build), the copies and the put
  in the graph: unlike ``qknorm``'s, this measured faster on the CPU than compiling the pure part and
  copying eagerly (about 10% for a prefill, 20-30% for a decode step).

Rerotate modes (``rerotate``, ``rerotate-fp8``), what a server without the op writes by hand
(:func:`rope_ext.bench.rerotate.rerotate_unfused_`: the rows at the slots gathered from the cache viewed as
``[num_slots, Hk, D]`` (fp8: its bytes), dequantized to float32 for the fp8 cache, rotated with the HF formula
by each token's shift (cos and sin of ``|delta|``, sin negated for a negative delta; in the cache's dtype, or
float32 for fp8), requantized and put back with ``index_copy_``), cos/sin gathered and cast once, outside the
timed call (as for the MLA modes: a context shift applies the same shifts to every layer's cache):

* ``eager unfused`` (the baseline): that function run eagerly;
* ``torch.compile unfused``: that function compiled whole (and warmed up at build), gather and put in the
  graph, as for the MLA modes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import rope_ext

from ..baselines import hf_apply_rotary_pos_emb
from ..mla import mla_rotary_cache_unfused_
from ..presets import MLA_MODES, REROTATE_MODES
from ..rerotate import rerotate_tensors, rerotate_unfused_, shift_cos_sin
from ..workloads import Case
from . import Runner, Skip, mla_tensors, provider

__all__ = ["hf_rms_norm", "qk_norm_rotary_unfused"]


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
        _raise_recompile_limits()
    fn = _compiled[key]
    cos, sin = case.hf_cos_sin()
    q, k = case.q, case.k
    return lambda: fn(q, k, cos, sin)


def _raise_recompile_limits() -> None:
    from torch import _dynamo

    # Every entry shares one code object, whose recompile limit would otherwise end a sweep.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(_dynamo.config, name):
            setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 1024))


def hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' ``Qwen3RMSNorm`` over the last dim: in float32, cast back, times the weight."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def qk_norm_rotary_unfused(
    q: Tensor, k: Tensor, qw: Tensor, kw: Tensor, cos: Tensor, sin: Tensor, il: bool, eps: float
) -> tuple[Tensor, Tensor]:
    """Pure torch: :func:`hf_rms_norm` of each head of ``q [T, Hq, D]``, ``k [T, Hkv, D]``, then the HF
    rotation (``cos``, ``sin`` ``[T, rotary_dim]`` gathered, in q's dtype); returns new ``(q', k')``."""
    return hf_apply_rotary_pos_emb(hf_rms_norm(q, qw, eps), hf_rms_norm(k, kw, eps), cos, sin, il)


def _qknorm_views(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    if case.mrope_section is not None:
        raise Skip("qknorm: one position per token (its reference takes no MRoPE)")
    qkv = case.packed_qkv().flatten(1)
    p = case.preset
    d = p.head_dim
    q = qkv[:, : p.q_heads * d].unflatten(-1, (p.q_heads, d))
    k = qkv[:, p.q_heads * d : (p.q_heads + p.kv_heads) * d].unflatten(-1, (p.kv_heads, d))
    return qkv, q, k


@provider("eager unfused", "qknorm", baseline=True)
def _qknorm_eager(case: Case) -> Runner:
    qkv, q, k = _qknorm_views(case)
    s = case.serving
    pos, cs, il = case.rope_positions, case.cos_sin, case.interleaved
    eps, qw, kw = s.eps, s.q_weight, s.k_weight
    rotate = rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, ...]:
        q.copy_(hf_rms_norm(q, qw, eps))
        k.copy_(hf_rms_norm(k, kw, eps))
        rotate(q, k, pos, cs, interleaved=il)
        return (qkv,)

    return run


@provider("torch.compile unfused", "qknorm")
def _qknorm_compile(case: Case) -> Runner:
    if case.device.type == "cpu" and not _have_cxx():
        raise Skip("torch.compile on CPU needs a C++ compiler")
    qkv, q, k = _qknorm_views(case)
    s, il = case.serving, case.interleaved
    key = ("qknorm", il, tuple(qkv.shape), tuple(q.shape), tuple(k.shape), case.rotary_dim, case.dtype)
    key += (case.device.type,)
    cos, sin = case.hf_cos_sin()
    args = (s.q_weight, s.k_weight, cos, sin, il, s.eps)
    if key not in _compiled:
        fn = torch.compile(qk_norm_rotary_unfused, dynamic=False, fullgraph=True)
        _raise_recompile_limits()
        fn(q, k, *args)  # compile and warm up here, not in the first timed call (q, k not written)
        _compiled[key] = fn
    fn = _compiled[key]

    def run() -> tuple[Tensor, ...]:
        qr, kr = fn(q, k, *args)
        q.copy_(qr)
        k.copy_(kr)
        return (qkv,)

    return run


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in ("c++", "g++", "clang++", os.environ.get("CXX", "c++")))


def _mla_unfused(fp8: bool, compiled: bool):
    def build(case: Case) -> Runner:
        if compiled and case.device.type == "cpu" and not _have_cxx():
            raise Skip("torch.compile on CPU needs a C++ compiler")
        q, kv_c, k_pe, cache = mla_tensors(case, fp8)
        m = case.mla
        q_pe = q[..., m.q_nope.shape[-1] :]
        cos, sin = case.hf_cos_sin()
        rows = (cache.view(torch.uint8) if fp8 else cache).view(-1, cache.shape[-1])
        args = (q_pe, k_pe, kv_c, cos, sin, case.interleaved, rows, m.slot_mapping)
        args += (m.kv_scale, cache.dtype) if fp8 else ()
        fn: Callable[..., Any] = mla_rotary_cache_unfused_
        if compiled:
            key = ("mla", *q.shape, *kv_c.shape, rows.shape[0], fp8, case.interleaved, case.dtype)
            key += (case.device.type,)
            if key not in _compiled:
                _compiled[key] = torch.compile(fn, dynamic=False, fullgraph=True)
                _raise_recompile_limits()
            fn = _compiled[key]
            fn(*args)  # compile and warm up here, not in the first timed call; then the inputs as they were
            for t, fresh in zip((q, kv_c, k_pe, cache), mla_tensors(case, fp8), strict=True):
                t.copy_(fresh)

        def run() -> tuple[Tensor, ...]:
            fn(*args)
            return q, k_pe, cache

        return run

    return build


for _mode in MLA_MODES:
    provider("eager unfused", _mode, baseline=True)(_mla_unfused(_mode == "mla-fp8", compiled=False))
    provider("torch.compile unfused", _mode)(_mla_unfused(_mode == "mla-fp8", compiled=True))
del _mode


def _rerotate_unfused(fp8: bool, compiled: bool):
    def build(case: Case) -> Runner:
        if compiled and case.device.type == "cpu" and not _have_cxx():
            raise Skip("torch.compile on CPU needs a C++ compiler")
        cache = rerotate_tensors(case, fp8)
        s = case.rerotate
        cos, sin = shift_cos_sin(case, torch.float32 if fp8 else case.dtype)
        rows = (cache.view(torch.uint8) if fp8 else cache).view(-1, *cache.shape[2:])
        args = (rows, s.slot_mapping, cos, sin, case.interleaved)
        args += (s.k_scale, cache.dtype) if fp8 else ()
        fn: Callable[..., Any] = rerotate_unfused_
        if compiled:
            key = ("rerotate", *rows.shape, case.tokens, fp8, case.rotary_dim, case.interleaved, case.dtype)
            key += (case.device.type,)
            if key not in _compiled:
                _compiled[key] = torch.compile(fn, dynamic=False, fullgraph=True)
                _raise_recompile_limits()
            fn = _compiled[key]
            fn(*args)  # compile and warm up here, not in the first timed call; then the cache as it was
            cache.copy_(rerotate_tensors(case, fp8))

        def run() -> tuple[Tensor, ...]:
            fn(*args)
            return (cache,)

        return run

    return build


for _mode in REROTATE_MODES:
    _fp8 = _mode == "rerotate-fp8"
    provider("eager unfused", _mode, baseline=True)(_rerotate_unfused(_fp8, compiled=False))
    provider("torch.compile unfused", _mode)(_rerotate_unfused(_fp8, compiled=True))
del _mode, _fp8

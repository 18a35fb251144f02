"""rope-bench: benchmark harness for rotary-embedding kernels (``python -m rope_ext.bench``).

For every workload (model preset or custom shape, token count, dtype, pairing) the harness:

1. builds ``q [T, Hq, D]``, ``k [T, Hkv, D]`` (token-major, contiguous), ``positions`` (``0..T-1`` for a
   prefill, random positions of a batch of sequences for a decode step) and a float32 cos/sin cache;
2. validates every provider against the float64 reference (:func:`rope_ext.reference.rotary_hadamard`)
   on the same inputs; a provider that disagrees is reported as ``wrong`` and is not timed;
3. times the providers and the bandwidth ceilings of this machine side by side: several rounds, each
   running every provider and every ceiling once in turn, so that noise from other processes hits them
   alike; the median over all rounds is reported with its spread (25th-75th percentiles).

Bytes counted per call (the minimum traffic of the op, the same for every provider): q and k read
once and written once, one cos/sin row (``rotary_dim`` values of the cache dtype) and one position
read per token. GB/s = bytes / median time.

Ceilings, measured in the same run on the same number of q and k bytes:

* ``stream in-place``: ``a.mul_(1.0)`` on one float32 buffer of q's plus k's bytes (the in-place
  streaming bandwidth; dtype-independent);
* ``clone``: ``q.clone()``, ``k.clone()`` (fresh outputs: the floor for any op that returns new tensors);
* ``copy into``: ``a.copy_(b)`` between float32 buffers of q's plus k's bytes (for reference);
* ``no-op call``: a registered op with the schema of ``rope_ext::rotary_qk_`` whose kernel does nothing,
  called through ``torch.ops`` from Python: the cost of a call, to judge small (decode) workloads;
* ``tiny kernel`` (GPU only): ``one.zero_()`` on a one-element tensor, the device time of an (almost)
  empty kernel launch; on a GPU the decode ratio ``x no-op`` is taken against it.

``% ceil`` is the ceiling's time divided by the provider's time (in place against the in-place stream,
out of place and backward against clone); cos/sin and positions are not credited to the provider there.

Timing: blocked timing as ``torch.utils.benchmark``'s ``blocked_autorange`` on the CPU; CUDA events on a
GPU, with the L2 cache flushed (a buffer twice its size is zeroed) before every timed call.
Warm-up calls first.

Adding a provider is one small function decorated with :func:`provider`; see the existing ones.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import rope_ext
from rope_ext import reference

__all__ = [
    "Case",
    "Preset",
    "Provider",
    "PRESETS",
    "PROVIDERS",
    "Skip",
    "main",
    "provider",
    "run_benchmark",
]

# ---------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Preset:
    """Attention shape of a model: heads, head and rotary dims, pairing and rope base."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    base: float = 10000.0


# shared/REFERENCES.md section 4 (head_dim, rotary_dim, pairing, base) with the models' head counts.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("llama-2-7b", 32, 32, 128, 128, False, 1e4),
        Preset("codellama-7b", 32, 32, 128, 128, False, 1e6),
        Preset("llama-3-8b", 32, 8, 128, 128, False, 5e5),
        Preset("llama-3.1-8b", 32, 8, 128, 128, False, 5e5),
        Preset("llama-3-70b", 64, 8, 128, 128, False, 5e5),
        Preset("llama-3.2-1b", 32, 8, 64, 64, False, 5e5),
        Preset("mistral-7b", 32, 8, 128, 128, False, 1e4),
        Preset("qwen2-7b", 28, 4, 128, 128, False, 1e6),
        Preset("qwen2.5-7b", 28, 4, 128, 128, False, 1e6),
        Preset("gpt-neox-20b", 64, 64, 96, 24, False, 1e4),
        Preset("pythia-6.9b", 32, 32, 128, 32, False, 1e4),
        Preset("gpt-j-6b", 16, 16, 256, 64, True, 1e4),
        Preset("phi-2", 32, 32, 80, 32, False, 1e4),
        Preset("phi-3-mini", 32, 32, 96, 96, False, 1e4),
        Preset("deepseek-v3-rope", 128, 1, 64, 64, True, 1e4),
        Preset("gpt-oss-20b", 64, 8, 64, 64, False, 1.5e5),
        Preset("gemma-2-9b", 16, 8, 256, 256, False, 1e4),
        Preset("stablelm-3b", 32, 32, 80, 20, False, 1e4),
    ]
}

PREFILL_TOKENS = [128, 256, 512, 1024, 2048, 4096]
DECODE_TOKENS = [1, 4, 16, 64, 256]
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
MODES = ("inplace", "out", "backward")
# Decode positions are drawn from [0, DECODE_CONTEXT): each token is the next one of its own sequence.
DECODE_CONTEXT = 8192


@dataclass
class Case:
    """One workload with its inputs and float64 expected results (built once, shared by providers)."""

    preset: Preset
    tokens: int
    phase: str  # "prefill" | "decode"
    dtype: torch.dtype
    interleaved: bool
    device: torch.device
    q: Tensor
    k: Tensor
    positions: Tensor  # int64 [T]
    cos_sin: Tensor  # float32 [P, rotary_dim]
    grad_q: Tensor
    grad_k: Tensor
    _expected: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def rotary_dim(self) -> int:
        return self.cos_sin.shape[-1]

    @property
    def pairing(self) -> str:
        return "interleaved" if self.interleaved else "half-split"

    def expected(self, mode: str) -> tuple[Tensor, Tensor]:
        """Float64 reference: the rotation of (q, k), or for backward the inverse rotation of the grads."""
        key = "backward" if mode == "backward" else "forward"
        if key not in self._expected:
            pos = self.positions[:, None]
            inverse = key == "backward"
            a, b = (self.grad_q, self.grad_k) if inverse else (self.q, self.k)
            self._expected[key] = tuple(  # type: ignore[assignment]
                reference.rotary_hadamard(
                    t.cpu(), pos.cpu(), self.cos_sin.cpu(), interleaved=self.interleaved, inverse=inverse
                )
                for t in (a, b)
            )
        return self._expected[key]

    def copy_inputs(self) -> Case:
        """The same workload on fresh copies of q, k and the grads (positions, cos/sin, expected shared)."""
        return dataclasses.replace(
            self,
            q=self.q.clone(),
            k=self.k.clone(),
            grad_q=self.grad_q.clone(),
            grad_k=self.grad_k.clone(),
        )

    def bytes_moved(self) -> int:
        """q and k read and written once, one cos/sin row and one position read per token."""
        qk = self.q.numel() * self.q.element_size() + self.k.numel() * self.k.element_size()
        return 2 * qk + self.tokens * (self.rotary_dim * self.cos_sin.element_size() + 8)

    def qk_bytes(self) -> tuple[int, int]:
        return self.q.numel() * self.q.element_size(), self.k.numel() * self.k.element_size()

    def hf_cos_sin(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """HF-style ``cos``, ``sin`` ``[T, rotary_dim]`` gathered per token, in ``dtype`` (default x's)."""
        h = self.rotary_dim // 2
        rows = self.cos_sin[self.positions]
        c, s = rows[:, :h], rows[:, h:]
        if self.interleaved:
            c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        else:
            c, s = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
        dt = dtype or self.dtype
        return c.to(dt).contiguous(), s.to(dt).contiguous()


def make_case(
    preset: Preset,
    tokens: int,
    phase: str,
    dtype: torch.dtype,
    interleaved: bool,
    device: torch.device,
    seed: int = 0,
) -> Case:
    """Random q, k, grads (standard normal) and positions for one workload."""
    g = torch.Generator().manual_seed(seed)
    if phase == "decode":
        positions = torch.randint(0, DECODE_CONTEXT, (tokens,), generator=g, dtype=torch.int64)
        n_pos = DECODE_CONTEXT
    else:
        positions = torch.arange(tokens, dtype=torch.int64)
        n_pos = max(tokens, 1)
    cos_sin = rope_ext.RopeCache(preset.rotary_dim, preset.base, max_positions=n_pos).cos_sin

    def rnd(h: int) -> Tensor:
        return torch.randn(tokens, h, preset.head_dim, generator=g).to(dtype)

    return Case(
        preset=preset,
        tokens=tokens,
        phase=phase,
        dtype=dtype,
        interleaved=interleaved,
        device=device,
        q=rnd(preset.q_heads).to(device),
        k=rnd(preset.kv_heads).to(device),
        positions=positions.to(device),
        cos_sin=cos_sin.to(device),
        grad_q=rnd(preset.q_heads).to(device),
        grad_k=rnd(preset.kv_heads).to(device),
    )


# ---------------------------------------------------------------------------------------------
# Providers


class Skip(Exception):
    """Raised by a provider's builder when it cannot run: not installed, or not for this workload."""


Runner = Callable[[], tuple[Tensor, Tensor]]
Builder = Callable[[Case], Runner]


@dataclass
class Provider:
    """A named implementation of one mode.

    ``build(case)`` prepares its own copies of the inputs and returns a zero-argument callable, the
    thing that is timed; calling it returns the rotated ``(q, k)`` (for ``backward``: the gradients).
    It raises :class:`Skip` when the provider is not available.
    """

    name: str
    mode: str  # "inplace" | "out" | "backward"
    build: Builder
    baseline: bool = False  # the eager reference: speedups are relative to it


PROVIDERS: list[Provider] = []


def provider(name: str, mode: str, *, baseline: bool = False) -> Callable[[Builder], Builder]:
    """Registers ``build(case) -> runner`` as provider ``name`` for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def register(build: Builder) -> Builder:
        PROVIDERS.append(Provider(name, mode, build, baseline))
        return build

    return register


def _clones(case: Case) -> tuple[Tensor, Tensor]:
    return case.q.clone(), case.k.clone()


# rope_ext ------------------------------------------------------------------------------------


@provider("rope_ext", "inplace")
def _rope_ext_inplace(case: Case) -> Runner:
    q, k = _clones(case)
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


# HF-style reference ---------------------------------------------------------------------------


def hf_rotate_half(x: Tensor) -> Tensor:
    """transformers' ``rotate_half``: ``(x1, x2) -> (-x2, x1)`` on the two halves."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rotate_every_two(x: Tensor) -> Tensor:
    """transformers' GPT-J ``rotate_every_two``: ``(x0, x1, ..) -> (-x1, x0, ..)``."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def hf_apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on ``[T, H, D]`` with ``cos``/``sin`` ``[T, rotary_dim]``.

    Arithmetic in the input dtype (HF casts cos/sin to it); partial rotary splits off the pass-through
    features and concatenates them back, as HF's partial-rotary models do.
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rot = hf_rotate_every_two if interleaved else hf_rotate_half
    r = cos.shape[-1]

    def one(x: Tensor) -> Tensor:
        if r == x.shape[-1]:
            return (x * cos) + (rot(x) * sin)
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat(((x_rot * cos) + (rot(x_rot) * sin), x_pass), dim=-1)

    return one(q), one(k)


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
    import shutil

    return any(shutil.which(c) for c in ("c++", "g++", "clang++", os.environ.get("CXX", "c++")))


# Peers (skipped with a note when not importable) -----------------------------------------------


def _flat(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1)


@provider("vllm", "inplace")
def _vllm(case: Case) -> Runner:
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception as e:  # ImportError, or a broken install
        raise Skip(f"vllm not importable ({type(e).__name__})") from None
    q, k = _clones(case)
    cache = case.cos_sin.to(case.dtype)  # vLLM matches the cache to the query dtype
    pos, d, neox = case.positions, case.preset.head_dim, not case.interleaved
    qf, kf = _flat(q), _flat(k)

    def run() -> tuple[Tensor, Tensor]:
        vllm_ops.rotary_embedding(pos, qf, kf, d, cache, neox)
        return q, k

    return run


@provider("flashinfer", "inplace")
def _flashinfer_inplace(case: Case) -> Runner:
    try:
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace
    except Exception as e:
        raise Skip(f"flashinfer not importable ({type(e).__name__})") from None
    q, k = _clones(case)
    pos, cs, d, neox = case.positions, case.cos_sin, case.preset.head_dim, not case.interleaved
    qf, kf = _flat(q), _flat(k)

    def run() -> tuple[Tensor, Tensor]:
        apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, d, cs, is_neox=neox)
        return q, k

    return run


@provider("flashinfer", "out")
def _flashinfer_out(case: Case) -> Runner:
    try:
        from flashinfer.rope import apply_rope_with_cos_sin_cache
    except Exception as e:
        raise Skip(f"flashinfer not importable ({type(e).__name__})") from None
    pos, cs, d, neox = case.positions, case.cos_sin, case.preset.head_dim, not case.interleaved
    qf, kf = _flat(case.q), _flat(case.k)
    shapes = case.q.shape, case.k.shape

    def run() -> tuple[Tensor, Tensor]:
        qo, ko = apply_rope_with_cos_sin_cache(pos, qf, kf, d, cs, is_neox=neox)
        return qo.view(shapes[0]), ko.view(shapes[1])

    return run


def _flash_attn_cos_sin(case: Case) -> tuple[Tensor, Tensor]:
    h = case.rotary_dim // 2
    rows = case.cos_sin[case.positions]  # [T, rotary_dim]: per-token rows give arbitrary positions
    return rows[:, :h].contiguous(), rows[:, h:].contiguous()


def _flash_attn_fn(case: Case) -> Callable[..., Tensor]:
    try:
        from flash_attn.layers.rotary import apply_rotary_emb
    except Exception as e:
        raise Skip(f"flash-attn not importable ({type(e).__name__})") from None
    if case.device.type != "cuda":
        raise Skip("flash-attn rotary runs on CUDA only")
    return apply_rotary_emb


@provider("flash-attn", "inplace")
def _flash_attn_inplace(case: Case) -> Runner:
    fn = _flash_attn_fn(case)
    cos, sin = _flash_attn_cos_sin(case)
    q, k = _clones(case)
    il = case.interleaved

    def run() -> tuple[Tensor, Tensor]:
        fn(q[None], cos, sin, interleaved=il, inplace=True)
        fn(k[None], cos, sin, interleaved=il, inplace=True)
        return q, k

    return run


@provider("flash-attn", "out")
def _flash_attn_out(case: Case) -> Runner:
    fn = _flash_attn_fn(case)
    cos, sin = _flash_attn_cos_sin(case)
    q, k, il = case.q, case.k, case.interleaved
    return lambda: (fn(q[None], cos, sin, interleaved=il)[0], fn(k[None], cos, sin, interleaved=il)[0])


@provider("liger", "inplace")
def _liger(case: Case) -> Runner:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as e:
        raise Skip(f"liger-kernel not importable ({type(e).__name__})") from None
    if case.device.type != "cuda":
        raise Skip("liger rope runs on CUDA only")
    if case.interleaved or case.rotary_dim != case.preset.head_dim:
        raise Skip("liger rope: half-split pairing and full rotary only")
    cos, sin = case.hf_cos_sin()
    cos, sin = cos[None], sin[None]  # [1, T, D]
    q, k = _clones(case)
    qv, kv = q[None].transpose(1, 2), k[None].transpose(1, 2)  # BHSD views of the token-major tensors

    def run() -> tuple[Tensor, Tensor]:
        qo, ko = LigerRopeFunction.apply(qv, kv, cos, sin)
        return qo.transpose(1, 2)[0], ko.transpose(1, 2)[0]

    return run


# ---------------------------------------------------------------------------------------------
# Ceilings: what this machine does with the same bytes, measured in the same run.


_noop_lib: torch.library.Library | None = None


def noop_op() -> Callable[..., None]:
    """A registered op with the schema of ``rope_ext::rotary_qk_`` whose kernel does nothing.

    Defined with ``torch.library`` (a Python kernel registered for every backend), called as
    ``torch.ops.rope_bench.noop_qk_.default(...)``: the dispatcher, the schema's argument parsing and the
    return to Python are paid exactly as for the real op; only the kernel body is empty (its Python
    body costs a little more than a C++ one would, so the floor is generous by ~1 us).
    """
    global _noop_lib
    if _noop_lib is None:
        _noop_lib = torch.library.Library("rope_bench", "DEF")
        _noop_lib.define(
            "noop_qk_(Tensor(a!) q, Tensor(b!)? k, Tensor positions, Tensor cos_sin, "
            "bool interleaved=False, bool inverse=False) -> ()"
        )
        _noop_lib.impl("noop_qk_", lambda *args: None, "CompositeExplicitAutograd")
    return torch.ops.rope_bench.noop_qk_.default


def ceilings(case: Case) -> dict[str, Callable[[], Any]]:
    """Reference operations over the bytes of q and k (see the module docstring).

    The streaming ceilings use one float32 buffer of q's plus k's bytes (one parallel region per call,
    as the rotary op itself), so they measure the machine, not torch's kernels for a dtype.
    """
    nq, nk = case.qk_bytes()
    dev = case.device
    a = torch.ones(max((nq + nk) // 4, 1), device=dev)
    src = torch.ones_like(a)
    q, k = case.q, case.k
    noop = noop_op()
    qn, kn = _clones(case)
    pos, cs = case.positions[:, None], case.cos_sin
    out = {
        "stream in-place": lambda: a.mul_(1.0),
        "clone": lambda: (q.clone(), k.clone()),
        "copy into": lambda: a.copy_(src),
        "no-op call": lambda: noop(qn, kn, pos, cs, False, False),
    }
    if dev.type == "cuda":
        # The device time of launching a kernel that does (almost) nothing: the floor for decode steps.
        one = torch.zeros(1, device=dev)
        out["tiny kernel"] = lambda: one.zero_()
    return out


CEILING_FOR_MODE = {"inplace": "stream in-place", "out": "clone", "backward": "clone"}


# ---------------------------------------------------------------------------------------------
# Validation and timing


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


class Timer:
    """Runs callables in rounds and collects per-call times (seconds)."""

    BLOCK_S = 2e-3

    def __init__(self, device: torch.device, min_run_time: float, warmup: int = 2) -> None:
        self.device = device
        self.min_run_time = min_run_time
        self.warmup = warmup
        self._flush: Tensor | None = None
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            l2 = int(getattr(props, "L2_cache_size", 0) or 64 << 20)
            self._flush = torch.empty(2 * l2 // 4, dtype=torch.float32, device=device)

    def warm(self, fn: Callable[[], Any]) -> None:
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, fn: Callable[[], Any]) -> list[float]:
        """One round: per-call times of ``fn`` (CPU: block means; CUDA: one event pair per call)."""
        if self.device.type == "cuda":
            return self._measure_cuda(fn)
        return self._measure_cpu(fn)

    def _measure_cpu(self, fn: Callable[[], Any]) -> list[float]:
        # Blocked timing as torch.utils.benchmark's blocked_autorange: calls are grouped in blocks of at
        # least BLOCK_S seconds (so the clock's resolution and loop overhead vanish for tiny calls), and
        # blocks repeat until min_run_time has passed (at least 3). Each block gives one per-call mean.
        # (benchmark.Timer itself is not used: it sets the thread count around every block, which
        # changes torch.compile's global-state guard and recompiles the compiled reference.)
        clock = time.perf_counter
        t0 = clock()
        fn()
        one = max(clock() - t0, 1e-7)
        number = max(1, int(self.BLOCK_S / one))
        times: list[float] = []
        start = clock()
        while len(times) < 3 or clock() - start < self.min_run_time:
            t0 = clock()
            for _ in range(number):
                fn()
            times.append((clock() - t0) / number)
        return times

    def _measure_cuda(self, fn: Callable[[], Any]) -> list[float]:
        assert self._flush is not None
        # Size the round from one flushed call.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(self.device)
        one = max(start.elapsed_time(end) * 1e-3, 1e-6)
        n = int(min(max(self.min_run_time / (one + 20e-6), 5), 200))
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)
        ]
        for s, e in events:
            self._flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e-3 for s, e in events]


def _stats(times: Sequence[float]) -> dict[str, float]:
    ts = sorted(times)
    if not ts:
        return {}
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    return {"median_s": statistics.median(ts), "p25_s": q[0], "p75_s": q[2], "min_s": ts[0], "n": len(ts)}


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Config:
    """What to run; see ``rope-bench --help`` for the meaning of each field."""

    presets: list[Preset]
    prefill_tokens: list[int]
    decode_tokens: list[int]
    dtypes: list[torch.dtype]
    pairings: list[str]  # "model" | "half" | "interleaved"
    modes: list[str]
    providers: list[str] | None = None  # None: all
    device: str = "cpu"
    rounds: int = 10
    min_run_time: float = 0.1
    tol_ulps: float = 8.0
    allocator: str = "fresh"  # CPU: see set_cpu_allocator
    cache: str = "cold"  # CPU: see input_sets
    progress: bool = True


def _dtype_name(dt: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dt]


def _workloads(cfg: Config) -> list[tuple[Preset, int, str, torch.dtype, bool]]:
    out = []
    for preset in cfg.presets:
        pairs: list[bool] = []
        for p in cfg.pairings:
            il = preset.interleaved if p == "model" else p == "interleaved"
            if il not in pairs:
                pairs.append(il)
        for dt in cfg.dtypes:
            for il in pairs:
                for phase, toks in (("decode", cfg.decode_tokens), ("prefill", cfg.prefill_tokens)):
                    for t in toks:
                        out.append((preset, t, phase, dt, il))
    return out


def set_cpu_allocator(mode: str) -> str:
    """Makes the page faults of fresh CPU outputs deterministic (glibc ``mallopt``); returns what was done.

    glibc maps large blocks with ``mmap`` and moves its threshold with the history of frees, so whether a
    new output tensor page-faults (costly: the kernel zeroes every page) depends on what ran before it.
    ``fresh``: blocks over 1 MiB are always mapped and unmapped, so every output of every call is
    faulted in (what a process sees for large new tensors). ``reuse``: nothing is ever unmapped, outputs
    reuse freed memory (as a caching allocator would). ``default``: glibc unchanged.
    """
    if mode == "default" or not sys.platform.startswith("linux"):
        return "default"
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim, m_mmap_threshold, m_mmap_max = -1, -3, -4
        if mode == "fresh":
            ok = libc.mallopt(m_mmap_threshold, 1 << 20) and libc.mallopt(m_trim, 1 << 20)
        elif mode == "reuse":
            ok = libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim, 1 << 40)
        else:
            raise ValueError(f"allocator mode must be fresh, reuse or default, got {mode!r}")
    except OSError:
        return "default (no glibc)"
    return mode if ok else "default (mallopt failed)"


def last_level_cache_bytes() -> int:
    """Size of the CPU's last-level cache (Linux sysfs), 32 MiB when unknown."""
    best = 0
    with contextlib.suppress(OSError, ValueError):
        base = "/sys/devices/system/cpu/cpu0/cache"
        for idx in os.listdir(base):
            with open(f"{base}/{idx}/size") as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def input_sets(case: Case, cache: str) -> int:
    """How many copies of the inputs a timed run cycles through.

    ``cold`` on the CPU: a workload of 1 MiB or more (q and k read and written) cycles through enough
    copies to span three times the last-level cache, so that no call finds its data in the cache left
    by the previous calls (the CPU counterpart of flushing the GPU's L2); every provider and every
    ceiling gets the same treatment. Smaller workloads (decode steps) keep one set: their cost is the
    call, and in a model their q and k are still in cache from the projection that made them.
    ``warm``, and on a GPU (which flushes its L2 instead): one set.
    """
    if cache != "cold" or case.device.type != "cpu":
        return 1
    ws = case.bytes_moved()
    if ws < 1 << 20:
        return 1
    return int(min(64, math.ceil(3 * last_level_cache_bytes() / ws)))


def _cycle(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """A callable that calls ``fns`` in turn, one per call."""
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "rope_ext": rope_ext.__version__,
        "rope_ext_cpu_isa": str(torch.ops.rope_ext._cpu_isa()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
    }
    with contextlib.suppress(OSError):
        info["loadavg"] = list(os.getloadavg())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def run_benchmark(
    cfg: Config, extra_providers: Iterable[Provider] = (), log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Runs every workload of ``cfg``; returns ``{"machine", "config", "rows", "notes"}``.

    Each row is one (workload, provider) or (workload, ceiling): status ``ok`` (timed), ``wrong``
    (disagrees with the float64 reference; not timed) or ``error`` (raised; not timed).
    """
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    provs = [p for p in [*PROVIDERS, *extra_providers] if p.mode in cfg.modes]
    if cfg.providers is not None:
        provs = [p for p in provs if p.name in cfg.providers]
    timer = Timer(device, cfg.min_run_time)
    notes: dict[str, None] = {}
    rows: list[dict[str, Any]] = []
    machine = machine_info(device)
    if device.type == "cpu":
        machine["cpu_allocator"] = set_cpu_allocator(cfg.allocator)
    workloads = _workloads(cfg)
    bar = None
    if cfg.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(workloads), desc="rope-bench", unit="workload", leave=False, file=sys.stderr)
        except ImportError:
            bar = None

    for preset, tokens, phase, dtype, il in workloads:
        if bar is not None:
            bar.set_postfix_str(f"{preset.name} {_dtype_name(dtype)} {'il' if il else 'half'} T={tokens}")
        case = make_case(preset, tokens, phase, dtype, il, device)
        base = {
            "preset": preset.name,
            "q_heads": preset.q_heads,
            "kv_heads": preset.kv_heads,
            "head_dim": preset.head_dim,
            "rotary_dim": preset.rotary_dim,
            "pairing": case.pairing,
            "dtype": _dtype_name(dtype),
            "phase": phase,
            "tokens": tokens,
            "bytes": case.bytes_moved(),
        }
        n_sets = input_sets(case, cfg.cache)
        cases = [case] + [case.copy_inputs() for _ in range(n_sets - 1)]
        base["input_sets"] = n_sets
        # Validate (on the first input set) and build every provider.
        runners: dict[str, Callable[[], Any]] = {}
        wl_rows: dict[str, dict[str, Any]] = {}
        for p in provs:
            key = f"{p.name}|{p.mode}"
            row = {**base, "provider": p.name, "mode": p.mode, "kind": "provider", "baseline": p.baseline}
            try:
                fn = p.build(case)
                ok, err = validate(case, p.mode, fn(), cfg.tol_ulps)
                if ok and n_sets > 1:
                    fn = _cycle([fn] + [p.build(c) for c in cases[1:]])
            except Skip as e:
                notes[f"skipped {p.name} ({p.mode}): {e}"] = None
                continue
            except Exception as e:  # a provider that raises is reported, not fatal
                row.update(status="error", detail=f"{type(e).__name__}: {e}".splitlines()[0][:200])
                rows.append(row)
                continue
            row.update(status="ok" if ok else "wrong", err_ulps=err)
            wl_rows[key] = row
            rows.append(row)
            if ok:
                runners[key] = fn
        ceils = [ceilings(c) for c in cases]
        for name in ceils[0]:
            if name in ("no-op call", "tiny kernel") and tokens > 256:
                continue
            fn = _cycle([c[name] for c in ceils])
            key = f"{name}|ceiling"
            row = {**base, "provider": name, "mode": "ceiling", "kind": "ceiling", "status": "ok"}
            wl_rows[key] = row
            rows.append(row)
            runners[key] = fn
        # Time in rounds: every runner once per round, in turn.
        for fn in runners.values():
            timer.warm(fn)
        times: dict[str, list[float]] = {key: [] for key in runners}
        for _ in range(cfg.rounds):
            for key, fn in runners.items():
                times[key] += timer.measure(fn)
        for key, ts in times.items():
            wl_rows[key].update(_stats(ts))
        _derive(wl_rows)
        del case, cases, runners, ceils
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    cfg_dict = dataclasses.asdict(cfg)
    cfg_dict["presets"] = [p.name for p in cfg.presets]
    cfg_dict["dtypes"] = [_dtype_name(d) for d in cfg.dtypes]
    return {"machine": machine, "config": cfg_dict, "rows": rows, "notes": list(notes)}


def _derive(wl: dict[str, dict[str, Any]]) -> None:
    """GB/s, fraction of the mode's ceiling, speedup vs eager and call-overhead ratio, in place."""
    eager = {r["mode"]: r for r in wl.values() if r.get("baseline") and "median_s" in r}
    # On a GPU the decode floor is the device time of a tiny kernel; on a CPU, the cost of a call.
    noop = wl.get("tiny kernel|ceiling") or wl.get("no-op call|ceiling")
    for r in wl.values():
        t = r.get("median_s")
        if not t:
            continue
        r["gbps"] = r["bytes"] / t / 1e9
        if r["kind"] == "ceiling":
            nbytes = r["bytes"] - r["tokens"] * (r["rotary_dim"] * 4 + 8)  # q and k only
            r["gbps"] = nbytes / t / 1e9
            continue
        ceil = wl.get(f"{CEILING_FOR_MODE[r['mode']]}|ceiling")
        if ceil and ceil.get("median_s"):
            r["ceiling"] = ceil["provider"]
            r["frac_ceiling"] = ceil["median_s"] / t
            r["frac_ceiling_min"] = ceil["min_s"] / r["min_s"]  # best runs of each: least disturbed
        ref = eager.get("backward" if r["mode"] == "backward" else "out")
        if ref:
            r["speedup_vs_eager"] = ref["median_s"] / t
        if noop and noop.get("median_s"):
            r["x_noop_call"] = t / noop["median_s"]
        fwd = wl.get(f"{r['provider']}|out")
        if r["mode"] == "backward" and fwd and fwd.get("median_s"):
            r["x_forward"] = t / fwd["median_s"]


# ---------------------------------------------------------------------------------------------
# Output


def _fmt_time(s: float | None) -> str:
    if s is None:
        return ""
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.2f} ms"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


TABLE_COLUMNS = [
    "workload",
    "mode",
    "provider",
    "status",
    "median",
    "spread (p25-p75)",
    "bytes",
    "GB/s",
    "% ceil",
    "vs eager",
    "x no-op",
]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """The rows of the printed table, as strings."""
    out = []
    for r in result["rows"]:
        wl = (
            f"{r['preset']} {r['dtype']} {'il' if r['pairing'] == 'interleaved' else 'half'} "
            f"{r['phase']} T={r['tokens']}"
        )
        status = r["status"]
        if status == "wrong":
            status = f"WRONG ({r['err_ulps']:.3g} ulp)"
        elif status == "error":
            status = f"ERROR {r.get('detail', '').split(':')[0][:28]}"
        t = r.get("median_s")
        spread = f"{_fmt_time(r.get('p25_s'))} - {_fmt_time(r.get('p75_s'))}" if t else ""
        out.append(
            [
                wl,
                r["mode"],
                r["provider"],
                status,
                _fmt_time(t),
                spread,
                _fmt_bytes(r["bytes"]),
                f"{r['gbps']:.1f}" if "gbps" in r else "",
                f"{100 * r['frac_ceiling']:.0f}%" if "frac_ceiling" in r else "",
                f"{r['speedup_vs_eager']:.1f}x" if "speedup_vs_eager" in r else "",
                f"{r['x_noop_call']:.2f}" if "x_noop_call" in r else "",
            ]
        )
    return out


def print_table(result: dict[str, Any], file: Any = None) -> None:
    """Prints the results table (rich when installed, plain text otherwise), then the notes."""
    file = file or sys.stdout
    rows = table_rows(result)
    m = result["machine"]
    head = (
        f"rope-bench on {m['cpu']} ({m['torch_threads']} threads, ISA {m['rope_ext_cpu_isa']}"
        + (f", GPU {m['gpu']}" if "gpu" in m else "")
        + (f", allocator {m['cpu_allocator']}" if "cpu_allocator" in m else "")
        + f"), torch {m['torch']}, load {', '.join(f'{x:.2f}' for x in m.get('loadavg', []))}"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [
            max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(TABLE_COLUMNS)
        ]
        print(head, file=file)
        print("  ".join(c.ljust(w) for c, w in zip(TABLE_COLUMNS, widths, strict=True)), file=file)
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)), file=file)
    else:
        console = Console(file=file, width=max(170, Console(file=file).width))
        table = Table(title=head, title_justify="left", show_lines=False)
        for c in TABLE_COLUMNS:
            table.add_column(
                c, justify="right" if c not in ("workload", "mode", "provider", "status") else "left"
            )
        prev = None
        for r in rows:
            if prev is not None and r[0] != prev:
                table.add_section()
            prev = r[0]
            style = "red" if r[3].startswith(("WRONG", "ERROR")) else ("dim" if r[1] == "ceiling" else None)
            table.add_row(*r, style=style)
        console.print(table)
    print(
        "bytes: q and k read + written once, cos/sin row + position read once per token; "
        "% ceil: ceiling time / provider time on the same q, k bytes (in place vs 'stream in-place', "
        "out/backward vs 'clone'); vs eager: hf-eager time / time; x no-op: time / registered no-op call.",
        file=file,
    )
    for line in summary(result):
        print(line, file=file)
    for n in result["notes"]:
        print(f"note: {n}", file=file)


def summary(result: dict[str, Any], name: str = "rope_ext") -> list[str]:
    """One line per workload: how provider ``name`` stands against the ceilings and the references."""
    lines = []
    by_wl: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in result["rows"]:
        key = (r["preset"], r["dtype"], r["pairing"], r["phase"], r["tokens"])
        by_wl.setdefault(key, {})[f"{r['provider']}|{r['mode']}"] = r
    for (preset, dt, pairing, phase, tokens), rows in by_wl.items():
        parts = []
        ip, out, bwd = rows.get(f"{name}|inplace"), rows.get(f"{name}|out"), rows.get(f"{name}|backward")
        if ip and "frac_ceiling" in ip:
            parts.append(
                f"in place {100 * ip['frac_ceiling']:.0f}% of stream (best runs "
                f"{100 * ip['frac_ceiling_min']:.0f}%)"
            )
        if out and "frac_ceiling" in out:
            parts.append(
                f"out of place {100 * out['frac_ceiling']:.0f}% of clone (best runs "
                f"{100 * out['frac_ceiling_min']:.0f}%)"
            )
            for ref in ("hf-compile", "hf-eager"):
                rr = rows.get(f"{ref}|out")
                if rr and rr.get("median_s"):
                    parts.append(f"{rr['median_s'] / out['median_s']:.1f}x {ref}")
        if bwd and "x_forward" in bwd:
            parts.append(f"backward {bwd['x_forward']:.2f}x forward")
        for r in (ip, out):
            if r and "x_noop_call" in r and phase == "decode":
                parts.append(f"{r['mode']} call {r['x_noop_call']:.2f}x no-op")
        if parts:
            lines.append(f"{name} {preset} {dt} {pairing} {phase} T={tokens}: " + ", ".join(parts))
    return lines


CSV_FIELDS = [
    "preset",
    "q_heads",
    "kv_heads",
    "head_dim",
    "rotary_dim",
    "pairing",
    "dtype",
    "phase",
    "tokens",
    "mode",
    "provider",
    "kind",
    "status",
    "err_ulps",
    "median_s",
    "p25_s",
    "p75_s",
    "min_s",
    "n",
    "bytes",
    "gbps",
    "ceiling",
    "frac_ceiling",
    "frac_ceiling_min",
    "speedup_vs_eager",
    "x_noop_call",
    "x_forward",
    "input_sets",
    "detail",
]


def write_csv(result: dict[str, Any], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow(r)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


CEILING_STYLE = {"stream in-place": ("--", "black"), "clone": ("--", "gray"), "copy into": (":", "black")}


def plot(result: dict[str, Any], path: str) -> None:
    """GB/s against tokens, one line per provider and mode, dashed lines for the ceilings.

    One panel per (preset, dtype, pairing).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        if "gbps" in r:
            groups.setdefault((r["preset"], r["dtype"], r["pairing"]), []).append(r)
    n = max(len(groups), 1)
    cols = min(n, 2)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, ((preset, dt, pairing), rs) in zip(axes.flat, sorted(groups.items()), strict=False):
        lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rs:
            if r["provider"] == "no-op call":
                continue
            lines.setdefault((r["provider"], r["mode"]), []).append((r["tokens"], r["gbps"]))
        for (name, mode), pts in sorted(lines.items(), key=lambda kv: (kv[0][1] == "ceiling", kv[0])):
            pts.sort()
            xs, ys = zip(*pts, strict=True)
            if mode == "ceiling":
                style = CEILING_STYLE.get(name, ("--", "gray"))
                ax.plot(xs, ys, style[0], color=style[1], lw=1.1, label=f"ceiling: {name}")
            else:
                ax.plot(xs, ys, "o-", ms=3, lw=1.3, label=f"{name} ({mode})")
        cold = [r["tokens"] for r in rs if r.get("input_sets", 1) > 1]
        if cold:
            ax.axvline(min(cold), color="0.6", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{preset} {dt} {pairing}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    m = result["machine"]
    fig.suptitle(
        f"rope-bench: {m.get('gpu', m['cpu'])}, {m['torch_threads']} threads "
        "(dotted: from here on, inputs rotated so calls run from memory, not cache)",
        fontsize=9,
    )
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if nrows == 1 else 0.05, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()] if s.strip() else []


def _custom_preset(spec: str, base: float) -> Preset:
    """``Q,KV,D[,R]``: q heads, kv heads, head_dim, rotary_dim (default head_dim)."""
    v = _ints(spec)
    if len(v) not in (3, 4):
        raise argparse.ArgumentTypeError(f"--shape wants Q,KV,D[,R], got {spec!r}")
    r = v[3] if len(v) == 4 else v[2]
    return Preset(
        f"custom-{v[0]}x{v[1]}x{v[2]}" + (f"r{r}" if r != v[2] else ""), v[0], v[1], v[2], r, False, base
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="rope-bench",
        description="Validate and time rotary-embedding kernels against each other and this machine's "
        "memory bandwidth.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        default=None,
        help="comma-separated model presets, or 'all' (see --list); default: llama-3-8b, none with --shape",
    )
    ap.add_argument("--shape", action="append", default=[], help="custom shape Q,KV,D[,R] (repeatable)")
    ap.add_argument("--base", type=float, default=1e4, help="rope base for --shape")
    ap.add_argument(
        "--tokens", default=",".join(map(str, PREFILL_TOKENS)), help="prefill token counts (empty: none)"
    )
    ap.add_argument(
        "--decode-tokens", default=",".join(map(str, DECODE_TOKENS)), help="decode token counts (empty: none)"
    )
    ap.add_argument("--dtype", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    ap.add_argument(
        "--pairing", default="model", help="model (the preset's), half, interleaved, both; comma-separated"
    )
    ap.add_argument("--mode", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--providers", default=None, help="comma-separated provider names (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    ap.add_argument("--rounds", type=int, default=10, help="timing rounds (each runs every provider in turn)")
    ap.add_argument("--min-run-time", type=float, default=0.1, help="seconds per provider per round")
    ap.add_argument(
        "--allocator",
        default="fresh",
        choices=["fresh", "reuse", "default"],
        help="CPU: fresh = new outputs always page-fault (large blocks mmapped per call), reuse = freed "
        "memory reused (no faults), default = glibc as is (depends on history)",
    )
    ap.add_argument(
        "--cache",
        default="cold",
        choices=["cold", "warm"],
        help="CPU: cold = workloads of 1 MiB or more cycle through copies of their inputs spanning 3x the "
        "last-level cache, so repeated calls do not run from cache; warm = one input set",
    )
    ap.add_argument("--tol-ulps", type=float, default=8.0, help="validation tolerance (eps * max|x| units)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small run for CI (make bench): llama-3-8b fp32, decode 1 and prefill 2048 tokens, in place "
        "and out of place, 3 rounds",
    )
    ap.add_argument("--json", default=None, help="write results as JSON")
    ap.add_argument("--csv", default=None, help="write results as CSV")
    ap.add_argument("--plot", default=None, help="write GB/s-vs-tokens plot (PNG)")
    ap.add_argument(
        "--omp-wait",
        default="passive",
        choices=["passive", "active", "inherit"],
        help="OMP_WAIT_POLICY for the run (the command re-executes itself to set it): passive keeps idle "
        "OpenMP workers asleep, so that on a shared machine a parallel region does not wait a scheduler "
        "tick for a worker that lost its core while spinning; inherit leaves the environment as is",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--list", action="store_true", help="list presets and providers, then exit")
    return ap.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> Config:
    if a.quick:
        a.preset, a.tokens, a.decode_tokens = "llama-3-8b", "2048", "1"
        a.dtype, a.pairing, a.mode = "fp32", "model", "inplace,out"
        a.rounds, a.min_run_time = 6, 0.05
    presets: list[Preset] = []
    if a.preset is None and not a.shape:
        a.preset = "llama-3-8b"
    if a.preset:
        names = list(PRESETS) if a.preset == "all" else [n.strip() for n in a.preset.split(",") if n.strip()]
        for n in names:
            if n not in PRESETS:
                raise SystemExit(f"unknown preset {n!r}; known: {', '.join(PRESETS)}")
            presets.append(PRESETS[n])
    if a.shape:
        presets += [_custom_preset(s, a.base) for s in a.shape]
    dtypes = []
    for d in a.dtype.split(","):
        if d.strip() not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
        dtypes.append(DTYPES[d.strip()])
    pairings = []
    for p in a.pairing.split(","):
        p = p.strip()
        if p == "both":
            pairings += ["half", "interleaved"]
        elif p in ("model", "half", "interleaved"):
            pairings.append(p)
        else:
            raise SystemExit(f"unknown pairing {p!r}: model, half, interleaved or both")
    modes = [m.strip() for m in a.mode.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    return Config(
        presets=presets,
        prefill_tokens=_ints(a.tokens),
        decode_tokens=_ints(a.decode_tokens),
        dtypes=dtypes,
        pairings=pairings,
        modes=modes,
        providers=[p.strip() for p in a.providers.split(",")] if a.providers else None,
        device=a.device,
        rounds=a.rounds,
        min_run_time=a.min_run_time,
        tol_ulps=a.tol_ulps,
        allocator=a.allocator,
        cache=a.cache,
        progress=not a.no_progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rope-bench``; returns 1 when a provider was wrong or raised, else 0."""
    a = parse_args(argv)
    want = a.omp_wait.upper()
    if argv is None and a.omp_wait != "inherit" and os.environ.get("OMP_WAIT_POLICY", "").upper() != want:
        # OpenMP reads its wait policy once, when torch loads it: start again with it set.
        os.environ["OMP_WAIT_POLICY"] = want
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "rope_ext.bench", *sys.argv[1:]])
    if a.list:
        for p in PRESETS.values():
            print(
                f"{p.name:18s} q {p.q_heads:3d} kv {p.kv_heads:3d} head_dim {p.head_dim:3d} "
                f"rotary_dim {p.rotary_dim:3d} {'interleaved' if p.interleaved else 'half-split'} "
                f"base {p.base:g}"
            )
        print("providers: " + ", ".join(sorted({f"{p.name} ({p.mode})" for p in PROVIDERS})))
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = config_from_args(a)
    t0 = time.perf_counter()
    result = run_benchmark(cfg)
    result["command"] = "rope-bench " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)
    )
    result["elapsed_s"] = time.perf_counter() - t0
    print_table(result)
    print(f"elapsed {result['elapsed_s']:.1f} s", file=sys.stdout)
    if a.json:
        write_json(result, a.json)
    if a.csv:
        write_csv(result, a.csv)
    if a.plot:
        plot(result, a.plot)
    bad = [r for r in result["rows"] if r["status"] in ("wrong", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Workloads: the run's configuration, one workload's inputs (:class:`Case`) and its input sets.

A workload is a preset (or custom shape), a token count, a phase, a dtype and a pairing. Its inputs are
``q [T, Hq, D]``, ``k [T, Hkv, D]`` (token-major, contiguous), ``positions`` (``0..T-1`` for a prefill,
random positions of a batch of sequences for a decode step) and a float32 cos/sin cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import rope_ext
from rope_ext import reference

from .presets import DECODE_CONTEXT, Preset

__all__ = [
    "Case",
    "Config",
    "clones",
    "cycle",
    "input_sets",
    "last_level_cache_bytes",
    "make_case",
    "workloads",
]


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
    allocator: str = "fresh"  # CPU: see timing.set_cpu_allocator
    cache: str = "cold"  # CPU: see input_sets
    progress: bool = True


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


def clones(case: Case) -> tuple[Tensor, Tensor]:
    """Fresh copies of the case's ``q`` and ``k`` (for the in-place providers and ceilings)."""
    return case.q.clone(), case.k.clone()


def workloads(cfg: Config) -> list[tuple[Preset, int, str, torch.dtype, bool]]:
    """Every ``(preset, tokens, phase, dtype, interleaved)`` of ``cfg``, in run order."""
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


def cycle(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """A callable that calls ``fns`` in turn, one per call."""
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()

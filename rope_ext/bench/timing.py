"""Timing: blocked CPU timing, CUDA events with the L2 flushed, summary statistics, allocator modes.

Blocked timing as ``torch.utils.benchmark``'s ``blocked_autorange`` on the CPU; CUDA events on a GPU,
with the L2 cache flushed (a buffer twice its size is zeroed) before every timed call. Warm-up calls
first.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Timer", "set_cpu_allocator", "stats"]


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


def stats(times: Sequence[float]) -> dict[str, float]:
    """Median, 25th and 75th percentiles, minimum and count of per-call times (empty for no times)."""
    ts = sorted(times)
    if not ts:
        return {}
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    return {"median_s": statistics.median(ts), "p25_s": q[0], "p75_s": q[2], "min_s": ts[0], "n": len(ts)}


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

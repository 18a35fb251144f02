"""cos/sin cache: angles built in float64, stored as float32 (or the dtype asked for)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["RopeCache"]


class RopeCache:
    """Table of ``cos(p * inv_j)`` and ``sin(p * inv_j)`` for positions ``0 .. capacity-1``.

    ``cos_sin`` is ``[capacity, rotary_dim]``: cos for ``j < rotary_dim/2``, then sin (vLLM's
    ``cos_sin_cache`` layout), ready for :func:`rope_ext.apply_rotary`. ``inv_j = base ** (-2j/rotary_dim)``;
    every angle ``p * inv_j`` is computed in float64 and only the final cos/sin are rounded to
    ``dtype`` (float32 by default).

    ``ensure(n)`` makes positions ``0 .. n-1`` available, growing the table geometrically (never
    shrinking). A server that sizes the cache once up front (``max_positions``) never grows it inside a
    ``torch.compile`` graph or a CUDA graph. ``ensure`` may be called from several threads; a tensor
    returned by ``cos_sin`` stays valid (growth builds a new tensor, it never mutates the old one).
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float = 10000.0,
        *,
        max_positions: int = 2048,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
        if not base > 1.0:
            raise ValueError(f"base must be > 1, got {base!r}")
        if not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self._lock = threading.Lock()
        self._cos_sin = self._rows(0, max_positions)

    @property
    def inv_freq(self) -> Tensor:
        """float64 ``[rotary_dim / 2]``."""
        return self.base ** -(torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)

    @property
    def capacity(self) -> int:
        return self._cos_sin.shape[0]

    @property
    def cos_sin(self) -> Tensor:
        """``[capacity, rotary_dim]`` of ``dtype`` on ``device``."""
        return self._cos_sin

    def _rows(self, start: int, stop: int) -> Tensor:
        p = torch.arange(start, stop, dtype=torch.float64)
        angles = p[:, None] * self.inv_freq[None, :]  # element-wise: no TF32 matmul
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return table.to(device=self.device, dtype=self.dtype)

    def ensure(self, n: int) -> RopeCache:
        """Make positions ``0 .. n-1`` available; grows to ``max(n, 2 * capacity)`` when needed."""
        if n <= self._cos_sin.shape[0]:
            return self
        with self._lock:
            cap = self._cos_sin.shape[0]
            if n > cap:
                new_cap = max(int(n), 2 * cap)
                self._cos_sin = torch.cat([self._cos_sin, self._rows(cap, new_cap)], dim=0)
        return self

    def __repr__(self) -> str:
        return (
            f"RopeCache(rotary_dim={self.rotary_dim}, base={self.base}, capacity={self.capacity}, "
            f"device={self.device}, dtype={self.dtype})"
        )

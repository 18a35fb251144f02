"""labml-style module: :class:`RotaryPositionalEmbeddings`, seq-first ``[seq, batch, heads, features]``,
rotating the first ``d`` features with half-split pairs (the layout of labml's annotated implementation)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._tables import DeviceTables
from ..cache import RopeCache
from ..ops import apply_rotary

__all__ = ["RotaryPositionalEmbeddings"]


class RotaryPositionalEmbeddings(nn.Module):
    """RoPE for ``x`` ``[seq_len, batch, heads, features]``: token ``s`` is at position ``s``, the first ``d``
    features rotate with half-split pairs ``(i, i + d/2)``, ``theta_i = base ** (-2i / d)``; features past
    ``d`` pass through. Output has ``x``'s shape and dtype (the table is float32 with float64 angles).
    ``d`` must be even.
    """

    def __init__(self, d: int, base: int | float = 10_000) -> None:
        super().__init__()
        self.d = d
        self.base = base
        self.cache = RopeCache(d, float(base), max_positions=1)
        self._device_tables = DeviceTables(self.cache)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._device_tables.follow(fn)
        return self

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[-1] < self.d:
            raise ValueError(f"x must be [seq_len, batch, heads, features >= {self.d}], got {tuple(x.shape)}")
        seq = x.shape[0]
        if not torch.compiler.is_compiling():
            self.cache.ensure(seq)
            self._device_tables.on(x.device)
        positions = torch.arange(seq, device=x.device)[:, None, None]
        table = self._device_tables.table
        return apply_rotary(x if x.stride(-1) == 1 else x.contiguous(), positions, table)

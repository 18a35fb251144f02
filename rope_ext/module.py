"""``RotaryEmbedding``: the nn.Module a model author drops into an attention block.

Its cos/sin table comes from a :class:`~rope_ext.RopeCache` and follows the module's device through
:class:`rope_ext._tables.DeviceTables` (the same bookkeeping as the adapters in :mod:`rope_ext.compat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ._tables import DeviceTables
from .cache import RopeCache
from .checks import axis_layout
from .ops import apply_rotary_qk, apply_rotary_qk_

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of ``q`` and ``k`` backed by a :class:`~rope_ext.RopeCache`.

    Layout: ``q`` is ``[batch, seq, heads, head_dim]`` (``k`` the same with its own head count), or
    ``[seq, heads, head_dim]`` without a batch dim; any float dtype, last dim contiguous, other strides
    free. The first ``rotary_dim`` features of each head rotate (half-split pairs ``(j, j + rotary_dim/2)``,
    or ``(2j, 2j+1)`` when ``interleaved``); the rest pass through.

    ``forward(q, k, positions=None, *, offset=0, inplace=False)`` returns the rotated ``(q, k)``:

    * without ``positions``, token ``s`` of the sequence dim (dim ``-3``) is at position ``offset + s``
      (``offset``: a Python int, e.g. the number of tokens already in the KV cache); the table grows to
      ``offset + seq`` if needed (outside ``torch.compile``);
    * ``positions`` (int32/int64) is either per token, shaped like the trailing token dims of ``q``
      (``[batch, seq]``, or ``[seq]`` shared by the batch; packed sequences and left padding welcome),
      or any other shape that broadcasts to ``q.shape[:-1]``. Positions are not scanned (no device
      sync): they must be below the table's capacity, ``max_positions`` or what ``ensure`` made
      available;
    * with ``mrope_section`` (MRoPE, set by ``from_hf_config`` for Qwen2-VL / Qwen2.5-VL / Qwen3-VL),
      ``positions`` is ``[3, ...]`` (temporal, height, width rows, each as above); without ``positions``
      every token gets its index in all three rows (text), which is the ordinary rotation;
    * ``inplace=True`` rotates ``q`` and ``k`` in their own storage (no output allocation; differentiable
      like any in-place op) and returns them.

    The cos/sin table stays float32 (float64 angles) whatever ``module.to(dtype)`` does; ``module.to(device)``
    moves it (one copy per device). Size the table up front (``max_positions``) before ``torch.compile``
    or CUDA graph capture; see :class:`~rope_ext.RopeCache`.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        interleaved: bool = False,
        max_positions: int = 2048,
        mrope_section: tuple[int, ...] | None = None,
        mrope_interleaved: bool | str = False,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if not isinstance(rotary_dim, int) or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be an int <= head_dim = {head_dim}, got {rotary_dim!r}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.interleaved = bool(interleaved)
        if mrope_section is not None and sum(mrope_section) != rotary_dim // 2:
            raise ValueError(
                f"mrope_section must be ints summing to rotary_dim / 2 = {rotary_dim // 2}, "
                f"got {mrope_section!r}"
            )
        self.mrope_section = None if mrope_section is None else tuple(mrope_section)
        self.mrope_interleaved = axis_layout(mrope_interleaved)
        self.cache = RopeCache(rotary_dim, base, max_positions=max_positions, scaling=scaling)
        self._device_tables = DeviceTables(self.cache)

    @property
    def _table(self) -> Tensor:
        """The table as last fetched, on the module's device (what a compiled forward reads)."""
        return self._device_tables.table

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        layer_type: str | None = None,
        interleaved: bool = False,
        max_positions: int | None = None,
        device: torch.device | str | None = None,
    ) -> RotaryEmbedding:
        """Module for a transformers config (object or dict; see :meth:`RopeCache.from_hf_config`).

        ``interleaved`` for checkpoints in GPT-J / Meta pairing; ``device`` moves the module there.
        ``max_positions`` defaults to the config's ``max_position_embeddings``, with ``dynamic`` /
        ``longrope`` starting as transformers' module does (see :meth:`RopeCache.from_hf_config`).
        """
        from .hf_config import default_table_lengths, parse_hf_config, parse_mrope

        head_dim, rotary_dim, base, scaling = parse_hf_config(config, layer_type=layer_type)
        reserve = None
        if max_positions is None:
            max_positions, reserve = default_table_lengths(config, scaling)
        section, mrope_interleaved = parse_mrope(config, layer_type=layer_type)
        m = cls(
            head_dim,
            rotary_dim=rotary_dim,
            base=base,
            scaling=scaling,
            interleaved=interleaved,
            max_positions=max_positions,
            mrope_section=section,
            mrope_interleaved=mrope_interleaved,
        )
        if reserve is not None and reserve > max_positions:
            m.cache.reserve(reserve)
            m._device_tables.refresh()
        return m if device is None else m.to(device)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._device_tables.follow(fn)
        return self

    def ensure(self, n: int) -> RotaryEmbedding:
        """Make positions ``0 .. n-1`` available (see :meth:`RopeCache.ensure`)."""
        self.cache.ensure(n)
        self._device_tables.refresh()
        return self

    def cos_sin(self, device: torch.device | None = None) -> Tensor:
        """The float32 ``[capacity, rotary_dim]`` table (cos half, sin half) on ``device``."""
        return self.cache.cos_sin_on(device if device is not None else self._device_tables.device)

    def forward(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None, *, offset: int = 0, inplace: bool = False
    ) -> tuple[Tensor, Tensor]:
        for name, t in (("q", q), ("k", k), ("positions", positions)):
            if not isinstance(t, Tensor) and not (t is None and name == "positions"):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if isinstance(offset, bool) or not hasattr(offset, "__index__"):  # int, SymInt, numpy integer
            raise TypeError(f"offset must be an int, got {type(offset).__name__}")
        if q.dim() < 3 or k.dim() != q.dim():
            raise ValueError(
                "q and k must be [batch, seq, heads, head_dim] or [seq, heads, head_dim], "
                f"got {tuple(q.shape)} and {tuple(k.shape)}"
            )
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"q and k must have head_dim = {self.head_dim}, got {q.shape[-1]} and {k.shape[-1]}"
            )
        kw: dict[str, Any] = {"interleaved": self.interleaved}
        if positions is None:
            seq = q.shape[-3]
            if not torch.compiler.is_compiling():
                self.cache.ensure(offset + seq)  # a no-op unless the length is new
                self._device_tables.on(q.device)  # current table (grown / rebuilt / moved)
            positions = torch.arange(offset, offset + seq, device=q.device)[:, None]
        else:
            mrope = self.mrope_section is not None
            tok = positions.shape[1:] if mrope else positions.shape  # MRoPE: [n_axes, ...]
            nd = len(tok)
            if 0 < nd <= q.dim() - 2 and tuple(tok) == tuple(q.shape[-2 - nd : -2]):
                positions = positions[..., None]  # per token: broadcast over heads
            if not torch.compiler.is_compiling():
                self._device_tables.on(q.device)
            if mrope:
                kw["mrope_section"], kw["mrope_interleaved"] = self.mrope_section, self.mrope_interleaved
        table = self._device_tables.table
        if inplace:
            apply_rotary_qk_(q, k, positions, table, **kw)
            return q, k
        return apply_rotary_qk(q, k, positions, table, **kw)

    def extra_repr(self) -> str:
        c = self.cache
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={c.base}, "
            f"rope_type={c.rope_type!r}, interleaved={self.interleaved}, capacity={c.capacity}"
        )

"""The adapter standing in for a transformers ``*RotaryEmbedding`` module: cos / sin from rope_ext caches.

:class:`HFRotaryAdapter` builds its :class:`~rope_ext.RopeCache` objects from the model's config (one set
per layer type where the config nests its rope parameters per layer type) and follows transformers'
per-call rules for the length-dependent variants. Whether an adapter computes what a given model's module
computes is checked in :mod:`.probes`, not here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..._tables import DeviceTables
from ...cache import RopeCache
from .rotation import _as_layout

__all__ = ["HFRotaryAdapter"]


def _rope_layer_types(config: Any) -> tuple[str, ...] | None:
    """The layer types of a config whose ``rope_parameters`` is nested per layer type (Gemma 3,
    ModernBERT: ``{"sliding_attention": {...}, "full_attention": {...}}``) that its ``layer_types`` use,
    else None."""
    from ...hf_config import _getter, _is_nested

    get = _getter(config)
    params = get("rope_parameters")
    if params is None:
        params = get("rope_scaling")
    if not isinstance(params, dict) or not _is_nested(params):
        return None
    used = get("layer_types")  # the model computes cos / sin only for the layer types it has
    return tuple(sorted(lt for lt, p in params.items() if p is not None and (used is None or lt in used)))


class _Kind(NamedTuple):
    """The RoPE of one layer type (or of the whole model): how the adapter's caches are read."""

    prefix: str  # the keys of its caches: prefix + "main" (or "short" / "long" for longrope)
    rope_type: str
    original_max: int | None
    rotary_dim: int
    mrope_section: tuple[int, int, int] | None
    mrope_interleaved: bool


class HFRotaryAdapter(nn.Module):
    """Replaces a transformers ``*RotaryEmbedding``: ``forward(x, position_ids, layer_type=None) -> (cos,
    sin)``, each ``[batch, seq, rotary_dim]`` in ``x.dtype`` with the attention factor applied, laid out as
    ``layout``: ``"cat"`` (``cat((c, c))``, the usual) or ``"repeat"`` (``repeat_interleave(c, 2)``, Cohere),
    read from rope_ext caches (float64 angles, float32 table) instead of float32 angles.

    A config whose ``rope_parameters`` is nested per layer type (Gemma 3, ModernBERT) gets one set of
    caches per layer type, picked by ``layer_type`` as the model passes it.

    Length-dependent variants follow transformers' per-call rule (``seq_len = max(position_ids) + 1``):
    ``dynamic`` grows its base with ``seq_len`` and resets when a call is back under the trained length
    (eager only: under ``torch.compile`` the table as sized is used); ``longrope`` picks the long or
    short table per call, in-graph. Eagerly, the table grows to cover ``seq_len`` (one device sync per
    forward on CUDA); under ``torch.compile`` it must already be large enough (``max_positions``).
    """

    def __init__(self, original: nn.Module, config: Any, max_positions: int, *, layout: str = "cat") -> None:
        super().__init__()
        if layout not in ("cat", "repeat"):
            raise ValueError(f"layout must be 'cat' or 'repeat', got {layout!r}")
        object.__setattr__(self, "_original", original)  # not a submodule: kept for unpatching
        self.config = config
        self.layout = layout
        self.layer_types = _rope_layer_types(config)
        caches: dict[str, RopeCache] = {}
        self.kinds: dict[str | None, _Kind] = {}
        for lt in self.layer_types or (None,):
            prefix = "" if lt is None else f"{lt}."
            kind, kind_caches = self._build_kind(config, lt, prefix, max_positions)
            self.kinds[lt] = kind
            caches.update(kind_caches)
        first = next(iter(self.kinds.values()))
        self.rope_type = first.rope_type
        self.original_max = first.original_max
        self._rotary_dim = first.rotary_dim
        # MRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pair j's cos / sin come from the row of its section.
        self.mrope_section, self.mrope_interleaved = first.mrope_section, first.mrope_interleaved
        if self.mrope_section is not None:
            if self.layer_types is not None:
                raise ValueError("MRoPE with rope parameters per layer type is not supported")
            self.register_buffer("_mrope_rows", self._section_rows(), persistent=False)
        self.caches = caches
        self._device_tables = DeviceTables(self.caches)

    @staticmethod
    def _build_kind(
        config: Any, layer_type: str | None, prefix: str, max_positions: int
    ) -> tuple[_Kind, dict[str, RopeCache]]:
        probe = RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=1)
        original_max = probe.scaling.get("original_max_position_embeddings")
        if probe.rope_type == "longrope":
            o = original_max
            caches = {
                prefix + "short": RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=o),
                prefix + "long": RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=o + 1),
            }
            for c in caches.values():
                c.reserve(max_positions)
        elif probe.rope_type == "dynamic":
            main = RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=original_max)
            caches = {prefix + "main": main.reserve(max_positions)}
        else:
            caches = {
                prefix + "main": RopeCache.from_hf_config(
                    config, layer_type=layer_type, max_positions=max_positions
                )
            }
        kind = _Kind(
            prefix,
            probe.rope_type,
            original_max,
            probe.rotary_dim,
            probe.mrope_section,
            probe.mrope_interleaved,
        )
        return kind, caches

    @property
    def _tables(self) -> dict[str, Tensor]:
        """Each cache's table as last fetched, on the module's device (what a compiled forward reads)."""
        return self._device_tables.tables

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._original._apply(fn, recurse)
        self._device_tables.follow(fn)
        return self

    def reset_parameters(self) -> None:
        """Rebuild the kept original module's buffers (``inv_freq``, ...) after ``to_empty``.

        The adapter has no buffers of its own (its tables come from its caches, on the CPU, and follow
        the device), but it moves the original it keeps for :func:`unpatch_transformers`, so
        ``to_empty`` leaves that module's buffers uninitialised. They are rebuilt from a fresh original
        constructed on the CPU from its config (torchtune / FSDP2's ``reset_parameters`` convention).
        """
        if self.mrope_section is not None:
            with torch.no_grad():
                self._mrope_rows.copy_(self._section_rows())
        orig = self._original
        if next(orig.buffers(), None) is None:
            return
        with torch.device("cpu"):
            fresh = dict(type(orig)(getattr(orig, "config", self.config)).named_buffers())
        with torch.no_grad():
            for name, buf in orig.named_buffers():
                new = fresh.get(name)
                if new is not None and new.shape == buf.shape:
                    buf.copy_(new)

    def _section_rows(self) -> Tensor:
        from ...reference import mrope_rows

        return mrope_rows(self._rotary_dim // 2, self.mrope_section, self.mrope_interleaved)

    def _eager_update(self, kind: _Kind, position_ids: Tensor, device: torch.device) -> None:
        if position_ids.numel() == 0:
            return
        n = int(position_ids.max()) + 1
        if kind.rope_type == "dynamic":
            c = self.caches[kind.prefix + "main"]
            if n > c.seq_len:
                c.set_seq_len(n)
            elif n < kind.original_max < c.seq_len:
                c.set_seq_len(kind.original_max)
        for key, c in self.caches.items():
            if key.startswith(kind.prefix):
                c.reserve(n)
        self._device_tables.on(device)

    def forward(
        self, x: Tensor, position_ids: Tensor, layer_type: str | None = None
    ) -> tuple[Tensor, Tensor]:
        """``x`` (any shape: its dtype and device are used), ``position_ids`` int ``[batch, seq]`` (or
        ``[3, batch, seq]`` for MRoPE) -> ``(cos, sin)``, each ``[batch, seq, rotary_dim]`` in ``x.dtype``."""
        if self.layer_types is None:
            kind = self.kinds[None]
        elif layer_type in self.kinds:
            kind = self.kinds[layer_type]
        else:
            raise ValueError(f"layer_type must be one of {list(self.layer_types)}, got {layer_type!r}")
        if self.mrope_section is not None and position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)  # text: the same position in every section
        if not torch.compiler.is_compiling():
            self._eager_update(kind, position_ids, x.device)
        tables = self._device_tables.tables
        if kind.rope_type == "longrope":
            use_long = (position_ids.max() + 1) > kind.original_max
            short, long = tables[kind.prefix + "short"], tables[kind.prefix + "long"]
            rows = torch.where(use_long, long[position_ids], short[position_ids])
        else:
            rows = tables[kind.prefix + "main"][position_ids]
        h = rows.shape[-1] // 2
        c, s = rows[..., :h], rows[..., h:]
        if self.mrope_section is not None:
            # rows [3, batch, seq, rotary_dim]: pair j from section self._mrope_rows[j]
            idx = self._mrope_rows.view(1, 1, 1, h).expand(1, *c.shape[1:])
            c, s = c.gather(0, idx)[0], s.gather(0, idx)[0]
        return _as_layout(c, self.layout).to(x.dtype), _as_layout(s, self.layout).to(x.dtype)

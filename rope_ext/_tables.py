"""Device-following cos/sin tables for rope_ext's nn.Modules (internal).

A module backed by :class:`~rope_ext.RopeCache` objects (``RotaryEmbedding``, and in :mod:`rope_ext.compat`
the transformers adapter and the labml-style module) keeps each cache's table on the device it works on.
The cache stays where it was built (CPU) and hands out one copy per device (``cos_sin_on``); the module
remembers its device and the tables it last fetched, so that a compiled forward reads them without
touching the cache. :class:`DeviceTables` is that bookkeeping, shared by the three modules:

* in ``_apply`` (``module.to(device)``, ``.cuda()``, ``.half()``, ...): ``tables.follow(fn)`` probes the
  device ``fn`` moves tensors to and re-fetches every table there (a dtype-only ``fn`` keeps the float32
  tables as they are);
* in an eager forward, after any growth of the caches: ``tables.on(x.device)`` makes the input's device
  current and re-fetches (a dict lookup per cache unless the device is new or the table grew / was rebuilt);
* under ``torch.compile``: ``tables.tables`` / ``tables.table`` as last fetched (size the caches first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from .cache import RopeCache

__all__ = ["DeviceTables", "target_device"]


def target_device(fn: Callable[[Tensor], Tensor], current: torch.device) -> torch.device:
    """The device ``module._apply(fn)`` moves tensors to (probed on an empty tensor on ``current``)."""
    try:
        return fn(torch.empty(0, device=current, dtype=torch.float32)).device
    except Exception:  # fn that does not accept an arbitrary tensor: keep the device
        return current


class DeviceTables:
    """The current table of each of a module's caches, on the module's current device.

    ``DeviceTables(cache)`` (one cache, named ``"main"``) or ``DeviceTables({"name": cache, ...})``;
    ``device`` defaults to the first cache's device. Attributes: ``caches`` (name -> RopeCache),
    ``device`` and ``tables`` (name -> the table last fetched, on ``device``); ``table`` is the
    ``"main"`` table (or the only one).
    """

    def __init__(
        self, caches: RopeCache | Mapping[str, RopeCache], device: torch.device | None = None
    ) -> None:
        self.caches: dict[str, RopeCache] = (
            {"main": caches} if isinstance(caches, RopeCache) else dict(caches)
        )
        if not self.caches:
            raise ValueError("DeviceTables needs at least one RopeCache")
        self.device = next(iter(self.caches.values())).device if device is None else device
        self.tables: dict[str, Tensor] = {}
        self.refresh()

    @property
    def table(self) -> Tensor:
        """The ``"main"`` table (or the only one), as last fetched."""
        t = self.tables.get("main")
        return t if t is not None else next(iter(self.tables.values()))

    def refresh(self) -> dict[str, Tensor]:
        """Re-fetch every table on the current device (after the caches grew); returns ``tables``."""
        self.tables = {k: c.cos_sin_on(self.device) for k, c in self.caches.items()}
        return self.tables

    def follow(self, fn: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """For ``module._apply(fn)``: the device ``fn`` moves to becomes current; returns ``tables``."""
        self.device = target_device(fn, self.device)
        return self.refresh()

    def on(self, device: torch.device) -> dict[str, Tensor]:
        """For an eager forward: ``device`` (the input's) becomes current; returns ``tables`` there."""
        self.device = device
        return self.refresh()

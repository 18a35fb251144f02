"""torchtune-style module: :class:`RotaryPositionalEmbeddings`, a drop-in for
``torchtune.modules.RotaryPositionalEmbeddings`` (interleaved pairs, ``[b, s, n_h, h_d]``,
``forward(x, *, input_pos=None)``), computed by rope_ext's op.

Exported from :mod:`rope_ext.compat` as ``TorchtuneRotaryPositionalEmbeddings`` (the
``RotaryPositionalEmbeddings`` there is the labml-style module).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cache import cos_sin_rows
from ..ops import apply_rotary

__all__ = ["RotaryPositionalEmbeddings"]

_CPU = torch.device("cpu")


class RotaryPositionalEmbeddings(nn.Module):
    """torchtune's ``RotaryPositionalEmbeddings``: same constructor, attributes (``dim``, ``base``,
    ``max_seq_len``), methods and buffers, with the rotation done by rope_ext's op (``interleaved=True``).

    ``forward(x, *, input_pos=None)``: ``x`` is ``[b, s, n_h, h_d]`` with ``h_d == dim`` (rotate a slice
    ``x[..., :dim]`` for a partial rotary dim; any strides with a unit last stride work); pairs
    ``(2j, 2j + 1)`` rotate by ``input_pos * theta_j``, ``theta_j = base ** (-2j / dim)``:
    ``[x0 cos - x1 sin, x1 cos + x0 sin]``. ``input_pos`` is ``None`` (token ``i`` at position ``i``),
    ``[b, s]`` (per sequence, e.g. packed samples or a KV-cache step) or ``[s]``; positions must be below the
    cache's length (CPU raises ``IndexError``, as torchtune's indexing does). Returns ``x``'s shape and
    dtype, computed in float32 (float64 for float64 ``x``); differentiable in ``x``.

    Buffers (non-persistent, as in torchtune), rebuilt by :meth:`rope_init` (e.g. after ``to_empty``) and
    :meth:`build_rope_cache`:

    * ``theta`` float32 ``[dim // 2]``;
    * ``cache`` float32 ``[max_seq_len, dim // 2, 2]``, ``(cos, sin)`` of ``p * theta_j``. Unlike
      torchtune's (float32 ``theta``, float32 angle products), frequencies and angles are float64, so every
      value is within one float32 ulp of the exact cos/sin; torchtune's drift by up to
      ``p * |theta_j error|`` (about ``p * 2**-24`` radians);
    * ``_cos_sin`` float32 ``[max_seq_len, dim]``: the same values in the op's layout (cos half, then sin
      half), the table ``forward`` reads. It keeps float32 under ``module.to(torch.bfloat16)`` (``cache``
      is converted, as torchtune's is) and follows device moves.

    :meth:`rope_init` builds on the device of the existing buffers, or the default device when there are
    none or they are on the meta device (torchtune's flow: build under ``torch.device("meta")``, then
    ``rope_init()`` under ``torch.device(device)``, or after ``to_empty(device=...)``).
    """

    def __init__(self, dim: int, max_seq_len: int = 4096, base: int | float = 10_000) -> None:
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even int, got {dim!r}")
        self.dim = dim
        self.base = base
        self.max_seq_len = max_seq_len
        self.rope_init()

    def _inv_freq64(self) -> Tensor:
        return float(self.base) ** -(
            torch.arange(0, self.dim, 2, dtype=torch.float64, device=_CPU) / self.dim
        )

    def rope_init(self) -> None:
        """(Re)build ``theta`` and the caches (``max_seq_len`` positions)."""
        old = self._buffers.get("theta")
        device = old.device if old is not None and old.device.type != "meta" else torch.get_default_device()
        theta = self._inv_freq64().to(torch.float32)
        self.register_buffer("theta", theta.to(device), persistent=False)
        self.build_rope_cache(self.max_seq_len)

    def build_rope_cache(self, max_seq_len: int = 4096) -> None:
        """(Re)build ``cache`` and ``_cos_sin``: positions ``0 .. max_seq_len - 1``, on ``theta``'s device."""
        device = self.theta.device
        if device.type == "meta":
            cos_sin = torch.empty(max_seq_len, self.dim, dtype=torch.float32, device=device)
        else:
            positions = torch.arange(max_seq_len, dtype=torch.float64, device=_CPU)
            cos_sin = cos_sin_rows(positions, self._inv_freq64()).to(torch.float32).to(device)
        h = self.dim // 2
        self.register_buffer("cache", torch.stack([cos_sin[:, :h], cos_sin[:, h:]], dim=-1), persistent=False)
        self.register_buffer("_cos_sin", cos_sin, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # ``_cos_sin`` follows the device but stays float32 (a dtype conversion applies to ``cache`` only).
        cos_sin = self._buffers.pop("_cos_sin", None)
        try:
            super()._apply(fn, recurse)
        finally:
            if cos_sin is not None:
                self._buffers["_cos_sin"] = cos_sin
        if cos_sin is not None:
            moved = fn(cos_sin)
            if moved.dtype != cos_sin.dtype:
                moved = cos_sin.to(device=moved.device)
            self._buffers["_cos_sin"] = moved
        return self

    def forward(self, x: Tensor, *, input_pos: Tensor | None = None) -> Tensor:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [b, s, n_h, h_d] with h_d = dim = {self.dim}, got {tuple(x.shape)}")
        b, s = x.shape[0], x.shape[1]
        table = self._cos_sin
        if input_pos is None:
            if s > table.shape[0]:
                raise ValueError(
                    f"sequence length {s} exceeds the cache's {table.shape[0]} positions "
                    "(max_seq_len; build_rope_cache(n) makes more)"
                )
            positions = torch.arange(s, device=x.device)[:, None]  # [s, 1]: every sequence and head
        elif input_pos.dim() == 1 and input_pos.shape[0] == s:
            positions = input_pos[:, None]
        elif input_pos.dim() == 2 and input_pos.shape[1] == s and input_pos.shape[0] in (1, b):
            positions = input_pos[:, :, None]
        else:
            raise ValueError(
                f"input_pos must be [b, s] or [s] = {[b, s]} / {[s]}, got {tuple(input_pos.shape)}"
            )
        return apply_rotary(x if x.stride(-1) == 1 else x.contiguous(), positions, table, interleaved=True)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_seq_len={self.max_seq_len}, base={self.base}"

"""Positions of packed variable-length batches (THD / flash-attn varlen), with context parallelism.

:func:`varlen_positions` turns ``cu_seqlens`` into the position of every token, ready for
:func:`rope_ext.apply_rotary` as ``positions[:, None]``. Plain torch ops, no Python loop over sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import position_checks

__all__ = ["varlen_positions"]

_OUT_DTYPES = (torch.int32, torch.int64)


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _require_int(name: str, value, *, lo: int) -> None:
    """``value`` is a Python int (or a SymInt under ``torch.compile``), at least ``lo``."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _check_values(cu: Tensor, cp_size: int, total_tokens) -> int:
    """The checks that read ``cu`` (int64): one host read on success. Returns ``cu[-1]``."""
    n = cu.shape[0]
    d = cu[1:] - cu[:-1]
    # One read: cu[0], cu[-1], any decrease, any length not a multiple of 2 * cp_size.
    first, last, decreasing, unpadded = torch.stack(
        [cu[0], cu[-1], (d < 0).any().long(), (d % (2 * cp_size) != 0).any().long()]
    ).tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {first}")
    if decreasing:
        b = int((d < 0).nonzero()[0, 0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{b + 1}] = {int(cu[b + 1])} < "
            f"cu_seqlens[{b}] = {int(cu[b])}"
        )
    if cp_size > 1 and unpadded:
        b = int((d % (2 * cp_size) != 0).nonzero()[0, 0])
        raise ValueError(
            f"cu_seqlens must hold padded lengths, multiples of 2 * cp_size = {2 * cp_size} when "
            f"cp_size > 1, got length {int(d[b])} for sequence {b} (of {n - 1})"
        )
    if total_tokens is not None and total_tokens != last // cp_size:
        what = "cu_seqlens[-1]" if cp_size == 1 else f"cu_seqlens[-1] / cp_size = {last} / {cp_size}"
        raise ValueError(f"total_tokens must equal {what} = {last // cp_size}, got {total_tokens}")
    return last


def varlen_positions(
    cu_seqlens: Tensor,
    *,
    total_tokens: int | None = None,
    start_positions: Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    dtype: torch.dtype = torch.int32,
) -> Tensor:
    """Position of every token of a packed batch: ``[total_tokens]`` of ``dtype``, on cu_seqlens' device.

    Packed (TransformerEngine's THD format, flash-attn varlen): sequence ``b`` occupies tokens
    ``[cu_seqlens[b], cu_seqlens[b+1])`` of a ``[total_tokens, H, D]`` tensor, and its token ``i`` gets
    position ``start_positions[b] + i`` (``0 + i`` without ``start_positions``). Rotate with
    ``rope_ext.apply_rotary(x, varlen_positions(cu_seqlens, ...)[:, None], cos_sin)``.

    Args:
        cu_seqlens: ``[B + 1]`` integer tensor (int32 or int64 as flash-attn and TE use; any integer
            dtype works), ``0 = cu_seqlens[0] <= cu_seqlens[1] <= ...``; empty sequences are allowed.
            With ``cp_size > 1``, the *full padded* lengths (TE's ``cu_seqlens_padded``), each a
            multiple of ``2 * cp_size``.
        total_tokens: the length of the result: ``cu_seqlens[-1]``, or ``cu_seqlens[-1] / cp_size``
            (this rank's tokens) with ``cp_size > 1``. Give it (e.g. ``x.shape[0]``) to avoid the host
            synchronisation and under ``torch.compile`` / CUDA graphs.
        start_positions: ``[B]`` integer tensor on cu_seqlens' device, the offset of every sequence
            (decode continuation; flash-attn's ``seqlen_offsets``, TE's ``start_positions``).
        cp_size, cp_rank: context parallelism, TE's load-balanced layout: every sequence is cut into
            ``2 * cp_size`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r``,
            in that order, for every sequence, packed (sequence 0's two chunks, then sequence 1's, ...).
            The result is then the positions of the tokens this rank holds, ``cu_seqlens[-1] / cp_size``
            of them.
        dtype: ``torch.int32`` (default) or ``torch.int64``.

    Synchronisation: none when ``total_tokens`` is given: the result is computed on the device by
    ``arange``, ``searchsorted`` and gathers from ``cu_seqlens`` with static shapes, so the call is
    CUDA-graph safe and traces under ``torch.compile(fullgraph=True)`` (also ``dynamic=True``). Without
    ``total_tokens``, ``cu_seqlens[-1]`` is read on the host: one synchronisation on CUDA.

    Errors, naming the argument: ``TypeError`` for arguments of the wrong type and for a non-integer
    ``cu_seqlens`` or ``start_positions`` dtype (as ``apply_rotary`` does for positions); ``ValueError``
    for wrong shapes, devices, values and ``dtype``. Checks that need no values (types, shapes, dtypes,
    devices, ``cp_size``, ``cp_rank``) are always done. The checks that read ``cu_seqlens`` (starts at 0,
    non-decreasing, padded lengths with ``cp_size > 1``, ``total_tokens`` agrees) are done on the CPU in
    eager mode, and on CUDA only with ``rope_ext.set_position_checks(True)`` (one synchronisation);
    never under ``torch.compile``. Unchecked bad values never read or write out of bounds (sequence
    indices are clamped): they give garbage positions, which ``apply_rotary`` maps to NaN features on
    CUDA when outside the cache (or ``IndexError`` with position checks).
    """
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least one element ([batch + 1]), got shape "
            f"{list(cu_seqlens.shape)}"
        )
    if not _is_int_dtype(cu_seqlens.dtype):
        raise TypeError(f"cu_seqlens must have an integer dtype (int32 or int64), got {cu_seqlens.dtype}")
    _require_int("cp_size", cp_size, lo=1)
    _require_int("cp_rank", cp_rank, lo=0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {cp_size}), got {cp_rank}")
    if total_tokens is not None:
        _require_int("total_tokens", total_tokens, lo=0)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    n_seq = cu_seqlens.shape[0] - 1
    device = cu_seqlens.device
    if start_positions is not None:
        if not isinstance(start_positions, Tensor):
            raise TypeError(f"start_positions must be a torch.Tensor, got {type(start_positions).__name__}")
        if start_positions.dim() != 1 or start_positions.shape[0] != n_seq:
            raise ValueError(
                f"start_positions must have shape [batch] = [{n_seq}] (cu_seqlens.shape[0] - 1), got "
                f"{list(start_positions.shape)}"
            )
        if not _is_int_dtype(start_positions.dtype):
            raise TypeError(
                f"start_positions must have an integer dtype (int32 or int64), got {start_positions.dtype}"
            )
        if start_positions.device != device:
            raise ValueError(
                f"start_positions must be on the device of cu_seqlens ({device}), "
                f"got {start_positions.device}"
            )

    cu = cu_seqlens.to(torch.int64)
    compiling = torch.compiler.is_compiling()
    last = None
    if not compiling and (device.type == "cpu" or (position_checks.on_device and device.type != "meta")):
        last = _check_values(cu, cp_size, total_tokens)
    if total_tokens is None:
        if device.type == "meta":
            raise ValueError("total_tokens must be given for cu_seqlens on the meta device (no values)")
        if last is None:
            last = int(cu[-1])  # the one host synchronisation (on CUDA) of a call without total_tokens
        total_tokens = max(last // cp_size, 0)

    token = torch.arange(total_tokens, device=device, dtype=torch.int64)
    if n_seq == 0:
        # No sequence: nothing to index (total_tokens is 0 for valid input; garbage positions otherwise).
        return token.to(dtype)
    # Local (this rank's) cumulative lengths: cu_seqlens / cp_size, exact for padded lengths.
    cu_local = cu if cp_size == 1 else cu.div(cp_size, rounding_mode="floor")
    # seq[t] = b with cu_local[b] <= t < cu_local[b + 1] (right=True skips empty sequences); clamped so
    # that bad cu_seqlens or total_tokens never index out of bounds.
    seq = torch.searchsorted(cu_local[1:].contiguous(), token, right=True).clamp_(max=n_seq - 1)
    offset = token - cu_local.index_select(0, seq)  # token index within this rank's part of the sequence
    if cp_size > 1:
        # Chunk size c = L_b / (2 cp_size); this rank's part is chunk r then chunk 2 cp_size - 1 - r.
        length = cu.index_select(0, seq + 1) - cu.index_select(0, seq)
        c = length.div(2 * cp_size, rounding_mode="floor")
        offset = torch.where(offset < c, cp_rank * c + offset, (2 * cp_size - 2 - cp_rank) * c + offset)
    if start_positions is not None:
        offset = offset + start_positions.to(torch.int64).index_select(0, seq)
    return offset.to(dtype)

"""Meta's Llama complex form: :func:`precompute_freqs_cis` (complex64 table from float64 angles) and
:func:`apply_rotary_emb` (pairs ``(2j, 2j+1)`` as complex numbers; Meta's ``[seq, head_dim / 2]`` and
transformers' Llama 4 per-batch ``[batch, seq, head_dim / 2]`` freqs_cis), computed by rope_ext's op."""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import RopeCache
from ..ops import apply_rotary_qk

__all__ = ["precompute_freqs_cis", "apply_rotary_emb"]


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> Tensor:
    """complex64 ``[end, dim / 2]``: ``exp(i * p * theta ** (-2j / dim))`` (Meta's ``precompute_freqs_cis``),
    from float64 angles."""
    t = RopeCache(dim, theta, max_positions=end).cos_sin
    h = dim // 2
    return torch.complex(t[:, :h].contiguous(), t[:, h:].contiguous())


def _freqs_4d(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> Tensor:
    """``freqs_cis`` as ``[batch, seq, heads, head_dim / 2]`` (each of the first three 1 or the inputs' size),
    from any shape Meta's or transformers' form takes; ``ValueError`` naming the shapes otherwise."""
    d = xq.shape[-1]
    f = freqs_cis
    if f.dim() == 2:  # Meta: [seq, head_dim / 2], the same rows for every sequence of the batch
        f = f[None, :, None, :]
    elif f.dim() == 3:  # transformers' Llama 4: [batch, seq, head_dim / 2] (per-sequence position_ids)
        f = f[:, :, None, :]
    ok = (
        xq.dim() == 4
        and xk.dim() == 4
        and d % 2 == 0
        and xk.shape[-1] == d
        and freqs_cis.is_complex()
        and f.dim() == 4
        and f.shape[-1] == d // 2
        and all(f.shape[i] == 1 or f.shape[i] == xq.shape[i] == xk.shape[i] for i in range(3))
    )
    if not ok:
        raise ValueError(
            "expected xq, xk [batch, seq, heads, head_dim] (even head_dim) and complex freqs_cis "
            "[seq, head_dim/2], [batch, seq, head_dim/2] or [batch, seq, heads, head_dim/2] (each size but "
            f"the last 1 or the inputs'), got {tuple(xq.shape)}, {tuple(xk.shape)}, "
            f"{tuple(freqs_cis.shape)} {freqs_cis.dtype}"
        )
    return f


def apply_rotary_emb(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """Meta's ``apply_rotary_emb``: pairs ``(2j, 2j+1)`` of ``xq`` ``[batch, seq, heads, head_dim]`` (and
    ``xk``, its own head count) as complex numbers times ``freqs_cis`` (complex), which is

    * ``[seq, head_dim / 2]`` (Meta's Llama: one row per token, shared by the batch),
    * ``[batch, seq, head_dim / 2]`` (transformers' Llama 4: a row per sequence and token, from
      ``position_ids``; its rows may carry the attention scaling, ``|freqs_cis| != 1``), or
    * ``[batch, seq, heads, head_dim / 2]``,

    each size but the last either the inputs' or 1 (broadcast: ``[1, seq, 1, head_dim / 2]``,
    ``[1, seq, head_dim / 2]``, ...). Float32 arithmetic (float64 when xq, xk are), outputs in the inputs'
    dtypes (``type_as``); differentiable in ``xq`` and ``xk`` (and ``freqs_cis`` when it requires grad,
    through the complex formula)."""
    f = _freqs_4d(xq, xk, freqs_cis)
    if torch.is_grad_enabled() and freqs_cis.requires_grad:
        oq = torch.view_as_real(torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2)) * f).flatten(
            3
        )
        ok = torch.view_as_real(torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2)) * f).flatten(
            3
        )
        return oq.type_as(xq), ok.type_as(xk)
    tdtype = torch.float64 if xq.dtype == torch.float64 and xk.dtype == torch.float64 else torch.float32
    # One table row per freqs_cis row; positions [b, s, h] (f's sizes) pick them, broadcast by the op.
    rows = torch.view_as_real(f.reshape(-1, f.shape[-1]).resolve_conj())  # [n, head_dim / 2, (re, im)]
    table = rows.transpose(-1, -2).reshape(rows.shape[0], -1).to(tdtype)  # cos half, then sin half
    positions = torch.arange(rows.shape[0], device=xq.device).view(f.shape[:3])
    q = xq if xq.stride(-1) == 1 else xq.contiguous()
    k = xk if xk.stride(-1) == 1 else xk.contiguous()
    return apply_rotary_qk(q, k, positions, table, interleaved=True)

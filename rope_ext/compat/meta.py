"""Meta's Llama complex form: :func:`precompute_freqs_cis` (complex64 table from float64 angles) and
:func:`apply_rotary_emb` (pairs ``(2j, 2j+1)`` as complex numbers), computed by rope_ext's op."""

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


def apply_rotary_emb(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """Meta's ``apply_rotary_emb``: pairs ``(2j, 2j+1)`` of ``xq`` ``[batch, seq, heads, head_dim]`` (and
    ``xk``, its own head count) as complex numbers times ``freqs_cis`` ``[seq, head_dim / 2]`` (complex).
    Float32 arithmetic, outputs in the inputs' dtypes (``type_as``); differentiable in ``xq`` and ``xk``
    (and ``freqs_cis`` when it requires grad, through the complex formula)."""
    s, d = xq.shape[1], xq.shape[-1]
    if xq.dim() != 4 or xk.dim() != 4 or tuple(freqs_cis.shape) != (s, d // 2) or not freqs_cis.is_complex():
        raise ValueError(
            "expected xq, xk [batch, seq, heads, head_dim] and complex freqs_cis "
            f"[seq, head_dim/2] = {(s, d // 2)}, "
            f"got {tuple(xq.shape)}, {tuple(xk.shape)}, {tuple(freqs_cis.shape)}"
        )
    if torch.is_grad_enabled() and freqs_cis.requires_grad:
        f = freqs_cis[None, :, None, :]
        oq = torch.view_as_real(torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2)) * f).flatten(
            3
        )
        ok = torch.view_as_real(torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2)) * f).flatten(
            3
        )
        return oq.type_as(xq), ok.type_as(xk)
    tdtype = torch.float64 if xq.dtype == torch.float64 and xk.dtype == torch.float64 else torch.float32
    table = torch.cat([freqs_cis.real, freqs_cis.imag], dim=-1).to(tdtype)
    positions = torch.arange(s, device=xq.device)[:, None]
    q = xq if xq.stride(-1) == 1 else xq.contiguous()
    k = xk if xk.stride(-1) == 1 else xk.contiguous()
    return apply_rotary_qk(q, k, positions, table, interleaved=True)

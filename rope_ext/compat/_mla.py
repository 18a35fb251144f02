"""Shared pieces of the MLA adapters (:mod:`.vllm`, :mod:`.flashinfer`): peers pass a head's no-rope and
rope parts (or a token's latent and rope parts) as two tensors, :func:`rope_ext.apply_mla_rotary_and_cache_`
takes one tensor with the rope part at ``rotary_offset``. When the two are side by side in one tensor (the
layout vLLM's and SGLang's MLA backends allocate) :func:`joined` gives that tensor as a view; otherwise
the adapter stages them through a temporary."""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _no_overlap(t: Tensor) -> bool:
    """Every element of ``t`` at its own address (dims sorted by stride, each past the ones below)."""
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True


def joined(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """The view of ``a`` then ``b`` along the last dim when they are adjacent columns of one tensor (same
    storage, dtype, leading shape and strides, contiguous last dim, ``b`` starting right after ``a``'s last
    column), with no element twice; else None."""
    if a is None or b is None or a.dtype != b.dtype or a.device != b.device:
        return None
    if a.shape[:-1] != b.shape[:-1] or a.stride()[:-1] != b.stride()[:-1] or a.dim() < 2:
        return None
    if (a.shape[-1] > 1 and a.stride(-1) != 1) or (b.shape[-1] > 1 and b.stride(-1) != 1):
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if b.storage_offset() != a.storage_offset() + a.shape[-1]:
        return None
    view = a.as_strided((*a.shape[:-1], a.shape[-1] + b.shape[-1]), (*a.stride()[:-1], 1), a.storage_offset())
    return view if _no_overlap(view) else None


def scale_tensor(
    s: float | Tensor | None, device: torch.device, *, reciprocal: bool = False
) -> Tensor | None:
    """A one-element float32 tensor on ``device`` (the ops' scale), from a number or a tensor; with
    ``reciprocal`` the scale multiplies (``x * s``, FlashInfer's convention) and is turned into the divisor
    ``1 / s`` the ops take. None stays None (1.0)."""
    if s is None:
        return None
    if isinstance(s, Tensor):
        t = s.to(device=device, dtype=torch.float32).reshape(1)
    else:
        t = torch.tensor([float(s)], dtype=torch.float32, device=device)
    return t.reciprocal() if reciprocal else t

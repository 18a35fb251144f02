"""vLLM adapters: the in-place ``rotary_embedding`` custom op on flattened ``[num_tokens, num_heads *
head_size]`` tensors (``cos_sin_cache`` in vLLM's layout), computed by rope_ext's in-place op, and the
fused ``fused_qk_norm_rope`` (QK RMSNorm + rotary on a packed qkv) in vLLM's argument order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..ops import apply_rotary_qk_
from ..serving import apply_qk_norm_rotary_

__all__ = ["fused_qk_norm_rope", "rotary_embedding"]


def rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor | None,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox: bool,
    *,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> None:
    """vLLM's ``rotary_embedding`` custom op: rotate ``query`` and ``key`` in place.

    ``positions`` int64/int32 ``[num_tokens]`` (or ``[batch, seq]``); ``query`` ``[num_tokens, num_heads *
    head_size]`` (or ``[num_tokens, num_heads, head_size]``, or with ``[batch, seq]`` leading dims), token
    stride free (a slice of a packed QKV tensor works), last dim contiguous; ``key`` likewise with its own
    head count, or ``None``. ``cos_sin_cache`` ``[max_position, rot_dim]`` (cos half, sin half); the first
    ``rot_dim <= head_size`` features of each head rotate, the rest are untouched. ``is_neox``: half-split
    pairs (GPT-NeoX) if true, interleaved (GPT-J) if false. A cache in a dtype other than float32 and
    ``query``'s is used as float32. Returns ``None``.

    MRoPE (vLLM's ``MRotaryEmbedding``, Qwen2-VL / Qwen3-VL): ``positions`` ``[3, num_tokens]`` (temporal,
    height, width) with ``mrope_section=(t, h, w)`` (``t + h + w == rot_dim / 2``) and, for Qwen3-VL,
    ``mrope_interleaved=True``; see :func:`rope_ext.apply_rotary`.
    """
    if cos_sin_cache.dtype not in (torch.float32, query.dtype):
        cos_sin_cache = cos_sin_cache.float()
    pdim = positions.dim() - (1 if mrope_section is not None else 0)  # MRoPE: a leading section dim

    def heads(x: Tensor) -> Tensor:
        if x.dim() == pdim + 1:
            return x.unflatten(-1, (-1, head_size))
        if x.dim() == pdim + 2 and x.shape[-1] == head_size:
            return x
        raise ValueError(
            f"expected [*positions.shape, num_heads * {head_size}] or [..., num_heads, {head_size}], "
            f"got {tuple(x.shape)} with positions {tuple(positions.shape)}"
            + (" (MRoPE: [3, num_tokens])" if mrope_section is not None else "")
        )

    q = heads(query)
    k = heads(key) if key is not None else None
    apply_rotary_qk_(
        q,
        k,
        positions[..., None],
        cos_sin_cache,
        interleaved=not is_neox,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )


def fused_qk_norm_rope(
    qkv: Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: Tensor,
    k_weight: Tensor,
    cos_sin_cache: Tensor,
    is_neox: bool,
    position_ids: Tensor,
) -> None:
    """vLLM's ``fused_qk_norm_rope`` custom op, same argument order: in place on ``qkv``.

    ``qkv [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``; ``q_weight``,
    ``k_weight`` ``[head_dim]``; ``cos_sin_cache [max_position, rot_dim]`` (cos half, sin half; a cache in
    a dtype other than float32 and qkv's is used as float32); ``position_ids [num_tokens]``. Each q and k
    head is RMS-normalised (``eps``), scaled by its weight, rounded to qkv's dtype, then rotated
    (half-split pairs if ``is_neox``, else interleaved); the first ``rot_dim`` features rotate. Any
    ``head_dim <= 512`` (vLLM's CUDA kernel takes 64, 128 and 256). See
    :func:`rope_ext.apply_qk_norm_rotary_`.
    """
    width = (num_heads_q + num_heads_k + num_heads_v) * head_dim
    if qkv.dim() != 2 or qkv.shape[-1] != width:
        raise ValueError(
            f"qkv must be [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim] = "
            f"[num_tokens, {width}], got {list(qkv.shape)}"
        )
    if cos_sin_cache.dtype not in (torch.float32, qkv.dtype):
        cos_sin_cache = cos_sin_cache.float()
    apply_qk_norm_rotary_(
        qkv,
        num_heads_q,
        num_heads_k,
        num_heads_v,
        q_weight,
        k_weight,
        position_ids,
        cos_sin_cache,
        eps=eps,
        interleaved=not is_neox,
    )

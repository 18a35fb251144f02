"""vLLM adapters: the in-place ``rotary_embedding`` custom op on flattened ``[num_tokens, num_heads *
head_size]`` tensors (``cos_sin_cache`` in vLLM's layout), computed by rope_ext's in-place op, the fused
``fused_qk_norm_rope`` (QK RMSNorm + rotary on a packed qkv), and the MLA ops fusing DeepSeek's rotary
with ``concat_and_cache_mla`` (``concat_and_cache_mla_rope_fused``,
``fuse_mla_decode_rope_q_concat_kv_insert``), each in vLLM's argument order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..ops import apply_rotary_qk_
from ..serving import apply_mla_rotary_and_cache_, apply_qk_norm_rotary_
from ._mla import joined, scale_tensor

__all__ = [
    "concat_and_cache_mla_rope_fused",
    "fuse_mla_decode_rope_q_concat_kv_insert",
    "fused_qk_norm_rope",
    "rotary_embedding",
]


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


# vLLM's kv_cache_dtype strings: "auto" (and "bfloat16") store the model dtype; the fp8 ones store fp8
# bytes, in a uint8 cache tensor (vLLM's) or an fp8 one.
_KV_CACHE_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _kv_cache_as(kv_cache: Tensor, kv_cache_dtype: str) -> Tensor:
    """``kv_cache`` viewed as the dtype the string names (a uint8 cache as fp8); as it is for "auto"."""
    if kv_cache_dtype in ("auto", "bfloat16"):
        return kv_cache
    fp8 = _KV_CACHE_FP8.get(kv_cache_dtype)
    if fp8 is None:
        raise ValueError(
            f"kv_cache_dtype must be 'auto', 'bfloat16' or one of {sorted(_KV_CACHE_FP8)}, got "
            f"{kv_cache_dtype!r} (fp8_ds_mla's 656-byte rows are not this layout)"
        )
    if kv_cache.dtype == torch.uint8:
        return kv_cache.view(fp8)
    if kv_cache.dtype != fp8:
        raise TypeError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a uint8 or {fp8} cache, got {kv_cache.dtype}"
        )
    return kv_cache


def _table(cos_sin_cache: Tensor, dtype: torch.dtype) -> Tensor:
    return cos_sin_cache if cos_sin_cache.dtype in (torch.float32, dtype) else cos_sin_cache.float()


def concat_and_cache_mla_rope_fused(
    positions: Tensor,
    q_pe: Tensor,
    k_pe: Tensor,
    kv_c: Tensor,
    cos_sin_cache: Tensor,
    is_neox: bool,
    slot_mapping: Tensor,
    kv_cache: Tensor,
    kv_cache_dtype: str,
    kv_cache_scale: Tensor,
) -> None:
    """vLLM's ``concat_and_cache_mla_rope_fused``: DeepSeek's rotary (``DeepseekScalingRotaryEmbedding``)
    fused with ``concat_and_cache_mla``, same argument order.

    ``q_pe [num_tokens, num_heads, rot_dim]`` (e.g. ``q[..., qk_nope_head_dim:]``) and ``k_pe [num_tokens,
    rot_dim]`` are rotated in place (``is_neox``: half-split pairs, else interleaved; DeepSeek: ``False``);
    ``kv_c [num_tokens, kv_lora_rank]`` and the rotated ``k_pe`` are written side by side to ``kv_cache
    [num_blocks, block_size, kv_lora_rank + rot_dim]`` at ``slot_mapping`` (int64, ``-1`` skips a token).
    ``kv_cache_dtype``: ``"auto"`` stores q's dtype; ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` store
    ``x / kv_cache_scale`` saturated to fp8, in a uint8 (vLLM's) or fp8 cache. ``cos_sin_cache [max_pos,
    rot_dim]`` of q's dtype (vLLM's) or float32. ``positions`` may be longer than num_tokens (CUDA-graph
    padding). One call of :func:`rope_ext.apply_mla_rotary_and_cache_`.

    Differences from vLLM's kernel: rope_ext rotates in float32 and rounds once (vLLM's rounds each
    product in q's dtype: a few ulps apart), and it also rotates the ``k_pe`` of tokens with slot -1
    (vLLM's leaves them, padding either way).
    """
    n = q_pe.shape[0]
    apply_mla_rotary_and_cache_(
        q_pe,
        kv_c,
        k_pe,
        positions[:n],
        _table(cos_sin_cache, q_pe.dtype),
        _kv_cache_as(kv_cache, kv_cache_dtype),
        slot_mapping,
        interleaved=not is_neox,
        kv_scale=scale_tensor(kv_cache_scale, q_pe.device),
    )


def fuse_mla_decode_rope_q_concat_kv_insert(
    positions: Tensor,
    q_nope: Tensor,
    q_pe: Tensor,
    kv: Tensor,
    cos_sin_cache: Tensor,
    is_neox: bool,
    slot_mapping: Tensor,
    kv_cache: Tensor,
    kv_cache_dtype: str,
    kv_scale: Tensor,
    q_scale: Tensor | None,
    q_out: Tensor,
) -> None:
    """vLLM's ``fuse_mla_decode_rope_q_concat_kv_insert`` (its MLA decode prologue), same argument order.

    ``q_out [num_tokens, num_heads, kv_lora_rank + rot_dim]`` gets ``[q_nope | rotate(q_pe)]`` (``q_nope
    [num_tokens, num_heads, kv_lora_rank]``, the absorbed query; ``q_pe [num_tokens, num_heads, rot_dim]``),
    in q's dtype, or fp8 ``x / q_scale`` when ``q_scale`` is given (q_out fp8, or uint8 read as
    ``float8_e4m3fn``). ``kv [num_tokens, kv_lora_rank + rot_dim]`` is ``[kv_c | k_pe]``: kv_c and the
    rotated k_pe go to ``kv_cache`` at ``slot_mapping`` as in :func:`concat_and_cache_mla_rope_fused`.
    ``q_nope``, ``q_pe`` and ``kv`` are not modified. ``positions`` and ``slot_mapping`` may be longer
    than num_tokens. One call of :func:`rope_ext.apply_mla_rotary_and_cache_` (q read from ``[q_nope |
    q_pe]`` in place when they are adjacent columns of one tensor, else from a concatenated copy; k_pe
    from a copy).

    Difference from vLLM's kernel: with an fp8 q_out, rope_ext rounds the rotated q to q's dtype before
    quantizing (vLLM quantizes the float32 value): a value on an fp8 rounding boundary may move one step.
    """
    n, rot_dim = q_pe.shape[0], q_pe.shape[-1]
    lora = kv.shape[-1] - rot_dim
    q = joined(q_nope, q_pe)
    if q is None:
        q = torch.cat([q_nope, q_pe], dim=-1)
    if q_scale is not None and q_out.dtype == torch.uint8:
        q_out = q_out.view(torch.float8_e4m3fn)
    apply_mla_rotary_and_cache_(
        q,
        kv[:, :lora],
        kv[:, lora:].clone(),
        positions[:n],
        _table(cos_sin_cache, q_pe.dtype),
        _kv_cache_as(kv_cache, kv_cache_dtype),
        slot_mapping[:n],
        rotary_offset=lora,
        interleaved=not is_neox,
        kv_scale=scale_tensor(kv_scale, q_pe.device),
        q_out=q_out,
        q_scale=scale_tensor(q_scale, q_pe.device),
    )

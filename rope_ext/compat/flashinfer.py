"""FlashInfer adapter: ``mla_rope_quantize_fp8`` (``flashinfer.rope``), same argument order, computed by
:func:`rope_ext.apply_mla_rotary_and_cache_`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..serving import apply_mla_rotary_and_cache_
from ._mla import FP8, joined, scale_tensor

__all__ = ["mla_rope_quantize_fp8"]


def mla_rope_quantize_fp8(
    q_rope: Tensor,
    k_rope: Tensor,
    q_nope: Tensor | None,
    k_nope: Tensor | None,
    cos_sin_cache: Tensor,
    pos_ids: Tensor,
    is_neox: bool = True,
    quantize_dtype: torch.dtype | None = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Tensor | None = None,
    k_rope_out: Tensor | None = None,
    q_nope_out: Tensor | None = None,
    k_nope_out: Tensor | None = None,
    enable_pdl: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlashInfer's ``mla_rope_quantize_fp8``: RoPE on the rope parts, every part quantized to fp8.

    ``q_rope [nnz, H, rope_dim]``, ``k_rope [nnz, rope_dim]`` (MLA: one latent k, no head dim), ``q_nope
    [nnz, H, no_rope_dim]``, ``k_nope [nnz, no_rope_dim]`` (None: zero width), one float dtype;
    ``cos_sin_cache [max_pos, rope_dim]`` float32 (cos half, sin half; anything else is FlashInfer's
    ``ValueError``); ``pos_ids [nnz]``; ``is_neox``: half-split pairs, else interleaved (DeepSeek:
    ``False``). Writes ``fp8(rotate(q_rope) * quant_scale_q)`` to ``q_rope_out``, ``fp8(q_nope *
    quant_scale_q)`` to ``q_nope_out`` and likewise k with ``quant_scale_kv`` (the scales multiply;
    saturating, round to nearest even), allocating the outputs that are None (``quantize_dtype``, else an
    output's dtype, else ``float8_e4m3fn``). The inputs are not modified. Returns ``(q_rope_out,
    k_rope_out, q_nope_out, k_nope_out)``. ``enable_pdl`` is accepted and ignored.

    One call of the MLA op: q is ``[q_nope | q_rope]`` (``rotary_offset = no_rope_dim``) written whole to an
    fp8 ``q_out``; k is the op's cache write into a one-slot-per-token "cache" ``[nnz, 1, no_rope_dim +
    rope_dim]`` that is ``[k_nope_out | k_rope_out]``, with ``k_nope`` as ``kv_c``. Parts that are adjacent
    columns of one tensor (``q_nope_out = q_out[..., :L]``, ``q_rope_out = q_out[..., L:]``, as SGLang's
    MLA backends pass them) are used in place; others go through a temporary and a copy (and k_rope
    through a copy, the op rotating k_pe in place).

    Differences from FlashInfer's kernel: rope_ext divides by ``1 / scale`` (float32) where FlashInfer
    multiplies by ``scale`` (the same for powers of two), and it rounds the rotated values to the inputs'
    dtype before quantizing them (as its cache write does); either can move a value lying on an fp8
    rounding boundary by one fp8 step.
    """
    del enable_pdl
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    if q_rope.dim() != 3 or k_rope.dim() != 2:
        raise ValueError(
            "mla_rope_quantize_fp8 takes the MLA layout: q_rope [nnz, num_heads, rope_dim] and k_rope "
            f"[nnz, rope_dim], got {list(q_rope.shape)}, {list(k_rope.shape)}"
        )
    nnz, heads, rope_dim = q_rope.shape
    if q_nope is None:
        q_nope = q_rope.new_empty(nnz, heads, 0)
    if k_nope is None:
        k_nope = k_rope.new_empty(nnz, 0)
    if quantize_dtype is None:
        outs = (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
        quantize_dtype = next((o.dtype for o in outs if o is not None), torch.float8_e4m3fn)
    if quantize_dtype not in FP8:
        raise TypeError(f"quantize_dtype must be float8_e4m3fn or float8_e5m2, got {quantize_dtype}")
    if q_rope_out is None:
        q_rope_out = torch.empty_like(q_rope, dtype=quantize_dtype)
    if k_rope_out is None:
        k_rope_out = torch.empty_like(k_rope, dtype=quantize_dtype)
    if q_nope_out is None:
        q_nope_out = torch.empty_like(q_nope, dtype=quantize_dtype)
    if k_nope_out is None:
        k_nope_out = torch.empty_like(k_nope, dtype=quantize_dtype)

    no_rope = q_nope.shape[-1]
    q = joined(q_nope, q_rope)
    if q is None:
        q = torch.cat([q_nope, q_rope], dim=-1)
    q_out = joined(q_nope_out, q_rope_out)
    q_staged = q_out is None
    if q_staged:
        q_out = q_rope_out.new_empty(nnz, heads, no_rope + rope_dim)
    k_width = k_nope.shape[-1] + rope_dim
    kv = joined(k_nope_out, k_rope_out)
    k_staged = kv is None
    if k_staged:
        kv = k_rope_out.new_empty(nnz, k_width)
    slots = torch.arange(nnz, device=q_rope.device)
    apply_mla_rotary_and_cache_(
        q,
        k_nope,
        k_rope.clone(),
        pos_ids,
        cos_sin_cache,
        kv.unsqueeze(1),  # [nnz, 1, L + R]: token t in slot t
        slots,
        rotary_offset=no_rope,
        interleaved=not is_neox,
        kv_scale=scale_tensor(quant_scale_kv, q_rope.device, reciprocal=True),
        q_out=q_out,
        q_scale=scale_tensor(quant_scale_q, q_rope.device, reciprocal=True),
    )
    if q_staged:
        q_nope_out.copy_(q_out[..., :no_rope])
        q_rope_out.copy_(q_out[..., no_rope:])
    if k_staged:
        k_nope_out.copy_(kv[:, : k_width - rope_dim])
        k_rope_out.copy_(kv[:, k_width - rope_dim :])
    return q_rope_out, k_rope_out, q_nope_out, k_nope_out

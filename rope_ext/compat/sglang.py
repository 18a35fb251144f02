"""SGLang adapter: ``apply_rope_with_cos_sin_cache_inplace`` (sgl_kernel's signature) with its optional
fused KV-buffer write (``FusedSetKVBufferArg``), computed by rope_ext's ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops import apply_rotary_qk_
from ..serving import apply_rotary_qk_and_cache_

__all__ = ["FusedSetKVBufferArg", "apply_rope_with_cos_sin_cache_inplace"]


@dataclass
class FusedSetKVBufferArg:
    """The KV-buffer write fused into the rotation (sgl_kernel's dataclass of the same name).

    ``value [num_tokens, num_kv_heads * v_head_dim]`` (or ``[num_tokens, num_kv_heads, v_head_dim]``);
    ``k_buffer [num_slots, num_kv_heads * head_size]`` (or 3-d), ``v_buffer`` likewise with v_head_dim:
    one layer's token-slot buffers; ``cache_loc`` int64 ``[num_tokens]``, the slot of each token.
    ``k_scale`` / ``v_scale``: for fp8 buffers, the value stored is ``x / scale`` (None is 1.0).
    """

    value: Tensor
    k_buffer: Tensor
    v_buffer: Tensor
    k_scale: float | Tensor | None
    v_scale: float | Tensor | None
    cache_loc: Tensor


def _heads(x: Tensor, head_size: int) -> Tensor:
    return x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))


def _scale(s: float | Tensor | None, device: torch.device) -> Tensor | None:
    if s is None or isinstance(s, Tensor):
        return s
    return torch.tensor([float(s)], dtype=torch.float32, device=device)


def apply_rope_with_cos_sin_cache_inplace(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    enable_pdl: bool | None = None,
) -> None:
    """sgl_kernel's ``apply_rope_with_cos_sin_cache_inplace``: rotate ``query`` and ``key`` in place.

    ``positions`` int ``[num_tokens]``; ``query [num_tokens, num_heads * head_size]``, ``key`` likewise
    (3-d ``[num_tokens, heads, head_size]`` too; slices of a packed qkv work); ``cos_sin_cache
    [max_position, rot_dim]`` (cos half, sin half; used as float32 unless it has query's dtype);
    ``is_neox`` selects half-split pairs (else interleaved). With ``fused_set_kv_buffer_arg``, the rotated
    key and the value are also written to ``k_buffer`` / ``v_buffer`` at ``cache_loc`` in the same pass
    (:func:`rope_ext.apply_rotary_qk_and_cache_` with a block size of 1). ``enable_pdl`` is accepted and
    ignored (programmatic dependent launch is a launch attribute, not a result).
    """
    del enable_pdl
    if cos_sin_cache.dtype not in (torch.float32, query.dtype):
        cos_sin_cache = cos_sin_cache.float()
    q = _heads(query, head_size)
    k = _heads(key, head_size)
    if fused_set_kv_buffer_arg is None:
        apply_rotary_qk_(q, k, positions.unsqueeze(-1), cos_sin_cache, interleaved=not is_neox)
        return
    a = fused_set_kv_buffer_arg
    v = a.value if a.value.dim() == 3 else a.value.unflatten(-1, (k.shape[1], -1))
    kb = _heads(a.k_buffer, head_size).unsqueeze(1)  # [num_slots, 1, Hk, D]: NHD, block size 1
    vb = a.v_buffer if a.v_buffer.dim() == 3 else a.v_buffer.unflatten(-1, (k.shape[1], -1))
    apply_rotary_qk_and_cache_(
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        kb,
        vb.unsqueeze(1),
        a.cache_loc.to(torch.int64),
        interleaved=not is_neox,
        k_scale=_scale(a.k_scale, q.device),
        v_scale=_scale(a.v_scale, q.device),
    )

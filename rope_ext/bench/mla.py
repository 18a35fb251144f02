"""The MLA modes' workload: RoPE + MLA latent-cache write (DeepSeek-V2/V3), ``mla`` and ``mla-fp8``.

On a preset with an MLA shape (:class:`~rope_ext.bench.presets.Mla`: ``N = qk_nope_head_dim``, ``L =
kv_lora_rank``; the preset's ``head_dim = rotary_dim = R``, the rope part), one call of
``rope_ext.apply_mla_rotary_and_cache_`` per step. Its inputs, built from the workload's ``q``, ``k`` (the
rope parts, ``[T, H, R]`` and ``[T, 1, R]``) and, on first use, :class:`MlaInputs` (deterministic):

* ``q [T, H, N + R]`` (q's dtype): random ``q_nope [T, H, N]`` then the workload's q; the op rotates the
  rope part in place at ``rotary_offset = N``, the nope part is not touched;
* ``kv_c [T, L]`` and ``k_pe [T, 1, R]``: views of one ``[T, L + R]`` buffer (the output of DeepSeek's
  ``kv_a_proj_with_mqa`` after its norm): random kv_c, then the workload's k; k_pe is rotated in place;
* ``kv_cache [num_blocks, MLA_BLOCK_SIZE, L + R]`` (vLLM's ``concat_and_cache_mla`` layout), zeroed, of q's
  dtype (``mla``) or float8_e4m3fn with a one-element float32 ``kv_scale`` (``mla-fp8``); row ``slot``
  gets ``kv_c`` then the rotated ``k_pe``. Slots: int64, distinct, drawn as the cache modes draw theirs (a
  prefill: a random permutation of a cache of just its tokens; a decode step: random slots of
  ``DECODE_CACHE_SLOTS``).

Bytes moved (:meth:`~rope_ext.bench.workloads.Case.bytes_moved`), with ``e`` q's element size and ``c`` the
cache's (``e``, or 1 for fp8)::

    2 T H R e  +  2 T R e  +  T L e  +  T (L + R) c  +  8 T  +  T R 4  +  8 T
    q's rope part  k_pe      kv_c     cache rows       slots  cos/sin   positions
    read+written   read+wr.  read     written          read   row read  read

(the nope part of q is neither read nor written; the last two terms are what every mode counts per token).
Its ceiling ``stream mla`` / ``stream mla-fp8`` streams the first four terms (:mod:`.ceilings`).

:func:`mla_rotary_cache_unfused_` is what a server without the fusion writes by hand (the ``eager
unfused`` and ``torch.compile unfused`` providers): the HF formula on q's rope slice and k_pe, written back,
then the cache rows ``cat(kv_c, k_pe)`` (quantized for an fp8 cache) put at the slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rope_ext.reference import quantize_fp8

from .baselines import hf_apply_rotary_pos_emb
from .presets import DECODE_CACHE_SLOTS, MLA_BLOCK_SIZE, Mla

if TYPE_CHECKING:
    from .workloads import Case

__all__ = ["MLA_KV_SCALE", "MlaInputs", "mla_inputs", "mla_rotary_cache_unfused_", "mla_shape", "mla_tensors"]

MLA_KV_SCALE = 0.02  # kv_c standard normal, rotated k_pe up to ~7: most of e4m3's range (448)


@dataclass
class MlaInputs:
    """The MLA modes' inputs besides the workload's q, k, positions and cos/sin (see the module docstring)."""

    q_nope: Tensor  # [T, H, N], q's dtype
    kv_c: Tensor  # [T, L], q's dtype
    slot_mapping: Tensor  # int64 [T], distinct slots of the cache
    num_blocks: int  # of the cache, MLA_BLOCK_SIZE slots each
    kv_scale: Tensor  # float32 [1] (fp8 cache)


def mla_shape(case: Case) -> Mla:
    """The preset's MLA shape; ValueError for a preset without one."""
    if case.preset.mla is None:
        raise ValueError(f"{case.preset.name} has no MLA shape: the MLA modes need one (deepseek-v3)")
    return case.preset.mla


def mla_inputs(case: Case) -> MlaInputs:
    """Random q_nope and kv_c (standard normal), slots and the fp8 scale of ``case`` (deterministic)."""
    m = mla_shape(case)
    g = torch.Generator().manual_seed(2)  # independent of make_case's and the serving inputs' streams
    t, dev = case.tokens, case.device
    q_nope = torch.randn(t, case.preset.q_heads, m.qk_nope_head_dim, generator=g).to(case.dtype)
    kv_c = torch.randn(t, m.kv_lora_rank, generator=g).to(case.dtype)
    slots_needed = max(t, DECODE_CACHE_SLOTS) if case.phase == "decode" else t
    num_blocks = max(1, math.ceil(slots_needed / MLA_BLOCK_SIZE))
    slots = torch.randperm(num_blocks * MLA_BLOCK_SIZE, generator=g)[:t].to(torch.int64)
    return MlaInputs(
        q_nope=q_nope.to(dev),
        kv_c=kv_c.to(dev),
        slot_mapping=slots.to(dev),
        num_blocks=num_blocks,
        kv_scale=torch.tensor([MLA_KV_SCALE], device=dev),
    )


def mla_tensors(case: Case, fp8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fresh ``q [T, H, N + R]``, ``kv_c [T, L]``, ``k_pe [T, 1, R]`` (views of one ``[T, L + R]``) and a
    zeroed ``kv_cache [num_blocks, MLA_BLOCK_SIZE, L + R]`` (q's dtype, or float8_e4m3fn when ``fp8``)."""
    m, s = mla_shape(case), case.mla
    from .workloads import FP8_CACHE_DTYPE

    q = torch.cat([s.q_nope, case.q], dim=-1)
    latent = torch.cat([s.kv_c, case.k[:, 0]], dim=-1)
    kv_c, k_pe = latent[:, : m.kv_lora_rank], latent[:, None, m.kv_lora_rank :]
    shape = (s.num_blocks, MLA_BLOCK_SIZE, m.kv_lora_rank + case.rotary_dim)
    cache = torch.zeros(shape, dtype=FP8_CACHE_DTYPE if fp8 else case.dtype, device=case.device)
    return q, kv_c, k_pe, cache


def mla_rotary_cache_unfused_(
    q_pe: Tensor,
    k_pe: Tensor,
    kv_c: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    cache_rows: Tensor,
    slot_mapping: Tensor,
    kv_scale: Tensor | None = None,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Pure torch, what a server without the fused op writes by hand: the HF rotation of ``q_pe [T, H,
    R]`` (q's rope slice) and ``k_pe [T, 1, R]`` in their dtype (``cos``, ``sin`` ``[T, R]`` gathered, in
    q's dtype), copied back into them, and the rows ``cat(kv_c, k_pe') [T, L + R]`` put at
    ``slot_mapping`` with ``index_copy_`` into ``cache_rows``, the cache viewed ``[num_slots, L + R]``. An
    fp8 cache (``cache_dtype``) is passed as its bytes (``uint8``; CPU torch has no fp8 ``index_copy_``),
    the rows quantized with ``kv_scale`` (:func:`rope_ext.reference.quantize_fp8`) first."""
    qr, kr = hf_apply_rotary_pos_emb(q_pe, k_pe, cos, sin, interleaved)
    rows = torch.cat([kv_c, kr[:, 0]], dim=-1)
    if cache_dtype is not None and cache_dtype != rows.dtype:
        rows = quantize_fp8(rows, kv_scale, cache_dtype).view(cache_rows.dtype)  # type: ignore[arg-type]
    q_pe.copy_(qr)
    k_pe.copy_(kr)
    cache_rows.index_copy_(0, slot_mapping, rows)

"""The rerotate modes' workload: keys already in a paged KV cache rotated in place by ``delta`` positions
(context shift, attention sinks, a prefix reused at another offset), ``rerotate`` and ``rerotate-fp8``.

One call of ``rope_ext.rerotate_kv_cache_`` per step, on every preset (it needs only the preset's ``Hk``,
``head_dim`` and ``rotary_dim``). Its inputs, :class:`RerotateInputs` (deterministic, built on first use:
:attr:`~rope_ext.bench.workloads.Case.rerotate`):

* ``key_cache [num_blocks, KV_BLOCK_SIZE, Hk, D]`` (vLLM's NHD layout), of q's dtype (``rerotate``) or
  float8_e4m3fn with a one-element float32 ``k_scale`` (``rerotate-fp8``: ``quantize_fp8(k, k_scale)``),
  holding the workload's ``k [T, Hk, D]`` at the slots, zeros elsewhere. Slots: int64, distinct, drawn as the
  cache modes draw theirs (a prefill: a random permutation of a cache of just its tokens; a decode step:
  random slots of ``DECODE_CACHE_SLOTS``). Each provider rotates a fresh copy of it;
* ``delta``: int64 ``[T]``, one shift per token (the general case; a context shift passes one for all),
  uniform in ``(-P, P)`` with ``P`` the workload's table rows (a prefill: ``T``; a decode step:
  ``DECODE_CONTEXT``), both signs; the table is the workload's ``cos_sin``.

Bytes moved (:meth:`~rope_ext.bench.workloads.Case.bytes_moved`), with ``R`` the rotary dim and ``c`` the
cache's element size (q's, or 1 for fp8)::

    2 T Hk R c          +  8 T    +  8 T
    rotated features       slots     deltas
    read and written       read      read

(the pass-through features ``R .. D`` of a partial-rotary row are not touched; the cos/sin rows are not
counted: a context shift reads one). Its ceiling ``stream rerotate`` / ``stream rerotate-fp8`` streams the
first term in place (:mod:`.ceilings`).

:func:`rerotate_unfused_` is what a server without the op writes by hand (the ``eager unfused`` and
``torch.compile unfused`` providers): the rows gathered at the slots (``index_select``), dequantized to
float32 for an fp8 cache, rotated with the HF formula (cos and sin gathered at ``|delta|``, sin negated for a
negative delta: the inverse rotation), requantized, and put back with ``index_copy_``.
:func:`expected_cache` is the float64 reference the providers are validated against (:mod:`.validation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rope_ext import reference

from .baselines import hf_rotate_every_two, hf_rotate_half
from .presets import DECODE_CACHE_SLOTS, KV_BLOCK_SIZE

if TYPE_CHECKING:
    from .workloads import Case

__all__ = [
    "REROTATE_K_SCALE",
    "RerotateInputs",
    "expected_cache",
    "rerotate_bytes",
    "rerotate_inputs",
    "rerotate_row_bytes",
    "rerotate_tensors",
    "rerotate_unfused_",
    "shift_cos_sin",
]

REROTATE_K_SCALE = 0.02  # the cache modes' k_scale: standard-normal keys use most of e4m3's range (448)


@dataclass
class RerotateInputs:
    """The rerotate modes' inputs besides the workload's cos/sin (see the module docstring)."""

    key_cache: Tensor  # [num_blocks, KV_BLOCK_SIZE, Hk, D], q's dtype, k at the slots (never written)
    key_cache_fp8: Tensor  # the same, float8_e4m3fn: quantize_fp8(k, k_scale)
    slot_mapping: Tensor  # int64 [T], distinct slots of the cache
    delta: Tensor  # int64 [T], |delta| < cos_sin.shape[0]
    num_blocks: int  # of the cache, KV_BLOCK_SIZE slots each
    k_scale: Tensor  # float32 [1] (fp8 cache)

    def cache(self, fp8: bool) -> Tensor:
        """The initial cache of the mode (q's dtype, or fp8); not a copy."""
        return self.key_cache_fp8 if fp8 else self.key_cache


def rerotate_inputs(case: Case) -> RerotateInputs:
    """The cache holding the workload's k at random slots, per-token deltas, the fp8 scale (deterministic)."""
    from .workloads import FP8_CACHE_DTYPE

    g = torch.Generator().manual_seed(3)  # independent of make_case's and the other modes' streams
    t, p, dev = case.tokens, case.preset, case.device
    slots_needed = max(t, DECODE_CACHE_SLOTS) if case.phase == "decode" else t
    num_blocks = max(1, math.ceil(slots_needed / KV_BLOCK_SIZE))
    slots = torch.randperm(num_blocks * KV_BLOCK_SIZE, generator=g)[:t].to(torch.int64)
    rows = case.cos_sin.shape[0]
    delta = torch.randint(1 - rows, rows, (t,), generator=g, dtype=torch.int64)
    k_scale = torch.tensor([REROTATE_K_SCALE])
    k = case.k.cpu()
    cache = torch.zeros(num_blocks * KV_BLOCK_SIZE, p.kv_heads, p.head_dim, dtype=case.dtype)
    cache[slots] = k
    cache_fp8 = torch.zeros(cache.shape, dtype=torch.uint8)
    cache_fp8[slots] = reference.quantize_fp8(k, k_scale, FP8_CACHE_DTYPE).view(torch.uint8)
    shape = (num_blocks, KV_BLOCK_SIZE, p.kv_heads, p.head_dim)
    return RerotateInputs(
        key_cache=cache.view(shape).to(dev),
        key_cache_fp8=cache_fp8.view(FP8_CACHE_DTYPE).view(shape).to(dev),
        slot_mapping=slots.to(dev),
        delta=delta.to(dev),
        num_blocks=num_blocks,
        k_scale=k_scale.to(dev),
    )


def rerotate_tensors(case: Case, fp8: bool) -> Tensor:
    """A fresh copy of the mode's initial ``key_cache`` (each provider rotates its own)."""
    return case.rerotate.cache(fp8).clone()


def rerotate_row_bytes(case: Case, fp8: bool) -> int:
    """Bytes of the rotated features of the T cache rows: ``T * Hk * rotary_dim`` values (q's element size,
    or one byte for fp8)."""
    return case.tokens * case.preset.kv_heads * case.rotary_dim * (1 if fp8 else case.q.element_size())


def rerotate_bytes(case: Case, fp8: bool) -> int:
    """The op's minimum traffic: the rotated features read and written once, one slot and one delta (int64)
    read per token (see the module docstring)."""
    return 2 * rerotate_row_bytes(case, fp8) + 16 * case.tokens


def shift_cos_sin(case: Case, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """HF-style ``cos``, ``sin`` ``[T, rotary_dim]`` of each token's shift, in ``dtype``: the table rows
    ``|delta|``, sin negated for a negative delta (the inverse rotation), laid out for the pairing."""
    delta = case.rerotate.delta
    rows = case.cos_sin[delta.abs()]
    h = case.rotary_dim // 2
    c, s = rows[:, :h], rows[:, h:] * torch.where(delta < 0, -1.0, 1.0)[:, None]
    if case.interleaved:
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    else:
        c, s = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
    return c.to(dtype).contiguous(), s.to(dtype).contiguous()


def rerotate_unfused_(
    cache_rows: Tensor,
    slot_mapping: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    k_scale: Tensor | None = None,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Pure torch, what a server without the op writes by hand: the rows ``[T, Hk, D]`` of ``cache_rows``
    (the cache viewed ``[num_slots, Hk, D]``) at ``slot_mapping`` gathered, rotated with the HF formula
    (``cos``, ``sin`` ``[T, rotary_dim]`` from :func:`shift_cos_sin`, in the cache's dtype; partial rotary:
    the pass-through features concatenated back), and put back with ``index_copy_``. An fp8 cache
    (``cache_dtype``) is passed as its bytes (``uint8``; CPU torch has no fp8 ``index_copy_``): its rows are
    dequantized (``x * k_scale`` in float32), rotated in float32 (``cos``, ``sin`` float32) and requantized
    with :func:`rope_ext.reference.quantize_fp8`."""
    rows = cache_rows.index_select(0, slot_mapping)
    if cache_dtype is not None and cache_dtype != rows.dtype:
        rows = rows.view(cache_dtype).to(torch.float32) * k_scale
    rot = hf_rotate_every_two if interleaved else hf_rotate_half
    c, s, r = cos.unsqueeze(1), sin.unsqueeze(1), cos.shape[-1]
    x = rows[..., :r]
    out = x * c + rot(x) * s
    if r < rows.shape[-1]:
        out = torch.cat([out, rows[..., r:]], dim=-1)
    if cache_dtype is not None and cache_dtype != cache_rows.dtype:
        out = reference.quantize_fp8(out, k_scale, cache_dtype).view(cache_rows.dtype)  # type: ignore[arg-type]
    cache_rows.index_copy_(0, slot_mapping, out)


def expected_cache(case: Case, fp8: bool) -> Tensor:
    """The whole cache after one call, ``[num_slots, Hk, D]`` (cached on the case): the stored rows (q's
    dtype, or dequantized fp8) rotated by ``delta`` in float64; float64, or for fp8 requantized with
    ``k_scale`` (float8_e4m3fn). Rows not at the slots and the pass-through features: the cache as it was."""
    key = "rerotate-fp8" if fp8 else "rerotate"
    if key not in case._expected:
        s = case.rerotate
        slots, delta, cs = s.slot_mapping.cpu(), s.delta.cpu(), case.cos_sin.cpu()
        cache = s.cache(fp8).cpu()
        cache = cache.reshape(-1, *cache.shape[2:])
        if fp8:  # gathered as bytes: CPU torch does not index fp8 tensors
            rows = cache.view(torch.uint8)[slots].view(cache.dtype).double() * float(s.k_scale)
        else:
            rows = cache[slots].double()
        rotated = torch.empty_like(rows)
        for back in (False, True):  # a negative delta: the inverse rotation by |delta|
            m = (delta < 0) == back
            pos = delta[m].abs()[:, None]
            rotated[m] = reference.rotary_hadamard(
                rows[m], pos, cs, interleaved=case.interleaved, inverse=back
            )
        if fp8:
            out = cache.view(torch.uint8).clone()
            out[slots] = reference.quantize_fp8(rotated, s.k_scale.cpu(), cache.dtype).view(torch.uint8)
            out = out.view(cache.dtype)
        else:
            out = cache.double()
            out[slots] = rotated
        case._expected[key] = (out,)
    return case._expected[key][0]

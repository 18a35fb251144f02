"""Serving ops: rotary fused with its neighbours (KV-cache write with fp8, QK-RMSNorm).

Tokens are flattened: ``q [T, Hq, D]``, ``k [T, Hk, D]``, ``v [T, Hk, Dv]`` (views of a packed QKV
tensor work: any strides but a contiguous last dim), one position per token (``positions [T]``, int32
or int64; ``[n_axes, T]`` with ``mrope_section``). ``cos_sin [P, rotary_dim]`` as for
:func:`rope_ext.apply_rotary`. Arithmetic in float32 (float64 for float64 inputs).

As in :mod:`rope_ext.ops`, each function builds its op's arguments once, in schema order, for the op's
description (:mod:`rope_ext.specs`): its checks, then the call through the overload its options select.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import autograd as _autograd  # noqa: F401  (registers the autograd formulas)
from . import fakes as _fakes  # noqa: F401  (registers the fake kernels)
from ._inplace import check_inplace_allowed
from .checks import page_table as _page_table
from .checks import position_checks, shift_tensor, split_qkv, typed_errors
from .specs import CACHE, MLA_CACHE, QK_NORM, QK_NORM_PACKED_, REROTATE

__all__ = [
    "apply_mla_rotary_and_cache_",
    "apply_qk_norm_rotary",
    "apply_qk_norm_rotary_",
    "apply_rotary_qk_and_cache_",
    "rerotate_kv_cache_",
]

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_DEFAULT_EPS = QK_NORM.Args._field_defaults["eps"]  # the schemas' default eps


def _is_view(t: Tensor | None) -> bool:
    return t is not None and t._base is not None


def apply_rotary_qk_and_cache_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor | None = None,
    *,
    interleaved: bool = False,
    layout: str = "NHD",
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    q_out: Tensor | None = None,
    q_scale: Tensor | None = None,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | str = False,
    inverse: bool = False,
    page_table: Sequence[Tensor | None] | None = None,
) -> None:
    """Rotate q and k in place and write rotated k and v into a paged KV cache, in one pass.

    ``q [T, Hq, D]``, ``k [T, Hk, D]``, ``v [T, Hk, Dv]`` of one float dtype. q and k are rotated in
    place (k stays usable for prefill attention); rotated k and v go to the caches:

    - ``layout="NHD"``: ``[num_blocks, block_size, Hk, D]`` (vLLM's flash layout; a flat
      ``[num_slots, Hk, D]`` cache is ``cache.unsqueeze(1)``); ``"HND"``: ``[num_blocks, Hk,
      block_size, D]`` (FlashInfer). Any strides with a contiguous last dim; ``Dv`` for value_cache.
    - ``slot_mapping`` int64 ``[T']``, ``T' <= T``: token t goes to block ``slot // block_size``, row
      ``slot % block_size``. ``-1`` rotates the token without writing it (padding), and tokens
      ``t >= T'`` are rotated, not written (CUDA-graph padding). Slots are expected distinct. A slot
      outside the cache raises ``IndexError`` on CPU before anything is written; on CUDA that token's
      write is skipped (never out of bounds), and :func:`rope_ext.set_position_checks` makes eager CUDA
      calls raise instead.
    - ``page_table`` instead of ``slot_mapping`` (None): FlashInfer's paged-KV arguments
      (:class:`rope_ext.PageTable`: ``batch_indices``, ``positions``, ``kv_indices``, ``kv_indptr``,
      ``kv_last_page_len``), each token's slot found inside the kernel (no slot tensor, CUDA-graph
      safe). The same write, bit for bit, as the slot mapping of those slots; a token the table cannot
      place is refused or skipped as a slot outside the cache is.
    - Cache dtype: q's dtype (values stored as they are; the scales are ignored), or
      ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``: the stored value is ``x / scale`` in float32,
      saturated to the type's finite range (+-448 / +-57344; infinities saturate too), rounded to
      nearest even; NaN stays NaN (:func:`rope_ext.reference.quantize_fp8`). ``k_scale``, ``v_scale``:
      one-element float32 tensors read on the device (None is 1.0).
    - ``q_out`` (``[T, Hq, D]``, q's dtype or fp8 with ``q_scale``): q is then read only and its
      rotation goes to q_out; an fp8 q_out holds ``quantize_fp8(apply_rotary(q), q_scale)`` (the
      rotation rounded to q's dtype first, like k in its cache).

    ``positions`` ``[T]`` (``[n_axes, T]`` with ``mrope_section``, as :func:`rope_ext.apply_rotary`);
    ``rotary_offset`` as there. ``inverse=True`` rotates q (or q_out) by the negative angle; k is
    rotated as always (it goes to the cache). One kernel launch on CUDA, no allocation and no host
    synchronisation (CUDA-graph safe); one parallel pass over tokens on CPU. Every argument is checked
    before the first write: on error q, k, v and both caches are unchanged. An inference op: no
    autograd.
    """
    if page_table is not None:
        page_table = _page_table(page_table)
    inputs = (q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping)
    options = (
        k_scale, v_scale, q_out, q_scale,
        interleaved, layout, rotary_offset, mrope_section, mrope_interleaved, inverse, page_table,
    )  # fmt: skip
    if (
        type(q) is type(k) is type(v) is type(positions) is Tensor
        and (type(slot_mapping) is Tensor or (slot_mapping is None and page_table is not None))
        and type(key_cache) is type(value_cache) is Tensor
        and type(layout) is str
        and positions.dim() == 1
        and mrope_section is None
        and type(mrope_interleaved) in (bool, int)
        and not mrope_interleaved
        and type(rotary_offset) is int
        and (q_out is None or type(q_out) is Tensor)
        and not (
            _grad_enabled()
            and (
                q.requires_grad
                or k.requires_grad
                or v.requires_grad
                or key_cache.requires_grad
                or value_cache.requires_grad
                or (q_out is not None and q_out.requires_grad)
            )
        )
        and not position_checks.on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): straight to the op, which checks everything else (as in
        # ops.apply_rotary_qk_).
        try:
            CACHE.eager(inputs, options)
        except Exception as e:
            CACHE.reject(inputs, options, e)
        return
    _cache_checked(inputs, options)


@typed_errors
def _cache_checked(inputs: tuple, options: tuple) -> None:
    """``apply_rotary_qk_and_cache_`` past the eager fast path: every check, and ``torch.compile``."""
    a = CACHE.check(inputs, options)
    if _is_compiling() and (_is_view(a.q) or _is_view(a.k) or _is_view(a.q_out)):
        # Views mutated by a custom op lose their storage offset in Inductor (ops._rotate_in_place):
        # the op runs on copies, which are copied back.
        qc, kc = a.q.clone(), a.k.clone()
        qo = None if a.q_out is None else torch.empty_like(a.q_out)
        CACHE.call(a._replace(q=qc, k=kc, q_out=qo))
        a.k.copy_(kc)
        (a.q if a.q_out is None else a.q_out).copy_(qc if a.q_out is None else qo)
        return
    CACHE.call(a)


def apply_mla_rotary_and_cache_(
    q: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor | None = None,
    *,
    rotary_offset: int = 0,
    interleaved: bool = False,
    kv_scale: Tensor | None = None,
    q_out: Tensor | None = None,
    q_scale: Tensor | None = None,
    inverse: bool = False,
    page_table: Sequence[Tensor | None] | None = None,
) -> None:
    """RoPE + MLA latent-cache write (DeepSeek-V2/V3, Kimi-K2), in one pass.

    - ``q [T, H, D]``: features ``rotary_offset .. rotary_offset + rotary_dim`` (``rotary_dim =
      cos_sin.shape[-1]``) rotated in place; DeepSeek's ``q [T, H, nope + rope]`` passes
      ``rotary_offset=nope``. With ``q_out`` (q's shape; q's dtype, or fp8 with ``q_scale``) q is read
      only and q_out gets the whole head: the rope part rotated, the others copied (an fp8 q_out holds
      ``quantize_fp8`` of both, FlashInfer's ``mla_rope_quantize_fp8``).
    - ``k_pe [T, rotary_dim]`` (or ``[T, 1, rotary_dim]``): rotated in place.
    - ``kv_c [T, kv_lora_rank]`` (normalised already) and the rotated k_pe are stored side by side in
      ``kv_cache [num_blocks, block_size, kv_lora_rank + rotary_dim]`` (vLLM's ``concat_and_cache_mla``
      layout) at ``slot_mapping`` as :func:`apply_rotary_qk_and_cache_` does: slot -1 and tokens past
      slot_mapping are rotated, not written; a slot outside the cache is an ``IndexError`` on CPU before
      any write, skipped on CUDA; or at the slots of a ``page_table`` (:class:`rope_ext.PageTable`), as
      there. kv_cache of q's dtype, or fp8 with ``kv_scale`` (None is 1.0).

    Any strides with a contiguous last dim (kv_c and k_pe may be views of one projection output).
    Pairing half-split or ``interleaved`` (DeepSeek's checkpoints are interleaved; vLLM's DeepSeek
    models pass ``is_neox_style=False``). One kernel launch on CUDA, CUDA-graph safe; every argument is
    checked before the first write. ``inverse=True`` rotates q by the negative angle (k_pe as always).
    An inference op: no autograd. DeepSeek's yarn table:
    ``RopeCache.from_hf_config(config)`` with ``rotary_dim = qk_rope_head_dim``.
    """
    if page_table is not None:
        page_table = _page_table(page_table)
    inputs = (q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping)
    options = (kv_scale, q_out, q_scale, interleaved, rotary_offset, inverse, page_table)
    if (
        type(q) is type(kv_c) is type(k_pe) is type(positions) is type(kv_cache) is Tensor
        and (type(slot_mapping) is Tensor or (slot_mapping is None and page_table is not None))
        and positions.dim() == 1
        and type(rotary_offset) is int
        and (q_out is None or type(q_out) is Tensor)
        and not (
            _grad_enabled()
            and (
                q.requires_grad
                or kv_c.requires_grad
                or k_pe.requires_grad
                or kv_cache.requires_grad
                or (q_out is not None and q_out.requires_grad)
            )
        )
        and not position_checks.on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): straight to the op, which checks everything else.
        try:
            MLA_CACHE.eager(inputs, options)
        except Exception as e:
            MLA_CACHE.reject(inputs, options, e)
        return
    _mla_checked(inputs, options)


@typed_errors
def _mla_checked(inputs: tuple, options: tuple) -> None:
    """``apply_mla_rotary_and_cache_`` past the eager fast path: every check, and ``torch.compile``."""
    a = MLA_CACHE.check(inputs, options)
    if _is_compiling() and (_is_view(a.q) or _is_view(a.k_pe) or _is_view(a.q_out)):
        # As in _cache_checked: views mutated by a custom op run on copies, copied back.
        qc, kc = a.q.clone(), a.k_pe.clone()
        qo = None if a.q_out is None else torch.empty_like(a.q_out)
        MLA_CACHE.call(a._replace(q=qc, k_pe=kc, q_out=qo))
        a.k_pe.copy_(kc)
        (a.q if a.q_out is None else a.q_out).copy_(qc if a.q_out is None else qo)
        return
    MLA_CACHE.call(a)


def rerotate_kv_cache_(
    key_cache: Tensor,
    slot_mapping: Tensor,
    delta: Tensor | int,
    cos_sin: Tensor,
    *,
    layout: str = "NHD",
    interleaved: bool = False,
    k_scale: Tensor | None = None,
    rotary_offset: int = 0,
) -> None:
    """Rotate keys already in a paged cache by ``delta`` positions, in place (context shift, attention
    sinks, a prefix reused at another offset).

    ``key_cache`` as :func:`apply_rotary_qk_and_cache_` writes it (``"NHD"`` ``[num_blocks, block_size,
    Hk, D]`` or ``"HND"`` ``[num_blocks, Hk, block_size, D]``), of any float dtype or fp8. Every head of
    the key at slot ``slot_mapping[t]`` (int64 ``[T]``; -1 skips the token) has its features
    ``rotary_offset .. rotary_offset + rotary_dim`` rotated by ``delta[t]`` positions (``delta``: int32 /
    int64 ``[T]``, a one-element tensor or an int, one shift for all): by the table row ``|delta|``,
    inversely for a negative delta, so a key rotated at position p moves to ``p + delta``. Same pairing
    and ``cos_sin`` as when the keys were written. An fp8 cache is dequantized (``x * k_scale`` in
    float32), rotated in float32 and requantized with the same scale (:func:`rope_ext.reference.
    quantize_fp8`); other dtypes rotate as :func:`apply_rotary` does (float32 arithmetic).

    Slots are expected distinct. A slot outside the cache, or a shift with ``|delta| >=
    cos_sin.shape[0]``, raises on CPU before anything is written (``IndexError``; a repeated slot
    ``ValueError``); on CUDA that token is skipped, and :func:`rope_ext.set_position_checks` makes eager
    calls raise instead. One launch on CUDA, CUDA-graph safe with tensor arguments (an int delta is
    copied to the device). Not differentiable.
    """
    options = (k_scale, interleaved, layout, rotary_offset)
    if (
        type(key_cache) is type(slot_mapping) is type(cos_sin) is Tensor
        and type(delta) in (Tensor, int)
        and (k_scale is None or type(k_scale) is Tensor)
        and type(layout) is str
        and type(rotary_offset) is int
        and not (_grad_enabled() and key_cache.requires_grad)
        and not position_checks.on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step's shift): straight to the op, which checks everything else
        # (as in apply_rotary_qk_and_cache_).
        inputs = (key_cache, slot_mapping, shift_tensor(delta, key_cache), cos_sin)
        try:
            REROTATE.eager(inputs, options)
        except Exception as e:
            REROTATE.reject(inputs, options, e)
        return
    _rerotate_checked((key_cache, slot_mapping, delta, cos_sin), options)


@typed_errors
def _rerotate_checked(inputs: tuple, options: tuple) -> None:
    """``rerotate_kv_cache_`` past the eager fast path: every check, and ``torch.compile``."""
    key_cache, slot_mapping, delta, cos_sin = inputs
    inputs = (key_cache, slot_mapping, shift_tensor(delta, key_cache), cos_sin)
    REROTATE.call(REROTATE.check(inputs, options))


def apply_qk_norm_rotary_(
    qkv: Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    q_weight: Tensor,
    k_weight: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    eps: float = _DEFAULT_EPS,
    interleaved: bool = False,
    weight_offset: float = 0.0,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | str = False,
) -> None:
    """Per-head QK RMSNorm then rotary, in place on a packed ``qkv [T, (Hq+Hk+Hv)*D]``.

    Each q head (with ``q_weight [D]``) and k head (``k_weight [D]``) is RMS-normalised over its D
    features in float32, scaled by ``weight + weight_offset`` (``weight_offset=1.0`` is Gemma's
    ``1 + w``), rounded once to qkv's dtype, then rotated; the v heads are not touched.
    ``rotary_dim = cos_sin.shape[-1] < D`` is partial rotary. ``D <= 512``. The semantics of vLLM's
    ``fused_qk_norm_rope`` (:func:`rope_ext.compat.vllm.fused_qk_norm_rope` takes its argument order)
    and of :func:`rope_ext.reference.qk_norm_rotary`. qkv may be any 2-d view with a contiguous last
    dim. Every argument is checked before the first write; CUDA-graph safe. Differentiable when qkv
    requires grad (through :func:`apply_qk_norm_rotary`).
    """
    inputs = (qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin)
    options = (eps, interleaved, weight_offset, rotary_offset, mrope_section, mrope_interleaved)
    if (
        type(qkv) is type(q_weight) is type(k_weight) is type(positions) is Tensor
        and positions.dim() == 1
        and type(num_heads_q) is type(num_heads_k) is type(num_heads_v) is int
        and type(eps) is float
        and type(weight_offset) in (float, int)
        and mrope_section is None
        and type(mrope_interleaved) in (bool, int)
        and not mrope_interleaved
        and type(rotary_offset) is int
        and not (_grad_enabled() and (qkv.requires_grad or q_weight.requires_grad or k_weight.requires_grad))
        and not position_checks.on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): one op on qkv, which checks everything else (as in
        # ops.apply_rotary_qk_).
        try:
            QK_NORM_PACKED_.eager(inputs, options)
        except Exception as e:
            QK_NORM_PACKED_.reject(inputs, options, e)
        return
    _qk_norm_checked(inputs, options)


@typed_errors
def _qk_norm_checked(inputs: tuple, options: tuple) -> None:
    """``apply_qk_norm_rotary_`` past the eager fast path: every check, autograd and ``torch.compile``."""
    a = QK_NORM_PACKED_.check(inputs, options)
    wanted = a.qkv.requires_grad or a.q_weight.requires_grad or a.k_weight.requires_grad
    grad = wanted and torch.is_grad_enabled()
    if grad or _is_compiling():
        # The differentiable functional op on the q and k heads, then one copy_ into their columns of qkv
        # (also the traced path: see ops._rotate_in_place). With grad, the op saves copies of q and k
        # (qkv changes next).
        q, k = split_qkv(a.qkv, a.num_heads_q, a.num_heads_k, a.num_heads_v)
        if grad:
            check_inplace_allowed(a.qkv, requires_grad=True)
            q, k = q.clone(), k.clone()
        # qk_norm_rotary's arguments after q and k are the packed op's after the head counts.
        q_new, k_new = QK_NORM.call(QK_NORM.Args(q, k, *a[a._fields.index("q_weight") :]))
        width = (a.num_heads_q + a.num_heads_k) * q.shape[-1]
        a.qkv[:, :width].copy_(torch.cat([q_new.flatten(1), k_new.flatten(1)], dim=1))
        return
    QK_NORM_PACKED_.call(a)


@typed_errors
def apply_qk_norm_rotary(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    eps: float = _DEFAULT_EPS,
    interleaved: bool = False,
    weight_offset: float = 0.0,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | str = False,
) -> tuple[Tensor, Tensor]:
    """QK RMSNorm then rotary, out of place: returns new ``(q', k')`` of q's and k's shapes.

    ``q [T, Hq, D]``, ``k [T, Hk, D]`` (any strides, contiguous last dim), weights ``[D]`` of any float
    dtype; otherwise as :func:`apply_qk_norm_rotary_`. Differentiable in q, k, q_weight and k_weight
    with a hand-written backward: the gradient is rotated back by the inverse rotation, then through the
    RMSNorm in float32 (float64 for float64 inputs).
    """
    options = (eps, interleaved, weight_offset, rotary_offset, mrope_section, mrope_interleaved)
    return QK_NORM.call(QK_NORM.check((q, k, q_weight, k_weight, positions, cos_sin), options))

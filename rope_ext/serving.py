"""Serving ops: rotary fused with its neighbours (KV-cache write with fp8, QK-RMSNorm).

Tokens are flattened: ``q [T, Hq, D]``, ``k [T, Hk, D]``, ``v [T, Hk, Dv]`` (views of a packed QKV
tensor work: any strides but a contiguous last dim), one position per token (``positions [T]``, int32
or int64; ``[3, T]`` with ``mrope_section``). ``cos_sin [P, rotary_dim]`` as for
:func:`rope_ext.apply_rotary`. Arithmetic in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import ops as _o
from ._inplace import check_inplace_allowed

__all__ = ["apply_qk_norm_rotary", "apply_qk_norm_rotary_", "apply_rotary_qk_and_cache_"]

_ops = torch.ops.rope_ext
_cache_op = _ops.rotary_qk_cache_.default
_packed_norm_op = _ops.qk_norm_rotary_packed_.default
# The overloads with every option at its default, for the eager fast paths: a boxed call costs about
# 0.27 us per schema argument, passed or defaulted.
_cache_plain = _ops.rotary_qk_cache_.plain
_cache_scaled = _ops.rotary_qk_cache_.scaled
_packed_norm_plain = _ops.qk_norm_rotary_packed_.plain
_is_compiling = torch.compiler.is_compiling
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DEFAULT_EPS = 1e-6  # the schemas' default eps (csrc/ops/registration.cpp)


def _token_positions(positions: Tensor, mrope_section) -> Tensor:
    """``positions``, a tensor: the ops check that it holds one position per token (``[T]`` or ``[T, 1]``;
    ``[3, T]`` or ``[3, T, 1]`` with MRoPE), the positions rule of every op (``ops.positions_shape``)."""
    _o._require_tensor("positions", positions)
    return positions


def _fake_tokens(q: Tensor, positions: Tensor) -> None:
    """The serving kernels' check that positions (of section 0) hold one position per token of q."""
    shape = _o.positions_shape(positions.shape, q.shape[:-1], "q", token_major=True)
    T = q.shape[0]
    per_token = len(shape) == 2 and shape[-1] == 1 and (shape[0] == T or T <= 1)
    expanded = len(shape) == 2 and shape[0] != 1 and positions.stride(0) == 0
    if not per_token or expanded:
        raise ValueError(
            f"positions must hold one position per token of q ({T} tokens) with a nonzero stride: [T] "
            "(or [3, T] with mrope_section)"
        )


def _no_grad_wanted(**tensors: Tensor | None) -> None:
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and names:
        raise RuntimeError(
            f"{', '.join(names)} requires grad, but apply_rotary_qk_and_cache_ is an inference op and "
            "records no gradient; call it under torch.no_grad() (or use apply_rotary_qk for training)"
        )


def _pre_check_slots(slot_mapping: Tensor, key_cache: Tensor, layout: str) -> None:
    """With position checks on (``set_position_checks``), eager CUDA calls check slots too."""
    if (
        _o._check_positions_on_device
        and slot_mapping.device.type != "cpu"
        and slot_mapping.numel() > 0
        and not torch.compiler.is_compiling()
        and key_cache.dim() == 4
    ):
        n = key_cache.shape[0] * key_cache.shape[1 if layout == "NHD" else 2]
        bad = (slot_mapping < -1) | (slot_mapping >= n)
        if bool(bad.any()):
            value = int(slot_mapping[bad][0])
            raise IndexError(
                f"slot_mapping must hold -1 or slots in [0, num_blocks * block_size) = [0, {n}), got {value}"
            )


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
    slot_mapping: Tensor,
    *,
    interleaved: bool = False,
    layout: str = "NHD",
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    q_out: Tensor | None = None,
    q_scale: Tensor | None = None,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
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
    - Cache dtype: q's dtype (values stored as they are; the scales are ignored), or
      ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``: the stored value is ``x / scale`` in float32,
      saturated to the type's finite range (+-448 / +-57344; infinities saturate too), rounded to
      nearest even; NaN stays NaN (:func:`rope_ext.reference.quantize_fp8`). ``k_scale``, ``v_scale``:
      one-element float32 tensors read on the device (None is 1.0).
    - ``q_out`` (``[T, Hq, D]``, q's dtype or fp8 with ``q_scale``): q is then read only and its
      rotation goes to q_out; an fp8 q_out holds ``quantize_fp8(apply_rotary(q), q_scale)`` (the
      rotation rounded to q's dtype first, like k in its cache).

    ``positions`` ``[T]`` (``[3, T]`` with ``mrope_section``, as :func:`rope_ext.apply_rotary`);
    ``rotary_offset`` as there. One kernel launch on CUDA, no allocation and no host synchronisation
    (CUDA-graph safe); one parallel pass over tokens on CPU. Every argument is checked before the
    first write: on error q, k, v and both caches are unchanged. An inference op: no autograd.
    """
    if (
        type(q) is type(k) is type(v) is type(positions) is type(slot_mapping) is Tensor
        and type(key_cache) is type(value_cache) is Tensor
        and type(layout) is str
        and positions.dim() == 1
        and mrope_section is None
        and not mrope_interleaved
        and type(rotary_offset) is int
        and not (q.requires_grad or k.requires_grad or v.requires_grad)
        and not (key_cache.requires_grad or value_cache.requires_grad)
        and (q_out is None or (type(q_out) is Tensor and not q_out.requires_grad))
        and not _o._check_positions_on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): straight to the op, which checks everything else; with no
        # option set, the .plain overload (.scaled with both scales). Trailing arguments left at their
        # defaults are not passed; every other argument is, so the op sees what the general path passes.
        try:
            if q_out is None and q_scale is None and layout == "NHD" and not (interleaved or rotary_offset):
                if k_scale is None and v_scale is None:
                    _cache_plain(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping)
                elif type(k_scale) is type(v_scale) is Tensor:
                    _cache_scaled(
                        q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale, v_scale
                    )
                else:
                    _cache_op(
                        q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale, v_scale
                    )
            else:
                _cache_op(
                    q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                    q_out, q_scale, interleaved, layout, rotary_offset,
                )  # fmt: skip
        except Exception as e:
            error = e
        else:
            return
        # Rejected. The general path's checks before the op (they write nothing) raise first where they
        # would, so both paths reject alike (a non-tensor: their TypeError, not the op's RuntimeError).
        _cache_args(
            q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, layout, k_scale, v_scale,
            q_out, q_scale, rotary_offset, mrope_section,
        )  # fmt: skip
        raise (_o._retyped(error) if isinstance(error, ValueError) else error) from None
    _cache_checked(
        q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, interleaved, layout, k_scale,
        v_scale, q_out, q_scale, rotary_offset, mrope_section, mrope_interleaved,
    )  # fmt: skip


@_o._typed_errors
def _cache_args(
    q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, layout, k_scale, v_scale, q_out,
    q_scale, rotary_offset, mrope_section,
):  # fmt: skip
    """The checks of ``apply_rotary_qk_and_cache_``'s general path before the op (they write nothing);
    returns positions and ``mrope_section`` as the op takes them."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cos_sin", cos_sin)):
        _o._require_tensor(name, t)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        _o._require_tensor(name, t)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale), ("q_out", q_out), ("q_scale", q_scale)):
        _o._require_tensor(name, t, optional=True)
    _o._require_offset(rotary_offset)
    if not isinstance(layout, str):
        raise TypeError(f"layout must be 'NHD' or 'HND', got {type(layout).__name__}")
    mrope_section = _o._sections(mrope_section)
    pos = _token_positions(positions, mrope_section)
    _no_grad_wanted(q=q, k=k, v=v, q_out=q_out, key_cache=key_cache, value_cache=value_cache)
    _o._pre_check(positions, cos_sin)
    _pre_check_slots(slot_mapping, key_cache, layout)
    return pos, mrope_section


@_o._typed_errors
def _cache_checked(
    q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, interleaved, layout, k_scale, v_scale,
    q_out, q_scale, rotary_offset, mrope_section, mrope_interleaved,
) -> None:  # fmt: skip
    """``apply_rotary_qk_and_cache_`` past the eager fast path: every check, and ``torch.compile``."""
    pos, mrope_section = _cache_args(
        q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, layout, k_scale, v_scale, q_out,
        q_scale, rotary_offset, mrope_section,
    )  # fmt: skip
    rest = (interleaved, layout, rotary_offset, mrope_section, mrope_interleaved)
    args = (v, pos, cos_sin, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if torch.compiler.is_compiling() and (_is_view(q) or _is_view(k) or _is_view(q_out)):
        # Views mutated by a custom op lose their storage offset in Inductor (ops._rotate_in_place):
        # the op runs on copies, which are copied back.
        qc, kc = q.clone(), k.clone()
        qo = None if q_out is None else torch.empty_like(q_out)
        _ops.rotary_qk_cache_.default(qc, kc, *args, qo, q_scale, *rest)
        k.copy_(kc)
        (q if q_out is None else q_out).copy_(qc if q_out is None else qo)
        return
    _ops.rotary_qk_cache_.default(q, k, *args, q_out, q_scale, *rest)


def _split_qkv(qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int):
    """Views ``q [T, Hq, D]``, ``k [T, Hk, D]`` of a packed ``qkv [T, (Hq+Hk+Hv)*D]``, and D."""
    _o._require_tensor("qkv", qkv)
    counts = (num_heads_q, num_heads_k, num_heads_v)
    if any(type(h) is not int or h < 0 for h in counts) or not (num_heads_q and num_heads_k):
        raise ValueError(f"head counts must be ints, q and k >= 1, v >= 0; got {counts}")
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T, (Hq+Hk+Hv)*D], got shape {list(qkv.shape)}")
    if not qkv.is_floating_point() or qkv.dtype in FP8_DTYPES:
        raise TypeError(
            f"qkv must be a floating tensor (float32, float64, float16 or bfloat16), got {qkv.dtype}"
        )
    heads = sum(counts)
    width = qkv.shape[-1]
    if width % heads:
        raise ValueError(f"qkv.shape[-1] = {width} is not a multiple of Hq+Hk+Hv = {heads}")
    d = width // heads
    q = qkv[:, : num_heads_q * d].unflatten(-1, (num_heads_q, d))
    k = qkv[:, num_heads_q * d : (num_heads_q + num_heads_k) * d].unflatten(-1, (num_heads_k, d))
    return q, k


def _check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")


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
    mrope_interleaved: bool = False,
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
    if (
        type(qkv) is type(q_weight) is type(k_weight) is type(positions) is Tensor
        and positions.dim() == 1
        and type(num_heads_q) is type(num_heads_k) is type(num_heads_v) is int
        and type(eps) is float
        and type(weight_offset) in (float, int)
        and mrope_section is None
        and not mrope_interleaved
        and type(rotary_offset) is int
        and not (qkv.requires_grad or q_weight.requires_grad or k_weight.requires_grad)
        and not _o._check_positions_on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): one op on qkv, which checks everything else (trailing
        # defaults, eps included, not passed, as in apply_rotary_qk_and_cache_). A weight_offset that is
        # not 0 is passed as the general path passes it, through float().
        try:
            if interleaved or weight_offset != 0 or rotary_offset:
                _packed_norm_op(
                    qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps,
                    interleaved, float(weight_offset), rotary_offset,
                )  # fmt: skip
            elif eps == _DEFAULT_EPS:
                _packed_norm_plain(
                    qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin
                )
            else:
                _packed_norm_op(
                    qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps
                )
        except Exception as e:
            error = e
        else:
            return
        # Rejected: the general path's checks before the op raise first where they would (as in
        # apply_rotary_qk_and_cache_).
        _norm_args(
            qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps,
            weight_offset, rotary_offset, mrope_section,
        )  # fmt: skip
        raise (_o._retyped(error) if isinstance(error, ValueError) else error) from None
    _qk_norm_checked(
        qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps, interleaved,
        weight_offset, rotary_offset, mrope_section, mrope_interleaved,
    )  # fmt: skip


@_o._typed_errors
def _norm_args(
    qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps, weight_offset,
    rotary_offset, mrope_section,
):  # fmt: skip
    """The checks of ``apply_qk_norm_rotary_``'s general path before the op (they write nothing); returns
    q and k (views of qkv), positions, and eps, weight_offset and ``mrope_section`` as the op takes them."""
    q, k = _split_qkv(qkv, num_heads_q, num_heads_k, num_heads_v)
    if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(qkv) == 1:
        raise ValueError(
            "qkv has elements that overlap in memory (expanded or stride-0 view, strides "
            f"{list(qkv.stride())}); it is written in place"
        )
    _o._require_tensor("q_weight", q_weight)
    _o._require_tensor("k_weight", k_weight)
    _o._require_tensor("cos_sin", cos_sin)
    _o._require_offset(rotary_offset)
    _check_float("eps", eps)
    _check_float("weight_offset", weight_offset)
    mrope_section = _o._sections(mrope_section)
    pos = _token_positions(positions, mrope_section)
    _o._pre_check(positions, cos_sin)
    return q, k, pos, float(eps), float(weight_offset), mrope_section


@_o._typed_errors
def _qk_norm_checked(
    qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps, interleaved,
    weight_offset, rotary_offset, mrope_section, mrope_interleaved,
) -> None:  # fmt: skip
    """``apply_qk_norm_rotary_`` past the eager fast path: every check, autograd and ``torch.compile``."""
    q, k, pos, eps, weight_offset, mrope_section = _norm_args(
        qkv, num_heads_q, num_heads_k, num_heads_v, q_weight, k_weight, positions, cos_sin, eps,
        weight_offset, rotary_offset, mrope_section,
    )  # fmt: skip
    rest = (eps, interleaved, weight_offset, rotary_offset, mrope_section, mrope_interleaved)
    grad = torch.is_grad_enabled() and (qkv.requires_grad or q_weight.requires_grad or k_weight.requires_grad)
    if grad or torch.compiler.is_compiling():
        # The differentiable functional op, then one copy_ into the q and k columns of qkv (also the traced
        # path: see ops._rotate_in_place). With grad, the op saves copies of q and k (qkv changes next).
        if grad:
            check_inplace_allowed(qkv, requires_grad=True)
            q, k = q.clone(), k.clone()
        q_new, k_new = _ops.qk_norm_rotary.default(q, k, q_weight, k_weight, pos, cos_sin, *rest)
        width = (num_heads_q + num_heads_k) * q.shape[-1]
        qkv[:, :width].copy_(torch.cat([q_new.flatten(1), k_new.flatten(1)], dim=1))
        return
    _ops.qk_norm_rotary_.default(q, k, q_weight, k_weight, pos, cos_sin, *rest)


@_o._typed_errors
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
    mrope_interleaved: bool = False,
) -> tuple[Tensor, Tensor]:
    """QK RMSNorm then rotary, out of place: returns new ``(q', k')`` of q's and k's shapes.

    ``q [T, Hq, D]``, ``k [T, Hk, D]`` (any strides, contiguous last dim), weights ``[D]`` of any float
    dtype; otherwise as :func:`apply_qk_norm_rotary_`. Differentiable in q, k, q_weight and k_weight
    with a hand-written backward: the gradient is rotated back by the inverse rotation, then through the
    RMSNorm in float32 (float64 for float64 inputs).
    """
    for name, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("cos_sin", cos_sin)):
        _o._require_tensor(name, t)
    _o._require_offset(rotary_offset)
    _check_float("eps", eps)
    _check_float("weight_offset", weight_offset)
    mrope_section = _o._sections(mrope_section)
    pos = _token_positions(positions, mrope_section)
    _o._pre_check(positions, cos_sin)
    return _ops.qk_norm_rotary.default(
        q, k, q_weight, k_weight, pos, cos_sin, float(eps), interleaved, float(weight_offset), rotary_offset,
        mrope_section, mrope_interleaved,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Fake kernels.


def _fake_3d(x, name: str, shape: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be {shape}, got shape {list(x.shape)}")


@torch.library.register_fake("rope_ext::rotary_qk_cache_.scaled")
@torch.library.register_fake("rope_ext::rotary_qk_cache_.plain")
@torch.library.register_fake("rope_ext::rotary_qk_cache_")
def _rotary_qk_cache_fake(
    q,
    k,
    v,
    positions,
    cos_sin,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
    q_out=None,
    q_scale=None,
    interleaved=False,
    layout="NHD",
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    _fake_3d(q, "q", "[T, Hq, D]")
    _fake_3d(k, "k", "[T, Hk, D]")
    _fake_3d(v, "v", "[T, Hk, Dv]")
    pos0 = _o._fake_sections(positions, cos_sin, mrope_section, mrope_interleaved)
    _o._fake_checks(q, pos0, cos_sin, "q", rotary_offset, token_major=True)
    _o._same_device(q, k)
    _o._fake_checks(k, pos0, cos_sin, "k", rotary_offset, token_major=True)
    _fake_tokens(q, pos0)
    for name, t in (
        ("v", v),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
        ("k_scale", k_scale),
        ("v_scale", v_scale),
        ("q_out", q_out),
        ("q_scale", q_scale),
    ):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got '{layout}'")
    torch._check(k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0], lambda: "q, k, v: same T")
    torch._check(key_cache.dim() == 4 and value_cache.dim() == 4, lambda: "caches must be 4-d")
    torch._check(slot_mapping.dim() == 1, lambda: "slot_mapping must be [T']")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be an int64 tensor, got {slot_mapping.dtype}")
    if key_cache.dtype not in (q.dtype, *FP8_DTYPES):
        raise TypeError(
            f"key_cache must have the dtype of q ({q.dtype}) or be float8_e4m3fn / float8_e5m2, "
            f"got {key_cache.dtype}"
        )


@torch.library.register_fake("rope_ext::qk_norm_rotary_")
def _qk_norm_rotary_inplace_fake(
    q,
    k,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    eps=_DEFAULT_EPS,
    interleaved=False,
    weight_offset=0.0,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    _norm_fake_checks(
        q, k, q_weight, k_weight, positions, cos_sin, rotary_offset, mrope_section, mrope_interleaved
    )


@torch.library.register_fake("rope_ext::qk_norm_rotary")
def _qk_norm_rotary_fake(
    q,
    k,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    eps=_DEFAULT_EPS,
    interleaved=False,
    weight_offset=0.0,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    _norm_fake_checks(
        q, k, q_weight, k_weight, positions, cos_sin, rotary_offset, mrope_section, mrope_interleaved
    )
    return _o._empty_output(q), _o._empty_output(k)


@torch.library.register_fake("rope_ext::qk_norm_rotary_packed_.plain")
@torch.library.register_fake("rope_ext::qk_norm_rotary_packed_")
def _qk_norm_rotary_packed_fake(
    qkv,
    num_heads_q,
    num_heads_k,
    num_heads_v,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    eps=_DEFAULT_EPS,
    interleaved=False,
    weight_offset=0.0,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    q, k = _split_qkv(qkv, num_heads_q, num_heads_k, num_heads_v)
    _norm_fake_checks(
        q, k, q_weight, k_weight, positions, cos_sin, rotary_offset, mrope_section, mrope_interleaved
    )


def _norm_fake_checks(
    q, k, q_weight, k_weight, positions, cos_sin, rotary_offset, mrope_section, mrope_interleaved
):
    _fake_3d(q, "q", "[T, Hq, D]")
    _fake_3d(k, "k", "[T, Hk, D]")
    pos0 = _o._fake_sections(positions, cos_sin, mrope_section, mrope_interleaved)
    _o._fake_checks(q, pos0, cos_sin, "q", rotary_offset, token_major=True)
    _o._same_device(q, k)
    _o._fake_checks(k, pos0, cos_sin, "k", rotary_offset, token_major=True)
    _fake_tokens(q, pos0)
    torch._check(q.shape[-1] <= 512, lambda: "head_dim must be at most 512 for the fused QK norm")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {w.device}")
        torch._check(w.dim() == 1 and w.shape[0] == q.shape[-1], lambda name=name: f"{name} must be [D]")


# ---------------------------------------------------------------------------------------------
# Autograd of qk_norm_rotary: y = R(n), n = x * r * (w + offset), r = 1 / sqrt(mean(x^2) + eps).
# Given dy: dn = R^-1(dy) (the inverse rotation); dw = sum(dn * x * r) over tokens and heads;
# dx = r * a - x * r^3 * mean(a * x) with a = dn * (w + offset). Computed in float32 (float64 inputs:
# float64) from the saved inputs; the forward's rounding of n to the activation dtype is not
# differentiated (the straight-through convention of every low-precision kernel).


def _norm_setup(ctx, inputs, output):
    q, k, q_weight, k_weight, positions, cos_sin, eps, interleaved, weight_offset, *rot = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, positions, cos_sin)
    ctx.eps = eps
    ctx.interleaved = interleaved
    ctx.weight_offset = weight_offset
    ctx.rot = rot  # rotary_offset, mrope_section, mrope_interleaved


def _norm_head_backward(ctx, x: Tensor, w: Tensor, grad: Tensor | None, positions, cos_sin):
    if grad is None:
        return None, None
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cs = cos_sin if cos_sin.dtype in (torch.float32, acc) else cos_sin.to(acc)
    if positions.dim() == grad.dim() - 2 + (ctx.rot[1] is not None):
        positions = positions.unsqueeze(-1)  # per token ([T]) as the rotary op takes it ([T, 1])
    dn = _ops.rotary.default(
        _o._last_dim_contiguous(grad.to(acc)), positions, cs, ctx.interleaved, True, *ctx.rot
    )
    xf = x.to(acc)
    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + ctx.eps)
    wf = w.to(acc) + ctx.weight_offset
    a = dn * wf
    dx = r * a - xf * r.pow(3) * (a * xf).mean(dim=-1, keepdim=True)
    dw = (dn * xf * r).sum(dim=(0, 1))
    return dx.to(x.dtype), dw.to(w.dtype)


def _norm_backward(ctx, grad_q, grad_k):
    q, k, q_weight, k_weight, positions, cos_sin = ctx.saved_tensors
    dq, dwq = _norm_head_backward(ctx, q, q_weight, grad_q, positions, cos_sin)
    dk, dwk = _norm_head_backward(ctx, k, k_weight, grad_k, positions, cos_sin)
    if not ctx.needs_input_grad[2]:
        dwq = None
    if not ctx.needs_input_grad[3]:
        dwk = None
    return dq, dk, dwq, dwk, None, None, None, None, None, None, None, None


torch.library.register_autograd("rope_ext::qk_norm_rotary", _norm_backward, setup_context=_norm_setup)

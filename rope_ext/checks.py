"""The Python checks of the public ops, run before an op (they write nothing).

The kernels check every argument themselves (csrc/ops/binding.cpp); the checks here are the ones the
Python API adds: a non-tensor argument raises ``TypeError`` naming it (the boxed call would raise a
``RuntimeError`` about the schema), option values of the wrong Python type are refused instead of being
coerced, and, with :func:`set_position_checks`, eager CUDA calls check positions and slots on the host.
Each op's checks (run by ``specs.OpSpec.check`` after the tensor arguments' types) take the op's
arguments by name (a named tuple in schema order) and return them as the op takes them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "FP8_DTYPES",
    "MAX_AXES",
    "PageTable",
    "TYPE_ERROR_TAG",
    "cache_args",
    "page_table",
    "position_checks",
    "qk_norm_args",
    "qk_norm_packed_args",
    "require_tensor",
    "retyped",
    "rotary_args",
    "set_position_checks",
    "split_qkv",
    "typed_errors",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Position axes (len(mrope_section)) at most: the kernels' kMaxAxes (csrc/rope/params.h).
MAX_AXES = 8
_is_compiling = torch.compiler.is_compiling


class _PositionChecks:
    """Whether eager CUDA calls check positions (and slots) on the host (:func:`set_position_checks`).

    One object that the modules import by name: every eager fast path reads ``on_device`` (and leaves
    such calls to the checked path), so it is an attribute read, not a function call.
    """

    __slots__ = ("on_device",)

    def __init__(self) -> None:
        self.on_device = False


position_checks = _PositionChecks()


def set_position_checks(enabled: bool) -> None:
    """Raise ``IndexError`` for out-of-cache positions on CUDA too.

    CPU ops always check positions before writing. CUDA ops do not by default, since the check
    synchronises with the device: a position outside ``[0, cos_sin.shape[0])`` then yields NaN in
    that token's rotated features (never an out-of-bounds access). With checks enabled, eager calls
    on CUDA check first (one synchronisation per call), and the cache op also refuses a slot that two
    tokens share (``ValueError``, as on the CPU); compiled graphs and CUDA-graph captures are not
    checked (their replays run unchecked).
    """
    position_checks.on_device = bool(enabled)


# ---------------------------------------------------------------------------------------------
# Error classes.

# The tag that starts the message of a C++ check rejecting a type or dtype (csrc/ops/binding.h, TypeError).
# The stable ABI carries standard exceptions only, so the bare ops raise them as ValueError with the tag;
# the API raises TypeError without it.
TYPE_ERROR_TAG = "[type] "


def retyped(e: Exception) -> Exception:
    """``e`` as the API raises it: a tagged ValueError of the ops as TypeError, anything else as it is."""
    if isinstance(e, ValueError):
        msg = str(e)
        if msg.startswith(TYPE_ERROR_TAG):
            return TypeError(msg[len(TYPE_ERROR_TAG) :])
    return e


def typed_errors(fn):
    """``fn`` raising TypeError for the ops' type errors (eager; traced calls raise from the fake kernels)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise retyped(e) from None

    return wrapper


# ---------------------------------------------------------------------------------------------
# Argument checks.


def require_tensor(name: str, value, optional: bool = False) -> None:
    """Raises ``TypeError`` naming the argument unless ``value`` is a tensor (or None, when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_offset(rotary_offset) -> None:
    if type(rotary_offset) is not int:
        raise TypeError(f"rotary_offset must be an int, got {type(rotary_offset).__name__}")


def _require_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")


def _sections(mrope_section) -> list[int] | None:
    """``mrope_section`` as the op takes it (a list of ints), or None."""
    if mrope_section is None:
        return None
    if isinstance(mrope_section, Tensor) or not all(type(v) is int for v in mrope_section):
        raise TypeError(f"mrope_section must be a sequence of ints, got {mrope_section!r}")
    return list(mrope_section)


# How several position axes share a head's pairs (the ops' ``mrope_interleaved``), by name: contiguous
# sections (Qwen2-VL), interleaved (Qwen3-VL), alternating (ERNIE-4.5-VL; reference.mrope_rows).
AXIS_LAYOUTS = {"contiguous": 0, "interleaved": 1, "alternating": 2}


def axis_layout(value) -> bool | int:
    """``mrope_interleaved`` as the op takes it: a bool, or an int of 0-2, as given; None as False; a layout
    name as its code (:data:`AXIS_LAYOUTS`)."""
    if type(value) is bool:
        return value
    if type(value) is int:
        if not 0 <= value <= 2:
            raise ValueError(
                "mrope_interleaved must be False (contiguous sections), True (interleaved, Qwen3-VL) or 2 "
                f"(alternating, ERNIE-4.5-VL), got {value}"
            )
        return value
    if value is None:
        return False
    if isinstance(value, str):
        if value not in AXIS_LAYOUTS:
            raise ValueError(
                f"mrope_interleaved must be a bool or one of {sorted(AXIS_LAYOUTS)}, got {value!r}"
            )
        return AXIS_LAYOUTS[value]
    raise TypeError(
        f"mrope_interleaved must be a bool or one of {sorted(AXIS_LAYOUTS)}, got {type(value).__name__}"
    )


def _host_check(t: Tensor) -> bool:
    """Whether an eager check of device tensor ``t`` may synchronise: not on the CPU (the ops check there),
    not while compiling, not while the current CUDA stream is capturing a graph (a synchronisation would
    invalidate the capture; the graph's replays run unchecked, as compiled graphs do)."""
    if t.device.type == "cpu" or _is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _positions_in_range(positions: Tensor, cos_sin: Tensor) -> None:
    """Eager CUDA calls with position checks on (:func:`set_position_checks`; the callers test it) check
    positions on the host."""
    if positions.numel() > 0 and _host_check(positions) and cos_sin.dim() == 1:
        # Frequencies: any position that gives an angle (as the CPU kernels check).
        p = positions.double()
        if not bool((p.abs() <= 2.0**53).all()):
            bad = p[~(p.abs() <= 2.0**53)][0].item()
            raise ValueError(f"positions must give finite angles with the frequencies, got {bad}")
    elif positions.numel() > 0 and _host_check(positions):
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin.shape[0]:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"positions must be in [0, cos_sin.shape[0]) = [0, {cos_sin.shape[0]}), got {bad}"
            )


def _shifts_in_range(delta: Tensor, cos_sin: Tensor) -> None:
    """As :func:`_positions_in_range`, for the shifts of ``rerotate_kv_cache_`` (``|delta|`` a table row)."""
    if cos_sin.dim() == 1:
        _positions_in_range(delta, cos_sin)  # frequencies: any shift that gives an angle
    elif delta.numel() > 0 and not delta.is_floating_point() and _host_check(delta):
        lo, hi = int(delta.min()), int(delta.max())
        n = cos_sin.shape[0]
        if lo <= -n or hi >= n:
            bad = lo if lo <= -n else hi
            raise IndexError(
                f"delta must be in (-cos_sin.shape[0], cos_sin.shape[0]) = (-{n}, {n}), got {bad}"
            )


def _slots_in_range(slot_mapping: Tensor, n: int | None) -> None:
    """With position checks on (the caller tests it), eager CUDA calls check slots too; ``n``: the
    cache's slots (None when its shape is wrong, which the op reports)."""
    if slot_mapping.numel() > 0 and n is not None and _host_check(slot_mapping):
        bad = (slot_mapping < -1) | (slot_mapping >= n)
        if bool(bad.any()):
            value = int(slot_mapping[bad][0])
            raise IndexError(
                f"slot_mapping must hold -1 or slots in [0, num_blocks * block_size) = [0, {n}), got {value}"
            )
        # Two tokens with one slot would write one cache row from two blocks (as the CPU op refuses).
        slots = slot_mapping[slot_mapping >= 0].sort().values
        twice = slots[1:] == slots[:-1]
        if bool(twice.any()):
            value = int(slots[1:][twice][0])
            raise ValueError(
                f"slot_mapping holds slot {value} twice; each token's k and v need a slot of their own"
            )


class PageTable(NamedTuple):
    """FlashInfer's page table (``append_paged_kv_cache``'s arguments), for the cache ops' ``page_table``.

    Token t is entry ``positions[t]`` of request ``b = batch_indices[t]`` (-1: not written): row
    ``positions[t] % block_size`` of page ``kv_indices[kv_indptr[b] + positions[t] // block_size]``.
    With ``kv_last_page_len`` the request's length is ``max(pages - 1, 0) * block_size +
    kv_last_page_len[b]`` and an entry past it is refused like a slot outside the cache. int32 or int64
    1-d tensors on q's device: ``batch_indices``, ``positions`` ``[T']`` (``T' <= T``: the tokens past
    them are rotated, not written), ``kv_indices`` (the pages, request after request), ``kv_indptr``
    ``[batch_size + 1]``, ``kv_last_page_len`` ``[batch_size]`` or None.
    """

    batch_indices: Tensor
    positions: Tensor
    kv_indices: Tensor
    kv_indptr: Tensor
    kv_last_page_len: Tensor | None = None


def page_table(value) -> tuple[Tensor, ...] | None:
    """A cache op's ``page_table`` as the op takes it: its tensors (no ``kv_last_page_len`` when None),
    or None. ``TypeError`` names the entry that is not a tensor."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) not in (4, 5):
        raise ValueError(
            "page_table must be (batch_indices, positions, kv_indices, kv_indptr[, kv_last_page_len]) "
            f"(rope_ext.PageTable), got {type(value).__name__}"
            + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
        )
    tensors = tuple(value)
    if len(tensors) == 5 and tensors[4] is None:
        tensors = tensors[:4]
    for name, t in zip(PageTable._fields, tensors, strict=False):
        if not isinstance(t, Tensor):
            raise TypeError(f"page_table's {name} must be a torch.Tensor, got {type(t).__name__}")
    return tensors


def _slots_given(a, cache_slots: tuple[int, int] | None) -> None:
    """A cache op places its tokens by slot_mapping or by page_table, one of them; with position checks on
    (the caller tests it), eager CUDA calls check either on the host as the CPU op does. ``cache_slots``:
    the cache's (num_blocks, block_size), None when its shape is wrong (the op reports it)."""
    if a.page_table is not None and a.slot_mapping is not None:
        raise ValueError("slot_mapping must be None when page_table is given (one of them places the tokens)")
    if a.page_table is None and a.slot_mapping is None:
        raise TypeError("slot_mapping must be a tensor, got None (or pass page_table)")
    if not position_checks.on_device or cache_slots is None:
        return
    if a.slot_mapping is not None:
        _slots_in_range(a.slot_mapping, cache_slots[0] * cache_slots[1])
    elif _host_check(a.page_table[0]):
        tables = [t.cpu() for t in a.page_table]
        torch.ops.rope_ext._page_table_slots(tables, cache_slots[1], cache_slots[0])


def _no_grad_wanted(op: str, **tensors: Tensor | None) -> None:
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and names:
        raise RuntimeError(
            f"{', '.join(names)} requires grad, but {op} is an inference op and records no gradient; call "
            "it under torch.no_grad() (or use apply_rotary_qk for training)"
        )


def split_qkv(qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int) -> tuple[Tensor, Tensor]:
    """Views ``q [T, Hq, D]``, ``k [T, Hk, D]`` of a packed ``qkv [T, (Hq+Hk+Hv)*D]``."""
    require_tensor("qkv", qkv)
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


# ---------------------------------------------------------------------------------------------
# The checks of each op, after its tensor arguments' types (``specs.OpSpec.check``). Each takes the op's
# arguments by name (a named tuple in schema order) and returns them as the op takes them.


def rotary_args(a):
    """``rotary``, ``rotary_qk``, ``rotary_qk_``."""
    _require_offset(a.rotary_offset)
    if a.mrope_section is not None or type(a.mrope_interleaved) is not bool:
        a = a._replace(
            mrope_section=_sections(a.mrope_section), mrope_interleaved=axis_layout(a.mrope_interleaved)
        )
    if position_checks.on_device:
        _positions_in_range(a.positions, a.cos_sin)
    return a


def cache_args(a):
    """``rotary_qk_cache_`` (``apply_rotary_qk_and_cache_``)."""
    _require_offset(a.rotary_offset)
    if not isinstance(a.layout, str):
        raise TypeError(f"layout must be 'NHD' or 'HND', got {type(a.layout).__name__}")
    if a.mrope_section is not None or type(a.mrope_interleaved) is not bool:
        a = a._replace(
            mrope_section=_sections(a.mrope_section), mrope_interleaved=axis_layout(a.mrope_interleaved)
        )
    _no_grad_wanted(
        "apply_rotary_qk_and_cache_",
        q=a.q, k=a.k, v=a.v, q_out=a.q_out, key_cache=a.key_cache, value_cache=a.value_cache,
    )  # fmt: skip
    a = a._replace(page_table=page_table(a.page_table))
    c = a.key_cache
    _slots_given(a, (c.shape[0], c.shape[1 if a.layout == "NHD" else 2]) if c.dim() == 4 else None)
    if position_checks.on_device:
        _positions_in_range(a.positions, a.cos_sin)
    return a


def mla_args(a):
    """``mla_rotary_cache_`` (``apply_mla_rotary_and_cache_``)."""
    _require_offset(a.rotary_offset)
    grads = dict(q=a.q, kv_c=a.kv_c, k_pe=a.k_pe, q_out=a.q_out, kv_cache=a.kv_cache)
    _no_grad_wanted("apply_mla_rotary_and_cache_", **grads)
    a = a._replace(page_table=page_table(a.page_table))
    c = a.kv_cache
    _slots_given(a, (c.shape[0], c.shape[1]) if c.dim() == 3 else None)
    if position_checks.on_device:
        _positions_in_range(a.positions, a.cos_sin)
    return a


def rerotate_args(a):
    """``rerotate_kv_cache_`` (``delta`` a tensor already: :func:`shift_tensor`)."""
    _require_offset(a.rotary_offset)
    if not isinstance(a.layout, str):
        raise TypeError(f"layout must be 'NHD' or 'HND', got {type(a.layout).__name__}")
    _no_grad_wanted("rerotate_kv_cache_", key_cache=a.key_cache)
    if position_checks.on_device:
        c = a.key_cache
        n = c.shape[0] * c.shape[1 if a.layout == "NHD" else 2] if c.dim() == 4 else None
        _slots_in_range(a.slot_mapping, n)
        _shifts_in_range(a.delta, a.cos_sin)
    return a


def shift_tensor(delta, key_cache):
    """``rerotate_kv_cache_``'s delta: an int becomes a one-element int64 tensor on the cache's device."""
    if type(delta) is not int:
        return delta
    if not -(2**63) <= delta < 2**63:
        raise IndexError(f"delta must be in (-cos_sin.shape[0], cos_sin.shape[0]), got {delta}")
    return torch.tensor([delta], device=key_cache.device if isinstance(key_cache, Tensor) else None)


def qk_norm_args(a):
    """``qk_norm_rotary`` and ``qk_norm_rotary_`` (``apply_qk_norm_rotary``)."""
    _require_offset(a.rotary_offset)
    _require_float("eps", a.eps)
    _require_float("weight_offset", a.weight_offset)
    if not (
        type(a.eps) is type(a.weight_offset) is float
        and a.mrope_section is None
        and type(a.mrope_interleaved) is bool
    ):
        a = a._replace(
            eps=float(a.eps),
            weight_offset=float(a.weight_offset),
            mrope_section=_sections(a.mrope_section),
            mrope_interleaved=axis_layout(a.mrope_interleaved),
        )
    if position_checks.on_device:
        _positions_in_range(a.positions, a.cos_sin)
    return a


def qk_norm_packed_args(a):
    """``qk_norm_rotary_packed_`` (``apply_qk_norm_rotary_``): the head counts split qkv, which has no
    overlapping elements (it is written in place), then as :func:`qk_norm_args`."""
    split_qkv(a.qkv, a.num_heads_q, a.num_heads_k, a.num_heads_v)
    if not _is_compiling() and torch._debug_has_internal_overlap(a.qkv) == 1:
        raise ValueError(
            "qkv has elements that overlap in memory (expanded or stride-0 view, strides "
            f"{list(a.qkv.stride())}); it is written in place"
        )
    return qk_norm_args(a)

"""Fake kernels of the ops (shapes only) for torch.compile, FakeTensor and the meta device.

Each checks what the real kernels check without reading values (shapes, dtypes, devices; the same
exception types) and returns outputs of the shapes the kernels allocate. One per op, registered for every
overload of it (:func:`fake_kernel`): a short overload's omitted options read as their defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .checks import FP8_DTYPES, MAX_AXES, PageTable, split_qkv
from .positions import positions_shape
from .specs import (
    CACHE,
    MLA_CACHE,
    QK_NORM,
    QK_NORM_,
    QK_NORM_PACKED_,
    REROTATE,
    ROTARY,
    ROTARY_QK,
    ROTARY_QK_,
    OpSpec,
)

__all__ = ["empty_output", "fake_kernel"]


def fake_kernel(spec: OpSpec) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Registers the decorated function, which takes the arguments by name (``spec.Args``), as the fake
    kernel of every overload of ``spec``."""

    def register(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def fake_of(overload):
            def fake(*args, **kwargs):
                return fn(spec.bind(args, kwargs, overload))

            return fake

        for overload in spec.overloads:
            torch.library.register_fake(overload, fake_of(overload))
        return fn

    return register


def empty_output(x: Tensor) -> Tensor:
    """The output the kernels allocate: ``empty_like(x)``, row-major if that leaves the last dim strided."""
    out = torch.empty_like(x)
    if out.dim() > 0 and out.shape[-1] > 1 and out.stride(-1) != 1:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out


def _rotated(x: Tensor, positions: Tensor, a: Any, name: str, token_major: bool = False) -> None:
    """The checks of a rotated tensor ``x`` with ``positions`` (of section 0) and the call's ``a.cos_sin``
    and ``a.rotary_offset``."""
    cos_sin = a.cos_sin
    for arg, t in ((name, x), ("positions", positions), ("cos_sin", cos_sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{arg} must be a tensor, got {type(t).__name__}")
    # Mixed devices that include "meta" dispatch here rather than to a real kernel: reject them
    # as the real kernels do (else the call would return garbage or skip an in-place rotation).
    for arg, t in (("positions", positions), ("cos_sin", cos_sin)):
        if t.device != x.device:
            raise ValueError(f"{arg} must be on the device of {name} ({x.device}), got {t.device}")
    torch._check(
        cos_sin.dim() in (1, 2),
        lambda: "cos_sin must have shape [positions, rotary_dim] (a table) or [rotary_dim] (frequencies)",
    )
    if positions.is_floating_point() and cos_sin.dim() != 1:
        raise TypeError(
            "positions must be an int32 or int64 tensor with a cos_sin table (float positions need "
            f"frequencies, cos_sin [rotary_dim]), got {positions.dtype}"
        )
    torch._check(cos_sin.shape[-1] <= x.shape[-1], lambda: "rotary_dim must be <= head_dim")
    positions_shape(positions.shape, x.shape[:-1], name, token_major)
    if not 0 <= a.rotary_offset <= x.shape[-1] - cos_sin.shape[-1]:
        raise ValueError(
            f"rotary_offset must be in [0, head_dim - rotary_dim] = [0, {x.shape[-1] - cos_sin.shape[-1]}], "
            f"got {a.rotary_offset}"
        )


def _on_device_of(q: Tensor, name: str, t: Any) -> None:
    """Raises ``ValueError`` unless ``t`` (a tensor, or None) is on q's device (as the real kernels do)."""
    if t is not None and t.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")


def _rotated_qk(a: Any, q: Tensor, k: Tensor | None, token_major: bool = False) -> Tensor:
    """The checks of q and k (``None``: no k), rotated by the same positions; returns the positions of
    section 0."""
    positions = _section_positions(a)
    _rotated(q, positions, a, "q", token_major)
    if k is not None:
        if not isinstance(k, Tensor):
            raise TypeError(f"k must be a tensor, got {type(k).__name__}")
        _on_device_of(q, "k", k)
        _rotated(k, positions, a, "k", token_major)
    return positions


def _section_positions(a: Any) -> Tensor:
    """The kernels' MRoPE checks; returns the positions of section 0 (what broadcasts to x)."""
    positions, mrope_section = a.positions, a.mrope_section
    if mrope_section is None:
        if a.mrope_interleaved:
            raise ValueError("mrope_interleaved needs mrope_section")
        return positions
    half = a.cos_sin.shape[-1] // 2
    n = len(mrope_section)
    if not 1 <= n <= MAX_AXES or min(mrope_section) < 0 or sum(mrope_section) != half:
        raise ValueError(
            f"mrope_section must be 1 to {MAX_AXES} non-negative ints (pairs per position axis, e.g. "
            f"temporal, height, width) summing to rotary_dim / 2 = {half}, got {list(mrope_section)}"
        )
    if positions.dim() < 1 or positions.shape[0] != n:
        raise ValueError(
            f"positions must have a leading axis dim of size len(mrope_section) = {n} ([{n}, ...]) with "
            f"mrope_section, got shape {list(positions.shape)}"
        )
    return positions[0]


@fake_kernel(ROTARY)
def _rotary(a):
    _rotated(a.x, _section_positions(a), a, "x")
    return empty_output(a.x)


@fake_kernel(ROTARY_QK)
def _rotary_qk(a):
    _rotated_qk(a, a.q, a.k)
    return empty_output(a.q), empty_output(a.k)


@fake_kernel(ROTARY_QK_)
def _rotary_qk_inplace(a):
    _rotated_qk(a, a.q, a.k)


# ---------------------------------------------------------------------------------------------
# Serving ops: token-major q [T, Hq, D], k [T, Hk, D], one position per token.


def _three_d(x: Any, name: str, shape: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be {shape}, got shape {list(x.shape)}")


def _serving_qk(a: Any, q: Tensor, k: Tensor) -> None:
    """The checks of the serving ops' q and k (3-d), and that positions hold one position per token of q."""
    _one_per_token(_rotated_qk(a, q, k, token_major=True), q)


def _one_per_token(positions: Tensor, q: Tensor) -> None:
    shape = positions_shape(positions.shape, q.shape[:-1], "q", token_major=True)
    T = q.shape[0]
    # as the kernels' check: one token takes any positions that broadcast, [1] included
    per_token = T <= 1 or (len(shape) == 2 and shape[-1] == 1 and shape[0] == T)
    expanded = len(shape) == 2 and shape[0] != 1 and positions.stride(0) == 0
    if not per_token or expanded:
        raise ValueError(
            f"positions must hold one position per token of q ({T} tokens) with a nonzero stride: [T] "
            "(or [n_axes, T] with mrope_section)"
        )


def _slots(a, q: Tensor) -> None:
    """A cache write's slot_mapping, or its page_table (one of them)."""
    if a.page_table is not None:
        if a.slot_mapping is not None:
            raise ValueError("slot_mapping must be None when page_table is given (one of them places tokens)")
        if len(a.page_table) not in (4, 5):
            raise ValueError(f"page_table must hold 4 or 5 tensors, got {len(a.page_table)}")
        for name, t in zip(PageTable._fields, a.page_table, strict=False):
            if t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"page_table's {name} must be an int32 or int64 tensor, got {t.dtype}")
            torch._check(t.dim() == 1, lambda name=name: f"page_table's {name} must be 1-d")
            _on_device_of(q, f"page_table's {name}", t)
        return
    if not isinstance(a.slot_mapping, Tensor):
        raise TypeError("slot_mapping must be a tensor, got None (or pass page_table)")
    _on_device_of(q, "slot_mapping", a.slot_mapping)
    torch._check(a.slot_mapping.dim() == 1, lambda: "slot_mapping must be [T']")
    if a.slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be an int64 tensor, got {a.slot_mapping.dtype}")


@fake_kernel(CACHE)
def _rotary_qk_cache(a):
    q, k, v = a.q, a.k, a.v
    _three_d(q, "q", "[T, Hq, D]")
    _three_d(k, "k", "[T, Hk, D]")
    _three_d(v, "v", "[T, Hk, Dv]")
    _serving_qk(a, q, k)
    for name in ("v", "key_cache", "value_cache", "k_scale", "v_scale", "q_out", "q_scale"):
        _on_device_of(q, name, getattr(a, name))
    if a.layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got '{a.layout}'")
    key_cache, value_cache = a.key_cache, a.value_cache
    torch._check(k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0], lambda: "q, k, v: same T")
    torch._check(key_cache.dim() == 4 and value_cache.dim() == 4, lambda: "caches must be 4-d")
    _slots(a, q)
    if key_cache.dtype not in (q.dtype, *FP8_DTYPES):
        raise TypeError(
            f"key_cache must have the dtype of q ({q.dtype}) or be float8_e4m3fn / float8_e5m2, "
            f"got {key_cache.dtype}"
        )


@fake_kernel(MLA_CACHE)
def _mla_rotary_cache(a):
    q, kv_c, k_pe, kv_cache = a.q, a.kv_c, a.k_pe, a.kv_cache
    _three_d(q, "q", "[T, H, D]")
    for name in ("kv_c", "k_pe", "kv_cache"):
        t = getattr(a, name)
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    _rotated(q, a.positions, a, "q", token_major=True)
    _one_per_token(a.positions, q)
    for name in ("kv_c", "k_pe", "kv_cache", "kv_scale", "q_out", "q_scale"):
        _on_device_of(q, name, getattr(a, name))
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
    if kv_c.dim() != 2:
        raise ValueError(f"kv_c must be [T, kv_lora_rank], got shape {list(kv_c.shape)}")
    if not (k_pe.dim() == 2 or (k_pe.dim() == 3 and k_pe.shape[1] == 1)):
        raise ValueError(f"k_pe must be [T, rotary_dim] or [T, 1, rotary_dim], got shape {list(k_pe.shape)}")
    if kv_cache.dim() != 3:
        raise ValueError(
            "kv_cache must be [num_blocks, block_size, kv_lora_rank + rotary_dim], got shape "
            f"{list(kv_cache.shape)}"
        )
    T = q.shape[0]
    torch._check(kv_c.shape[0] == T and k_pe.shape[0] == T, lambda: "q, kv_c, k_pe: same T")
    torch._check(k_pe.shape[-1] == a.cos_sin.shape[-1], lambda: "k_pe.shape[-1] must be rotary_dim")
    torch._check(kv_cache.shape[-1] == kv_c.shape[-1] + k_pe.shape[-1], lambda: "kv_cache.shape[-1]")
    _slots(a, q)
    if kv_cache.dtype not in (q.dtype, *FP8_DTYPES):
        raise TypeError(
            f"kv_cache must have the dtype of q ({q.dtype}) or be float8_e4m3fn / float8_e5m2, "
            f"got {kv_cache.dtype}"
        )


@fake_kernel(REROTATE)
def _rerotate_kv_cache(a):
    cache, cos_sin = a.key_cache, a.cos_sin
    for name in ("key_cache", "slot_mapping", "delta", "cos_sin"):
        t = getattr(a, name)
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    for name in ("slot_mapping", "delta", "cos_sin", "k_scale"):
        t = getattr(a, name)
        if t is not None and t.device != cache.device:
            raise ValueError(f"{name} must be on the device of key_cache ({cache.device}), got {t.device}")
    if a.layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got '{a.layout}'")
    if cache.dim() != 4:
        raise ValueError(f"key_cache must be 4-d, got shape {list(cache.shape)}")
    if a.slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be an int64 tensor, got {a.slot_mapping.dtype}")
    floats = (torch.float32, torch.float64) if cos_sin.dim() == 1 else ()
    if a.delta.dtype not in (torch.int32, torch.int64, *floats):
        kinds = "int32 or int64 tensor (float32 or float64 with frequencies)"
        raise TypeError(f"delta must be an {kinds}, got {a.delta.dtype}")
    torch._check(a.slot_mapping.dim() == 1, lambda: "slot_mapping must be [T]")
    torch._check(
        cos_sin.dim() in (1, 2),
        lambda: "cos_sin must have shape [positions, rotary_dim] (a table) or [rotary_dim] (frequencies)",
    )
    rd, d = cos_sin.shape[-1], cache.shape[-1]
    torch._check(rd <= d, lambda: "rotary_dim must be <= head_dim")
    if not 0 <= a.rotary_offset <= d - rd:
        raise ValueError(
            f"rotary_offset must be in [0, head_dim - rotary_dim] = [0, {d - rd}], got {a.rotary_offset}"
        )


def _qk_norm(a: Any, q: Tensor, k: Tensor) -> None:
    _three_d(q, "q", "[T, Hq, D]")
    _three_d(k, "k", "[T, Hk, D]")
    _serving_qk(a, q, k)
    torch._check(q.shape[-1] <= 512, lambda: "head_dim must be at most 512 for the fused QK norm")
    for name in ("q_weight", "k_weight"):
        w = getattr(a, name)
        _on_device_of(q, name, w)
        torch._check(w.dim() == 1 and w.shape[0] == q.shape[-1], lambda name=name: f"{name} must be [D]")


@fake_kernel(QK_NORM)
def _qk_norm_rotary(a):
    _qk_norm(a, a.q, a.k)
    return empty_output(a.q), empty_output(a.k)


@fake_kernel(QK_NORM_)
def _qk_norm_rotary_inplace(a):
    _qk_norm(a, a.q, a.k)


@fake_kernel(QK_NORM_PACKED_)
def _qk_norm_rotary_packed(a):
    _qk_norm(a, *split_qkv(a.qkv, a.num_heads_q, a.num_heads_k, a.num_heads_v))


@torch.library.register_fake("rope_ext::_angle_rows")
def _angle_rows(positions: Tensor, freqs: Tensor) -> Tensor:
    """The rows of the table-free mode and of every table (``cache.cos_sin_rows``)."""
    torch._check(positions.dim() == 1, lambda: "positions must have shape [n]")
    torch._check(freqs.dim() == 1 and freqs.shape[0] % 2 == 0, lambda: "freqs must have shape [rotary_dim]")
    torch._check(freqs.dtype == torch.float64, lambda: "freqs must be float64")
    return positions.new_empty((positions.shape[0], freqs.shape[0]), dtype=torch.float64)

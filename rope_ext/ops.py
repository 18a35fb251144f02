"""Python API of the rotary ops: ``apply_rotary``, ``apply_rotary_qk``, ``apply_rotary_qk_``.

Shapes: ``x``, ``q``, ``k`` are ``[..., head_dim]`` (float32, float64, float16 or bfloat16) with a
contiguous last dim and any other strides; ``positions`` is int32/int64, broadcastable to
``x.shape[:-1]``; ``cos_sin`` is ``[P, rotary_dim]`` (cos half then sin half, float32 or x's dtype), or
float64 frequencies ``[rotary_dim]`` (:func:`rope_ext.frequencies`: each token's cos/sin computed in the op;
positions may then be float32/float64).
Arithmetic is float32 (float64 for float64 inputs); outputs have x's dtype.

Each function builds its op's arguments once, in schema order, and hands them to the op's description
(:mod:`rope_ext.specs`): its checks, then the call through the overload its options select.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from . import fakes as _fakes  # noqa: F401  (registers the fake kernels)
from ._inplace import check_inplace_allowed, refuse_dual_tensors
from .autograd import record_rotation
from .checks import position_checks, set_position_checks, typed_errors
from .specs import ROTARY, ROTARY_QK, ROTARY_QK_

__all__ = ["apply_rotary", "apply_rotary_qk", "apply_rotary_qk_", "set_position_checks"]

_ops = torch.ops.rope_ext
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

# Instruction sets of the CPU kernel, lowest first within each architecture (csrc/rope/cpu/cpu.h).
CPU_ISAS = ("scalar", "avx2", "avx512", "avx512_bf16", "neon")
_isa_env = os.environ.get("ROPE_EXT_CPU_ISA")
if _isa_env and _isa_env not in CPU_ISAS:
    raise ValueError(f"ROPE_EXT_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {_isa_env!r}")
# The CPU kernel's software prefetch distance in bytes: at most 1 MiB (cpu.h, kMaxPrefetch).
CPU_MAX_PREFETCH = 1 << 20
_prefetch_env = os.environ.get("ROPE_EXT_CPU_PREFETCH")
if _prefetch_env and not (
    _prefetch_env.isascii() and _prefetch_env.isdigit() and int(_prefetch_env) <= CPU_MAX_PREFETCH
):
    raise ValueError(
        f"ROPE_EXT_CPU_PREFETCH must be a number of bytes from 0 to {CPU_MAX_PREFETCH}, got {_prefetch_env!r}"
    )
# The cache level its hints fill: 1 (L1, prefetcht0) or 2 (L2, prefetcht1).
_level_env = os.environ.get("ROPE_EXT_CPU_PREFETCH_LEVEL")
if _level_env and _level_env not in ("1", "2"):
    raise ValueError(f"ROPE_EXT_CPU_PREFETCH_LEVEL must be 1 or 2, got {_level_env!r}")


def _cpu_isa() -> str:
    """The CPU kernel's instruction set in this process: one of ``CPU_ISAS``.

    The best set this CPU supports, chosen at the first CPU call; the environment variable
    ``ROPE_EXT_CPU_ISA`` caps it (the best supported set no higher than the one named, in the
    order scalar < avx2 = neon < avx512 < avx512_bf16).
    """
    return str(_ops._cpu_isa())


def _set_cpu_isa(name: str) -> str:
    """Use the CPU instruction set ``name`` for calls that start from now on; returns the previous one.

    For tests and benchmarks that compare the sets in one process. Raises ``ValueError`` when
    ``name`` is not one of ``CPU_ISAS`` or this CPU does not run it.
    """
    if name not in CPU_ISAS:
        raise ValueError(f"name must be one of {', '.join(CPU_ISAS)}, got {name!r}")
    previous = _cpu_isa()
    if not _ops._set_cpu_isa(name):
        raise ValueError(f"this CPU does not run the {name} kernel (cpu ISA in use: {previous})")
    return previous


def _cpu_prefetch() -> int:
    """The CPU kernel's software prefetch distance in bytes (0: none).

    Before each head is rotated or normalised, the head that many bytes further on in the loop's order
    is hinted into the cache level :func:`_cpu_prefetch_level`. Set at the first CPU call:
    ``ROPE_EXT_CPU_PREFETCH`` when given, else 2048 on Intel CPUs, 8192 on AMD CPUs from family 19h
    (Zen 3 on) and 0 on others (benchmarks/cpu-serving.md, benchmarks/cpu-zen4.md).
    """
    return int(_ops._cpu_prefetch())


def _cpu_prefetch_level() -> int:
    """The cache level the CPU kernel's prefetch hints fill: 1 (L1) or 2 (L2).

    Set at the first CPU call: ``ROPE_EXT_CPU_PREFETCH_LEVEL`` when given, else 2 on AMD CPUs from
    family 19h and 1 on others.
    """
    return int(_ops._cpu_prefetch_level())


def _set_cpu_prefetch_level(level: int) -> int:
    """Make the prefetch hints of calls that start from now on fill cache level ``level`` (1 or 2);
    returns the previous level. For tests and benchmarks; results do not depend on it."""
    if type(level) is not int or level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level!r}")
    previous = _cpu_prefetch_level()
    if not _ops._set_cpu_prefetch_level(level):
        raise ValueError(f"the CPU kernel refused the prefetch level {level}")
    return previous


def _set_cpu_prefetch(bytes_ahead: int) -> int:
    """Use the prefetch distance ``bytes_ahead`` for calls that start from now on; returns the previous one.

    For tests and benchmarks. Raises ``ValueError`` outside ``[0, CPU_MAX_PREFETCH]``; results do not
    depend on it.
    """
    if type(bytes_ahead) is not int or not 0 <= bytes_ahead <= CPU_MAX_PREFETCH:
        raise ValueError(f"bytes_ahead must be an int from 0 to {CPU_MAX_PREFETCH}, got {bytes_ahead!r}")
    previous = _cpu_prefetch()
    if not _ops._set_cpu_prefetch(bytes_ahead):
        raise ValueError(f"the CPU kernel refused the prefetch distance {bytes_ahead}")
    return previous


def _int_list(v) -> bool:
    """Whether ``v`` is a tuple or list of ints (an ``mrope_section`` the op takes as it is)."""
    return type(v) in (tuple, list) and all(type(x) is int for x in v)


@typed_errors
def apply_rotary(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | str = False,
) -> Tensor:
    """Rotate ``x [..., head_dim]`` by the angles of ``cos_sin[positions]``; returns a new tensor.

    ``positions`` broadcasts to ``x.shape[:-1]``: ``[T, 1]`` for ``[T, H, D]``; ``[B, S, 1]`` or
    ``[S, 1]`` for BSHD; ``[B, 1, S]`` for BHSD; ``[S, 1, 1]`` for ``[S, B, H, D]``. Features
    ``[rotary_offset, rotary_offset + rotary_dim)`` (``rotary_dim = cos_sin.shape[-1]``) are rotated, all
    others copied unchanged: ``rotary_offset = head_dim - rotary_dim`` serves heads laid out
    ``[nope | rope]`` (MLA) without slicing. ``interleaved`` pairs ``(2j, 2j+1)`` instead of
    ``(j, j + rotary_dim/2)``, counted from ``rotary_offset``; ``inverse`` rotates by the negative angle.

    MRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): with ``mrope_section=(t, h, w)`` (``t + h + w ==
    rotary_dim / 2``), ``positions`` is ``[3, ...]`` (temporal, height, width; the rest broadcasts to
    ``x.shape[:-1]``) and pair ``j`` takes the position of its section: ``positions[0]`` for ``j < t``,
    ``positions[1]`` for ``t <= j < t + h``, ``positions[2]`` after; with ``mrope_interleaved=True``
    (Qwen3-VL) pair ``j`` takes ``positions[1]`` when ``j % 3 == 1 and j < 3 h``, ``positions[2]`` when
    ``j % 3 == 2 and j < 3 w``, else ``positions[0]``; with ``mrope_interleaved="alternating"``
    (ERNIE-4.5-VL, ``h == w``) pair ``j`` takes ``positions[1]`` for even ``j < 2 h``, ``positions[2]`` for
    odd ``j < 2 h``, else ``positions[0]``. Any number of axes (1 to 8; 2-D vision, 3-D video):
    ``mrope_section`` holds the pairs of each, ``positions`` is ``[len(mrope_section), ...]``; contiguous
    sections are runs of pairs in axis order, interleaved ones (``n`` axes) put pair ``j`` on axis
    ``j % n`` while ``j < n * mrope_section[j % n]``, else on axis 0, alternating ones on axis
    ``1 + j % (n - 1)`` while ``j < (n - 1) * mrope_section[1]``, else on axis 0 (``reference.mrope_rows``).
    ``mrope_interleaved`` is a bool, a layout name (``"contiguous"``, ``"interleaved"``, ``"alternating"``)
    or the op's code for it (0, 1, 2).
    Differentiable in ``x`` (the gradient is the inverse rotation); ``positions`` and ``cos_sin``
    get no gradient.
    """
    options = (interleaved, inverse, rotary_offset, mrope_section, mrope_interleaved)
    return ROTARY.call(ROTARY.check((x, positions, cos_sin), options))


@typed_errors
def apply_rotary_qk(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | str = False,
) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` (same rank and head_dim, head counts may differ) in one launch.

    ``positions`` broadcasts to both ``q.shape[:-1]`` and ``k.shape[:-1]``. Equal to two
    :func:`apply_rotary` calls (``inverse`` as there); differentiable in ``q`` and ``k``.
    """
    options = (interleaved, inverse, rotary_offset, mrope_section, mrope_interleaved)
    return ROTARY_QK.call(ROTARY_QK.check((q, k, positions, cos_sin), options))


def apply_rotary_qk_(
    q: Tensor,
    k: Tensor | None,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool | str = False,
) -> None:
    """Rotate ``q`` and ``k`` in place (``k`` may be None); no allocation, CUDA-graph safe. ``inverse``
    rotates by the negative angle (DeepSeek-V4-style output rotation; :func:`apply_rotary`).

    Every argument is checked before anything is written: on error q and k are unchanged.
    q and k must not overlap in memory, nor have elements that alias each other (expanded views).
    Differentiable like any in-place op: when q or k requires grad, autograd records the rotation (its
    backward is the inverse rotation of the incoming gradient), also for views of a packed QKV tensor and
    under ``torch.compile``. What autograd refuses for an in-place op (a leaf that requires grad or a view
    of one; an output of unbind, split or chunk; a view made under no_grad or inference_mode) raises
    PyTorch's usual error before anything is written; a dual tensor, ``NotImplementedError`` (no
    forward-mode AD).
    """
    inputs = (q, k, positions, cos_sin)
    options = (interleaved, inverse, rotary_offset, mrope_section, mrope_interleaved)
    if (
        type(q) is type(positions) is type(cos_sin) is Tensor
        and (k is None or type(k) is Tensor)
        and not (_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)))
        and type(rotary_offset) is int
        and (mrope_section is None or _int_list(mrope_section))
        and type(mrope_interleaved) in (bool, int)
        and not position_checks.on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): arguments of the types the checks let through go straight
        # to the op, which checks everything else; when it rejects them, reject() runs the checks first, so
        # that both paths raise alike.
        try:
            ROTARY_QK_.eager(inputs, options)
        except Exception as e:
            ROTARY_QK_.reject(inputs, options, e)
        return
    _rotary_qk_inplace_checked(inputs, options)


def _rotation(a) -> tuple:
    """The arguments of a call ``a`` of the rotary family (by name) after its tensors: positions, cos_sin
    and the options, the same for ``rotary``, ``rotary_qk`` and ``rotary_qk_``."""
    return a[a._fields.index("positions") :]


@typed_errors
def _rotary_qk_inplace_checked(inputs: tuple, options: tuple) -> None:
    """``apply_rotary_qk_`` past the eager fast path: every check, autograd and ``torch.compile``."""
    a = ROTARY_QK_.check(inputs, options)
    q, k = a.q, a.k
    if not (q.requires_grad or (k is not None and k.requires_grad)) or not torch.is_grad_enabled():
        _rotate_in_place(a)
        return
    targets = [t for t in (q, k) if t is not None]
    for t in targets:
        check_inplace_allowed(t)
    if _is_compiling():
        # Traced: the differentiable functional op and copy_ (AOTAutograd reinplaces where it can).
        _copy_rotated(a)
        return
    refuse_dual_tensors(targets, "apply_rotary_qk_")
    # One launch rotates both (every check before the first write), on aliases autograd does not see;
    # then each tensor gets the rotation's node in its history, as an in-place op would.
    with torch.no_grad():
        _rotate_in_place(a._replace(q=q.detach(), k=None if k is None else k.detach()))
    for t in targets:
        if t.requires_grad:
            record_rotation(t, ROTARY_QK_, a)


def _rotate_in_place(a) -> None:
    """``rotary_qk_`` (the call ``a``, by name); under ``torch.compile``, views go through the functional op
    and ``copy_``.

    Inductor (torch 2.14.1, ``dynamic=True``) hands a custom op's mutated view argument to the kernel with
    its storage offset dropped, so ``rotary_qk_(qkv[:, :, 1], ...)`` would rotate ``qkv[:, :, 0]``
    (tests/test_compile_views.py has the case and a minimal reproduction without rope_ext). The
    functional op plus ``copy_`` into the view is traced correctly. On that path q and k that overlap
    are not detected (eager calls raise): pass disjoint views.
    """
    if _is_compiling() and (a.q._base is not None or (a.k is not None and a.k._base is not None)):
        _copy_rotated(a)
        return
    ROTARY_QK_.call(a)


def _copy_rotated(a) -> None:
    """The in-place rotation ``a`` (a call of ``rotary_qk_``, by name) as the functional op plus ``copy_``
    (both differentiable)."""
    if a.k is None:
        a.q.copy_(ROTARY.op(a.q, *_rotation(a)))
    else:
        q_rot, k_rot = ROTARY_QK.op(a.q, a.k, *_rotation(a))
        a.q.copy_(q_rot)
        a.k.copy_(k_rot)

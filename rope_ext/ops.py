"""Python API of the rotary ops: typed wrappers, fake kernels and autograd.

Shapes: ``x``, ``q``, ``k`` are ``[..., head_dim]`` (float32, float64, float16 or bfloat16) with a
contiguous last dim and any other strides; ``positions`` is int32/int64, broadcastable to
``x.shape[:-1]``; ``cos_sin`` is ``[P, rotary_dim]`` (cos half then sin half, float32 or x's dtype).
Arithmetic is float32 (float64 for float64 inputs); outputs have x's dtype.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.rope_ext.*: the schemas and the CPU kernels)
from ._inplace import check_inplace_allowed, refuse_dual_tensors
from .positions import positions_shape


def _load_cuda_kernels() -> str | None:
    """Import ``rope_ext._C_cuda`` (it registers the CUDA kernels) when this torch has CUDA.

    Returns the library's path, or None: a torch without CUDA never loads it (the library needs
    libtorch_cuda), and a build without it (no nvcc) has none. A library that cannot load under this
    torch (say, built for another CUDA major version) leaves the CPU kernels working and says why.
    """
    if torch.version.cuda is None or importlib.util.find_spec("rope_ext._C_cuda") is None:
        return None
    try:
        return importlib.import_module("rope_ext._C_cuda").__file__
    except ImportError as e:
        warnings.warn(f"rope_ext: the CUDA kernels did not load, CPU only: {e}", stacklevel=2)
        return None


_CUDA_LIBRARY = _load_cuda_kernels()


def _built_with_cuda() -> bool:
    """Whether the CUDA kernels are registered (this build has them and this torch has CUDA)."""
    return _CUDA_LIBRARY is not None


__all__ = ["apply_rotary", "apply_rotary_qk", "apply_rotary_qk_", "set_position_checks"]

_ops = torch.ops.rope_ext
_rotary_qk_inplace = _ops.rotary_qk_.default
_rotary_qk_plain = _ops.rotary_qk_.plain  # every option at its default: a shorter boxed call
_is_compiling = torch.compiler.is_compiling
_check_positions_on_device = False

# Instruction sets of the CPU kernel, lowest first within each architecture (csrc/rope/cpu.h).
CPU_ISAS = ("scalar", "avx2", "avx512", "avx512_bf16", "neon")
_isa_env = os.environ.get("ROPE_EXT_CPU_ISA")
if _isa_env and _isa_env not in CPU_ISAS:
    raise ValueError(f"ROPE_EXT_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {_isa_env!r}")


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


def set_position_checks(enabled: bool) -> None:
    """Raise ``IndexError`` for out-of-cache positions on CUDA too.

    CPU ops always check positions before writing. CUDA ops do not by default, since the check
    synchronises with the device: a position outside ``[0, cos_sin.shape[0])`` then yields NaN in
    that token's rotated features (never an out-of-bounds access). With checks enabled, eager calls
    on CUDA check first (one synchronisation per call); compiled graphs are not affected.
    """
    global _check_positions_on_device
    _check_positions_on_device = bool(enabled)


# The tag that starts the message of a C++ check rejecting a type or dtype (csrc/ops/binding.h, TypeError).
# The stable ABI carries standard exceptions only, so the bare ops raise them as ValueError with the tag;
# the API raises TypeError without it.
TYPE_ERROR_TAG = "[type] "


def _retyped(e: ValueError) -> Exception:
    msg = str(e)
    return TypeError(msg[len(TYPE_ERROR_TAG) :]) if msg.startswith(TYPE_ERROR_TAG) else e


def _typed_errors(fn):
    """``fn`` raising TypeError for the ops' type errors (eager; traced calls raise from the fake kernels)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise _retyped(e) from None

    return wrapper


def _require_tensor(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_offset(rotary_offset) -> None:
    if type(rotary_offset) is not int:
        raise TypeError(f"rotary_offset must be an int, got {type(rotary_offset).__name__}")


def _sections(mrope_section) -> list[int] | None:
    """``mrope_section`` as the op takes it (a list of ints), or None."""
    if mrope_section is None:
        return None
    if isinstance(mrope_section, Tensor) or not all(type(v) is int for v in mrope_section):
        raise TypeError(f"mrope_section must be a sequence of 3 ints, got {mrope_section!r}")
    return list(mrope_section)


def _int_triple(v) -> bool:
    """Whether ``v`` is a tuple or list of three ints (an ``mrope_section`` the op takes as it is)."""
    return type(v) in (tuple, list) and len(v) == 3 and type(v[0]) is type(v[1]) is type(v[2]) is int


def _pre_check(positions: Tensor, cos_sin: Tensor) -> None:
    if (
        _check_positions_on_device
        and positions.device.type != "cpu"
        and positions.numel() > 0
        and not torch.compiler.is_compiling()
    ):
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin.shape[0]:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"positions must be in [0, cos_sin.shape[0]) = [0, {cos_sin.shape[0]}), got {bad}"
            )


@_typed_errors
def apply_rotary(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
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
    ``j % 3 == 2 and j < 3 w``, else ``positions[0]``.
    Differentiable in ``x`` (the gradient is the inverse rotation); ``positions`` and ``cos_sin``
    get no gradient.
    """
    _require_tensor("x", x)
    _require_tensor("positions", positions)
    _require_tensor("cos_sin", cos_sin)
    _require_offset(rotary_offset)
    mrope_section = _sections(mrope_section)
    _pre_check(positions, cos_sin)
    return _ops.rotary.default(
        x, positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section, mrope_interleaved
    )


@_typed_errors
def apply_rotary_qk(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` (same rank and head_dim, head counts may differ) in one launch.

    ``positions`` broadcasts to both ``q.shape[:-1]`` and ``k.shape[:-1]``. Equal to two
    :func:`apply_rotary` calls; differentiable in ``q`` and ``k``.
    """
    _require_tensor("q", q)
    _require_tensor("k", k)
    _require_tensor("positions", positions)
    _require_tensor("cos_sin", cos_sin)
    _require_offset(rotary_offset)
    mrope_section = _sections(mrope_section)
    _pre_check(positions, cos_sin)
    return _ops.rotary_qk.default(
        q, k, positions, cos_sin, interleaved, False, rotary_offset, mrope_section, mrope_interleaved
    )


def apply_rotary_qk_(
    q: Tensor,
    k: Tensor | None,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    rotary_offset: int = 0,
    mrope_section: Sequence[int] | None = None,
    mrope_interleaved: bool = False,
) -> None:
    """Rotate ``q`` and ``k`` in place (``k`` may be None); no allocation, CUDA-graph safe.

    Every argument is checked before anything is written: on error q and k are unchanged.
    q and k must not overlap in memory, nor have elements that alias each other (expanded views).
    Differentiable like any in-place op: when q or k requires grad, autograd records the rotation (its
    backward is the inverse rotation of the incoming gradient), also for views of a packed QKV tensor and
    under ``torch.compile``. What autograd refuses for an in-place op (a leaf that requires grad or a view
    of one; an output of unbind, split or chunk; a view made under no_grad or inference_mode) raises
    PyTorch's usual error before anything is written; a dual tensor, ``NotImplementedError`` (no
    forward-mode AD).
    """
    if (
        type(q) is type(positions) is type(cos_sin) is Tensor
        and not q.requires_grad
        and (k is None or (type(k) is Tensor and not k.requires_grad))
        and type(rotary_offset) is int
        and (mrope_section is None or _int_triple(mrope_section))
        and not _check_positions_on_device
        and not _is_compiling()
    ):
        # The common eager call (a decode step): straight to the op, which checks everything else. Each
        # schema argument costs the boxed call time (~0.27 us, passed or defaulted): with no option set,
        # the .plain overload, which has none.
        try:
            if not rotary_offset and mrope_section is None and not mrope_interleaved:
                if interleaved:
                    _rotary_qk_inplace(q, k, positions, cos_sin, interleaved)
                else:
                    _rotary_qk_plain(q, k, positions, cos_sin)
            else:
                _rotary_qk_inplace(
                    q,
                    k,
                    positions,
                    cos_sin,
                    interleaved,
                    False,
                    rotary_offset,
                    mrope_section,
                    mrope_interleaved,
                )
        except ValueError as e:
            raise _retyped(e) from None
        return
    _rotary_qk_inplace_checked(
        q, k, positions, cos_sin, interleaved, rotary_offset, mrope_section, mrope_interleaved
    )


@_typed_errors
def _rotary_qk_inplace_checked(
    q, k, positions, cos_sin, interleaved, rotary_offset, mrope_section, mrope_interleaved
) -> None:
    """``apply_rotary_qk_`` past the eager fast path: every check, autograd and ``torch.compile``."""
    _require_tensor("q", q)
    _require_tensor("k", k, optional=True)
    _require_tensor("positions", positions)
    _require_tensor("cos_sin", cos_sin)
    _require_offset(rotary_offset)
    mrope_section = _sections(mrope_section)
    _pre_check(positions, cos_sin)
    rot = (positions, cos_sin, interleaved, rotary_offset, mrope_section, mrope_interleaved)
    if not (q.requires_grad or (k is not None and k.requires_grad)) or not torch.is_grad_enabled():
        _rotate_in_place(q, k, *rot)
        return
    targets = [t for t in (q, k) if t is not None]
    for t in targets:
        check_inplace_allowed(t)
    if torch.compiler.is_compiling():
        # Traced: the differentiable functional op and copy_ (AOTAutograd reinplaces where it can).
        _copy_rotated(q, k, *rot)
        return
    refuse_dual_tensors(targets, "apply_rotary_qk_")
    # One launch rotates both (every check before the first write), on aliases autograd does not see;
    # then each tensor gets the rotation's node in its history, as an in-place op would.
    with torch.no_grad():
        _rotate_in_place(q.detach(), None if k is None else k.detach(), *rot)
    for t in targets:
        if t.requires_grad:
            _RotatedInPlace.apply(t, *rot)


# ---------------------------------------------------------------------------------------------
# Fake kernels (shapes only) for torch.compile / FakeTensor.


def _fake_checks(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    name: str = "x",
    rotary_offset: int = 0,
    token_major: bool = False,
) -> None:
    """Shape and device checks of the fake kernels."""
    for arg, t in ((name, x), ("positions", positions), ("cos_sin", cos_sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{arg} must be a tensor, got {type(t).__name__}")
    # Mixed devices that include "meta" dispatch here rather than to a real kernel: reject them
    # as the real kernels do (else the call would return garbage or skip an in-place rotation).
    for arg, t in (("positions", positions), ("cos_sin", cos_sin)):
        if t.device != x.device:
            raise ValueError(f"{arg} must be on the device of {name} ({x.device}), got {t.device}")
    torch._check(cos_sin.dim() == 2, lambda: "cos_sin must have shape [positions, rotary_dim]")
    torch._check(cos_sin.shape[-1] <= x.shape[-1], lambda: "rotary_dim must be <= head_dim")
    positions_shape(positions.shape, x.shape[:-1], name, token_major)
    if not 0 <= rotary_offset <= x.shape[-1] - cos_sin.shape[-1]:
        raise ValueError(
            f"rotary_offset must be in [0, head_dim - rotary_dim] = [0, {x.shape[-1] - cos_sin.shape[-1]}], "
            f"got {rotary_offset}"
        )


def _fake_sections(positions: Tensor, cos_sin: Tensor, mrope_section, mrope_interleaved: bool) -> Tensor:
    """The kernels' MRoPE checks; returns the positions of section 0 (what broadcasts to x)."""
    if mrope_section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved needs mrope_section")
        return positions
    half = cos_sin.shape[-1] // 2
    if len(mrope_section) != 3 or min(mrope_section) < 0 or sum(mrope_section) != half:
        raise ValueError(
            "mrope_section must be 3 non-negative ints (temporal, height, width) summing to "
            f"rotary_dim / 2 = {half}, got {list(mrope_section)}"
        )
    if positions.dim() < 1 or positions.shape[0] != 3:
        raise ValueError(
            "positions must have a leading section dim of size 3 ([3, ...]) with mrope_section, "
            f"got shape {list(positions.shape)}"
        )
    return positions[0]


def _same_device(q: Tensor, k: Tensor) -> None:
    """Raises ``ValueError`` unless k is on q's device (as the real kernels do)."""
    if not isinstance(k, Tensor):
        raise TypeError(f"k must be a tensor, got {type(k).__name__}")
    if k.device != q.device:
        raise ValueError(f"k must be on the device of q ({q.device}), got {k.device}")


def _empty_output(x: Tensor) -> Tensor:
    """The output the kernels allocate: ``empty_like(x)``, row-major if that leaves the last dim strided."""
    out = torch.empty_like(x)
    if out.dim() > 0 and out.shape[-1] > 1 and out.stride(-1) != 1:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out


@torch.library.register_fake("rope_ext::rotary")
def _rotary_fake(
    x,
    positions,
    cos_sin,
    interleaved=False,
    inverse=False,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    positions = _fake_sections(positions, cos_sin, mrope_section, mrope_interleaved)
    _fake_checks(x, positions, cos_sin, "x", rotary_offset)
    return _empty_output(x)


@torch.library.register_fake("rope_ext::rotary_qk")
def _rotary_qk_fake(
    q,
    k,
    positions,
    cos_sin,
    interleaved=False,
    inverse=False,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    positions = _fake_sections(positions, cos_sin, mrope_section, mrope_interleaved)
    _fake_checks(q, positions, cos_sin, "q", rotary_offset)
    _same_device(q, k)
    _fake_checks(k, positions, cos_sin, "k", rotary_offset)
    return _empty_output(q), _empty_output(k)


@torch.library.register_fake("rope_ext::rotary_qk_.plain")
@torch.library.register_fake("rope_ext::rotary_qk_")
def _rotary_qk_inplace_fake(
    q,
    k,
    positions,
    cos_sin,
    interleaved=False,
    inverse=False,
    rotary_offset=0,
    mrope_section=None,
    mrope_interleaved=False,
):
    positions = _fake_sections(positions, cos_sin, mrope_section, mrope_interleaved)
    _fake_checks(q, positions, cos_sin, "q", rotary_offset)
    if k is not None:
        _same_device(q, k)
        _fake_checks(k, positions, cos_sin, "k", rotary_offset)


# ---------------------------------------------------------------------------------------------
# Autograd: the gradient of a rotation is the inverse rotation (the same kernel with sin negated).


def _last_dim_contiguous(g: Tensor) -> Tensor:
    return g if g.shape[-1] <= 1 or g.stride(-1) == 1 else g.contiguous()


def _setup(ctx, inputs, output):
    positions, cos_sin, interleaved, inverse, rotary_offset, mrope_section, mrope_interleaved = inputs[-7:]
    ctx.save_for_backward(positions, cos_sin)
    ctx.interleaved = interleaved
    ctx.inverse = inverse
    ctx.rest = (rotary_offset, mrope_section, mrope_interleaved)


def _rotary_backward(ctx, grad):
    positions, cos_sin = ctx.saved_tensors
    dx = _ops.rotary.default(
        _last_dim_contiguous(grad), positions, cos_sin, ctx.interleaved, not ctx.inverse, *ctx.rest
    )
    return dx, None, None, None, None, None, None, None


def _rotary_qk_backward(ctx, grad_q, grad_k):
    positions, cos_sin = ctx.saved_tensors
    args = (positions, cos_sin, ctx.interleaved, not ctx.inverse, *ctx.rest)
    if grad_q is not None and grad_k is not None:
        dq, dk = _ops.rotary_qk.default(_last_dim_contiguous(grad_q), _last_dim_contiguous(grad_k), *args)
    else:
        dq = None if grad_q is None else _ops.rotary.default(_last_dim_contiguous(grad_q), *args)
        dk = None if grad_k is None else _ops.rotary.default(_last_dim_contiguous(grad_k), *args)
    return dq, dk, None, None, None, None, None, None, None


def _rotate_in_place(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin: Tensor, *rest) -> None:
    """``rotary_qk_``; under ``torch.compile``, views go through the functional op and ``copy_``.

    Inductor (torch 2.14.1, ``dynamic=True``) hands a custom op's mutated view argument to the kernel
    with its storage offset dropped, so ``rotary_qk_(qkv[:, :, 1], ...)`` would rotate ``qkv[:, :, 0]``
    (tests/test_compile_views.py has the case and a minimal reproduction without rope_ext). The
    functional op plus ``copy_`` into the view is traced correctly. On that path q and k that overlap
    are not detected (eager calls raise): pass disjoint views.
    """
    if torch.compiler.is_compiling() and (q._base is not None or (k is not None and k._base is not None)):
        _copy_rotated(q, k, positions, cos_sin, *rest)
        return
    interleaved, *more = rest
    _ops.rotary_qk_.default(q, k, positions, cos_sin, interleaved, False, *more)


def _copy_rotated(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin: Tensor, *rest) -> None:
    """The in-place rotation as the functional op plus ``copy_`` (both differentiable).

    ``rest``: ``interleaved, rotary_offset, mrope_section, mrope_interleaved``.
    """
    interleaved, *more = rest
    if k is None:
        q.copy_(_ops.rotary.default(q, positions, cos_sin, interleaved, False, *more))
    else:
        q_rot, k_rot = _ops.rotary_qk.default(q, k, positions, cos_sin, interleaved, False, *more)
        q.copy_(q_rot)
        k.copy_(k_rot)


class _RotatedInPlace(torch.autograd.Function):
    """Autograd node of an in-place rotation already applied to ``x``: marks ``x`` modified in place;
    backward rotates the incoming gradient by the inverse angle (the same kernel)."""

    @staticmethod
    def forward(ctx, x, positions, cos_sin, interleaved, rotary_offset, mrope_section, mrope_interleaved):
        ctx.mark_dirty(x)
        ctx.save_for_backward(positions, cos_sin)
        ctx.interleaved = interleaved
        ctx.rest = (rotary_offset, mrope_section, mrope_interleaved)
        return x

    @staticmethod
    def backward(ctx, grad):
        positions, cos_sin = ctx.saved_tensors
        g = _last_dim_contiguous(grad)
        dx = _ops.rotary.default(g, positions, cos_sin, ctx.interleaved, True, *ctx.rest)
        return dx, None, None, None, None, None, None


torch.library.register_autograd("rope_ext::rotary", _rotary_backward, setup_context=_setup)
torch.library.register_autograd("rope_ext::rotary_qk", _rotary_qk_backward, setup_context=_setup)

"""Autograd of the ops.

* ``rotary``, ``rotary_qk`` (registered): the gradient of a rotation is the inverse rotation of the
  incoming gradient (the same kernel with sin negated);
* in-place rotations (:func:`record_rotation`): a node recording a rotation already applied to a tensor,
  whose backward is the inverse rotation;
* ``qk_norm_rotary`` (registered): the inverse rotation, then the RMSNorm's backward (see below).

Positions and cos_sin get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .specs import QK_NORM, ROTARY, ROTARY_QK, OpSpec

__all__ = ["last_dim_contiguous", "record_rotation"]


def last_dim_contiguous(g: Tensor) -> Tensor:
    return g if g.shape[-1] <= 1 or g.stride(-1) == 1 else g.contiguous()


def _inverse_rotation(a: Any, positions: Tensor, cos_sin: Tensor) -> tuple:
    """The arguments of ``rotary`` after x that undo the rotation of the call ``a`` (by name: an op whose
    rotation options are named as ``rotary``'s; options it lacks, such as ``inverse``, at their defaults)."""
    r = ROTARY.Args(None, positions, cos_sin)
    r = r._replace(**{n: getattr(a, n) for n in r._fields[3:] if n in a._fields})
    return r._replace(inverse=not r.inverse)[1:]


def _without_tensors(spec: OpSpec, a: Any) -> Any:
    """``a`` with its tensor arguments replaced by None: what a backward keeps besides the saved tensors."""
    return a._replace(**{n: None for n in spec.names if isinstance(getattr(a, n), Tensor)})


def _register(spec: OpSpec, backward, saved: tuple[str, ...]) -> None:
    """Registers ``backward(ctx, a, *grads)`` as the autograd formula of ``spec``. ``a``: the call's arguments
    by name, the tensors named in ``saved`` saved for it (the others None). It returns the gradients of
    the inputs (the arguments without a default; the options get none)."""
    n_options = len(spec.Args._field_defaults)

    def setup_context(ctx, inputs, output):
        a = spec.bind(inputs)
        ctx.save_for_backward(*(getattr(a, n) for n in saved))
        ctx.a = _without_tensors(spec, a)

    def backward_of_every_input(ctx, *grads):
        a = ctx.a._replace(**dict(zip(saved, ctx.saved_tensors, strict=True)))
        return (*backward(ctx, a, *grads), *(None,) * n_options)

    for overload in spec.overloads:
        torch.library.register_autograd(overload, backward_of_every_input, setup_context=setup_context)


def _rotary_backward(ctx, a, grad):
    dx = ROTARY.op(last_dim_contiguous(grad), *_inverse_rotation(a, a.positions, a.cos_sin))
    return dx, None, None


def _rotary_qk_backward(ctx, a, grad_q, grad_k):
    inverse = _inverse_rotation(a, a.positions, a.cos_sin)
    if grad_q is not None and grad_k is not None:
        dq, dk = ROTARY_QK.op(last_dim_contiguous(grad_q), last_dim_contiguous(grad_k), *inverse)
    else:
        dq = None if grad_q is None else ROTARY.op(last_dim_contiguous(grad_q), *inverse)
        dk = None if grad_k is None else ROTARY.op(last_dim_contiguous(grad_k), *inverse)
    return dq, dk, None, None


_register(ROTARY, _rotary_backward, ("positions", "cos_sin"))
_register(ROTARY_QK, _rotary_qk_backward, ("positions", "cos_sin"))


class _RotatedInPlace(torch.autograd.Function):
    """Autograd node of an in-place rotation already applied to ``x``: marks ``x`` modified in place;
    backward rotates the incoming gradient by the inverse angle (the same kernel)."""

    @staticmethod
    def forward(ctx, x, positions, cos_sin, rotation):
        ctx.mark_dirty(x)
        ctx.save_for_backward(positions, cos_sin)
        ctx.rotation = rotation
        return x

    @staticmethod
    def backward(ctx, grad):
        positions, cos_sin = ctx.saved_tensors
        dx = ROTARY.op(last_dim_contiguous(grad), *_inverse_rotation(ctx.rotation, positions, cos_sin))
        return dx, None, None, None


def record_rotation(x: Tensor, spec: OpSpec, a: Any) -> None:
    """Records in ``x``'s history the rotation of the call ``a`` of ``spec`` (by name), already applied to
    ``x`` in place, as an in-place op would."""
    _RotatedInPlace.apply(x, a.positions, a.cos_sin, _without_tensors(spec, a))


# ---------------------------------------------------------------------------------------------
# Autograd of qk_norm_rotary: y = R(n), n = x * r * (w + offset), r = 1 / sqrt(mean(x^2) + eps).
# Given dy: dn = R^-1(dy) (the inverse rotation); dw = sum(dn * x * r) over tokens and heads;
# dx = r * a - x * r^3 * mean(a * x) with a = dn * (w + offset). Computed in float32 (float64 inputs:
# float64) from the saved inputs; the forward's rounding of n to the activation dtype is not
# differentiated (the straight-through convention of every low-precision kernel).


def _norm_head_backward(a, x: Tensor, w: Tensor, grad: Tensor | None):
    if grad is None:
        return None, None
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cs = a.cos_sin if a.cos_sin.dtype in (torch.float32, acc) else a.cos_sin.to(acc)
    positions = a.positions
    if positions.dim() == grad.dim() - 2 + (a.mrope_section is not None):
        positions = positions.unsqueeze(-1)  # per token ([T]) as the rotary op takes it ([T, 1])
    dn = ROTARY.op(last_dim_contiguous(grad.to(acc)), *_inverse_rotation(a, positions, cs))
    xf = x.to(acc)
    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + a.eps)
    wf = w.to(acc) + a.weight_offset
    d = dn * wf
    dx = r * d - xf * r.pow(3) * (d * xf).mean(dim=-1, keepdim=True)
    dw = (dn * xf * r).sum(dim=(0, 1))
    return dx.to(x.dtype), dw.to(w.dtype)


def _norm_backward(ctx, a, grad_q, grad_k):
    dq, dwq = _norm_head_backward(a, a.q, a.q_weight, grad_q)
    dk, dwk = _norm_head_backward(a, a.k, a.k_weight, grad_k)
    dwq = dwq if ctx.needs_input_grad[2] else None
    dwk = dwk if ctx.needs_input_grad[3] else None
    return dq, dk, dwq, dwk, None, None


_register(QK_NORM, _norm_backward, ("q", "k", "q_weight", "k_weight", "positions", "cos_sin"))

"""Autograd's refusals of an in-place op, checked before the ops write.

The differentiable in-place paths rotate first and record the rotation in autograd after (autograd.py,
``record_rotation``); autograd checks an in-place op only when recording it. What it would refuse is
refused here first, so that a rejected call leaves every tensor as it was.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.autograd import forward_ad

_DEFAULT_VIEW = torch._C._autograd.CreationMeta.DEFAULT


def check_inplace_allowed(t: Tensor, requires_grad: bool | None = None) -> None:
    """Raises the error autograd would raise for an in-place op on ``t``, or nothing.

    ``requires_grad``: whether the value written requires grad (default ``t.requires_grad``). The checks
    and their order are autograd's (``check_inplace``): a view autograd cannot rebase (an output of a
    function that returns several views, such as unbind, split or chunk; a view made under no_grad or
    inference_mode, or inside a custom Function), then a view of a leaf, then a leaf that requires grad.
    Traced calls skip the view check (its state is not traceable): the traced ``copy_`` of the rotation
    raises autograd's error while tracing, before anything runs.
    """
    if requires_grad is None:
        requires_grad = t.requires_grad
    if not (requires_grad and torch.is_grad_enabled()):
        return
    base = t._base
    if base is None:
        pass
    elif not torch.compiler.is_compiling() and torch._C._autograd._get_creation_meta(t) != _DEFAULT_VIEW:
        _raise_view_error(t)
    elif t.requires_grad and base.is_leaf:
        raise RuntimeError(
            "a view of a leaf Variable that requires grad is being used in an in-place operation."
        )
    if t.requires_grad and t.is_leaf:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")


def _raise_view_error(t: Tensor) -> None:
    """Raises autograd's error for ``t``, a view whose creation autograd does not let an in-place op rebase.

    The text is autograd's own: an in-place ``mul_`` whose other operand requires grad, which autograd
    rejects before its kernel runs. That operand has more dims than ``t``, so the kernel could not write
    either (an in-place result cannot broadcast to a larger shape); a PyTorch whose wording differs gets
    a message of this module instead.
    """
    meta = torch._C._autograd._get_creation_meta(t)
    dtype = t.dtype if t.is_floating_point() else torch.float32
    other = torch.empty((0,) * (t.dim() + 1), dtype=dtype, device=t.device, requires_grad=True)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            t.mul_(other)
    except RuntimeError as e:
        if "modified inplace" in str(e):
            raise
    raise RuntimeError(
        f"this view ({meta.name}) cannot be modified in place while autograd records it; "
        "modify a clone or call the op under torch.no_grad()"
    )


def refuse_dual_tensors(targets: Iterable[Tensor], op: str) -> None:
    """Raises ``NotImplementedError`` when a target has a forward-mode tangent: the node that records an
    in-place rotation has no forward-mode formula, and autograd refuses a dual tensor only on recording."""
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in targets):
        raise NotImplementedError(f"{op} has no forward-mode AD formula: q or k is a dual tensor")

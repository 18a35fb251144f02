"""Fused QK norm: attention layers whose per-head q / k RMSNorm runs right before the rotation.

In the attention classes of :data:`FUSED_QK_NORM_MODEL_TYPES`, ``forward`` applies ``q_norm`` / ``k_norm``
to the projections and then, always, the modeling module's rotary function. :func:`_defer_norms` swaps the
two norms for :class:`_DeferredNorm` modules that return their input while that attention's forward runs
(recorded per thread in ``_RUNNING``), and the patched rotary function (:mod:`.patch`) applies norms and
rotation as one :func:`rope_ext.apply_qk_norm_rotary` call (:func:`_fused_norm_rotate`); any call the fused
op does not take gets the original norms, then the plain rotation. A norm is deferred only when a probe
shows it computes ``rms_norm(x, weight, eps, weight_offset)``.
"""

from __future__ import annotations

import inspect
import threading
import types
from typing import Any

import torch
from torch import Tensor, nn

from ...reference import rms_norm
from ...serving import apply_qk_norm_rotary
from .probes import _code_names
from .rotation import _pair_values, _Rotation

__all__ = ["FUSED_QK_NORM_MODEL_TYPES"]


# Attention classes (by model type) whose forward applies q_norm / k_norm to the projections and then,
# always, the modeling module's rotary function: their norms can be deferred into one fused op.
FUSED_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


class _Running(threading.local):
    """Per thread: the attention module whose forward (with deferred norms) this thread is running, the
    innermost one, else None.

    Per thread because threads run patched models at once (a threaded server, DataParallel replicas): with
    one process-wide record, a norm or rotation in one thread would read the other thread's attention and
    apply its norms, or apply them twice. Not a ``ContextVar``: ``torch.compile(fullgraph=True)`` traces
    reads and writes of a ``threading.local``'s attributes (guarded on the calling thread's values) but
    breaks the graph at ``ContextVar.set``. ``attention`` is set in ``__init__`` (run in each thread on its
    first access), not given as a class attribute: with a class default, dynamo (torch 2.14) guards on the
    attribute being absent from the thread's ``__dict__``, a guard the traced forward's own writes fail, and
    the compile errors out.
    """

    def __init__(self) -> None:
        self.attention: nn.Module | None = None


_RUNNING = _Running()


class _DeferredNorm(nn.Module):
    """Stands in for an attention's ``q_norm`` / ``k_norm``: inside the attention's forward it returns its
    input, and the patched rotary function applies the norm fused with the rotation
    (:func:`rope_ext.apply_qk_norm_rotary`); anywhere else it runs the original norm. Its ``weight`` is the
    original module's parameter itself, so state dict keys, optimizers and training are unchanged; the
    original module is ``.original`` (not a submodule)."""

    def __init__(self, original: nn.Module, eps: float, weight_offset: float) -> None:
        super().__init__()
        self.__dict__["original"] = original  # a plain reference: its weight is registered here
        self.weight = original.weight
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: Tensor) -> Tensor:
        attention = _RUNNING.attention
        if attention is not None and attention is self.__dict__.get("owner"):
            return x
        return self.original(x)

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__}, eps={self.eps}, weight_offset={self.weight_offset}, deferred"


def _norm_form(norm: nn.Module, head_dim: int) -> tuple[float, float] | None:
    """``(eps, weight_offset)`` when ``norm(x)`` is ``rms_norm(x, weight, eps, weight_offset)`` (float32
    probe against the float64 reference), else None."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (head_dim,) or weight.device.type == "meta":
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, head_dim, generator=g).to(weight.device)
    with torch.no_grad():
        try:
            got = norm(x.float()).double()
        except Exception:
            return None
    for attr in ("variance_epsilon", "eps"):
        eps = getattr(norm, attr, None)
        if not isinstance(eps, float):
            continue
        for offset in (0.0, 1.0):
            want = rms_norm(x, weight.detach().float(), eps, offset)
            if torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                return eps, offset
    return None


def _fusable_attentions(model: nn.Module) -> list[nn.Module]:
    """Attention modules of the model types in FUSED_QK_NORM_MODEL_TYPES whose q / k norms can be fused."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_QK_NORM_MODEL_TYPES:
        return []
    found = []
    for m in model.modules():
        q_norm, k_norm, head_dim = (getattr(m, a, None) for a in ("q_norm", "k_norm", "head_dim"))
        if not (
            isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module) and isinstance(head_dim, int)
        ):
            continue
        forward = inspect.unwrap(type(m).forward)
        if isinstance(q_norm, _DeferredNorm) or not {"q_norm", "k_norm"} <= _code_names(forward.__code__):
            continue
        forms = (_norm_form(q_norm, head_dim), _norm_form(k_norm, head_dim))
        if forms[0] is not None and forms[0] == forms[1]:
            found.append(m)
    return found


def _attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The attention's own forward with its q / k norms deferred to the rotary function. The attention
    running before (an outer one, or None) is restored after, in this thread only."""
    outer = _RUNNING.attention
    _RUNNING.attention = self
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _RUNNING.attention = outer


def _defer_norms(attention: nn.Module) -> None:
    eps, offset = _norm_form(attention.q_norm, attention.head_dim)
    q_norm, k_norm = (
        _DeferredNorm(attention.q_norm, eps, offset),
        _DeferredNorm(attention.k_norm, eps, offset),
    )
    for norm in (q_norm, k_norm):
        norm.__dict__["owner"] = attention  # a plain reference, not a submodule
    attention.q_norm, attention.k_norm = q_norm, k_norm
    attention._rope_ext_norms = True
    attention.forward = types.MethodType(_attention_forward, attention)


def _restore_norms(attention: nn.Module) -> None:
    if isinstance(attention.q_norm, _DeferredNorm):
        attention.q_norm = attention.q_norm.original
        attention.k_norm = attention.k_norm.original
        del attention._rope_ext_norms
        del attention.forward


def _fused_norm_rotate(att, plain, q, k, cos, sin, args, kwargs, rot: _Rotation):
    """The deferred q / k norms and the rotation, as one :func:`rope_ext.apply_qk_norm_rotary` call on
    ``q [B, Hq, S, D]`` / ``k`` with ``cos`` / ``sin`` ``[B, S, w]`` (``unsqueeze_dim=1``, the layout these
    attention classes use); any other call applies the original norms, then the plain patched function."""
    qn, kn = att.q_norm, att.k_norm
    ok = (
        not args
        and not kwargs
        and q.dim() == 4
        and k.dim() == 4
        and cos.dim() == 3
        and cos.shape == sin.shape
        and q.dtype == k.dtype == cos.dtype
        and cos.shape[0] in (1, q.shape[0])
        and q.shape[2] == cos.shape[1]
        and rot.output == "same"
        and not cos.requires_grad
        and not sin.requires_grad
        and (cos.shape[-1] == q.shape[-1] or (rot.partial and cos.shape[-1] < q.shape[-1]))
    )
    if not ok:
        return plain(qn.original(q), kn.original(k), cos, sin, *args, **kwargs)
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    Bc, w = cos.shape[0], cos.shape[-1]
    table = torch.cat([_pair_values(cos, rot.layout), _pair_values(sin, rot.layout)], dim=-1).reshape(
        Bc * S, w
    )
    # token (b, s) of q reads row (b or 0, s) of the table
    positions = torch.arange(Bc * S, device=q.device).view(Bc, S).expand(B, S).reshape(B * S)
    q2, k2 = apply_qk_norm_rotary(
        q.transpose(1, 2).reshape(B * S, Hq, D),
        k.transpose(1, 2).reshape(B * S, Hk, D),
        qn.weight,
        kn.weight,
        positions,
        table,
        eps=qn.eps,
        interleaved=rot.pairing == "interleaved",
        weight_offset=qn.weight_offset,
    )
    return q2.view(B, S, Hq, D).transpose(1, 2), k2.view(B, S, Hk, D).transpose(1, 2)

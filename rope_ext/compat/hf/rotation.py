"""The rotation transformers' ``apply_rotary*`` functions compute, and rope_ext's op computing it.

:class:`_Rotation` names what such a function computes from ``(q, k, cos, sin)``: the pairing, how
``cos`` / ``sin`` hold the pair values, the output order, whether features past ``cos``'s width pass
through, the output dtype. :func:`_rotate` computes a rotation with rope_ext's op, or returns None where
the op cannot compute it exactly (the caller then runs the original function, so results never depend on
which path ran). :func:`apply_rotary_pos_emb` is transformers' own function on top of it.

The bottom of the package: it imports none of its sibling modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...ops import apply_rotary, apply_rotary_qk
from ...reference import rotate_half

__all__ = ["apply_rotary_pos_emb"]

_OP_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _Rotation(NamedTuple):
    """What a transformers ``apply_rotary*`` function computes from ``(q, k, cos, sin)``.

    * ``pairing``: ``"half"`` (features ``(j, j + w/2)``, ``rotate_half``) or ``"interleaved"``
      (``(2j, 2j+1)``), over the first ``w = cos.shape[-1]`` features;
    * ``layout``: how ``cos`` / ``sin`` hold the ``w/2`` pair values: ``"cat"`` (``cat((c, c))``) or
      ``"repeat"`` (``repeat_interleave(c, 2)``);
    * ``output``: ``"same"`` (each pair written back where it was read) or ``"deinterleaved"`` (the first
      elements of the rotated pairs, then the second ones: DeepSeek's ``apply_rotary_pos_emb_interleave``);
    * ``partial``: ``q`` / ``k`` wider than ``cos`` are accepted, the features past ``w`` passed through
      (when false, such calls go to the original function);
    * ``keep_dtype``: outputs in the inputs' dtype (else the promotion of ``q`` / ``k`` with ``cos``).
    """

    pairing: str
    layout: str
    output: str = "same"
    partial: bool = False
    keep_dtype: bool = False

    def describe(self) -> str:
        """A short description, e.g. ``"interleaved pairs, de-interleaved output"``."""
        text = "half-split pairs" if self.pairing == "half" else "interleaved pairs"
        if self.output == "deinterleaved":
            text += ", de-interleaved output"
        if self.layout == "repeat":
            text += ", repeat_interleave cos/sin"
        return text


_HF_ROTATION = _Rotation("half", "cat")
# The rotations rope_ext's op computes, tried in this order against a modeling module's function.
_CANDIDATES = (("half", "same"), ("interleaved", "same"), ("interleaved", "deinterleaved"))


def _hf_formula(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _fast_path(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, partial: bool) -> bool:
    """Whether the op computes exactly what the function would (shapes, dtypes, devices, grads)."""
    d, w = q.shape[-1], cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() > min(q.dim(), k.dim()) or cos.dim() == 0:
        return False
    if w % 2 or w == 0 or k.shape[-1] != d or not (d == w or (partial and d > w)):
        return False
    if cos.is_complex() or sin.is_complex() or cos.dtype != sin.dtype:
        return False
    if not all(t.dtype in _OP_DTYPES for t in (q, k, cos)):
        return False
    if not (q.device == k.device == cos.device == sin.device):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False  # the op gives no gradient to cos / sin; the formula does
    lead = cos.shape[:-1]
    try:
        return (
            torch.broadcast_shapes(q.shape[:-1], lead) == q.shape[:-1]
            and torch.broadcast_shapes(k.shape[:-1], lead) == k.shape[:-1]
        )
    except RuntimeError:
        return False


def _pair_values(t: Tensor, layout: str) -> Tensor:
    """``[..., w]`` cos or sin -> the ``[..., w/2]`` pair values it holds (``layout``: see ``_Rotation``)."""
    return t[..., : t.shape[-1] // 2] if layout == "cat" else t[..., 0::2]


def _as_layout(c: Tensor, layout: str) -> Tensor:
    """``[..., w/2]`` pair values -> ``[..., w]`` cos or sin laid out as ``layout``."""
    if layout == "cat":
        return torch.cat([c, c], dim=-1)
    return torch.stack([c, c], dim=-1).flatten(-2)


def _duplicated(cos: Tensor, sin: Tensor, layout: str) -> bool:
    """Whether ``cos`` and ``sin`` really are laid out as ``layout`` (each pair value stored twice)."""
    if layout == "cat":
        h = cos.shape[-1] // 2
        return torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:])
    return torch.equal(cos[..., 0::2], cos[..., 1::2]) and torch.equal(sin[..., 0::2], sin[..., 1::2])


def _deinterleave(x: Tensor, w: int) -> Tensor:
    """Features ``[0, w)`` of ``x [..., d]`` reordered to ``(0, 2, 4, ..., 1, 3, 5, ...)``; the rest kept."""
    head = x[..., :w].unflatten(-1, (w // 2, 2)).transpose(-1, -2).flatten(-2)
    return head if x.shape[-1] == w else torch.cat([head, x[..., w:]], dim=-1)


def _rotate(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int, rot: _Rotation, check_pairs: bool
) -> tuple[Tensor, Tensor] | None:
    """``rot`` applied to ``q`` and ``k`` by rope_ext's op, or None when the op cannot compute it exactly
    (then the caller runs the original function). ``cos`` / ``sin`` are unsqueezed at ``unsqueeze_dim``
    first, as transformers does; with ``check_pairs`` (eager only) their layout is verified."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if not _fast_path(q, k, cos, sin, rot.partial) or (rot.keep_dtype and q.dtype != k.dtype):
        return None
    if check_pairs and not torch.compiler.is_compiling() and not _duplicated(cos, sin, rot.layout):
        return None
    in_dtype = q.dtype
    dq = torch.promote_types(q.dtype, cos.dtype)
    dk = torch.promote_types(k.dtype, cos.dtype)
    q = q.to(dq) if q.dtype != dq else q
    k = k.to(dk) if k.dtype != dk else k
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    w = cos.shape[-1]
    lead = cos.shape[:-1]
    n = 1
    for s in lead:
        n *= s
    table = torch.cat([_pair_values(cos, rot.layout), _pair_values(sin, rot.layout)], dim=-1).reshape(n, w)
    # Full rank (leading 1s): cos broadcasts numpy-style, which the ops take as it is at full rank only.
    positions = torch.arange(n, device=cos.device).view((1,) * max(0, q.dim() - 1 - len(lead)) + tuple(lead))
    interleaved = rot.pairing == "interleaved"
    if dq == dk and table.dtype in (torch.float32, dq):
        q, k = apply_rotary_qk(q, k, positions, table, interleaved=interleaved)
    else:
        tq = table if table.dtype in (torch.float32, dq) else table.float()
        tk = table if table.dtype in (torch.float32, dk) else table.float()
        q = apply_rotary(q, positions, tq, interleaved=interleaved)
        k = apply_rotary(k, positions, tk, interleaved=interleaved)
    if rot.output == "deinterleaved":
        q, k = _deinterleave(q, w), _deinterleave(k, w)
    if rot.keep_dtype and q.dtype != in_dtype:
        q, k = q.to(in_dtype), k.to(in_dtype)
    return q, k


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb``:
    ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` after
    ``cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)``.

    ``q`` ``[batch, heads, seq, head_dim]`` and ``k`` (its own head count) with ``cos`` / ``sin``
    ``[batch, seq, head_dim]`` and ``unsqueeze_dim=1`` (``unsqueeze_dim=2`` for ``[batch, seq, heads,
    head_dim]``); any shapes that broadcast as in transformers. ``position_ids`` is accepted and ignored
    (as in transformers 4.x, where it is deprecated and unused). Outputs have transformers' dtypes (the
    promotion of ``q`` / ``k`` with ``cos`` / ``sin``); gradients flow to ``q`` and ``k`` (and to ``cos``
    / ``sin`` when they require grad: that case uses the formula itself).

    The op reads ``cos[..., :head_dim/2]`` and ``sin[..., :head_dim/2]`` as the pair values, which is what
    every transformers rotary embedding builds (``cat((freqs, freqs))``). Eagerly, the two halves are
    compared first (one pass over ``cos`` / ``sin``, which are ``heads`` times smaller than ``q``) and the
    formula is used when they differ; under ``torch.compile`` they are assumed equal. Arithmetic is float32
    (transformers rounds after each product in the input dtype): for bf16 / fp16 results can differ by an
    ulp, more accurate than the formula.
    """
    out = _rotate(q, k, cos, sin, unsqueeze_dim, _HF_ROTATION, check_pairs=True)
    if out is None:
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return _hf_formula(q, k, c, s)
    return out

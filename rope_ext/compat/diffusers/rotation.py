"""The rotations diffusers' rotary functions compute, and rope_ext's op computing them.

A diffusers rotation function takes the tensors it rotates (``x``, or ``q`` and ``k``), then the model's
own frequencies in one of five forms (:data:`FORMS`), then optional mode arguments (``use_real``,
``use_real_unbind_dim``, ``sequence_dim``, ...). :class:`_Form` names what one call form computes: the
pairing, how the frequencies hold the pair values, where their leading dims sit against ``x``'s, the
output dtype. :func:`_rotate` computes it with rope_ext's op on the table-with-positions trick (the pair
values as a ``[n, rotary_dim]`` table, positions ``arange(n)`` laid out as the frequencies broadcast), so
the result is the model's rotation at whatever positions it computed its frequencies for (fractional
ones included), or returns None where the op cannot compute it exactly; the caller then runs the
original function.

The bottom of the package: it imports none of its sibling modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...ops import apply_rotary, apply_rotary_qk

_OP_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

FORMS = ("tuple", "args", "complex", "joined", "matrix")
"""How a function takes the frequencies of rotary width ``w``:

* ``tuple``: one argument ``(cos, sin)``, each ``[..., w]`` (real);
* ``args``: two arguments ``cos, sin``, each ``[..., w]``;
* ``complex``: one complex tensor ``[..., w/2]`` (``cos + i sin``, ``torch.polar``);
* ``joined``: one real tensor ``[..., 2w]``, ``cat((cos, sin), -1)``;
* ``matrix``: one real tensor ``[..., w/2, 2, 2]``, the rotation matrices ``[[c, -s], [s, c]]``.

``cos`` / ``sin`` of the real forms hold each of the ``w/2`` pair values twice, ``repeat_interleave(c, 2)``
(layout ``repeat``) or ``cat((c, c))`` (layout ``cat``), or once (layout ``once``: ``[..., w/2]``)."""

_REAL_LAYOUTS = ("repeat", "cat", "once")
_LAYOUTS = {"tuple": _REAL_LAYOUTS, "args": _REAL_LAYOUTS, "joined": _REAL_LAYOUTS}


class _Form(NamedTuple):
    """What a function computes for one call form.

    * ``pairing``: ``"interleaved"`` (features ``(2j, 2j+1)``) or ``"half"`` (``(j, j + w/2)``);
    * ``layout``: ``"repeat"`` / ``"cat"`` / ``"once"`` for the real forms (see :data:`FORMS`), ``""``
      otherwise;
    * ``dims``: which dims of ``x.shape[:-1]`` the frequencies' leading dims take, in order, the others
      of size 1 (diffusers' ``sequence_dim=1`` on ``[B, S, H, D]``: ``[S, w]`` is ``[1, S, 1, w]``,
      dims ``(1,)``; transformers' ``cos.unsqueeze(1)`` on ``[B, H, S, D]``: ``[B, S, w]``, dims ``(0, 2)``);
    * ``partial``: ``x`` wider than the rotary width is accepted, the features past it passed through;
    * ``keep_dtype``: outputs in ``x``'s dtype (else the promotion of ``x`` with the frequencies');
    * ``float64``: float64 ``x`` is rotated in float64 arithmetic, as the op does (else such calls go to
      the original function, which computes them in float32).
    """

    pairing: str
    layout: str
    dims: tuple
    partial: bool = False
    keep_dtype: bool = True
    float64: bool = False

    def describe(self, form: str) -> str:
        """E.g. ``"interleaved pairs, (cos, sin) repeat_interleave"``."""
        pairs = "interleaved pairs" if self.pairing == "interleaved" else "half-split pairs"
        freqs = {
            "tuple": "(cos, sin)",
            "args": "cos, sin",
            "complex": "complex freqs",
            "joined": "cat(cos, sin)",
            "matrix": "2x2 matrices",
        }[form]
        if self.layout:
            freqs += {"repeat": " repeat_interleave", "cat": " cat", "once": " w/2 wide"}[self.layout]
        return f"{pairs}, {freqs}" + (", partial" if self.partial else "")


def _as_layout(c: Tensor, layout: str) -> Tensor:
    """``[..., w/2]`` pair values -> ``[..., w]`` laid out as ``layout`` (``[..., w/2]`` for ``once``)."""
    if layout == "once":
        return c
    if layout == "cat":
        return torch.cat([c, c], dim=-1)
    return torch.stack([c, c], dim=-1).flatten(-2)


def _make_freqs(form: str, layout: str, c: Tensor, s: Tensor) -> tuple:
    """The frequency arguments of ``form`` for pair values ``c``, ``s`` ``[..., w/2]``."""
    if form == "tuple":
        return ((_as_layout(c, layout), _as_layout(s, layout)),)
    if form == "args":
        return (_as_layout(c, layout), _as_layout(s, layout))
    if form == "complex":
        return (torch.complex(c, s),)
    if form == "joined":
        return (torch.cat([_as_layout(c, layout), _as_layout(s, layout)], dim=-1),)
    return (torch.stack([c, -s, s, c], dim=-1).unflatten(-1, (2, 2)),)


def _form_of(freqs: tuple) -> str | None:
    """The form of a call's frequency arguments, or None."""
    if len(freqs) == 2:
        return "args" if _real_pair(*freqs) else None
    if len(freqs) != 1:
        return None
    f = freqs[0]
    if isinstance(f, (tuple, list)):
        return "tuple" if len(f) == 2 and _real_pair(*f) else None
    if not isinstance(f, Tensor) or f.dim() == 0:
        return None
    if f.is_complex():
        return "complex"
    if f.dim() >= 3 and f.shape[-1] == 2 and f.shape[-2] == 2:
        return "matrix"
    return "joined"


def _real_pair(a, b) -> bool:
    return all(isinstance(t, Tensor) and t.dim() > 0 and not t.is_complex() for t in (a, b))


def _lead_rank(form: str, freqs: tuple) -> int:
    f = freqs[0][0] if form == "tuple" else freqs[0]
    return f.dim() - (3 if form == "matrix" else 1)


def _pair_values(form: str, layout: str, freqs: tuple) -> tuple[Tensor, Tensor] | None:
    """The ``[..., w/2]`` pair values the frequencies hold, or None when their shapes or dtypes do not
    fit ``form`` (every value is read, so the layout itself is checked by :func:`_laid_out`)."""
    if form == "complex":
        f = freqs[0]
        return (f.real, f.imag) if f.dtype in (torch.complex64, torch.complex128) else None
    if form == "matrix":
        f = freqs[0]
        return f[..., 0, 0], f[..., 1, 0]
    if form == "joined":
        f = freqs[0]
        if f.shape[-1] % 2:
            return None
        cos, sin = f.chunk(2, dim=-1)
    else:
        cos, sin = freqs[0] if form == "tuple" else freqs
        if cos.shape != sin.shape or cos.dtype != sin.dtype:
            return None
    if layout == "once":
        return cos, sin
    if cos.shape[-1] % 2:
        return None
    if layout == "cat":
        h = cos.shape[-1] // 2
        return cos[..., :h], sin[..., :h]
    return cos[..., 0::2], sin[..., 0::2]


def _laid_out(form: str, layout: str, freqs: tuple) -> bool:
    """Whether the frequencies really hold each pair value as ``form`` / ``layout`` say (eager only)."""
    if form == "complex" or layout == "once":
        return True
    if form == "matrix":
        f = freqs[0]
        return torch.equal(f[..., 0, 1], -f[..., 1, 0]) and torch.equal(f[..., 1, 1], f[..., 0, 0])
    parts = freqs[0].chunk(2, dim=-1) if form == "joined" else freqs[0] if form == "tuple" else freqs
    for t in parts:
        if layout == "cat":
            h = t.shape[-1] // 2
            same = torch.equal(t[..., :h], t[..., h:])
        else:
            same = torch.equal(t[..., 0::2], t[..., 1::2])
        if not same:
            return False
    return True


def _positions_shape(lead: tuple, rank: int, dims: tuple, targets: tuple) -> tuple | None:
    """``lead`` placed at ``dims`` of ``rank`` dims (1 elsewhere), or None when that does not broadcast into
    each of ``targets`` (the rotated tensors' leading shapes) as it is."""
    if len(dims) != len(lead) or (dims and dims[-1] >= rank):
        return None
    shape = [1] * rank
    for d, size in zip(dims, lead, strict=True):
        shape[d] = size
    shape = tuple(shape)
    for target in targets:
        for a, b in zip(shape, target, strict=True):
            if a != 1 and a != b:
                return None
    return shape


def _rotate(xs: tuple, form: str, freqs: tuple, rot: _Form, check: bool) -> tuple | None:
    """``rot`` applied to each tensor of ``xs`` by rope_ext's op, or None when the op cannot compute it
    exactly (shapes, dtypes, devices, frequencies requiring grad, pair values not laid out as ``rot``
    says when ``check``)."""
    pair = _pair_values(form, rot.layout, freqs)
    if pair is None:
        return None
    c, s = pair
    w = 2 * c.shape[-1]
    if w == 0 or c.shape != s.shape or c.dtype not in _OP_DTYPES or c.dtype != s.dtype:
        return None
    if torch.is_grad_enabled() and (c.requires_grad or s.requires_grad):
        return None  # the op gives no gradient to the frequencies; the original does
    rank = xs[0].dim()
    for x in xs:
        if not isinstance(x, Tensor) or x.dim() != rank or x.dtype not in _OP_DTYPES:
            return None
        if x.dtype == torch.float64 and not rot.float64:
            return None
        if x.device != c.device or not (x.shape[-1] == w or (rot.partial and x.shape[-1] > w)):
            return None
    if rank < 2 or xs[0].shape[-1] != xs[-1].shape[-1]:
        return None
    shape = _positions_shape(tuple(c.shape[:-1]), rank - 1, rot.dims, tuple(x.shape[:-1] for x in xs))
    if shape is None:
        return None
    if check and not torch.compiler.is_compiling() and not _laid_out(form, rot.layout, freqs):
        return None
    n = c.numel() // c.shape[-1]
    table = torch.cat([c, s], dim=-1).reshape(n, w)
    positions = torch.arange(n, device=c.device).view(shape)
    interleaved = rot.pairing == "interleaved"
    outs: list[Tensor] = []
    if len(xs) == 2 and xs[0].dtype == xs[1].dtype:
        x, y = _as_operand(xs[0], table, rot), _as_operand(xs[1], table, rot)
        outs = list(apply_rotary_qk(x, y, positions, _table_for(x, table), interleaved=interleaved))
    else:
        for x0 in xs:
            x = _as_operand(x0, table, rot)
            outs.append(apply_rotary(x, positions, _table_for(x, table), interleaved=interleaved))
    if rot.keep_dtype:
        outs = [o if o.dtype == x0.dtype else o.to(x0.dtype) for o, x0 in zip(outs, xs, strict=True)]
    return tuple(outs)


def _as_operand(x: Tensor, table: Tensor, rot: _Form) -> Tensor:
    """``x`` in the dtype the op computes ``rot`` in: ``x``'s own where a float32 table gives the same
    (float32 arithmetic, one rounding to ``x``'s dtype), else the promotion of ``x`` with the table."""
    if not (rot.keep_dtype and table.dtype == torch.float32):
        dtype = torch.promote_types(x.dtype, table.dtype)
        x = x.to(dtype) if x.dtype != dtype else x
    return x if x.stride(-1) == 1 else x.contiguous()


def _table_for(x: Tensor, table: Tensor) -> Tensor:
    return table if table.dtype in (torch.float32, x.dtype) else table.float()

"""Float64 reference implementations of the rotary map, written for clarity.

Three independent forms of the same linear map (they agree to ~1e-15):

* :func:`rotary_matrix`   - build the block-diagonal rotation ``R(p)`` and compute ``x R(p)``;
* :func:`rotary_complex`  - view each pair as a complex number and multiply by ``e^{i a}``;
* :func:`rotary_hadamard` - ``x * cos + rot(x) * sin`` element-wise.

Each takes the arguments of :func:`rope_ext.apply_rotary` (``x [..., head_dim]``, integer ``positions``
broadcastable to ``x.shape[:-1]``, ``cos_sin [P, rotary_dim]`` = cos half then sin half) and returns a
float64 tensor of x's shape; features ``[rotary_offset, rotary_offset + rotary_dim)`` are rotated, the
others passed through. ``inverse=True`` rotates by the negative angle. With ``mrope_section`` (MRoPE),
``positions`` is ``[3, ...]`` and pair ``j`` uses the row of section ``mrope_rows(...)[j]``. Pairs are
``(j, j + rotary_dim/2)`` (half-split, GPT-NeoX / HF ``rotate_half``) or ``(2j, 2j+1)`` when
``interleaved`` (GPT-J / RoFormer / complex form).

Also here, the HF-style eager formula as transformers writes it, in the input dtype (the baseline the
benchmark times, not a float64 reference): :func:`hf_apply_rotary_pos_emb` with its helpers
:func:`hf_rotate_half` (the same function as :func:`rotate_half`) and :func:`hf_rotate_every_two`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "inv_freq",
    "cos_sin_table",
    "rotary_matrix",
    "rotary_complex",
    "rotary_hadamard",
    "mrope_rows",
    "rotate_half",
    "hf_rotate_half",
    "hf_rotate_every_two",
    "hf_apply_rotary_pos_emb",
]


def inv_freq(rotary_dim: int, base: float = 10000.0) -> Tensor:
    """``base ** (-2j / rotary_dim)`` for ``j < rotary_dim / 2``, float64 ``[rotary_dim / 2]`` on the CPU
    (whatever the default device)."""
    return base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim)


def cos_sin_table(n_positions: int, rotary_dim: int, base: float = 10000.0) -> Tensor:
    """Float64 ``[n_positions, rotary_dim]`` on the CPU: ``cos(p inv_j)`` for ``j < rotary_dim/2``, then
    ``sin``."""
    p = torch.arange(n_positions, dtype=torch.float64, device="cpu")
    angles = p[:, None] * inv_freq(rotary_dim, base)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def mrope_rows(half: int, mrope_section, mrope_interleaved: bool = False) -> Tensor:
    """MRoPE: the section (0 temporal, 1 height, 2 width) whose position rotates each of the ``half`` pairs,
    int64 ``[half]``. Contiguous sections (Qwen2-VL): ``t`` pairs, then ``h``, then ``w``. Interleaved
    (Qwen3-VL): pair ``j`` is height when ``j % 3 == 1 and j < 3 h``, width when ``j % 3 == 2 and
    j < 3 w``, else temporal."""
    t, hh, w = mrope_section
    j = torch.arange(half)
    if mrope_interleaved:
        rows = torch.zeros(half, dtype=torch.long)
        rows[(j % 3 == 1) & (j < 3 * hh)] = 1
        rows[(j % 3 == 2) & (j < 3 * w)] = 2
        return rows
    return (j >= t).long() + (j >= t + hh).long()


def _cos_sin(
    x: Tensor, positions: Tensor, cos_sin: Tensor, inverse: bool, mrope_section=None, mrope_interleaved=False
) -> tuple[Tensor, Tensor]:
    """Per-row cos and sin, float64 ``[*x.shape[:-1], rotary_dim / 2]``."""
    rows = cos_sin.to(torch.float64)[positions.long()]
    h = cos_sin.shape[-1] // 2
    c, s = rows[..., :h], rows[..., h:]
    if mrope_section is not None:  # rows [3, ..., rotary_dim]: pair j from its section's row
        sec = mrope_rows(h, mrope_section, mrope_interleaved).to(rows.device)
        c = torch.where(sec == 0, c[0], torch.where(sec == 1, c[1], c[2]))
        s = torch.where(sec == 0, s[0], torch.where(sec == 1, s[1], s[2]))
    if inverse:
        s = -s
    shape = (*x.shape[:-1], h)
    return c.expand(shape), s.expand(shape)


def _pairs(x: Tensor, rotary_dim: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    """The two features of every pair, each ``[..., rotary_dim / 2]``."""
    rot = x[..., :rotary_dim]
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    return rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]


def _unpairs(y1: Tensor, y2: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        return torch.stack([y1, y2], dim=-1).flatten(-2)
    return torch.cat([y1, y2], dim=-1)


def _with_pass(x: Tensor, rotated: Tensor, rotary_dim: int) -> Tensor:
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def _at_offset(form, x: Tensor, positions, cos_sin, interleaved, inverse, rotary_offset, *mrope) -> Tensor:
    """``form`` on the features from ``rotary_offset`` on; the ones before it pass through."""
    x = x.to(torch.float64)
    sec, il = mrope
    tail = form(
        x[..., rotary_offset:],
        positions,
        cos_sin,
        interleaved=interleaved,
        inverse=inverse,
        mrope_section=sec,
        mrope_interleaved=il,
    )
    return torch.cat([x[..., :rotary_offset], tail], dim=-1)


def rotary_matrix(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> Tensor:
    """Rotation-matrix form: ``x' = x R(p)`` with ``R(p)`` block-diagonal 2x2 rotations (RoFormer)."""
    if rotary_offset:
        return _at_offset(
            rotary_matrix,
            x,
            positions,
            cos_sin,
            interleaved,
            inverse,
            rotary_offset,
            mrope_section,
            mrope_interleaved,
        )
    x = x.to(torch.float64)
    r = cos_sin.shape[-1]
    c, s = _cos_sin(x, positions, cos_sin, inverse, mrope_section, mrope_interleaved)
    R = torch.zeros(*x.shape[:-1], r, r, dtype=torch.float64, device=x.device)
    j = torch.arange(r // 2, device=x.device)
    i1, i2 = (2 * j, 2 * j + 1) if interleaved else (j, j + r // 2)
    # Row-vector convention: y[i1] = x[i1] c - x[i2] s, y[i2] = x[i1] s + x[i2] c.
    R[..., i1, i1] = c
    R[..., i2, i1] = -s
    R[..., i1, i2] = s
    R[..., i2, i2] = c
    rotated = (x[..., None, :r] @ R).squeeze(-2)
    return _with_pass(x, rotated, r)


def rotary_complex(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> Tensor:
    """Complex form: pair ``j`` is ``z_j = x1 + i x2`` and ``z_j' = z_j e^{i a_j}`` (Meta's Llama)."""
    if rotary_offset:
        return _at_offset(
            rotary_complex,
            x,
            positions,
            cos_sin,
            interleaved,
            inverse,
            rotary_offset,
            mrope_section,
            mrope_interleaved,
        )
    x = x.to(torch.float64)
    r = cos_sin.shape[-1]
    c, s = _cos_sin(x, positions, cos_sin, inverse, mrope_section, mrope_interleaved)
    x1, x2 = _pairs(x, r, interleaved)
    z = torch.view_as_complex(torch.stack([x1, x2], dim=-1).contiguous())
    w = torch.view_as_complex(torch.stack([c, s], dim=-1).contiguous())
    y = torch.view_as_real(z * w)
    return _with_pass(x, _unpairs(y[..., 0], y[..., 1], interleaved), r)


def rotate_half(x: Tensor) -> Tensor:
    """HF's ``rotate_half``: ``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rotary_hadamard(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> Tensor:
    """Element-wise form: ``x' = x * cos + rot(x) * sin``, ``rot`` swapping each pair with a sign."""
    if rotary_offset:
        return _at_offset(
            rotary_hadamard,
            x,
            positions,
            cos_sin,
            interleaved,
            inverse,
            rotary_offset,
            mrope_section,
            mrope_interleaved,
        )
    x = x.to(torch.float64)
    r = cos_sin.shape[-1]
    c, s = _cos_sin(x, positions, cos_sin, inverse, mrope_section, mrope_interleaved)
    x1, x2 = _pairs(x, r, interleaved)
    cos = _unpairs(c, c, interleaved)
    sin = _unpairs(s, s, interleaved)
    rot = _unpairs(-x2, x1, interleaved)
    return _with_pass(x, x[..., :r] * cos + rot * sin, r)


# HF-style eager formula ------------------------------------------------------------------------------

hf_rotate_half = rotate_half
"""transformers' ``rotate_half`` (the same function as :func:`rotate_half`): ``x [..., D]`` (any float
dtype, ``D`` even) to ``(-x2, x1)`` on the two halves of the last dim; same shape and dtype as ``x``."""


def hf_rotate_every_two(x: Tensor) -> Tensor:
    """transformers' GPT-J ``rotate_every_two``: ``(x0, x1, ..) -> (-x1, x0, ..)`` on adjacent pairs.

    ``x [..., D]`` (any float dtype, ``D`` even); returns a tensor of the same shape and dtype.
    """
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def hf_apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on token-major ``q [T, Hq, D]``, ``k [T, Hkv, D]``.

    ``cos``, ``sin``: ``[T, rotary_dim]``, one row per token, already gathered at the tokens' positions
    and laid out for the pairing (each half repeated for half-split, each value repeated twice when
    ``interleaved``), in the dtype of q and k (HF casts them to it). Arithmetic runs in the input dtype
    (this is the eager baseline, not a float64 reference); partial rotary (``rotary_dim < D``) splits off
    the pass-through features and concatenates them back, as HF's partial-rotary models do. Returns new
    ``(q', k')`` of the shapes and dtype of ``q`` and ``k``.
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rot = hf_rotate_every_two if interleaved else hf_rotate_half
    r = cos.shape[-1]

    def one(x: Tensor) -> Tensor:
        if r == x.shape[-1]:
            return (x * cos) + (rot(x) * sin)
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat(((x_rot * cos) + (rot(x_rot) * sin), x_pass), dim=-1)

    return one(q), one(k)

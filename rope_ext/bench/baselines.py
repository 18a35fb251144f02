"""The HF-style eager formula as transformers writes it, in the input dtype: the baseline the benchmark
times (``hf-eager``, ``hf-compile``), not a float64 reference (those are in :mod:`rope_ext.reference`).

:func:`hf_apply_rotary_pos_emb` with its helpers :func:`hf_rotate_half` (the same function as
:func:`rope_ext.reference.rotate_half`) and :func:`hf_rotate_every_two`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rope_ext.reference import rotate_half

__all__ = ["hf_apply_rotary_pos_emb", "hf_rotate_every_two", "hf_rotate_half"]

hf_rotate_half = rotate_half
"""transformers' ``rotate_half`` (the same function as :func:`rope_ext.reference.rotate_half`): ``x [..., D]``
(any float dtype, ``D`` even) to ``(-x2, x1)`` on the two halves of the last dim; same shape and dtype."""


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

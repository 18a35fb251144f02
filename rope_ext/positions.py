"""The positions rule of every op: how a positions tensor maps to the tokens and heads of x.

One definition, applied by the kernels' argument checks (csrc/ops/binding.cpp, ``make_params``), the
fake kernels and the float64 references; README, "Positions", states it with a table per layout.
"""

from __future__ import annotations

from collections.abc import Sequence


def positions_shape(
    positions: Sequence[int], batch: Sequence[int], name: str = "x", token_major: bool = False
) -> tuple[int, ...]:
    """The shape that positions of shape ``positions`` broadcast as against ``batch = x.shape[:-1]``
    (numpy rules from there on), or ``ValueError``.

    Positions of the rank of ``batch``, a scalar, or positions whose last dim is 1 broadcast as they
    are. Any other shape could align a token dim with the heads when sizes coincide (``[T]`` against
    ``[T, H]`` with ``T == H``) and is rejected, except that the token-major ops (``token_major``: x is
    ``[T, H, D]``) read ``[T]`` as ``[T, 1]``, one position per token.
    """
    shape, n = tuple(positions), len(batch)
    if not (len(shape) == 0 or len(shape) >= n or shape[-1] == 1):
        if not (token_major and len(shape) == n - 1):
            raise ValueError(
                f"positions of shape {list(shape)} are ambiguous for {name}.shape[:-1] = {list(batch)}: "
                f"give them the rank of {name}.shape[:-1] with a 1 where they broadcast "
                "(positions[..., None] for [T] with [T, H, D], [B, S, 1] for [B, S, H, D], [B, 1, S] for "
                "[B, H, S, D])"
            )
        shape = (*shape, 1)
    ok = len(shape) <= n and all(
        not (type(p) is int and type(b) is int) or p in (1, b)
        for p, b in zip(reversed(shape), reversed(tuple(batch)), strict=False)
    )
    if not ok:
        raise ValueError(
            f"positions of shape {list(positions)} must be broadcastable to {name}.shape[:-1] = {list(batch)}"
        )
    return shape

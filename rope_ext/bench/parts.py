"""Parts: a piece of a provider's work timed on its own, reported as a fraction of the rotation it feeds.

* ``varlen_positions`` (packed workloads, ``--seqs``): ``rope_ext.varlen_positions(cu_seqlens,
  total_tokens=T)``, the positions that the ``rope_ext+varlen`` provider computes before it rotates; its
  ``frac_rotation`` is its time over that of ``rope_ext`` in place (the rotation alone, on positions
  computed beforehand).

A part returns no q and k, so it is not validated; it is timed in the rounds with the providers and the
ceilings. ``--providers`` selects parts by name as it selects providers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import rope_ext

from .workloads import Case

__all__ = ["PART_OF", "parts"]

# The provider row (``name|mode``) whose time each part's ``frac_rotation`` divides by.
PART_OF = {"varlen_positions": "rope_ext|inplace"}


def parts(case: Case) -> dict[str, Callable[[], Any]]:
    """The parts that apply to ``case`` (see the module docstring), by name."""
    out: dict[str, Callable[[], Any]] = {}
    if case.cu_seqlens is not None:
        cu, tokens, positions = case.cu_seqlens, case.tokens, rope_ext.varlen_positions
        out["varlen_positions"] = lambda: positions(cu, total_tokens=tokens)
    return out

"""Ceilings: what this machine does with the same bytes as q and k, measured in the same run.

* ``stream in-place``: ``a.mul_(1.0)`` on one float32 buffer of q's plus k's bytes (the in-place
  streaming bandwidth; dtype-independent);
* ``clone``: ``q.clone()``, ``k.clone()`` (fresh outputs: the floor for any op that returns new tensors);
* ``copy into``: ``a.copy_(b)`` between float32 buffers of q's plus k's bytes (for reference);
* ``no-op call``: a registered op with the schema of ``rope_ext::rotary_qk_`` whose kernel does nothing,
  called through ``torch.ops`` from Python: the cost of a call, to judge small (decode) workloads;
* ``tiny kernel`` (GPU only): ``one.zero_()`` on a one-element tensor, the device time of an (almost)
  empty kernel launch; on a GPU the decode ratio ``x no-op`` is taken against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .workloads import Case, clones

__all__ = ["CEILING_FOR_MODE", "ceilings", "noop_op"]

_noop_lib: torch.library.Library | None = None


def noop_op() -> Callable[..., None]:
    """A registered op with the schema of ``rope_ext::rotary_qk_`` whose kernel does nothing.

    Defined with ``torch.library`` (a Python kernel registered for every backend), called as
    ``torch.ops.rope_bench.noop_qk_.default(...)``: the dispatcher, the schema's argument parsing and the
    return to Python are paid exactly as for the real op; only the kernel body is empty (its Python
    body costs a little more than a C++ one would, so the floor is generous by ~1 us).
    """
    global _noop_lib
    if _noop_lib is None:
        _noop_lib = torch.library.Library("rope_bench", "DEF")
        # rotary_qk_'s own schema (so it follows every change to it), renamed.
        schema = str(torch.ops.rope_ext.rotary_qk_.default._schema)
        _noop_lib.define(schema.replace("rope_ext::rotary_qk_", "noop_qk_", 1))
        _noop_lib.impl("noop_qk_", lambda *args: None, "CompositeExplicitAutograd")
    return torch.ops.rope_bench.noop_qk_.default


def ceilings(case: Case) -> dict[str, Callable[[], Any]]:
    """Reference operations over the bytes of q and k (see the module docstring).

    The streaming ceilings use one float32 buffer of q's plus k's bytes (one parallel region per call,
    as the rotary op itself), so they measure the machine, not torch's kernels for a dtype.
    """
    nq, nk = case.qk_bytes()
    dev = case.device
    a = torch.ones(max((nq + nk) // 4, 1), device=dev)
    src = torch.ones_like(a)
    q, k = case.q, case.k
    noop = noop_op()
    qn, kn = clones(case)
    pos, cs = case.rope_positions, case.cos_sin
    out = {
        "stream in-place": lambda: a.mul_(1.0),
        "clone": lambda: (q.clone(), k.clone()),
        "copy into": lambda: a.copy_(src),
        # called as apply_rotary_qk_ calls rotary_qk_: the pairing passed only when interleaved
        "no-op call": (lambda: noop(qn, kn, pos, cs, True))
        if case.interleaved
        else (lambda: noop(qn, kn, pos, cs)),
    }
    if dev.type == "cuda":
        # The device time of launching a kernel that does (almost) nothing: the floor for decode steps.
        one = torch.zeros(1, device=dev)
        out["tiny kernel"] = lambda: one.zero_()
    return out


# The ceiling each mode's "% ceil" is taken against.
CEILING_FOR_MODE = {"inplace": "stream in-place", "out": "clone", "backward": "clone"}

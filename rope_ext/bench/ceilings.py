"""Ceilings: what this machine does with the same bytes as q and k, measured in the same run.

* ``stream in-place``: ``a.mul_(1.0)`` on one float32 buffer of q's plus k's bytes (the in-place
  streaming bandwidth; dtype-independent);
* ``clone``: ``q.clone()``, ``k.clone()`` (fresh outputs: the floor for any op that returns new tensors);
* ``copy into``: ``a.copy_(b)`` between float32 buffers of q's plus k's bytes (for reference);
* ``no-op call``: a registered op with the schema of ``rope_ext::rotary_qk_`` whose kernel does nothing,
  called through ``torch.ops`` from Python: the cost of a call, to judge small (decode) workloads;
* ``tiny kernel`` (GPU only): ``one.zero_()`` on a one-element tensor, the device time of an (almost)
  empty kernel launch; on a GPU the decode ratio ``x no-op`` is taken against it.

Only when the run has the cache modes (``cache``, ``cache-fp8``; ``qknorm`` takes ``stream in-place``,
which streams exactly the q and k heads of its packed qkv, read and written):

* ``stream cache`` / ``stream cache-fp8``: the bytes of one RoPE + KV-cache write call, streamed through
  float32 buffers, timed as one callable: ``a.mul_(1.0)`` on q's plus k's bytes (q and k read and
  written, as the in-place stream), then ``w[:m].copy_(r[:m])`` from a buffer ``r`` of v's bytes into a
  buffer ``w`` of the cache rows' bytes (``Case.cache_bytes``: k's and v's rows in q's dtype, or one byte
  per value for fp8), ``m`` = the smaller of the two, and the rest of the larger one streamed alone:
  ``w[m:].fill_(0.0)`` (write only; caches of q's dtype: the key rows, as many bytes as v) or
  ``r[m:].sum()`` (read only; fp32 v into fp8 caches: half of v). In all: q and k read and written, v
  read, the cache rows written once - the minimum traffic of the fused op, without cos/sin, positions and
  slots (k is read once: the fused op writes the cache's key rows from the rotation it already holds).

Only when the run has the MLA modes (``mla``, ``mla-fp8``), on presets with an MLA shape:

* ``stream mla`` / ``stream mla-fp8``: the same streams over the bytes of one RoPE + MLA latent-cache write
  (:mod:`.mla`): ``a.mul_(1.0)`` on q's rope part plus k_pe (the workload's q and k: read and written),
  ``kv_c`` read (in v's place) and the latent cache rows written (``Case.mla_cache_bytes``: ``kv_lora_rank +
  rope`` values a token in q's dtype, or one byte each for fp8; caches of q's dtype: the rest is the k_pe
  columns, written alone; fp8: the rest of kv_c, read alone). q's nope part is not streamed: the op does
  not touch it.

Only when the run has the rerotate modes (``rerotate``, ``rerotate-fp8``; every preset):

* ``stream rerotate`` / ``stream rerotate-fp8``: ``a.mul_(1.0)`` on one float32 buffer of the bytes of the
  cache rows' rotated features (``T * Hk * rotary_dim`` values in q's dtype, or one byte each for fp8;
  :func:`~rope_ext.bench.rerotate.rerotate_row_bytes`): those bytes read and written once in place, the
  minimum traffic of the op without its slots and deltas (:mod:`.rerotate`). q and k are not streamed: the
  op does not touch them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .presets import MLA_MODES, REROTATE_MODES
from .rerotate import rerotate_row_bytes
from .workloads import Case, clones

__all__ = ["CEILING_FOR_MODE", "SERVING_STREAMS", "ceiling_bytes", "ceilings", "noop_op"]

_noop_lib: torch.library.Library | None = None


def noop_op() -> Callable[..., None]:
    """A registered op with the schema of ``rope_ext::rotary_qk_`` whose kernel does nothing.

    Defined with ``torch.library`` (a Python kernel registered for every backend), called as
    ``torch.ops.rope_bench.noop_qk_.default(...)``: the dispatcher, the schema's argument parsing and the
    return to Python are paid exactly as for the real op; only the kernel body is empty (its Python
    body costs a little more than a C++ one would, so the floor is generous by about one Python call).
    """
    global _noop_lib
    if _noop_lib is None:
        _noop_lib = torch.library.Library("rope_bench", "DEF")
        # rotary_qk_'s own schema (so it follows every change to it), renamed.
        schema = str(torch.ops.rope_ext.rotary_qk_.default._schema)
        _noop_lib.define(schema.replace("rope_ext::rotary_qk_", "noop_qk_", 1))
        _noop_lib.impl("noop_qk_", lambda *args: None, "CompositeExplicitAutograd")
    return torch.ops.rope_bench.noop_qk_.default


def _stream_cache(case: Case, read_bytes: int, write_bytes: int) -> Callable[[], Any]:
    """The ``stream cache`` and ``stream mla`` ceilings (see the module docstring): q and k streamed in
    place, ``read_bytes`` (v, kv_c) read and ``write_bytes`` (the cache rows) written."""
    dev = case.device
    a = torch.ones(max(sum(case.qk_bytes()) // 4, 1), device=dev)
    r = torch.ones(max(read_bytes // 4, 1), device=dev)
    w = torch.ones(max(write_bytes // 4, 1), device=dev)
    m = min(r.numel(), w.numel())
    rm, wm, r_rest, w_rest = r[:m], w[:m], r[m:], w[m:]
    if w_rest.numel():

        def run() -> None:
            a.mul_(1.0)
            wm.copy_(rm)
            w_rest.fill_(0.0)

    elif r_rest.numel():

        def run() -> None:
            a.mul_(1.0)
            wm.copy_(rm)
            r_rest.sum()

    else:

        def run() -> None:
            a.mul_(1.0)
            wm.copy_(rm)

    return run


def _stream_parts(case: Case, name: str) -> tuple[int, int]:
    """(bytes read, bytes written) of a ``stream cache`` / ``stream mla`` ceiling besides q and k."""
    if name.startswith("stream mla"):
        return case.kv_c_bytes(), case.mla_cache_bytes(name == "stream mla-fp8")
    return case.v_bytes(), case.cache_bytes(name == "stream cache-fp8")


def ceiling_bytes(case: Case, name: str) -> int:
    """The bytes a ceiling streams (its GB/s counts them): q and k read and written for the q/k ceilings;
    ``stream cache`` (``stream mla``): that, v (kv_c) read and the cache rows written; ``stream rerotate``:
    the cache rows' rotated features read and written, without q and k."""
    qk = sum(case.qk_bytes())
    if name.startswith("stream rerotate"):
        return 2 * rerotate_row_bytes(case, name == "stream rerotate-fp8")
    if name in SERVING_STREAMS:
        return 2 * qk + sum(_stream_parts(case, name))
    return 2 * qk


def ceilings(case: Case, modes: Sequence[str] = ()) -> dict[str, Callable[[], Any]]:
    """Reference operations over the bytes of q and k (see the module docstring).

    The streaming ceilings use one float32 buffer of q's plus k's bytes (one parallel region per call,
    as the rotary op itself), so they measure the machine, not torch's kernels for a dtype. ``modes``:
    the run's modes; ``cache`` and ``cache-fp8`` add their ``stream cache`` ceilings, ``mla`` and
    ``mla-fp8`` their ``stream mla`` ones (presets with an MLA shape), ``rerotate`` and ``rerotate-fp8``
    their ``stream rerotate`` ones.
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
    for mode in ("cache", "cache-fp8", *MLA_MODES):
        if mode in modes and (mode not in MLA_MODES or case.preset.mla is not None):
            name = CEILING_FOR_MODE[mode]
            out[name] = _stream_cache(case, *_stream_parts(case, name))
    for mode in REROTATE_MODES:
        if mode in modes:
            rows = torch.ones(max(rerotate_row_bytes(case, mode == "rerotate-fp8") // 4, 1), device=dev)
            out[CEILING_FOR_MODE[mode]] = lambda rows=rows: rows.mul_(1.0)
    return out


# The ceiling each mode's "% ceil" is taken against.
CEILING_FOR_MODE = {
    "inplace": "stream in-place",
    "out": "clone",
    "backward": "clone",
    "cache": "stream cache",
    "cache-fp8": "stream cache-fp8",
    "qknorm": "stream in-place",
    "mla": "stream mla",
    "mla-fp8": "stream mla-fp8",
    "rerotate": "stream rerotate",
    "rerotate-fp8": "stream rerotate-fp8",
}
# The serving modes' own streams: a row of one of them counts (and reports) the bytes it streams.
SERVING_STREAMS = (
    "stream cache",
    "stream cache-fp8",
    "stream mla",
    "stream mla-fp8",
    "stream rerotate",
    "stream rerotate-fp8",
)

"""Probes: checks that rope_ext computes what a model's rotary modules and functions compute.

:func:`~.patch.patch_transformers` swaps nothing it has not first called on probes beside its rope_ext
stand-in; a failed check raises :class:`_CheckFailed` naming the difference (``patch_transformers`` turns it
into a ``TypeError``, the model unchanged). A function is probed with random q, k and pair values (the maps
are linear in each, so any other pairing, layout, width or sign differs by far more than the tolerance), a
rotary module with position ids chosen to cover each of its regimes.

* :func:`_function_rotation` - which :class:`~.rotation._Rotation` a modeling module's ``apply_rotary*``
  function computes (pairing and output order, both ``unsqueeze_dim`` layouts, partial rotary width, output
  dtype), or none that rope_ext implements;
* :func:`_check_rotary` - an :class:`~.adapter.HFRotaryAdapter` whose cos / sin equal those of the model's
  rotary module on positions covering every regime (past the trained length and back, MRoPE sections);
* :func:`_signature` / :func:`_code_names` - the arguments a function takes, the names a code object reads.
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .adapter import HFRotaryAdapter
from .rotation import _CANDIDATES, _as_layout, _rotate, _Rotation

# ---------------------------------------------------------------------------------------------
# Shared: the failure, calling a probed function, what a function takes and reads


class _CheckFailed(Exception):
    """A check of :func:`patch_transformers` failed; the message says which and why."""


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the probed function is a finding
        return e


class _Signature(NamedTuple):
    """How a function ``f(q, k, cos, sin, ...)`` takes its other arguments."""

    names: tuple[str, ...]  # parameters after the first four that can be passed by position
    defaults: dict[str, Any]  # every named parameter after the first four: its default (or _EMPTY)
    unsqueeze_default: int  # the default of ``unsqueeze_dim`` (1 when there is no such parameter)

    @property
    def has_unsqueeze(self) -> bool:
        return "unsqueeze_dim" in self.defaults


_EMPTY = inspect.Parameter.empty


def _signature(fn: Callable, name: str = "the function") -> _Signature:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise _CheckFailed(f"{name} has no signature to read: {e}") from e
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) < 4 or any(p.kind not in positional for p in params[:4]):
        raise _CheckFailed(f"{name} does not take (q, k, cos, sin) as its first four positional arguments")
    names, defaults = [], {}
    for p in params[4:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.append(p.name)
        defaults[p.name] = p.default
    ud = defaults.get("unsqueeze_dim", 1)
    return _Signature(tuple(names), defaults, ud if type(ud) is int else 1)


def _code_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the functions nested in it look up (globals, attributes, methods)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


# ---------------------------------------------------------------------------------------------
# What a modeling module's function computes


def _difference(got: Any, want: Any) -> float:
    """Max abs difference of two ``(q, k)`` pairs relative to ``1 + max |want|``; inf when their
    structure, shapes or dtypes differ."""
    if not (isinstance(want, tuple) and isinstance(got, tuple) and len(want) == len(got) == 2):
        return math.inf
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if not isinstance(b, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        if b.numel():
            err = (a.double() - b.double()).abs().max().item() / (1.0 + b.double().abs().max().item())
            worst = max(worst, err if err == err else math.inf)
    return worst


# Probe tolerance, relative to 1 + the largest output: rope_ext's float32 arithmetic against the
# function's on N(0, 1) inputs agrees to a few float32 ulps (~1e-7); any other pairing, layout, width or
# sign differs by O(1).
_PROBE_TOL = 1e-5
_PROBE_TOL_BF16 = 2e-2  # outputs rounded to bfloat16 (8 bits): an ulp either way is 2**-8 relative


def _probe_inputs(g: torch.Generator, q_shape, k_shape, cos_lead, w: int, layout: str, dtype=torch.float32):
    q = torch.randn(q_shape, generator=g).to(dtype)
    k = torch.randn(k_shape, generator=g).to(dtype)
    # Any pair values (not only cos / sin of an angle): the maps are linear in them.
    c = torch.randn(*cos_lead, w // 2, generator=g)
    s = torch.randn(*cos_lead, w // 2, generator=g)
    return q, k, _as_layout(c, layout), _as_layout(s, layout)


def _function_rotation(fn: Callable, name: str, layout: str, head_dim: int, rotary_dim: int) -> _Rotation:
    """The :class:`_Rotation` that ``fn(q, k, cos, sin, ...)`` computes for ``cos`` / ``sin`` laid out as
    ``layout`` and ``rotary_dim`` wide, found on random probes; raises :class:`_CheckFailed` when rope_ext
    computes none of what ``fn`` does.

    Probes (float32 unless said): ``q [2, 3, 5, w]``, ``k [2, 2, 5, w]``, ``cos [2, 5, w]`` with the default
    ``unsqueeze_dim``; ``[2, 5, 3, w]`` / ``[2, 5, 2, w]`` with ``cos [1, 5, w]`` and ``unsqueeze_dim=2``;
    ``q`` / ``k`` ``head_dim`` wide when that is more than ``w = rotary_dim`` (partial rotary); bfloat16
    ``q`` / ``k`` with float32 ``cos`` / ``sin`` (the output dtype rule).
    """
    sig = _signature(fn, name)
    g = torch.Generator().manual_seed(0)
    w = rotary_dim
    ud = sig.unsqueeze_default
    if ud not in (1, -3):
        raise _CheckFailed(f"{name}: its default unsqueeze_dim is {ud}, not 1")

    def shapes(layout_: str, width: int):
        if layout_ == "bhsd":
            return (2, 3, 5, width), (2, 2, 5, width), (2, 5)
        return (2, 5, 3, width), (2, 5, 2, width), (1, 5)

    def context(desc: str, q: Tensor, k: Tensor, cos: Tensor) -> str:
        return f"{name}{desc} on q {list(q.shape)}, k {list(k.shape)}, cos / sin {list(cos.shape)}"

    # 1. The pairing (and output order) on q / k as wide as cos.
    q, k, cos, sin = _probe_inputs(g, *shapes("bhsd", w), w, layout)
    want = _call(fn, q, k, cos, sin)
    if isinstance(want, Exception):
        raise _CheckFailed(f"{context('(q, k, cos, sin)', q, k, cos)} raised {type(want).__name__}: {want}")
    tried = []
    for pairing, output in _CANDIDATES:
        rot = _Rotation(pairing, layout, output)
        err = _difference(_rotate(q, k, cos, sin, ud, rot, check_pairs=False), want)
        if err <= _PROBE_TOL:
            break
        tried.append(f"{rot.describe()}: {err:.3g}")
    else:
        raise _CheckFailed(
            f"{context('(q, k, cos, sin)', q, k, cos)} computes none of the rotations rope_ext implements "
            f"(relative max difference to {'; '.join(tried)}; tolerance {_PROBE_TOL:g})"
        )

    # 2. [batch, seq, heads, head_dim] with unsqueeze_dim=2 and cos broadcast over the batch.
    if sig.has_unsqueeze:
        q, k, cos, sin = _probe_inputs(g, *shapes("bshd", w), w, layout)
        want = _call(fn, q, k, cos, sin, unsqueeze_dim=2)
        err = _difference(_rotate(q, k, cos, sin, 2, rot, check_pairs=False), want)
        if err > _PROBE_TOL:
            got = (
                f"raised {type(want).__name__}: {want}"
                if isinstance(want, Exception)
                else f"differs by {err:.3g}"
            )
            raise _CheckFailed(f"{context('(q, k, cos, sin, unsqueeze_dim=2)', q, k, cos)}: {got}")

    # 3. Partial rotary: q / k wider than cos.
    if head_dim > w:
        q, k, cos, sin = _probe_inputs(g, *shapes("bhsd", head_dim)[:2], (2, 5), w, layout)
        want = _call(fn, q, k, cos, sin)
        if not isinstance(want, Exception):
            wide = rot._replace(partial=True)
            err = _difference(_rotate(q, k, cos, sin, ud, wide, check_pairs=False), want)
            if err > _PROBE_TOL:
                raise _CheckFailed(
                    f"{context('(q, k, cos, sin)', q, k, cos)} differs from rotating the first {w} features "
                    f"and passing the other {head_dim - w} through by {err:.3g}"
                )
            rot = wide

    # 4. Output dtypes: bfloat16 q / k with float32 cos / sin.
    q, k, cos, sin = _probe_inputs(g, *shapes("bhsd", w), w, layout, dtype=torch.bfloat16)
    want = _call(fn, q, k, cos, sin)
    if isinstance(want, Exception):
        raise _CheckFailed(f"{context('(q, k, cos, sin)', q, k, cos)} (bfloat16 q / k) raised {want!r}")
    for keep in (False, True):
        err = _difference(_rotate(q, k, cos, sin, ud, rot._replace(keep_dtype=keep), check_pairs=False), want)
        if err <= _PROBE_TOL_BF16:
            return rot._replace(keep_dtype=keep)
    raise _CheckFailed(
        f"{context('(q, k, cos, sin)', q, k, cos)} with bfloat16 q / k and float32 cos / sin returns "
        f"{[getattr(t, 'dtype', t) for t in want] if isinstance(want, tuple) else want!r}: neither the "
        "inputs' dtype nor their promotion with cos' dtype, or different values"
    )


# ---------------------------------------------------------------------------------------------
# Whether an adapter gives a rotary module's cos / sin


def _reference_rotary(child: nn.Module) -> nn.Module:
    """A float32 CPU instance of ``child``'s class built from its config (its buffers as the class makes
    them, whatever ``child``'s device or dtype), to probe."""
    config = getattr(child, "config", None)
    if config is None:
        raise _CheckFailed(f"{type(child).__name__} has no config to build a reference instance from")
    try:
        with torch.device("cpu"):
            return type(child)(config)
    except Exception as e:  # noqa: BLE001
        raise _CheckFailed(f"{type(child).__name__}(config) could not be built to check it: {e!r}") from e


def _layout_of(cos: Tensor) -> str | None:
    h = cos.shape[-1] // 2
    if torch.equal(cos[..., :h], cos[..., h:]):
        return "cat"
    if torch.equal(cos[..., 0::2], cos[..., 1::2]):
        return "repeat"
    return None


def _probe_positions(adapter: HFRotaryAdapter) -> list[Tensor]:
    """Calls that exercise every regime: positions 0..47 (two rows, the second shifted); past the trained
    length and back for ``dynamic`` / ``longrope``; ``[3, batch, seq]`` section positions for MRoPE."""
    base = torch.arange(48)
    calls = [torch.stack([base, base + 7])]
    for kind in adapter.kinds.values():
        if kind.rope_type in ("dynamic", "longrope") and kind.original_max:
            long = torch.arange(kind.original_max + 8, kind.original_max + 24)[None]
            calls += [long, calls[0]]
            break
    if adapter.mrope_section is not None:
        t = base.repeat(2, 1)
        calls.append(torch.stack([t, t.div(3, rounding_mode="floor") + 2, t % 5 + 1]))
    return calls


def _check_rotary(child: nn.Module, config: Any, max_positions: int) -> HFRotaryAdapter:
    """An adapter for ``child`` whose cos / sin equal those of ``child``'s class on probe positions (within
    float32 angle error); raises :class:`_CheckFailed` naming the difference otherwise."""
    name = type(child).__name__
    try:
        params = inspect.signature(type(child).forward).parameters
    except (TypeError, ValueError) as e:
        raise _CheckFailed(f"{name}.forward has no signature: {e}") from e
    extra = [p for p in list(params)[1:] if p not in ("x", "position_ids", "layer_type")]
    if extra:
        raise _CheckFailed(
            f"{name}.forward takes {extra}, which the adapter does not (x, position_ids, layer_type)"
        )
    ref = _reference_rotary(child)
    try:
        probe = HFRotaryAdapter(child, config, max_positions=64)
    except Exception as e:  # noqa: BLE001 - config rope_ext cannot read
        raise _CheckFailed(f"rope_ext cannot build {name}'s RoPE from the config: {e}") from e
    layer_types = probe.layer_types or (None,)
    x = torch.zeros(1, dtype=torch.float32)
    layout = None
    with torch.device("cpu"):
        for pos in _probe_positions(probe):
            for lt in layer_types:
                args = (x, pos) if lt is None else (x, pos, lt)
                want = _call(ref, *args)
                if isinstance(want, Exception):
                    raise _CheckFailed(f"{name}(x, position_ids {list(pos.shape)}) raised {want!r}")
                if not (isinstance(want, tuple) and len(want) == 2):
                    raise _CheckFailed(f"{name} returns {type(want).__name__}, not (cos, sin)")
                if layout is None:
                    layout = _layout_of(want[0])
                    if layout is None:
                        raise _CheckFailed(
                            f"{name}'s cos holds its pair values neither as cat((c, c)) nor as "
                            "repeat_interleave(c, 2)"
                        )
                    probe.layout = layout
                got = probe(*args)
                _compare_rotary(name, lt, probe.kinds[lt], probe.caches, pos, got, want)
    return HFRotaryAdapter(child, config, max_positions, layout=layout)


def _compare_rotary(name, layer_type, kind, caches, pos, got, want) -> None:
    # transformers computes angles in float32: each is off by a few ulps of the angle (position times
    # frequency), rope_ext's by float64 rounding. Tolerance: 2e-6 plus 4e-6 of the angle, times the
    # attention factor; a wrong base, scaling, factor list or section is off by orders more.
    main = [c for k, c in caches.items() if k.startswith(kind.prefix)]
    amp = max(c.attention_factor for c in main)
    inv = max(float(c.inv_freq.max()) for c in main)
    p = pos if kind.mrope_section is None or pos.dim() == 2 else pos.amax(0)
    tol = amp * (2e-6 + 4e-6 * p[..., None].double() * inv)
    for part, a, b in (("cos", got[0], want[0]), ("sin", got[1], want[1])):
        if a.shape != b.shape:
            raise _CheckFailed(f"{name} {part} is {list(b.shape)}, the adapter's {list(a.shape)}")
        excess = (a.double() - b.double()).abs() - tol
        if excess.max() > 0:
            at = int(excess.flatten().argmax())
            which = "" if layer_type is None else f" (layer type {layer_type!r})"
            err = (a.double() - b.double()).abs().flatten()[at].item()
            raise _CheckFailed(
                f"{name}{which} {part} differs from rope_ext's {kind.rope_type} RoPE by {err:.3g} "
                f"(tolerance {tol.expand_as(a).flatten()[at].item():.3g}) at position ids {list(pos.shape)}"
            )

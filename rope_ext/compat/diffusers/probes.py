"""The check run on a diffusers rotation function before it is swapped: which call forms of it rope_ext's op
computes, found on random probes.

:func:`_function_spec` calls the function on small random tensors, every way it could be called: the
rotated tensor(s) as ``[B, S, H, D]``, ``[B, H, S, D]`` or flat ``[B, S, H * D]``; the frequencies in each
of the five forms of :data:`~.rotation.FORMS` (each real form in both layouts) with leading shapes such as
``[S]``, ``[1, S, 1]``, ``[B, S]``; its mode arguments (``use_real``, ``use_real_unbind_dim``,
``sequence_dim``, ...) at their defaults and at the other values of their kind (both bools; -2, -1, 1, 2 for
an int). Each output is compared with the rotations rope_ext's op computes (pairing, where the frequencies'
dims go), and the matches make a :class:`_Spec`: per mode values, form, rank of ``x`` and singleton pattern
of the frequencies' leading shape, the :class:`~.rotation._Form` that computes it, with partial rotary width
and the output dtype rule (bfloat16 and float64 ``x``) checked on further probes. Pair values are random
numbers, not cos / sin of angles: every map involved is linear in them, and any other pairing, layout or
alignment differs by O(1) while rope_ext's float32 arithmetic agrees with the function's to a few ulps.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .rotation import _LAYOUTS, _Form, _make_freqs, _positions_shape, _rotate

__all__: list[str] = []


class _CheckFailed(Exception):
    """A check of :func:`patch_diffusers` failed; the message says which and why, ``short`` in a few words."""

    def __init__(self, message: str, short: str | None = None):
        super().__init__(message)
        self.short = short or message


class _Spec(NamedTuple):
    """How to call rope_ext for a function ``f(*xs, *freqs, **modes)``.

    ``n_x`` tensors rotated (1, or 2 for ``(q, k, ...)`` functions returning both), ``required`` the names of
    the rotated and frequency parameters, ``modes`` the other parameters taking a bool / int / str / None
    (``positional`` of them can be passed by position), ``defaults`` their defaults, ``forms`` the call
    forms the op computes: ``(mode values, form, rank of x, lead pattern) -> _Form``, the lead pattern
    being which of the frequencies' leading dims are 1."""

    n_x: int
    required: tuple[str, ...]
    modes: tuple[str, ...]
    positional: int
    defaults: tuple
    forms: dict

    def describe(self) -> str:
        """The call forms found, e.g. ``"interleaved pairs, (cos, sin) repeat_interleave"``, most used
        first."""
        counts: dict[str, int] = {}
        for (_, form, _, _), rot in self.forms.items():
            text = rot._replace(partial=False).describe(form)
            counts[text] = counts.get(text, 0) + 1
        return "; ".join(sorted(counts, key=lambda t: -counts[t]))


_B, _S, _H, _W = 2, 5, 3, 8
_X_SHAPES = ((_B, _S, _H, _W), (_B, _H, _S, _W), (_B, _S, _H * _W))
_LEADS = (
    (_S,), (1, _S), (_B, _S), (_S, 1), (1, _S, 1), (_B, _S, 1), (1, 1, _S), (_B, 1, _S), (_B, _S, _H),
    (_B, _H, _S),
)  # fmt: skip
_MODE_TYPES = (bool, int, str, type(None))
_INT_VALUES = (-2, -1, 1, 2)
_MAX_COMBOS = 64
# Tolerances relative to 1 + the largest output: float32 arithmetic agrees to a few ulps (~1e-7), any
# other rotation differs by O(1); bfloat16 outputs by an ulp either way (2**-8); float64 to ~1e-16.
_TOL = 1e-5
_TOL_BF16 = 2e-2
_TOL_F64 = 1e-12  # float64 x with float32 frequencies: computed in float64 or not


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the probed function is a finding
        return e


def _difference(got: Any, want: Any, n_x: int) -> float:
    """Max abs difference relative to ``1 + max |want|``; inf when structure, shapes or dtypes differ."""
    if got is None:
        return math.inf
    if n_x == 1:
        want = (want,)
    elif not (isinstance(want, tuple) and len(want) == 2):
        return math.inf
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if not isinstance(b, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        if b.numel():
            err = (a.double() - b.double()).abs().max().item() / (1.0 + b.double().abs().max().item())
            worst = max(worst, err if err == err else math.inf)
    return worst


def _parameters(fn: Callable, name: str) -> tuple[list[str], list[str], int, tuple]:
    """``fn``'s required positional parameters, its mode parameters, how many of those can be passed by
    position, and their defaults."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise _CheckFailed(f"{name} has no signature to read: {e}") from e
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = []
    for p in params:
        if p.kind not in positional or p.default is not inspect.Parameter.empty:
            break
        required.append(p.name)
    modes, defaults, n_positional, in_order = [], [], 0, True
    for p in params[len(required) :]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            in_order = False
            continue
        if p.default is inspect.Parameter.empty:
            raise _CheckFailed(f"{name} requires {p.name!r} after its optional parameters")
        if type(p.default) not in _MODE_TYPES:
            raise _CheckFailed(f"{name}'s parameter {p.name!r} defaults to a {type(p.default).__name__}")
        modes.append(p.name)
        defaults.append(p.default)
        if in_order and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
            n_positional += 1
        else:
            in_order = False
    return required, modes, n_positional, tuple(defaults)


def _mode_combos(defaults: tuple) -> list[tuple]:
    """Mode values to probe: the defaults first, then the other values of each mode's kind."""
    choices = []
    for d in defaults:
        if type(d) is bool:
            choices.append((d, not d))
        elif type(d) is int:
            choices.append((d,) + tuple(v for v in _INT_VALUES if v != d))
        else:
            choices.append((d,))
    combos = list(itertools.product(*choices))
    if len(combos) > _MAX_COMBOS:  # one mode off its default at a time
        combos = [defaults] + [
            defaults[:i] + (v,) + defaults[i + 1 :] for i, c in enumerate(choices) for v in c[1:]
        ]
    return combos


def _inputs(g: torch.Generator, n_x: int, x_shape: tuple, form: str, layout: str, lead: tuple, w: int):
    xs = tuple(torch.randn(x_shape, generator=g, dtype=torch.float32) for _ in range(n_x))
    c = torch.randn(*lead, w // 2, generator=g, dtype=torch.float32)
    s = torch.randn(*lead, w // 2, generator=g, dtype=torch.float32)
    return xs, _make_freqs(form, layout, c, s)


def _widen(xs: tuple, extra: int, g: torch.Generator) -> tuple:
    return tuple(
        torch.cat([x, torch.randn(*x.shape[:-1], extra, generator=g, dtype=x.dtype)], -1) for x in xs
    )


def _function_spec(fn: Callable, name: str) -> _Spec:
    """The :class:`_Spec` of ``fn``, found on probes; raises :class:`_CheckFailed` when rope_ext computes
    none of its call forms."""
    required, modes, n_positional, defaults = _parameters(fn, name)
    splits = [n_x for n_x in (1, 2) if len(required) - n_x in (1, 2)]
    if not splits:
        raise _CheckFailed(
            f"{name} takes {len(required)} required arguments {required}, not (x, freqs), (x, cos, sin), "
            "(q, k, freqs) or (q, k, cos, sin)"
        )
    g = torch.Generator().manual_seed(0)
    found: dict[tuple, tuple] = {}
    first_error: Exception | None = None
    dtypes: set = set()  # output dtypes other than float32 (all probes are float32)
    returned = False
    for values, n_x in itertools.product(_mode_combos(defaults), splits):
        kwargs = {m: v for m, v, d in zip(modes, values, defaults, strict=True) if v is not d}
        forms = ("args",) if len(required) - n_x == 2 else ("tuple", "complex", "joined", "matrix")
        for x_shape, form, lead in itertools.product(_X_SHAPES, forms, _LEADS):
            rank = len(x_shape)
            targets = (x_shape[:-1],) * n_x
            placements = [
                dims
                for dims in itertools.combinations(range(rank - 1), len(lead))
                if _positions_shape(lead, rank - 1, dims, targets) is not None
            ]
            if not placements:
                continue
            key = (values, form, rank, tuple(d == 1 for d in lead))
            for layout in _LAYOUTS.get(form, ("",)):
                xs, freqs = _inputs(g, n_x, x_shape, form, layout, lead, x_shape[-1])
                want = _call(fn, *xs, *freqs, **kwargs)
                if isinstance(want, Exception):
                    first_error = first_error or want
                    continue
                returned = True
                outs = (want,) if n_x == 1 else want if isinstance(want, tuple) else ()
                dtypes |= {t.dtype for t in outs if isinstance(t, Tensor)} - {torch.float32}
                for pairing, dims in itertools.product(("interleaved", "half"), placements):
                    rot = _Form(pairing, layout, dims)
                    if _difference(_rotate(xs, form, freqs, rot, check=False), want, n_x) <= _TOL:
                        probe = (n_x, x_shape, form, layout, lead, kwargs)
                        if key in found and found[key][0] != rot:
                            found[key] = (None, probe)  # two alignments for one key: the original's
                        elif key not in found:
                            found[key] = (rot, probe)
                        break
    forms: dict[tuple, _Form] = {}
    per_split = [sum(p[0] == n for _, p in found.values()) for n in (1, 2)]
    n_x = 1 if per_split[0] >= per_split[1] else 2  # a function takes one of the two argument lists
    for key, (rot, probe) in found.items():
        rot = None if rot is None or probe[0] != n_x else _finish(fn, rot, probe, g)
        if rot is not None:
            forms[key] = rot
    if not forms:
        if dtypes:
            why = f"returns {', '.join(sorted(str(d) for d in dtypes))} for float32 inputs"
        elif found:
            why = "rotates float32 inputs as rope_ext does, but not bfloat16 ones"
        elif not returned:
            why = f"raises on every probe ({type(first_error).__name__})"
        else:
            why = "gives outputs that no rotation rope_ext implements matches"
        raise _CheckFailed(
            f"{name} computes none of the rotations rope_ext implements on its probes (x [B, S, H, D], "
            f"[B, H, S, D] or [B, S, H * D]; frequencies as (cos, sin), cos / sin, complex, cat((cos, sin)) "
            f"or 2x2 matrices; both pairings): it {why}"
            + (f"; first error {first_error!r}" if first_error is not None else ""),
            f"`{name}` {why}",
        )
    return _Spec(n_x, tuple(required), tuple(modes), n_positional, defaults, forms)


def _finish(fn: Callable, rot: _Form, probe: tuple, g: torch.Generator) -> _Form | None:
    """``rot`` with its partial-width and dtype fields found on further probes (wider ``x``; bfloat16 ``x``;
    float64 ``x``, which the op computes in float64 and many functions in float32), or None when ``fn``
    gives bfloat16 inputs an output dtype or values rope_ext does not."""
    n_x, x_shape, form, layout, lead, kwargs = probe
    xs, freqs = _inputs(g, n_x, x_shape, form, layout, lead, x_shape[-1])
    wide = _widen(xs, 4, g)
    want = _call(fn, *wide, *freqs, **kwargs)
    if not isinstance(want, Exception):
        partial = rot._replace(partial=True)
        if _difference(_rotate(wide, form, freqs, partial, check=False), want, n_x) <= _TOL:
            rot = partial
    low = tuple(x.to(torch.bfloat16) for x in xs)
    want = _call(fn, *low, *freqs, **kwargs)
    for keep in (True, False):
        err = _difference(_rotate(low, form, freqs, rot._replace(keep_dtype=keep), check=False), want, n_x)
        if err <= _TOL_BF16:
            rot = rot._replace(keep_dtype=keep)
            break
    else:
        return None
    high = tuple(x.double() for x in xs)
    want = _call(fn, *high, *freqs, **kwargs)
    wide64 = rot._replace(float64=True)
    if _difference(_rotate(high, form, freqs, wide64, check=False), want, n_x) <= _TOL_F64:
        rot = wide64
    return rot

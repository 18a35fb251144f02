"""The vision towers of vision-language models: their rotation functions, checked and swapped with the
diffusers patcher's machinery.

A vision tower computes its own per-token frequencies from its patch grid (Qwen2-VL's, Qwen2.5-VL's,
Qwen3-VL's and GLM-4V's ``VisionRotaryEmbedding``, Pixtral's and Llama 4's axial RoPE, ...): they are not a
function of one position id that rope_ext's caches could hold, so the model keeps computing them, as a
diffusers model does. What changes is the rotation: each function the tower's attention calls to rotate
q / k (``apply_rotary_pos_emb_vision(q, k, cos, sin)``, Pixtral's ``apply_rotary_pos_emb(q, k, cos, sin,
unsqueeze_dim=0)``, Llama 4's ``vision_apply_rotary_emb(q, k, freqs_ci)`` with complex frequencies) is
replaced by the diffusers patcher's stand-in, which hands the frequencies' pair values to rope_ext's op as
a per-token table and calls the original for any call the probes did not show the op computes.

What is reused from :mod:`rope_ext.compat.diffusers`: finding the functions (``_rotation_sites``), the
probe of every argument form (``_spec``), the stand-in (``_make_patched``), and the primitives of the probe
(inputs, comparison, alignment, dtype checks). What is added here (:func:`_vision_spec`): the call shapes
of vision towers that the diffusers probes lack, probed with those same primitives and merged into the
diffusers spec:

* a packed sequence without a batch dim, ``x [S, H, D]`` with ``cos [S, D]`` (the Qwen-VL and GLM-4V
  towers put all images of a batch in one sequence);
* int mode values 0 and -3 (Pixtral passes ``unsqueeze_dim=0`` for ``cos [S, D]`` on ``[B, H, S, D]``).

A call form is kept only when every probe of it agrees on one alignment (the diffusers probe's finding and
these), so a function whose behaviour depends on more than the form is left to run itself. (The diffusers
probe takes its shapes from module constants; were they a parameter, the loop of :func:`_vision_forms`
would be one call of it.) The stand-in also accepts the rotated tensors and frequencies by keyword (Llama 4
passes ``freqs_ci=``), handing them on by position.

Which modules are the vision part: every module of the model outside the text scopes (the parents of
the ``rotary_emb`` modules the text patch replaces). A function the text patch swaps is not swapped again:
when the vision part calls it too, the text stand-in checks eagerly that cos / sin hold their pair values
as the adapter's do. A vision function the probes reject, or defined inside a method, is left alone
(recorded, see :func:`vision_report`), unlike a text function, which refuses the whole model.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from ..diffusers.patch import _make_patched as _diffusers_stand_in
from ..diffusers.patch import _rotation_sites
from ..diffusers.patch import _spec as _diffusers_spec
from ..diffusers.probes import (
    _H,
    _LEADS,
    _S,
    _TOL,
    _W,
    _X_SHAPES,
    _call,
    _difference,
    _finish,
    _inputs,
    _mode_combos,
    _parameters,
    _Spec,
)
from ..diffusers.probes import _CheckFailed as _ProbeFailed
from ..diffusers.rotation import _LAYOUTS, _Form, _positions_shape, _rotate

__all__ = ["TESTED_VISION_MODELS", "vision_report"]

TESTED_VISION_MODELS = (
    "Qwen2VisionTransformerPretrainedModel",
    "Qwen2_5_VisionTransformerPretrainedModel",
    "Qwen3VLVisionModel",
    "Glm4vVisionModel",
    "Ernie4_5_VLMoeVisionTransformerPretrainedModel",
    "PixtralVisionModel",
    "Llama4VisionModel",
)
"""The vision towers whose rotations :func:`~rope_ext.compat.patch_transformers` is tested on (tiny random
towers: outputs and gradients against the unpatched tower, eager and ``torch.compile(fullgraph=True)``),
alone or inside their vision-language model; any other tower is patched too where the probes accept its
function."""

# The vision call shapes the diffusers probes lack (see the module docstring).
_VISION_X_SHAPES = ((_S, _H, _W),)
_VISION_INTS = (0, -3)

_VISION_SPECS: dict = {}  # (code, defaults) -> _Spec or the _ProbeFailed found
_ATTR = "_rope_ext_vision_functions"  # on a patched model: the (module, name) keys it swapped
_SKIPPED_ATTR = "_rope_ext_vision_skipped"  # on a patched model: label -> why it was left alone


# ---------------------------------------------------------------------------------------------
# The probe: the diffusers spec plus the vision call shapes


def _combos(defaults: tuple) -> tuple[list[tuple], list[tuple]]:
    """The diffusers probe's mode values, and the extra ones: each int mode set to each of
    :data:`_VISION_INTS` (one at a time)."""
    base = _mode_combos(defaults)
    extra = []
    for i, d in enumerate(defaults):
        if type(d) is int:
            for v in _VISION_INTS:
                values = defaults[:i] + (v,) + defaults[i + 1 :]
                if values not in base and values not in extra:
                    extra.append(values)
    return base, extra


def _alignments(fn: Callable, n_x: int, x_shape: tuple, form: str, lead: tuple, kwargs: dict, g):
    """Each ``(rotation, probe)`` that ``fn`` computes on random inputs of this shape, one per layout of
    ``form`` (the first pairing and alignment that matches), as the diffusers probe finds them."""
    rank = len(x_shape)
    targets = (x_shape[:-1],) * n_x
    placements = [
        dims
        for dims in itertools.combinations(range(rank - 1), len(lead))
        if _positions_shape(lead, rank - 1, dims, targets) is not None
    ]
    if not placements:
        return
    for layout in _LAYOUTS.get(form, ("",)):
        xs, freqs = _inputs(g, n_x, x_shape, form, layout, lead, x_shape[-1])
        want = _call(fn, *xs, *freqs, **kwargs)
        if isinstance(want, Exception):
            continue
        for pairing, dims in itertools.product(("interleaved", "half"), placements):
            rot = _Form(pairing, layout, dims)
            if _difference(_rotate(xs, form, freqs, rot, check=False), want, n_x) <= _TOL:
                yield rot, (n_x, x_shape, form, layout, lead, kwargs)
                break


def _bare(rot: _Form) -> _Form:
    """A form as :func:`_alignments` finds it (before the partial-width and dtype probes)."""
    return _Form(rot.pairing, rot.layout, rot.dims)


def _vision_forms(fn: Callable, spec: _Spec) -> dict:
    """``spec.forms`` with the vision call shapes added: a key the diffusers probe decided is probed on the
    vision shapes only (and dropped when they align it otherwise); a key it left out is probed on its
    shapes and the vision ones together, and kept when all that rotate agree."""
    g = torch.Generator().manual_seed(1)
    base, extra = _combos(spec.defaults)
    kinds = ("args",) if len(spec.required) - spec.n_x == 2 else ("tuple", "complex", "joined", "matrix")
    found: dict[tuple, tuple[set, tuple]] = {}
    for values in base + extra:
        kwargs = {m: v for m, v, d in zip(spec.modes, values, spec.defaults, strict=True) if v is not d}
        for x_shape, form, lead in itertools.product(_X_SHAPES + _VISION_X_SHAPES, kinds, _LEADS):
            key = (values, form, len(x_shape), tuple(d == 1 for d in lead))
            if key in spec.forms and x_shape not in _VISION_X_SHAPES:  # decided by the diffusers probe
                continue
            for rot, probe in _alignments(fn, spec.n_x, x_shape, form, lead, kwargs, g):
                found.setdefault(key, (set(), probe))[0].add(rot)
    forms = dict(spec.forms)
    for key, (rots, probe) in found.items():
        if key in forms:
            rots.add(_bare(forms[key]))
        if len(rots) > 1:  # two alignments for one call form: the original runs
            forms.pop(key, None)
        elif key not in forms:
            rot = _finish(fn, next(iter(rots)), probe, g)
            if rot is not None:
                forms[key] = rot
    return forms


def _probe(fn: Callable, label: str) -> _Spec:
    try:
        base: _Spec | None = _diffusers_spec(fn, label)
        error = None
    except _ProbeFailed as e:
        base, error = None, e
    required, modes, positional, defaults = _parameters(fn, label)
    splits = [base.n_x] if base is not None else [n for n in (1, 2) if len(required) - n in (1, 2)]
    best: _Spec | None = None
    for n_x in splits:
        spec = base or _Spec(n_x, tuple(required), tuple(modes), positional, defaults, {})
        spec = spec._replace(forms=_vision_forms(fn, spec))
        if best is None or len(spec.forms) > len(best.forms):
            best = spec
    if best is None or not best.forms:
        if error is not None:
            raise _ProbeFailed(f"{error} (nor on the vision probes x [S, H, D])", error.short)
        raise _ProbeFailed(f"{label} computes none of the rotations rope_ext implements on its probes")
    return best


def _vision_spec(fn: Callable, label: str) -> _Spec:
    """``fn``'s spec (the call forms rope_ext's op computes), probed once per code object and defaults;
    raises the diffusers probe's ``_CheckFailed`` when it computes none."""
    key = (fn.__code__, repr(fn.__defaults__), repr(fn.__kwdefaults__))
    if key not in _VISION_SPECS:
        try:
            _VISION_SPECS[key] = _probe(fn, label)
        except _ProbeFailed as e:
            _VISION_SPECS[key] = e
    found = _VISION_SPECS[key]
    if isinstance(found, _ProbeFailed):
        raise _ProbeFailed(str(found), found.short)
    return found


# ---------------------------------------------------------------------------------------------
# Finding a model's vision functions


class _Modules:
    """What ``_rotation_sites`` reads of a model, its ``modules()``: here, the vision part only."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._list = modules

    def modules(self) -> Iterator[nn.Module]:
        return iter(self._list)


class _VisionPlan(NamedTuple):
    """The vision functions :func:`~.patch.patch_transformers` swaps, and those it leaves alone."""

    functions: dict[tuple[str, str], tuple[Callable, _Spec]]  # (module, name) -> (original, spec)
    shared: set[tuple[str, str]]  # text functions the vision part calls too
    skipped: dict[str, str]  # label -> why it is left alone


def _vision_modules(model: nn.Module, text_parents: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``model`` outside the subtrees of ``text_parents``."""
    inside = {id(m) for p in text_parents for m in p.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def _sites(modules: list[nn.Module], skipped: dict[str, str]) -> list:
    try:
        return _rotation_sites(_Modules(modules))
    except _ProbeFailed:  # a method-local rotation that cannot be swapped: find the others class by class
        pass
    sites = []
    for m in {type(m): m for m in modules}.values():
        try:
            sites += _rotation_sites(_Modules([m]))
        except _ProbeFailed as e:
            skipped[f"{type(m).__module__}.{type(m).__qualname__}"] = str(e)
    return sites


def _vision_plan(model: nn.Module, text_parents: list[nn.Module], text_keys: set) -> _VisionPlan:
    """Check the vision functions of ``model`` (outside ``text_parents``), changing nothing; never raises
    for a function the probes reject (it is recorded in ``skipped``)."""
    functions: dict[tuple[str, str], tuple[Callable, _Spec]] = {}
    shared: set[tuple[str, str]] = set()
    skipped: dict[str, str] = {}
    seen = set()
    for site in _sites(_vision_modules(model, text_parents), skipped):
        if site.key in seen:
            continue
        seen.add(site.key)
        label = site.functions[0][0]
        if site.kind != "global":
            skipped[label] = "defined inside a method: left alone"
            continue
        key = (site.owner.__name__, site.attr)
        if key in text_keys:  # the text patch swaps it, with its own checks
            shared.add(key)
            continue
        try:
            functions[key] = (site.original, _vision_spec(site.original, label))
        except _ProbeFailed as e:
            skipped[label] = e.short
    return _VisionPlan(functions, shared, skipped)


# ---------------------------------------------------------------------------------------------
# Swapping, and what a patched model reports


def _make_stand_in(original: Callable, spec: _Spec) -> Callable:
    """The diffusers patcher's stand-in: rope_ext's op for the call forms ``spec`` holds (eagerly, after
    checking that cos / sin hold their pair values as found), ``original`` otherwise. The rotated tensors
    and frequencies may come by keyword (Llama 4 calls ``vision_apply_rotary_emb(q, k, freqs_ci=...)``):
    they are passed on by position, which is what the diffusers stand-in reads."""
    inner = _diffusers_stand_in(original, spec)
    params = inspect.signature(original).parameters
    required = spec.required
    by_keyword = all(params[n].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for n in required)

    def patched(*args, **kwargs):
        n = len(args)
        if by_keyword and n < len(required) and all(name in kwargs for name in required[n:]):
            kwargs = dict(kwargs)
            args = args + tuple(kwargs.pop(name) for name in required[n:])
        return inner(*args, **kwargs)

    functools.update_wrapper(patched, original)
    patched._rope_ext = True  # type: ignore[attr-defined]
    patched._rope_ext_original = original  # type: ignore[attr-defined]
    patched._rope_ext_spec = spec  # type: ignore[attr-defined]
    return patched


def vision_report(model: nn.Module) -> dict[str, dict[str, str]]:
    """What :func:`~rope_ext.compat.patch_transformers` did with ``model``'s vision rotation functions:
    ``{"patched": {name: call forms}, "skipped": {name: why}}`` (names as ``module.function``), gathered
    over ``model`` and its submodules that were patched; empty dicts for a model never patched."""
    patched: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for m in model.modules():
        for module_name, name in m.__dict__.get(_ATTR, ()):
            fn = getattr(sys.modules.get(module_name), name, None)
            spec = getattr(fn, "_rope_ext_spec", None)
            patched[f"{module_name}.{name}"] = spec.describe() if spec is not None else "restored"
        skipped.update(m.__dict__.get(_SKIPPED_ATTR, {}))
    return {"patched": patched, "skipped": skipped}

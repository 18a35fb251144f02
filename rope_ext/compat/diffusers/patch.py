"""Patching a diffusers model: :func:`patch_diffusers`, :func:`unpatch_diffusers`.

A diffusers transformer computes its RoPE frequencies in Python (its pos-embed module, or the pipeline)
and rotates q / k in its attention processors with a rotation function: diffusers'
``embeddings.apply_rotary_emb``, a function of the model's module (LTX-Video's ``apply_rotary_emb``,
Qwen-Image's ``apply_rotary_emb_qwen``, ...), or one defined inside the processor's ``__call__`` (Wan's).
:func:`_rotation_sites` finds those the model's classes and processors call: names with ``apply`` and
``rotary`` or ``rope`` in them, read as globals of their module, imported inside a method (``from
..embeddings import apply_rotary_emb``), defined inside a method, or the same in a function of the model's
module that a method calls. Each function is checked by :func:`~.probes._function_spec` before anything
changes, then swapped for a stand-in (:func:`_make_patched`) that runs rope_ext's op where it computes the
same and the original function otherwise: a global in its module (per module, so every model using it in
the process), a method-local function by rewriting the method's code to call the stand-in instead (per
class; a module function defining one likewise). ``_ORIGINALS`` keeps what was replaced for
:func:`unpatch_diffusers`.
"""

from __future__ import annotations

import dis
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .probes import _MODE_TYPES, _CheckFailed, _function_spec, _Spec
from .rotation import _form_of, _lead_rank, _rotate

__all__ = ["TESTED_DIFFUSERS_MODELS", "patch_diffusers", "unpatch_diffusers"]

TESTED_DIFFUSERS_MODELS = (
    "FluxTransformer2DModel",
    "WanTransformer3DModel",
    "HunyuanVideoTransformer3DModel",
    "LTXVideoTransformer3DModel",
    "CogVideoXTransformer3DModel",
    "QwenImageTransformer2DModel",
)
"""The diffusers models :func:`patch_diffusers` is tested on (tiny random models: outputs and gradients
against the unpatched model, eager and ``torch.compile(fullgraph=True)``); any other model is patched too
when every check passes."""

_ROTATION_NAME = re.compile(r"^(?=\w*apply)(?=\w*(rotary|rope))")
# key -> (owner, attribute, the original value, globals added to modules as (module, name)).
_ORIGINALS: dict[tuple, tuple[Any, str, Any, tuple]] = {}
# The patched models (by id) using each swapped function: the original returns when the last is unpatched.
_USERS: dict[tuple, set[int]] = {}
_SPECS: dict[Any, _Spec | _CheckFailed] = {}
_ATTR = "_rope_ext_diffusers_sites"


# ---------------------------------------------------------------------------------------------
# The stand-in


def _fast(spec: _Spec, args: tuple, kwargs: dict) -> Any:
    """rope_ext's result for ``original(*args, **kwargs)``, or None when the call is not one of the forms
    ``spec`` holds (then the original runs)."""
    n = len(spec.required)
    if len(args) < n or len(args) > n + spec.positional:
        return None
    values = list(spec.defaults)
    for i in range(n, len(args)):
        values[i - n] = args[i]
    for name, value in kwargs.items():
        if name not in spec.modes:
            return None
        values[spec.modes.index(name)] = value
    for value in values:
        if type(value) not in _MODE_TYPES:
            return None
    xs, freqs = args[: spec.n_x], args[spec.n_x : n]
    form = _form_of(freqs)
    if form is None or not all(isinstance(x, Tensor) for x in xs):
        return None
    f = freqs[0][0] if form == "tuple" else freqs[0]
    lead = f.shape[: _lead_rank(form, freqs)]
    rot = spec.forms.get((tuple(values), form, xs[0].dim(), tuple(d == 1 for d in lead)))
    if rot is None:
        return None
    out = _rotate(xs, form, freqs, rot, check=True)
    if out is None:
        return None
    return out[0] if spec.n_x == 1 else out


def _make_patched(original: Callable, spec: _Spec) -> Callable:
    """``original``'s stand-in: rope_ext's op where ``spec`` says it computes the same, ``original``
    otherwise."""

    def patched(*args, **kwargs):
        out = _fast(spec, args, kwargs)
        return original(*args, **kwargs) if out is None else out

    functools.update_wrapper(patched, original)
    patched._rope_ext = True  # type: ignore[attr-defined]
    patched._rope_ext_original = original  # type: ignore[attr-defined]
    patched._rope_ext_spec = spec  # type: ignore[attr-defined]
    return patched


def _spec(fn: Callable, label: str) -> _Spec:
    """``fn``'s :class:`_Spec`, probed once per code object and defaults; raises :class:`_CheckFailed`."""
    key = (fn.__code__, repr(fn.__defaults__), repr(fn.__kwdefaults__))
    if key not in _SPECS:
        try:
            _SPECS[key] = _function_spec(fn, label)
        except _CheckFailed as e:
            _SPECS[key] = e
    found = _SPECS[key]
    if isinstance(found, _CheckFailed):
        raise _CheckFailed(str(found), found.short)
    return found


# ---------------------------------------------------------------------------------------------
# Finding the rotation functions a model calls


class _Site(NamedTuple):
    """One thing :func:`patch_diffusers` swaps.

    ``kind`` ``"global"``: the function ``attr`` of module ``owner``; ``kind`` ``"nested"``: the method
    ``attr`` of class ``owner`` (or function ``attr`` of module ``owner``), whose local functions ``nested``
    (code objects) are rotations.
    ``functions`` are the rotation functions to probe, as ``(label, function)``."""

    key: tuple
    kind: str
    owner: Any
    attr: str
    original: Any
    functions: tuple
    nested: tuple = ()


def _code_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the functions nested in it look up (globals, attributes, methods)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _imports(code: types.CodeType, package: str | None) -> set[tuple[str, str]]:
    """``(module, name)`` of each ``from module import name`` run by ``code`` or the functions in it."""
    found = set()
    ins = list(dis.get_instructions(code))
    module = None
    for i, inst in enumerate(ins):
        if inst.opname == "IMPORT_NAME":
            level = ins[i - 2].argval if i >= 2 and type(ins[i - 2].argval) is int else 0
            try:
                module = (
                    importlib.util.resolve_name("." * level + inst.argval, package) if level else inst.argval
                )
            except (ImportError, ValueError):
                module = None
        elif inst.opname == "IMPORT_FROM" and module is not None:
            found.add((module, inst.argval))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _imports(const, package)
    return found


def _has_defaults(outer: types.CodeType, nested: types.CodeType) -> bool:
    """Whether ``outer`` gives its local function ``nested`` default values when it defines it."""
    ins = list(dis.get_instructions(outer))
    for i, inst in enumerate(ins):
        if inst.opname == "LOAD_CONST" and inst.argval is nested:
            for follow in ins[i + 1 : i + 4]:
                if follow.opname in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE") and (follow.arg or 0) & 3:
                    return True
    return False


def _scope_classes(model: nn.Module) -> list[type]:
    """The classes (MROs included) of ``model``'s modules and of their attention processors."""
    seen: set[type] = set()
    out = []
    for m in model.modules():
        objs = [m]
        processor = m.__dict__.get("processor")
        if processor is not None:
            objs.append(processor)
        for obj in objs:
            for klass in type(obj).__mro__:
                if klass in seen or klass.__module__.startswith(("torch.", "builtins")):
                    continue
                seen.add(klass)
                out.append(klass)
    return out


def _function_of(value: Any) -> types.FunctionType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        value = value.fget
    value = getattr(value, "_rope_ext_original", value)
    value = inspect.unwrap(value) if callable(value) else None
    return value if isinstance(value, types.FunctionType) else None


def _rotation_sites(model: nn.Module) -> list[_Site]:
    """Every rotation function the classes of ``model``'s modules and processors call; raises
    :class:`_CheckFailed` for a method-local rotation that cannot be swapped."""
    sites: dict[tuple, _Site] = {}

    def add_global(module: types.ModuleType, name: str) -> None:
        value = module.__dict__.get(name)
        fn = getattr(value, "_rope_ext_original", value)
        if isinstance(fn, types.FunctionType):
            key = ("global", module.__name__, name)
            sites.setdefault(
                key, _Site(key, "global", module, name, fn, ((f"{module.__name__}.{name}", fn),))
            )

    def scan(fn: types.FunctionType, owner: Any, attr: str) -> None:
        code, module = fn.__code__, sys.modules.get(fn.__module__ or "")
        if module is not None and module.__dict__ is fn.__globals__:
            for name in sorted(_code_names(code)):
                value = module.__dict__.get(name)
                value = getattr(value, "_rope_ext_original", value)
                if _ROTATION_NAME.match(name):
                    add_global(module, name)
                elif isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
                    if value not in helpers:  # a function of the model's module: what it calls counts too
                        helpers.add(value)
                        scan(value, module, name)
        for source, name in sorted(_imports(code, fn.__globals__.get("__package__"))):
            if _ROTATION_NAME.match(name):
                try:
                    add_global(importlib.import_module(source), name)
                except ImportError:
                    continue
        nested = tuple(
            c for c in code.co_consts if isinstance(c, types.CodeType) and _ROTATION_NAME.match(c.co_name)
        )
        if nested:
            site = _nested_site(owner, attr, fn, nested)
            sites[site.key] = site

    helpers: set[types.FunctionType] = set()
    for klass in _scope_classes(model):
        for attr, value in vars(klass).items():
            fn = _function_of(value)
            if fn is not None:
                scan(fn, klass, attr)
    return list(sites.values())


def _qualname(owner: Any) -> str:
    """A class's qualified name, or "" for a module."""
    return "" if isinstance(owner, types.ModuleType) else owner.__qualname__


def _nested_site(owner: Any, attr: str, fn: types.FunctionType, nested: tuple) -> _Site:
    label = ".".join(filter(None, (fn.__module__, _qualname(owner), attr)))
    stored = vars(owner).get(attr)
    if getattr(stored, "_rope_ext_original", stored) is not fn:
        raise _CheckFailed(f"{label} defines {nested[0].co_name} but is wrapped; its code cannot be swapped")
    module = sys.modules.get(fn.__module__ or "")
    if module is None or module.__dict__ is not fn.__globals__:
        raise _CheckFailed(f"{label} has no module to hold the stand-in of its {nested[0].co_name}")
    functions = []
    for code in nested:
        name = f"{label}.{code.co_name}"
        if code.co_freevars:
            raise _CheckFailed(f"{name} reads variables {list(code.co_freevars)} of {label}")
        if code.co_kwonlyargcount or code.co_posonlyargcount or code.co_flags & 0x0C:
            raise _CheckFailed(f"{name} takes keyword-only or variable arguments")
        if _has_defaults(fn.__code__, code):
            raise _CheckFailed(f"{name} has default values")
        functions.append((name, types.FunctionType(code, fn.__globals__, code.co_name)))
    key = ("nested", fn.__module__, _qualname(owner), attr)
    return _Site(key, "nested", owner, attr, fn, tuple(functions), nested)


# ---------------------------------------------------------------------------------------------
# Rewriting a method to call stand-ins for its local rotation functions


def _global_name(owner: Any, attr: str, code: types.CodeType) -> str:
    return re.sub(r"\W", "_", f"_rope_ext_{_qualname(owner)}_{attr}_{code.co_name}")


def _trampoline(code: types.CodeType, target: str) -> types.CodeType:
    """A code object taking ``code``'s arguments and returning ``target(*those arguments)``."""
    args = ", ".join(code.co_varnames[: code.co_argcount])
    namespace: dict[str, Any] = {}
    source = f"def _stand_in({args}):\n    return {target}({args})\n"
    exec(compile(source, f"<rope_ext stand-in for {code.co_name}>", "exec"), namespace)
    tramp = namespace["_stand_in"].__code__
    names = {"co_name": code.co_name}
    if hasattr(code, "co_qualname"):
        names["co_qualname"] = code.co_qualname
    return tramp.replace(**names)


def _rewritten(method: types.FunctionType, swaps: dict) -> types.FunctionType:
    """``method`` with its local functions' code objects replaced as ``swaps`` says."""
    code = method.__code__
    code = code.replace(co_consts=tuple(swaps.get(id(c), c) for c in code.co_consts))
    new = types.FunctionType(
        code, method.__globals__, method.__name__, method.__defaults__, method.__closure__
    )
    new.__kwdefaults__ = method.__kwdefaults__
    new.__qualname__ = method.__qualname__
    new.__doc__ = method.__doc__
    new.__module__ = method.__module__
    new.__annotations__ = dict(method.__annotations__)
    new.__dict__.update(method.__dict__)
    new._rope_ext_original = method  # type: ignore[attr-defined]
    return new


# ---------------------------------------------------------------------------------------------
# Patching a model


def _plan(model: nn.Module) -> list[tuple[_Site, list[_Spec]]]:
    """Every site with the specs of its functions, all checks passed; raises :class:`_CheckFailed`."""
    sites = _rotation_sites(model)
    if not sites:
        raise _CheckFailed(
            f"the modules and attention processors of {type(model).__name__} call no apply_*rotary* / "
            "apply_*rope* function to route through rope_ext (a rotation written inline is not swapped)",
            "calls no `apply_*rotary*` function (the rotation is written inline)",
        )
    return [(site, [_spec(fn, label) for label, fn in site.functions]) for site in sites]


def patch_diffusers(model: nn.Module) -> nn.Module:
    """Route a diffusers model's RoPE rotations through rope_ext; returns ``model``.

    Tested models: :data:`TESTED_DIFFUSERS_MODELS`; any other model is patched too when every check passes.
    The model's cos / sin (or complex frequencies, or rotation matrices) stay its own: they are computed by
    its pos-embed module as before, so fractional positions (LTX-Video's) and per-axis frequencies come
    through unchanged. What changes is the rotation: each function its attention processors and modules call
    to rotate q / k (diffusers' ``embeddings.apply_rotary_emb`` in every ``use_real`` /
    ``use_real_unbind_dim`` / ``sequence_dim`` form, the model's own functions, the function Wan's
    processor defines in its ``__call__``) is replaced by one that hands the frequencies' pair values to
    rope_ext's op as a table (positions ``arange``, laid out as the frequencies broadcast), differentiable
    and ``torch.compile(fullgraph=True)``-able, and calls the original function for calls the op cannot
    compute exactly: frequencies requiring grad, float64 inputs the original computes in float32, shapes or
    arguments the probes did not cover, and (eagerly) cos / sin whose pair values are not duplicated as the
    probes found. A module's function is swapped in its module, a method-local function by rewriting the
    method (per class): other models using them in the process also use the op, with the same results.
    :func:`unpatch_diffusers` undoes it.

    Checks, all made before anything is swapped: each function, called on random probes of every argument
    form (see :mod:`rope_ext.compat.diffusers.probes`), must compute one of the rotations rope_ext
    implements for some form. Raises ``TypeError`` naming the function and why when one does not, or when the
    model calls no such function (a rotation written inline in a processor); the model and diffusers'
    modules are then unchanged.
    """
    try:
        with torch.device("cpu"):  # the probes run on the CPU, whatever the default device
            plan = _plan(model)
    except _CheckFailed as e:
        raise TypeError(
            f"patch_diffusers supports diffusers models whose rotary functions rope_ext computes (tested: "
            f"{', '.join(TESTED_DIFFUSERS_MODELS)}), got {type(model).__name__}: {e}"
        ) from None
    keys = []
    for site, specs in plan:
        key = site.key
        keys.append(key)
        _USERS.setdefault(key, set()).add(id(model))
        if key in _ORIGINALS:
            continue
        if site.kind == "global":
            original = site.functions[0][1]
            _ORIGINALS[key] = (site.owner, site.attr, site.original, ())
            setattr(site.owner, site.attr, _make_patched(original, specs[0]))
            continue
        module = sys.modules[site.original.__module__]
        swaps, added = {}, []
        for code, (_, fn), spec in zip(site.nested, site.functions, specs, strict=True):
            name = _global_name(site.owner, site.attr, code)
            setattr(module, name, _make_patched(fn, spec))
            added.append((module, name))
            swaps[id(code)] = _trampoline(code, name)
        _ORIGINALS[key] = (site.owner, site.attr, site.original, tuple(added))
        setattr(site.owner, site.attr, _rewritten(site.original, swaps))
    model.__dict__[_ATTR] = keys
    return model


def unpatch_diffusers(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_diffusers`: the original functions and methods return once no other patched model
    uses them."""
    for key in model.__dict__.pop(_ATTR, []):
        users = _USERS.get(key, set())
        users.discard(id(model))
        if users:
            continue
        _USERS.pop(key, None)
        entry = _ORIGINALS.pop(key, None)
        if entry is None:
            continue
        owner, attr, original, added = entry
        setattr(owner, attr, original)
        for module, name in added:
            module.__dict__.pop(name, None)
    return model

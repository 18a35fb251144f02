"""Patching a loaded transformers model: :func:`patch_transformers`, :func:`unpatch_transformers`,
:func:`supported_model_types`.

A patch is planned in full before anything changes (:func:`_plan`: each ``rotary_emb`` module and the
``apply_rotary*`` functions the modules under its parent call, each checked against rope_ext by
:mod:`.probes`; then the rotation functions of the vision part, checked by :mod:`.vision`), so a failed
check leaves the model and its modeling modules as they were. Functions are swapped in their modeling module
(per class, not per instance) for :func:`_make_patched` stand-ins (vision functions: the diffusers patcher's
stand-in), which run rope_ext's op where it computes the same and the original function otherwise;
``_ORIGINALS`` keeps the originals for :func:`unpatch_transformers`.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .adapter import HFRotaryAdapter
from .probes import _check_rotary, _CheckFailed, _code_names, _function_rotation, _Signature, _signature
from .qk_norm import (
    _RUNNING,
    _defer_norms,
    _DeferredNorm,
    _fusable_attentions,
    _fused_norm_rotate,
    _restore_norms,
)
from .rotation import _rotate, _Rotation
from .vision import _ATTR as _VISION_ATTR
from .vision import _SKIPPED_ATTR as _VISION_SKIPPED_ATTR
from .vision import _make_stand_in, _vision_plan, _VisionPlan

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "supported_model_types",
    "patch_transformers",
    "unpatch_transformers",
]


# ---------------------------------------------------------------------------------------------
# The stand-in for a modeling module's function


def _make_patched(original: Callable, rot: _Rotation, sig: _Signature, check_pairs: bool = False) -> Callable:
    """``original``'s stand-in: rope_ext's op computing ``rot`` where it can, ``original`` otherwise (any
    argument other than ``q, k, cos, sin, unsqueeze_dim`` passed with a non-default value, shapes or dtypes
    the op does not take, ``cos`` / ``sin`` requiring grad). With ``check_pairs`` (a function the vision part
    calls too, with cos / sin not from the adapter), eager calls check that cos / sin are laid out as
    ``rot`` says first."""
    names, defaults, ud_default = sig.names, sig.defaults, sig.unsqueeze_default

    def patched(q, k, cos, sin, *args, **kwargs):
        attention = _RUNNING.attention
        if attention is not None and isinstance(getattr(attention, "q_norm", None), _DeferredNorm):
            # Inside an attention whose q / k norms are deferred to here (fused QK norm).
            return _fused_norm_rotate(attention, patched_plain, q, k, cos, sin, args, kwargs, rot)
        return patched_plain(q, k, cos, sin, *args, **kwargs)

    def patched_plain(q, k, cos, sin, *args, **kwargs):
        ud = ud_default
        if args or kwargs:
            if len(args) > len(names) or any(n in kwargs for n in names[: len(args)]):
                return original(q, k, cos, sin, *args, **kwargs)
            given = dict(zip(names, args, strict=False))
            given.update(kwargs)
            for name, value in given.items():
                if name == "unsqueeze_dim" and type(value) is int:
                    ud = value
                elif name not in defaults or value is not defaults[name]:
                    return original(q, k, cos, sin, *args, **kwargs)
        out = _rotate(q, k, cos, sin, ud, rot, check_pairs=check_pairs)
        return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    functools.update_wrapper(patched, original)
    patched._rope_ext = True  # type: ignore[attr-defined]
    patched._rope_ext_original = original  # type: ignore[attr-defined]
    patched._rope_ext_rotation = rot  # type: ignore[attr-defined]
    patched._rope_ext_check_pairs = check_pairs  # type: ignore[attr-defined]
    return patched


# ---------------------------------------------------------------------------------------------
# Patching a model


SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    # MRoPE (the text models of the vision-language families; [3, batch, seq] position ids)
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
    "qwen3_vl",
    "qwen3_vl_text",
    "ernie4_5_vl_moe",
    "mixtral",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "cohere",
    "gpt_neox",
    "stablelm",
    "starcoder2",
    "deepseek_v3",
    "glm",
    "modernbert",
)
"""The model types :func:`patch_transformers` is tested on (tiny random models, logits and gradients against
the unpatched model). :func:`supported_model_types` reports which of them the installed transformers has
and passes the checks; other model types are patched too when every check passes."""

_ORIGINALS: dict[tuple[str, str], Callable] = {}  # (modeling module, function name) -> original function
# The patched models (by id) using each swapped function: the original returns when the last is unpatched.
_USERS: dict[tuple[str, str], set[int]] = {}
_FUNCTION_PREFIX = "apply_rotary"


def _rotary_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if name == "rotary_emb" and type(child).__name__.endswith("RotaryEmbedding"):
                found.append((parent, name, child))
    return found


def _called_functions(scope: nn.Module) -> dict[tuple[str, str], Callable]:
    """The ``apply_rotary*`` functions the classes of ``scope``'s modules call: ``(module name, function
    name) -> the function``, read from the code of every method of every class in their MROs (the names
    they look up as globals of their modeling module)."""
    found: dict[tuple[str, str], Callable] = {}
    seen: set[type] = set()
    for m in scope.modules():
        for klass in type(m).__mro__:
            if klass in seen or klass.__module__.startswith(("torch.", "builtins")):
                continue
            seen.add(klass)
            for attr in vars(klass).values():
                fn = inspect.unwrap(attr) if callable(attr) else None
                code = getattr(fn, "__code__", None)
                if code is None:
                    continue
                module = sys.modules.get(getattr(fn, "__module__", None) or "")
                for name in _code_names(code):
                    if name.startswith(_FUNCTION_PREFIX) and module is not None:
                        target = getattr(module, name, None)
                        if callable(target):
                            found[(module.__name__, name)] = target
    return found


class _Plan(NamedTuple):
    """What :func:`patch_transformers` swaps, every check passed."""

    adapters: list[tuple[nn.Module, str, HFRotaryAdapter]]  # (parent, attribute, adapter)
    functions: dict[tuple[str, str], tuple[Callable, _Rotation]]  # -> (original, rotation)
    owners: dict[int, list[tuple[str, str]]]  # id(adapter) -> the functions its scope calls
    vision: _VisionPlan  # the rotation functions of the modules outside the text scopes


def _plan(model: nn.Module, max_positions: int | None) -> _Plan:
    """Check all that :func:`patch_transformers` would swap, changing nothing; raises ``_CheckFailed``."""
    from ...hf_config import parse_hf_config

    config = getattr(model, "config", None)
    found = _rotary_modules(model)
    adapters, owners = [], {}
    functions: dict[tuple[str, str], tuple[Callable, _Rotation]] = {}
    layouts: dict[tuple[str, str], str] = {}
    taken: set[tuple[str, str]] = set()  # the functions of adapters already in place (a model patched twice)
    for parent, name, child in found:
        if isinstance(child, HFRotaryAdapter):
            taken.update(getattr(child, "_rope_ext_functions", None) or ())
            continue
        cfg = child.config if hasattr(child, "config") else config
        n = max_positions if max_positions is not None else int(getattr(cfg, "max_position_embeddings", 2048))
        adapter = _check_rotary(child, cfg, n)
        widths = sorted({parse_hf_config(cfg, layer_type=lt)[:2] for lt in adapter.kinds})
        calls = _called_functions(parent)
        if not calls:
            raise _CheckFailed(
                f"the modules under {type(parent).__name__} call no {_FUNCTION_PREFIX}* function to route "
                "through rope_ext"
            )
        for key, fn in calls.items():
            original = getattr(fn, "_rope_ext_original", fn)
            if layouts.setdefault(key, adapter.layout) != adapter.layout:
                raise _CheckFailed(f"{key[0]}.{key[1]} gets cos / sin in two layouts")
            for head_dim, rotary_dim in widths:
                rot = _function_rotation(original, f"{key[0]}.{key[1]}", adapter.layout, head_dim, rotary_dim)
                prev = functions.get(key, (None, None))[1]
                if prev is None and getattr(fn, "_rope_ext", False):
                    prev = fn._rope_ext_rotation
                if prev is not None:
                    if prev._replace(partial=False) != rot._replace(partial=False):
                        raise _CheckFailed(f"{key[0]}.{key[1]} computes different rotations for two configs")
                    rot = rot._replace(partial=rot.partial or prev.partial)
                functions[key] = (original, rot)
        owners[id(adapter)] = list(calls)
        adapters.append((parent, name, adapter))
    vision = _vision_plan(model, [parent for parent, _, _ in found], set(functions) | taken)
    if not found and not vision.functions:
        why = "".join(f"; {label}: {reason}" for label, reason in vision.skipped.items())
        raise _CheckFailed(
            f"no *RotaryEmbedding module named rotary_emb found in {type(model).__name__}, nor a vision "
            f"rotation function rope_ext computes{why}"
        )
    return _Plan(adapters, functions, owners, vision)


def patch_transformers(
    model: nn.Module, *, max_positions: int | None = None, fuse_qk_norm: bool = True
) -> nn.Module:
    """Route a loaded transformers model's RoPE through rope_ext; returns ``model``.

    Tested model types: :data:`SUPPORTED_MODEL_TYPES`; :func:`supported_model_types` says which of them the
    installed transformers passes. Any other model is patched too when every check below passes.

    Three things change. (1) Each ``*RotaryEmbedding`` module named ``rotary_emb`` is replaced by an
    :class:`HFRotaryAdapter`: cos / sin come from :class:`~rope_ext.RopeCache` objects built by
    ``from_hf_config`` (float64 angles; one per layer type where the config nests its rope parameters per
    layer type, as Gemma 3 and ModernBERT do; MRoPE sections for Qwen2-VL, Qwen2.5-VL and Qwen3-VL) with
    ``max_positions`` rows up front (default ``config.max_position_embeddings``). (2) The attention layers
    call ``apply_rotary_pos_emb`` (or ``apply_rotary_pos_emb_interleave``, ...) as a global of their
    modeling module (e.g. ``transformers.models.llama.modeling_llama``); each such function called by the
    modules under the rotary embedding's parent is replaced by one computing the same rotation with
    rope_ext's op (one call for q and k, float32 arithmetic, differentiable), falling back to the original
    for arguments the op does not take. (2) is per model class, not per instance: other models of the same
    family in the process also use the op, with transformers' semantics. (3) The vision part (every module
    outside the rotary embeddings' parents: the vision tower of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V,
    Pixtral, Llama 4, ...; see :mod:`rope_ext.compat.hf.vision`) keeps its own per-token cos / sin (or
    complex frequencies); each rotation function it calls (``apply_rotary_pos_emb_vision``,
    ``vision_apply_rotary_emb``, ...) is swapped, per modeling module, for the diffusers patcher's stand-in:
    rope_ext's op on those frequencies as a per-token table, for the call forms the probes showed it
    computes, the original otherwise. A vision function the probes reject is left alone (see
    :func:`~rope_ext.compat.hf.vision_report`), not refused; a model with no ``rotary_emb`` (a vision tower
    on its own) is patched when it has a vision function to swap. The patched model runs under
    ``torch.compile(fullgraph=True)``. :func:`unpatch_transformers` undoes all three.

    With ``fuse_qk_norm`` (the default), attention layers of the model types in
    :data:`FUSED_QK_NORM_MODEL_TYPES` (Qwen3, Qwen3-MoE) whose ``q_norm`` / ``k_norm`` are per-head RMSNorms
    (checked on a probe against the float64 reference, which also finds ``eps`` and the ``1 + w`` form)
    run the norms and the rotation as one :func:`rope_ext.apply_qk_norm_rotary` call (differentiable; the
    norm's output rounded once instead of twice). The norm modules stay reachable as ``.original`` and
    share their weights.

    Checks, all made before anything is swapped: the class of each rotary module, built from its config on
    the CPU, gives the adapter's cos / sin on probe positions (within float32 angle error; this also finds
    their layout, ``cat((c, c))`` or Cohere's ``repeat_interleave(c, 2)``); each function, called on random
    probes of the model's shapes (head dim, partial rotary width, both ``unsqueeze_dim`` layouts, bfloat16
    inputs), computes one of the rotations rope_ext implements: half-split or interleaved pairs over the
    first ``cos.shape[-1]`` features, the output in place or de-interleaved (DeepSeek-V3), in the promoted or
    the input dtype. Raises ``TypeError`` naming the check that failed and the supported model types;
    the model and its modeling modules are then unchanged.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    try:
        with torch.device("cpu"):
            plan = _plan(model, max_positions)
    except _CheckFailed as e:
        raise TypeError(
            f"patch_transformers supports model_type in {list(supported_model_types())}, got "
            f"{model_type!r}: {e}"
        ) from None
    for parent, name, adapter in plan.adapters:
        child = getattr(parent, name)
        device = next((b.device for b in child.buffers()), torch.device("cpu"))
        adapter.to(device)
        adapter._rope_ext_functions = plan.owners[id(adapter)]
        setattr(parent, name, adapter)
    for (module_name, fn_name), (original, rot) in plan.functions.items():
        module = sys.modules[module_name]
        _ORIGINALS.setdefault((module_name, fn_name), original)
        _USERS.setdefault((module_name, fn_name), set()).add(id(model))
        # checking cos / sin, once a vision part calls it too, until the function is restored
        check = (module_name, fn_name) in plan.vision.shared or getattr(
            getattr(module, fn_name), "_rope_ext_check_pairs", False
        )
        setattr(module, fn_name, _make_patched(original, rot, _signature(original), check_pairs=check))
    for (module_name, fn_name), (original, spec) in plan.vision.functions.items():
        _ORIGINALS.setdefault((module_name, fn_name), original)
        _USERS.setdefault((module_name, fn_name), set()).add(id(model))
        setattr(sys.modules[module_name], fn_name, _make_stand_in(original, spec))
    if plan.vision.functions or plan.vision.skipped:
        model.__dict__[_VISION_ATTR] = list(plan.vision.functions)
        model.__dict__[_VISION_SKIPPED_ATTR] = dict(plan.vision.skipped)
    if fuse_qk_norm:
        for attention in _fusable_attentions(model):
            _defer_norms(attention)
    return model


def _release(key: tuple[str, str], user: int) -> None:
    """``user`` (a patched model's id) no longer calls the stand-in of ``key``: the original returns when no
    other patched model does."""
    users = _USERS.get(key, set())
    users.discard(user)
    if users:  # another patched model still calls the stand-in
        return
    _USERS.pop(key, None)
    original = _ORIGINALS.pop(key, None)
    if original is not None:
        setattr(sys.modules[key[0]], key[1], original)


def unpatch_transformers(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_transformers`: the original rotary modules and modeling-module functions return
    (vision functions too, for ``model`` and any of its submodules patched on their own)."""
    for m in list(model.modules()):
        if hasattr(m, "_rope_ext_norms"):
            _restore_norms(m)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, HFRotaryAdapter):
                setattr(parent, name, child._original)
                keys = getattr(child, "_rope_ext_functions", None)
                if keys is None:  # an adapter made by hand: the rotary module's own modeling module
                    keys = [(type(child._original).__module__, "apply_rotary_pos_emb")]
                for key in keys:
                    _release(key, id(model))
    for m in list(model.modules()):
        m.__dict__.pop(_VISION_SKIPPED_ATTR, None)
        for key in m.__dict__.pop(_VISION_ATTR, ()):
            _release(key, id(m))
    return model


# ---------------------------------------------------------------------------------------------
# What the installed transformers supports


def _tiny_default_model(model_type: str) -> nn.Module:
    """``model_type``'s base model from its default config (one layer), on the meta device."""
    from transformers import AutoConfig, AutoModel

    try:
        config = AutoConfig.for_model(model_type, num_hidden_layers=1)
    except TypeError:
        config = AutoConfig.for_model(model_type)
    with torch.device("meta"):
        return AutoModel.from_config(config)


@functools.lru_cache(maxsize=1)
def supported_model_types() -> tuple[str, ...]:
    """The model types of :data:`SUPPORTED_MODEL_TYPES` that the installed transformers has and that pass
    :func:`patch_transformers`' checks: each one's base model, built from its default config on the meta
    device, is checked as it would be patched (its rotary modules against the adapter, its
    ``apply_rotary*`` functions against rope_ext's op). Computed once per process: it builds and checks one
    model per type."""
    from transformers.utils import logging as hf_logging

    supported = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs warn about their token ids, irrelevant here
    try:
        for model_type in SUPPORTED_MODEL_TYPES:
            try:
                model = _tiny_default_model(model_type)
                with torch.device("cpu"):
                    _plan(model, max_positions=64)
            except Exception:  # noqa: BLE001 - a model type transformers lacks or that fails a check
                continue
            supported.append(model_type)
    finally:
        hf_logging.set_verbosity(verbosity)
    return tuple(supported)

"""Sharding rules of rope_ext's ops for DTensor (torch.distributed.tensor); no communication of our own.

Registered (:func:`register_sharding_rules`) as soon as both rope_ext and torch.distributed.tensor are
imported, whichever comes first: ``import rope_ext`` registers them at once when torch.distributed.tensor is
already loaded, else installs an import hook (:func:`register_sharding_rules_on_import`) that registers them
right after torch.distributed.tensor's own import. A DTensor cannot exist before that import, so the rules
are in place before the first DTensor reaches an op, and ``import rope_ext`` does not pay for importing
torch.distributed.tensor (and sympy with it) in a process that never uses DTensor. Per mesh dim, an op
accepts:

* everything replicated;
* q (and k) sharded on any dim but the last (heads: tensor parallel; tokens: sequence / context parallel;
  batch: data parallel), outputs placed like the inputs. ``positions`` goes with it: sharded on its dim
  that aligns with q's sharded dim when it varies along it (per-token positions), replicated when it
  broadcasts there (a ``[T, 1]`` positions tensor with q sharded on heads). MRoPE's leading section dim of
  3 is never sharded. ``cos_sin`` is replicated.

The serving ops:

* ``qk_norm_rotary`` / ``qk_norm_rotary_`` (the norm runs over the last dim, which is never sharded): as
  ``rotary_qk`` / ``rotary_qk_``, with the norm weights replicated;
* ``rotary_qk_cache_`` (a paged cache is indexed by global slots, so tokens are never split): everything
  replicated, or q, k, v sharded on heads (tensor parallel) with both caches sharded on their head dim
  (dim 2 for ``"NHD"``, 1 for ``"HND"``) and q_out like q; positions, cos_sin, slot_mapping (or every
  tensor of page_table) and the scales replicated;
* ``mla_rotary_cache_`` (the latent cache has no head dim): everything replicated, or q (and q_out)
  sharded on heads with kv_c, k_pe, the cache and the rest (slot_mapping or page_table) replicated (each
  rank writes the same rows into its replica);
* ``rerotate_kv_cache_``: the cache replicated or sharded on its head dim, the rest replicated.

Anything else (the last dim sharded, ``Partial`` placements, q / k / positions sharded inconsistently)
matches none of these, and DTensor redistributes the inputs to the cheapest one that does, so the result
is always the single-device result. An in-place call (``rotary_qk_``) keeps q's and k's placements and
writes only the local shards; DTensor refuses an in-place call whose q or k would need redistributing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch

from .specs import (
    CACHE,
    MLA_CACHE,
    QK_NORM,
    QK_NORM_,
    QK_NORM_PACKED_,
    REROTATE,
    ROTARY,
    ROTARY_QK,
    ROTARY_QK_,
    OpSpec,
)

__all__ = ["register_sharding_rules", "register_sharding_rules_on_import"]

_registered = False
_DTENSOR = "torch.distributed.tensor"


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the rules right after torch.distributed.tensor's import, wherever it is imported from.

    A finder first in ``sys.meta_path`` that finds nothing itself: for torch.distributed.tensor it asks the
    other finders for the spec and wraps that spec's loader's ``exec_module`` (on this one loader instance,
    removed again after the call), so the module loads exactly as it would without the hook, and the rules
    are registered once it has fully executed. The hook removes itself once they are registered; a failed
    import leaves it for the next attempt.
    """

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _DTENSOR or self._finding:
            return None
        self._finding = True  # the lookup below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        # Only a loader instance is wrapped (a class, as for built-in or frozen modules, is shared).
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            try:
                exec_module(module)
            finally:
                del loader.exec_module  # the loader as it was
            register_sharding_rules()
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        try:
            loader.exec_module = exec_then_register
        except AttributeError:  # a loader without an instance __dict__: loaded as it is, rules not hooked
            pass
        return spec


_hook: _RegisterOnImport | None = None


def register_sharding_rules_on_import() -> bool:
    """Registers the rules now if torch.distributed.tensor is imported, else right after its import (an import
    hook); False when torch.distributed is missing. Called on import of rope_ext."""
    global _hook
    if not torch.distributed.is_available():
        return False
    if _DTENSOR in sys.modules:
        return register_sharding_rules()
    if _hook is None:
        _hook = _RegisterOnImport()
        sys.meta_path.insert(0, _hook)
    return True


def _placements(q: Any, positions: Any, mrope: bool) -> list[tuple[Any, Any]]:
    """(q placement, positions placement) pairs of one mesh dim: replicated, or sharded on one batch dim."""
    from torch.distributed.tensor import Replicate, Shard

    out = [(Replicate(), Replicate())]
    pshape = tuple(positions.shape)
    lead = 1 if mrope else 0  # MRoPE positions [n_axes, ...]: the axis dim is not a token dim
    n, m = q.ndim - 1, len(pshape) - lead  # batch dims of q, token-aligned dims of positions
    for d in range(n):
        pd = d - (n - m)  # positions are aligned to the right of q.shape[:-1]
        varies = pd >= 0 and pshape[pd + lead] > 1
        out.append((Shard(d), Shard(pd + lead) if varies else Replicate()))
    return out


def _token_placements(q: Any, positions: Any, mrope: bool) -> list[tuple[Any, Any]]:
    """As :func:`_placements`, for the serving ops' per-token positions (``[T]`` for ``q [T, H, D]``, aligned
    to the left of q's batch dims) as well as for positions broadcasting to ``q.shape[:-1]``."""
    from torch.distributed.tensor import Replicate, Shard

    lead = 1 if mrope else 0
    if positions.ndim - lead != q.ndim - 2:
        return _placements(q, positions, mrope)
    out = [(Replicate(), Replicate())]
    for d in range(q.ndim - 1):
        per_token = d < q.ndim - 2 and positions.shape[d + lead] > 1
        out.append((Shard(d), Shard(d + lead) if per_token else Replicate()))
    return out


def register_sharding_rules() -> bool:
    """Registers the rules above for every rope_ext op (once); False when torch.distributed is missing."""
    global _registered
    if _registered:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    if _registered:  # the import above was the first: the import hook has registered them
        return True

    R = Replicate()

    def rule(spec: OpSpec) -> Callable[[Callable[[Any], Any]], None]:
        """Registers the decorated function as the rule of every overload of ``spec``. It takes the call's
        arguments by name and returns (output placements, {argument name: placement}) pairs; an argument it
        does not name gets None (a non-tensor), as does one that is None (a tensor option not given, the
        slot_mapping of a cache write given a page_table). A tensor list (``Tensor[]``: page_table) gets
        its placement once per tensor: DTensor flattens the list, so its tensors are inputs of their own."""

        def placements(names: tuple[str, ...], args: tuple, ins: dict[str, Any]) -> list[Any]:
            out: list[Any] = []
            for name, value in zip(names, args, strict=False):
                placement = None if value is None else ins.get(name)
                if isinstance(value, (list, tuple)):
                    out.extend([placement] * len(value))
                else:
                    out.append(placement)
            return out

        def register(fn: Callable[[Any], Any]) -> None:
            def sharding_of(overload: Any) -> Callable[..., list[tuple[list[Any], list[Any]]]]:
                names = spec.names_of(overload)

                def sharding(*args: Any, **kwargs: Any) -> list[tuple[list[Any], list[Any]]]:
                    a = spec.bind(args, kwargs, overload)
                    return [(outs, placements(names, args, ins)) for outs, ins in fn(a)]

                return sharding

            for overload in spec.overloads:
                register_sharding(overload)(sharding_of(overload))

        return register

    def mrope(a: Any) -> bool:
        return a.mrope_section is not None

    @rule(ROTARY)
    def _rotary(a):
        return [
            ([p], {"x": p, "positions": pp, "cos_sin": R})
            for p, pp in _placements(a.x, a.positions, mrope(a))
        ]

    @rule(ROTARY_QK)
    def _rotary_qk(a):
        return [
            ([p, p], {"q": p, "k": p, "positions": pp, "cos_sin": R})
            for p, pp in _placements(a.q, a.positions, mrope(a))
        ]

    @rule(ROTARY_QK_)
    def _rotary_qk_inplace(a):
        return [
            ([], {"q": p, "k": None if a.k is None else p, "positions": pp, "cos_sin": R})
            for p, pp in _placements(a.q, a.positions, mrope(a))
        ]

    def norm_inputs(p: Any, pp: Any) -> dict[str, Any]:
        return {"q": p, "k": p, "q_weight": R, "k_weight": R, "positions": pp, "cos_sin": R}

    @rule(QK_NORM)
    def _qk_norm_rotary(a):
        return [([p, p], norm_inputs(p, pp)) for p, pp in _token_placements(a.q, a.positions, mrope(a))]

    @rule(QK_NORM_)
    def _qk_norm_rotary_inplace(a):
        return [([], norm_inputs(p, pp)) for p, pp in _token_placements(a.q, a.positions, mrope(a))]

    @rule(QK_NORM_PACKED_)
    def _qk_norm_rotary_packed(a):
        # a packed row mixes q, k and v heads: tokens are sharded (with per-token positions), never heads
        lead = 1 if mrope(a) else 0
        pos_tok = Shard(lead) if a.positions.shape[lead] > 1 else R
        weights = {"q_weight": R, "k_weight": R, "cos_sin": R}
        return [
            ([], {"qkv": R, "positions": R, **weights}),
            ([], {"qkv": Shard(0), "positions": pos_tok, **weights}),
        ]

    @rule(CACHE)
    def _rotary_qk_cache(a):
        cache_heads = 2 if a.layout == "NHD" else 1

        def inputs(x: Any, c: Any) -> dict[str, Any]:
            scales = {n: R for n in ("k_scale", "v_scale", "q_scale") if getattr(a, n) is not None}
            q_out = {} if a.q_out is None else {"q_out": x}  # placed like q
            fixed = {"positions": R, "cos_sin": R, "slot_mapping": R, "page_table": R}
            return {"q": x, "k": x, "v": x, "key_cache": c, "value_cache": c, **fixed, **scales, **q_out}

        return [([], inputs(R, R)), ([], inputs(Shard(1), Shard(cache_heads)))]

    @rule(MLA_CACHE)
    def _mla_rotary_cache(a):
        # the latent cache has no heads: it, kv_c and k_pe are replicated; q may be sharded by heads
        def inputs(x: Any) -> dict[str, Any]:
            scales = {n: R for n in ("kv_scale", "q_scale") if getattr(a, n) is not None}
            q_out = {} if a.q_out is None else {"q_out": x}
            fixed = {n: R for n in ("kv_c", "k_pe", "positions", "cos_sin", "kv_cache", "slot_mapping")}
            fixed["page_table"] = R
            return {"q": x, **fixed, **scales, **q_out}

        return [([], inputs(R)), ([], inputs(Shard(1)))]

    @rule(REROTATE)
    def _rerotate_kv_cache(a):
        # each head's rows rotate on their own: the cache may be sharded on its head dim
        fixed = {n: R for n in ("slot_mapping", "delta", "cos_sin")}
        scale = {} if a.k_scale is None else {"k_scale": R}
        heads = Shard(2 if a.layout == "NHD" else 1)
        return [([], {"key_cache": R, **fixed, **scale}), ([], {"key_cache": heads, **fixed, **scale})]

    _registered = True
    return True

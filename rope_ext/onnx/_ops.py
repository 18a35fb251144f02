"""The ONNX translations of the rope_ext ops, the functional twins of the in-place ops, and the rewrite that
puts the twins in place of the in-place ops in an exported program.

An in-place op in a graph torch.export captured (``rotary_qk_`` on q and k, ``rotary_qk_cache_`` on q, k and
the caches, ...) becomes its twin ``rope_ext_onnx::<op>`` (the op without the trailing underscore: the new
value of every argument the op writes, in schema order) and one ``aten.copy_`` into each written tensor;
functionalization then turns the copies into data flow (slice scatters for views of a packed qkv), which
ONNX expresses. The twins exist only for export: they run eagerly (the in-place op on clones) and have fake
kernels, so a rewritten program still runs and re-traces.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from .. import fakes as _fakes  # noqa: F401  (the fake kernels of the rope_ext ops)
from ..specs import (
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
from ._graph import (
    ExportError,
    cache_write,
    page_slots,
    quantize,
    rerotate_rows,
    rms_norm,
    rotate,
    static_dim,
)

__all__ = ["TWINS", "functionalize", "translations"]

_INPLACE = (ROTARY_QK_, CACHE, MLA_CACHE, REROTATE, QK_NORM_, QK_NORM_PACKED_)


# The functional twins ------------------------------------------------------------------------------------

_lib = torch.library.Library("rope_ext_onnx", "DEF")  # noqa: TOR901  (kept for the life of the process)


def _mutated(spec: OpSpec) -> tuple[str, ...]:
    """The arguments ``spec``'s op writes (``Tensor(a!)``), in schema order."""
    return tuple(
        a.name for a in spec.op._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    )


def _define_twin(spec: OpSpec) -> torch._ops.OpOverload:
    written = _mutated(spec)
    args = re.sub(r"\([a-z]!\)", "", str(spec.op._schema).split("(", 1)[1].rsplit(") ->", 1)[0])
    name = spec.name.rstrip("_")
    returns = "Tensor" if len(written) == 1 else f"({', '.join(['Tensor'] * len(written))})"
    _lib.define(f"{name}({args}) -> {returns}")
    twin = getattr(torch.ops.rope_ext_onnx, name).default

    def result(values: list) -> Any:
        first = values[0]
        values = tuple(first.new_empty(0) if t is None else t for t in values)
        return values[0] if len(values) == 1 else values

    def eager(*args, **kwargs):
        a = spec.bind(args, kwargs)
        new = {n: None if getattr(a, n) is None else getattr(a, n).clone() for n in written}
        spec.op(*a._replace(**new))
        return result(list(new.values()))

    def fake(*args, **kwargs):
        a = spec.bind(args, kwargs)
        return result([None if getattr(a, n) is None else torch.empty_like(getattr(a, n)) for n in written])

    _lib.impl(name, eager, "CompositeExplicitAutograd")
    torch.library.register_fake(twin, fake, lib=_lib)
    return twin


TWINS = {spec.name: (spec, _define_twin(spec)) for spec in _INPLACE}
"""In-place op name -> (its OpSpec, its functional twin ``torch.ops.rope_ext_onnx.<name>.default``)."""


# The rewrite -----------------------------------------------------------------------------------------------

_HOPS = ("auto_functionalized", "auto_functionalized_v2")


def functionalize(exported_program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrites, in place, every in-place rope_ext op of ``exported_program``'s graph as its functional twin
    plus ``aten.copy_`` into each tensor it writes (the same values), and returns the program.

    Takes a program as ``torch.export.export`` returns it; one already functionalized by
    ``run_decompositions()`` holds the in-place ops as ``auto_functionalized`` nodes, which raise
    :class:`ExportError` (export the module, or the program before ``run_decompositions``)."""
    gm = exported_program.graph_module
    changed = False
    for module in list(gm.modules()):
        if isinstance(module, torch.fx.GraphModule) and _rewrite(module.graph):
            module.recompile()
            changed = True
    if changed:
        exported_program.graph.lint()
    return exported_program


def _rewrite(graph: torch.fx.Graph) -> bool:
    fake_mode = None
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if getattr(target, "__name__", None) in _HOPS and node.args:
            inner = node.args[0]
            if getattr(inner, "namespace", None) == "rope_ext":
                raise ExportError(
                    f"rope_ext.onnx: {inner.name()} is already functionalized (auto_functionalized) in this "
                    "ExportedProgram: export the module, or the program as torch.export.export returns it "
                    "(before run_decompositions)"
                )
            continue
        if not isinstance(target, torch._ops.OpOverload) or target.namespace != "rope_ext":
            continue
        name = target._schema.name.split("::", 1)[1]
        if name not in TWINS:
            continue
        spec, twin = TWINS[name]
        if fake_mode is None:
            fake_mode = torch._guards.detect_fake_mode(
                [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
            )
        a = spec.bind(node.args, node.kwargs, target)
        with graph.inserting_before(node):
            new = graph.call_function(twin, tuple(a))
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta["val"] = _meta_value(fake_mode, twin, a)
            written = _mutated(spec)
            for i, arg in enumerate(written):
                dst = getattr(a, arg)
                if dst is None:
                    continue
                if len(written) == 1:
                    value = new
                else:
                    value = graph.call_function(operator.getitem, (new, i))
                    value.meta["val"] = new.meta["val"][i]
                copy = graph.call_function(torch.ops.aten.copy_.default, (dst, value))
                copy.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                copy.meta["val"] = dst.meta.get("val")
        graph.erase_node(node)
        changed = True
    return changed


def _meta_value(fake_mode, twin, a):
    values = [torch.fx.node.map_arg(x, lambda n: n.meta.get("val")) for x in a]  # page_table: a list
    if fake_mode is None:
        return None
    with fake_mode:
        return twin(*values)


# The translations -------------------------------------------------------------------------------------------


def _rotation_options(a) -> dict:
    return {
        "interleaved": a.interleaved,
        "inverse": getattr(a, "inverse", False),
        "rotary_offset": a.rotary_offset,
        "mrope_section": a.mrope_section,
        "mrope_interleaved": a.mrope_interleaved,
    }


def _empty_like(x: ir.Value) -> ir.Value:
    return op.CastLike(op.ConstantOfShape([0]), x)


def _rotary(*args, **kwargs):
    a = ROTARY.bind(args, kwargs)
    return rotate(a.x, a.positions, a.cos_sin, op_name="rotary", **_rotation_options(a))


def _rotary_qk(*args, **kwargs):
    a = ROTARY_QK.bind(args, kwargs)
    opts = _rotation_options(a)
    return (
        rotate(a.q, a.positions, a.cos_sin, op_name="rotary_qk", **opts),
        rotate(a.k, a.positions, a.cos_sin, op_name="rotary_qk", **opts),
    )


def _rotary_qk_twin(*args, **kwargs):
    a = ROTARY_QK_.bind(args, kwargs)
    opts = _rotation_options(a)
    q = rotate(a.q, a.positions, a.cos_sin, op_name="rotary_qk_", **opts)
    k = _empty_like(a.q) if a.k is None else rotate(a.k, a.positions, a.cos_sin, op_name="rotary_qk_", **opts)
    return q, k


def _norm_rotate(x, w, a, name: str, shape: list | None = None, dtype: ir.DataType | None = None) -> ir.Value:
    shape = list(x.shape) if shape is None else shape
    dtype = x.dtype if dtype is None else dtype
    normed = rms_norm(x, dtype, w, a.eps, a.weight_offset)
    return rotate(
        normed, a.positions, a.cos_sin, op_name=name, shape=shape, dtype=dtype, **_rotation_options(a)
    )


def _qk_norm_rotary(*args, **kwargs):
    a = QK_NORM.bind(args, kwargs)
    return _norm_rotate(a.q, a.q_weight, a, "qk_norm_rotary"), _norm_rotate(
        a.k, a.k_weight, a, "qk_norm_rotary"
    )


def _qk_norm_rotary_twin(*args, **kwargs):
    a = QK_NORM_.bind(args, kwargs)
    return _norm_rotate(a.q, a.q_weight, a, "qk_norm_rotary_"), _norm_rotate(
        a.k, a.k_weight, a, "qk_norm_rotary_"
    )


def _qk_norm_rotary_packed_twin(*args, **kwargs):
    a = QK_NORM_PACKED_.bind(args, kwargs)
    name = "qk_norm_rotary_packed_"
    hq, hk, hv = a.num_heads_q, a.num_heads_k, a.num_heads_v
    tokens = a.qkv.shape[0]
    d = static_dim(a.q_weight.shape[0], "head_dim (q_weight.shape[0])", name)

    def norm_rotate(start: int, count: int, weight: ir.Value) -> ir.Value:
        heads = op.Reshape(op.Slice(a.qkv, [start * d], [(start + count) * d], [-1]), [0, count, d])
        return _norm_rotate(heads, weight, a, name, [tokens, count, d], a.qkv.dtype)

    q = norm_rotate(0, hq, a.q_weight)
    k = norm_rotate(hq, hk, a.k_weight)
    parts = [op.Reshape(q, [0, hq * d]), op.Reshape(k, [0, hk * d])]
    if hv:
        parts.append(op.Slice(a.qkv, [(hq + hk) * d], [(hq + hk + hv) * d], [-1]))
    return op.Concat(*parts, axis=-1)


def _slots(a, cache: ir.Value, layout: str) -> ir.Value:
    """A cache write's slots: its slot_mapping, or those its page table gives (-1 where it places none)."""
    return a.slot_mapping if a.page_table is None else page_slots(a.page_table, cache, layout)


def _rotary_qk_cache_twin(*args, **kwargs):
    a = CACHE.bind(args, kwargs)
    name = "rotary_qk_cache_"
    if a.layout not in ("NHD", "HND"):
        raise ExportError(f"rope_ext.onnx: {name}: layout={a.layout!r} is not 'NHD' or 'HND'")
    opts = {**_rotation_options(a), "inverse": False}
    q_rot = rotate(a.q, a.positions, a.cos_sin, op_name=name, **(opts | {"inverse": a.inverse}))
    k_rot = rotate(a.k, a.positions, a.cos_sin, op_name=name, **opts)
    fp8 = a.key_cache.dtype in (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2)
    slots = _slots(a, a.key_cache, a.layout)
    key_cache = cache_write(k_rot, a.key_cache, slots, a.k_scale if fp8 else None, a.layout)
    value_cache = cache_write(a.v, a.value_cache, slots, a.v_scale if fp8 else None, a.layout)
    if a.q_out is None:
        return q_rot, k_rot, key_cache, value_cache, _empty_like(a.q)
    q_scale = a.q_scale if a.q_out.dtype in (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2) else None
    return op.Identity(a.q), k_rot, key_cache, value_cache, quantize(q_rot, q_scale, a.q_out.dtype)


def _mla_rotary_cache_twin(*args, **kwargs):
    a = MLA_CACHE.bind(args, kwargs)
    name = "mla_rotary_cache_"
    opts = {"interleaved": a.interleaved, "inverse": False}
    q_opts = opts | {"inverse": a.inverse, "rotary_offset": a.rotary_offset}
    q_rot = rotate(a.q, a.positions, a.cos_sin, op_name=name, **q_opts)
    k_rot = rotate(a.k_pe, a.positions, a.cos_sin, op_name=name, **opts)
    # the cache rows [T, kv_lora_rank + rotary_dim]: kv_c, then the rotated k_pe
    rows = op.Concat(a.kv_c, op.Reshape(k_rot, [0, -1]), axis=-1)
    fp8 = a.kv_cache.dtype in (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2)
    kv_cache = cache_write(rows, a.kv_cache, _slots(a, a.kv_cache, "NHD"), a.kv_scale if fp8 else None, "NHD")
    if a.q_out is None:
        return q_rot, k_rot, kv_cache, _empty_like(a.q)
    q_scale = a.q_scale if a.q_out.dtype in (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2) else None
    return op.Identity(a.q), k_rot, kv_cache, quantize(q_rot, q_scale, a.q_out.dtype)


def _rerotate_kv_cache_twin(*args, **kwargs):
    a = REROTATE.bind(args, kwargs)
    name = "rerotate_kv_cache_"
    if a.layout not in ("NHD", "HND"):
        raise ExportError(f"rope_ext.onnx: {name}: layout={a.layout!r} is not 'NHD' or 'HND'")
    fp8 = a.key_cache.dtype in (ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2)
    return rerotate_rows(
        a.key_cache, a.slot_mapping, a.delta, a.cos_sin, a.k_scale if fp8 else None, layout=a.layout,
        interleaved=a.interleaved, rotary_offset=a.rotary_offset, op_name=name,
    )  # fmt: skip


def translations() -> dict:
    """Every op the exported graph can hold (the functional ops and the twins) -> its translation."""
    twins = {name: twin for name, (_, twin) in TWINS.items()}
    return {
        ROTARY.op: _rotary,
        ROTARY_QK.op: _rotary_qk,
        QK_NORM.op: _qk_norm_rotary,
        twins["rotary_qk_"]: _rotary_qk_twin,
        twins["qk_norm_rotary_"]: _qk_norm_rotary_twin,
        twins["qk_norm_rotary_packed_"]: _qk_norm_rotary_packed_twin,
        twins["rotary_qk_cache_"]: _rotary_qk_cache_twin,
        twins["mla_rotary_cache_"]: _mla_rotary_cache_twin,
        twins["rerotate_kv_cache_"]: _rerotate_kv_cache_twin,
    }

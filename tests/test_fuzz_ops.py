"""Hostile non-integer arguments to every public function and every bare op (and its overloads).

Every tensor argument of every entry point (public functions, ``RotaryEmbedding.forward``, the
``torch.ops.rope_ext`` overloads, the emulated CUDA body) gets in turn every dtype, a wrong rank, meta, a
zero size, an expanded view, a strided last dim, a transposed layout, a storage offset, a leaf requiring grad
and None; then come overlapping views, zero tokens, all-meta calls and non-tensor options. Each case is
marked must raise (True), must compute (False) or either (None): a call returns the float64 reference's
answer and writes nothing outside its outputs, or raises a Python exception naming the argument (a mismatch
may name the other side) with every input's storage bit-identical. The calls run in a subprocess (this file
as a script): every case on the default CPU instruction set, a subset on the others.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from _helpers import assert_close_to_reference, child_env

import rope_ext
from rope_ext import reference

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = (TypeError, ValueError, IndexError, RuntimeError, NotImplementedError)
T, HQ, HK, D, R, P = 3, 2, 1, 40, 32, 16
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = (*FLOATS, torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64, *FP8)
SEC = [6, 5, 5]  # an mrope_section for rotary_dim R

# References: what an entry point returns or writes, float64 (integers exact), from the arguments before.

_ROT_KW = ("interleaved", "inverse", "rotary_offset", "mrope_section", "mrope_interleaved")


def _rot(x, pos, cs, kw):
    kw = {n: bool(v) if n == "interleaved" else v for n, v in kw.items() if n in _ROT_KW}
    return reference.rotary_hadamard(x, pos, cs, **kw)


def _normrot(x, w, pos, cs, kw):
    """QK RMSNorm (rounded once to x's dtype, as the kernels round it), then the rotation."""
    if x.dim() != 3 or w.shape != (x.shape[-1],):
        raise ValueError("reference: x [T, H, D], weight [D]")
    n = reference.rms_norm(x, w, kw.get("eps", 1e-6), kw.get("weight_offset", 0.0)).to(x.dtype)
    return _rot(n, pos, cs, kw)


def _ref_rot(b, kw, outs):
    pos, cs = b["positions"], b["cos_sin"]
    if "x" in b:
        return {outs[0]: _rot(b["x"], pos, cs, kw)}
    k = {} if b["k"] is None else {outs[1]: _rot(b["k"], pos, cs, kw)}
    return {outs[0]: _rot(b["q"], pos, cs, kw), **k}


def _ref_cache(b, kw, outs):
    qr, kr = (_rot(b[n], b["positions"], b["cos_sin"], kw) for n in ("q", "k"))
    if kw.get("layout", "NHD") != "NHD":
        raise ValueError("reference: layout")
    kc, vc = reference.kv_cache_write(
        kr.to(b["k"].dtype), b["v"], b["key_cache"], b["value_cache"], b["slot_mapping"],
        k_scale=b.get("k_scale"), v_scale=b.get("v_scale"),
    )  # fmt: skip
    return {"k": kr, "key_cache": kc, "value_cache": vc, "q" if b.get("q_out") is None else "q_out": qr}


def _ref_norm(b, kw, outs):
    pos, cs = b["positions"], b["cos_sin"]
    return {o: _normrot(b[n], b[f"{n}_weight"], pos, cs, kw) for o, n in zip(outs, "qk", strict=True)}


def _ref_packed(b, kw, outs):
    qkv, hq, hk, hv = b["qkv"], b["num_heads_q"], b["num_heads_k"], b["num_heads_v"]
    if qkv.dim() != 2 or any(type(h) is not int for h in (hq, hk, hv)) or qkv.shape[-1] % (hq + hk + hv):
        raise ValueError("reference: qkv [T, (Hq+Hk+Hv)*D]")
    x = qkv.unflatten(-1, (hq + hk + hv, -1))
    q = _normrot(x[:, :hq], b["q_weight"], b["positions"], b["cos_sin"], kw)
    k = _normrot(x[:, hq : hq + hk], b["k_weight"], b["positions"], b["cos_sin"], kw)
    return {"qkv": torch.cat([q, k, x[:, hq + hk :].double()], 1).flatten(1)}


def _ref_varlen(b, kw, outs):
    cu, start = b["cu_seqlens"], b["start_positions"]
    if cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype in (torch.bool, torch.complex64):
        raise TypeError("reference: integer cu_seqlens")
    out = []
    for i in range(cu.shape[0] - 1):
        out += [(0 if start is None else int(start[i])) + j for j in range(int(cu[i + 1]) - int(cu[i]))]
    return {"out": torch.tensor(out, dtype=kw.get("dtype", torch.int32))}


_embedding = functools.partial(rope_ext.RotaryEmbedding, D, rotary_dim=R, max_positions=P)


def _ref_module(b, kw, outs):
    pos, table = b["positions"], _embedding().cos_sin()
    pos = torch.arange(kw.get("offset", 0), kw.get("offset", 0) + b["q"].shape[0]) if pos is None else pos
    return {"q": _rot(b["q"], pos[..., None], table, kw), "k": _rot(b["k"], pos[..., None], table, kw)}


# Entry points.


def _inputs(seed: int = 0, tokens: int = T) -> dict:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, D, generator=g) for h in (HQ, HK, HK))
    w = torch.randn(2, D, generator=g) * 0.3 + 1
    i = dict(q=q, k=k, v=v, qw=w[0], kw=w[1], pos=torch.randint(0, P, (tokens,), generator=g))
    i |= dict(cs=rope_ext.RopeCache(R, max_positions=P).cos_sin.clone(), qkv=torch.randn(tokens, 4 * D))
    caches = dict(kc=torch.zeros(2, 4, HK, D), vc=torch.zeros(2, 4, HK, D))
    return i | caches | dict(slots=torch.tensor([5, -1, 2][:tokens], dtype=torch.long))


def _args(family: str, i: dict) -> dict:
    """The valid arguments, in call order, of the entry points of ``family``."""
    rot = dict(positions=i["pos"][:, None], cos_sin=i["cs"])
    cache = dict(q=i["q"], k=i["k"], v=i["v"], positions=i["pos"], cos_sin=i["cs"], key_cache=i["kc"])
    cache |= dict(value_cache=i["vc"], slot_mapping=i["slots"])
    norm = dict(q_weight=i["qw"], k_weight=i["kw"], positions=i["pos"], cos_sin=i["cs"])
    f8 = dict(key_cache=i["kc"].to(FP8[0]), value_cache=i["vc"].to(FP8[0]))
    return {
        "rot1": lambda: dict(x=i["q"], **rot),
        "rot2": lambda: dict(q=i["q"], k=i["k"], **rot),
        "module": lambda: dict(q=i["q"], k=i["k"], positions=i["pos"]),
        "cache": lambda: cache,
        "scaled": lambda: cache | f8 | dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0])),
        "q_out": lambda: cache | dict(q_out=torch.empty_like(i["q"])),
        "norm": lambda: dict(q=i["q"], k=i["k"], **norm),
        "packed": lambda: dict(qkv=i["qkv"], num_heads_q=HQ, num_heads_k=HK, num_heads_v=HK, **norm),
        "varlen": lambda: dict(cu_seqlens=torch.tensor([0, 2, 2, 5]), start_positions=i["pos"] // 4),
        "emu": lambda: dict(q=i["q"], k=i["k"], q_out=i["q"] * 0, k_out=i["k"] * 0) | rot,
        "emu_norm": lambda: dict(q=i["q"], k=i["k"], q_out=i["q"] * 0, k_out=i["k"] * 0) | norm,
    }[family]()


_CACHE = dict(q="a", k="a", v="a", positions="p", cos_sin="c", key_cache="kc", value_cache="vc")
_CACHE |= dict(slot_mapping="s")
_NORM = dict(positions="p", cos_sin="c")
# family -> (reference, the kind of each tensor argument: see KINDS; a written "a" becomes "o")
FAMILIES = {
    "rot1": (_ref_rot, dict(x="x", positions="pos1", cos_sin="c")),
    "rot2": (_ref_rot, dict(q="a", k="a", positions="pos1", cos_sin="c")),
    "module": (_ref_module, dict(q="a", k="a", positions="pm?")),
    "cache": (_ref_cache, _CACHE),
    "scaled": (_ref_cache, _CACHE | dict(k_scale="sc?", v_scale="sc?")),
    "q_out": (_ref_cache, _CACHE | dict(q_out="qo?")),
    "norm": (_ref_norm, dict(q="a", k="a", q_weight="w", k_weight="w") | _NORM),
    "packed": (_ref_packed, dict(qkv="a", q_weight="w", k_weight="w") | _NORM),
    "varlen": (_ref_varlen, dict(cu_seqlens="i", start_positions="i?")),
    "emu": (_ref_rot, dict(q="a", k="a", q_out="a", k_out="a", positions="pos1", cos_sin="c")),
    "emu_norm": (_ref_norm, dict(q="a", k="a", q_out="a", k_out="a", q_weight="w", k_weight="w") | _NORM),
}


class Op:
    """An entry point: ``call(args, kw)`` on the arguments of its family, ``outs`` the names of what it
    returns, ``mutated`` the arguments it writes; ``marks`` overrides {"kind.category" or category: mark}."""

    def __init__(self, name, call, family, outs=(), mutated=(), marks=None):
        self.name, self.call, self.family, self.outs, self.mutated = name, call, family, outs, mutated
        self.ref, kinds = FAMILIES[family]
        self.kinds = {n: "o" + k[1:] if n in mutated and k[0] == "a" else k for n, k in kinds.items()}
        self.marks, self.loose = marks or {}, family in ("norm", "packed", "emu_norm")

    def args(self, inputs: dict) -> dict:
        return _args(self.family, inputs)


def _entry_points() -> list[Op]:
    ops = torch.ops.rope_ext

    public = lambda fn: lambda a, kw: fn(**a, **kw)
    bare = lambda fn, *extra: lambda a, kw: fn(*a.values(), *extra, **kw)
    module = lambda inplace: lambda a, kw: _embedding()(**a, **kw, inplace=inplace)  # a new one each call

    qo, qk, qkc = ("q_out", "k_out"), ("q", "k"), ("q", "k", "key_cache", "value_cache")
    no_grad = {"a.grad": True}  # the public serving op is an inference op: an input that requires grad raises
    cache = public(rope_ext.apply_rotary_qk_and_cache_)
    eps = [
        Op("apply_rotary", public(rope_ext.apply_rotary), "rot1", ("out",)),
        Op("rotary", bare(ops.rotary.default), "rot1", ("out",)),
        Op("apply_rotary_qk", public(rope_ext.apply_rotary_qk), "rot2", qo),
        Op("rotary_qk", bare(ops.rotary_qk.default), "rot2", qo),
        Op("apply_rotary_qk_", public(rope_ext.apply_rotary_qk_), "rot2", (), qk, {"k.none": False}),
        Op("rotary_qk_", bare(ops.rotary_qk_.default), "rot2", (), qk, {"k.none": False}),
        Op("rotary_qk_.plain", bare(ops.rotary_qk_.plain), "rot2", (), qk, {"k.none": False}),
        Op("RotaryEmbedding", module(False), "module", qk),
        Op("RotaryEmbedding.inplace", module(True), "module", (), qk),
        Op("apply_rotary_qk_and_cache_", cache, "cache", (), qkc, no_grad),
        Op("apply_rotary_qk_and_cache_+scales", cache, "scaled", (), qkc, no_grad),
        Op("apply_rotary_qk_and_cache_+q_out", cache, "q_out", (), (*qkc[1:], "q_out"), no_grad),
        Op("rotary_qk_cache_", bare(ops.rotary_qk_cache_.default), "cache", (), qkc),
        Op("rotary_qk_cache_.plain", bare(ops.rotary_qk_cache_.plain), "cache", (), qkc),
        Op("rotary_qk_cache_.scaled", bare(ops.rotary_qk_cache_.scaled), "scaled", (), qkc),
        Op("apply_qk_norm_rotary", public(rope_ext.apply_qk_norm_rotary), "norm", qo),
        Op("qk_norm_rotary", bare(ops.qk_norm_rotary.default), "norm", qo),
        Op("qk_norm_rotary_", bare(ops.qk_norm_rotary_.default), "norm", qk, qk),
        Op("apply_qk_norm_rotary_", public(rope_ext.apply_qk_norm_rotary_), "packed", (), ("qkv",)),
        Op("qk_norm_rotary_packed_", bare(ops.qk_norm_rotary_packed_.default), "packed", (), ("qkv",)),
        Op("qk_norm_rotary_packed_.plain", bare(ops.qk_norm_rotary_packed_.plain), "packed", (), ("qkv",)),
        Op("varlen_positions", public(rope_ext.varlen_positions), "varlen", ("out",)),
    ]
    emulated = [("", "emu", qo, (False, False)), ("_norm", "emu_norm", qo, (1e-6, False, 0.0))]
    emulated.append(("_cache", "cache", qkc, (None, None, None, None, False, "NHD")))
    for sms, scalar in ((1, False), (132, True)) if hasattr(ops, "_cuda_emulated") else ():
        for sfx, family, mutated, extra in emulated:  # the CUDA bodies on the host: vector, 1 SM; scalar, 132
            fn = bare(getattr(ops, f"_cuda_emulated{sfx}").default, *extra, sms, scalar)
            eps.append(Op(f"_cuda_emulated{sfx}.{sms}", fn, family, (), mutated))
    return eps


# Hostile values of one tensor argument and their marks.

# Per kind of argument: the mark of each category of hostile value (True must raise, False must compute,
# None either) where it differs from BASE, and of each dtype where it differs from True.
BASE = dict(none=True, d0=True, d1=True, more=True, less=True, meta=True, size0=None, expanded=False)
BASE |= dict(strided=None, transposed=False, offset=False, grad=False)
_HALF = {torch.float64: None, torch.float16: None, torch.bfloat16: None}
_OK_FLOATS = {torch.float64: False, torch.float16: False, torch.bfloat16: False}
KINDS = {
    "x": dict(dtypes=_OK_FLOATS, more=False, size0_1=False, size0_2=True),  # apply_rotary's x
    "a": dict(dtypes=_HALF, more=None, size0_2=True),  # an activation read
    "o": dict(dtypes=_HALF, more=None, size0_2=True, expanded=True, grad=True),  # an activation written
    "qo": dict(dtypes=dict.fromkeys(FP8, False), more=None, size0_2=True, expanded=True, grad=True),  # q_out
    "pos1": dict(dtypes={torch.int32: False}, d0=False, d1=False, less=False),  # positions [T, 1]
    "p": dict(dtypes={torch.int32: False}, expanded=None),  # serving positions [T]: nonzero stride
    "pm": dict(dtypes={torch.int32: False}, d0=False),  # RotaryEmbedding's positions [T]
    "c": dict(dtypes=_HALF),  # cos_sin
    "w": dict(dtypes=_OK_FLOATS, expanded=None),  # a norm weight (contiguous)
    "s": dict(dtypes={torch.int32: None}, size0=False, expanded=None),  # slot_mapping (contiguous)
    "kc": dict(expanded=True, grad=True),  # a cache
    "vc": dict(expanded=True, grad=True),
    "sc": dict(dtypes=_HALF, d0=False, more=None, size0=True),  # a scale: one float32 element
    "i": dict(dtypes={d: False for d in (torch.int32, torch.int64, torch.int8, torch.uint8)}, size0=True),
}


def _hostile(t: torch.Tensor):
    """(category, label, value) for the tensor argument ``t``."""
    yield "none", "None", None
    for dt in DTYPES:
        if dt != t.dtype:
            yield "dtype", f"dtype {str(dt)[6:]}", t.to(dt)
    if t.dim() != 0:
        yield "d0", "0-d", t.reshape(-1)[0].clone()
    if t.dim() != 1:
        yield "d1", "1-d", t.reshape(-1)[: t.shape[-1]].clone()
    yield "more", "one more dim", t[None]
    if t.dim() >= 2:
        yield "less", "one dim less", t[0]
    yield "meta", "meta", t.to("meta")
    for i in range(t.dim()):
        yield f"size0_{i}", f"size 0 in dim {i}", t.narrow(i, 0, 0)
    for i in range(t.dim() - (t.dim() > 1)):
        if t.shape[i] > 1:
            yield "expanded", f"expanded dim {i}", t.narrow(i, 0, 1).expand_as(t)
    if t.dim() >= 1 and t.shape[-1] > 1:
        yield "strided", "strided last dim", torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    if t.dim() >= 2:  # a 2-d one then has a strided last dim
        tr = t.transpose(0, 1).contiguous().transpose(0, 1)
        yield "transposed" if t.dim() > 2 else "strided", "transposed", tr
    off = torch.full((t.numel() + 7,), 7, dtype=t.dtype)[7:].view(t.shape).copy_(t)
    yield "offset", "storage offset", off
    if t.is_floating_point():
        yield "grad", "leaf requiring grad", t.clone().requires_grad_()


def _mark(op: Op, arg: str, category: str, value):
    kind = op.kinds[arg].rstrip("?")
    for key in (f"{arg}.{category}", f"{kind}.{category}"):
        if key in op.marks:
            return op.marks[key]
    if category == "none":
        return not op.kinds[arg].endswith("?")
    if category == "dtype":
        return KINDS[kind].get("dtypes", {}).get(value.dtype, True)
    if category == "grad" and not op.name.startswith(("apply_", "RotaryEmbedding")):
        return None  # the bare ops are the kernels below autograd (README, "Errors"): they may write it
    for key in (category, category.split("_")[0]):
        for marks in (op.marks, KINDS[kind], BASE):
            if key in marks:
                return marks[key]
    raise KeyError(category)


# Op-level cases: zero tokens, every tensor on meta, overlapping views, non-tensor values.


def _overlaps(op: Op, a: dict):
    """(argument names, label, args, mark) with views that share memory."""
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(T, HQ + HK, D, generator=g)
    flat = torch.randn(T, (HQ + HK + 1) * D, generator=g)
    half = flat[:, HQ * D - D // 2 : HQ * D + D // 2].unflatten(-1, (HK, D))  # half a head of q
    pairs = {
        "q and k overlap": dict(q=buf[:, :HQ], k=buf[:, HQ - 1 : HQ - 1 + HK]),
        "k is a part of q": dict(k=a["q"][:, :HK]) if "q" in a else {},
        "k shares half a head with q": dict(q=flat[:, : HQ * D].unflatten(-1, (HQ, D)), k=half),
        "q and k disjoint views": dict(q=buf[:, :HQ], k=buf[:, HQ:]),
    }
    if "q" in a and "k" in a and "x" not in a and "qkv" not in a:
        written = "q" in op.mutated or "k" in op.mutated  # nothing written may overlap what the call reads
        for label, change in pairs.items():
            yield "q,k", label, a | change, written and "disjoint" not in label
    cases, kvc = [], "key_cache,value_cache"
    if "key_cache" in a:
        kv = torch.zeros(2, 4, HK, 3 * D // 2, dtype=a["key_cache"].dtype)
        cases.append((kvc, "caches overlap", dict(key_cache=kv[..., :D], value_cache=kv[..., -D:]), True))
        cases.append((kvc, "value_cache is key_cache", dict(value_cache=a["key_cache"]), True))
        kv = torch.zeros(2, 2, 4, HK, D, dtype=a["key_cache"].dtype)
        cases.append((kvc, "caches in one tensor", dict(key_cache=kv[0], value_cache=kv[1]), False))
        cases.append(("k,key_cache", "k is in key_cache", dict(k=a["key_cache"].flatten(0, 1)[:T]), None))
        cases.append(
            ("v,value_cache", "v is in value_cache", dict(v=a["value_cache"].flatten(0, 1)[:T]), None)
        )
    if a.get("q_out") is not None and "key_cache" in a:
        cases.append(("q_out,k", "q_out overlaps k", dict(k=buf[:, HQ:], q_out=buf[:, 1 : HQ + 1]), True))
        cases.append(("q_out,q", "q_out is q", dict(q_out=a["q"]), None))
    if "k_out" in a:
        cases.append(
            ("q_out,k_out", "q_out and k_out overlap", dict(q_out=buf[:, :2], k_out=buf[:, 1:2]), True)
        )
        cases.append(("q_out,k_out", "in place", dict(q_out=a["q"], k_out=a["k"]), False))
    for arg, label, change, mark in cases:
        yield arg, label, a | change, mark


MROPE = [([], 1), ([16], 1), ([8, 8], 1), ([6, 5, 5, 0], 1), ([6.0, 5, 5], 1), ([True, 10, 5], 1)]
MROPE += [((6, 5, 5), 0), (torch.tensor(SEC), 1), ("655", 1)]
FLAG = [(1, None), (2.5, None), (None, None), ("yes", 1), (True, 0)]
OFFSET = [(True, 1), (1.0, 1), (8.0, 1), (None, 1), ("1", 1), (8, 0)]
# option -> (the ops that take it, [(value, 1: must raise in the public API, 0: must compute, None: either)])
OPTIONS = {
    "mrope_section": (r"^(apply_|rotary|qk_norm|_cuda_emulated.1)(?!.*(plain|scaled|scales|q_out))", MROPE),
    "rotary_offset": (r"^(apply_rotary|rotary|qk_norm|apply_qk)(?!.*(plain|scal|q_out))", OFFSET),
    "num_heads_q": (r"packed_$|^apply_qk_norm_rotary_$", [(True, 1), (2.0, 1), (None, 1), ("2", 1), (2, 0)]),
    "eps": (r"^(apply_)?qk_norm_rotary_?$", [(True, 1), (None, 1), ("1e-6", 1), (1, 0)]),
    "weight_offset": (r"^(apply_)?qk_norm_rotary_?$", [(True, 1), (None, 1), ("0", 1), (1, 0)]),
    "interleaved": (r"^(apply_rotary|rotary)(_qk)?_?$", FLAG),
    "inverse": (r"^(apply_)?rotary$", FLAG),
    "layout": (r"cache_$", [(1, 1), (None, 1), ("nhd", 1), ("HND", 1)]),
    "dtype": ("^varlen", [(torch.float32, 1), ("int32", 1), (None, 1), (torch.int64, 0)]),
    "cp_size": ("^varlen", [(True, 1), (1.0, 1), (None, 1)]),
    "total_tokens": ("^varlen", [(True, 1), (5.0, 1), (5, 0)]),
    "offset": ("^RotaryEmbedding", [(True, 1), (1.5, 1), (None, 1), (2, 0)]),
}
SYNONYMS = {"num_heads_q": ("head counts", "Hq+Hk+Hv"), "q_out": ("q",), "k_out": ("k",)}


def _options(op: Op, a: dict):
    """(argument name, label, args, kw, mark) with a non-tensor value of an option."""
    public = not re.match(r"^(rotary|qk_norm|_cuda)", op.name)
    for name, (ops, values) in OPTIONS.items():
        if not re.search(ops, op.name):
            continue
        for value, mark in values:
            args, kw = dict(a), {name: value}
            if name == "mrope_section":
                args["positions"] = torch.stack([a["positions"] + i for i in range(3)]) % P
            if name == "offset":
                args["positions"] = None
            if name in args:
                args[name] = kw.pop(name)
            mark = None if mark and not public else (None if mark is None else bool(mark))
            yield name, f"{name}={value!r}", args, kw, mark


# Running one case.


def _storages(tensors) -> dict:
    """{storage: (its bytes, a copy)} of every CPU tensor of ``tensors``."""
    cpu = [
        torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()) for t in tensors if t.device.type == "cpu"
    ]
    return {u.data_ptr(): (u, u.clone()) for u in cpu}


def _cover(t: torch.Tensor, storages: dict, masks: dict) -> None:
    """Marks the bytes of its storage that ``t`` covers (where the call may write)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    u = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    es = t.element_size()
    idx = torch.arange(u.numel() // es).as_strided(t.shape, t.stride(), t.storage_offset())
    m = masks.setdefault(u.data_ptr(), torch.zeros(u.numel(), dtype=torch.bool))
    m[(idx.reshape(-1, 1) * es + torch.arange(es)).reshape(-1)] = True


def _compare(name, got, ref, scale, loose) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{name}: returned {type(got).__name__}"
    if tuple(got.shape) != tuple(ref.shape):
        return f"{name}: shape {list(got.shape)}, the reference {list(ref.shape)}"
    if got.device.type == "meta" or got.numel() == 0:
        return None
    if not got.is_floating_point():
        ok = got.dtype == ref.dtype and torch.equal(got, ref)
        return None if ok else f"{name}: {got} != {ref}"
    g, r = got.detach().double(), ref.double()
    if got.dtype in FP8:  # within one fp8 ulp of the reference (the rotation rounds before the quantization)
        ok = ((g - r).abs() <= r.abs() * (0.07 if got.dtype == FP8[0] else 0.13) + 2.0**-9).all()
        return None if ok else f"{name}: fp8 values differ from the reference"
    if loose:  # the norm rounds its normalised value to the dtype, then rotates: 2.5 ulps of max|ref|
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(got.dtype, torch.finfo(got.dtype).eps * 2.5)
        err = (g - r).abs().max().item()
        return None if err <= tol * max(r.abs().max().item(), 1.0) else f"{name}: error {err:.3g}"
    try:
        assert_close_to_reference(got.detach(), r, scale)
    except AssertionError as e:
        return f"{name}: {e}"
    return None


MISMATCH = ("dtype", "d0", "d1", "more", "less", "size0", "meta")  # the message may name the other side


def _names(op: Op, e: BaseException, arg: str, category: str) -> bool:
    words = [w for a in arg.split(",") for w in (a, *SYNONYMS.get(a, ()))]
    if category.startswith(MISMATCH):
        words += [*op.kinds, "device"] if category == "meta" else list(op.kinds)
    if category == "grad":  # autograd's own error for an in-place op, word for word (test_inplace_autograd)
        words.append("leaf Variable that requires grad is being used in an in-place operation")
    return any(re.search(rf"(?<![\w.]){re.escape(w)}(?!\w)", str(e)) for w in words)


def run_case(op: Op, args: dict, kw: dict, arg: str, category: str, must_raise, ref_args=None) -> str:
    """Runs one case: "ok", "raised", or what went wrong."""
    tensors = [v for v in args.values() if isinstance(v, torch.Tensor)]
    before = {n: v.detach().clone() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    storages = _storages(tensors)
    try:
        result = op.call(args, kw)
    except ALLOWED as e:
        msg = f"{type(e).__name__}: {str(e)[:200]}"
        if must_raise is False:
            return f"raised {msg}"
        if any(not torch.equal(u, b) for u, b in storages.values()):
            return f"raised but changed an input: {msg}"
        return "raised" if _names(op, e, arg, category) else f"does not name {arg}: {msg}"
    except Exception as e:  # noqa: BLE001 - an exception type outside the contract
        return f"raised {type(e).__name__}: {str(e)[:200]}"
    if must_raise:
        return "returned (must raise)"
    got = dict(zip(op.outs, result if isinstance(result, tuple) else (result,), strict=False))
    masks: dict = {}
    for m in op.mutated + (("q",) if op.family == "q_out" and args["q_out"] is None else ()):
        if isinstance(args.get(m), torch.Tensor):
            got[m] = args[m]
            _cover(args[m], storages, masks)
    for key, (u, b) in storages.items():
        if ((u != b) & ~masks.get(key, torch.zeros((), dtype=torch.bool))).any():
            return "returned and changed bytes outside its outputs"
    try:
        ref = op.ref(ref_args or before, kw, op.outs or op.mutated)
    except Exception as e:  # noqa: BLE001 - the reference rejects these arguments
        return f"returned, but the reference rejects them: {type(e).__name__}: {str(e)[:120]}"
    floats = [t.detach() for t in tensors if t.is_floating_point() and t.device.type == "cpu" and t.numel()]
    scale = max([t.double().abs().max().item() for t in floats] + [1e-30])
    for name, r in ref.items():
        problem = _compare(name, got.get(name), r, scale, op.loose)
        if problem:
            return problem
    return "ok"


def _cases(op: Op, subset: bool = False):
    """(argument, category, label, args, kw, mark, reference args) of every case of ``op``."""
    base = op.args(_inputs())
    for arg in op.kinds:
        if base.get(arg) is None:
            continue
        for category, label, value in _hostile(base[arg]):
            if subset and category not in ("dtype", "expanded", "strided", "transposed", "offset"):
                continue
            table = category.startswith("size0") and op.kinds[arg] in ("c", "kc", "vc")
            if op.name.startswith("_cuda") and (category == "meta" or table):
                continue  # no fake kernel; past the table (cache): NaN (no write) on CUDA, as documented
            a = op.args(_inputs())
            a[arg] = value
            yield arg, category, label, a, {}, _mark(op, arg, category, value), None
    for arg, label, a, mark in _overlaps(op, op.args(_inputs())):
        yield arg, "overlap", label, a, {}, mark, None
    if subset:
        return
    if op.name != "varlen_positions":
        yield "q", "size0", "0 tokens", op.args(_inputs(tokens=0)), {}, False, None
    if not op.name.startswith("_cuda"):  # every tensor on meta: the fake kernels (shapes only)
        a = op.args(_inputs())
        meta = {n: v.to("meta") if isinstance(v, torch.Tensor) else v for n, v in a.items()}
        kw = {"total_tokens": 5} if op.family == "varlen" else {}
        yield "q", "meta", "every tensor on meta", meta, kw, False, a
        if op.family == "varlen":  # no total_tokens: nothing to read it from
            yield "total_tokens", "meta", "on meta without total_tokens", meta, {}, True, a
    for arg, label, a, kw, mark in _options(op, op.args(_inputs())):
        yield arg, "option", label, a, kw, mark, None


def _run_op(op: Op, result: dict, prefix: str = "", subset: bool = False) -> None:
    for arg, category, label, a, kw, mark, ref_args in _cases(op, subset):
        outcome = run_case(op, a, kw, arg, category, mark, ref_args)
        key = f"{op.name} {arg}={label}"
        result["cases"][op.name] = result["cases"].get(op.name, 0) + 1
        if outcome in ("ok", "raised"):
            result[outcome] += 1
            continue
        result["bad"].append(f"{prefix}{key} (must raise: {mark}): {outcome}")


ISA_OPS = ("apply_rotary", "apply_rotary_qk_", "apply_rotary_qk_and_cache_", "apply_qk_norm_rotary",
           "apply_qk_norm_rotary_")  # fmt: skip


def run() -> dict:
    ops = torch.ops.rope_ext
    result = {"ok": 0, "raised": 0, "bad": [], "cases": {}, "isas": []}
    torch.set_num_threads(1)
    entry_points = _entry_points()
    for op in entry_points:
        _run_op(op, result)
    default = str(ops._cpu_isa())
    for isa in ("scalar", "avx2", "avx512", "avx512_bf16", "neon"):
        if isa == default or not ops._cpu_isa_supported(isa):
            continue
        ops._set_cpu_isa(isa)
        result["isas"].append(isa)
        for op in entry_points:
            if op.name in ISA_OPS:
                _run_op(op, result, f"[{isa}] ", subset=True)
    ops._set_cpu_isa(default)
    return result


@functools.cache
def _result() -> dict:
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=600, cwd=ROOT, env=child_env()
    )
    assert proc.returncode == 0, f"crashed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hostile_arguments_raise_or_compute():
    result = _result()
    assert result["raised"] > 0 and result["ok"] > 0
    assert not result["bad"], f"{len(result['bad'])} bad cases:\n" + "\n".join(result["bad"][:40])


if __name__ == "__main__":  # _helpers imported rope_ext._C_testing (the emulated CUDA body) if built
    out = run()
    if "-v" in sys.argv:
        print("\n".join(out["bad"]))
    print(json.dumps(out))

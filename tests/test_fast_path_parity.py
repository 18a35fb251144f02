"""Each public op with an eager fast path decides every call as its general path does.

``apply_rotary_qk_``, ``apply_rotary_qk_and_cache_``, ``apply_mla_rotary_and_cache_``,
``apply_qk_norm_rotary_`` and ``rerotate_kv_cache_`` send their common eager call straight to the op and
everything else through a checked general function (``_rotary_qk_inplace_checked``, ``_cache_checked``,
``_mla_checked``, ``_qk_norm_checked``, ``_rerotate_checked``). Every combination of the option values below,
valid and invalid, must give the same outcome both ways: the same bits in every tensor the op writes, or the
same exception type with nothing written.
``set_position_checks(True)`` forces the general path (on CPU it changes nothing else: CPU positions are
always checked), and a counter on the general function shows which path each call took. Each value says
whether it keeps a call on the fast path, so a guard that stopped taking the fast path (which would make the
comparison vacuous) fails too.
The other ops (``apply_rotary``, ``apply_rotary_qk``, ``apply_qk_norm_rotary``) have a single path.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import NamedTuple

import pytest
import torch

import rope_ext
from rope_ext import ops, serving

T, HQ, HK, D, R, P = 4, 2, 1, 16, 8, 16  # rotary_dim R < D: rotary_offset in [0, D - R] is valid
FP8 = torch.float8_e4m3fn


class V(NamedTuple):
    """An option value: ``fast`` says whether the guard keeps a call with it on the fast path (``GRAD_OFF``:
    only with grad mode off, the case's ``grad_mode`` option, as for a tensor that requires grad)."""

    label: str
    value: object
    fast: bool | str = True


GRAD_OFF = "grad-off"


def _fast(case) -> bool:
    grad_on = dict(case).get("grad_mode", V("enabled", True)).value
    return all(v.fast is True or (v.fast == GRAD_OFF and not grad_on) for _, v in case)


def _combos(groups: list[dict[str, list[V]]]) -> list[tuple[tuple[str, V], ...]]:
    """Every combination of the values within each group, options outside it at their first value."""
    names = list(dict.fromkeys(n for g in groups for n in g))
    seen, out = set(), []
    for group in groups:
        base = {n: next(g[n] for g in groups if n in g)[0] for n in names}
        for values in itertools.product(*group.values()):
            case = {**base, **dict(zip(group, values, strict=True))}
            key = tuple(case[n].label for n in names)
            if key not in seen:
                seen.add(key)
                out.append(tuple((n, case[n]) for n in names))
    return out


@contextlib.contextmanager
def _path(monkeypatch, module, general_name: str, general: bool):
    """Runs the body with the fast path allowed (``general=False``) or ruled out; yields a one-element
    list that counts the calls of the general function."""
    calls = [0]
    real = getattr(module, general_name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(module, general_name, counted)
        rope_ext.set_position_checks(general)
        try:
            yield calls
        finally:
            rope_ext.set_position_checks(False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.uint8)


def _outcome(call, written: list[torch.Tensor]):
    """The exception type a call raised (with its tensors unchanged), or the bits it wrote."""
    before = [_bits(t) for t in written]
    try:
        call()
    except Exception as e:  # every exception type is compared, not only the expected ones
        assert all(torch.equal(b, _bits(t)) for b, t in zip(before, written, strict=True)), type(e)
        return type(e)
    return [_bits(t) for t in written]


def _same(a, b) -> bool:
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _described(outcome) -> str:
    return outcome.__name__ if isinstance(outcome, type) else "written"


def _check_parity(monkeypatch, module, general_name, cases, run):
    """``run(options)`` returns ``(call, written)`` on fresh tensors; both paths must agree on every case."""
    fast_cases = 0
    for case in cases:
        options = {n: v.value for n, v in case}
        labels = {n: v.label for n, v in case}
        fast = _fast(case)
        outcomes = []
        for general in (False, True):
            call, written = run(options)
            with _path(monkeypatch, module, general_name, general) as calls:
                outcomes.append(_outcome(call, written))
            assert calls[0] == (general or not fast), (labels, "general" if general else "fast")
        fast_cases += fast
        assert _same(*outcomes), (labels, *map(_described, outcomes))
    assert fast_cases > len(cases) // 5  # a good share of the comparisons are between two different paths


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


_CS = rope_ext.RopeCache(R, max_positions=P).cos_sin
_POS = torch.arange(T) * 3 % P
_MROPE_POS = torch.stack([_POS, (_POS + 1) % P, (_POS + 5) % P])

# Shared option tables. A value whose ``fast`` differs between ops is given per op.
INTERLEAVED = [V("F", False), V("T", True), V("0", 0), V("None", None), V("str", "yes")]
ROTARY_OFFSET = [
    V("0", 0), V("valid", D - R), V("neg", -1), V("too-large", D - R + 1),
    V("float", 1.0, fast=False), V("bool", True, fast=False),
]  # fmt: skip
SECTION_VALUES = [
    ("None", None), ("tuple", (2, 1, 1)), ("list", [2, 1, 1]), ("bad-sum", (2, 1, 2)), ("len-2", (2, 2)),
    ("len-9", (1,) * 9), ("empty", ()), ("neg", (3, 2, -1)), ("huge", (2**63 - 1, 1, 1)),
    ("overflow", (2**63, 1, 1)), ("float", (2, 1, 1.0)),
]  # fmt: skip
MROPE_INTERLEAVED = [
    V("F", False), V("T", True), V("0", 0), V("None", None, fast=False),
    V("alternating", "alternating", fast=False),
]  # fmt: skip
# A tensor argument passed as a list instead (the guards check the types of some of them).
NOT_TENSOR = [V("tensors", None), V("cos_sin", "cos_sin"), V("positions", "positions", fast=False)]


def _listed(o, name, t):
    return t.tolist() if o["not_tensor"] == name else t


# ---------------------------------------------------------------------------------------------
# apply_rotary_qk_: every combination. The guard takes any mrope_section that is a tuple or list of
# ints (the op checks their number and values), and any int rotary_offset.

QK_OPTIONS = {
    "k": [V("tensor", True), V("None", None)],
    "interleaved": INTERLEAVED,
    "rotary_offset": ROTARY_OFFSET,
    "mrope_section": [V(label, s, fast=label != "float") for label, s in SECTION_VALUES],
    "mrope_interleaved": MROPE_INTERLEAVED,
    "positions": [
        V("[T,1]", _POS[:, None]),
        V("[T]", _POS),
        V("[3,T,1]", _MROPE_POS[..., None]),
        V("[3,T]", _MROPE_POS),
    ],
}

QK_TYPES = {
    "not_tensor": [NOT_TENSOR[0], V("cos_sin", "cos_sin", fast=False), NOT_TENSOR[2]],
    "k": QK_OPTIONS["k"],
    "mrope_section": QK_OPTIONS["mrope_section"][:2],
    "positions": QK_OPTIONS["positions"],
}


# q that requires grad: autograd records the rotation (a leaf: refused) with grad mode on, and nothing
# with it off, where the op runs as for any q.
QK_GRAD = {
    "grad": [V("none", False), V("q", True, fast=GRAD_OFF)],
    "grad_mode": [V("enabled", True), V("no_grad", False)],
    "k": QK_OPTIONS["k"],
}


def _run_qk(o):
    q, k = _randn(T, HQ, D).requires_grad_(o["grad"]), (_randn(T, HK, D, seed=1) if o["k"] else None)
    positions, cos_sin = _listed(o, "positions", o["positions"]), _listed(o, "cos_sin", _CS)
    kw = {n: o[n] for n in ("interleaved", "rotary_offset", "mrope_section", "mrope_interleaved")}

    def call():
        with torch.set_grad_enabled(o["grad_mode"]):
            rope_ext.apply_rotary_qk_(q, k, positions, cos_sin, **kw)

    return call, [q] + ([k] if o["k"] else [])


def test_apply_rotary_qk_(monkeypatch):
    cases = _combos([QK_OPTIONS, QK_TYPES, QK_GRAD])
    _check_parity(monkeypatch, ops, "_rotary_qk_inplace_checked", cases, _run_qk)


# ---------------------------------------------------------------------------------------------
# Serving ops: MRoPE calls (mrope_section or mrope_interleaved set) and positions other than [T] take
# the general path. The fast path chooses an
# overload by the options set, so the options that choose it are crossed with each other, and the others
# with one value of each choice.

SERVING_MROPE = {
    "mrope_section": [V(label, s, fast=s is None) for label, s in SECTION_VALUES],
    # (a layout name never takes the fast path: the rotary family's crossing has it)
    "mrope_interleaved": [
        V(v.label, v.value, fast=v.fast and not v.value)
        for v in MROPE_INTERLEAVED
        if type(v.value) is not str
    ],
    "positions": [V("[T]", _POS), V("[T,1]", _POS[:, None], fast=False), V("[3,T]", _MROPE_POS, fast=False)],
}

CACHE_OPTIONS = {
    "interleaved": INTERLEAVED,
    "layout": [V("NHD", "NHD"), V("HND", "HND"), V("bad", "nhd"), V("int", 0, fast=False)],
    # cache dtype, k_scale, v_scale
    "scales": [
        V("none", (torch.float32, None, None)), V("fp8", (FP8, None, None)), V("fp8-both", (FP8, 0.5, 2.0)),
        V("fp8-k", (FP8, 0.5, None)), V("unscaled-both", (torch.float32, 0.5, 2.0)),
        V("float", (FP8, "float", None)), V("shape", (FP8, "shape", 2.0)),
    ],
    # q_out (see _q_out), q_scale
    "q_out": [
        V("None", (None, None)), V("same", (torch.float32, None)), V("fp8", (FP8, 0.25)),
        V("scale-only", (None, 0.25)), V("scale-float", (None, "float")), V("str", ("str", None), fast=False),
        V("requires-grad", ("grad", None), fast=GRAD_OFF),
    ],
    "rotary_offset": ROTARY_OFFSET,
}  # fmt: skip
CACHE_CHOICE = {
    "interleaved": INTERLEAVED[:2],
    "scales": CACHE_OPTIONS["scales"][:4],
    "q_out": CACHE_OPTIONS["q_out"][:2],
    "rotary_offset": ROTARY_OFFSET[:2],
}
CACHE_TYPES = {
    "not_tensor": [*NOT_TENSOR, V("key_cache", "key_cache", fast=False)],
    "grad_mode": [V("no_grad", False), V("enabled", True)],
    "q_out": CACHE_OPTIONS["q_out"],
}


def _scale(s):
    if s is None:
        return None
    if s == "float":
        return 0.5  # a Python float, not a tensor
    if s == "shape":
        return torch.full((2,), 0.5)
    return torch.tensor([s])


def _q_out(kind):
    """No q_out, a string instead of a tensor, a q_out that requires grad, or one of dtype ``kind``."""
    if kind is None:
        return None
    if kind == "str":
        return "q_out"
    if kind == "grad":
        return torch.zeros(T, HQ, D, requires_grad=True)
    return torch.zeros(T, HQ, D).to(kind)


def _run_cache(o):
    q, k, v = _randn(T, HQ, D), _randn(T, HK, D, seed=1), _randn(T, HK, D, seed=2)
    cache_dtype, k_scale, v_scale = o["scales"]
    shape = (3, HK, 4, D) if o["layout"] == "HND" else (3, 4, HK, D)
    key_cache = _randn(*shape, seed=3).to(cache_dtype)
    value_cache = _randn(*shape, seed=4).to(cache_dtype)
    slots = torch.tensor([5, -1, 0, 11])
    out_kind, q_scale = o["q_out"]
    q_out = _q_out(out_kind)
    kw = {n: o[n] for n in ("interleaved", "layout", "rotary_offset", "mrope_section", "mrope_interleaved")}
    kw.update(k_scale=_scale(k_scale), v_scale=_scale(v_scale), q_out=q_out, q_scale=_scale(q_scale))
    written = [q, k, v, key_cache, value_cache] + ([q_out] if isinstance(q_out, torch.Tensor) else [])
    args = [
        _listed(o, n, t)
        for n, t in (("positions", o["positions"]), ("cos_sin", _CS), ("key_cache", key_cache))
    ]

    def call():
        with torch.set_grad_enabled(o["grad_mode"]):
            rope_ext.apply_rotary_qk_and_cache_(q, k, v, *args, value_cache, slots, **kw)

    return call, written


def test_apply_rotary_qk_and_cache_(monkeypatch):
    cases = _combos([CACHE_OPTIONS, CACHE_CHOICE | SERVING_MROPE, CACHE_CHOICE | CACHE_TYPES])
    _check_parity(monkeypatch, serving, "_cache_checked", cases, _run_cache)


# ---------------------------------------------------------------------------------------------
# apply_qk_norm_rotary_ (eps must be a Python float for the fast path).

NORM_OPTIONS = {
    "eps": [
        V("default", 1e-6), V("1e-5", 1e-5), V("zero", 0.0), V("neg", -1.0), V("int", 1, fast=False),
        V("bool", True, fast=False), V("str", "x", fast=False), V("None", None, fast=False),
    ],
    "interleaved": INTERLEAVED,
    "weight_offset": [
        V("0.0", 0.0), V("1.0", 1.0), V("int", 1), V("None", None, fast=False), V("bool", True, fast=False),
        V("str", "1.5", fast=False), V("junk", "x", fast=False),
    ],
    "rotary_offset": ROTARY_OFFSET,
}  # fmt: skip
NORM_CHOICE = {
    "eps": NORM_OPTIONS["eps"][:2],
    "interleaved": INTERLEAVED[:2],
    "weight_offset": NORM_OPTIONS["weight_offset"][:2],
    "rotary_offset": ROTARY_OFFSET[:2],
}
# qkv [T, (Hq+Hk+Hv)*D] with (Hq+Hk+Hv)*D = 64: head counts that split it, and some that do not.
NORM_SHAPES = {
    "heads": [
        V("2,1,1", (2, 1, 1)), V("3,1,0", (3, 1, 0)), V("0,3,1", (0, 3, 1)), V("2,1,-1", (2, 1, -1)),
        V("3,2,3", (3, 2, 3)), V("5,2,1", (5, 2, 1)), V("float", (2.0, 1, 1), fast=False),
        V("bool", (True, 2, 1), fast=False),
    ],
    "weights": [V("[D]", "ok"), V("[D+1]", "long"), V("bf16", "bf16"), V("2-d", "2d")],
    "qkv": [V("[T,64]", "ok"), V("strided", "strided"), V("3-d", "3d"), V("last-strided", "cols")],
}  # fmt: skip
# qkv (a view of a leaf that requires grad: refused with grad mode on) or the weights requiring grad (the
# differentiable path with grad mode on); with grad mode off, the op as for any other call.
NORM_GRAD = {
    "requires_grad": [V("none", ""), V("qkv", "qkv", fast=GRAD_OFF), V("weights", "weights", fast=GRAD_OFF)],
    "grad_mode": [V("enabled", True), V("no_grad", False)],
}


def _weight(kind, d, seed):
    w = _randn(d + (kind == "long"), seed=seed) * 0.1 + 1
    if kind == "bf16":
        return w.to(torch.bfloat16)
    return w[None] if kind == "2d" else w


def _run_norm(o):
    width = (HQ + HK + 1) * D
    grad = o["requires_grad"]
    base = _randn(2 * T * width, seed=5).requires_grad_(grad == "qkv")  # the storage of every qkv
    qkv = {
        "ok": base[: T * width].view(T, width),
        "strided": base.view(T, 2 * width)[:, :width],
        "3d": base[: T * width].view(T, 1, width),
        "cols": base.view(T, width, 2)[..., 0],
    }[o["qkv"]]
    heads = o["heads"]
    d = width // max(1, sum(int(h) for h in heads))
    q_weight, k_weight = (_weight(o["weights"], d, s).requires_grad_(grad == "weights") for s in (6, 7))
    kw = {n: o[n] for n in ("eps", "interleaved", "weight_offset", "rotary_offset")}
    kw.update(mrope_section=o["mrope_section"], mrope_interleaved=o["mrope_interleaved"])
    positions, cos_sin = _listed(o, "positions", o["positions"]), _listed(o, "cos_sin", _CS)

    def call():
        with torch.set_grad_enabled(o["grad_mode"]):
            rope_ext.apply_qk_norm_rotary_(qkv, *heads, q_weight, k_weight, positions, cos_sin, **kw)

    return call, [base]


def test_apply_qk_norm_rotary_(monkeypatch):
    groups = [NORM_OPTIONS, NORM_CHOICE | SERVING_MROPE, NORM_CHOICE | NORM_SHAPES]
    cases = _combos([*groups, NORM_CHOICE | {"not_tensor": NOT_TENSOR}, NORM_CHOICE | NORM_GRAD])
    _check_parity(monkeypatch, serving, "_qk_norm_checked", cases, _run_norm)


# ---------------------------------------------------------------------------------------------
# rerotate_kv_cache_ (an int delta becomes a one-element tensor first, on both paths).

REROTATE_OPTIONS = {
    "interleaved": INTERLEAVED,
    "layout": [V("NHD", "NHD"), V("HND", "HND"), V("bad", "nhd"), V("int", 0, fast=False)],
    # cache dtype, k_scale
    "scales": [
        V("none", (torch.float32, None)), V("fp8", (FP8, None)), V("fp8-scaled", (FP8, 0.5)),
        V("unscaled", (torch.float32, 0.5)), V("float", (FP8, "float"), fast=False),
        V("shape", (FP8, "shape")),
    ],
    "rotary_offset": ROTARY_OFFSET,
}  # fmt: skip
REROTATE_CHOICE = {
    "interleaved": INTERLEAVED[:2],
    "scales": REROTATE_OPTIONS["scales"][:3],
    "rotary_offset": ROTARY_OFFSET[:2],
}
REROTATE_ARGS = {
    "delta": [
        V("[T]", "tokens"), V("one", "one"), V("int", 3), V("neg-int", -5), V("int-P", P),
        V("int-2^63", 2**63), V("bool", True, fast=False), V("int32", "int32"), V("float", "float"),
        V("past-table", "past"), V("2-d", "2d"),
    ],
    "slots": [
        V("ok", "ok"), V("repeated", "repeated"), V("outside", "outside"), V("int32", "int32"),
        V("2-d", "2d"),
    ],
}  # fmt: skip
REROTATE_TYPES = {
    "not_tensor": [
        V("tensors", None), V("cos_sin", "cos_sin", fast=False),
        V("slot_mapping", "slot_mapping", fast=False), V("key_cache", "key_cache", fast=False),
    ],
    "grad": [V("none", False), V("requires-grad", True, fast=GRAD_OFF)],
    "grad_mode": [V("enabled", True), V("no_grad", False)],
}  # fmt: skip
_SLOTS = {
    "ok": torch.tensor([5, -1, 0, 11]), "repeated": torch.tensor([5, -1, 5, 11]),
    "outside": torch.tensor([5, -1, 0, 12]), "int32": torch.tensor([5, -1, 0, 11], dtype=torch.int32),
    "2d": torch.tensor([[5, -1], [0, 11]]),
}  # fmt: skip
_DELTAS = {
    "tokens": torch.tensor([3, -2, 0, P - 1]), "one": torch.tensor([4]),
    "int32": torch.tensor([3, -2, 0, 1], dtype=torch.int32), "float": torch.tensor([3.0, -2.0, 0.0, 1.0]),
    "past": torch.tensor([3, -P, 0, 1]), "2d": torch.tensor([[3, -2], [0, 1]]),
}  # fmt: skip


def _run_rerotate(o):
    cache_dtype, k_scale = o["scales"]
    shape = (3, HK, 4, D) if o["layout"] == "HND" else (3, 4, HK, D)  # 12 slots
    key_cache = _randn(*shape, seed=3).to(cache_dtype).requires_grad_(o["grad"])
    delta = _DELTAS.get(o["delta"], o["delta"]) if isinstance(o["delta"], str) else o["delta"]
    kw = {n: o[n] for n in ("interleaved", "layout", "rotary_offset")}
    args = [
        _listed(o, n, t)
        for n, t in (("key_cache", key_cache), ("slot_mapping", _SLOTS[o["slots"]]), ("cos_sin", _CS))
    ]

    def call():
        with torch.set_grad_enabled(o["grad_mode"]):
            rope_ext.rerotate_kv_cache_(args[0], args[1], delta, args[2], k_scale=_scale(k_scale), **kw)

    return call, [key_cache]


def test_rerotate_kv_cache_(monkeypatch):
    groups = [REROTATE_OPTIONS, REROTATE_CHOICE | REROTATE_ARGS, REROTATE_CHOICE | REROTATE_TYPES]
    _check_parity(monkeypatch, serving, "_rerotate_checked", _combos(groups), _run_rerotate)


@pytest.mark.parametrize("run", [_run_qk, _run_cache, _run_norm], ids=["qk_", "cache_", "norm_"])
def test_mrope_interleaved_needs_a_section(run):
    """``mrope_interleaved=True`` without ``mrope_section`` is rejected by every op, on its default path."""
    tables = (QK_OPTIONS, QK_TYPES, QK_GRAD, CACHE_OPTIONS, CACHE_TYPES, NORM_OPTIONS, NORM_SHAPES, NORM_GRAD)
    tables += (SERVING_MROPE,)
    options = {n: v[0].value for table in tables for n, v in table.items()}
    positions = _POS[:, None] if run is _run_qk else _POS
    call, written = run({**options, "positions": positions, "mrope_interleaved": True})
    before = [_bits(t) for t in written]
    with pytest.raises(ValueError, match="mrope_interleaved needs mrope_section"):
        call()
    assert all(torch.equal(b, _bits(t)) for b, t in zip(before, written, strict=True))


# ---------------------------------------------------------------------------------------------
# apply_mla_rotary_and_cache_: q [T, H, D] rotated at rotary_offset, k_pe [T, R], kv_c [T, L] and a latent
# cache [blocks, block_size, L + R].

L = 8  # kv_lora_rank
MLA_OPTIONS = {
    "interleaved": INTERLEAVED,
    "rotary_offset": ROTARY_OFFSET,
    # cache dtype, kv_scale
    "scales": [
        V("none", (torch.float32, None)), V("fp8", (FP8, 0.5)), V("fp8-unscaled", (FP8, None)),
        V("fp32-scaled", (torch.float32, 0.5)), V("scale-float", (FP8, "float")),
        V("scale-shape", (FP8, "shape")),
    ],
    "inverse": [V("F", False), V("T", True), V("int", 1)],
    "q_out": [
        V("none", (None, None)), V("fp32", (torch.float32, None)), V("fp8", (FP8, 0.25)),
        V("fp8-unscaled", (FP8, None)), V("bf16", (torch.bfloat16, None)),
        V("str", ("str", None), fast=False), V("requires-grad", ("grad", None), fast=GRAD_OFF),
    ],
}  # fmt: skip
MLA_CHOICE = {
    "interleaved": INTERLEAVED[:2],
    "rotary_offset": ROTARY_OFFSET[:2],
    "q_out": MLA_OPTIONS["q_out"][:3],
}
MLA_TYPES = {
    "not_tensor": [*NOT_TENSOR, V("kv_cache", "kv_cache", fast=False)],
    "positions": [V("[T]", _POS), V("[T,1]", _POS[:, None], fast=False)],
    "requires_grad": [V("none", ""), V("q", "q", fast=GRAD_OFF), V("kv_cache", "kv_cache", fast=GRAD_OFF)],
    "grad_mode": [V("enabled", True), V("no_grad", False)],
}


def _run_mla(o):
    grad = o["requires_grad"]
    q = _randn(T, HQ, D).requires_grad_(grad == "q")
    kv_c, k_pe = _randn(T, L, seed=1), _randn(T, R, seed=2)
    cache_dtype, kv_scale = o["scales"]
    kv_cache = _randn(3, 4, L + R, seed=3).to(cache_dtype).requires_grad_(grad == "kv_cache")
    out_kind, q_scale = o["q_out"]
    q_out = _q_out(out_kind)
    kw = {n: o[n] for n in ("interleaved", "rotary_offset", "inverse")}
    kw.update(kv_scale=_scale(kv_scale), q_out=q_out, q_scale=_scale(q_scale))
    args = [
        _listed(o, n, t) for n, t in (("positions", o["positions"]), ("cos_sin", _CS), ("kv_cache", kv_cache))
    ]
    written = [q, k_pe, kv_cache] + ([q_out] if isinstance(q_out, torch.Tensor) else [])

    def call():
        with torch.set_grad_enabled(o["grad_mode"]):
            rope_ext.apply_mla_rotary_and_cache_(q, kv_c, k_pe, *args, torch.tensor([5, -1, 0, 11]), **kw)

    return call, written


def test_apply_mla_rotary_and_cache_(monkeypatch):
    groups = [MLA_OPTIONS, MLA_CHOICE | MLA_TYPES, MLA_CHOICE | {"scales": MLA_OPTIONS["scales"][:3]}]
    _check_parity(monkeypatch, serving, "_mla_checked", _combos(groups), _run_mla)

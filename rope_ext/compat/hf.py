"""transformers adapters: ``apply_rotary_pos_emb`` and patching a loaded model's RoPE.

* :func:`apply_rotary_pos_emb` - transformers' function (``q * cos + rotate_half(q) * sin``), same
  arguments, broadcasting, output dtypes and gradients, computed by rope_ext's op.
* :class:`HFRotaryAdapter` - stands in for a model's ``*RotaryEmbedding`` (cos / sin from rope_ext caches,
  one set per layer type where the model has several).
* :func:`patch_transformers` / :func:`unpatch_transformers` - route a loaded model's RoPE through rope_ext
  (adapter + the modeling module's ``apply_rotary*`` functions), after checking on probes that rope_ext
  computes what the model's own modules and functions compute, and back.
* :func:`supported_model_types` - the model types that pass those checks with the installed transformers.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .._tables import DeviceTables
from ..cache import RopeCache
from ..ops import apply_rotary, apply_rotary_qk
from ..reference import rms_norm, rotate_half
from ..serving import apply_qk_norm_rotary

__all__ = [
    "apply_rotary_pos_emb",
    "HFRotaryAdapter",
    "SUPPORTED_MODEL_TYPES",
    "supported_model_types",
    "patch_transformers",
    "unpatch_transformers",
    "FUSED_QK_NORM_MODEL_TYPES",
]

_OP_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The rotation a transformers function computes, and rope_ext's op computing it


class _Rotation(NamedTuple):
    """What a transformers ``apply_rotary*`` function computes from ``(q, k, cos, sin)``.

    * ``pairing``: ``"half"`` (features ``(j, j + w/2)``, ``rotate_half``) or ``"interleaved"``
      (``(2j, 2j+1)``), over the first ``w = cos.shape[-1]`` features;
    * ``layout``: how ``cos`` / ``sin`` hold the ``w/2`` pair values: ``"cat"`` (``cat((c, c))``) or
      ``"repeat"`` (``repeat_interleave(c, 2)``);
    * ``output``: ``"same"`` (each pair written back where it was read) or ``"deinterleaved"`` (the first
      elements of the rotated pairs, then the second ones: DeepSeek's ``apply_rotary_pos_emb_interleave``);
    * ``partial``: ``q`` / ``k`` wider than ``cos`` are accepted, the features past ``w`` passed through
      (when false, such calls go to the original function);
    * ``keep_dtype``: outputs in the inputs' dtype (else the promotion of ``q`` / ``k`` with ``cos``).
    """

    pairing: str
    layout: str
    output: str = "same"
    partial: bool = False
    keep_dtype: bool = False

    def describe(self) -> str:
        """A short description, e.g. ``"interleaved pairs, de-interleaved output"``."""
        text = "half-split pairs" if self.pairing == "half" else "interleaved pairs"
        if self.output == "deinterleaved":
            text += ", de-interleaved output"
        if self.layout == "repeat":
            text += ", repeat_interleave cos/sin"
        return text


_HF_ROTATION = _Rotation("half", "cat")
# The rotations rope_ext's op computes, tried in this order against a modeling module's function.
_CANDIDATES = (("half", "same"), ("interleaved", "same"), ("interleaved", "deinterleaved"))


def _hf_formula(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _fast_path(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, partial: bool) -> bool:
    """Whether the op computes exactly what the function would (shapes, dtypes, devices, grads)."""
    d, w = q.shape[-1], cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() > min(q.dim(), k.dim()) or cos.dim() == 0:
        return False
    if w % 2 or w == 0 or k.shape[-1] != d or not (d == w or (partial and d > w)):
        return False
    if cos.is_complex() or sin.is_complex() or cos.dtype != sin.dtype:
        return False
    if not all(t.dtype in _OP_DTYPES for t in (q, k, cos)):
        return False
    if not (q.device == k.device == cos.device == sin.device):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False  # the op gives no gradient to cos / sin; the formula does
    lead = cos.shape[:-1]
    try:
        return (
            torch.broadcast_shapes(q.shape[:-1], lead) == q.shape[:-1]
            and torch.broadcast_shapes(k.shape[:-1], lead) == k.shape[:-1]
        )
    except RuntimeError:
        return False


def _pair_values(t: Tensor, layout: str) -> Tensor:
    """``[..., w]`` cos or sin -> the ``[..., w/2]`` pair values it holds (``layout``: see ``_Rotation``)."""
    return t[..., : t.shape[-1] // 2] if layout == "cat" else t[..., 0::2]


def _as_layout(c: Tensor, layout: str) -> Tensor:
    """``[..., w/2]`` pair values -> ``[..., w]`` cos or sin laid out as ``layout``."""
    if layout == "cat":
        return torch.cat([c, c], dim=-1)
    return torch.stack([c, c], dim=-1).flatten(-2)


def _duplicated(cos: Tensor, sin: Tensor, layout: str) -> bool:
    """Whether ``cos`` and ``sin`` really are laid out as ``layout`` (each pair value stored twice)."""
    if layout == "cat":
        h = cos.shape[-1] // 2
        return torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:])
    return torch.equal(cos[..., 0::2], cos[..., 1::2]) and torch.equal(sin[..., 0::2], sin[..., 1::2])


def _deinterleave(x: Tensor, w: int) -> Tensor:
    """Features ``[0, w)`` of ``x [..., d]`` reordered to ``(0, 2, 4, ..., 1, 3, 5, ...)``; the rest kept."""
    head = x[..., :w].unflatten(-1, (w // 2, 2)).transpose(-1, -2).flatten(-2)
    return head if x.shape[-1] == w else torch.cat([head, x[..., w:]], dim=-1)


def _rotate(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int, rot: _Rotation, check_pairs: bool
) -> tuple[Tensor, Tensor] | None:
    """``rot`` applied to ``q`` and ``k`` by rope_ext's op, or None when the op cannot compute it exactly
    (then the caller runs the original function). ``cos`` / ``sin`` are unsqueezed at ``unsqueeze_dim``
    first, as transformers does; with ``check_pairs`` (eager only) their layout is verified."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if not _fast_path(q, k, cos, sin, rot.partial) or (rot.keep_dtype and q.dtype != k.dtype):
        return None
    if check_pairs and not torch.compiler.is_compiling() and not _duplicated(cos, sin, rot.layout):
        return None
    in_dtype = q.dtype
    dq = torch.promote_types(q.dtype, cos.dtype)
    dk = torch.promote_types(k.dtype, cos.dtype)
    q = q.to(dq) if q.dtype != dq else q
    k = k.to(dk) if k.dtype != dk else k
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    w = cos.shape[-1]
    lead = cos.shape[:-1]
    n = 1
    for s in lead:
        n *= s
    table = torch.cat([_pair_values(cos, rot.layout), _pair_values(sin, rot.layout)], dim=-1).reshape(n, w)
    # Full rank (leading 1s): cos broadcasts numpy-style, which the ops take as it is at full rank only.
    positions = torch.arange(n, device=cos.device).view((1,) * max(0, q.dim() - 1 - len(lead)) + tuple(lead))
    interleaved = rot.pairing == "interleaved"
    if dq == dk and table.dtype in (torch.float32, dq):
        q, k = apply_rotary_qk(q, k, positions, table, interleaved=interleaved)
    else:
        tq = table if table.dtype in (torch.float32, dq) else table.float()
        tk = table if table.dtype in (torch.float32, dk) else table.float()
        q = apply_rotary(q, positions, tq, interleaved=interleaved)
        k = apply_rotary(k, positions, tk, interleaved=interleaved)
    if rot.output == "deinterleaved":
        q, k = _deinterleave(q, w), _deinterleave(k, w)
    if rot.keep_dtype and q.dtype != in_dtype:
        q, k = q.to(in_dtype), k.to(in_dtype)
    return q, k


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb``:
    ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` after
    ``cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)``.

    ``q`` ``[batch, heads, seq, head_dim]`` and ``k`` (its own head count) with ``cos`` / ``sin``
    ``[batch, seq, head_dim]`` and ``unsqueeze_dim=1`` (``unsqueeze_dim=2`` for ``[batch, seq, heads,
    head_dim]``); any shapes that broadcast as in transformers. ``position_ids`` is accepted and ignored
    (as in transformers 4.x, where it is deprecated and unused). Outputs have transformers' dtypes (the
    promotion of ``q`` / ``k`` with ``cos`` / ``sin``); gradients flow to ``q`` and ``k`` (and to ``cos``
    / ``sin`` when they require grad: that case uses the formula itself).

    The op reads ``cos[..., :head_dim/2]`` and ``sin[..., :head_dim/2]`` as the pair values, which is what
    every transformers rotary embedding builds (``cat((freqs, freqs))``). Eagerly, the two halves are
    compared first (one pass over ``cos`` / ``sin``, which are ``heads`` times smaller than ``q``) and the
    formula is used when they differ; under ``torch.compile`` they are assumed equal. Arithmetic is float32
    (transformers rounds after each product in the input dtype): for bf16 / fp16 results can differ by an
    ulp, more accurate than the formula.
    """
    out = _rotate(q, k, cos, sin, unsqueeze_dim, _HF_ROTATION, check_pairs=True)
    if out is None:
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return _hf_formula(q, k, c, s)
    return out


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


def _make_patched(original: Callable, rot: _Rotation, sig: _Signature) -> Callable:
    """``original``'s stand-in: rope_ext's op computing ``rot`` where it can, ``original`` otherwise (any
    argument other than ``q, k, cos, sin, unsqueeze_dim`` passed with a non-default value, shapes or dtypes
    the op does not take, ``cos`` / ``sin`` requiring grad)."""
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
        out = _rotate(q, k, cos, sin, ud, rot, check_pairs=False)
        return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    functools.update_wrapper(patched, original)
    patched._rope_ext = True  # type: ignore[attr-defined]
    patched._rope_ext_original = original  # type: ignore[attr-defined]
    patched._rope_ext_rotation = rot  # type: ignore[attr-defined]
    return patched


# ---------------------------------------------------------------------------------------------
# Fused QK norm: attention layers whose per-head q / k RMSNorm runs right before the rotation


# Attention classes (by model type) whose forward applies q_norm / k_norm to the projections and then,
# always, the modeling module's rotary function: their norms can be deferred into one fused op.
FUSED_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


class _Running(threading.local):
    """Per thread: the attention module whose forward (with deferred norms) this thread is running, the
    innermost one, else None.

    Per thread because threads run patched models at once (a threaded server, DataParallel replicas): with
    one process-wide record, a norm or rotation in one thread would read the other thread's attention and
    apply its norms, or apply them twice. Not a ``ContextVar``: ``torch.compile(fullgraph=True)`` traces
    reads and writes of a ``threading.local``'s attributes (guarded on the calling thread's values) but
    breaks the graph at ``ContextVar.set``. ``attention`` is set in ``__init__`` (run in each thread on its
    first access), not given as a class attribute: with a class default, dynamo (torch 2.14) guards on the
    attribute being absent from the thread's ``__dict__``, a guard the traced forward's own writes fail, and
    the compile errors out.
    """

    def __init__(self) -> None:
        self.attention: nn.Module | None = None


_RUNNING = _Running()


class _DeferredNorm(nn.Module):
    """Stands in for an attention's ``q_norm`` / ``k_norm``: inside the attention's forward it returns its
    input, and the patched rotary function applies the norm fused with the rotation
    (:func:`rope_ext.apply_qk_norm_rotary`); anywhere else it runs the original norm. Its ``weight`` is the
    original module's parameter itself, so state dict keys, optimizers and training are unchanged; the
    original module is ``.original`` (not a submodule)."""

    def __init__(self, original: nn.Module, eps: float, weight_offset: float) -> None:
        super().__init__()
        self.__dict__["original"] = original  # a plain reference: its weight is registered here
        self.weight = original.weight
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: Tensor) -> Tensor:
        attention = _RUNNING.attention
        if attention is not None and attention is self.__dict__.get("owner"):
            return x
        return self.original(x)

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__}, eps={self.eps}, weight_offset={self.weight_offset}, deferred"


def _norm_form(norm: nn.Module, head_dim: int) -> tuple[float, float] | None:
    """``(eps, weight_offset)`` when ``norm(x)`` is ``rms_norm(x, weight, eps, weight_offset)`` (float32
    probe against the float64 reference), else None."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (head_dim,) or weight.device.type == "meta":
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, head_dim, generator=g).to(weight.device)
    with torch.no_grad():
        try:
            got = norm(x.float()).double()
        except Exception:
            return None
    for attr in ("variance_epsilon", "eps"):
        eps = getattr(norm, attr, None)
        if not isinstance(eps, float):
            continue
        for offset in (0.0, 1.0):
            want = rms_norm(x, weight.detach().float(), eps, offset)
            if torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                return eps, offset
    return None


def _fusable_attentions(model: nn.Module) -> list[nn.Module]:
    """Attention modules of the model types in FUSED_QK_NORM_MODEL_TYPES whose q / k norms can be fused."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_QK_NORM_MODEL_TYPES:
        return []
    found = []
    for m in model.modules():
        q_norm, k_norm, head_dim = (getattr(m, a, None) for a in ("q_norm", "k_norm", "head_dim"))
        if not (
            isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module) and isinstance(head_dim, int)
        ):
            continue
        forward = inspect.unwrap(type(m).forward)
        if isinstance(q_norm, _DeferredNorm) or not {"q_norm", "k_norm"} <= _code_names(forward.__code__):
            continue
        forms = (_norm_form(q_norm, head_dim), _norm_form(k_norm, head_dim))
        if forms[0] is not None and forms[0] == forms[1]:
            found.append(m)
    return found


def _attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The attention's own forward with its q / k norms deferred to the rotary function. The attention
    running before (an outer one, or None) is restored after, in this thread only."""
    outer = _RUNNING.attention
    _RUNNING.attention = self
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _RUNNING.attention = outer


def _defer_norms(attention: nn.Module) -> None:
    eps, offset = _norm_form(attention.q_norm, attention.head_dim)
    q_norm, k_norm = (
        _DeferredNorm(attention.q_norm, eps, offset),
        _DeferredNorm(attention.k_norm, eps, offset),
    )
    for norm in (q_norm, k_norm):
        norm.__dict__["owner"] = attention  # a plain reference, not a submodule
    attention.q_norm, attention.k_norm = q_norm, k_norm
    attention._rope_ext_norms = True
    attention.forward = types.MethodType(_attention_forward, attention)


def _restore_norms(attention: nn.Module) -> None:
    if isinstance(attention.q_norm, _DeferredNorm):
        attention.q_norm = attention.q_norm.original
        attention.k_norm = attention.k_norm.original
        del attention._rope_ext_norms
        del attention.forward


def _fused_norm_rotate(att, plain, q, k, cos, sin, args, kwargs, rot: _Rotation):
    """The deferred q / k norms and the rotation, as one :func:`rope_ext.apply_qk_norm_rotary` call on
    ``q [B, Hq, S, D]`` / ``k`` with ``cos`` / ``sin`` ``[B, S, w]`` (``unsqueeze_dim=1``, the layout these
    attention classes use); any other call applies the original norms, then the plain patched function."""
    qn, kn = att.q_norm, att.k_norm
    ok = (
        not args
        and not kwargs
        and q.dim() == 4
        and k.dim() == 4
        and cos.dim() == 3
        and cos.shape == sin.shape
        and q.dtype == k.dtype == cos.dtype
        and cos.shape[0] in (1, q.shape[0])
        and q.shape[2] == cos.shape[1]
        and rot.output == "same"
        and not cos.requires_grad
        and not sin.requires_grad
        and (cos.shape[-1] == q.shape[-1] or (rot.partial and cos.shape[-1] < q.shape[-1]))
    )
    if not ok:
        return plain(qn.original(q), kn.original(k), cos, sin, *args, **kwargs)
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    Bc, w = cos.shape[0], cos.shape[-1]
    table = torch.cat([_pair_values(cos, rot.layout), _pair_values(sin, rot.layout)], dim=-1).reshape(
        Bc * S, w
    )
    # token (b, s) of q reads row (b or 0, s) of the table
    positions = torch.arange(Bc * S, device=q.device).view(Bc, S).expand(B, S).reshape(B * S)
    q2, k2 = apply_qk_norm_rotary(
        q.transpose(1, 2).reshape(B * S, Hq, D),
        k.transpose(1, 2).reshape(B * S, Hk, D),
        qn.weight,
        kn.weight,
        positions,
        table,
        eps=qn.eps,
        interleaved=rot.pairing == "interleaved",
        weight_offset=qn.weight_offset,
    )
    return q2.view(B, S, Hq, D).transpose(1, 2), k2.view(B, S, Hk, D).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Probes: what a modeling module's function computes


class _CheckFailed(Exception):
    """A check of :func:`patch_transformers` failed; the message says which and why."""


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the probed function is a finding
        return e


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
# The rotary embedding module


def _rope_layer_types(config: Any) -> tuple[str, ...] | None:
    """The layer types of a config whose ``rope_parameters`` is nested per layer type (Gemma 3,
    ModernBERT: ``{"sliding_attention": {...}, "full_attention": {...}}``) that its ``layer_types`` use,
    else None."""
    from ..hf_config import _getter, _is_nested

    get = _getter(config)
    params = get("rope_parameters")
    if params is None:
        params = get("rope_scaling")
    if not isinstance(params, dict) or not _is_nested(params):
        return None
    used = get("layer_types")  # the model computes cos / sin only for the layer types it has
    return tuple(sorted(lt for lt, p in params.items() if p is not None and (used is None or lt in used)))


class _Kind(NamedTuple):
    """The RoPE of one layer type (or of the whole model): how the adapter's caches are read."""

    prefix: str  # the keys of its caches: prefix + "main" (or "short" / "long" for longrope)
    rope_type: str
    original_max: int | None
    rotary_dim: int
    mrope_section: tuple[int, int, int] | None
    mrope_interleaved: bool


class HFRotaryAdapter(nn.Module):
    """Replaces a transformers ``*RotaryEmbedding``: ``forward(x, position_ids, layer_type=None) -> (cos,
    sin)``, each ``[batch, seq, rotary_dim]`` in ``x.dtype`` with the attention factor applied, laid out as
    ``layout``: ``"cat"`` (``cat((c, c))``, the usual) or ``"repeat"`` (``repeat_interleave(c, 2)``, Cohere),
    read from rope_ext caches (float64 angles, float32 table) instead of float32 angles.

    A config whose ``rope_parameters`` is nested per layer type (Gemma 3, ModernBERT) gets one set of
    caches per layer type, picked by ``layer_type`` as the model passes it.

    Length-dependent variants follow transformers' per-call rule (``seq_len = max(position_ids) + 1``):
    ``dynamic`` grows its base with ``seq_len`` and resets when a call is back under the trained length
    (eager only: under ``torch.compile`` the table as sized is used); ``longrope`` picks the long or
    short table per call, in-graph. Eagerly, the table grows to cover ``seq_len`` (one device sync per
    forward on CUDA); under ``torch.compile`` it must already be large enough (``max_positions``).
    """

    def __init__(self, original: nn.Module, config: Any, max_positions: int, *, layout: str = "cat") -> None:
        super().__init__()
        if layout not in ("cat", "repeat"):
            raise ValueError(f"layout must be 'cat' or 'repeat', got {layout!r}")
        object.__setattr__(self, "_original", original)  # not a submodule: kept for unpatching
        self.config = config
        self.layout = layout
        self.layer_types = _rope_layer_types(config)
        caches: dict[str, RopeCache] = {}
        self.kinds: dict[str | None, _Kind] = {}
        for lt in self.layer_types or (None,):
            prefix = "" if lt is None else f"{lt}."
            kind, kind_caches = self._build_kind(config, lt, prefix, max_positions)
            self.kinds[lt] = kind
            caches.update(kind_caches)
        first = next(iter(self.kinds.values()))
        self.rope_type = first.rope_type
        self.original_max = first.original_max
        self._rotary_dim = first.rotary_dim
        # MRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pair j's cos / sin come from the row of its section.
        self.mrope_section, self.mrope_interleaved = first.mrope_section, first.mrope_interleaved
        if self.mrope_section is not None:
            if self.layer_types is not None:
                raise ValueError("MRoPE with rope parameters per layer type is not supported")
            self.register_buffer("_mrope_rows", self._section_rows(), persistent=False)
        self.caches = caches
        self._device_tables = DeviceTables(self.caches)

    @staticmethod
    def _build_kind(
        config: Any, layer_type: str | None, prefix: str, max_positions: int
    ) -> tuple[_Kind, dict[str, RopeCache]]:
        probe = RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=1)
        original_max = probe.scaling.get("original_max_position_embeddings")
        if probe.rope_type == "longrope":
            o = original_max
            caches = {
                prefix + "short": RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=o),
                prefix + "long": RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=o + 1),
            }
            for c in caches.values():
                c.reserve(max_positions)
        elif probe.rope_type == "dynamic":
            main = RopeCache.from_hf_config(config, layer_type=layer_type, max_positions=original_max)
            caches = {prefix + "main": main.reserve(max_positions)}
        else:
            caches = {
                prefix + "main": RopeCache.from_hf_config(
                    config, layer_type=layer_type, max_positions=max_positions
                )
            }
        kind = _Kind(
            prefix,
            probe.rope_type,
            original_max,
            probe.rotary_dim,
            probe.mrope_section,
            probe.mrope_interleaved,
        )
        return kind, caches

    @property
    def _tables(self) -> dict[str, Tensor]:
        """Each cache's table as last fetched, on the module's device (what a compiled forward reads)."""
        return self._device_tables.tables

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._original._apply(fn, recurse)
        self._device_tables.follow(fn)
        return self

    def reset_parameters(self) -> None:
        """Rebuild the kept original module's buffers (``inv_freq``, ...) after ``to_empty``.

        The adapter has no buffers of its own (its tables come from its caches, on the CPU, and follow
        the device), but it moves the original it keeps for :func:`unpatch_transformers`, so
        ``to_empty`` leaves that module's buffers uninitialised. They are rebuilt from a fresh original
        constructed on the CPU from its config (torchtune / FSDP2's ``reset_parameters`` convention).
        """
        if self.mrope_section is not None:
            with torch.no_grad():
                self._mrope_rows.copy_(self._section_rows())
        orig = self._original
        if next(orig.buffers(), None) is None:
            return
        with torch.device("cpu"):
            fresh = dict(type(orig)(getattr(orig, "config", self.config)).named_buffers())
        with torch.no_grad():
            for name, buf in orig.named_buffers():
                new = fresh.get(name)
                if new is not None and new.shape == buf.shape:
                    buf.copy_(new)

    def _section_rows(self) -> Tensor:
        from ..reference import mrope_rows

        return mrope_rows(self._rotary_dim // 2, self.mrope_section, self.mrope_interleaved)

    def _eager_update(self, kind: _Kind, position_ids: Tensor, device: torch.device) -> None:
        if position_ids.numel() == 0:
            return
        n = int(position_ids.max()) + 1
        if kind.rope_type == "dynamic":
            c = self.caches[kind.prefix + "main"]
            if n > c.seq_len:
                c.set_seq_len(n)
            elif n < kind.original_max < c.seq_len:
                c.set_seq_len(kind.original_max)
        for key, c in self.caches.items():
            if key.startswith(kind.prefix):
                c.reserve(n)
        self._device_tables.on(device)

    def forward(
        self, x: Tensor, position_ids: Tensor, layer_type: str | None = None
    ) -> tuple[Tensor, Tensor]:
        """``x`` (any shape: its dtype and device are used), ``position_ids`` int ``[batch, seq]`` (or
        ``[3, batch, seq]`` for MRoPE) -> ``(cos, sin)``, each ``[batch, seq, rotary_dim]`` in ``x.dtype``."""
        if self.layer_types is None:
            kind = self.kinds[None]
        elif layer_type in self.kinds:
            kind = self.kinds[layer_type]
        else:
            raise ValueError(f"layer_type must be one of {list(self.layer_types)}, got {layer_type!r}")
        if self.mrope_section is not None and position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)  # text: the same position in every section
        if not torch.compiler.is_compiling():
            self._eager_update(kind, position_ids, x.device)
        tables = self._device_tables.tables
        if kind.rope_type == "longrope":
            use_long = (position_ids.max() + 1) > kind.original_max
            short, long = tables[kind.prefix + "short"], tables[kind.prefix + "long"]
            rows = torch.where(use_long, long[position_ids], short[position_ids])
        else:
            rows = tables[kind.prefix + "main"][position_ids]
        h = rows.shape[-1] // 2
        c, s = rows[..., :h], rows[..., h:]
        if self.mrope_section is not None:
            # rows [3, batch, seq, rotary_dim]: pair j from section self._mrope_rows[j]
            idx = self._mrope_rows.view(1, 1, 1, h).expand(1, *c.shape[1:])
            c, s = c.gather(0, idx)[0], s.gather(0, idx)[0]
        return _as_layout(c, self.layout).to(x.dtype), _as_layout(s, self.layout).to(x.dtype)


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
_FUNCTION_PREFIX = "apply_rotary"


def _rotary_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if name == "rotary_emb" and type(child).__name__.endswith("RotaryEmbedding"):
                found.append((parent, name, child))
    return found


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


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


def _plan(model: nn.Module, max_positions: int | None) -> _Plan:
    """Check all that :func:`patch_transformers` would swap, changing nothing; raises ``_CheckFailed``."""
    from ..hf_config import parse_hf_config

    config = getattr(model, "config", None)
    found = _rotary_modules(model)
    if not found:
        raise _CheckFailed(f"no *RotaryEmbedding module named rotary_emb found in {type(model).__name__}")
    adapters, owners = [], {}
    functions: dict[tuple[str, str], tuple[Callable, _Rotation]] = {}
    layouts: dict[tuple[str, str], str] = {}
    for parent, name, child in found:
        if isinstance(child, HFRotaryAdapter):
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
    return _Plan(adapters, functions, owners)


def patch_transformers(
    model: nn.Module, *, max_positions: int | None = None, fuse_qk_norm: bool = True
) -> nn.Module:
    """Route a loaded transformers model's RoPE through rope_ext; returns ``model``.

    Tested model types: :data:`SUPPORTED_MODEL_TYPES`; :func:`supported_model_types` says which of them the
    installed transformers passes. Any other model is patched too when every check below passes.

    Two things change. (1) Each ``*RotaryEmbedding`` module named ``rotary_emb`` is replaced by an
    :class:`HFRotaryAdapter`: cos / sin come from :class:`~rope_ext.RopeCache` objects built by
    ``from_hf_config`` (float64 angles; one per layer type where the config nests its rope parameters per
    layer type, as Gemma 3 and ModernBERT do; MRoPE sections for Qwen2-VL, Qwen2.5-VL and Qwen3-VL) with
    ``max_positions`` rows up front (default ``config.max_position_embeddings``). (2) The attention layers
    call ``apply_rotary_pos_emb`` (or ``apply_rotary_pos_emb_interleave``, ...) as a global of their
    modeling module (e.g. ``transformers.models.llama.modeling_llama``); each such function called by the
    modules under the rotary embedding's parent is replaced by one computing the same rotation with
    rope_ext's op (one call for q and k, float32 arithmetic, differentiable), falling back to the original
    for arguments the op does not take. (2) is per model class, not per instance: other models of the same
    family in the process also use the op, with transformers' semantics. The patched model runs under
    ``torch.compile(fullgraph=True)``. :func:`unpatch_transformers` undoes both.

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
        setattr(module, fn_name, _make_patched(original, rot, _signature(original)))
    if fuse_qk_norm:
        for attention in _fusable_attentions(model):
            _defer_norms(attention)
    return model


def unpatch_transformers(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_transformers`: the original rotary modules and modeling-module functions return."""
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
                    original = _ORIGINALS.pop(key, None)
                    if original is not None:
                        setattr(sys.modules[key[0]], key[1], original)
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
    ``apply_rotary*`` functions against rope_ext's op). Computed once per process (a few seconds)."""
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

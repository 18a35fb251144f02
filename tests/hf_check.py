"""The per-family check of ``patch_transformers`` on the tiny random models of ``hf_families.py``: building a
family's model (:func:`build`, weights from :func:`reinit`), the calls and their comparison
(:func:`check`), and README.md's table of the results (:func:`render_table`).

``tests/test_hf_families.py`` asserts on :func:`check`'s results; ``benchmarks/model_table.py`` renders the
same results as README.md's table of supported families. :func:`check` compares the patched model with the
unpatched one (float32 logits and gradients, eagerly and under ``torch.compile(fullgraph=True)``), counts
the rope_ext op calls, measures how far a deliberately wrong rotation moves the logits, and unpatches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
import traceback
from collections.abc import Callable
from typing import NamedTuple

import torch
import transformers
from hf_families import BATCH, COMMON, GRAD_RTOL, LOGIT_RTOL, SENSITIVITY, VOCAB, Family, missing
from torch.utils._python_dispatch import TorchDispatchMode

from rope_ext.compat import HFRotaryAdapter, patch_transformers, unpatch_transformers
from rope_ext.compat.hf.adapter import _rope_layer_types
from rope_ext.compat.hf.patch import _make_patched
from rope_ext.compat.hf.probes import _signature
from rope_ext.hf_config import parse_hf_config


def reinit(model: torch.nn.Module, seed: int = 0) -> None:
    """Redraw every weight matrix (Linear, Embedding, fused experts: any parameter of two or more dims) as
    N(0, 1 / fan_in) with fan_in the last dim, so activations stay O(1) through the layers and attention
    scores are O(1), far from the uniform attention of transformers' 0.02 init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def build(family: Family) -> torch.nn.Module:
    """``family``'s tiny float32 model (eval mode: no dropout), weights from :func:`reinit`."""
    config_cls = getattr(importlib.import_module(family.configuration), family.config)
    model_cls = getattr(importlib.import_module(family.modeling), family.model)
    kwargs = {**COMMON, **family.kwargs}
    config = config_cls(**{k: v for k, v in kwargs.items() if v is not None})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    reinit(model)
    return model


class OpCounter(TorchDispatchMode):
    """Records the ``rope_ext.*`` ops run while active: ``(name, interleaved, q width, rotary width)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "rope_ext":
            names = [a.name for a in func._schema.arguments]
            bound = dict(zip(names, args, strict=False)) | kwargs
            x = bound.get("q", bound.get("x"))
            self.calls.append(
                (str(func), bool(bound.get("interleaved", False)), x.shape[-1], bound["cos_sin"].shape[-1])
            )
        return func(*args, **kwargs)


class Call(NamedTuple):
    """One call of a family's model: ``ids`` int64 ``[batch, seq]``, ``positions`` None or int64
    ``[3, batch, seq]`` (MRoPE), ``seed`` of the float32 weights of the loss (drawn in the output's shape)."""

    ids: torch.Tensor
    positions: torch.Tensor | None
    seed: int


def make_call(family: Family, length: int, seed: int) -> Call:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=g)
    positions = None
    if family.mrope:
        # An image block: tokens 4..15 share the temporal position, height and width run over a 3 x 4 grid.
        t = torch.arange(length).repeat(BATCH, 1)
        hgt, wid = t.clone(), t.clone()
        t[:, 4:16] = 4
        hgt[:, 4:16] = 4 + torch.arange(12).div(4, rounding_mode="floor")
        wid[:, 4:16] = 4 + torch.arange(12) % 4
        positions = torch.stack([t, hgt, wid])
    return Call(ids, positions, seed)


def forward(model, call: Call) -> torch.Tensor:
    """The model's output for ``call``: logits ``[batch, seq, vocab]`` (a model with a head) or the last
    hidden state ``[batch, seq, hidden]`` (a base model), float32."""
    kwargs = {} if call.positions is None else {"position_ids": call.positions}
    out = model(input_ids=call.ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def run(model, call: Call, runner=None, forward_mode=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output (:func:`forward`) of ``runner`` (default ``model``; e.g. its compiled form) and the
    gradients of ``(output * weights).sum()`` (``weights`` N(0, 1)) for every parameter of ``model``.
    ``forward_mode`` (e.g. an :class:`OpCounter`) is active during the forward only."""
    model.zero_grad(set_to_none=True)
    with forward_mode if forward_mode is not None else contextlib.nullcontext():
        logits = forward(model if runner is None else runner, call)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(call.seed))
    (logits * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def logit_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``."""
    return ((a - b).abs().max() / b.abs().max()).item()


def grad_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over parameters of ``max |a - b| / max |b|`` (parameters with an all-zero gradient in ``b``,
    e.g. experts no token was routed to, must be all-zero in ``a``); inf when the sets differ."""
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for name, ref in b.items():
        scale = ref.abs().max()
        diff = (a[name] - ref).abs().max()
        worst = max(worst, (diff / scale).item() if scale > 0 else (float("inf") if diff > 0 else 0.0))
    return worst


def _recording_backend(graphs: list):
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


def _patched_functions(model: torch.nn.Module) -> dict[tuple[str, str], Callable]:
    return {
        key: fn
        for a in model.modules()
        if isinstance(a, HFRotaryAdapter)
        for key in a._rope_ext_functions
        if getattr(fn := getattr(importlib.import_module(key[0]), key[1]), "_rope_ext", False)
    }


@dataclasses.dataclass
class Result:
    """What :func:`check` found for one family; ``status`` is ``"supported"`` when every criterion holds."""

    model_type: str
    status: str
    pairing: str = ""
    partial: str = ""
    scaling: str = ""
    notes: str = ""
    logit_err: float = float("nan")
    grad_err: float = float("nan")
    compiled_logit_err: float = float("nan")
    compiled_grad_err: float = float("nan")
    wrong_rotation_change: float = float("nan")
    op_calls: int = 0
    layers: int = 0
    graphs: int = 0
    graph_has_op: bool = False
    unpatched_exact: bool = False
    restored: bool = False
    seconds: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)
    trace: str = ""


def _describe_partial(config) -> str:
    head_dim, rotary_dim, _, _ = parse_hf_config(config, layer_type=_first_layer_type(config))
    return "no" if rotary_dim == head_dim else f"{rotary_dim} of {head_dim}"


def _first_layer_type(config) -> str | None:
    types_ = _rope_layer_types(config)
    return types_[0] if types_ else None


def _describe_scaling(model) -> str:
    parts = []
    for a in model.modules():
        if isinstance(a, HFRotaryAdapter):
            for lt, kind in a.kinds.items():
                parts.append(kind.rope_type if lt is None else f"{kind.rope_type} ({lt})")
    return ", ".join(dict.fromkeys(parts))


def check(family: Family) -> Result:
    """Run the per-family check (see the module docstring). A failed criterion or an exception on the way
    does not raise: the result lists it in ``failures`` (the traceback in ``trace``) and ``status`` says
    ``fails``."""
    start = time.perf_counter()
    why = missing(family)
    if why is not None:
        return Result(family.model_type, f"skipped: {why}", notes=family.notes)
    model = build(family)
    res = Result(family.model_type, "", notes=family.notes, layers=model.config.num_hidden_layers)
    res.partial = _describe_partial(model.config)
    originals = {n: m for n, m in model.named_modules() if n.endswith("rotary_emb")}
    calls = [make_call(family, n, seed=10 + i) for i, n in enumerate(family.lengths)]
    refs = [run(model, c) for c in calls]
    modeling = importlib.import_module(family.modeling)
    before = {k: v for k, v in vars(modeling).items() if k.startswith("apply_rotary")}
    try:
        patch_transformers(model)
    except TypeError as e:
        res.status = f"fails: {e}"
        res.failures.append(str(e))
        return res
    try:
        _compare(model, res, calls, refs)
    except Exception as e:  # noqa: BLE001 - recorded: the test shows it, the table says "fails"
        res.failures.append(f"{type(e).__name__}: {e}")
        res.trace = traceback.format_exc()
    finally:
        unpatch_transformers(model)
    now = {k: v for k, v in vars(modeling).items() if k.startswith("apply_rotary")}
    res.restored = now == before and all(model.get_submodule(n) is m for n, m in originals.items())
    res.unpatched_exact = all(
        torch.equal(a[0], b[0])
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in b[1])
        for a, b in ((run(model, c), ref) for c, ref in zip(calls, refs, strict=True))
    )
    res.seconds = time.perf_counter() - start
    res.failures += _failures(res)
    res.status = "supported" if not res.failures else "fails: " + "; ".join(res.failures)
    return res


def _compare(model, res: Result, calls: list[Call], refs: list) -> None:
    """The patched ``model``'s part of :func:`check`: fills ``res`` in."""
    patched = _patched_functions(model)
    used: dict[str, str] = {}
    counter = OpCounter()
    for i, (call, ref) in enumerate(zip(calls, refs, strict=True)):
        if i == 0:
            _record_used(patched, used)
            got = run(model, call, forward_mode=counter)
            _record_used(patched, None)
            res.op_calls = sum(
                1 for c in counter.calls if c[0].startswith(("rope_ext.rotary", "rope_ext.qk_norm"))
            )
        else:
            got = run(model, call)
        res.logit_err = max(_nan0(res.logit_err), logit_error(got[0], ref[0]))
        res.grad_err = max(_nan0(res.grad_err), grad_error(got[1], ref[1]))
    res.pairing = "; ".join(dict.fromkeys(used.values()))
    res.scaling = _describe_scaling(model)
    res.wrong_rotation_change = _wrong_rotation_change(model, patched, calls[-1], refs[-1][0])

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
    got = run(model, calls[-1], runner=compiled)
    res.compiled_logit_err = logit_error(got[0], refs[-1][0])
    res.compiled_grad_err = grad_error(got[1], refs[-1][1])
    res.graphs = len(graphs)
    res.graph_has_op = any(
        "rope_ext" in str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"
    )
    torch._dynamo.reset()


def _nan0(x: float) -> float:
    return 0.0 if x != x else x


def _record_used(patched: dict[tuple[str, str], Callable], used: dict[str, str] | None) -> None:
    """While ``used`` is a dict, each patched function records its rotation there when it is called."""
    for (module, name), fn in patched.items():
        mod = importlib.import_module(module)
        if used is None:
            setattr(mod, name, fn)
            continue

        def recording(*args, _fn=fn, _name=name, **kwargs):
            used[_name] = _fn._rope_ext_rotation.describe()
            return _fn(*args, **kwargs)

        setattr(mod, name, recording)


def _wrong_rotation_change(model, patched, call, ref_logits) -> float:
    """How far the logits move (relative to their largest magnitude) when every patched function
    rotates with the other pairing (half-split <-> interleaved): what a wrong match would cost."""
    try:
        for (module, name), fn in patched.items():
            rot = fn._rope_ext_rotation
            other = "interleaved" if rot.pairing == "half" else "half"
            wrong = rot._replace(pairing=other, output="same")
            original = fn._rope_ext_original
            setattr(
                importlib.import_module(module),
                name,
                _make_patched(original, wrong, _signature(original)),
            )
        with torch.no_grad():
            logits = forward(model, call)
    finally:
        for (module, name), fn in patched.items():
            setattr(importlib.import_module(module), name, fn)
    return logit_error(logits, ref_logits)


def _failures(res: Result) -> list[str]:
    out = []
    if not res.logit_err <= LOGIT_RTOL:
        out.append(f"logits differ by {res.logit_err:.3g} (> {LOGIT_RTOL:g})")
    if not res.grad_err <= GRAD_RTOL:
        out.append(f"gradients differ by {res.grad_err:.3g} (> {GRAD_RTOL:g})")
    if not res.compiled_logit_err <= LOGIT_RTOL:
        out.append(f"compiled logits differ by {res.compiled_logit_err:.3g} (> {LOGIT_RTOL:g})")
    if not res.compiled_grad_err <= GRAD_RTOL:
        out.append(f"compiled gradients differ by {res.compiled_grad_err:.3g} (> {GRAD_RTOL:g})")
    if res.op_calls != res.layers:
        out.append(f"{res.op_calls} rope_ext op calls in a forward of {res.layers} layers")
    if not res.wrong_rotation_change >= SENSITIVITY * LOGIT_RTOL:
        out.append(f"a wrong rotation moves the logits by only {res.wrong_rotation_change:.3g}")
    if res.graphs != 1 or not res.graph_has_op:
        out.append(f"compiled: {res.graphs} graphs, rope_ext op in graph: {res.graph_has_op}")
    if not (res.restored and res.unpatched_exact):
        out.append("unpatching did not restore the model exactly")
    return out


# ---------------------------------------------------------------------------------------------
# README table

TABLE_BEGIN = "<!-- model-table:begin -->"
TABLE_END = "<!-- model-table:end -->"


def render_table(results: list[Result]) -> str:
    """The Markdown between README.md's markers: a line naming the transformers version, then the table."""
    lines = [
        f"Checked with transformers {transformers.__version__} by `tests/test_hf_families.py` (tiny random "
        "models, float32 logits and gradients against the unpatched model, eager and "
        "`torch.compile(fullgraph=True)`); regenerate with "
        "`python benchmarks/model_table.py --write README.md`.",
        "",
        "| model_type | pairing | partial rotary | scaling kinds seen | status |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        status = r.status if not r.notes or not r.status == "supported" else f"supported ({r.notes})"
        lines.append(
            f"| `{r.model_type}` | {r.pairing or '-'} | {r.partial or '-'} | {r.scaling or '-'} | {status} |"
        )
    return "\n".join(lines)


def replace_table(text: str, table: str) -> str:
    """``text`` (README.md) with the part between the markers :data:`TABLE_BEGIN` / :data:`TABLE_END` set to
    ``table``."""
    head, sep, rest = text.partition(TABLE_BEGIN)
    _, sep2, tail = rest.partition(TABLE_END)
    if not sep or not sep2:
        raise ValueError(f"README.md needs the markers {TABLE_BEGIN} and {TABLE_END}")
    return f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}"


def table_in(text: str) -> str:
    """The part of ``text`` between the markers (without the newlines next to them)."""
    return text.partition(TABLE_BEGIN)[2].partition(TABLE_END)[0].strip("\n")

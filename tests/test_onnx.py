"""ONNX export (rope_ext.onnx): every op and option, alone and inside a small attention block, exported once
(module-scoped fixtures) with dynamic token counts, checked with ``onnx.checker`` (full check), counted for
``RotaryEmbedding`` nodes and run in ONNX Runtime and OpenVINO (CPU) at two token counts other than the
export example's against rope_ext eager; the layouts; torch's default opset (the decomposition); patched
tiny transformers Llama and Qwen3 in ONNX Runtime; the errors of what cannot be exported.

Tolerances (:func:`tolerance`): float32 outputs within ``2e-6 * max|output|`` of eager (each side within the
``1e-6`` accuracy contract of the float64 reference), float64 within ``1e-12``; bfloat16 and float16 one
ulp of the largest output; the attention blocks and the models ``1e-5`` relative (matmuls and softmax in
another order). OpenVINO computes float64 in float32, keeps 16-bit values in float32 between ops (four
ulps) and converts to fp8 through float16 (one fp8 step).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from _helpers import requires_emulation
from _onnx_serving_cases import (
    BLOCK_SIZE,
    BLOCKS,
    HK,
    HQ,
    PAGES,
    TOKEN_DIMS,
    D,
    P,
    _cache,
    _cache_extra,
    _mla,
    _mla_extra,
    _rerotate,
    _rerotate_extra,
)

import rope_ext

onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install -c constraints.txt onnx)")
pytest.importorskip("onnxscript", reason="onnxscript is not installed (torch's ONNX exporter needs it)")
rope_onnx = pytest.importorskip("rope_ext.onnx")

try:
    import onnxruntime as ort
except ImportError:  # the ONNX Runtime checks skip themselves
    ort = None
try:
    import openvino as ov
except ImportError:  # the OpenVINO checks skip themselves
    ov = None


def _need(module, name: str) -> None:
    if module is None:
        pytest.skip(f"{name} is not installed (pip install -c constraints.txt {name})")


@pytest.fixture(scope="module", autouse=True)
def _one_registry_per_opset():
    """torch's exporter rebuilds its registry of ONNX Script functions (about 500) for every export, 0.9 s
    here; this file's 40-odd exports share one per opset (each gets a copy: custom translations go to it)."""
    try:
        from torch.onnx._internal.exporter import _registration

        original = _registration.ONNXRegistry.from_torchlib
    except (ImportError, AttributeError):  # another exporter: every export builds its own
        yield
        return
    built = {}

    def from_torchlib(cls, opset_version=18):
        if opset_version not in built:
            built[opset_version] = original(opset_version=opset_version)
        registry = copy.copy(built[opset_version])
        registry.functions = {k: list(v) for k, v in registry.functions.items()}
        return registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(from_torchlib))
        yield


EXAMPLE_T, RUN_T = 6, (3, 11)  # tokens of the export example; the token counts run
AUTO = torch.export.Dim.AUTO
_ops = torch.ops.rope_ext


def table(rd: int) -> torch.Tensor:
    return rope_ext.RopeCache(rd, max_positions=P).cos_sin


# The cases: one rope call on q [T, HQ, D] and k [T, HK, D] with its positions -------------------------------


@dataclass
class Case:
    """``call(q, k, positions, cos_sin, **extra)`` rotates q and k (in place where the op does) and returns
    them and whatever else the op writes; ``extra(t)``: the op's other inputs for ``t`` tokens, by name."""

    name: str
    call: Callable
    rd: int = D
    axes: int = 0  # position axes (len(mrope_section)); 0: one position per token
    rotary_embedding: int = 2  # RotaryEmbedding nodes at opset 23
    dtype: torch.dtype = torch.float32  # of q and k (the model's inputs and outputs are float32)
    flat: bool = False  # positions [T] (the serving ops) instead of [T, 1]
    int32: bool = False  # int32 positions (else int64)
    freqs: bool = False  # cos_sin as frequencies (the table-free mode); positions float64 (int32: float32)
    extra: Callable[[int], dict] = field(default=lambda t: {})

    def positions(self, t: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(t)
        shape = (t,) if self.flat else (t, 1)
        p = torch.randint(0, P, (self.axes, *shape) if self.axes else shape, generator=g)
        if self.freqs:
            return (p - 0.375).float() if self.int32 else p.double() / 3.0
        return p.int() if self.int32 else p

    def cos_sin(self) -> torch.Tensor:
        cache = rope_ext.RopeCache(self.rd, max_positions=P)
        return cache.frequencies_on() if self.freqs else cache.cos_sin


SECTION = {"mrope_section": (2, 3, 3)}


def _rotary(**kw):
    return lambda q, k, p, cs: (rope_ext.apply_rotary(q, p, cs, **kw), rope_ext.apply_rotary(k, p, cs, **kw))


def _rotary_qk(**kw):
    return lambda q, k, p, cs: rope_ext.apply_rotary_qk(q, k, p, cs, **kw)


def _rotary_qk_(k_none=False, **kw):
    def call(q, k, p, cs):
        _ops.rotary_qk_(q, None if k_none else k, p, cs, **kw)  # the bare op: in place in the graph
        return q, k

    return call


def _weights(t):
    g = torch.Generator().manual_seed(1)
    return {
        "q_weight": 1 + 0.1 * torch.randn(D, generator=g),
        "k_weight": 1 + 0.1 * torch.randn(D, generator=g),
    }


def _qk_norm(inplace=False, **kw):
    def call(q, k, p, cs, q_weight, k_weight):
        if not inplace:
            return rope_ext.apply_qk_norm_rotary(q, k, q_weight, k_weight, p, cs, **kw)
        _ops.qk_norm_rotary_(q, k, q_weight, k_weight, p, cs, **kw)
        return q, k

    return call


def _qk_norm_packed(**kw):
    def call(q, k, p, cs, q_weight, k_weight):
        t = q.shape[0]
        qkv = torch.cat([q.reshape(t, HQ * D), k.reshape(t, HK * D), k.reshape(t, HK * D) * 2], dim=1)
        _ops.qk_norm_rotary_packed_(qkv, HQ, HK, HK, q_weight, k_weight, p, cs, **kw)
        return qkv[:, : HQ * D].reshape(t, HQ, D), qkv[:, HQ * D : (HQ + HK) * D].reshape(t, HK, D), qkv

    return call


CASES = [
    Case("rotary", _rotary()),
    Case("rotary-interleaved-partial", _rotary(interleaved=True), rd=8),
    Case("rotary-inverse-offset", _rotary(inverse=True, rotary_offset=4), rd=8),
    Case("rotary-mrope", _rotary(**SECTION), axes=3, rotary_embedding=0),
    Case("rotary-float64", _rotary(), dtype=torch.float64, rotary_embedding=0),
    Case("rotary-bfloat16", _rotary(), dtype=torch.bfloat16),
    Case("rotary_qk", _rotary_qk()),
    Case("rotary_qk-float16", _rotary_qk(), dtype=torch.float16),
    Case("rotary_qk-interleaved-offset", _rotary_qk(interleaved=True, rotary_offset=8), rd=8),
    Case("rotary_qk_-int32", _rotary_qk_(), int32=True),
    Case("rotary_qk_-k-none-partial", _rotary_qk_(k_none=True), rd=8, rotary_embedding=1),
    Case("rotary_qk_-mrope-interleaved", _rotary_qk_(mrope_interleaved=True, **SECTION), axes=3,
         rotary_embedding=0),
    Case("rotary_qk-4-axes", _rotary_qk(mrope_section=(1, 3, 2, 2), mrope_interleaved=True), axes=4,
         rotary_embedding=0),
    Case("rotary_qk_-mrope-alternating", _rotary_qk_(mrope_interleaved=2, **SECTION), axes=3,
         rotary_embedding=0),
    Case("qk_norm_rotary", _qk_norm(eps=1e-5, weight_offset=1.0), flat=True, int32=True, extra=_weights),
    Case("qk_norm_rotary_-interleaved-partial", _qk_norm(True, interleaved=True), rd=8, flat=True,
         extra=_weights),
    Case("qk_norm_rotary-mrope", _qk_norm(**SECTION), axes=3, flat=True, rotary_embedding=0, extra=_weights),
    Case("qk_norm_rotary_packed_-offset", _qk_norm_packed(rotary_offset=8), rd=8, flat=True, extra=_weights),
    Case("rotary_qk_cache_", _cache(), flat=True, extra=_cache_extra()),
    Case("rotary_qk_cache_-hnd-q_out-interleaved", _cache("HND", interleaved=True), flat=True,
         extra=_cache_extra("HND", q_out=True)),
    Case("rotary_qk_cache_-fp8-q_out", _cache(fp8=True), flat=True, extra=_cache_extra(fp8=True, q_out=True)),
    Case("rotary_qk_cache_-2-axes", _cache(mrope_section=(5, 3)), axes=2, flat=True, rotary_embedding=0,
         extra=_cache_extra()),
    Case("mla_rotary_cache_", _mla(), rd=8, flat=True, extra=_mla_extra()),
    Case("rerotate_kv_cache_-offset", _rerotate(rotary_offset=8), rd=8, flat=True, rotary_embedding=0,
         extra=_rerotate_extra()),
    Case("rerotate_kv_cache_-hnd-interleaved-fp8", _rerotate(fp8=True, layout="HND", interleaved=True),
         flat=True, rotary_embedding=0, extra=_rerotate_extra("HND", fp8=True)),
    Case("mla_rotary_cache_-interleaved-fp8-q_out", _mla(fp8=True, interleaved=True), rd=8, flat=True,
         extra=_mla_extra(fp8=True, q_out=True)),
    Case("rotary_qk_cache_-page_table", _cache(), flat=True, extra=_cache_extra(paged=True)),
    Case("rotary_qk_cache_-hnd-page_table-full-pages-q_out", _cache("HND"), flat=True,
         extra=_cache_extra("HND", q_out=True, paged=True, last_page_len=False)),
    Case("mla_rotary_cache_-page_table", _mla(), rd=8, flat=True, extra=_mla_extra(paged=True)),
    Case("rotary-frequencies", _rotary(), freqs=True),
    Case("rotary_qk-frequencies-float32-positions-interleaved", _rotary_qk(interleaved=True), freqs=True,
         int32=True),
    Case("rotary_qk_cache_-frequencies", _cache(), flat=True, freqs=True, extra=_cache_extra()),
    Case("rerotate_kv_cache_-frequencies-hnd-fp8", _rerotate(fp8=True, layout="HND"), flat=True,
         rotary_embedding=0, freqs=True, extra=_rerotate_extra("HND", fp8=True)),
    Case("qk_norm_rotary-mrope-frequencies", _qk_norm(**SECTION), axes=3, flat=True, rotary_embedding=0,
         freqs=True, extra=_weights),
]  # fmt: skip


# The models: the call alone, and inside a token-major attention block --------------------------------------


class Alone(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case, self.names = case, tuple(case.extra(EXAMPLE_T))

    def forward(self, q, k, positions, cos_sin, *extra):
        dt = self.case.dtype
        q, k = q.to(dt) * 1, k.to(dt) * 1  # new tensors: in-place ops write them, not the model's inputs
        outs = self.case.call(q, k, positions, cos_sin, **dict(zip(self.names, extra, strict=True)))
        return tuple(t.float() for t in outs)

    def dynamic(self) -> tuple:
        """AUTO for the token dims (q, k, positions, slot_mapping or the page table's batch_indices and
        positions, q_out, delta); tables, weights, caches and the page table's pages static."""
        extra = tuple({0: AUTO} if n in TOKEN_DIMS else None for n in self.names)
        return ({0: AUTO}, {0: AUTO}, {int(bool(self.case.axes)): AUTO}, None) + ((extra,) if extra else ())

    def inputs(self, t: int) -> tuple:
        g = torch.Generator().manual_seed(100 + t)
        q, k = torch.randn(t, HQ, D, generator=g), torch.randn(t, HK, D, generator=g)
        return (q, k, self.case.positions(t), self.case.cos_sin(), *self.case.extra(t).values())


class Block(Alone):
    """One attention layer on ``x [T, 32]``: q, k, v are views of one projection; the rope call; causal
    attention (GQA) written out in matmuls; the output projection (and what the call writes besides)."""

    def __init__(self, case: Case):
        super().__init__(case)
        g = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(32, (HQ + 2 * HK) * D, generator=g) / 6)
        self.o = torch.nn.Parameter(torch.randn(HQ * D, 32, generator=g) / 8)

    def forward(self, x, positions, cos_sin, *extra):
        t = x.shape[0]
        qkv = x @ self.qkv
        dt = self.case.dtype
        if dt != torch.float32:
            qkv = qkv.to(dt)
        q = qkv[:, : HQ * D].view(t, HQ, D)
        k = qkv[:, HQ * D : (HQ + HK) * D].view(t, HK, D)
        v = qkv[:, (HQ + HK) * D :].view(t, HK, D).float()
        outs = self.case.call(q, k, positions, cos_sin, **dict(zip(self.names, extra, strict=True)))
        q, k = outs[0].float().transpose(0, 1), outs[1].float().transpose(0, 1)  # [heads, T, D]
        k, v = (h.unsqueeze(1).expand(HK, HQ // HK, t, D).reshape(HQ, t, D) for h in (k, v.transpose(0, 1)))
        i = torch.arange(t)
        scores = q @ k.transpose(1, 2) / D**0.5 + (i[None, :] > i[:, None]) * -1e9  # causal
        y = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(t, HQ * D)
        return (y @ self.o,) + tuple(t.float() for t in outs[2:])

    def dynamic(self) -> tuple:
        return super().dynamic()[1:]

    def inputs(self, t: int) -> tuple:
        x = torch.randn(t, 32, generator=torch.Generator().manual_seed(200 + t))
        return (x, self.case.positions(t), self.case.cos_sin(), *self.case.extra(t).values())


def count(model, op_type: str) -> int:
    return sum(node.op_type == op_type for node in model.graph.node)


def check_model(model) -> None:
    """The full checker; standard ONNX only (no custom domain, no functions)."""
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}, model.opset_import
    assert not model.functions
    assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)


def run_ort(model, inputs) -> list[torch.Tensor]:
    _need(ort, "onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert len(names) == len(inputs)
    feeds = {name: t.numpy() for name, t in zip(names, inputs, strict=True)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


@functools.cache
def _ov_core():
    return ov.Core()


def run_openvino(model, inputs) -> list[torch.Tensor]:
    _need(ov, "openvino")
    core = _ov_core()
    compiled = core.compile_model(
        core.read_model(model.SerializeToString(), b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    names = [i.name for i in model.graph.input]
    assert len(names) == len(inputs)
    used = {name for port in compiled.inputs for name in port.get_names()}  # OpenVINO drops unread inputs
    result = compiled({n: t.numpy() for n, t in zip(names, inputs, strict=True) if n in used})
    return [torch.from_numpy(result[o].copy()) for o in compiled.outputs]


def tolerance(case: Case, runtime: str, block: bool, output: int) -> tuple[float, float]:
    """``(relative to max|eager output|, relative to each element)`` for output ``output`` of ``case``
    (alone: q, k, then what the op writes; in the block: the block's output, then what the op writes)."""
    if runtime == "openvino" and case.name.endswith(("fp8-q_out", "-fp8")) and output >= (1 if block else 2):
        return 2**-9, 2**-3  # the fp8 values: OpenVINO converts to fp8 through float16 (two roundings)
    half = {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(case.dtype)  # one ulp, relative
    if half is not None:
        # OpenVINO keeps 16-bit values in float32 between ops: not the roundings of the graph
        return (4 * half if block else half) * (4 if runtime == "openvino" else 1), 0.0
    if block:
        return 1e-5, 0.0
    if case.freqs and runtime == "openvino":  # angles to 64 rad in float32: 64 * 2^-24
        return 2e-5, 0.0
    if case.dtype == torch.float64 and runtime == "onnxruntime":  # OpenVINO computes float64 in float32
        return 1e-12, 0.0
    return 2e-6, 0.0


def assert_matches(outs, want, case: Case, runtime: str, block: bool) -> None:
    assert len(outs) == len(want)
    for i, (got, ref) in enumerate(zip(outs, want, strict=True)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        rel_max, rel_each = tolerance(case, runtime, block, i)
        scale = ref.abs().max().item()
        excess = ((got - ref).abs() - rel_each * ref.abs()).max().item()
        assert excess <= rel_max * scale, f"output {i}: error {excess:.3g} > {rel_max:.3g} * {scale:.3g}"


def export(model, inputs, **kw):
    with torch.no_grad():  # the cache op is an inference op
        return torch.onnx.export(
            model, inputs, dynamo=True, verbose=False, dynamic_shapes=model.dynamic(), **kw
        ).model_proto


def check_runs(module, model, runtime: str, case: Case, sizes=RUN_T) -> None:
    run = run_ort if runtime == "onnxruntime" else run_openvino
    for size in sizes:
        inputs = module.inputs(size)
        with torch.no_grad():
            want = module(*inputs)
        assert_matches(run(model, inputs), list(want), case, runtime, isinstance(module, Block))


# Every case, alone and in the block, at opset 23 -----------------------------------------------------------

RUNTIMES = ["onnxruntime", "openvino"]


def installed_runtimes() -> list[str]:
    """The runtimes installed (tests that run the models in each skip when there is none)."""
    runtimes = [r for r, module in zip(RUNTIMES, (ort, ov), strict=True) if module is not None]
    if not runtimes:
        pytest.skip("neither onnxruntime nor openvino is installed")
    return runtimes


@pytest.fixture(
    scope="module",
    params=[(kind, c) for kind in ("alone", "block") for c in CASES],
    ids=lambda p: f"{p[0]}-{p[1].name}",
)
def exported(request):
    kind, case = request.param
    module = (Alone if kind == "alone" else Block)(case).eval()
    return case, module, export(module, module.inputs(EXAMPLE_T), opset_version=23)


def test_checker_and_rotary_embedding_nodes(exported):
    case, _, model = exported
    check_model(model)
    assert count(model, "RotaryEmbedding") == case.rotary_embedding
    token_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert token_dim.dim_param and not token_dim.dim_value  # the token count stays dynamic


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runs_like_eager(exported, runtime):
    case, module, model = exported
    check_runs(module, model, runtime, case)


@requires_emulation
def test_page_table_tokens_not_placed_are_skipped_as_on_cuda():
    """The tokens a page table cannot place (a request outside it, an entry outside its request, a page
    outside the cache, a kv_last_page_len over the page size: the CPU op refuses such a table) are not
    written, as the CUDA kernels skip them: ONNX Runtime against the CUDA kernel body run on the host."""
    _need(ort, "onnxruntime")
    case = next(c for c in CASES if c.name == "rotary_qk_cache_-page_table")
    module = Alone(case).eval()
    model = export(module, module.inputs(EXAMPLE_T), opset_version=23)
    inputs = module.inputs(RUN_T[1])
    q, k, p, cs, kc, vc, *table = inputs
    table[0][0], table[1][2], table[1][3], table[2][PAGES[0]], table[4][2] = 3, 99, -1, BLOCKS, BLOCK_SIZE + 1
    want = [q.clone(), k.clone(), kc.clone(), vc.clone()]
    flags = (None,) * 5 + (False, "NHD", 132, False)
    _ops._cuda_emulated_cache(*want[:2], k * 3 - 1, p, cs, *want[2:], *flags, page_table=table)
    assert not torch.equal(want[2], kc)  # some tokens placed
    assert_matches(run_ort(model, inputs), want, case, "onnxruntime", block=False)


# Layouts: x of any rank, positions broadcast over the heads (rope_ext.onnx.export: public APIs only) -------


@dataclass
class Layout:
    name: str
    x: Callable  # (b, s) -> x's shape
    positions: Callable  # (b, s) -> positions' shape
    dynamic: tuple  # dims of x, dims of positions


LAYOUTS = [
    Layout("bshd", lambda b, s: (b, s, HQ, D), lambda b, s: (b, s, 1), ((0, 1), (0, 1))),
    Layout("bshd-shared", lambda b, s: (b, s, HQ, D), lambda b, s: (s, 1), ((0, 1), (0,))),
    Layout("bhsd", lambda b, s: (b, HQ, s, D), lambda b, s: (b, 1, s), ((0, 2), (0, 2))),
    Layout("bhsd-shared", lambda b, s: (b, HQ, s, D), lambda b, s: (1, 1, s), ((0, 2), (2,))),
    Layout("sbhd", lambda b, s: (s, b, HQ, D), lambda b, s: (s, 1, 1), ((0, 1), (0,))),
    Layout("per-head", lambda b, s: (s, HQ, D), lambda b, s: (s, HQ), ((0,), (0,))),
]


class Rotate(torch.nn.Module):
    def __init__(self, layout: Layout):
        super().__init__()
        self.layout = layout

    def forward(self, x, positions, cos_sin):
        return rope_ext.apply_rotary(x, positions, cos_sin, interleaved=True)

    def inputs(self, b: int, s: int) -> tuple:
        g = torch.Generator().manual_seed(b * 100 + s)
        x = torch.randn(self.layout.x(b, s), generator=g)
        return x, torch.randint(0, P, self.layout.positions(b, s), generator=g), table(D)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_layouts(layout):
    module = Rotate(layout)
    xd, pd = layout.dynamic
    dynamic = ({i: AUTO for i in xd}, {i: AUTO for i in pd}, None)
    model = rope_onnx.export(module, module.inputs(2, EXAMPLE_T), dynamic_shapes=dynamic, verbose=False)
    model = model.model_proto
    check_model(model)
    assert count(model, "RotaryEmbedding") == 1
    for runtime in installed_runtimes():
        run = run_ort if runtime == "onnxruntime" else run_openvino
        for b, s in ((3, RUN_T[0]), (2, RUN_T[1])):
            inputs = module.inputs(b, s)
            assert_matches(run(model, inputs), [module(*inputs)], CASES[0], runtime, block=False)


# Opsets below 23: the decomposition everywhere -------------------------------------------------------------


def test_default_opset_decomposes():
    case = next(c for c in CASES if c.name == "rotary_qk_cache_-hnd-q_out-interleaved")
    module = Block(case).eval()
    model = export(module, module.inputs(EXAMPLE_T))  # torch's default opset (20): no RotaryEmbedding there
    check_model(model)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) < 23
    assert count(model, "RotaryEmbedding") == 0
    for runtime in installed_runtimes():
        check_runs(module, model, runtime, case)


# Transformers models patched with patch_transformers --------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_model(request):
    _need(ort, "onnxruntime")
    transformers = pytest.importorskip("transformers")
    from rope_ext.compat import patch_transformers, unpatch_transformers

    config = transformers.AutoConfig.for_model(
        request.param,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    patch_transformers(model)
    ids = torch.randint(0, 128, (2, EXAMPLE_T))
    batch, seq = torch.export.Dim("batch", max=16), torch.export.Dim("seq", max=128)
    with torch.no_grad():
        program = torch.onnx.export(
            model, (ids,), dynamo=True, opset_version=23, verbose=False, dynamic_shapes=({0: batch, 1: seq},)
        )
    yield model, program.model_proto
    unpatch_transformers(model)


def test_transformers_models_in_onnxruntime(hf_model):
    model, proto = hf_model
    check_model(proto)
    assert count(proto, "RotaryEmbedding") == 4  # q and k of 2 layers (Qwen3: after the fused QK norm)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, s in ((1, RUN_T[0]), (3, RUN_T[1])):
        ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(s))
        (logits,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
        with torch.no_grad():
            want = model(ids).logits
        assert (torch.from_numpy(logits) - want).abs().max() <= 1e-5 * want.abs().max()


# What cannot be exported, the registration, the import ------------------------------------------------------


def _export_error(exc: BaseException) -> BaseException | None:
    while exc is not None and not isinstance(exc, rope_onnx.ExportError):
        exc = exc.__cause__ or exc.__context__
    return exc


def test_dynamic_head_dim_raises_naming_op_and_option():
    class Model(torch.nn.Module):
        def forward(self, x, positions, cos_sin):
            return rope_ext.apply_rotary(x, positions, cos_sin, interleaved=True)

    x, positions = torch.randn(EXAMPLE_T, HQ, 24), CASES[0].positions(EXAMPLE_T)
    with pytest.raises(Exception) as info:
        torch.onnx.export(
            Model().eval(),
            (x, positions, table(D)),
            dynamo=True,
            opset_version=23,
            verbose=False,
            dynamic_shapes=({0: AUTO, 2: AUTO}, {0: AUTO}, None),
        )
    error = _export_error(info.value)
    assert error is not None and "rotary: a dynamic head_dim (x.shape[-1])" in str(error)


def test_functionalized_program_raises():
    case = next(c for c in CASES if c.name == "rotary_qk_-int32")
    module = Alone(case)
    with torch.no_grad():
        program = torch.export.export(module, module.inputs(EXAMPLE_T)).run_decompositions()
    with pytest.raises(Exception) as info:
        torch.onnx.export(program, dynamo=True, opset_version=23, verbose=False)
    error = _export_error(info.value)
    assert error is not None and "rope_ext::rotary_qk_ is already functionalized" in str(error)


def test_translation_table_and_registration():
    twins = {torch.ops.rope_ext_onnx.rotary_qk, torch.ops.rope_ext_onnx.rotary_qk_cache}
    twins |= {torch.ops.rope_ext_onnx.qk_norm_rotary, torch.ops.rope_ext_onnx.qk_norm_rotary_packed}
    twins |= {torch.ops.rope_ext_onnx.mla_rotary_cache, torch.ops.rope_ext_onnx.rerotate_kv_cache}
    functional = {_ops.rotary.default, _ops.rotary_qk.default, _ops.qk_norm_rotary.default}
    assert set(rope_onnx.translation_table()) == functional | {t.default for t in twins}
    assert rope_onnx.REGISTERED and rope_onnx.register()  # on import, idempotent


def test_import_rope_ext_does_not_import_onnx():
    import subprocess
    import sys

    heavy = ("onnx", "onnxscript", "rope_ext.onnx")
    code = f"import sys, rope_ext; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "[]", done.stderr[-2000:]


def test_bench_provider_validates():
    """rope-bench's onnxruntime provider (opt-in) against the float64 reference: in place on an MRoPE shape
    (the decomposition), out of place on a plain one (RotaryEmbedding)."""
    from rope_ext.bench.presets import Preset
    from rope_ext.bench.providers import PROVIDERS
    from rope_ext.bench.validation import check
    from rope_ext.bench.workloads import make_case

    _need(ort, "onnxruntime")

    presets = {
        "inplace": Preset("tiny-mrope", 4, 2, 32, 32, False, 1e4, (4, 6, 6)),
        "out": Preset("tiny", 4, 2, 32, 16, True),
    }
    for p in (p for p in PROVIDERS if p.name == "onnxruntime"):
        case = make_case(
            presets[p.mode], 8, "prefill", torch.float32, presets[p.mode].interleaved, torch.device("cpu")
        )
        assert check(case, p.mode, p.build(case)(), 8.0)["ok"], p.mode

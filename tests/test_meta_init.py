"""Construction under a meta default device (FSDP2 / torchtune: build on "meta", ``to_empty``, init).

rope_ext computes every cos/sin table on the CPU in float64 (stored float32) whatever the default device
(``with torch.device("meta")`` or ``torch.set_default_device``) and default dtype are; the modules follow
their device, so ``to_empty(device=...)`` re-fetches the table there. Everything built that way must be
bit-equal to the same thing built eagerly.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import assert_close_to_reference
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_ext import RopeCache, RotaryEmbedding, reference
from rope_ext.compat import (
    HFRotaryAdapter,
    RotaryPositionalEmbeddings,
    patch_transformers,
    precompute_freqs_cis,
    unpatch_transformers,
)

CPU = torch.device("cpu")

# rotary_dim 16 (longrope factor lists of 8); trained length 32 so that ensure(100) crosses it.
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32},
    "longrope": {
        "rope_type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "short_factor": [1.0 + 0.01 * j for j in range(8)],
        "long_factor": [1.0 + 0.5 * j for j in range(8)],
    },
}

# transformers configs (head_dim 64 / 4 = 16) for the HF adapter, one per cache layout it uses.
HF_ROPE = {
    "default": {"rope_type": "default", "rope_theta": 1e4},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + 0.01 * j for j in range(8)],
        "long_factor": [1.0 + 0.5 * j for j in range(8)],
        "original_max_position_embeddings": 16,
    },
}


@contextlib.contextmanager
def _global_default_device(device):
    prev = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None if prev == CPU else prev)


def _meta(how: str):
    """A meta default device: the context manager, or the process-wide ``torch.set_default_device``."""
    return torch.device("meta") if how == "context" else _global_default_device("meta")


@pytest.fixture
def bf16_default_dtype():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def _materialise(model: nn.Module, eager: nn.Module, device=CPU) -> nn.Module:
    """FSDP2 / torchtune: ``to_empty``, ``reset_parameters()`` where a module has one, then the learned
    weights (from ``eager``, as a checkpoint would bring them)."""
    model.to_empty(device=device)
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
    model.load_state_dict(eager.state_dict())
    return model


def _assert_tables_equal(a: RopeCache, b: RopeCache) -> None:
    assert a.device == b.device == CPU
    assert a.cos_sin.dtype == b.cos_sin.dtype == torch.float32
    assert a.inv_freq.dtype == b.inv_freq.dtype == torch.float64
    assert torch.equal(a.cos_sin, b.cos_sin)
    assert torch.equal(a.inv_freq, b.inv_freq)
    assert a.attention_factor == b.attention_factor
    assert (a.seq_len, a.capacity, a._version) == (b.seq_len, b.capacity, b._version)


def _qk(seq: int, heads: int = 2, head_dim: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, heads, head_dim, generator=g, dtype=torch.float32)
    k = torch.randn(2, seq, 1, head_dim, generator=g, dtype=torch.float32)
    return q, k


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.device == b.device and a.dtype == b.dtype
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# (a) the FSDP2 pattern without a process group: build on meta, to_empty, reset_parameters, weights


class _Attention(nn.Module):
    """The RoPE part of an attention block: a q/k projection and a RotaryEmbedding."""

    def __init__(self, head_dim: int = 32, heads: int = 2, **rope_kwargs) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qk = nn.Linear(heads * head_dim, 2 * heads * head_dim)
        self.rope = RotaryEmbedding(head_dim, **rope_kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.qk(x).unflatten(-1, (2, self.heads, self.head_dim)).unbind(-3)
        return self.rope(q, k)


@pytest.mark.parametrize("how", ["context", "global"])
@pytest.mark.parametrize("variant", list(SCALINGS))
def test_rotary_embedding_meta_then_to_empty(variant, how):
    kwargs = dict(rotary_dim=16, scaling=SCALINGS[variant], max_positions=64)
    torch.manual_seed(0)
    eager = _Attention(**kwargs)
    with _meta(how):
        model = _Attention(**kwargs)
    assert model.qk.weight.is_meta
    # the table is real (CPU, float64 angles) from the start, not a meta tensor
    assert model.rope.cos_sin().device == CPU and torch.equal(model.rope.cos_sin(), eager.rope.cos_sin())
    _materialise(model, eager)
    assert model.rope._table.device == CPU and model.rope._table.dtype == torch.float32
    _assert_tables_equal(model.rope.cache, eager.rope.cache)

    q, k = _qk(24)
    _assert_same(model.rope(q, k), eager.rope(q, k))
    _assert_same(model.rope(q, k, offset=90), eager.rope(q, k, offset=90))  # grows (and rebuilds)
    _assert_tables_equal(model.rope.cache, eager.rope.cache)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    _assert_same(model(x), eager(x))

    if variant == "default":  # against the float64 reference (its table built under meta too)
        with _meta(how):
            table = reference.cos_sin_table(120, 16)
        assert table.device == CPU
        pos = torch.arange(90, 114)[:, None]
        for got, t in zip(model.rope(q, k, offset=90), (q, k), strict=True):
            assert_close_to_reference(got, reference.rotary_hadamard(t, pos, table), t.abs().max().item())


def test_rotary_embedding_meta_forward_then_materialise():
    """A meta-built module also runs on meta inputs (shape inference), then materialises normally."""
    eager = RotaryEmbedding(32, interleaved=True, max_positions=16)
    with torch.device("meta"):
        m = RotaryEmbedding(32, interleaved=True, max_positions=16)
        qm, km = torch.empty(1, 8, 2, 32), torch.empty(1, 8, 2, 32)
    oq, ok = m(qm, km)
    assert oq.is_meta and ok.is_meta and oq.shape == qm.shape
    m.to_empty(device="cpu")
    assert m._table.device == CPU
    q, k = _qk(8)
    _assert_same(m(q, k), eager(q, k))


def test_rotary_embedding_to_empty_on_device(device):
    """``to_empty(device=...)`` re-fetches the table on that device (the cache itself stays on the CPU)."""
    torch.manual_seed(0)
    eager = _Attention(rotary_dim=16, scaling=SCALINGS["llama3"], max_positions=64).to(device)
    with torch.device("meta"):
        model = _Attention(rotary_dim=16, scaling=SCALINGS["llama3"], max_positions=64)
    _materialise(model, eager, device)
    assert model.rope._table.device == eager.rope._table.device
    assert model.rope.cache.device == CPU
    q, k = (t.to(device) for t in _qk(24))
    _assert_same(model.rope(q, k, offset=70), eager.rope(q, k, offset=70))


class _SeqFirst(nn.Module):
    def __init__(self, d: int = 16, features: int = 24) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.rope = RotaryPositionalEmbeddings(d, base=500)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rope(self.proj(x))


@pytest.mark.parametrize("how", ["context", "global"])
def test_labml_module_meta_then_to_empty(how):
    torch.manual_seed(0)
    eager = _SeqFirst()
    with _meta(how):
        model = _SeqFirst()
    _materialise(model, eager)
    x = torch.randn(40, 2, 3, 24, generator=torch.Generator().manual_seed(2))
    _assert_same([model.rope(x)], [eager.rope(x)])
    _assert_same([model(x)], [eager(x)])
    _assert_tables_equal(model.rope.cache, eager.rope.cache)
    table = reference.cos_sin_table(40, 16, 500.0)
    ref = reference.rotary_hadamard(x, torch.arange(40)[:, None, None], table)
    assert_close_to_reference(model.rope(x), ref, x.abs().max().item())


def _hf_config(variant: str, max_pos: int = 32) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=max_pos,
        rope_parameters=dict(HF_ROPE[variant]),
        attn_implementation="sdpa",
    )


def _hf_adapter(cfg: LlamaConfig) -> HFRotaryAdapter:
    return HFRotaryAdapter(LlamaRotaryEmbedding(cfg), cfg, max_positions=32)


@pytest.mark.parametrize("how", ["context", "global"])
@pytest.mark.parametrize("variant", list(HF_ROPE))
def test_hf_adapter_meta_then_to_empty(variant, how):
    cfg = _hf_config(variant)
    eager = _hf_adapter(cfg)
    with _meta(how):
        adapter = _hf_adapter(cfg)
    assert adapter._original.inv_freq.is_meta
    adapter.to_empty(device="cpu")
    adapter.reset_parameters()
    for name in eager.caches:
        _assert_tables_equal(adapter.caches[name], eager.caches[name])
    x = torch.zeros(1, dtype=torch.float32)
    for n in (12, 40, 12):  # under, past, back under the trained length (dynamic / longrope switch)
        pos = torch.arange(n)[None]
        _assert_same(adapter(x, pos), eager(x, pos))
    # the original kept for unpatching has its buffers back (to_empty left them uninitialised)
    for (na, a), (nb, b) in zip(
        adapter._original.named_buffers(), eager._original.named_buffers(), strict=True
    ):
        assert na == nb and a.device == CPU and torch.equal(a, b)


def test_patch_transformers_on_meta_model():
    """A transformers model built on meta, patched, materialised: same logits as one built eagerly,
    also after unpatching (the adapter's reset_parameters rebuilt the original's inv_freq)."""
    cfg = _hf_config("default", max_pos=64)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    patched = []
    try:
        patch_transformers(eager)
        patched.append(eager)
        patch_transformers(model)
        patched.append(model)
        assert isinstance(model.model.rotary_emb, HFRotaryAdapter)
        _materialise(model, eager)
        ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, eager(ids).logits)
            unpatch_transformers(model)
            unpatch_transformers(eager)
            patched.clear()
            assert isinstance(model.model.rotary_emb, LlamaRotaryEmbedding)
            assert torch.equal(model.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
            assert torch.equal(model(ids).logits, eager(ids).logits)
    finally:
        for m in patched:
            unpatch_transformers(m)


# ---------------------------------------------------------------------------------------------
# (b) RopeCache and the table builders under a meta default device


@pytest.mark.parametrize("how", ["context", "global"])
@pytest.mark.parametrize("variant", list(SCALINGS))
def test_rope_cache_under_meta_is_bit_equal(variant, how):
    eager = RopeCache(16, 1e4, max_positions=20, scaling=SCALINGS[variant])
    with _meta(how):
        cache = RopeCache(16, 1e4, max_positions=20, scaling=SCALINGS[variant])
        _assert_tables_equal(cache, eager)
        # growth, and for dynamic / longrope a rebuild with new frequencies, also under meta
        cache.ensure(100)
        cache.set_seq_len(30)
    eager.ensure(100)
    eager.set_seq_len(30)
    _assert_tables_equal(cache, eager)


@pytest.mark.parametrize("how", ["context", "global"])
def test_table_builders_under_meta(how):
    freqs = precompute_freqs_cis(32, 50, theta=5e5)
    inv = reference.inv_freq(32, 5e5)
    table = reference.cos_sin_table(50, 32, 5e5)
    from_config = RopeCache.from_hf_config(_hf_config("yarn"), max_positions=40)
    with _meta(how):
        got = (
            precompute_freqs_cis(32, 50, theta=5e5),
            reference.inv_freq(32, 5e5),
            reference.cos_sin_table(50, 32, 5e5),
        )
        cfg_cache = RopeCache.from_hf_config(_hf_config("yarn"), max_positions=40)
    _assert_same(got, (freqs, inv, table))
    _assert_tables_equal(cfg_cache, from_config)


# ---------------------------------------------------------------------------------------------
# (c) a bfloat16 default dtype changes no table


@pytest.mark.parametrize("variant", list(SCALINGS))
def test_rope_cache_with_bf16_default_dtype(variant, request):
    eager = RopeCache(16, 1e4, max_positions=20, scaling=SCALINGS[variant]).ensure(100)
    request.getfixturevalue("bf16_default_dtype")
    assert torch.get_default_dtype() == torch.bfloat16
    _assert_tables_equal(RopeCache(16, 1e4, max_positions=20, scaling=SCALINGS[variant]).ensure(100), eager)
    with torch.device("meta"):
        cache = RopeCache(16, 1e4, max_positions=20, scaling=SCALINGS[variant]).ensure(100)
    _assert_tables_equal(cache, eager)


def test_modules_with_bf16_default_dtype(request):
    q, k = _qk(24)
    x = torch.randn(40, 2, 3, 24, generator=torch.Generator().manual_seed(2))
    cfg = _hf_config("longrope")
    pos = torch.arange(40)[None]
    rope = RotaryEmbedding(32, scaling=SCALINGS["yarn"], max_positions=64)
    labml = RotaryPositionalEmbeddings(16)
    adapter = _hf_adapter(cfg)
    want = (*rope(q, k), labml(x), *adapter(x, pos))
    freqs = precompute_freqs_cis(32, 50)

    request.getfixturevalue("bf16_default_dtype")
    for build in (contextlib.nullcontext, lambda: torch.device("meta")):
        with build():
            rope2 = RotaryEmbedding(32, scaling=SCALINGS["yarn"], max_positions=64)
            labml2 = RotaryPositionalEmbeddings(16)
            adapter2 = _hf_adapter(cfg)
            freqs2 = precompute_freqs_cis(32, 50)
        for m in (rope2, labml2, adapter2):
            m.to_empty(device="cpu")
        adapter2.reset_parameters()
        assert rope2._table.dtype == labml2._device_tables.table.dtype == torch.float32
        assert freqs2.dtype == torch.complex64 and torch.equal(freqs2, freqs)
        _assert_tables_equal(rope2.cache, rope.cache)
        _assert_same((*rope2(q, k), labml2(x), *adapter2(x, pos)), want)


# ---------------------------------------------------------------------------------------------
# (d) real FSDP2 on the CPU: gloo, world size 1, in-process


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention(rotary_dim=16, scaling=SCALINGS["yarn"], max_positions=16)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.attn(x)
        return x + self.out((q * k.mean(-2, keepdim=True)).flatten(-2))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_fsdp2_fully_shard_meta_init(tmp_path):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    eager = _Model()
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(4))
    want = eager(x)
    want.square().mean().backward()

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with torch.device("meta"):
            model = _Model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model, FSDPModule)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                assert m._table.device == CPU
        sd = eager.state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(sd[name])  # world size 1: the local shard is the whole tensor
        got = model(x)
        assert torch.equal(got, want)
        got.square().mean().backward()
        grads = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p.grad.full_tensor(), grads[name].grad), name
    finally:
        dist.destroy_process_group()

"""Drop-in adapters against the real thing: transformers' own functions and tiny random models built
from configs (no download), vLLM's op semantics, labml's module layout, Meta's complex form."""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import assert_close_to_reference, ulp
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import rope_ext
from rope_ext import compat, reference
from rope_ext.compat import (
    RotaryPositionalEmbeddings,
    apply_rotary_emb,
    apply_rotary_pos_emb,
    patch_transformers,
    precompute_freqs_cis,
    rotary_embedding,
    unpatch_transformers,
)

HF_APPLY = modeling_llama.apply_rotary_pos_emb  # transformers' own function, captured before any patch


def _hf_cos_sin(batch: int, seq: int, head_dim: int, dtype: torch.dtype, theta: float = 1e4, offset: int = 0):
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_parameters={"rope_theta": theta})
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(offset, offset + seq).expand(batch, seq)
    return rope(torch.zeros(1, dtype=dtype), pos)


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of rope_ext's q/k op made by the adapters."""
    calls = []
    real = compat.hf.rotation.apply_rotary_qk

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compat.hf.rotation, "apply_rotary_qk", counted)  # the module that calls it
    return calls


# ---------------------------------------------------------------------------------------------
# apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_apply_rotary_pos_emb_matches_transformers(dtype, unsqueeze_dim, op_calls):
    B, S, H, Hk, D = 2, 37, 4, 2, 64
    g = torch.Generator().manual_seed(1)
    shape_q = (B, H, S, D) if unsqueeze_dim == 1 else (B, S, H, D)
    shape_k = (B, Hk, S, D) if unsqueeze_dim == 1 else (B, S, Hk, D)
    q0 = torch.randn(shape_q, generator=g).to(dtype)
    k0 = torch.randn(shape_k, generator=g).to(dtype)
    cos, sin = _hf_cos_sin(B, S, D, dtype, offset=3000)
    gq = torch.randn(shape_q, generator=g).to(dtype)
    gk = torch.randn(shape_k, generator=g).to(dtype)

    def run(fn, **kw):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        oq, ok = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, **kw)
        torch.autograd.backward([oq, ok], [gq, gk])
        return oq.detach(), ok.detach(), q.grad, k.grad

    theirs = run(HF_APPLY)
    ours = run(apply_rotary_pos_emb, position_ids=torch.arange(S))  # position_ids: accepted, unused
    assert len(op_calls) == 1  # forward through rope_ext's op (the backward runs the op's autograd)
    c64 = cos.double().unsqueeze(unsqueeze_dim)
    s64 = sin.double().unsqueeze(unsqueeze_dim)

    def exact(x, c, s):  # the formula in float64 on the same cos / sin values
        return x.double() * c + reference.rotate_half(x.double()) * s

    for o, t, x, c, s in (
        (ours[0], theirs[0], q0, c64, s64),
        (ours[1], theirs[1], k0, c64, s64),
        (ours[2], theirs[2], gq, c64, -s64),  # the gradient is the inverse rotation
        (ours[3], theirs[3], gk, c64, -s64),
    ):
        assert o.dtype == t.dtype == dtype and o.shape == t.shape
        ref = exact(x, c, s)
        assert_close_to_reference(o, ref, x.abs().max().item())  # ours: rounded once
        # transformers rounds each product and the sum in the dtype: within half an ulp of each term
        # and of the result from the exact value; ours within one ulp of the result.
        t1, t2 = (x.double() * c).abs(), (reference.rotate_half(x.double()) * s).abs()
        tol = ulp(t1, dtype) + ulp(t2, dtype) + 2 * ulp(ref, dtype)
        if dtype in (torch.float32, torch.float64):
            tol = tol + 1e-6 * x.abs().max().item()
        assert ((o.double() - t.double()).abs() <= tol).all()


def test_apply_rotary_pos_emb_general_cos_sin_equals_transformers_exactly():
    """cos / sin whose halves differ, or that need a gradient, take transformers' formula: bit-identical."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    for a, b in zip(apply_rotary_pos_emb(q, k, cos, sin), HF_APPLY(q, k, cos, sin), strict=True):
        assert torch.equal(a, b)
    c1 = cos.clone().requires_grad_()
    s1 = sin.clone().requires_grad_()
    c2 = cos.clone().requires_grad_()
    s2 = sin.clone().requires_grad_()
    sum(t.sum() for t in apply_rotary_pos_emb(q, k, c1, s1)).backward()
    sum(t.sum() for t in HF_APPLY(q, k, c2, s2)).backward()
    assert torch.equal(c1.grad, c2.grad) and torch.equal(s1.grad, s2.grad)


def test_apply_rotary_pos_emb_promotion_and_broadcast(op_calls):
    q = torch.randn(2, 4, 6, 16).bfloat16()
    k = torch.randn(2, 2, 6, 16).bfloat16()
    cos, sin = _hf_cos_sin(1, 6, 16, torch.float32)
    ours, theirs = apply_rotary_pos_emb(q, k, cos, sin), HF_APPLY(q, k, cos, sin)
    assert ours[0].dtype == theirs[0].dtype == torch.float32  # bf16 q * fp32 cos promotes, as in transformers
    assert torch.allclose(ours[0], theirs[0], atol=1e-6) and torch.allclose(ours[1], theirs[1], atol=1e-6)
    # [seq, head_dim] cos with unsqueeze_dim=0 broadcasts over batch and heads
    c2, s2 = cos[0], sin[0]
    ours, theirs = (
        apply_rotary_pos_emb(q.float(), k.float(), c2, s2, unsqueeze_dim=0),
        HF_APPLY(q.float(), k.float(), c2, s2, unsqueeze_dim=0),
    )
    assert torch.allclose(ours[0], theirs[0], atol=1e-6) and torch.allclose(ours[1], theirs[1], atol=1e-6)
    assert len(op_calls) == 2


# ---------------------------------------------------------------------------------------------
# patch_transformers on tiny random models


def _tiny(kind: str, rope_parameters: dict | None = None, max_pos: int = 256):
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=max_pos,
        attn_implementation="sdpa",
    )
    if rope_parameters is not None:
        common["rope_parameters"] = rope_parameters
    cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    return cls[1](cls[0](**common))


def _logits_and_grads(model, ids, positions=None, run=None):
    """Logits of ``run`` (default: ``model``; e.g. its compiled form) and ``model``'s gradients of a loss."""
    model.zero_grad(set_to_none=True)
    out = (model if run is None else run)(ids, position_ids=positions).logits
    out.float().square().mean().backward()
    return out.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _assert_match(a, b, rtol):
    (la, ga), (lb, gb) = a, b
    scale = la.float().abs().max()
    assert (la.float() - lb.float()).abs().max() <= rtol * scale
    assert ga.keys() == gb.keys()
    for n in ga:
        s = ga[n].float().abs().max().clamp_min(1e-30)
        assert (ga[n].float() - gb[n].float()).abs().max() <= rtol * s, n


@pytest.fixture
def restore_transformers():
    patched = []
    yield patched
    for m in patched:
        unpatch_transformers(m)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_patch_transformers_logits_and_gradients(kind, restore_transformers):
    model = _tiny(kind)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.stack([torch.arange(24), torch.arange(100, 124)])  # second row: after a cache
    ref = _logits_and_grads(model, ids, positions)
    modeling = type(model).__module__
    patch_transformers(model)
    restore_transformers.append(model)
    assert isinstance(model.model.rotary_emb, compat.HFRotaryAdapter)
    assert getattr(__import__(modeling, fromlist=["x"]).apply_rotary_pos_emb, "_rope_ext", False)
    _assert_match(_logits_and_grads(model, ids, positions), ref, rtol=2e-5)
    unpatch_transformers(model)
    restore_transformers.clear()
    assert not isinstance(model.model.rotary_emb, compat.HFRotaryAdapter)
    assert not getattr(__import__(modeling, fromlist=["x"]).apply_rotary_pos_emb, "_rope_ext", False)
    _assert_match(_logits_and_grads(model, ids, positions), ref, rtol=0)


def test_patch_transformers_bf16(restore_transformers):
    model = _tiny("llama").to(torch.bfloat16)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    ref = _logits_and_grads(model, ids)
    patch_transformers(model)
    restore_transformers.append(model)
    assert model.model.rotary_emb._tables["main"].dtype == torch.float32
    # bf16 has 8 bits: rounding differences of one ulp in q / k (ours rounds once) propagate through two
    # layers; 1/16 of the largest value is a few bf16 ulps of it.
    got = _logits_and_grads(model, ids)
    _assert_match(got, ref, rtol=1 / 16)
    clone = copy.deepcopy(model)  # a patched model copies like any other
    assert torch.equal(clone(ids).logits, got[0])


SCALED = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
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


@pytest.mark.parametrize("variant", list(SCALED))
def test_patch_transformers_scaled_variants(variant, restore_transformers):
    """Length-dependent variants follow transformers' per-call rule: a long call (past the trained
    length), a short one (back under it), then a long one again."""
    model = _tiny("llama", rope_parameters=dict(SCALED[variant]), max_pos=32)
    g = torch.Generator().manual_seed(5)
    calls = [torch.randint(0, 96, (1, n), generator=g) for n in (40, 12, 40)]
    refs = [_logits_and_grads(model, ids) for ids in calls]
    patch_transformers(model)
    restore_transformers.append(model)
    for ids, ref in zip(calls, refs, strict=True):
        _assert_match(_logits_and_grads(model, ids), ref, rtol=2e-5)


def _recording_backend(graphs):
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_patched_model_compiles_fullgraph(kind, restore_transformers):
    model = _tiny(kind)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(6))
    ref = _logits_and_grads(model, ids)
    patch_transformers(model)
    restore_transformers.append(model)
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
    got = _logits_and_grads(model, ids, run=compiled)
    _assert_match(got, ref, rtol=2e-5)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("rope_ext" in t for t in targets), "rope_ext's op is not in the compiled graph"
    torch._dynamo.reset()


def test_patch_transformers_rejects_other_models():
    class Fake(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    with pytest.raises(
        TypeError, match=r"supports model_type in \['llama', 'mistral', 'qwen2', 'qwen2_vl', .*\], got 'gpt2'"
    ):
        patch_transformers(Fake())


# ---------------------------------------------------------------------------------------------
# vLLM


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
@pytest.mark.parametrize("with_key", [True, False])
def test_vllm_rotary_embedding(is_neox, rot_dim, with_key):
    T, H, Hk, D = 13, 4, 2, 64
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g)
    query, key = qkv[:, : H * D], qkv[:, H * D : (H + Hk) * D]  # slices of a packed QKV: token stride 8D
    q0, k0 = query.clone(), key.clone()
    positions = torch.randint(0, 5000, (T,), generator=g)
    cache = rope_ext.RopeCache(rot_dim, 1e4, max_positions=5000).cos_sin
    out = rotary_embedding(positions, query, key if with_key else None, D, cache, is_neox)
    assert out is None
    pos = positions[:, None]
    ref_q = reference.rotary_hadamard(q0.view(T, H, D), pos, cache, interleaved=not is_neox).view(T, H * D)
    assert_close_to_reference(query, ref_q, q0.abs().max().item())
    if with_key:
        ref_k = reference.rotary_hadamard(k0.view(T, Hk, D), pos, cache, interleaved=not is_neox).view(
            T, Hk * D
        )
        assert_close_to_reference(key, ref_k, k0.abs().max().item())
    else:
        assert torch.equal(key, k0)
    assert torch.equal(qkv[:, (H + Hk) * D :], qkv[:, (H + Hk) * D :].clone())  # values untouched


def test_vllm_rotary_embedding_batched_and_bf16_cache():
    B, S, H, D = 2, 5, 3, 32
    q = torch.randn(B, S, H * D, dtype=torch.bfloat16)
    q0 = q.clone()
    positions = torch.arange(B * S).view(B, S)
    cache = rope_ext.RopeCache(
        D, max_positions=64, dtype=torch.bfloat16
    ).cos_sin  # the query's dtype: used as is
    rotary_embedding(positions, q, None, D, cache, True)
    ref = reference.rotary_hadamard(q0.view(B, S, H, D), positions[..., None], cache).view(B, S, H * D)
    assert_close_to_reference(q, ref, q0.abs().max().item())
    with pytest.raises(ValueError, match="expected"):
        rotary_embedding(positions, q.view(-1), None, D, cache, True)


# ---------------------------------------------------------------------------------------------
# labml-style module and Meta's complex form


def test_rotary_positional_embeddings_seq_first():
    S, B, H, F, d = 300, 2, 3, 24, 16
    x = torch.randn(S, B, H, F, requires_grad=True)
    m = RotaryPositionalEmbeddings(d)
    y = m(x)
    table = reference.cos_sin_table(S, d, 10000.0)
    ref = reference.rotary_hadamard(x.detach(), torch.arange(S)[:, None, None], table)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close_to_reference(y.detach(), ref, x.abs().max().item())
    assert torch.equal(y[..., d:], x[..., d:])
    y.sum().backward()
    gref = reference.rotary_hadamard(torch.ones_like(x), torch.arange(S)[:, None, None], table, inverse=True)
    assert_close_to_reference(x.grad, gref, 1.0)
    # shorter input after a longer one, other dtype
    y2 = m(x.detach()[:7].bfloat16())
    assert y2.dtype == torch.bfloat16
    assert_close_to_reference(
        y2, reference.rotary_hadamard(x.detach()[:7].bfloat16(), torch.arange(7)[:, None, None], table), 4.0
    )


def test_meta_complex_form():
    B, S, H, Hk, D = 2, 9, 4, 2, 32
    freqs_cis = precompute_freqs_cis(D, 2 * S, theta=5e5)
    angles = torch.outer(torch.arange(2 * S, dtype=torch.float64), reference.inv_freq(D, 5e5))
    assert freqs_cis.dtype == torch.complex64
    assert (
        freqs_cis.to(torch.complex128) - torch.polar(torch.ones_like(angles), angles)
    ).abs().max() < 1.2e-7
    fc = freqs_cis[4 : 4 + S]  # Meta slices freqs_cis[start_pos : start_pos + seqlen]
    xq = torch.randn(B, S, H, D, dtype=torch.bfloat16)
    xk = torch.randn(B, S, Hk, D, dtype=torch.bfloat16)
    oq, ok = apply_rotary_emb(xq, xk, fc)
    assert oq.dtype == ok.dtype == torch.bfloat16

    def complex_form(x):  # Meta's definition: pairs (2j, 2j+1) as complex numbers times freqs_cis
        z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * fc.to(torch.complex128)[None, :, None, :]).flatten(3)

    assert_close_to_reference(oq, complex_form(xq), xq.abs().max().item())
    assert_close_to_reference(ok, complex_form(xk), xk.abs().max().item())
    fcg = fc.clone().requires_grad_()
    oq2, _ = apply_rotary_emb(xq.float(), xk.float(), fcg)  # freqs_cis with grad: the complex formula
    oq2.abs().sum().backward()
    assert fcg.grad is not None
    with pytest.raises(ValueError, match="freqs_cis"):
        apply_rotary_emb(xq, xk, freqs_cis)

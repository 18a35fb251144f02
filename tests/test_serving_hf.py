"""``patch_transformers`` fuses Qwen3's per-head q / k RMSNorm with the rotation (one
``rope_ext.apply_qk_norm_rotary`` call per layer): logits and gradients match the unpatched model, eagerly and
compiled, with unchanged state dict keys; unpatching restores the model bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from rope_ext.compat import patch_transformers, unpatch_transformers
from rope_ext.compat.hf import qk_norm as hf_qk_norm

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL))
    else:
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        )
    with torch.no_grad():  # non-trivial norm weights: the fused op must use them
        for m in model.modules():
            if hasattr(m, "q_norm"):
                m.q_norm.weight.normal_()
                m.k_norm.weight.normal_()
    return model.float()


def _run(model, ids, runner=None):
    model.zero_grad()
    out = (model if runner is None else runner)(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_fused_qk_norm_matches_unpatched(kind, monkeypatch):
    model = _model(kind)
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _run(model, ids)
    keys = list(model.state_dict())
    patch_transformers(model)
    layers = [m for m in model.modules() if hasattr(m, "q_norm")]
    assert all(isinstance(m.q_norm, hf_qk_norm._DeferredNorm) for m in layers)
    assert list(model.state_dict()) == keys
    calls = []
    fused = hf_qk_norm.apply_qk_norm_rotary
    monkeypatch.setattr(hf_qk_norm, "apply_qk_norm_rotary", lambda *a, **k: calls.append(1) or fused(*a, **k))
    logits, grads = _run(model, ids)
    assert len(calls) == len(layers)  # one fused call per attention layer
    # float32: the fused norm rounds once where HF rounds after the norm and after the weight (1e-6 level)
    assert _rel(logits, ref_logits) <= 2e-5
    assert grads.keys() == ref_grads.keys()
    assert max(_rel(grads[n], ref_grads[n]) for n in grads) <= 1e-4
    monkeypatch.undo()
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    logits_c, grads_c = _run(model, ids, runner=compiled)
    assert len(graphs) == 1
    assert any("qk_norm_rotary" in str(n.target) for n in graphs[0].graph.nodes)
    assert _rel(logits_c, ref_logits) <= 2e-5
    assert max(_rel(grads_c[n], ref_grads[n]) for n in grads_c) <= 1e-4
    torch._dynamo.reset()
    unpatch_transformers(model)
    assert not any(isinstance(m.q_norm, hf_qk_norm._DeferredNorm) for m in layers)
    again, _ = _run(model, ids)
    assert torch.equal(again, ref_logits)


def test_fuse_qk_norm_off_and_norm_outside_attention():
    model = _model("qwen3")
    patch_transformers(model, fuse_qk_norm=False)
    attn = model.model.layers[0].self_attn
    assert not isinstance(attn.q_norm, hf_qk_norm._DeferredNorm)
    unpatch_transformers(model)
    patch_transformers(model)
    # called outside its attention's forward, a deferred norm is the original norm
    x = torch.randn(3, 32)
    assert torch.equal(attn.q_norm(x), attn.q_norm.original(x))
    unpatch_transformers(model)


def test_bf16_logits_within_an_ulp_level():
    model = _model("qwen3").to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits.float()
        patch_transformers(model)
        got = model(ids).logits.float()
    unpatch_transformers(model)
    # bf16: the norm output rounded once (HF: twice) and float32 rotation: a few bf16 ulps in the logits
    assert _rel(got, ref) <= 2e-2

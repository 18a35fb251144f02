"""rope_ext.RotaryEmbedding: layout, positions, offset, in place, growth, dtype handling, compile."""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close_to_reference
from transformers import LlamaConfig

import rope_ext
from rope_ext import RopeCache, RotaryEmbedding, reference


def _qk(B, S, H, Hk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, D, generator=g).to(dtype), torch.randn(B, S, Hk, D, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_forward_offset_matches_reference(dtype, interleaved, rotary_dim):
    m = RotaryEmbedding(64, rotary_dim=rotary_dim, base=5e5, interleaved=interleaved, max_positions=64)
    q, k = _qk(2, 9, 4, 2, 64, dtype)
    oq, ok = m(q, k, offset=50)  # positions 50..58: past max_positions, the table grows
    assert m.cache.capacity >= 59
    pos = torch.arange(50, 59)[:, None]
    table = reference.cos_sin_table(59, rotary_dim or 64, 5e5)
    for o, x in ((oq, q), (ok, k)):
        assert o.dtype == dtype and o.shape == x.shape
        assert_close_to_reference(
            o, reference.rotary_hadamard(x, pos, table, interleaved=interleaved), x.abs().max().item()
        )


def test_per_token_positions_and_unbatched_layout():
    m = RotaryEmbedding(32, max_positions=128)
    q, k = _qk(2, 5, 3, 1, 32)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 7, 8, 9]])  # second row: left padding
    oq, ok = m(q, k, positions)
    ref = reference.rotary_hadamard(q, positions[..., None], m.cos_sin())
    assert_close_to_reference(oq, ref, q.abs().max().item())
    # [seq, heads, head_dim]: token s at offset + s
    oq3, ok3 = m(q[1], k[1], offset=3)
    assert_close_to_reference(
        oq3, reference.rotary_hadamard(q[1], torch.arange(3, 8)[:, None], m.cos_sin()), 4.0
    )
    # positions [seq] for the unbatched layout, and shared by the batch
    oq4, _ = m(q[1], k[1], torch.arange(3, 8))
    assert torch.equal(oq4, oq3)
    oq5, _ = m(q, k, torch.arange(3, 8))
    assert torch.equal(oq5, m(q, k, offset=3)[0])


def test_inplace_and_gradients():
    m = RotaryEmbedding(64, max_positions=32)
    q, k = _qk(1, 7, 2, 2, 64)
    out_q, out_k = m(q, k, offset=4)
    q2, k2 = q.clone(), k.clone()
    rq, rk = m(q2, k2, offset=4, inplace=True)
    assert rq is q2 and rk is k2 and torch.equal(q2, out_q) and torch.equal(k2, out_k)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    a, b = m(qg, kg, offset=4)
    (a.square().sum() + b.sum()).backward()
    pos = torch.arange(4, 11)[:, None]
    assert_close_to_reference(
        qg.grad,
        reference.rotary_hadamard(2 * out_q, pos, m.cos_sin(), inverse=True),
        2 * out_q.abs().max().item(),
    )
    assert_close_to_reference(
        kg.grad, reference.rotary_hadamard(torch.ones_like(k), pos, m.cos_sin(), inverse=True), 1.0
    )


def test_module_to_lower_dtype_keeps_float32_table():
    m = RotaryEmbedding(64, max_positions=16).to(torch.bfloat16)
    assert m.cos_sin().dtype == torch.float32 and m.cache.cos_sin.dtype == torch.float32
    m.half().double()
    assert m._table.dtype == torch.float32
    assert "cos_sin" not in dict(m.named_buffers()) and not list(m.state_dict())
    q, k = _qk(1, 4, 2, 2, 64, torch.bfloat16)
    assert m(q, k)[0].dtype == torch.bfloat16


def test_from_hf_config():
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    m = RotaryEmbedding.from_hf_config(cfg, max_positions=64)
    assert m.head_dim == 128 and m.rotary_dim == 128 and m.cache.capacity == 64
    assert torch.equal(m.cache.inv_freq, RopeCache.from_hf_config(cfg, max_positions=64).inv_freq)
    partial = RotaryEmbedding.from_hf_config({"head_dim": 80, "partial_rotary_factor": 0.4})
    assert (partial.head_dim, partial.rotary_dim) == (80, 32)


def test_compiles_fullgraph_without_growth():
    m = RotaryEmbedding(64, max_positions=64)
    q, k = _qk(2, 8, 4, 2, 64)

    def attn_scores(q, k, positions):
        q, k = m(q, k, positions)
        return torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(2, dim=2))

    positions = torch.arange(8).expand(2, 8)
    expected = attn_scores(q, k, positions)
    torch._dynamo.reset()
    compiled = torch.compile(attn_scores, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, positions), expected, atol=1e-5)
    compiled_offset = torch.compile(lambda q, k: m(q, k, offset=3), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled_offset(q, k)[0], m(q, k, offset=3)[0])
    torch._dynamo.reset()


def test_bad_input():
    m = RotaryEmbedding(64, max_positions=8)
    q, k = _qk(1, 4, 2, 2, 64)
    with pytest.raises(ValueError, match="head_dim = 64"):
        m(q[..., :32], k[..., :32])
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        m(q[0, 0], k[0, 0])
    with pytest.raises(IndexError):  # explicit positions are not scanned; the CPU op checks them
        m(q, k, torch.tensor([[0, 1, 2, 100]]))
    with pytest.raises(ValueError, match="unknown RoPE scaling"):
        RotaryEmbedding(64, scaling={"rope_type": "nope"})
    assert isinstance(rope_ext.RotaryEmbedding(8).cache, RopeCache)


def test_dynamic_ntk_keyed_on_requested_length_through_the_module():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    m = RotaryEmbedding(32, scaling=scaling, max_positions=16)
    q, k = _qk(1, 4, 2, 2, 32)
    m(q, k, offset=14)  # 18 positions: capacity 32, base keyed on 18
    assert m.cache.capacity == 32 and m.cache.seq_len == 18
    m(q, k, offset=16)  # 20 <= capacity, but a new largest length: the base follows it
    assert m.cache.seq_len == 20
    fresh = RopeCache(32, scaling=scaling, max_positions=20)
    assert torch.equal(m.cos_sin()[:20], fresh.cos_sin)

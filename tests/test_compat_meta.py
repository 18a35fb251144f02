"""``rope_ext.compat.apply_rotary_emb`` (Meta's complex form) against transformers' Llama 4
``apply_rotary_emb`` (per-batch ``freqs_cis [batch, seq, head_dim/2]`` from ``Llama4TextRotaryEmbedding``)
and against Meta's reference (``[seq, head_dim/2]`` through ``reshape_for_broadcast``), for every shape
those forms take, with the project's accuracy contract against the float64 complex product of the same
``freqs_cis``."""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close_to_reference
from transformers import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as hf_llama4_apply

from rope_ext.compat import apply_rotary_emb, precompute_freqs_cis

B, S, H, HK, D = 3, 7, 4, 2, 64


def meta_reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Meta's Llama ``reshape_for_broadcast`` (llama/model.py), transcribed."""
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def meta_apply_rotary_emb(xq, xk, freqs_cis):
    """Meta's Llama ``apply_rotary_emb`` (llama/model.py), transcribed."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = meta_reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def exact(x: torch.Tensor, f4: torch.Tensor) -> torch.Tensor:
    """float64 reference: pairs (2j, 2j+1) of x as complex128 times the given freqs_cis ([b, s, h, d/2])."""
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * f4.to(torch.complex128)).flatten(3)


def llama4_freqs_cis(position_ids: torch.Tensor, rope_parameters: dict) -> torch.Tensor:
    """transformers' Llama 4 rotary embedding: complex64 ``[batch, seq, head_dim/2]``."""
    cfg = Llama4TextConfig(
        hidden_size=D * H,
        num_attention_heads=H,
        num_key_value_heads=HK,
        head_dim=D,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_parameters),
    )
    rope = Llama4TextRotaryEmbedding(cfg)
    return rope(torch.zeros(1), position_ids)


LLAMA4_SCOUT = {  # Llama-4-Scout's published rope settings
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
YARN = {  # attention scaling != 1: |freqs_cis| != 1
    "rope_type": "yarn",
    "rope_theta": 5e5,
    "factor": 8.0,
    "original_max_position_embeddings": 16384,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rope", ["scout", "yarn"])
def test_llama4_per_batch_freqs_cis_matches_transformers(dtype, rope):
    torch.manual_seed(0)
    # A different offset per sequence (left padding, packed or continued batches).
    position_ids = torch.arange(S)[None, :] + torch.tensor([[0], [5], [40000]])
    fc = llama4_freqs_cis(position_ids, LLAMA4_SCOUT if rope == "scout" else YARN)
    assert fc.shape == (B, S, D // 2) and fc.dtype == torch.complex64
    xq = torch.randn(B, S, H, D).to(dtype)
    xk = torch.randn(B, S, HK, D).to(dtype)
    oq, ok = apply_rotary_emb(xq, xk, fc)
    hq, hk = hf_llama4_apply(xq, xk, fc)
    assert oq.dtype == hq.dtype == dtype and ok.dtype == hk.dtype == dtype
    f4 = fc[:, :, None, :]
    scale = fc.abs().max().item()  # the attention scaling is in freqs_cis
    for ours, theirs, x in ((oq, hq, xq), (ok, hk, xk)):
        ref = exact(x, f4)
        assert_close_to_reference(ours, ref, x.abs().max().item() * scale)
        assert_close_to_reference(theirs, ref, x.abs().max().item() * scale)  # the reference is transformers'


def _shapes():
    # (id, freqs_cis shape as a function of the [B, S, D/2] rows, x batch, x seq)
    yield "meta_2d", lambda f: f[0], B, S
    yield "per_batch_3d", lambda f: f, B, S
    yield "batch1_3d", lambda f: f[:1], B, S
    yield "bcast_4d_1s1", lambda f: f[:1, :, None, :], B, S
    yield "per_batch_4d", lambda f: f[:, :, None, :], B, S
    yield "per_head_4d", lambda f: f[:, :, None, :].expand(B, S, HK, D // 2) * 1.0, B, S
    yield "decode_seq1_3d", lambda f: f[:, :1], B, 1
    yield "seq_broadcast_3d", lambda f: f[:, :1], B, S


@pytest.mark.parametrize("make,batch,seq", [s[1:] for s in _shapes()], ids=[s[0] for s in _shapes()])
def test_every_broadcastable_shape(make, batch, seq):
    torch.manual_seed(1)
    rows = llama4_freqs_cis(torch.arange(S)[None, :] + torch.tensor([[0], [9], [1000]]), LLAMA4_SCOUT)
    fc = make(rows)
    heads = HK if fc.dim() == 4 and fc.shape[2] == HK else H
    xq = torch.randn(batch, seq, heads, D)
    xk = torch.randn(batch, seq, HK, D)
    oq, ok = apply_rotary_emb(xq, xk, fc)
    f4 = fc[None, :, None, :] if fc.dim() == 2 else fc[:, :, None, :] if fc.dim() == 3 else fc
    for out, x in ((oq, xq), (ok, xk)):
        assert out.shape == x.shape
        assert_close_to_reference(out, exact(x, f4), x.abs().max().item())
    if fc.dim() == 2:  # Meta's own function takes exactly this shape
        mq, mk = meta_apply_rotary_emb(xq, xk, fc)
        assert_close_to_reference(mq, exact(xq, f4), xq.abs().max().item())
        assert_close_to_reference(oq, mq.double(), xq.abs().max().item())
    if fc.dim() == 3:  # transformers' Llama 4 function takes exactly this shape
        hq, hk = hf_llama4_apply(xq, xk, fc)
        assert_close_to_reference(oq, hq.double(), xq.abs().max().item())
        assert_close_to_reference(ok, hk.double(), xk.abs().max().item())


def test_meta_reference_with_precompute():
    """Meta's pipeline: ``precompute_freqs_cis``, then ``freqs_cis[start_pos : start_pos + seqlen]``."""
    torch.manual_seed(2)
    fc = precompute_freqs_cis(D, 64, theta=5e5)[10 : 10 + S]
    xq, xk = torch.randn(B, S, H, D, dtype=torch.bfloat16), torch.randn(B, S, HK, D, dtype=torch.bfloat16)
    oq, ok = apply_rotary_emb(xq, xk, fc)
    mq, mk = meta_apply_rotary_emb(xq, xk, fc)
    assert oq.dtype == mq.dtype == torch.bfloat16
    for ours, meta, x in ((oq, mq, xq), (ok, mk, xk)):
        ref = exact(x, fc[None, :, None, :])
        assert_close_to_reference(ours, ref, x.abs().max().item())
        assert_close_to_reference(meta, ref, x.abs().max().item())


def test_per_batch_gradients():
    torch.manual_seed(3)
    fc = llama4_freqs_cis(torch.arange(S)[None, :] + torch.tensor([[0], [3], [77]]), YARN)
    xq = torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True)
    xk = torch.randn(B, S, HK, D, dtype=torch.float64, requires_grad=True)
    gq, gk = torch.randn(B, S, H, D, dtype=torch.float64), torch.randn(B, S, HK, D, dtype=torch.float64)
    oq, ok = apply_rotary_emb(xq, xk, fc)
    torch.autograd.backward((oq, ok), (gq, gk))
    xq2, xk2 = xq.detach().clone().requires_grad_(), xk.detach().clone().requires_grad_()
    f4 = fc[:, :, None, :].to(torch.complex128)
    rq, rk = exact(xq2, f4), exact(xk2, f4)
    torch.autograd.backward((rq, rk), (gq, gk))
    assert_close_to_reference(xq.grad, xq2.grad, gq.abs().max().item() * fc.abs().max().item())
    assert_close_to_reference(xk.grad, xk2.grad, gk.abs().max().item() * fc.abs().max().item())
    # freqs_cis requiring grad: the complex formula, also per batch
    fcg = fc.clone().requires_grad_()
    oq3, _ = apply_rotary_emb(xq.detach().float(), xk.detach().float(), fcg)
    oq3.sum().backward()
    assert fcg.grad is not None and fcg.grad.shape == fc.shape


@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex")
def test_compiles_fullgraph_per_batch():
    fc = llama4_freqs_cis(torch.arange(S)[None, :] + torch.tensor([[0], [3], [77]]), LLAMA4_SCOUT)
    xq, xk = torch.randn(B, S, H, D), torch.randn(B, S, HK, D)
    eager = apply_rotary_emb(xq, xk, fc)
    compiled = torch.compile(apply_rotary_emb, fullgraph=True)(xq, xk, fc)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


@pytest.mark.parametrize(
    "shape",
    [(S + 1, D // 2), (B + 1, S, D // 2), (B, S, 3, D // 2), (B, S, D), (D // 2,), (1, B, S, 1, D // 2)],
    ids=["seq", "batch", "heads", "last", "rank1", "rank5"],
)
def test_bad_freqs_cis_raises(shape):
    xq, xk = torch.randn(B, S, H, D), torch.randn(B, S, HK, D)
    with pytest.raises(ValueError, match="freqs_cis"):
        apply_rotary_emb(xq, xk, torch.ones(shape, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex freqs_cis"):
        apply_rotary_emb(xq, xk, torch.ones(S, D // 2))

"""DeepSeek-V3's yarn table and MLA rotation against the installed transformers' own DeepSeek-V3 code.

``RopeCache.from_hf_config`` on a real ``DeepseekV3Config`` (the published checkpoint's RoPE settings:
``qk_rope_head_dim=64``, ``rope_theta=10000``, yarn ``factor=40``, ``original_max_position_embeddings=4096``,
``beta_fast=32``, ``beta_slow=1``, ``mscale = mscale_all_dim = 1``) gives the cos/sin of transformers'
``DeepseekV3RotaryEmbedding`` at every position ``0 .. 16384`` (well past the trained 4096), and
:func:`rope_ext.apply_mla_rotary_and_cache_` with that table rotates q's rope part and k_pe as transformers'
DeepSeek-V3 attention does.

**Pairing.** transformers' ``DeepseekV3Attention`` calls ``apply_rotary_pos_emb_interleave`` when
``config.rope_interleave`` (the default, True): the pairs are ``(x[2j], x[2j+1])`` (the checkpoints' weight
layout), and its result is written de-interleaved (``[rotated evens | rotated odds]``), a fixed permutation
of the features. rope_ext's ``interleaved=True`` rotates the same pairs in place (vLLM's DeepSeek models:
``is_neox_style=False``), so for DeepSeek pass ``interleaved=True`` and ``rotary_offset=qk_nope_head_dim``;
the two results are equal up to that permutation, applied to q and k alike, so every attention score
``q . k`` is the same. ``rope_interleave=False`` is transformers' half-split ``apply_rotary_pos_emb``:
``interleaved=False``, equal element for element.

**Tolerance** (float32, as derived in test_scaling.py): transformers forms the angle ``fl32(p * inv32_j)``
in float32, so at position ``p`` its cos/sin are off the exact values by up to ``A (a eps_inv + ulp32(a) / 2
+ 4 * 2**-24)`` with ``a = p inv_j`` the angle, ``eps_inv = 6 * 2**-24`` (d = 64 is a power of two: the
exponents ``2j/d`` are exact) and ``A`` the attention factor (1.0 here: mscale equals mscale_all_dim);
rope_ext's table is within an ulp of exact. Stated flat: every cos/sin entry within ``1e-3`` of transformers'
at positions up to 16384 (measured: 6e-4 at most, 1.3e-4 up to 4096; at most 0.42 of the element-wise bound,
which is checked too). A rotated feature
``x1 c - x2 s`` adds ``(|x1| + |x2|)`` times that, plus the float32 rounding of the products.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import ulp
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

import rope_ext
from rope_ext import RopeCache

EPS = 2.0**-24
ROPE, NOPE, LORA, HEADS = 64, 128, 512, 4  # qk_rope_head_dim, qk_nope_head_dim, kv_lora_rank, heads (TP)
MAX_POS = 16384
# The checkpoint's rope settings (config.json's rope_scaling), in the 5.x rope_parameters form.
DEEPSEEK_V3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def deepseek_config(rope_interleave: bool = True) -> DeepseekV3Config:
    """A tiny DeepseekV3Config (nothing downloaded) with the real model's attention and RoPE sizes."""
    return DeepseekV3Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=LORA,
        q_lora_rank=None,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=NOPE,
        max_position_embeddings=163840,
        rope_parameters=dict(DEEPSEEK_V3_ROPE),
        rope_interleave=rope_interleave,
    )


def _cos_sin_bound(cache: RopeCache, positions: torch.Tensor) -> torch.Tensor:
    """Element-wise bound ``[len(positions), ROPE / 2]`` on |rope_ext - transformers| (module doc)."""
    angle = positions.double()[:, None] * cache.inv_freq
    return cache.attention_factor * (angle * 6 * EPS + ulp(angle, torch.float32) / 2 + 4 * EPS)


@pytest.fixture(scope="module")
def tables():
    cfg = deepseek_config()
    cache = RopeCache.from_hf_config(cfg, max_positions=MAX_POS + 1)
    positions = torch.arange(MAX_POS + 1)
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    return cfg, cache, positions, hf_cos[0].double(), hf_sin[0].double()


def test_from_hf_config_builds_the_deepseek_v3_yarn_table(tables):
    cfg, cache, positions, hf_cos, hf_sin = tables
    # rotary_dim is qk_rope_head_dim (transformers' DeepseekV3Config sets head_dim to it), not
    # hidden_size / heads or qk_nope + qk_rope
    assert cfg.head_dim == ROPE and cache.rotary_dim == ROPE and cache.rope_type == "yarn"
    assert cache.cos_sin.shape == (MAX_POS + 1, ROPE) and cache.cos_sin.dtype == torch.float32
    hf = DeepseekV3RotaryEmbedding(cfg)
    assert cache.attention_factor == hf.attention_scaling == 1.0  # mscale / mscale_all_dim = 1
    rel = (hf.inv_freq.double() - cache.inv_freq).abs() / cache.inv_freq
    assert rel.max() <= 6 * EPS, rel.max()

    h = ROPE // 2
    assert torch.equal(hf_cos[:, :h], hf_cos[:, h:]) and torch.equal(hf_sin[:, :h], hf_sin[:, h:])
    ours = cache.cos_sin.double()
    bound = _cos_sin_bound(cache, positions)
    for mine, theirs in ((ours[:, :h], hf_cos[:, :h]), (ours[:, h:], hf_sin[:, :h])):
        err = (mine - theirs).abs()
        assert err.max() <= 1e-3, err.max()  # the stated float32 tolerance
        assert (err <= bound).all(), f"ratio {(err / bound).max():.3g}"
    # yarn, not plain RoPE: the low frequencies are interpolated (divided by factor 40)
    plain = rope_ext.reference.inv_freq(ROPE, 1e4)
    assert torch.allclose(cache.inv_freq[-1], plain[-1] / 40, rtol=1e-12)
    assert torch.equal(cache.inv_freq[0], plain[0])


def test_from_hf_config_plain_config_json_dict():
    legacy = {
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {k: v for k, v in DEEPSEEK_V3_ROPE.items() if k not in ("rope_type", "rope_theta")}
        | {"type": "yarn"},
    }
    assert RopeCache.from_hf_config({**legacy, "head_dim": ROPE}, max_positions=8).rotary_dim == ROPE
    assert RopeCache.from_hf_config(legacy, max_positions=8).rotary_dim == ROPE


def _mla_inputs(positions: torch.Tensor):
    g = torch.Generator().manual_seed(7)
    T = len(positions)
    q = torch.randn(T, HEADS, NOPE + ROPE, generator=g)
    kv = torch.randn(T, LORA + ROPE, generator=g)  # kv_a_proj's output: [kv_c | k_pe], views of it
    return q, kv[:, :LORA], kv[:, LORA:]


@pytest.mark.parametrize("rope_interleave", [True, False], ids=["rope_interleave", "half_split"])
def test_mla_op_rotates_like_transformers_deepseek_v3(tables, rope_interleave):
    _, cache, _, _, _ = tables
    cfg = deepseek_config(rope_interleave)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 4097, 8191, 9000, 12345, 16383, MAX_POS])
    T = len(positions)
    q, kv_c, k_pe = _mla_inputs(positions)
    q0, k_pe0 = q.clone(), k_pe.clone()

    # transformers: DeepseekV3Attention's split, its rotary module and the apply function it picks
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(q, positions[None])
    q_rot = q[:, :, NOPE:].transpose(0, 1)[None]  # [batch 1, heads, seq, rope]
    k_rot = k_pe[None, None]  # [batch 1, 1, seq, rope]
    hf_apply = apply_rotary_pos_emb_interleave if cfg.rope_interleave else apply_rotary_pos_emb
    hf_q, hf_k = hf_apply(q_rot, k_rot, cos, sin)
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0, 0]  # back to [T, heads, rope], [T, rope]

    # rope_ext: the MLA op with the DeepSeek call (rotary_offset = qk_nope_head_dim), cache of 4 x 4 slots
    kv_cache = torch.zeros(4, 4, LORA + ROPE)
    slots = torch.randperm(16, generator=torch.Generator().manual_seed(3))[:T]
    interleaved = cfg.rope_interleave  # DeepSeek's checkpoints: True
    rope_ext.apply_mla_rotary_and_cache_(
        q, kv_c, k_pe, positions, cache.cos_sin, kv_cache, slots, rotary_offset=NOPE, interleaved=interleaved
    )

    def as_hf(x: torch.Tensor) -> torch.Tensor:  # transformers' interleaved form writes de-interleaved
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if interleaved else x

    def pair_mag(x: torch.Tensor) -> torch.Tensor:  # |x1| + |x2| of each pair, in transformers' order
        x = x.double()
        a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : ROPE // 2], x[..., ROPE // 2 :])
        return torch.cat([a.abs() + b.abs()] * 2, dim=-1)

    tol = _cos_sin_bound(cache, positions) + 4 * EPS * cache.attention_factor
    tol = torch.cat([tol, tol], dim=-1)  # [T, ROPE]
    for mine, theirs, x in (
        (q[:, :, NOPE:], hf_q, q0[:, :, NOPE:]),
        (k_pe, hf_k, k_pe0),
    ):
        bound = pair_mag(x) * (tol[:, None] if x.dim() == 3 else tol)
        err = (as_hf(mine).double() - theirs.double()).abs()
        assert (err <= bound).all(), f"ratio {(err / bound).max():.3g}"
        assert err.max() <= 1e-3 * x.abs().max()
    assert torch.equal(q[:, :, :NOPE], q0[:, :, :NOPE])  # the nope part is not touched
    # attention scores q_rope . k_rope: the same whichever feature order (transformers' or the cache's)
    scores = torch.einsum("thr,tr->th", q[:, :, NOPE:].double(), k_pe.double())
    hf_scores = torch.einsum("thr,tr->th", hf_q.double(), hf_k.double())
    assert torch.allclose(scores, hf_scores, rtol=0, atol=1e-3 * hf_scores.abs().max())
    # the cache rows: kv_c then the rotated k_pe exactly as left in k_pe (the cache's layout is rope_ext's)
    rows = kv_cache.view(-1, LORA + ROPE)[slots]
    assert torch.equal(rows, torch.cat([kv_c, k_pe], dim=-1))

    # the other pairing is a different rotation: wrong by O(1) past position 0
    q1, k1 = q0.clone(), k_pe0.clone()
    other = dict(rotary_offset=NOPE, interleaved=not interleaved)
    rope_ext.apply_mla_rotary_and_cache_(q1, kv_c, k1, positions, cache.cos_sin, kv_cache, slots, **other)
    assert (as_hf(k1)[1:] - hf_k[1:]).abs().max() > 0.1

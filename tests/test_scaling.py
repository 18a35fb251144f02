"""Scaling variants against the installed transformers (real components: its rope init functions, its
rotary embedding modules and its apply functions), for the rope settings of the models in MODELS (from
their published Hugging Face configs) and the edge cases, plus worked yarn correction ranges.

Tolerances are derived from transformers' float32 arithmetic, not guessed:

* ``inv_freq``: transformers forms the exponent ``2j/d`` in float32 (error ``de_j = |fl32(2j/d) - 2j/d|``,
  zero when ``d`` is a power of two), raises the base with float32 ``pow`` (<= 1 ulp), takes a reciprocal
  and scales (<= 0.5 ulp each; yarn / llama3 blend two such values: a few ulps more). So
  ``|rel err| <= ln(base) * de_j + 6 * 2**-24`` (``EPS_OPS``).
* cos/sin at position ``p``: transformers' angle is ``fl32(p * inv32_j)``, off from the exact angle
  ``a = p * inv_j`` by ``a * rel_err(inv_j) + ulp32(a) / 2``; its float32 cos/sin add ~1 ulp, the
  attention factor ``A`` multiplies everything and one more rounding. Ours is within 1 ulp of exact. So
  ``|ours - theirs| <= A * (a * rel_tol_j + ulp32(a) / 2 + 4 * 2**-24)`` element-wise. At p=131071 the
  angle term dominates: e.g. Llama-3.1 j=1 ``a ~ 1.1e5``, ``ulp32(a)/2 = 3.9e-3``.
* rotated q/k: each output is ``x1 c - x2 s`` (or ``x2 c + x1 s``): ``(|x1| + |x2|) * tol_cs`` plus the
  float32 rounding of the products and sum, ``4 * 2**-24 * A * (|x1| + |x2|)``.

Measured (this transformers version): cos/sin differ from transformers by up to 3.4e-3 (Llama-3.1),
5.4e-3 (Qwen2.5 yarn), 1.1e-2 (Phi-3 long factors) at p=131071, 6e-8..1.2e-7 at p=1; the largest
error is 0.76 of its bound (Llama-3.1), so the bounds are tight, not loose. Failures report the ratio.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import ulp
from transformers import GPTNeoXConfig, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as hf_apply_partial

import rope_ext
from rope_ext import RopeCache
from rope_ext.cache import cos_sin_rows
from rope_ext.scaling import yarn_correction_range, yarn_get_mscale

POSITIONS = [0, 1, 2047, 2049, 4095, 32767, 65537, 131071]
EPS = 2.0**-24
EPS_OPS = 6 * EPS


def _longrope_factors(n: int) -> tuple[list[float], list[float]]:
    # Shaped like Phi-3-mini-128k's lists: short close to 1, long rising to ~50 (values synthetic).
    short = [1.0 + 0.1 * j / (n - 1) for j in range(n)]
    long = [1.0 + 49.0 * (j / (n - 1)) ** 3 for j in range(n)]
    return short, long


_S48, _L48 = _longrope_factors(48)

# name: (head_dim, rotary_dim, rope_theta, rope parameters (5.x form, no theta), max_position_embeddings)
MODELS = {
    "llama2_7b": (128, 128, 1e4, {"rope_type": "default"}, 4096),
    "codellama_7b": (128, 128, 1e6, {"rope_type": "default"}, 16384),
    "llama3_8b": (128, 128, 5e5, {"rope_type": "default"}, 8192),
    "llama3.1_8b": (
        128,
        128,
        5e5,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
    ),
    "llama3.2_1b": (
        64,
        64,
        5e5,
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
    ),
    "mistral_7b": (128, 128, 1e4, {"rope_type": "default"}, 32768),
    "qwen2_7b": (128, 128, 1e6, {"rope_type": "default"}, 32768),
    "qwen2.5_7b_yarn": (
        128,
        128,
        1e6,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        131072,
    ),
    "gpt_neox_20b": (96, 24, 1e4, {"rope_type": "default"}, 2048),
    "pythia_6.9b": (128, 32, 1e4, {"rope_type": "default"}, 2048),
    "gptj_6b": (256, 64, 1e4, {"rope_type": "default"}, 2048),
    "phi2": (80, 32, 1e4, {"rope_type": "default"}, 2048),
    "phi3_mini_128k": (
        96,
        96,
        1e4,
        {
            "rope_type": "longrope",
            "short_factor": _S48,
            "long_factor": _L48,
            "original_max_position_embeddings": 4096,
        },
        131072,
    ),
    "deepseek_v3": (
        64,
        64,
        1e4,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        163840,
    ),
    "gpt_oss_20b": (
        64,
        64,
        1.5e5,
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        131072,
    ),
    "gemma2_9b": (256, 256, 1e4, {"rope_type": "default"}, 8192),
    "stablelm_3b": (80, 20, 1e4, {"rope_type": "default"}, 4096),
    # edge cases and the remaining variants
    "llama4_low_eq_high": (
        128,
        128,
        5e5,
        {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        131072,
    ),
    "yarn_explicit_attention": (
        128,
        128,
        1e6,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16384,
            "attention_factor": 1.25,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        131072,
    ),
    "yarn_mscale_differs": (
        64,
        64,
        1e4,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        163840,
    ),
    "linear_x4": (128, 128, 1e4, {"rope_type": "linear", "factor": 4.0}, 16384),
    "dynamic_x2": (128, 128, 1e4, {"rope_type": "dynamic", "factor": 2.0}, 4096),
    "dynamic_partial": (80, 32, 1e4, {"rope_type": "dynamic", "factor": 4.0}, 2048),
}
INTERLEAVED = {"gptj_6b", "deepseek_v3"}


def hf_config(name: str) -> GPTNeoXConfig:
    """A transformers config with this model's RoPE settings (GPT-NeoX's classes read every variant
    and the partial rotary factor)."""
    head_dim, rotary_dim, theta, params, mpe = MODELS[name]
    params = dict(params, rope_theta=theta, partial_rotary_factor=rotary_dim / head_dim)
    return GPTNeoXConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
        max_position_embeddings=mpe,
        rope_parameters=params,
    )


def hf_inv_freq_and_attention(config, seq_len: int | None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def inv_rel_tol(rotary_dim: int, base: float) -> torch.Tensor:
    """Bound on transformers' float32 ``inv_freq`` relative error, per frequency (see module doc)."""
    e = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    de = (e.float().double() - e).abs()
    return math.log(base) * de + EPS_OPS


def effective_base(name: str, seq_len: int) -> float:
    head_dim, rotary_dim, theta, params, mpe = MODELS[name]
    if params["rope_type"] == "dynamic" and seq_len > mpe:
        f = params["factor"]
        return theta * ((f * seq_len / mpe) - (f - 1)) ** (rotary_dim / (rotary_dim - 2))
    return theta


def ulp32(t: torch.Tensor) -> torch.Tensor:
    return ulp(t, torch.float32)


def _seq_len_cases(name: str) -> list[int]:
    rope_type = MODELS[name][3]["rope_type"]
    if rope_type == "longrope":
        return [4096, 131072]  # short factors, then long ones
    if rope_type == "dynamic":
        return [MODELS[name][4], 131072]
    return [131072]


CASES = [(name, n) for name in MODELS for n in _seq_len_cases(name)]


@pytest.mark.parametrize("name,seq_len", CASES, ids=[f"{n}-L{s}" for n, s in CASES])
def test_inv_freq_and_attention_factor_match_transformers(name, seq_len):
    config = hf_config(name)
    hf_inv, hf_attn = hf_inv_freq_and_attention(config, seq_len)
    length_dependent = MODELS[name][3]["rope_type"] in ("dynamic", "longrope")
    cache = RopeCache.from_hf_config(config, max_positions=seq_len if length_dependent else 16)
    assert cache.rotary_dim == MODELS[name][1]
    ours = cache.inv_freq
    assert ours.dtype == torch.float64 and ours.shape == hf_inv.shape
    rel = (hf_inv.double() - ours).abs() / ours
    tol = inv_rel_tol(cache.rotary_dim, effective_base(name, seq_len))
    assert (rel <= tol).all(), f"worst rel err {rel.max():.3g}, ratio {(rel / tol).max():.3g}"
    assert math.isclose(cache.attention_factor, float(hf_attn), rel_tol=1e-12)


@pytest.mark.parametrize("name,seq_len", CASES, ids=[f"{n}-L{s}" for n, s in CASES])
def test_cos_sin_and_rotation_match_transformers(name, seq_len):
    head_dim, rotary_dim, *_ = MODELS[name]
    config = hf_config(name)
    positions = [p for p in POSITIONS if p < seq_len]
    pos = torch.tensor([positions])
    # transformers: its rotary module keys dynamic / longrope on max(position_ids) + 1, so the largest
    # position asked is seq_len - 1 (the cache is keyed on the same length).
    hf_rope = GPTNeoXRotaryEmbedding(config)
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.tensor([positions + [seq_len - 1]]))
    hf_cos, hf_sin = hf_cos[:, :-1].double(), hf_sin[:, :-1].double()
    if MODELS[name][3]["rope_type"] in ("dynamic", "longrope"):
        # keyed on seq_len: the table itself, all seq_len rows
        cache = RopeCache.from_hf_config(config, max_positions=seq_len)
        assert cache.cos_sin.dtype == torch.float32 and cache.cos_sin.shape == (seq_len, rotary_dim)
        table = cache.cos_sin[pos[0]]
    else:
        # the rows the table build computes (test_cache checks they are the stored rows, bit for bit),
        # without building 131072 rows per model
        cache = RopeCache.from_hf_config(config, max_positions=2050)
        table = cos_sin_rows(pos[0], cache.inv_freq, cache.attention_factor).float()
        assert torch.equal(table[:4], cache.cos_sin[pos[0, :4]])  # positions 0, 1, 2047, 2049
    h = rotary_dim // 2
    rows = table[None].double()
    ours_cos, ours_sin = rows[..., :h], rows[..., h:]

    A = cache.attention_factor
    angle = pos[..., None].double() * cache.inv_freq
    tol_cs = A * (angle * inv_rel_tol(rotary_dim, effective_base(name, seq_len)) + ulp32(angle) / 2 + 4 * EPS)
    for ours, theirs in ((ours_cos, hf_cos), (ours_sin, hf_sin)):
        assert torch.equal(theirs[..., :h], theirs[..., h:])
        err = (ours - theirs[..., :h]).abs()
        assert (err <= tol_cs).all(), f"ratio {(err / tol_cs).max():.3g}"

    # Rotated q / k through transformers' own apply function and through rope_ext's op.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, len(positions), head_dim, generator=g)
    k = torch.randn(1, 2, len(positions), head_dim, generator=g)
    hf_q, hf_k = hf_apply_partial(q, k, hf_cos.float(), hf_sin.float())
    local = torch.arange(len(positions))[None, None, :]  # row i of `table` holds position positions[i]
    rq, rk = rope_ext.apply_rotary_qk(q, k, local, table)

    def bound(x):
        pair = x[..., :h].abs().double() + x[..., h:rotary_dim].abs().double()
        t = pair * (tol_cs[:, None] + 4 * EPS * A)
        return torch.cat([t, t, torch.zeros_like(x[..., rotary_dim:], dtype=torch.float64)], dim=-1)

    for ours, theirs, x in ((rq, hf_q, q), (rk, hf_k, k)):
        err = (ours.double() - theirs.double()).abs()
        assert (err <= bound(x)).all(), f"ratio {(err / bound(x).clamp_min(1e-30)).max():.3g}"
        assert torch.equal(ours[..., rotary_dim:], x[..., rotary_dim:])

    if name in INTERLEAVED:  # transformers' interleaved form (DeepSeek-V3) returns de-interleaved halves
        qr, kr = q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous()
        hf_qi, hf_ki = apply_rotary_pos_emb_interleave(qr, kr, hf_cos.float(), hf_sin.float())
        iq, ik = rope_ext.apply_rotary_qk(qr, kr, local, table, interleaved=True)
        for ours, theirs in ((iq, hf_qi), (ik, hf_ki)):
            ours_split = torch.cat([ours[..., 0::2], ours[..., 1::2]], dim=-1)
            x = torch.cat([qr if ours is iq else kr], dim=-1)
            pair = (x[..., 0::2].abs() + x[..., 1::2].abs()).double()
            t = pair * (tol_cs[:, None] + 4 * EPS * A)
            err = (ours_split.double() - theirs.double()).abs()
            assert (err <= torch.cat([t, t], dim=-1)).all()


def test_longrope_switches_at_original_length():
    config = hf_config("phi3_mini_128k")
    cache = RopeCache.from_hf_config(config, max_positions=4096)
    short_inv, _ = hf_inv_freq_and_attention(config, 4096)
    long_inv, _ = hf_inv_freq_and_attention(config, 4097)
    tol = inv_rel_tol(96, 1e4)
    assert ((cache.inv_freq - short_inv.double()).abs() / cache.inv_freq <= tol).all()
    before = cache.cos_sin
    cache.ensure(4097)
    assert ((cache.inv_freq - long_inv.double()).abs() / cache.inv_freq <= tol).all()
    # every row was rebuilt with the long factors, including rows that existed before
    fresh_long = RopeCache.from_hf_config(config, max_positions=4097)
    assert torch.equal(cache.cos_sin[:4097], fresh_long.cos_sin[:4097])
    assert not torch.equal(cache.cos_sin[1:4096], before[1:4096])
    # Phi-3's attention factor: sqrt(1 + ln(131072 / 4096) / ln(4096))
    assert cache.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-15)


def test_dynamic_keyed_on_largest_requested_length_not_capacity():
    config = hf_config("dynamic_x2")
    cache = RopeCache.from_hf_config(config, max_positions=4096)
    unscaled = cache.inv_freq
    cache.ensure(5000)  # capacity grows to 8192, the base follows 5000
    assert cache.capacity == 8192 and cache.seq_len == 5000
    hf5000, _ = hf_inv_freq_and_attention(config, 5000)
    tol = inv_rel_tol(128, effective_base("dynamic_x2", 5000))
    assert ((cache.inv_freq - hf5000.double()).abs() / cache.inv_freq <= tol).all()
    version = cache._version
    cache.ensure(4500)  # smaller: nothing changes
    assert cache._version == version and cache.seq_len == 5000
    cache.set_seq_len(100)  # back under the trained length: the original base
    assert torch.equal(cache.inv_freq, unscaled)


WORKED = [
    # name, low, high: yarn's correction range of pairs, worked out by hand from the config
    ("deepseek_v3", 10, 23),
    ("qwen2.5_7b_yarn", 23, 40),
]


@pytest.mark.parametrize("name,low,high", WORKED)
def test_yarn_worked_values(name, low, high):
    head_dim, d, theta, params, _ = MODELS[name]
    lo, hi = yarn_correction_range(d, theta, params["original_max_position_embeddings"])
    assert (lo, hi) == (low, high)


def test_yarn_worked_values_truncate_false_and_attention_factors():
    lo, hi = yarn_correction_range(64, 1.5e5, 4096, truncate=False)
    assert lo == pytest.approx(8.09, abs=0.005) and hi == pytest.approx(17.40, abs=0.005)
    # Qwen2.5 x4: 0.1 ln 4 + 1
    assert RopeCache.from_hf_config(
        hf_config("qwen2.5_7b_yarn"), max_positions=4
    ).attention_factor == pytest.approx(1.1386, abs=1e-4)
    # DeepSeek-V3's magnitude correction g(40, 1) = 1.369. With mscale == mscale_all_dim (its config) the
    # factor on cos/sin is g/g = 1, as in transformers (DeepSeek applies g**2 to the softmax scale instead);
    # without the mscale keys, cos/sin carry g(40, 1) itself.
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(1.369, abs=5e-4)
    assert RopeCache.from_hf_config(hf_config("deepseek_v3"), max_positions=4).attention_factor == 1.0
    s = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    assert RopeCache(64, 1e4, scaling=s).attention_factor == pytest.approx(1.369, abs=5e-4)


@pytest.mark.parametrize("name,split", [("llama3.1_8b", (29, 6, 29)), ("llama3.2_1b", (15, 3, 14))])
def test_llama3_frequency_split(name, split):
    cache = RopeCache.from_hf_config(hf_config(name), max_positions=4)
    head_dim, d, theta, params, _ = MODELS[name]
    plain = rope_ext.reference.inv_freq(d, theta)
    inv = cache.inv_freq
    unchanged = int((inv == plain).sum())
    divided = int(torch.isclose(inv, plain / params["factor"], rtol=1e-15, atol=0).sum())
    assert (unchanged, d // 2 - unchanged - divided, divided) == split


def test_llama4_low_equals_high_has_no_nan():
    cache = RopeCache.from_hf_config(hf_config("llama4_low_eq_high"), max_positions=2048)
    assert torch.isfinite(cache.inv_freq).all() and torch.isfinite(cache.cos_sin).all()
    plain = rope_ext.reference.inv_freq(128, 5e5)
    wavelen = 2 * math.pi / plain
    expect = torch.where(wavelen > 8192, plain / 16, plain)
    assert torch.equal(cache.inv_freq, expect)


def test_real_config_classes():
    """Config objects of the model classes themselves, 5.x form, and the 4.x dict forms."""
    llama31 = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
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
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](llama31)
    cache = RopeCache.from_hf_config(llama31, max_positions=4)
    assert ((cache.inv_freq - hf_inv.double()).abs() / cache.inv_freq <= inv_rel_tol(128, 5e5)).all()
    legacy = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    assert torch.equal(RopeCache.from_hf_config(legacy, max_positions=4).inv_freq, cache.inv_freq)

    phi3 = Phi3Config(
        hidden_size=3072,
        num_attention_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": _S48,
            "long_factor": _L48,
        },
    )
    hf_inv, hf_attn = ROPE_INIT_FUNCTIONS["longrope"](phi3, None, seq_len=131072)
    cache = RopeCache.from_hf_config(phi3, max_positions=4097)  # past the original length: long factors
    assert ((cache.inv_freq - hf_inv.double()).abs() / cache.inv_freq <= inv_rel_tol(96, 1e4)).all()
    assert cache.attention_factor == pytest.approx(hf_attn, rel=1e-12)
    legacy_su = {
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_theta": 1e4,
        "rope_scaling": {"type": "su", "short_factor": _S48, "long_factor": _L48},
    }
    su = RopeCache.from_hf_config(legacy_su, max_positions=4097)
    assert torch.equal(su.inv_freq, cache.inv_freq) and su.attention_factor == cache.attention_factor


# ---------------------------------------------------------------------------------------------
# Table length of from_hf_config: the config's max_position_embeddings, started as transformers starts.

LLAMA31_PARAMS = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rotate_at(cos_sin: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_qk`` of one token at ``position``, and the float64 reference of its q."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, cos_sin.shape[1], generator=g), torch.randn(1, 1, cos_sin.shape[1], generator=g)
    pos = torch.tensor([[position]])
    out, _ = rope_ext.apply_rotary_qk(q, k, pos, cos_sin)
    return out, rope_ext.reference.rotary_matrix(q, pos, cos_sin)


def test_from_hf_config_default_length_is_max_position_embeddings():
    """A Llama-3.1 config (131072 positions): position 131071 works at once (the table used to have 2048
    rows: ``IndexError ... got 8191``), 131072 raises the ops' IndexError; ``max_positions=`` overrides."""
    mpe = 131072
    cfg = LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=mpe, rope_parameters=LLAMA31_PARAMS
    )
    cache = RopeCache.from_hf_config(cfg)
    assert cache.capacity == mpe and cache.seq_len == mpe
    small = RopeCache.from_hf_config(cfg, max_positions=64)
    assert small.capacity == 64 and torch.equal(small.cos_sin, cache.cos_sin[:64])
    out, ref = _rotate_at(cache.cos_sin, mpe - 1)
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(
        cache.cos_sin[mpe - 1], cos_sin_rows(torch.tensor([mpe - 1]), cache.inv_freq)[0].float()
    )
    with pytest.raises(IndexError, match=f"got {mpe}"):
        _rotate_at(cache.cos_sin, mpe)
    with pytest.raises(IndexError, match="got 64"):
        _rotate_at(small.cos_sin, 64)

    m = rope_ext.RotaryEmbedding.from_hf_config(cfg)
    assert m.cache.capacity == mpe and torch.equal(m.cos_sin(), cache.cos_sin)
    q = torch.randn(1, 1, 2, 64)
    want = rope_ext.apply_rotary(q, torch.tensor([[[mpe - 1]]]), cache.cos_sin)
    assert torch.equal(m(q, q, torch.tensor([[mpe - 1]]))[0], want)
    with pytest.raises(IndexError, match=f"got {mpe}"):
        m(q, q, torch.tensor([[mpe]]))
    assert rope_ext.RotaryEmbedding.from_hf_config(cfg, max_positions=64).cache.capacity == 64


def test_from_hf_config_without_max_position_embeddings_keeps_2048():
    cache = RopeCache.from_hf_config({"head_dim": 64, "rope_theta": 1e4})
    assert cache.capacity == cache.seq_len == 2048
    assert rope_ext.RotaryEmbedding.from_hf_config({"head_dim": 64}).cache.capacity == 2048
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RopeCache.from_hf_config({"head_dim": 64, "max_position_embeddings": 0})


def test_from_hf_config_length_dependent_variants_start_like_transformers():
    """``longrope``: all 131072 rows, short factors (transformers' module starts with them) until a longer
    sequence is asked for; ``dynamic``: ``max_position_embeddings`` rows at the unscaled base."""
    config = hf_config("phi3_mini_128k")
    cache = RopeCache.from_hf_config(config)
    assert (cache.capacity, cache.seq_len) == (131072, 4096)
    short = RopeCache.from_hf_config(config, max_positions=4096)
    assert torch.equal(cache.inv_freq, short.inv_freq) and torch.equal(cache.cos_sin[:4096], short.cos_sin)
    hf_short, _ = hf_inv_freq_and_attention(config, None)  # what transformers' module starts with
    assert ((cache.inv_freq - hf_short.double()).abs() / cache.inv_freq <= inv_rel_tol(96, 1e4)).all()
    out, ref = _rotate_at(cache.cos_sin, 131071)
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    with pytest.raises(IndexError, match="got 131072"):
        _rotate_at(cache.cos_sin, 131072)
    m = rope_ext.RotaryEmbedding.from_hf_config(config)
    assert (m.cache.capacity, m.cache.seq_len) == (131072, 4096) and torch.equal(m.cos_sin(), cache.cos_sin)
    # an explicit length is the constructor's: past the original length, the long factors everywhere
    assert RopeCache.from_hf_config(config, max_positions=4097).seq_len == 4097

    config = hf_config("dynamic_x2")
    cache = RopeCache.from_hf_config(config)
    assert (cache.capacity, cache.seq_len) == (4096, 4096)
    hf_inv, _ = hf_inv_freq_and_attention(config, None)
    assert ((cache.inv_freq - hf_inv.double()).abs() / cache.inv_freq <= inv_rel_tol(128, 1e4)).all()
    assert torch.equal(cache.inv_freq, rope_ext.reference.inv_freq(128, 1e4))
    with pytest.raises(IndexError, match="got 4096"):
        _rotate_at(cache.cos_sin, 4096)

"""RopeCache: precision of the stored table, growth, per-device copies, threads, config parsing, bad input."""

from __future__ import annotations

import threading

import mpmath
import numpy as np
import pytest
import torch
from _helpers import HAS_CUDA

import rope_ext
from rope_ext import RopeCache
from rope_ext.cache import cos_sin_rows

TOP = 1 << 20  # 1,048,576: the largest position the precision contract covers

YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# ---------------------------------------------------------------------------------------------
# Precision: stored float32 within 1 ulp of the correctly rounded value of the exact cos/sin.


def _within_one_ulp(stored: np.ndarray, exact: np.ndarray) -> None:
    """``stored`` (float32) is the float32 rounding of ``exact`` or a neighbour of it."""
    rounded = exact.astype(np.float32)
    up = np.nextafter(rounded, np.float32(np.inf))
    down = np.nextafter(rounded, np.float32(-np.inf))
    ok = (stored == rounded) | (stored == up) | (stored == down)
    assert ok.all(), f"{int((~ok).sum())} values more than 1 ulp from the correctly rounded float32"
    # and in practice nearly all are the correctly rounded value itself
    assert (stored == rounded).mean() > 0.999


@pytest.mark.parametrize(
    "rotary_dim,base,scaling",
    [
        (128, 5e5, None),
        (128, 1e6, {**YARN, "factor": 4.0, "original_max_position_embeddings": 32768}),
        (64, 1.5e5, YARN),
        (96, 1e4, None),
    ],
    ids=["llama3-base", "qwen-yarn", "yarn-x32", "d96"],
)
def test_stored_rows_near_one_million_within_one_ulp_long_double(rotary_dim, base, scaling):
    """The build path of the table (``_rows``) at the top of the range and in a spread of positions,
    against numpy long double (64-bit mantissa on x86: angle error <= 2**-64 relative)."""
    if np.finfo(np.longdouble).nmant < 63:
        pytest.skip("no extended-precision long double on this platform")
    cache = RopeCache(rotary_dim, base, max_positions=4, scaling=scaling)
    inv = cache.inv_freq.numpy().astype(np.longdouble)
    A = np.longdouble(cache.attention_factor)
    top_rows = cache._rows(TOP - 255, TOP + 1).numpy()  # positions TOP-255 .. TOP
    spread = np.unique(np.geomspace(1, TOP, 1500).astype(np.int64))
    spread_rows = (
        cos_sin_rows(torch.from_numpy(spread), cache.inv_freq, cache.attention_factor).float().numpy()
    )
    for pos, stored in ((np.arange(TOP - 255, TOP + 1), top_rows), (spread, spread_rows)):
        angle = pos.astype(np.longdouble)[:, None] * inv[None, :]
        exact = np.concatenate([A * np.cos(angle), A * np.sin(angle)], axis=1)
        _within_one_ulp(stored, exact)


def test_stored_rows_against_mpmath():
    """A few positions at 50 significant digits (exact angle of the float64 inv_freq)."""
    mpmath.mp.dps = 50
    cache = RopeCache(128, 5e5, max_positions=4, scaling=LLAMA3)
    positions = [TOP, TOP - 1, 999_983, 777_777, 131_071, 65_537]
    rows = cos_sin_rows(torch.tensor(positions), cache.inv_freq).float().numpy()
    inv = cache.inv_freq.tolist()
    exact = np.array(
        [
            [float(mpmath.cos(mpmath.mpf(p) * mpmath.mpf(f))) for f in inv]
            + [float(mpmath.sin(mpmath.mpf(p) * mpmath.mpf(f))) for f in inv]
            for p in positions
        ]
    )
    # float(mpmath) is the correctly rounded double; its float32 rounding can differ from the correctly
    # rounded float32 only by a double rounding, i.e. at most one ulp: covered by the check.
    _within_one_ulp(rows, exact)
    # The naive float64 angle (p * inv rounded) is off by up to ~1e-10 here; ours is not.
    naive = torch.tensor(positions, dtype=torch.float64)[:, None] * cache.inv_freq
    naive_err = np.abs(np.concatenate([naive.cos(), naive.sin()], 1) - exact).max()
    ours_err = np.abs(cos_sin_rows(torch.tensor(positions), cache.inv_freq).numpy() - exact).max()
    assert ours_err < 4e-16 and ours_err < naive_err


def test_table_matches_float64_reference_and_defaults_to_float32():
    cache = RopeCache(64, 1e4, max_positions=70_000)  # spans more than one build chunk
    assert cache.cos_sin.dtype == torch.float32 and cache.cos_sin.shape == (70_000, 64)
    ref = rope_ext.reference.cos_sin_table(70_000, 64, 1e4)
    # float64 reference: its own angle error is <= p * 2**-53 * few; ours is within 1 ulp of exact.
    tol = 2.0**-24 + 70_000 * 2.0**-51
    assert (cache.cos_sin.double() - ref).abs().max() <= tol
    # the stored rows are exactly cos_sin_rows of their positions, across build chunks
    some = torch.tensor([0, 1, 8191, 8192, 8193, 65535, 65536, 69999])
    assert torch.equal(cache.cos_sin[some], cos_sin_rows(some, cache.inv_freq).float())
    c64 = RopeCache(64, 1e4, max_positions=16, dtype=torch.float64)
    assert c64.cos_sin.dtype == torch.float64
    assert torch.equal(c64.cos_sin.float(), cache.cos_sin[:16])


def test_attention_factor_multiplies_cos_and_sin():
    plain = RopeCache(64, 1.5e5, max_positions=64, scaling=dict(YARN, attention_factor=1.0))
    scaled = RopeCache(64, 1.5e5, max_positions=64, scaling=dict(YARN, attention_factor=1.5))
    assert torch.allclose(scaled.cos_sin.double(), 1.5 * plain.cos_sin.double(), rtol=2**-23, atol=0)


# ---------------------------------------------------------------------------------------------
# Growth, copies, threads


def test_ensure_is_a_no_op_when_covered_and_grows_geometrically():
    cache = RopeCache(32, max_positions=16)
    t0 = cache.cos_sin
    assert cache.ensure(10) is cache and cache.cos_sin is t0 and cache.ensure(16).cos_sin is t0
    cache.ensure(17)
    assert cache.capacity == 32 and cache.seq_len == 17
    assert torch.equal(cache.cos_sin[:16], t0)  # rows kept, old tensor untouched
    cache.ensure(100)
    assert cache.capacity == 100
    assert torch.equal(cache.cos_sin, RopeCache(32, max_positions=100).cos_sin)  # appended rows are exact
    t1 = cache.cos_sin
    cache.reserve(50)
    assert cache.cos_sin is t1


def test_copy_and_pickle():
    import copy
    import pickle

    cache = RopeCache(32, max_positions=8, scaling={"rope_type": "linear", "factor": 2.0})
    cache.cos_sin_on("meta")
    for clone in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert torch.equal(clone.cos_sin, cache.cos_sin) and clone.scaling == cache.scaling
        clone.ensure(20)  # has a working lock of its own
        assert clone.capacity == 20 and cache.capacity == 8
    m = copy.deepcopy(rope_ext.RotaryEmbedding(32, max_positions=8))
    assert m.cache.capacity == 8


def test_one_copy_per_device():
    cache = RopeCache(32, max_positions=8)
    assert cache.cos_sin_on("cpu") is cache.cos_sin
    m1 = cache.cos_sin_on("meta")
    assert m1.device.type == "meta" and cache.cos_sin_on(torch.device("meta")) is m1
    cache.ensure(9)  # table grew: the copy is refreshed once
    m2 = cache.cos_sin_on("meta")
    assert m2 is not m1 and m2.shape[0] == cache.capacity and cache.cos_sin_on("meta") is m2


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_copy_matches():
    cache = RopeCache(64, max_positions=1024)
    g = cache.cos_sin_on("cuda")
    assert g.is_cuda and torch.equal(g.cpu(), cache.cos_sin) and cache.cos_sin_on("cuda") is g
    built_on_gpu = RopeCache(64, max_positions=1024, device="cuda").cos_sin
    assert (built_on_gpu.cpu().double() - cache.cos_sin.double()).abs().max() <= 2.0**-24


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}]
)
def test_threads(scaling):
    cache = RopeCache(32, max_positions=8, scaling=scaling)
    errors = []
    sizes = [int(n) for n in np.random.default_rng(0).integers(1, 300, size=400)]

    def work(chunk):
        try:
            for n in chunk:
                cache.ensure(n)
                t = cache.cos_sin_on("meta")
                assert cache.cos_sin.shape[0] >= n and t.shape[1] == 32
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(sizes[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.seq_len == max(sizes)
    fresh = RopeCache(32, max_positions=max(sizes), scaling=scaling)
    assert torch.equal(cache.cos_sin[: max(sizes)], fresh.cos_sin)


# ---------------------------------------------------------------------------------------------
# Config parsing


def test_from_hf_config_dict_forms():
    base4 = {"hidden_size": 256, "num_attention_heads": 2, "max_position_embeddings": 4096}
    a = RopeCache.from_hf_config(
        dict(base4, rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    )
    b = RopeCache.from_hf_config(dict(base4, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    c = RopeCache.from_hf_config(
        dict(base4, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    )
    assert a.rotary_dim == 128 and a.base == 5e5 and a.rope_type == "linear"
    assert torch.equal(a.inv_freq, b.inv_freq) and torch.equal(a.inv_freq, c.inv_freq)
    neox = RopeCache.from_hf_config({"hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25})
    assert neox.rotary_dim == 24 and neox.base == 10000.0
    gptj = RopeCache.from_hf_config({"n_embd": 4096, "head_dim": 256, "rotary_dim": 64})
    assert gptj.rotary_dim == 64
    phi2 = RopeCache.from_hf_config({"head_dim": 80, "partial_rotary_factor": 0.4})
    assert phi2.rotary_dim == 32
    kw = RopeCache.from_hf_config({"head_dim": 64}, max_positions=10, dtype=torch.float64)
    assert kw.capacity == 10 and kw.cos_sin.dtype == torch.float64


def test_from_hf_config_nested_per_layer_type_and_text_config():
    config = {
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    full = RopeCache.from_hf_config(config, layer_type="full_attention", max_positions=4)
    sliding = RopeCache.from_hf_config(config, layer_type="sliding_attention", max_positions=4)
    assert full.rope_type == "linear" and full.base == 1e6 and sliding.base == 1e4
    with pytest.raises(ValueError, match="layer_type"):
        RopeCache.from_hf_config(config)
    with pytest.raises(ValueError, match="chunked"):
        RopeCache.from_hf_config(config, layer_type="chunked")
    outer = {"text_config": config, "vision_config": {}}
    assert RopeCache.from_hf_config(outer, layer_type="full_attention", max_positions=4).base == 1e6


def test_from_hf_config_gemma3_object():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        head_dim=64,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    assert RopeCache.from_hf_config(cfg, layer_type="full_attention", max_positions=4).rope_type == "linear"
    assert RopeCache.from_hf_config(cfg, layer_type="sliding_attention", max_positions=4).base == 1e4


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "scaling,match",
    [
        (
            {"rope_type": "ntk-by-parts"},
            r"unknown RoPE scaling 'rope_type' 'ntk-by-parts'; known: \['default'",
        ),
        ({"rope_type": "linear"}, r"needs 'factor' \(expected a number > 0\)"),
        ({"rope_type": "linear", "factor": 0}, r"'factor' must be a number > 0, got 0"),
        ({"rope_type": "linear", "factor": -2.0}, r"'factor' must be a number > 0"),
        ({"rope_type": "dynamic", "factor": 2.0}, r"needs 'original_max_position_embeddings'"),
        ({**YARN, "factor": None}, r"needs 'factor'"),
        ({**YARN, "truncate": "no"}, r"'truncate' must be a bool"),
        ({**YARN, "beta_fast": 0}, r"'beta_fast' must be a number > 0"),
        ({**LLAMA3, "low_freq_factor": None}, r"needs 'low_freq_factor'"),
        ({**LLAMA3, "high_freq_factor": 0.5}, r"'high_freq_factor' must be >= 'low_freq_factor' = 1.0"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 32,
                "long_factor": [1.0] * 31,
                "factor": 2.0,
                "original_max_position_embeddings": 4096,
            },
            r"'long_factor' must have rotary_dim / 2 = 32 entries, got 31",
        ),
        (
            {
                "rope_type": "longrope",
                "long_factor": [1.0] * 32,
                "factor": 2.0,
                "original_max_position_embeddings": 4096,
            },
            r"needs 'short_factor' \(expected a list of 32 numbers > 0\)",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 31 + [0.0],
                "long_factor": [1.0] * 32,
                "factor": 2.0,
                "original_max_position_embeddings": 4096,
            },
            r"every entry of 'short_factor' must be a number > 0",
        ),
    ],
)
def test_bad_scaling_raises_naming_the_key(scaling, match):
    with pytest.raises(ValueError, match=match):
        RopeCache(64, scaling=scaling)


def test_bad_config_raises():
    with pytest.raises(ValueError, match=r"'rotary_dim' must be an int <= head_dim = 64, got 128"):
        RopeCache.from_hf_config({"head_dim": 64, "rotary_dim": 128})
    with pytest.raises(ValueError, match=r"'head_dim'"):
        RopeCache.from_hf_config({"rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"'partial_rotary_factor' must be in \(0, 1\], got 1.5"):
        RopeCache.from_hf_config({"head_dim": 64, "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match=r"unknown RoPE scaling 'rope_type' 'mrope'"):
        RopeCache.from_hf_config(
            {"head_dim": 64, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}
        )
    with pytest.raises(ValueError, match="rotary_dim must be a positive even int"):
        RopeCache(63)
    with pytest.raises(ValueError, match="rotary_dim must be an int <= head_dim = 64"):
        rope_ext.RotaryEmbedding(64, rotary_dim=128)

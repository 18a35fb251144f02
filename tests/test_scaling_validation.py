"""Scaling validation against the installed transformers: rope_ext rejects what transformers rejects, with
an exception of the same class (or a subclass), and accepts what it accepts.

transformers (5.x) checks a ``rope_parameters`` dict in three places, all run here the way a model does:
the config's ``standardize_rope_params`` / ``validate_rope`` (``_validate_<type>_rope_parameters``: a
missing required key is a ``KeyError``; types and ranges only log warnings), the rope init function
(``ROPE_INIT_FUNCTIONS``, a ``KeyError`` for an unknown ``rope_type``; a wrong type fails with a
``TypeError`` where the value is used) and, for longrope's long factors and dynamic NTK, a forward past the
trained length (a factor list of the wrong length: torch's ``RuntimeError``).

rope_ext raises :class:`rope_ext.scaling.RopeScalingError` (a ``ValueError``) whose subclasses are also
``KeyError`` / ``TypeError`` / ``RuntimeError``; where transformers only warns rope_ext accepts too, except
for values that give no meaningful table (``STRICTER``: a plain ``RopeScalingError``).
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from test_scaling import MODELS
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_ext import RopeCache
from rope_ext.scaling import (
    RopeScalingError,
    RopeScalingKeyError,
    RopeScalingLengthError,
    RopeScalingTypeError,
    normalize_scaling,
)

MPE = 4096
HEAD_DIM = 64


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers logs a warning for most of these dicts; keep the test output readable."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


def transformers_error(params: dict, *, mpe: int = MPE, head_dim: int = HEAD_DIM) -> Exception | None:
    """What transformers raises for ``rope_parameters=params`` (``None`` if it accepts the dict): a Llama
    config's standardization and validation (what ``PreTrainedConfig.__post_init__`` runs), the model's
    rotary embedding (the rope init function), and one forward at a position past the trained length."""
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=mpe,
        num_hidden_layers=1,
        intermediate_size=8,
        vocab_size=8,
    )
    # Set after construction: the strict dataclass would wrap a TypeError raised in __post_init__.
    config.rope_parameters = copy.deepcopy({"rope_theta": 1e4, **params})
    try:
        config.standardize_rope_params()
        config.validate_rope()
        rope = LlamaRotaryEmbedding(config)
        rope(torch.zeros(1, 2, head_dim), torch.tensor([[0, 2 * mpe]]))
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return e
    return None


def rope_ext_errors(params: dict, *, mpe: int = MPE, head_dim: int = HEAD_DIM) -> list[Exception | None]:
    """What rope_ext raises for the same dict: from a config (``RopeCache.from_hf_config``) and as a raw
    scaling dict (``normalize_scaling``, with ``max_position_embeddings`` in the dict)."""
    out: list[Exception | None] = []
    config = {
        "head_dim": head_dim,
        "max_position_embeddings": mpe,
        "rope_parameters": {"rope_theta": 1e4, **params},
    }
    try:
        RopeCache.from_hf_config(copy.deepcopy(config), max_positions=4)
        out.append(None)
    except Exception as e:  # noqa: BLE001
        out.append(e)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    try:
        normalize_scaling({**copy.deepcopy(params), "max_position_embeddings": mpe}, rotary_dim)
        out.append(None)
    except Exception as e:  # noqa: BLE001
        out.append(e)
    return out


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0] * (HEAD_DIM // 2),
    "long_factor": [2.0] * (HEAD_DIM // 2),
    "original_max_position_embeddings": 1024,
}
_DEL = object()


def _with(base: dict, **changes) -> dict:
    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is _DEL:
            out.pop(k)
        else:
            out[k] = v
    return out


# (id, rope parameters, the key the message must name, rope_ext's class)
REJECTED = [
    # rope_type: transformers' init-function lookup is a KeyError
    ("unknown_type", {"rope_type": "ntk-by-parts"}, "rope_type", RopeScalingKeyError),
    ("type_not_str", {"rope_type": 5}, "rope_type", RopeScalingKeyError),
    ("type_none", {"rope_type": None}, "rope_type", RopeScalingKeyError),
    ("type_empty", {"rope_type": ""}, "rope_type", RopeScalingKeyError),
    ("legacy_type_unknown", {"type": "mrope"}, "rope_type", RopeScalingKeyError),
    # linear / dynamic: factor required
    ("linear_no_factor", {"rope_type": "linear"}, "factor", RopeScalingKeyError),
    ("linear_factor_none", {"rope_type": "linear", "factor": None}, "factor", RopeScalingTypeError),
    ("linear_factor_str", {"rope_type": "linear", "factor": "2"}, "factor", RopeScalingTypeError),
    ("dynamic_no_factor", {"rope_type": "dynamic"}, "factor", RopeScalingKeyError),
    ("dynamic_factor_none", {"rope_type": "dynamic", "factor": None}, "factor", RopeScalingTypeError),
    ("dynamic_factor_str", {"rope_type": "dynamic", "factor": "2"}, "factor", RopeScalingTypeError),
    # yarn
    ("yarn_no_factor", _with(YARN, factor=_DEL), "factor", RopeScalingKeyError),
    ("yarn_factor_str", _with(YARN, factor="4"), "factor", RopeScalingTypeError),
    (
        "yarn_original_none",
        _with(YARN, original_max_position_embeddings=None),
        "original",
        RopeScalingTypeError,
    ),
    (
        "yarn_original_str",
        _with(YARN, original_max_position_embeddings="1024"),
        "original",
        RopeScalingTypeError,
    ),
    ("yarn_beta_fast_str", _with(YARN, beta_fast="32"), "beta_fast", RopeScalingTypeError),
    ("yarn_beta_slow_str", _with(YARN, beta_slow="1"), "beta_slow", RopeScalingTypeError),
    (
        "yarn_attention_factor_str",
        _with(YARN, attention_factor="1"),
        "attention_factor",
        RopeScalingTypeError,
    ),
    ("yarn_mscale_str", _with(YARN, mscale="1", mscale_all_dim=1.0), "mscale", RopeScalingTypeError),
    # llama3: every key below is required
    *[
        (f"llama3_no_{k}", _with(LLAMA3, **{k: _DEL}), k, RopeScalingKeyError)
        for k in ("factor", "low_freq_factor", "high_freq_factor")
    ],
    *[
        (f"llama3_{k}_{name}", _with(LLAMA3, **{k: v}), k, RopeScalingTypeError)
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        for name, v in (("none", None), ("str", "1"))
    ],
    # longrope
    ("longrope_no_short", _with(LONGROPE, short_factor=_DEL), "short_factor", RopeScalingKeyError),
    ("longrope_no_long", _with(LONGROPE, long_factor=_DEL), "long_factor", RopeScalingKeyError),
    ("longrope_short_none", _with(LONGROPE, short_factor=None), "short_factor", RopeScalingTypeError),
    ("longrope_long_none", _with(LONGROPE, long_factor=None), "long_factor", RopeScalingTypeError),
    ("longrope_short_scalar", _with(LONGROPE, short_factor=1.0), "short_factor", RopeScalingTypeError),
    ("longrope_short_str", _with(LONGROPE, short_factor="a" * 32), "short_factor", RopeScalingTypeError),
    # transformers: torch.tensor(["1", ...]) is a ValueError; rope_ext's TypeError subclass is one too
    (
        "longrope_short_entries_str",
        _with(LONGROPE, short_factor=["1"] * 32),
        "short_factor",
        RopeScalingTypeError,
    ),
    ("longrope_short_len", _with(LONGROPE, short_factor=[1.0] * 31), "short_factor", RopeScalingLengthError),
    ("longrope_long_len", _with(LONGROPE, long_factor=[2.0] * 33), "long_factor", RopeScalingLengthError),
    # lists sized for the head, but only a quarter of it rotates: rotary_dim / 2 = 8
    (
        "longrope_len_partial",
        _with(LONGROPE, partial_rotary_factor=0.25),
        "short_factor",
        RopeScalingLengthError,
    ),
    ("longrope_factor_str", _with(LONGROPE, factor="2"), "factor", RopeScalingTypeError),
    (
        "longrope_original_none",
        _with(LONGROPE, original_max_position_embeddings=None),
        "original",
        RopeScalingTypeError,
    ),
    (
        "longrope_attention_str",
        _with(LONGROPE, attention_factor="1"),
        "attention_factor",
        RopeScalingTypeError,
    ),
]


@pytest.mark.parametrize("params,key,ours_cls", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejected_like_transformers(params, key, ours_cls):
    theirs = transformers_error(params)
    assert theirs is not None, "transformers accepts this dict: not a rejection case"
    for ours in rope_ext_errors(params):
        assert ours is not None, (
            f"rope_ext accepts what transformers rejects ({type(theirs).__name__}: {theirs})"
        )
        assert isinstance(ours, type(theirs)), f"{type(ours).__mro__} is no {type(theirs).__name__}: {ours}"
        assert type(ours) is ours_cls
        assert isinstance(ours, ValueError) and isinstance(ours, RopeScalingError)
        assert key in str(ours), f"message does not name {key!r}: {ours}"


def test_yarn_without_factor_headline():
    """transformers refuses a yarn config without ``factor`` when the config is built; so does rope_ext
    (it used to take ``max_position_embeddings / original`` silently)."""
    params = {"rope_type": "yarn", "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    with pytest.raises(KeyError, match="factor"):
        LlamaConfig(max_position_embeddings=131072, rope_parameters=copy.deepcopy(params))
    config = {"head_dim": 128, "max_position_embeddings": 131072, "rope_parameters": params}
    with pytest.raises(KeyError, match=r"yarn RoPE scaling needs 'factor' \(expected a number > 0\)") as info:
        RopeCache.from_hf_config(config)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("yarn")  # the message as is, not KeyError's quoted repr


def test_odd_head_dim_rejected_like_transformers():
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64)
    config.head_dim = 65
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="even") as theirs:
        config.validate_rope()
    with pytest.raises(type(theirs.value), match="even"):
        RopeCache.from_hf_config({"head_dim": 65, "rope_parameters": {"rope_theta": 1e4}})


# Accepted by transformers (some with a warning): rope_ext accepts them as well, with the same factor.
ACCEPTED = [
    ("default_extra_keys", {"rope_type": "default", "factor": 2.0, "foo": 1}),
    ("legacy_type_key", {"type": "linear", "factor": 2.0}),
    ("linear_factor_below_1", {"rope_type": "linear", "factor": 0.5}),
    (
        "linear_unused_keys_unchecked",
        {"rope_type": "linear", "factor": 2.0, "beta_fast": "x", "short_factor": 3},
    ),
    ("yarn_unknown_key", _with(YARN, foo=1)),
    ("yarn_factor_none_is_ratio", _with(YARN, factor=None)),
    ("yarn_original_from_max", _with(YARN, original_max_position_embeddings=_DEL)),
    ("yarn_factor_int", _with(YARN, factor=4)),
    ("yarn_beta_fast_below_slow", _with(YARN, beta_fast=1, beta_slow=32)),
    ("yarn_mscale_alone", _with(YARN, mscale=1.0)),
    ("llama3_original_from_max", _with(LLAMA3, original_max_position_embeddings=_DEL)),
    ("llama3_low_eq_high", _with(LLAMA3, low_freq_factor=2.0, high_freq_factor=2.0)),
    ("llama3_original_float_int_valued", _with(LLAMA3, original_max_position_embeddings=1024.0)),
    ("longrope_no_factor_is_ratio", LONGROPE),
    ("longrope_factor_below_1", _with(LONGROPE, factor=0.5)),
    ("longrope_original_from_max", _with(LONGROPE, original_max_position_embeddings=_DEL)),
    (
        "longrope_partial",
        _with(LONGROPE, partial_rotary_factor=0.5, short_factor=[1.0] * 16, long_factor=[2.0] * 16),
    ),
]


@pytest.mark.parametrize("params", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_like_transformers(params):
    assert transformers_error(params) is None
    assert rope_ext_errors(params) == [None, None]


@pytest.mark.parametrize(
    "params,factor",
    [
        (_with(YARN, factor=None), MPE / 1024),
        (LONGROPE, MPE / 1024),
        (_with(LONGROPE, factor=None), MPE / 1024),
    ],
    ids=["yarn_factor_none", "longrope_no_factor", "longrope_factor_none"],
)
def test_factor_from_max_position_embeddings_as_transformers(params, factor):
    """A ``factor`` of None (yarn) or none at all (longrope) is ``max_position_embeddings / original``, as in
    transformers: same attention factor, and the same frequencies as with the explicit factor."""
    config = LlamaConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MPE
    )
    config.rope_parameters = copy.deepcopy({"rope_theta": 1e4, **params})
    config.standardize_rope_params()
    hf = LlamaRotaryEmbedding(config)
    cache = RopeCache.from_hf_config(
        {
            "head_dim": HEAD_DIM,
            "max_position_embeddings": MPE,
            "rope_parameters": {"rope_theta": 1e4, **params},
        },
        max_positions=4,
    )
    assert cache.scaling["factor"] == factor
    assert math.isclose(cache.attention_factor, hf.attention_scaling, rel_tol=1e-12)
    explicit = RopeCache(
        HEAD_DIM,
        1e4,
        max_positions=4,
        scaling={**_with(params, factor=factor), "max_position_embeddings": MPE},
    )
    assert torch.equal(cache.inv_freq, explicit.inv_freq)


# Values transformers only warns about but computes with: no meaningful table, so rope_ext raises a plain
# RopeScalingError (a ValueError) naming the key.
STRICTER = [
    ("linear_factor_zero", {"rope_type": "linear", "factor": 0}, "factor"),
    ("linear_factor_negative", {"rope_type": "linear", "factor": -2.0}, "factor"),
    ("yarn_factor_nan", _with(YARN, factor=float("nan")), "factor"),
    ("yarn_mscale_negative", _with(YARN, mscale=-1.0, mscale_all_dim=1.0), "mscale"),
    ("llama3_high_below_low", _with(LLAMA3, low_freq_factor=4.0, high_freq_factor=1.0), "high_freq_factor"),
    ("longrope_entry_zero", _with(LONGROPE, short_factor=[1.0] * 31 + [0.0]), "short_factor"),
    ("yarn_original_fractional", _with(YARN, original_max_position_embeddings=1024.5), "original"),
]


@pytest.mark.parametrize("params,key", [c[1:] for c in STRICTER], ids=[c[0] for c in STRICTER])
def test_stricter_than_transformers(params, key):
    assert transformers_error(params) is None
    for ours in rope_ext_errors(params):
        assert type(ours) is RopeScalingError and key in str(ours)


def test_stricter_type_checks_stay_value_errors():
    """Types transformers would take (a bool factor, a truthy non-bool ``truncate``, a single-entry factor
    list that broadcasts) are rejected, as ``ValueError`` subclasses naming the key."""
    for params, key in [
        ({"rope_type": "linear", "factor": True}, "factor"),
        (_with(YARN, truncate="no"), "truncate"),
        (_with(LONGROPE, short_factor=[1.0]), "short_factor"),
    ]:
        assert transformers_error(params) is None
        for ours in rope_ext_errors(params):
            assert isinstance(ours, RopeScalingError) and key in str(ours)


def test_legacy_su_alias_kept():
    """The one name rope_ext accepts that transformers 5.x refuses: 4.x's ``"su"`` (old Phi-3 configs),
    read as ``longrope``, as transformers 4.x did."""
    params = {**_with(LONGROPE, rope_type=_DEL), "type": "su"}
    assert isinstance(transformers_error(params), KeyError)
    assert rope_ext_errors(params) == [None, None]
    assert normalize_scaling({**params, "factor": 4.0}, HEAD_DIM)["rope_type"] == "longrope"


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_configs_accepted(name):
    head_dim, rotary_dim, theta, params, mpe = MODELS[name]
    params = dict(params, rope_theta=theta, partial_rotary_factor=rotary_dim / head_dim)
    assert transformers_error(params, mpe=mpe, head_dim=head_dim) is None
    assert rope_ext_errors(params, mpe=mpe, head_dim=head_dim) == [None, None]

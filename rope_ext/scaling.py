"""RoPE scaling variants: validated parameters, then float64 ``inv_freq`` and an attention factor.

A *scaling* is a plain dict in transformers' vocabulary (the ``rope_scaling`` / ``rope_parameters`` keys)::

    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

:func:`resolve_rope_type` is the one place that reads the variant's name (``rope_type``, the 4.x ``type``,
the legacy ``"su"`` alias of ``longrope``) and rejects unknown ones; :func:`normalize_scaling` checks the
whole dict once (``ValueError`` naming the key and the expected value) and returns a canonical dict;
:func:`inv_freq_and_attention_factor` turns it into the float64 inverse frequencies ``[rotary_dim / 2]``
and the attention factor that multiplies both cos and sin.

Variants (``d`` rotary dim, ``b`` base, ``inv_j = b ** (-2j/d)``, ``O`` original/trained length, ``L`` the
length the table is keyed on):

* ``default``: ``inv_j``.
* ``linear``: ``inv_j / factor``.
* ``dynamic`` (NTK-aware): base ``b * (factor * max(L, O) / O - (factor - 1)) ** (d / (d - 2))``.
* ``yarn``: ramp between interpolated and extrapolated frequencies over the correction range given by
  ``beta_fast`` / ``beta_slow`` (``truncate`` rounds it to integers); attention factor explicit, or from
  ``mscale`` / ``mscale_all_dim``, or ``0.1 ln(factor) + 1``.
* ``llama3``: frequencies with wavelength over ``O / low_freq_factor`` divided by ``factor``, under
  ``O / high_freq_factor`` unchanged, smoothly interpolated between (no smooth band when
  ``low_freq_factor == high_freq_factor``).
* ``longrope``: ``1 / (ext_j * b ** (2j/d))`` with ``ext = long_factor`` if ``L > O`` else ``short_factor``;
  attention factor explicit, else ``sqrt(1 + ln(factor) / ln(O))`` (1 when ``factor <= 1``).

``dynamic`` and ``longrope`` depend on ``L`` (:data:`LENGTH_DEPENDENT`); the others do not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "KNOWN_ROPE_TYPES",
    "LENGTH_DEPENDENT",
    "resolve_rope_type",
    "normalize_scaling",
    "inv_freq_and_attention_factor",
    "yarn_correction_range",
    "yarn_get_mscale",
]

KNOWN_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LENGTH_DEPENDENT: frozenset[str] = frozenset({"dynamic", "longrope"})
_ALIASES = {"su": "longrope"}  # transformers 4.x legacy name of longrope (Phi-3)

_POSITIVE_FLOATS = (
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "low_freq_factor",
    "high_freq_factor",
)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(s: dict, key: str, rope_type: str, required: bool = False) -> None:
    v = s.get(key)
    if v is None:
        if required:
            raise ValueError(f"{rope_type} RoPE scaling needs {key!r} (expected a number > 0)")
        return
    if not _is_number(v) or v <= 0:
        raise ValueError(f"{rope_type} RoPE scaling: {key!r} must be a number > 0, got {v!r}")
    s[key] = float(v)


def _positive_int(s: dict, key: str, rope_type: str) -> None:
    v = s.get(key)
    if v is None:
        raise ValueError(f"{rope_type} RoPE scaling needs {key!r} (expected the trained length, an int > 0)")
    if not _is_number(v) or v <= 0 or int(v) != v:
        raise ValueError(f"{rope_type} RoPE scaling: {key!r} must be an int > 0, got {v!r}")
    s[key] = int(v)


def _factor_list(s: dict, key: str, rotary_dim: int) -> None:
    v = s.get(key)
    n = rotary_dim // 2
    if v is None:
        raise ValueError(f"longrope RoPE scaling needs {key!r} (expected a list of {n} numbers > 0)")
    if isinstance(v, Tensor):
        v = v.tolist()
    if not isinstance(v, Sequence) or isinstance(v, str) or len(v) != n:
        got = len(v) if isinstance(v, Sequence) and not isinstance(v, str) else type(v).__name__
        raise ValueError(f"longrope RoPE scaling: {key!r} must have rotary_dim / 2 = {n} entries, got {got}")
    if not all(_is_number(x) and x > 0 for x in v):
        raise ValueError(f"longrope RoPE scaling: every entry of {key!r} must be a number > 0")
    s[key] = tuple(float(x) for x in v)


def resolve_rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The canonical variant named by a scaling dict (transformers' ``rope_scaling`` / ``rope_parameters``).

    ``rope_type``, else the 4.x ``type``, else ``"default"`` (for ``None`` or ``{}`` too); the legacy
    ``"su"`` (transformers 4.x's name of ``longrope``, Phi-3) reads as ``"longrope"``. Raises ``ValueError``
    when the name is not a string or not one of :data:`KNOWN_ROPE_TYPES`. Only the name is checked; see
    :func:`normalize_scaling` for the parameters.
    """
    s = scaling or {}
    rope_type = s.get("rope_type") or s.get("type") or "default"
    if not isinstance(rope_type, str):
        raise ValueError(f"'rope_type' must be a string, one of {list(KNOWN_ROPE_TYPES)}, got {rope_type!r}")
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in KNOWN_ROPE_TYPES:
        raise ValueError(f"unknown RoPE scaling 'rope_type' {rope_type!r}; known: {list(KNOWN_ROPE_TYPES)}")
    return rope_type


def normalize_scaling(scaling: Mapping[str, Any] | None, rotary_dim: int) -> dict[str, Any]:
    """Validate a scaling dict and return a canonical copy (``rope_type`` set, numbers as float/int).

    ``rope_type`` (or the 4.x ``type``) picks the variant; ``None`` or ``{}`` is ``default``. Keys that a
    variant does not use are kept but ignored. ``max_position_embeddings``, when present, supplies the
    default ``factor`` of ``yarn`` and ``longrope`` (``max_position_embeddings / original``), as in
    transformers. Raises ``ValueError`` naming the offending key and the expected value.
    """
    s: dict[str, Any] = dict(scaling or {})
    rope_type = resolve_rope_type(s)
    s.pop("rope_type", None)
    s.pop("type", None)
    s["rope_type"] = rope_type
    if rope_type == "default":
        return s

    mpe = s.get("max_position_embeddings")
    if mpe is not None:
        _positive_int(s, "max_position_embeddings", rope_type)
        if rope_type == "dynamic" and s.get("original_max_position_embeddings") is None:
            # transformers keys dynamic NTK on max_position_embeddings (the trained length).
            s["original_max_position_embeddings"] = s["max_position_embeddings"]
    if rope_type in ("yarn", "longrope") and s.get("factor") is None and mpe is not None:
        orig = s.get("original_max_position_embeddings")
        if _is_number(orig) and orig > 0:
            s["factor"] = s["max_position_embeddings"] / orig
    for key in _POSITIVE_FLOATS:
        _positive(s, key, rope_type, required=key == "factor" or (rope_type == "llama3" and "freq" in key))
    if rope_type != "linear":
        _positive_int(s, "original_max_position_embeddings", rope_type)

    if rope_type == "yarn":
        for key in ("mscale", "mscale_all_dim"):
            v = s.get(key)
            if v is not None and (not _is_number(v) or v < 0):
                raise ValueError(f"yarn RoPE scaling: {key!r} must be a number >= 0, got {v!r}")
        t = s.get("truncate", True)
        if not isinstance(t, bool):
            raise ValueError(f"yarn RoPE scaling: 'truncate' must be a bool, got {t!r}")
        s["truncate"] = t
    elif rope_type == "llama3":
        if s["high_freq_factor"] < s["low_freq_factor"]:
            raise ValueError(
                "llama3 RoPE scaling: 'high_freq_factor' must be >= 'low_freq_factor' "
                f"= {s['low_freq_factor']}, got {s['high_freq_factor']}"
            )
    elif rope_type == "longrope":
        _factor_list(s, "short_factor", rotary_dim)
        _factor_list(s, "long_factor", rotary_dim)
    return s


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(
    rotary_dim: int,
    base: float,
    original: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate=True,
) -> tuple[float, float]:
    """YaRN's ``(low, high)`` dimension bounds: ``corr(r) = d ln(O / (2 pi r)) / (2 ln b)`` for
    ``r = beta_fast`` and ``beta_slow``, rounded outward when ``truncate``, clamped to ``[0, d - 1]``."""

    def corr(r: float) -> float:
        return rotary_dim * math.log(original / (r * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def _exponents(rotary_dim: int) -> Tensor:
    return torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim


def inv_freq_and_attention_factor(
    rotary_dim: int, base: float, scaling: Mapping[str, Any], length: int
) -> tuple[Tensor, float]:
    """float64 CPU ``inv_freq [rotary_dim / 2]`` and the attention factor of a normalized ``scaling``.

    ``length`` is the length the table is keyed on (the largest length requested so far); only
    ``dynamic`` and ``longrope`` read it.
    """
    t = scaling["rope_type"]
    d = rotary_dim
    e = _exponents(d)
    if t == "default":
        return base**-e, 1.0
    f = scaling["factor"]
    if t == "linear":
        return base**-e / f, 1.0
    o = scaling["original_max_position_embeddings"]
    if t == "dynamic":
        if length > o and d > 2:
            base = base * ((f * length / o) - (f - 1)) ** (d / (d - 2))
        return base**-e, 1.0
    if t == "yarn":
        inv = base**-e
        attn = scaling.get("attention_factor")
        if attn is None:
            ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = (
                yarn_get_mscale(f, ms) / yarn_get_mscale(f, ms_all) if ms and ms_all else yarn_get_mscale(f)
            )
        low, high = yarn_correction_range(
            d,
            base,
            o,
            scaling.get("beta_fast") or 32.0,
            scaling.get("beta_slow") or 1.0,
            scaling.get("truncate", True),
        )
        if low == high:
            high += 0.001  # no singularity
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        # ramp 0: keep the trained (extrapolated) frequency; ramp 1: interpolate (divide by factor).
        return inv / f * ramp + inv * (1 - ramp), float(attn)
    if t == "llama3":
        inv = base**-e
        low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > o / low_ff, inv / f, inv)
        if high_ff > low_ff:
            smooth = (o / wavelen - low_ff) / (high_ff - low_ff)
            medium = (wavelen >= o / high_ff) & (wavelen <= o / low_ff)
            out = torch.where(medium, (1 - smooth) * inv / f + smooth * inv, out)
        return out, 1.0
    if t == "longrope":
        ext = torch.tensor(scaling["long_factor" if length > o else "short_factor"], dtype=torch.float64)
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(o))
        return 1.0 / (ext * base**e), float(attn)
    raise ValueError(f"unknown RoPE scaling 'rope_type' {t!r}; known: {list(KNOWN_ROPE_TYPES)}")

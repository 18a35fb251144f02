"""RoPE scaling variants: validated parameters, then float64 ``inv_freq`` and an attention factor.

A *scaling* is a plain dict in transformers' vocabulary (the ``rope_scaling`` / ``rope_parameters`` keys)::

    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

:func:`resolve_rope_type` is the one place that reads the variant's name (``rope_type``, the 4.x ``type``,
the legacy ``"su"`` alias of ``longrope``) and rejects unknown ones; :func:`normalize_scaling` checks the
whole dict once (:class:`RopeScalingError`, a ``ValueError`` naming the key and the expected value, and
also a ``KeyError`` / ``TypeError`` / ``RuntimeError`` where transformers raises one for the same dict)
and returns a canonical dict;
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
    "RopeScalingError",
    "RopeScalingKeyError",
    "RopeScalingTypeError",
    "RopeScalingLengthError",
    "resolve_rope_type",
    "normalize_scaling",
    "inv_freq_and_attention_factor",
    "yarn_correction_range",
    "yarn_get_mscale",
]

KNOWN_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LENGTH_DEPENDENT: frozenset[str] = frozenset({"dynamic", "longrope"})
_ALIASES = {"su": "longrope"}  # transformers 4.x legacy name of longrope (Phi-3)


class RopeScalingError(ValueError):
    """A scaling dict rejected by :func:`resolve_rope_type` or :func:`normalize_scaling` (a ``ValueError``).

    Where transformers (5.x) raises for the same dict, the error is also an instance of the class it raises:

    * :class:`RopeScalingKeyError` (``KeyError``): a required key is missing (transformers' validation), or
      ``rope_type`` names no variant (transformers' lookup of the init function);
    * :class:`RopeScalingTypeError` (``TypeError``): a value of the wrong type, ``None`` for a required key
      included (transformers fails where it uses the value);
    * :class:`RopeScalingLengthError` (``RuntimeError``): a longrope factor list whose length is not
      ``rotary_dim / 2`` (torch's broadcasting error in transformers).

    A plain ``RopeScalingError`` is a value transformers only warns about and computes with anyway (a
    ``factor`` <= 0, ``high_freq_factor < low_freq_factor``, ...). Unknown keys are ignored (transformers
    warns).
    """

    __str__ = BaseException.__str__  # the message as is (KeyError's __str__ would quote it)


class RopeScalingKeyError(RopeScalingError, KeyError):
    """A required key is missing, or ``rope_type`` is not a known variant (transformers: ``KeyError``)."""


class RopeScalingTypeError(RopeScalingError, TypeError):
    """A value of the wrong type, e.g. ``None`` or a string for a number (transformers: ``TypeError``)."""


class RopeScalingLengthError(RopeScalingError, RuntimeError):
    """A longrope ``short_factor`` / ``long_factor`` of the wrong length (transformers: ``RuntimeError``)."""


# The keys each variant needs: transformers' required keys, less ``rope_type`` and ``rope_theta`` (the base
# is an argument here). ``dynamic`` also needs the trained length (transformers reads the config's
# ``max_position_embeddings``). ``original_max_position_embeddings`` defaults to ``max_position_embeddings``
# when the dict has it, as transformers' standardization does.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
# The numbers (> 0) each variant reads; other keys are kept but not checked (transformers only warns).
_NUMBERS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "attention_factor", "beta_fast", "beta_slow"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "attention_factor"),
}


def _expected(key: str, rotary_dim: int) -> str:
    if key.endswith("max_position_embeddings"):
        return "the trained length, an int > 0"
    if key in ("short_factor", "long_factor"):
        return f"a list of {rotary_dim // 2} numbers > 0"
    return "a number > 0"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(s: dict, key: str, rope_type: str, required: bool = False) -> None:
    v = s.get(key)
    if v is None:
        if required:
            raise RopeScalingTypeError(
                f"{rope_type} RoPE scaling needs {key!r} (expected a number > 0), got None"
            )
        return
    msg = f"{rope_type} RoPE scaling: {key!r} must be a number > 0, got {v!r}"
    if not _is_number(v):
        raise RopeScalingTypeError(msg)
    if not math.isfinite(v) or v <= 0:
        raise RopeScalingError(msg)
    s[key] = float(v)


def _positive_int(s: dict, key: str, rope_type: str) -> None:
    v = s.get(key)
    if v is None:
        raise RopeScalingTypeError(
            f"{rope_type} RoPE scaling needs {key!r} (expected the trained length, an int > 0), got None"
        )
    msg = f"{rope_type} RoPE scaling: {key!r} must be an int > 0, got {v!r}"
    if not _is_number(v):
        raise RopeScalingTypeError(msg)
    if not math.isfinite(v) or v <= 0 or int(v) != v:
        raise RopeScalingError(msg)
    s[key] = int(v)


def _factor_list(s: dict, key: str, rotary_dim: int) -> None:
    v = s[key]
    n = rotary_dim // 2
    if isinstance(v, Tensor):
        v = v.tolist()
    if not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        raise RopeScalingTypeError(
            f"longrope RoPE scaling: {key!r} must be a list of {n} numbers > 0, got {v!r}"
        )
    if len(v) != n:
        raise RopeScalingLengthError(
            f"longrope RoPE scaling: {key!r} must have rotary_dim / 2 = {n} entries, got {len(v)}"
        )
    msg = f"longrope RoPE scaling: every entry of {key!r} must be a number > 0"
    if not all(_is_number(x) for x in v):
        raise RopeScalingTypeError(msg)
    if not all(math.isfinite(x) and x > 0 for x in v):
        raise RopeScalingError(msg)
    s[key] = tuple(float(x) for x in v)


def resolve_rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The canonical variant named by a scaling dict (transformers' ``rope_scaling`` / ``rope_parameters``).

    ``rope_type`` when the key is present, else the 4.x ``type``, else ``"default"`` (for ``None`` or ``{}``
    too), as transformers reads it; the legacy ``"su"`` (transformers 4.x's name of ``longrope``, Phi-3)
    reads as ``"longrope"``. Raises :class:`RopeScalingKeyError` (a ``KeyError`` and a ``ValueError``, like
    transformers' ``KeyError``) when the name is not a string or not one of :data:`KNOWN_ROPE_TYPES`
    (``None`` included). Only the name is checked; see :func:`normalize_scaling` for the parameters.
    """
    s = scaling or {}
    rope_type = s["rope_type"] if "rope_type" in s else s.get("type", "default")
    if not isinstance(rope_type, str):
        raise RopeScalingKeyError(
            f"'rope_type' must be a string, one of {list(KNOWN_ROPE_TYPES)}, got {rope_type!r}"
        )
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in KNOWN_ROPE_TYPES:
        raise RopeScalingKeyError(
            f"unknown RoPE scaling 'rope_type' {rope_type!r}; known: {list(KNOWN_ROPE_TYPES)}"
        )
    return rope_type


def normalize_scaling(scaling: Mapping[str, Any] | None, rotary_dim: int) -> dict[str, Any]:
    """Validate a scaling dict and return a canonical copy (``rope_type`` set, numbers as float/int).

    ``rope_type`` (or the 4.x ``type``) picks the variant; ``None`` or ``{}`` is ``default``. The keys each
    variant requires are transformers' (``factor`` for all but ``default`` and ``longrope``;
    ``low_freq_factor`` / ``high_freq_factor`` for ``llama3``; ``short_factor`` / ``long_factor`` for
    ``longrope``), plus ``original_max_position_embeddings`` (not for ``linear``).
    ``max_position_embeddings``, when present, is the default of ``original_max_position_embeddings`` and
    turns a ``factor`` of ``None`` (``yarn``; absent or ``None`` for ``longrope``) into
    ``max_position_embeddings / original``, as in transformers. Keys that a variant does not use are kept
    but neither checked nor used.

    Raises :class:`RopeScalingError` (a ``ValueError``) naming the offending key and the expected value; its
    subclasses are also ``KeyError`` (missing key, unknown ``rope_type``), ``TypeError`` (wrong type, ``None``
    for a required value) or ``RuntimeError`` (longrope list length), the classes transformers raises for the
    same dicts. Stricter than transformers where it only warns: numbers must be finite and > 0, ``mscale`` /
    ``mscale_all_dim`` >= 0, ``truncate`` a bool, ``high_freq_factor >= low_freq_factor``, longrope lists
    exactly ``rotary_dim / 2`` long.
    """
    s: dict[str, Any] = dict(scaling or {})
    rope_type = resolve_rope_type(s)
    s.pop("rope_type", None)
    s.pop("type", None)
    s["rope_type"] = rope_type
    if rope_type == "default":
        return s

    orig_key = "original_max_position_embeddings"
    if s.get("max_position_embeddings") is not None:
        _positive_int(s, "max_position_embeddings", rope_type)
        if rope_type != "linear" and (orig_key not in s or (rope_type == "dynamic" and s[orig_key] is None)):
            # transformers' standardization (setdefault), and dynamic NTK's trained length.
            s[orig_key] = s["max_position_embeddings"]
    for key in _REQUIRED[rope_type]:
        if key not in s:
            hint = " or 'max_position_embeddings'" if key == orig_key else ""
            raise RopeScalingKeyError(
                f"{rope_type} RoPE scaling needs {key!r}{hint} (expected {_expected(key, rotary_dim)})"
            )
    if rope_type != "linear":
        _positive_int(s, orig_key, rope_type)
    if rope_type in ("yarn", "longrope") and s.get("factor") is None:
        if s.get("max_position_embeddings") is None:
            raise RopeScalingKeyError(
                f"{rope_type} RoPE scaling needs 'factor' (expected a number > 0), or "
                "'max_position_embeddings' to take it from (max_position_embeddings / original)"
            )
        s["factor"] = s["max_position_embeddings"] / s[orig_key]
    for key in _NUMBERS[rope_type]:
        _positive(s, key, rope_type, required=key in _REQUIRED[rope_type])

    if rope_type == "yarn":
        for key in ("mscale", "mscale_all_dim"):
            v = s.get(key)
            if v is not None and not _is_number(v):
                raise RopeScalingTypeError(f"yarn RoPE scaling: {key!r} must be a number >= 0, got {v!r}")
            if v is not None and (not math.isfinite(v) or v < 0):
                raise RopeScalingError(f"yarn RoPE scaling: {key!r} must be a number >= 0, got {v!r}")
        t = s.get("truncate", True)
        if not isinstance(t, bool):
            raise RopeScalingTypeError(f"yarn RoPE scaling: 'truncate' must be a bool, got {t!r}")
        s["truncate"] = t
    elif rope_type == "llama3":
        if s["high_freq_factor"] < s["low_freq_factor"]:
            raise RopeScalingError(
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


# Every tensor here is made with an explicit device and dtype: the frequencies are float64 on the CPU
# whatever the default device (``with torch.device("meta")``, ``torch.set_default_device``) or the default
# dtype (``torch.set_default_dtype``) is, so a model built on the meta device gets real values.
_CPU = torch.device("cpu")


def _exponents(rotary_dim: int) -> Tensor:
    return torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=_CPU) / rotary_dim


def inv_freq_and_attention_factor(
    rotary_dim: int, base: float, scaling: Mapping[str, Any], length: int
) -> tuple[Tensor, float]:
    """float64 CPU ``inv_freq [rotary_dim / 2]`` and the attention factor of a normalized ``scaling``
    (float64 on the CPU whatever the default device and dtype are).

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
        ramp = ((torch.arange(d // 2, dtype=torch.float64, device=_CPU) - low) / (high - low)).clamp(0, 1)
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
        factors = scaling["long_factor" if length > o else "short_factor"]
        ext = torch.tensor(factors, dtype=torch.float64, device=_CPU)
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(o))
        return 1.0 / (ext * base**e), float(attn)
    raise ValueError(f"unknown RoPE scaling 'rope_type' {t!r}; known: {list(KNOWN_ROPE_TYPES)}")

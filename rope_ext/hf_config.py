"""Read the RoPE settings out of a transformers config (object or dict, 4.x or 5.x form)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .scaling import resolve_rope_type

__all__ = ["DEFAULT_MAX_POSITIONS", "default_table_lengths", "parse_hf_config"]

# Table length of a config without ``max_position_embeddings`` (and of RopeCache / RotaryEmbedding built
# without a config).
DEFAULT_MAX_POSITIONS = 2048

_MISSING = object()
# Keys of a flat rope parameters dict (to tell it from a dict nested per layer type).
_FLAT_KEYS = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"}


def _getter(config: Any):
    if isinstance(config, Mapping):
        return lambda key, default=None: config.get(key, default)
    return lambda key, default=None: getattr(config, key, default)


def _is_nested(params: Mapping[str, Any]) -> bool:
    return (
        bool(params)
        and not (_FLAT_KEYS & set(params))
        and all(v is None or isinstance(v, Mapping) for v in params.values())
    )


def parse_hf_config(config: Any, *, layer_type: str | None = None) -> tuple[int, int, float, dict[str, Any]]:
    """``(head_dim, rotary_dim, base, scaling)`` of a transformers config.

    See :meth:`rope_ext.RopeCache.from_hf_config` for the forms read.

    ``scaling`` is an un-normalized dict ready for :func:`rope_ext.scaling.normalize_scaling`, with the
    lengths transformers would use: ``original_max_position_embeddings`` (top-level value first, as
    transformers does for Phi-3, then the rope dict's, then ``max_position_embeddings``) and, for
    ``dynamic``, ``max_position_embeddings``.
    """
    get = _getter(config)
    if get("head_dim") is None and get("hidden_size") is None and get("text_config") is not None:
        return parse_hf_config(get("text_config"), layer_type=layer_type)

    params = get("rope_parameters")
    legacy = params is None
    if legacy:
        params = get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"'rope_parameters' / 'rope_scaling' must be a dict, got {type(params).__name__}")
    if _is_nested(params):
        if layer_type is None:
            raise ValueError(
                f"'rope_parameters' is nested per layer type; pass layer_type= one of {sorted(params)}"
            )
        if params.get(layer_type) is None:
            raise ValueError(
                f"'rope_parameters' has no entry for layer_type {layer_type!r}; has {sorted(params)}"
            )
        params = params[layer_type]
    params = dict(params)

    base = params.get("rope_theta", _MISSING)
    if base is _MISSING or base is None:
        base = get("rope_theta", None)
    if base is None:
        base = 10000.0  # transformers' default_theta

    head_dim = get("head_dim")
    if head_dim is None:
        # MLA (DeepSeek-V2/V3, Kimi-K2): the rotated part of a head, which transformers calls head_dim
        head_dim = get("qk_rope_head_dim")
    if head_dim is None:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if hidden is None or heads is None:
            raise ValueError(
                "config needs 'head_dim' (expected an int > 0) or 'hidden_size' and 'num_attention_heads'"
            )
        head_dim = hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"'head_dim' must be an int > 0, got {head_dim!r}")

    prf = params.get("partial_rotary_factor")
    if prf is None:
        prf = get("partial_rotary_factor")
    if prf is None:
        prf = get("rotary_pct")
    if prf is not None:
        if not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ValueError(f"'partial_rotary_factor' must be in (0, 1], got {prf!r}")
        rotary_dim = int(head_dim * prf)
    else:
        rotary_dim = get("rotary_dim") or head_dim  # GPT-J names the rotary size directly
    if not isinstance(rotary_dim, int) or rotary_dim > head_dim:
        raise ValueError(f"'rotary_dim' must be an int <= head_dim = {head_dim}, got {rotary_dim!r}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"rotary dim (head_dim * partial_rotary_factor) must be even and > 0, got {rotary_dim}"
        )

    rope_type = resolve_rope_type(params)  # "su" alias and unknown names: scaling.py
    skip = ("rope_theta", "partial_rotary_factor", "type", "mrope_section", "mrope_interleaved")
    scaling = {k: v for k, v in params.items() if k not in skip}
    scaling["rope_type"] = rope_type

    mpe = get("max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope"):
        top = get("original_max_position_embeddings")
        if top is not None:
            scaling["original_max_position_embeddings"] = top
        elif "original_max_position_embeddings" not in scaling and mpe is not None:
            # transformers' setdefault: an explicit None stays (and is rejected, as transformers does)
            scaling["original_max_position_embeddings"] = mpe
    if rope_type == "dynamic" and mpe is not None:
        scaling["original_max_position_embeddings"] = mpe  # transformers' dynamic NTK trained length
    if mpe is not None and rope_type in ("yarn", "longrope"):
        scaling["max_position_embeddings"] = mpe
    return head_dim, rotary_dim, float(base), scaling


def default_table_lengths(config: Any, scaling: Mapping[str, Any]) -> tuple[int, int]:
    """``(seq_len, positions)`` of the table ``from_hf_config`` builds when no ``max_positions`` is given.

    ``positions`` (the rows available: ``0 .. positions-1``) is the config's ``max_position_embeddings``
    (read through ``text_config`` like :func:`parse_hf_config`), or :data:`DEFAULT_MAX_POSITIONS` when the
    config has none. ``seq_len`` (the length the frequencies of ``dynamic`` / ``longrope`` are keyed on) is
    the one transformers' rotary module starts from: ``positions`` for every variant but ``longrope``
    (``dynamic``: ``original_max_position_embeddings`` is ``max_position_embeddings``, so the base is
    unscaled), and ``min(positions, original_max_position_embeddings)`` for ``longrope``, whose module
    starts with the short factors. ``scaling`` is :func:`parse_hf_config`'s.
    """
    get = _getter(config)
    if get("head_dim") is None and get("hidden_size") is None and get("text_config") is not None:
        return default_table_lengths(get("text_config"), scaling)
    mpe = get("max_position_embeddings")
    if mpe is None:
        positions = DEFAULT_MAX_POSITIONS
    elif isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1:
        raise ValueError(f"'max_position_embeddings' must be an int > 0, got {mpe!r}")
    else:
        positions = mpe
    original = scaling.get("original_max_position_embeddings")
    if scaling.get("rope_type") == "longrope" and isinstance(original, int) and original >= 1:
        return min(positions, original), positions
    return positions, positions


def parse_mrope(
    config: Any, *, layer_type: str | None = None
) -> tuple[tuple[int, int, int] | None, bool | str]:
    """``(mrope_section, mrope_interleaved)`` of a transformers config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
    ERNIE-4.5-VL): read from ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x), through ``text_config``
    when the config has no head size of its own; ``(None, False)`` when the model has no MRoPE. ERNIE-4.5-VL
    lists its sections as (height, width, temporal) and alternates height and width pair by pair: its
    ``(h, w, t)`` becomes ``((t, h, w), "alternating")``."""
    get = _getter(config)
    if get("head_dim") is None and get("hidden_size") is None and get("text_config") is not None:
        return parse_mrope(get("text_config"), layer_type=layer_type)
    params = get("rope_parameters")
    if params is None:
        params = get("rope_scaling") or {}
    if _is_nested(params) and layer_type is not None:
        params = params.get(layer_type) or {}
    section = params.get("mrope_section") if isinstance(params, Mapping) else None
    if section is None:
        return None, False
    if len(section) != 3 or not all(isinstance(v, int) and v >= 0 for v in section):
        raise ValueError(f"'mrope_section' must be 3 non-negative ints, got {section!r}")
    if "ernie4_5_vl" in str(get("model_type") or ""):
        return (section[2], section[0], section[1]), "alternating"
    return tuple(section), bool(params.get("mrope_interleaved", False))

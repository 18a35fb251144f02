"""Float64 reference implementations of the rotary map, written for clarity.

Three independent forms of the same linear map (they agree to ~1e-15):

* :func:`rotary_matrix`   - build the block-diagonal rotation ``R(p)`` and compute ``x R(p)``;
* :func:`rotary_complex`  - view each pair as a complex number and multiply by ``e^{i a}``;
* :func:`rotary_hadamard` - ``x * cos + rot(x) * sin`` element-wise.

Each takes the arguments of :func:`rope_ext.apply_rotary` (``x [..., head_dim]``, integer ``positions``
broadcastable to ``x.shape[:-1]``, ``cos_sin [P, rotary_dim]`` = cos half then sin half) and returns a
float64 tensor of x's shape; features ``[rotary_offset, rotary_offset + rotary_dim)`` are rotated, the
others passed through. ``inverse=True`` rotates by the negative angle. With ``mrope_section`` (MRoPE),
``positions`` is ``[3, ...]`` and pair ``j`` uses the row of section ``mrope_rows(...)[j]``. Pairs are
``(j, j + rotary_dim/2)`` (half-split, GPT-NeoX / HF ``rotate_half``) or ``(2j, 2j+1)`` when
``interleaved`` (GPT-J / RoFormer / complex form).

The HF-style eager formula the benchmark times (in the input dtype, not a reference) is in
:mod:`rope_ext.bench.baselines`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .positions import positions_shape

__all__ = [
    "inv_freq",
    "cos_sin_table",
    "rotary_matrix",
    "rotary_complex",
    "rotary_hadamard",
    "mrope_rows",
    "rotate_half",
]


def inv_freq(rotary_dim: int, base: float = 10000.0) -> Tensor:
    """``base ** (-2j / rotary_dim)`` for ``j < rotary_dim / 2``, float64 ``[rotary_dim / 2]`` on the CPU
    (whatever the default device)."""
    return base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim)


def cos_sin_table(n_positions: int, rotary_dim: int, base: float = 10000.0) -> Tensor:
    """Float64 ``[n_positions, rotary_dim]`` on the CPU: ``cos(p inv_j)`` for ``j < rotary_dim/2``, then
    ``sin``."""
    p = torch.arange(n_positions, dtype=torch.float64, device="cpu")
    angles = p[:, None] * inv_freq(rotary_dim, base)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def mrope_rows(half: int, mrope_section, mrope_interleaved: bool | int | str = False) -> Tensor:
    """Several position axes (MRoPE: 0 temporal, 1 height, 2 width): the axis whose position rotates each of
    the ``half`` pairs, int64 ``[half]``. Contiguous sections (Qwen2-VL, FLUX): ``mrope_section[0]`` pairs
    of axis 0, then ``mrope_section[1]`` of axis 1, and so on. Interleaved (``True``, Qwen3-VL; ``n``
    axes): pair ``j`` takes axis ``a = j % n`` when ``a > 0 and j < n * mrope_section[a]``, else axis 0
    (with 3 axes: height when ``j % 3 == 1 and j < 3 h``, width when ``j % 3 == 2 and j < 3 w``, else
    temporal). Alternating (``"alternating"`` or 2, ERNIE-4.5-VL; ``mrope_section[1:]`` equal): axes
    ``1 .. n-1`` take turns from pair 0, pair ``j`` on axis ``1 + j % (n - 1)`` while
    ``j < (n - 1) * mrope_section[1]``, then axis 0 (with 3 axes: height, width, height, .., then
    temporal)."""
    layout = {"contiguous": 0, "interleaved": 1, "alternating": 2}.get(mrope_interleaved, mrope_interleaved)
    n = len(mrope_section)
    j = torch.arange(half)
    if layout == 2:
        m = n - 1
        return torch.where(j < m * mrope_section[1], 1 + j % m, 0)
    if layout:
        rows = torch.zeros(half, dtype=torch.long)
        for a in range(1, n):
            rows[(j % n == a) & (j < n * mrope_section[a])] = a
        return rows
    ends = torch.tensor(list(mrope_section), dtype=torch.long).cumsum(0)[:-1]
    return (j[:, None] >= ends[None, :]).long().sum(-1)


def _cos_sin(
    x: Tensor, positions: Tensor, cos_sin: Tensor, inverse: bool, mrope_section=None, mrope_interleaved=False
) -> tuple[Tensor, Tensor]:
    """Per-row cos and sin, float64 ``[*x.shape[:-1], rotary_dim / 2]``."""
    lead = positions.shape[:1] if mrope_section is not None else ()
    # token_major: the reading of every shape an op takes ([T] for [T, H, D] where the op is token-major).
    shape = positions_shape(positions.shape[len(lead) :], x.shape[:-1], token_major=True)
    rows = cos_sin.to(torch.float64)[positions.long().reshape((*lead, *shape))]
    h = cos_sin.shape[-1] // 2
    c, s = rows[..., :h], rows[..., h:]
    if mrope_section is not None:  # rows [n_axes, ..., rotary_dim]: pair j from its axis's row
        sec = mrope_rows(h, mrope_section, mrope_interleaved).to(rows.device)
        axis = sec.reshape((1,) * (c.dim() - 1) + (h,)).expand((1, *c.shape[1:]))
        c, s = c.gather(0, axis)[0], s.gather(0, axis)[0]
    if inverse:
        s = -s
    shape = (*x.shape[:-1], h)
    return c.expand(shape), s.expand(shape)


def _pairs(x: Tensor, rotary_dim: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    """The two features of every pair, each ``[..., rotary_dim / 2]``."""
    rot = x[..., :rotary_dim]
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    return rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]


def _unpairs(y1: Tensor, y2: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        return torch.stack([y1, y2], dim=-1).flatten(-2)
    return torch.cat([y1, y2], dim=-1)


def _with_pass(x: Tensor, rotated: Tensor, rotary_dim: int) -> Tensor:
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def _at_offset(form):
    """``form`` with its ``rotary_offset`` applied: the features before it pass through (as float64), the
    rest go to ``form``, which then sees ``rotary_offset=0``."""

    @functools.wraps(form)
    def with_offset(x: Tensor, positions: Tensor, cos_sin: Tensor, *, rotary_offset: int = 0, **kw) -> Tensor:
        if not rotary_offset:
            return form(x, positions, cos_sin, **kw)
        x = x.to(torch.float64)
        tail = form(x[..., rotary_offset:], positions, cos_sin, **kw)
        return torch.cat([x[..., :rotary_offset], tail], dim=-1)

    return with_offset


@_at_offset
def rotary_matrix(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> Tensor:
    """Rotation-matrix form: ``x' = x R(p)`` with ``R(p)`` block-diagonal 2x2 rotations (RoFormer)."""
    x = x.to(torch.float64)
    r = cos_sin.shape[-1]
    c, s = _cos_sin(x, positions, cos_sin, inverse, mrope_section, mrope_interleaved)
    R = torch.zeros(*x.shape[:-1], r, r, dtype=torch.float64, device=x.device)
    j = torch.arange(r // 2, device=x.device)
    i1, i2 = (2 * j, 2 * j + 1) if interleaved else (j, j + r // 2)
    # Row-vector convention: y[i1] = x[i1] c - x[i2] s, y[i2] = x[i1] s + x[i2] c.
    R[..., i1, i1] = c
    R[..., i2, i1] = -s
    R[..., i1, i2] = s
    R[..., i2, i2] = c
    rotated = (x[..., None, :r] @ R).squeeze(-2)
    return _with_pass(x, rotated, r)


@_at_offset
def rotary_complex(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> Tensor:
    """Complex form: pair ``j`` is ``z_j = x1 + i x2`` and ``z_j' = z_j e^{i a_j}`` (Meta's Llama)."""
    x = x.to(torch.float64)
    r = cos_sin.shape[-1]
    c, s = _cos_sin(x, positions, cos_sin, inverse, mrope_section, mrope_interleaved)
    x1, x2 = _pairs(x, r, interleaved)
    z = torch.view_as_complex(torch.stack([x1, x2], dim=-1).contiguous())
    w = torch.view_as_complex(torch.stack([c, s], dim=-1).contiguous())
    y = torch.view_as_real(z * w)
    return _with_pass(x, _unpairs(y[..., 0], y[..., 1], interleaved), r)


def rotate_half(x: Tensor) -> Tensor:
    """HF's ``rotate_half``: ``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


@_at_offset
def rotary_hadamard(
    x: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> Tensor:
    """Element-wise form: ``x' = x * cos + rot(x) * sin``, ``rot`` swapping each pair with a sign."""
    x = x.to(torch.float64)
    r = cos_sin.shape[-1]
    c, s = _cos_sin(x, positions, cos_sin, inverse, mrope_section, mrope_interleaved)
    x1, x2 = _pairs(x, r, interleaved)
    cos = _unpairs(c, c, interleaved)
    sin = _unpairs(s, s, interleaved)
    rot = _unpairs(-x2, x1, interleaved)
    return _with_pass(x, x[..., :r] * cos + rot * sin, r)


# Serving fusions: QK norm + rotary, KV-cache write -------------------------------------------------------

__all__ += [
    "rms_norm",
    "qk_norm_rotary",
    "qk_norm_rotary_unfused",
    "FP8_MAX",
    "quantize_fp8",
    "kv_cache_write",
]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""The largest finite value of each fp8 KV-cache dtype (what :func:`quantize_fp8` saturates to)."""


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, weight_offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dim, in float64: ``x / sqrt(mean(x^2) + eps) * (weight + weight_offset)``.

    ``x [..., N]`` and ``weight [N]`` of any float dtypes (both converted to float64 first);
    ``weight_offset=1.0`` is Gemma's ``(1 + weight)``. Returns float64 ``[..., N]``, never rounded.
    Differentiable in ``x`` and ``weight``.
    """
    x = x.to(torch.float64)
    ms = x.square().mean(dim=-1, keepdim=True)
    return x / torch.sqrt(ms + eps) * (weight.to(torch.float64) + weight_offset)


def _is_int(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _token_positions(positions: Tensor, tokens: int) -> Tensor:
    """``positions [T]`` (integer) as ``[T, 1]``, broadcastable to ``[T, H]``."""
    if not _is_int(positions):
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.shape != (tokens,):
        raise ValueError(f"positions must be [T] = [{tokens}], got {list(positions.shape)}")
    return positions.reshape(tokens, 1)


def qk_norm_rotary(
    qkv: Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    q_weight: Tensor,
    k_weight: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    eps: float = 1e-6,
    interleaved: bool = False,
    weight_offset: float = 0.0,
) -> Tensor:
    """Per-head QK RMSNorm then rotary on a packed ``qkv`` (vLLM's ``fused_qk_norm_rope``), as a new tensor.

    ``qkv [T, (Hq + Hk + Hv) * D]`` (float32, float16 or bfloat16; ``D = qkv.shape[-1] // (Hq+Hk+Hv)``)
    holds, per token, ``Hq`` query heads, then ``Hk`` key heads, then ``Hv`` value heads of ``D``
    features. ``q_weight``, ``k_weight``: ``[D]``, any float dtype. ``positions``: integer ``[T]``.
    ``cos_sin [P, rotary_dim]`` as for :func:`rotary_hadamard`; ``rotary_dim < D`` is partial rotary
    (features ``[rotary_dim, D)`` pass through after the norm).

    Each q head (with ``q_weight``) and each k head (with ``k_weight``) is :func:`rms_norm`-ed over its
    ``D`` features in float64, scaled by ``weight + weight_offset`` and rounded once to ``qkv.dtype``
    (the norm output in the activation dtype, as the unfused model hands it to the rotary), then rotated
    by :func:`rotary_hadamard` in float64 from those rounded values and rounded to ``qkv.dtype``. The
    ``v`` heads are copied bit for bit. Returns a tensor of ``qkv``'s shape and dtype; ``qkv`` is not
    modified.

    The rounding between norm and rotary is part of this definition: vLLM's CUDA kernel keeps the
    normalised value in float32 registers and rounds only the rotated result, so the two can differ by
    the rotary's image of one half-ulp of the norm output.
    """
    counts = (num_heads_q, num_heads_k, num_heads_v)
    if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in counts) or not (
        num_heads_q and num_heads_k
    ):
        raise ValueError(f"head counts must be ints, q and k >= 1, v >= 0; got {counts}")
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T, (Hq+Hk+Hv)*D], got {list(qkv.shape)}")
    heads = sum(counts)
    tokens, width = qkv.shape
    if width % heads:
        raise ValueError(f"qkv.shape[-1]={width} is not a multiple of Hq+Hk+Hv={heads}")
    d = width // heads
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(
            f"q_weight and k_weight must be [D] = [{d}], got {list(q_weight.shape)}, {list(k_weight.shape)}"
        )
    if cos_sin.shape[-1] > d or cos_sin.shape[-1] % 2:
        raise ValueError(f"rotary_dim={cos_sin.shape[-1]} must be even and <= D={d}")
    pos = _token_positions(positions, tokens)
    x = qkv.reshape(tokens, heads, d)
    q = x[:, :num_heads_q]
    k = x[:, num_heads_q : num_heads_q + num_heads_k]
    v = x[:, num_heads_q + num_heads_k :]

    def one(h: Tensor, weight: Tensor) -> Tensor:
        normed = rms_norm(h, weight, eps, weight_offset).to(qkv.dtype)
        return rotary_hadamard(normed, pos, cos_sin, interleaved=interleaved).to(qkv.dtype)

    return torch.cat([one(q, q_weight), one(k, k_weight), v], dim=1).reshape(qkv.shape)


def qk_norm_rotary_unfused(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    *,
    eps: float = 1e-6,
    interleaved: bool = False,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """QK RMSNorm then rotary on separate heads, all in float64 with no intermediate rounding.

    ``q [T, Hq, D]``, ``k [T, Hk, D]``, ``q_weight``, ``k_weight`` ``[D]`` (any float dtypes),
    ``positions`` integer ``[T]``, ``cos_sin [P, rotary_dim]`` with ``rotary_dim <= D``. Returns float64
    ``(q', k')`` of q's and k's shapes: ``rotary_hadamard(rms_norm(h, w, eps, weight_offset))`` per head.
    Built from plain differentiable torch ops, so autograd gives the gradients with respect to ``q``,
    ``k``, ``q_weight`` and ``k_weight`` (the reference for a hand-written backward). Equal to
    :func:`qk_norm_rotary` up to that function's two roundings to the activation dtype.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k must be [T, H, D] with equal T and D, got {list(q.shape)}, {list(k.shape)}")
    pos = _token_positions(positions, q.shape[0])

    def one(h: Tensor, weight: Tensor) -> Tensor:
        normed = rms_norm(h, weight, eps, weight_offset)
        return rotary_hadamard(normed, pos, cos_sin, interleaved=interleaved)

    return one(q, q_weight), one(k, k_weight)


def quantize_fp8(x: Tensor, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """Saturating scaled conversion to fp8, as vLLM's fp8 KV cache stores values.

    ``x`` of any float dtype and shape is converted to float32, divided by ``scale`` (a one-element
    float32 tensor, or a number) in float32, clamped to ``[-FP8_MAX[dtype], FP8_MAX[dtype]]`` (448 for
    ``torch.float8_e4m3fn``, 57344 for ``torch.float8_e5m2``; infinities saturate too) and converted with
    torch's own ``.to(dtype)`` (round to nearest even). NaN stays NaN (its sign is not specified). This
    matches vLLM's ``scaled_convert`` (``x / scale`` in float32, then a ``__NV_SATFINITE`` conversion).
    Returns a ``dtype`` tensor of x's shape on x's device.
    """
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.numel() != 1:
        raise ValueError(f"scale must have one element, got shape {list(s.shape)}")
    m = FP8_MAX[dtype]
    y = x.to(torch.float32) / s.reshape(())
    # clamp, NaN kept
    return torch.where(y.isnan(), y, y.clamp(-m, m)).to(dtype)


def kv_cache_write(
    k: Tensor,
    v: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    layout: str = "NHD",
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Paged KV-cache write (vLLM's ``reshape_and_cache_flash``): new caches with ``k``, ``v`` stored.

    ``k [T, Hk, D]`` (already rotated) and ``v [T, Hk, Dv]`` of one float dtype. Caches:
    ``layout="NHD"``: ``[num_blocks, block_size, Hk, D]``; ``"HND"``: ``[num_blocks, Hk, block_size, D]``
    (``Dv`` for ``value_cache``). ``slot_mapping``: integer (int64) ``[T']`` with ``T' <= T``: token ``t``
    goes to block ``slot // block_size``, offset ``slot % block_size``; slot ``-1`` skips the token, and
    tokens ``t >= T'`` are not written. Slots must be ``-1`` or in ``[0, num_blocks * block_size)`` and
    distinct (ValueError otherwise).

    The caches' dtype is k's dtype (values stored as they are; ``k_scale``/``v_scale`` are then ignored,
    as vLLM's ``kv_cache_dtype="auto"`` does) or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``: then each
    stored value is :func:`quantize_fp8` ``(x, scale, cache dtype)``, i.e. ``x / scale`` computed in
    float32 and saturated to the fp8 type's finite max, as vLLM's fp8 KV cache does; ``k_scale``,
    ``v_scale`` are one-element float32 tensors (``None`` is 1.0).

    Returns ``(key_cache', value_cache')``, clones of the inputs with the written slots replaced; every
    other slot keeps its bits. The inputs are not modified.
    """
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k, v must be [T, Hk, D] with equal T and Hk, got {list(k.shape)}, {list(v.shape)}")
    if k.dtype != v.dtype or not k.dtype.is_floating_point:
        raise TypeError(f"k and v must share one float dtype, got {k.dtype}, {v.dtype}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (k.dtype, *FP8_MAX):
        raise TypeError(
            f"caches must share k's dtype ({k.dtype}) or an fp8 dtype, got {key_cache.dtype}, "
            f"{value_cache.dtype}"
        )
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError("key_cache and value_cache must be 4-d")
    if layout == "NHD":
        num_blocks, block_size = key_cache.shape[:2]
        want_k = (num_blocks, block_size, k.shape[1], k.shape[2])
        want_v = (num_blocks, block_size, v.shape[1], v.shape[2])
    else:
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[2]
        want_k = (num_blocks, k.shape[1], block_size, k.shape[2])
        want_v = (num_blocks, v.shape[1], block_size, v.shape[2])
    if key_cache.shape != want_k or value_cache.shape != want_v:
        raise ValueError(
            f"{layout} caches for k {list(k.shape)}, v {list(v.shape)} must be {list(want_k)}, "
            f"{list(want_v)}; got {list(key_cache.shape)}, {list(value_cache.shape)}"
        )
    if not _is_int(slot_mapping):
        raise TypeError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(
            f"slot_mapping must be [T'] with T' <= T={k.shape[0]}, got {list(slot_mapping.shape)}"
        )
    slots = slot_mapping.to(device=k.device, dtype=torch.int64)
    n_slots = num_blocks * block_size
    bad = (slots < -1) | (slots >= n_slots)
    if bad.any():
        raise ValueError(f"slots must be -1 or in [0, {n_slots}), got {slots[bad].tolist()}")
    tokens = (slots >= 0).nonzero().flatten()
    written = slots[tokens]
    if written.unique().numel() != written.numel():
        raise ValueError("slot_mapping writes one slot twice")
    block, offset = written // block_size, written % block_size

    def store(x: Tensor, cache: Tensor, scale) -> Tensor:
        out = cache.clone()
        vals = x[tokens]
        if cache.dtype in FP8_MAX:
            vals = quantize_fp8(vals, 1.0 if scale is None else scale, cache.dtype)
        if layout == "NHD":
            out[block, offset] = vals
        else:
            out[block, :, offset] = vals
        return out

    return store(k, key_cache, k_scale), store(v, value_cache, v_scale)


# MLA (DeepSeek-V2/V3) rotary + latent-cache write -----------------------------------------------------

__all__ += ["mla_cache_write"]


def mla_cache_write(
    q: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    *,
    rotary_offset: int = 0,
    interleaved: bool = False,
    kv_scale: Tensor | None = None,
    q_out: Tensor | None = None,
    q_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """What ``rope_ext.apply_mla_rotary_and_cache_`` computes (vLLM's MLA rotary + ``concat_and_cache_mla``),
    as new tensors: ``(q', k_pe', kv_cache')``. The inputs are not modified.

    ``q [T, H, D]``, ``kv_c [T, L]``, ``k_pe [T, R]`` or ``[T, 1, R]`` of one float dtype; ``positions``
    integer ``[T]``; ``cos_sin [P, R]``; ``kv_cache [num_blocks, block_size, L + R]`` of q's dtype or fp8;
    ``slot_mapping`` integer ``[T']`` with ``T' <= T``: -1 or distinct slots in the cache, as for
    :func:`kv_cache_write` (ValueError otherwise).

    * ``q'``: float64 :func:`rotary_hadamard` of q (features ``[rotary_offset, rotary_offset + R)``
      rotated, the others passed through); with ``q_out`` of q's dtype, the same (q_out's expected
      values); with an fp8 ``q_out``, ``quantize_fp8(q' rounded to q's dtype, q_scale, q_out.dtype)``
      (``q_scale`` None is 1.0; only q_out's dtype is read).
    * ``k_pe'``: float64 :func:`rotary_hadamard` of k_pe (all R features, offset 0), of k_pe's shape.
    * ``kv_cache'``: a clone of kv_cache where row ``slot_mapping[t]`` of ``kv_cache.view(-1, L + R)``
      holds ``cat(kv_c[t], k_pe'[t] rounded to k_pe's dtype)`` for every token with a slot other than -1
      (fp8: :func:`quantize_fp8` of each with ``kv_scale``, None is 1.0); the other rows keep their bits.
      The rounding is the float64 value's (round to nearest even), which a float32 kernel can miss by an
      ulp: compare an op's cache bit for bit only where its rotated k_pe has the same bits.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {list(q.shape)}")
    tokens = q.shape[0]
    if not (k_pe.dim() == 2 or (k_pe.dim() == 3 and k_pe.shape[1] == 1)):
        raise ValueError(f"k_pe must be [T, R] or [T, 1, R], got {list(k_pe.shape)}")
    r = cos_sin.shape[-1]
    if kv_c.dim() != 2 or kv_c.shape[0] != tokens or k_pe.shape[0] != tokens or k_pe.shape[-1] != r:
        raise ValueError(
            f"kv_c must be [T, L] and k_pe [T, R] (T = {tokens}, R = {r}), got {list(kv_c.shape)}, "
            f"{list(k_pe.shape)}"
        )
    if not (kv_c.dtype == k_pe.dtype == q.dtype and q.dtype.is_floating_point) or q.dtype in FP8_MAX:
        raise TypeError(
            f"q, kv_c and k_pe must share one float dtype, got {q.dtype}, {kv_c.dtype}, {k_pe.dtype}"
        )
    if r % 2 or not 0 <= rotary_offset <= q.shape[-1] - r:
        raise ValueError(f"rotary_offset={rotary_offset}, R={r} must fit in D={q.shape[-1]} (R even)")
    lora = kv_c.shape[1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != lora + r:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {lora + r}], got {list(kv_cache.shape)}")
    if q_out is not None and (q_out.shape != q.shape or q_out.dtype not in (q.dtype, *FP8_MAX)):
        raise ValueError(f"q_out must be q's shape and dtype or fp8, got {list(q_out.shape)}, {q_out.dtype}")
    pos = _token_positions(positions, tokens)
    q_new = rotary_hadamard(q, pos, cos_sin, interleaved=interleaved, rotary_offset=rotary_offset)
    if q_out is not None and q_out.dtype in FP8_MAX:
        q_new = quantize_fp8(q_new.to(q.dtype), 1.0 if q_scale is None else q_scale, q_out.dtype)
    k3 = k_pe.reshape(tokens, 1, r)
    k_new = rotary_hadamard(k3, pos, cos_sin, interleaved=interleaved)
    # The latent cache is two NHD caches of one head: columns [0, L) (kv_c) and [L, L + R) (k_pe).
    rope_cols, lora_cols = kv_cache[:, :, None, lora:], kv_cache[:, :, None, :lora]
    kc, vc = kv_cache_write(
        k_new.to(k_pe.dtype),
        kv_c[:, None],
        rope_cols,
        lora_cols,
        slot_mapping,
        k_scale=kv_scale,
        v_scale=kv_scale,
    )
    return q_new, k_new.reshape(k_pe.shape), torch.cat([vc, kc], dim=-1)[:, :, 0]


# FlashInfer's page table: the slot of each token -----------------------------------------------------------

__all__ += ["page_table_slots"]


def page_table_slots(
    batch_indices: Tensor,
    positions: Tensor,
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor | None,
    block_size: int,
    num_blocks: int,
) -> Tensor:
    """The slot mapping of a page table (:class:`rope_ext.PageTable`, FlashInfer's ``append_paged_kv_cache``
    arguments), in plain Python: int64 ``[T']`` on the CPU, for the cache ops' ``slot_mapping``.

    Token ``t`` (``T' = len(batch_indices)``) is entry ``e = positions[t]`` of request ``b =
    batch_indices[t]``: slot ``page * block_size + e % block_size`` with ``page = kv_indices[kv_indptr[b] +
    e // block_size]``. ``-1`` (not written) when ``b == -1``, and also for every token the table cannot
    place, as the CUDA kernels skip it (the CPU op raises instead): ``b`` outside ``[0, batch_size)``
    (``batch_size = len(kv_indptr) - 1``); the request's pages ``kv_indptr[b] .. kv_indptr[b + 1]`` not in
    order within ``[0, len(kv_indices)]``; ``kv_last_page_len[b]`` outside ``[0, block_size]``; ``e``
    negative or past the request (its pages, and with ``kv_last_page_len`` its length ``max(pages - 1, 0) *
    block_size + kv_last_page_len[b]``); a page outside ``[0, num_blocks)``. Slots are not checked for
    repeats (:func:`kv_cache_write` refuses them). Integer 1-d tensors; ``batch_indices`` and
    ``positions`` of one length, ``kv_last_page_len`` (or None) ``[batch_size]`` (ValueError otherwise).
    """
    tables = (batch_indices, positions, kv_indices, kv_indptr)
    tables += () if kv_last_page_len is None else (kv_last_page_len,)
    if not all(_is_int(x) and x.dim() == 1 for x in tables):
        raise ValueError("page table tensors must be integer and 1-d")
    batch, pos, indices, indptr = (x.tolist() for x in tables[:4])
    n_req = len(indptr) - 1
    if len(pos) != len(batch) or n_req < 0:
        raise ValueError(
            f"batch_indices and positions must be [T'] and kv_indptr [batch_size + 1], got {len(batch)}, "
            f"{len(pos)}, {len(indptr)}"
        )
    last = None if kv_last_page_len is None else kv_last_page_len.tolist()
    if last is not None and len(last) != n_req:
        raise ValueError(f"kv_last_page_len must be [batch_size] = [{n_req}], got [{len(last)}]")

    def slot(b: int, e: int) -> int:
        if not 0 <= b < n_req:
            return -1
        first, end = indptr[b], indptr[b + 1]
        if not 0 <= first <= end <= len(indices):
            return -1
        pages = end - first
        length = pages * block_size
        if last is not None:
            if not 0 <= last[b] <= block_size:
                return -1
            length = max(pages - 1, 0) * block_size + last[b]
        if block_size <= 0 or not 0 <= e < min(length, pages * block_size):
            return -1
        page = indices[first + e // block_size]
        return page * block_size + e % block_size if 0 <= page < num_blocks else -1

    slots = [-1 if b == -1 else slot(b, e) for b, e in zip(batch, pos, strict=True)]
    return torch.tensor(slots, dtype=torch.int64)

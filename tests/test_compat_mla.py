"""The MLA adapters against plain-PyTorch float64 reimplementations of their peers' documented semantics:

* FlashInfer's ``mla_rope_quantize_fp8`` (``flashinfer.rope``): ``fp8(rotate(q_rope) * quant_scale_q)``,
  ``fp8(q_nope * quant_scale_q)``, the same for k with ``quant_scale_kv`` (the scales multiply; fp8
  conversion saturating, round to nearest even), inputs untouched;
* vLLM's ``concat_and_cache_mla_rope_fused`` (q_pe and k_pe rotated in place, ``[kv_c | k_pe]`` written to
  the latent cache at slot_mapping, fp8 as ``x / scale`` in a uint8 cache named by ``kv_cache_dtype``);
* vLLM's ``fuse_mla_decode_rope_q_concat_kv_insert`` (``q_out = [q_nope | rotate(q_pe)]``, fp8 ``x /
  q_scale`` of the float32 values, and the same cache write from a read-only ``kv = [kv_c | k_pe]``).

Rotations: within an ulp of the dtype of the float64 reference (plus the float32 rounding of a pair's
products). fp8: nope parts and caches bit for bit; rotated parts quantized from a rotation rounded to the
inputs' dtype first (rope_ext's documented difference) are within one fp8 step of the peer's value and
equal for most elements.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import ulp

from rope_ext import RopeCache
from rope_ext.compat import (
    concat_and_cache_mla_rope_fused,
    fuse_mla_decode_rope_q_concat_kv_insert,
    mla_rope_quantize_fp8,
)
from rope_ext.compat._mla import joined
from rope_ext.reference import quantize_fp8

T, H, LORA, ROPE = 9, 4, 48, 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U8 = torch.uint8


def _rotate64(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """float64 rotation of the last dim of ``x [T, ..., R]`` by the table rows ``cos_sin[pos]``."""
    x = x.double()
    rows = cos_sin[pos].double()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rows.shape[-1] // 2,)
    c, s = rows[:, : ROPE // 2].reshape(shape), rows[:, ROPE // 2 :].reshape(shape)
    if is_neox:
        a, b = x[..., : ROPE // 2], x[..., ROPE // 2 :]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def _pair_mag(x: torch.Tensor, is_neox: bool) -> torch.Tensor:
    x = x.double().abs()
    if is_neox:
        m = x[..., : ROPE // 2] + x[..., ROPE // 2 :]
        return torch.cat([m, m], dim=-1)
    return (x[..., 0::2] + x[..., 1::2]).repeat_interleave(2, dim=-1)


def _assert_rotated(got, x, pos, cos_sin, is_neox):
    """One rounding of a float32 rotation: within an ulp of the float64 value (plus float32 products)."""
    want = _rotate64(x, pos, cos_sin, is_neox)
    tol = ulp(want, got.dtype) + 8 * 2.0**-24 * _pair_mag(x, is_neox)
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"ratio {(err / tol).max():.3g}"


def _fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The peer's conversion of a float64 value: saturate to the finite range, round to nearest even."""
    m = torch.finfo(dtype).max
    return x.clamp(-m, m).to(dtype)


def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in fp8 codes (representable values) between two fp8 tensors of one dtype."""

    def order(t):
        bits = t.view(U8).to(torch.int16)
        mag = bits & 0x7F
        return torch.where(bits >= 0x80, -mag, mag)

    return (order(a) - order(b)).abs()


def _assert_fp8_close(got, want, exact_share=0.9):
    steps = _steps(got, want)
    assert steps.max() <= 1, steps.max()
    assert (steps == 0).double().mean() >= exact_share, (steps == 0).double().mean()


def _inputs(dtype, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, LORA + ROPE, generator=g) * scale).to(dtype)
    kv = (torch.randn(T, LORA + ROPE, generator=g) * scale).to(dtype)
    pos = torch.randint(0, 512, (T,), generator=g)
    return q, kv, pos


TABLE = RopeCache(ROPE, max_positions=512, scaling=None).cos_sin  # float32 [512, ROPE]


# -- FlashInfer: mla_rope_quantize_fp8 ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("layout", ["joined_outputs", "separate", "allocated"])
def test_flashinfer_mla_rope_quantize_fp8(dtype, is_neox, fp8, layout):
    q, kv, pos = _inputs(dtype, seed=1, scale=40.0)  # |x| up to ~200: e4m3's saturation at 448 after 4x
    q_nope, q_rope = q[..., :LORA], q[..., LORA:]  # adjacent views: read in place
    k_nope, k_rope = kv[:, :LORA].clone(), kv[:, LORA:].clone()  # separate tensors
    before = [t.clone() for t in (q, k_nope, k_rope)]
    sq, skv = 4.0, 0.5  # powers of two: x * s and x / (1 / s) agree
    outs = {}
    if layout == "joined_outputs":  # views of one q_out (SGLang's TRT-LLM MLA backend), one k row buffer
        q_out = torch.empty(T, H, LORA + ROPE, dtype=fp8)
        k_out = torch.empty(T, LORA + ROPE, dtype=fp8)
        outs = dict(q_rope_out=q_out[..., LORA:], q_nope_out=q_out[..., :LORA])
        outs |= dict(k_rope_out=k_out[:, LORA:], k_nope_out=k_out[:, :LORA])
    elif layout == "separate":  # SGLang's separate k outputs; the others allocated
        q_nope, q_rope = q_nope.clone(), q_rope.clone()
        outs = dict(q_rope_out=torch.empty(T, H, ROPE, dtype=fp8), k_nope_out=torch.empty(T, LORA, dtype=fp8))
    res = mla_rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, TABLE, pos, is_neox, fp8 if layout == "allocated" else None, sq, skv,
        **outs,
    )  # fmt: skip
    q_rope_out, k_rope_out, q_nope_out, k_nope_out = res
    returned = dict(zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), res, strict=True))
    assert all(returned[name] is o for name, o in outs.items())  # the outputs passed are written
    assert all(o.dtype == fp8 for o in res)
    assert q_rope_out.shape == q_rope.shape and k_rope_out.shape == k_rope.shape
    assert q_nope_out.shape == q_nope.shape and k_nope_out.shape == k_nope.shape
    # the non-rotated parts: exactly the peer's fp8(x * s)
    assert torch.equal(q_nope_out.view(U8), _fp8(q_nope.double() * sq, fp8).view(U8))
    assert torch.equal(k_nope_out.view(U8), _fp8(k_nope.double() * skv, fp8).view(U8))
    # the rotated parts: fp8 of the float64 rotation times the scale, within one fp8 step
    _assert_fp8_close(q_rope_out, _fp8(_rotate64(q_rope, pos, TABLE, is_neox) * sq, fp8))
    _assert_fp8_close(k_rope_out, _fp8(_rotate64(k_rope, pos, TABLE, is_neox) * skv, fp8))
    assert (q_rope_out.float().abs() == torch.finfo(fp8).max).any() or fp8 == E5M2  # saturation reached
    for t, t0 in zip((q, k_nope, k_rope), before, strict=True):
        assert torch.equal(t, t0)  # inputs untouched


def test_flashinfer_mla_rope_quantize_fp8_scales_and_no_nope():
    q, kv, pos = _inputs(torch.bfloat16, seed=2)
    q_rope, k_rope = q[..., LORA:], kv[:, LORA:]
    # no nope parts (None: zero width), scales that are not powers of two
    q_r, k_r, q_n, k_n = mla_rope_quantize_fp8(q_rope, k_rope, None, None, TABLE, pos, False, E4M3, 0.3, 3.0)
    assert q_n.shape == (T, H, 0) and k_n.shape == (T, 0)
    _assert_fp8_close(q_r, _fp8(_rotate64(q_rope, pos, TABLE, False) * 0.3, E4M3), exact_share=0.8)
    _assert_fp8_close(k_r, _fp8(_rotate64(k_rope, pos, TABLE, False) * 3.0, E4M3), exact_share=0.8)
    with pytest.raises(ValueError, match="float32"):
        mla_rope_quantize_fp8(q_rope, k_rope, None, None, TABLE.bfloat16(), pos)
    with pytest.raises(ValueError, match="MLA layout"):
        mla_rope_quantize_fp8(q_rope, q_rope, None, None, TABLE, pos)
    with pytest.raises(TypeError, match="quantize_dtype"):
        mla_rope_quantize_fp8(q_rope, k_rope, None, None, TABLE, pos, quantize_dtype=torch.bfloat16)


def test_joined_views():
    """The adapters read and write ``[nope | rope]`` in place only when the two are adjacent columns."""
    x = torch.randn(5, 3, 24)
    view = joined(x[..., :16], x[..., 16:20])
    assert view is not None and view.data_ptr() == x.data_ptr() and torch.equal(view, x[..., :20])
    assert joined(x[..., 16:], x[..., :16]) is None  # the wrong order
    assert joined(x[..., :16].clone(), x[..., 16:]) is None  # another tensor
    assert joined(x[..., :15], x[..., 16:]) is None  # a gap
    assert joined(x[..., :8], x[..., 8:16].to(torch.float64)) is None
    flat = torch.randn(40)  # b's rows are a's next rows: the joined rows would overlap
    assert joined(flat[:32].view(4, 8), flat[8:40].view(4, 8)) is None


# -- vLLM: concat_and_cache_mla_rope_fused -----------------------------------------------------------


def _cache(kv_cache_dtype, dtype):
    """A [4, 4, L + R] latent cache filled with a bit pattern (uint8 for vLLM's fp8 caches)."""
    torch.manual_seed(5)
    raw = torch.randint(0, 120, (4, 4, (LORA + ROPE) * (1 if kv_cache_dtype != "auto" else dtype.itemsize)))
    cache = raw.to(U8)
    return cache if kv_cache_dtype != "auto" else cache.view(dtype)


def _expected_cache(cache, kv_c, k_pe_rot, slots, kv_cache_dtype, scale):
    """vLLM's concat_and_cache_mla: row slot of cache.view(-1, L + R) = [kv_c | k_pe] (fp8: x / scale)."""
    want = cache.clone()
    rows = want.view(-1, LORA + ROPE)
    keep = slots >= 0
    vals = torch.cat([kv_c, k_pe_rot], dim=-1)[keep]
    if kv_cache_dtype != "auto":
        fp8 = E5M2 if kv_cache_dtype == "fp8_e5m2" else E4M3
        vals = quantize_fp8(vals, scale, fp8).view(U8)
    rows[slots[keep]] = vals
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_vllm_concat_and_cache_mla_rope_fused(dtype, is_neox, kv_cache_dtype):
    q, kv, pos = _inputs(dtype, seed=3)
    q0 = q.clone()
    kv_c, k_pe = kv[:, :LORA], kv[:, LORA:]  # views of kv_a_proj's output, as vLLM's DeepSeek passes them
    k_pe0 = k_pe.clone()
    slots = torch.tensor([3, 0, -1, 15, 7, 8, -1, 1, 12])
    cache = _cache(kv_cache_dtype, dtype)
    want_cache_base = cache.clone()
    scale = torch.tensor([0.25])
    table = TABLE.to(dtype)  # vLLM keeps cos_sin_cache in the model dtype
    positions = torch.cat([pos, torch.zeros(3, dtype=pos.dtype)])  # CUDA-graph padded positions
    concat_and_cache_mla_rope_fused(
        positions, q[..., LORA:], k_pe, kv_c, table, is_neox, slots, cache, kv_cache_dtype, scale
    )
    _assert_rotated(q[..., LORA:], q0[..., LORA:], pos, table, is_neox)
    assert torch.equal(q[..., :LORA], q0[..., :LORA])
    # every k_pe rotated (vLLM's kernel leaves the slot -1 tokens' k_pe as they were: padding)
    _assert_rotated(k_pe, k_pe0, pos, table, is_neox)
    want = _expected_cache(want_cache_base, kv_c, k_pe, slots, kv_cache_dtype, scale)
    assert cache.dtype == want.dtype and torch.equal(cache.view(U8), want.view(U8))


def test_vllm_kv_cache_dtype_strings():
    q, kv, pos = _inputs(torch.bfloat16, seed=4)
    args = (pos, q[..., LORA:], kv[:, LORA:], kv[:, :LORA], TABLE, False, torch.arange(T))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        concat_and_cache_mla_rope_fused(*args, torch.zeros(4, 4, LORA + ROPE, dtype=U8), "fp8_ds_mla", None)
    with pytest.raises(TypeError, match="needs a uint8"):
        concat_and_cache_mla_rope_fused(*args, torch.zeros(4, 4, LORA + ROPE), "fp8", None)
    # an fp8 cache tensor of the named type works as the uint8 one does
    c8 = torch.zeros(4, 4, LORA + ROPE, dtype=E4M3)
    c_u8 = torch.zeros(4, 4, LORA + ROPE, dtype=U8)
    a1 = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    a2 = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    concat_and_cache_mla_rope_fused(*a1, c8, "fp8_e4m3", torch.tensor([2.0]))
    concat_and_cache_mla_rope_fused(*a2, c_u8, "fp8", torch.tensor([2.0]))
    assert torch.equal(c8.view(U8), c_u8) and c_u8.any()


# -- vLLM: fuse_mla_decode_rope_q_concat_kv_insert ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("q_fp8", [False, True])
@pytest.mark.parametrize("adjacent", [True, False], ids=["q_adjacent", "q_separate"])
def test_vllm_fuse_mla_decode_rope_q_concat_kv_insert(dtype, is_neox, q_fp8, adjacent):
    q, kv, pos = _inputs(dtype, seed=6)
    q_nope, q_pe = q[..., :LORA], q[..., LORA:]
    if not adjacent:
        q_nope, q_pe = q_nope.clone(), q_pe.clone()
    before = [t.clone() for t in (q_nope, q_pe, kv)]
    n_pad = 2  # positions and slot_mapping padded past num_tokens (CUDA graphs)
    positions = torch.cat([pos, torch.zeros(n_pad, dtype=pos.dtype)])
    slots = torch.tensor([5, -1, 0, 9, 2, 14, 3, 11, 6, 4, 13])
    cache = _cache("fp8", dtype)
    cache0 = cache.clone()
    kv_scale, q_scale = torch.tensor([0.5]), (torch.tensor([0.25]) if q_fp8 else None)
    q_out = torch.empty(T, H, LORA + ROPE, dtype=U8 if q_fp8 else dtype)
    fuse_mla_decode_rope_q_concat_kv_insert(
        positions, q_nope, q_pe, kv, TABLE, is_neox, slots, cache, "fp8", kv_scale, q_scale, q_out
    )
    for t, t0 in zip((q_nope, q_pe, kv), before, strict=True):
        assert torch.equal(t, t0)  # read only
    rot = _rotate64(q_pe, pos, TABLE, is_neox)
    if q_fp8:  # vLLM: fp8 of the float32 rotation, x / q_scale; the nope part bit for bit
        got = q_out.view(E4M3)
        assert torch.equal(got[..., :LORA].view(U8), quantize_fp8(q_nope, q_scale, E4M3).view(U8))
        _assert_fp8_close(got[..., LORA:], _fp8(rot / 0.25, E4M3))
    else:
        assert torch.equal(q_out[..., :LORA], q_nope)
        _assert_rotated(q_out[..., LORA:], q_pe, pos, TABLE, is_neox)
    # the cache: [kv_c | rotate(k_pe) rounded to q's dtype] quantized with kv_scale; slot -1 and the
    # padding past num_tokens not written, every other row keeps its bits
    keep = slots[:T] >= 0
    rows, rows0 = cache.view(-1, LORA + ROPE), cache0.view(-1, LORA + ROPE)
    written = slots[:T][keep]
    assert torch.equal(rows[written, :LORA], quantize_fp8(kv[keep, :LORA], kv_scale, E4M3).view(U8))
    k_rot = _rotate64(kv[:, LORA:], pos, TABLE, is_neox).to(dtype)[keep]
    _assert_fp8_close(rows[written, LORA:].view(E4M3), quantize_fp8(k_rot, kv_scale, E4M3))
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(rows[untouched], rows0[untouched])

"""Positions along any number of axes (1 to 8: 2-D vision, 3-D video, 4-axis variants; MRoPE is 3):
``mrope_section`` with ``n`` entries and positions ``[n, ...]``, contiguous or interleaved sections, on every
backend and CPU instruction set against the float64 reference; ``RopeCache.for_axes`` (per-axis frequencies,
FLUX / HunyuanVideo / Wan) against the diffusers formula."""

from __future__ import annotations

import pytest
import torch
from _helpers import DTYPES, assert_close_to_reference, make_cos_sin
from backends import BACKENDS, device_of, rotate_qk

import rope_ext
from rope_ext import reference

# (rotary_dim, sections, layout: False contiguous, True interleaved, "alternating"). Halves of 32 and 48
# pairs take the AVX2 / AVX-512 vector path of the per-token table; 14 pairs the scalar one.
CONFIGS = [
    (64, (16, 16), False),
    (64, (10, 22), True),
    (96, (8, 16, 12, 12), False),
    (96, (12, 12, 12, 12), True),
    (32, (2,) * 8, False),
    (32, (3, 2, 2, 2, 2, 2, 1, 2), True),
    (28, (14,), False),
    (28, (5, 0, 9), False),
    (64, (10, 11, 11), "alternating"),  # ERNIE-4.5-VL's: height, width, .., then temporal
    (96, (12, 12, 12, 12), "alternating"),
    (28, (4, 5, 5), 2),
    (32, (0, 8, 8), "alternating"),
]


def _inputs(dtype, rotary_dim, n_axes, head_dim=None, tokens=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = head_dim or rotary_dim
    q = torch.randn(tokens, 4, D, generator=g).to(dtype)
    k = torch.randn(tokens, 2, D, generator=g).to(dtype)
    pos = torch.randint(0, 300, (n_axes, tokens, 1), generator=g)
    return q, k, pos, make_cos_sin(300, rotary_dim)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_axes_match_reference(backend, dtype, interleaved, inplace):
    device = device_of(backend)
    for i, (R, sec, mil) in enumerate(CONFIGS):
        q, k, pos, cs = (t.to(device) for t in _inputs(dtype, R, len(sec), R + 4, seed=i))
        kw = dict(interleaved=interleaved, mrope_section=sec, mrope_interleaved=mil)
        qo, ko = (q.clone(), k.clone()) if inplace else (q, k)
        qo, ko = rotate_qk(backend, qo, ko, pos, cs, inplace=inplace, **kw)
        for x, out in ((q, qo), (k, ko)):
            ref = reference.rotary_hadamard(x.cpu(), pos.cpu(), cs.cpu(), **kw)
            assert_close_to_reference(out.cpu(), ref, float(x.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_axes_inverse_matches_reference_and_undoes_the_rotation(backend, dtype, inplace):
    """``inverse=True`` with N axes (DeepSeek-V4-style rotating back by the query's positions): each pair
    rotated by minus its own axis's angle, against the float64 reference; in float32 the inverse of the
    forward rotation gives the input back within the rounding of two rotations."""
    device = device_of(backend)
    for i, (R, sec, mil) in enumerate(CONFIGS):
        q, k, pos, cs = (t.to(device) for t in _inputs(dtype, R, len(sec), R + 4, seed=50 + i))
        for interleaved in (False, True):
            kw = dict(interleaved=interleaved, mrope_section=sec, mrope_interleaved=mil)
            qo, ko = (q.clone(), k.clone()) if inplace else (q, k)
            qo, ko = rotate_qk(backend, qo, ko, pos, cs, inverse=True, inplace=inplace, **kw)
            for x, out in ((q, qo), (k, ko)):
                ref = reference.rotary_hadamard(x.cpu(), pos.cpu(), cs.cpu(), inverse=True, **kw)
                assert_close_to_reference(out.cpu(), ref, float(x.abs().max()))
            if dtype == torch.float32:
                fq, fk = rotate_qk(backend, q, k, pos, cs, **kw)
                bq, bk = rotate_qk(backend, fq, fk, pos, cs, inverse=True, **kw)
                torch.testing.assert_close(bq.cpu(), q.cpu(), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(bk.cpu(), k.cpu(), atol=1e-5, rtol=1e-5)


def test_axes_on_every_cpu_instruction_set():
    """The per-token table from the axes' rows (vector blends per set) against the reference on each set
    this CPU runs; fp32 results equal across sets."""
    supported = [
        s
        for s in ("scalar", "avx2", "avx512", "avx512_bf16", "neon")
        if torch.ops.rope_ext._cpu_isa_supported(s)
    ]
    before = rope_ext._cpu_isa()
    results = {}
    try:
        for isa in supported:
            rope_ext._set_cpu_isa(isa)
            for i, (R, sec, mil) in enumerate(CONFIGS):
                for dtype in (torch.float32, torch.bfloat16):
                    q, k, pos, cs = _inputs(dtype, R, len(sec), R, seed=100 + i)
                    for il in (False, True):
                        kw = dict(interleaved=il, mrope_section=sec, mrope_interleaved=mil)
                        qo, ko = rope_ext.apply_rotary_qk(q, k, pos, cs, **kw)
                        for x, out in ((q, qo), (k, ko)):
                            ref = reference.rotary_hadamard(x, pos, cs, **kw)
                            assert_close_to_reference(out, ref, float(x.abs().max()))
                        results.setdefault((i, dtype, il), []).append((isa, qo, ko))
    finally:
        rope_ext._set_cpu_isa(before)
    for (_, dtype, _), runs in results.items():
        if dtype == torch.float32:
            _, q0, k0 = runs[0]
            for isa, qo, ko in runs[1:]:
                assert torch.allclose(qo, q0, rtol=0, atol=1e-6) and torch.allclose(
                    ko, k0, rtol=0, atol=1e-6
                ), isa


def test_equal_positions_on_every_axis_equal_plain_rotary():
    for R, sec, mil in CONFIGS:
        q, k, pos, cs = _inputs(torch.bfloat16, R, len(sec), R + 2)
        same = pos[:1].expand(len(sec), -1, -1)
        a = rope_ext.apply_rotary_qk(q, k, same, cs, mrope_section=sec, mrope_interleaved=mil)
        b = rope_ext.apply_rotary_qk(q, k, pos[0], cs)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_axis_of_each_pair():
    """Contiguous: runs per axis; interleaved with n axes: pair j on axis j % n while j < n * sections."""
    assert reference.mrope_rows(6, (2, 1, 3)).tolist() == [0, 0, 1, 2, 2, 2]
    assert reference.mrope_rows(8, (2, 2, 2, 2), True).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert reference.mrope_rows(8, (4, 1, 2, 1), True).tolist() == [0, 1, 2, 3, 0, 0, 2, 0]
    # Three axes: Qwen3-VL's rule (height on j % 3 == 1 below 3h, width on j % 3 == 2 below 3w).
    j = torch.arange(64)
    want = torch.where((j % 3 == 1) & (j < 60), 1, torch.where((j % 3 == 2) & (j < 60), 2, 0))
    assert torch.equal(reference.mrope_rows(64, (24, 20, 20), True), want)
    # Alternating: axes 1 .. n-1 take turns from pair 0, then axis 0 (ERNIE-4.5-VL with 3).
    assert reference.mrope_rows(8, (2, 3, 3), "alternating").tolist() == [1, 2, 1, 2, 1, 2, 0, 0]
    assert reference.mrope_rows(8, (2, 2, 2, 2), 2).tolist() == [1, 2, 3, 1, 2, 3, 0, 0]
    want = torch.where(j < 44, 1 + j % 2, 0)
    assert torch.equal(reference.mrope_rows(64, (20, 22, 22), "alternating"), want)


def _flux_rotary(x: torch.Tensor, ids: torch.Tensor, axes_dim, theta: float) -> torch.Tensor:
    """diffusers' FluxPosEmbed + apply_rotary_emb (use_real, repeat_interleave_real), in float64."""
    cos, sin = [], []
    for a, d in enumerate(axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = ids[:, a].double()[:, None] * freqs[None, :]
        cos.append(ang.cos().repeat_interleave(2, dim=1))
        sin.append(ang.sin().repeat_interleave(2, dim=1))
    cos, sin = torch.cat(cos, -1)[:, None, :], torch.cat(sin, -1)[:, None, :]
    xd = x.double()
    real, imag = xd.reshape(*xd.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], -1).flatten(-2)
    return xd * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_for_axes_is_flux_rope(dtype):
    """FLUX (axes_dim [16, 56, 56], theta 10000, ids [S, 3], pairs (2j, 2j+1)): the table of
    RopeCache.for_axes and the op equal diffusers' formula."""
    axes_dim, S, H = [16, 56, 56], 40, 3
    g = torch.Generator().manual_seed(7)
    ids = torch.stack(
        [torch.zeros(S), torch.randint(0, 64, (S,), generator=g), torch.randint(0, 64, (S,), generator=g)], -1
    )
    x = torch.randn(S, H, 128, generator=g).to(dtype)
    cache = rope_ext.RopeCache.for_axes(axes_dim, 10000.0, max_positions=64)
    assert cache.mrope_section == (8, 28, 28) and cache.rotary_dim == 128
    pos = ids.long().T[:, :, None]  # [3, S, 1]
    out = rope_ext.apply_rotary(x, pos, cache.cos_sin, interleaved=True, mrope_section=cache.mrope_section)
    assert_close_to_reference(out, _flux_rotary(x, ids, axes_dim, 10000.0), float(x.abs().max()))


def test_for_axes_table_and_arguments():
    c = rope_ext.RopeCache.for_axes((4, 8), theta=(100.0, 10000.0), max_positions=5, dtype=torch.float64)
    inv = torch.cat(
        [
            100.0 ** -(torch.arange(0, 4, 2, dtype=torch.float64) / 4),
            10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8),
        ]
    ).double()
    assert torch.equal(c.inv_freq, inv)
    ang = torch.arange(5, dtype=torch.float64)[:, None] * inv
    assert torch.equal(c.cos_sin, torch.cat([ang.cos(), ang.sin()], -1))
    assert c.mrope_section == (2, 4) and not c.mrope_interleaved and c.attention_factor == 1.0
    c.ensure(50)  # growth keeps the per-axis frequencies
    assert c.capacity >= 50 and torch.equal(c.inv_freq, inv)
    for bad in ([], [3, 4], [0, 4], (2,) * 9, "44", [2.0, 4]):
        with pytest.raises(ValueError, match="axes_dim must be 1 to 8 positive even ints"):
            rope_ext.RopeCache.for_axes(bad)
    for bad in ((1.0, 2.0), (10.0,), float("inf"), 0.5):
        with pytest.raises(ValueError, match="theta must be a finite number > 1 or one per axis"):
            rope_ext.RopeCache.for_axes([4, 4], bad)
    with pytest.raises(TypeError, match="for_axes takes theta"):
        rope_ext.RopeCache.for_axes([4, 4], scaling={"rope_type": "linear", "factor": 2.0})


def test_opcheck_and_compile_with_axes():
    from torch.library import opcheck

    q, k, pos, cs = _inputs(torch.float32, 96, 4, 100)
    sec = (8, 16, 12, 12)
    opcheck(torch.ops.rope_ext.rotary_qk.default, (q, k, pos, cs, True, False, 2, list(sec), True))
    opcheck(torch.ops.rope_ext.rotary.default, (q, pos, cs, False, True, 0, list(sec), False))
    torch._dynamo.reset()

    def f(q, k, pos, cs):
        return rope_ext.apply_rotary_qk(q, k, pos, cs, mrope_section=sec)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for tokens in (9, 5):
        q, k, pos, cs = _inputs(torch.float32, 96, 4, 100, tokens=tokens)
        for got, want in zip(compiled(q, k, pos, cs), f(q, k, pos, cs), strict=True):
            assert torch.equal(got, want)


def _layout_calls(mrope_interleaved, sections=(2, 3, 3)):
    """The three ops taking ``mrope_interleaved`` (in place rotation, cache write, QK norm), each with its
    written tensors, on 4 tokens with positions [len(sections), 4]."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, h, 16, generator=g) for h in (2, 1, 1))
    pos = torch.randint(0, 20, (len(sections), 4), generator=g)
    cs = make_cos_sin(20, 16)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    qkv = torch.randn(4, 4 * 16, generator=g)
    w = torch.ones(16)
    kw = dict(mrope_section=sections, mrope_interleaved=mrope_interleaved)
    return [
        ((q, k), lambda: rope_ext.apply_rotary_qk_(q, k, pos[:, :, None], cs, **kw)),
        (
            (q, k, kc, vc),
            lambda: rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, torch.arange(4), **kw),
        ),
        ((qkv,), lambda: rope_ext.apply_qk_norm_rotary_(qkv, 2, 1, 1, w, w, pos, cs, **kw)),
    ]


@pytest.mark.parametrize(
    "value,error",
    [
        (3, ValueError),
        (-1, ValueError),
        (2**63 - 1, ValueError),
        (-(2**63), ValueError),
        (2**63, ValueError),
        (2**64, ValueError),
        ("zigzag", ValueError),
        ("Alternating", ValueError),
        (1.0, TypeError),
        ((2,), TypeError),
    ],
    ids=str,
)
def test_bad_layout_refused_before_any_write(value, error):
    """``mrope_interleaved`` outside False, True, 0-2 and the layout names: an exception naming it, every
    written tensor unchanged."""
    for written, call in _layout_calls(value):
        before = [t.clone() for t in written]
        with pytest.raises(error, match="mrope_interleaved"):
            call()
        assert all(torch.equal(a, b) for a, b in zip(before, written, strict=True))


@pytest.mark.parametrize("sections", [(2, 4, 2), (8,), (0, 5, 3)], ids=str)
def test_alternating_axes_need_equal_turns(sections):
    """Alternating axes take turns pair by pair: at least two axes, each after the first with as many
    pairs; otherwise a ValueError before any write."""
    for written, call in _layout_calls("alternating", sections):
        before = [t.clone() for t in written]
        with pytest.raises(ValueError, match="alternating"):
            call()
        assert all(torch.equal(a, b) for a, b in zip(before, written, strict=True))


def test_layout_names_equal_their_codes():
    """``"contiguous"``, ``"interleaved"``, ``"alternating"`` are False, True and 2, bit for bit."""
    q, k, pos, cs = _inputs(torch.bfloat16, 64, 3)
    for name, code in (("contiguous", False), ("interleaved", True), ("alternating", 2)):
        kw = dict(mrope_section=(10, 11, 11))
        a = rope_ext.apply_rotary_qk(q, k, pos, cs, mrope_interleaved=name, **kw)
        b = rope_ext.apply_rotary_qk(q, k, pos, cs, mrope_interleaved=code, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), name


def test_ernie_4_5_vl_text_rope_reproduced():
    """transformers' ERNIE-4.5-VL text RoPE (its rotary embedding and ``apply_rotary_pos_emb``, interleaved
    pairs, height and width alternating below ``h + w`` pairs, then temporal): reproduced by the table and
    table-free ops with ``parse_mrope``'s ``((t, h, w), "alternating")``; Qwen3-VL's layout would not."""
    ernie = pytest.importorskip("transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe")
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeTextConfig

    from rope_ext.hf_config import parse_mrope

    D = 32
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 6, 4]}
    cfg = Ernie4_5_VLMoeTextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=D, rope_parameters=params
    )
    sections, layout = parse_mrope(cfg)
    assert (sections, layout) == ((4, 6, 6), "alternating")
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 60, (3, 1, 9), generator=g)  # [axes, batch, tokens]: t, h, w
    q, k = torch.randn(1, 2, 9, D, generator=g), torch.randn(1, 1, 9, D, generator=g)
    cos, sin = ernie.Ernie4_5_VLMoeTextRotaryEmbedding(cfg)(q, pos)
    want = ernie.apply_rotary_pos_emb(q, k, cos, sin)
    cache = rope_ext.RopeCache(D, 10000.0, max_positions=64)
    p = pos[:, :, None, :]  # [axes, B, 1, S] for [B, H, S, D]
    for table in (cache.cos_sin_on(torch.device("cpu")), cache.frequencies_on(torch.device("cpu"))):
        got = rope_ext.apply_rotary_qk(
            q, k, p, table, interleaved=True, mrope_section=sections, mrope_interleaved=layout
        )
        for a, b in zip(got, want, strict=True):
            # both rotate by float32 cos/sin; transformers' angles are float32 products (<= 60 rad here)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    other = rope_ext.apply_rotary(
        q, p, table, interleaved=True, mrope_section=sections, mrope_interleaved=True
    )
    assert (other - want[0]).abs().max() > 0.1

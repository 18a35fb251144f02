"""MRoPE (multimodal rotary, Qwen2-VL / Qwen2.5-VL / Qwen3-VL): ``positions [3, ...]`` with
``mrope_section=(t, h, w)``, contiguous or interleaved sections, on every op and backend, against the float64
reference and the installed transformers' rotary modules."""

from __future__ import annotations

import pytest
import torch
from _helpers import DTYPES, assert_close_to_reference, make_cos_sin
from backends import BACKENDS, device_of, rotate_qk
from torch.library import opcheck

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
# (rotary_dim, sections, interleaved sections): Qwen2-VL / Qwen2.5-VL, Qwen3-VL, small and lopsided ones.
CONFIGS = [
    (128, (16, 24, 24), False),
    (128, (24, 20, 20), True),
    (64, (8, 12, 12), False),
    (64, (10, 11, 11), True),
    (12, (0, 6, 0), False),
    (14, (3, 1, 3), True),
]


def _inputs(dtype, rotary_dim, head_dim=None, tokens=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = head_dim or rotary_dim
    q = torch.randn(tokens, 4, D, generator=g).to(dtype)
    k = torch.randn(tokens, 2, D, generator=g).to(dtype)
    pos = torch.randint(0, 300, (3, tokens, 1), generator=g)
    return q, k, pos, make_cos_sin(300, rotary_dim)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_mrope_matches_reference(backend, dtype, interleaved, inplace):
    device = device_of(backend)
    for i, (R, sec, mil) in enumerate(CONFIGS):
        q, k, pos, cs = (t.to(device) for t in _inputs(dtype, R, R + 6, seed=i))
        kw = dict(interleaved=interleaved, mrope_section=sec, mrope_interleaved=mil)
        qo, ko = (q.clone(), k.clone()) if inplace else (q, k)
        qo, ko = rotate_qk(backend, qo, ko, pos, cs, inplace=inplace, **kw)
        for x, out in ((q, qo), (k, ko)):
            ref = reference.rotary_hadamard(x.cpu(), pos.cpu(), cs.cpu(), **kw)
            assert_close_to_reference(out.cpu(), ref, float(x.abs().max()))


def test_text_tokens_equal_plain_rotary():
    """All three rows equal (text-only tokens): MRoPE is the ordinary rotation, bit for bit."""
    for R, sec, mil in CONFIGS:
        q, k, pos, cs = _inputs(torch.bfloat16, R, R + 2)
        same = pos[:1].expand(3, -1, -1)
        for il in (False, True):
            a = rope_ext.apply_rotary_qk(
                q, k, same, cs, interleaved=il, mrope_section=sec, mrope_interleaved=mil
            )
            b = rope_ext.apply_rotary_qk(q, k, pos[0], cs, interleaved=il)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_three_reference_forms_agree_with_mrope():
    x = torch.randn(5, 3, 70, dtype=torch.float64)
    pos = torch.randint(0, 40, (3, 5, 1))
    cs = reference.cos_sin_table(40, 64)
    for sec, mil in (((8, 12, 12), False), ((10, 11, 11), True)):
        for il in (False, True):
            kw = dict(interleaved=il, mrope_section=sec, mrope_interleaved=mil, rotary_offset=4)
            forms = [
                f(x, pos, cs, **kw)
                for f in (reference.rotary_matrix, reference.rotary_complex, reference.rotary_hadamard)
            ]
            torch.testing.assert_close(forms[0], forms[1], rtol=0, atol=1e-13)
            torch.testing.assert_close(forms[0], forms[2], rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------------------
# Against transformers: the section logic lives in each model's rotary module (recomposition_frequencies).


def _hf_rotary(model: str, sections, head_dim=128):
    if model == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Rotary
    elif model == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Rotary
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
    params = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(sections)}
    if model == "qwen3_vl":
        params["mrope_interleaved"] = True
    cfg = Config(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        rope_parameters=params,
    )
    return Rotary(cfg)


HF_MODELS = [
    ("qwen2_vl", (16, 24, 24), False),
    ("qwen2_5_vl", (16, 24, 24), False),
    ("qwen3_vl", (24, 20, 20), True),
]


@pytest.mark.parametrize("model,sections,interleaved_sections", HF_MODELS)
def test_section_of_every_pair_matches_transformers(model, sections, interleaved_sections):
    """Feed the module's recomposition a frequency tensor whose section s holds the value s: what comes out
    names, pair by pair, the section transformers uses; rope_ext's must be the same."""
    rot = _hf_rotary(model, sections)
    freq = torch.arange(3, dtype=torch.float64).view(3, 1, 1, 1).expand(3, 1, 1, 64).clone()
    out = rot.recomposition_frequencies(freq)[0, 0, :64]
    assert torch.equal(out.long(), reference.mrope_rows(64, sections, interleaved_sections))


@pytest.mark.parametrize("model,sections,interleaved_sections", HF_MODELS)
@pytest.mark.parametrize("text_only", [False, True])
def test_rotation_matches_transformers(model, sections, interleaved_sections, text_only):
    """q and k rotated by transformers (its rotary module + apply_rotary_pos_emb) and by rope_ext.
    transformers computes the angles in float32, so the two agree to float32 angle error (positions < 512:
    < 2e-4 * max|x|); rope_ext also meets its contract against the float64 reference."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = _hf_rotary(model, sections)
    g = torch.Generator().manual_seed(11)
    B, S = 2, 9
    pid = torch.randint(0, 512, (3, B, S), generator=g)
    if text_only:
        pid = pid[:1].expand(3, -1, -1)
    q = torch.randn(B, 4, S, 128, generator=g)
    k = torch.randn(B, 2, S, 128, generator=g)
    cos, sin = rot(q, pid)
    hq, hk = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    cs = rope_ext.RopeCache(128, max_positions=512).cos_sin
    kw = dict(mrope_section=sections, mrope_interleaved=interleaved_sections)
    oq, ok = rope_ext.apply_rotary_qk(q, k, pid[:, :, None, :], cs, **kw)
    for ours, theirs, x in ((oq, hq, q), (ok, hk, k)):
        assert (ours.double() - theirs).abs().max() < 2e-4 * x.abs().max()
        ref = reference.rotary_hadamard(x, pid[:, :, None, :], cs, **kw)
        assert_close_to_reference(ours, ref, float(x.abs().max()))


# ---------------------------------------------------------------------------------------------------------
# Autograd, opcheck, compile, errors.


def test_gradcheck_with_mrope():
    cs = make_cos_sin(30, 12).double()
    x = torch.randn(4, 2, 14, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 1, 14, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 30, (3, 4, 1))
    for il in (False, True):
        kw = dict(mrope_section=(3, 1, 2), mrope_interleaved=il, rotary_offset=2)
        assert torch.autograd.gradcheck(lambda t, kw=kw: rope_ext.apply_rotary(t, pos, cs, **kw), (x,))
        assert torch.autograd.gradcheck(
            lambda a, b, kw=kw: rope_ext.apply_rotary_qk(a, b, pos, cs, **kw), (x, k)
        )

        def inplace(a, b, kw=kw):
            a, b = a * 1, b * 1
            rope_ext.apply_rotary_qk_(a, b, pos, cs, **kw)
            return a, b

        assert torch.autograd.gradcheck(inplace, (x, k))


def test_opcheck_with_mrope():
    q, k, pos, cs = _inputs(torch.float32, 64, 64)
    sec = [8, 12, 12]
    opcheck(OPS.rotary.default, (q.requires_grad_(True), pos, cs, False, False, 0, sec, False))
    opcheck(OPS.rotary_qk.default, (q.detach(), k, pos.int(), cs, True, True, 0, sec, True))
    opcheck(OPS.rotary_qk_.default, (q.detach().clone(), k.clone(), pos, cs, False, False, 0, sec, True))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_with_mrope(dynamic):
    cs = make_cos_sin(300, 64)

    def f(q, k, pos):
        rope_ext.apply_rotary_qk_(q, k, pos, cs, mrope_section=(8, 12, 12))
        return rope_ext.apply_rotary(q, pos, cs, mrope_section=(10, 11, 11), mrope_interleaved=True) + 1

    q, k, pos, _ = _inputs(torch.float32, 64, 64)
    a = (q.clone(), k.clone())
    b = (q.clone(), k.clone())
    want = f(*a, pos)
    got = torch.compile(f, fullgraph=True, dynamic=dynamic)(*b, pos)
    assert torch.equal(got, want) and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_mrope_arguments_are_rejected_before_any_write():
    q, k, pos, cs = _inputs(torch.float32, 64, 64)
    q0, k0 = q.clone(), k.clone()
    cases = [
        (
            dict(mrope_section=(8, 12, 11)),
            pos,
            r"mrope_section must be 1 to 8 non-negative ints .* = 32, got \[8, 12, 11\]",
        ),
        (dict(mrope_section=(4,) * 8 + (0,)), pos, "mrope_section must be 1 to 8 non-negative ints"),
        (dict(mrope_section=()), pos, "mrope_section must be 1 to 8 non-negative ints"),
        (dict(mrope_section=(-1, 21, 12)), pos, "mrope_section must be 1 to 8 non-negative ints"),
        (dict(mrope_section=(8, 24)), pos, r"leading axis dim of size len\(mrope_section\) = 2 \(\[2, "),
        (
            dict(mrope_section=(8, 12, 12)),
            pos[:2],
            r"leading axis dim of size len\(mrope_section\) = 3 \(\[3, ",
        ),
        (dict(mrope_section=(8, 12, 12)), pos[0], "leading axis dim of size len"),
        (dict(mrope_interleaved=True), pos[0], "mrope_interleaved needs mrope_section"),
    ]
    for kw, p, msg in cases:
        with pytest.raises(ValueError, match=msg):
            rope_ext.apply_rotary_qk_(q, k, p, cs, **kw)
        with pytest.raises(ValueError, match=msg):
            rope_ext.apply_rotary_qk(q, k, p, cs, **kw)
    with pytest.raises(TypeError, match="mrope_section must be a sequence of ints"):
        rope_ext.apply_rotary_qk_(q, k, pos, cs, mrope_section=(8.0, 12, 12))
    bad = pos.clone()
    bad[2, 3, 0] = 300  # the width row of token 3 is outside the cache
    with pytest.raises(
        IndexError, match=r"positions must be in \[0, cos_sin.shape\[0\]\) = \[0, 300\), got 300"
    ):
        rope_ext.apply_rotary_qk_(q, k, bad, cs, mrope_section=(8, 12, 12))
    assert torch.equal(q, q0) and torch.equal(k, k0)


# ---------------------------------------------------------------------------------------------------------
# Configs, the module and the vLLM adapter.


@pytest.mark.parametrize("model,sections,interleaved_sections", HF_MODELS)
def test_from_hf_config_reads_mrope(model, sections, interleaved_sections):
    rot = _hf_rotary(model, sections)
    cache = rope_ext.RopeCache.from_hf_config(rot.config, max_positions=512)
    assert cache.mrope_section == tuple(sections) and cache.mrope_interleaved == interleaved_sections
    m = rope_ext.RotaryEmbedding.from_hf_config(rot.config, max_positions=512)
    assert m.mrope_section == tuple(sections) and m.mrope_interleaved == interleaved_sections
    g = torch.Generator().manual_seed(12)
    B, S = 2, 6
    pid = torch.randint(0, 512, (3, B, S), generator=g)
    q = torch.randn(B, S, 4, 128, generator=g)
    k = torch.randn(B, S, 2, 128, generator=g)
    oq, ok = m(q, k, pid)
    kw = dict(mrope_section=sections, mrope_interleaved=interleaved_sections)
    want = rope_ext.apply_rotary_qk(q, k, pid[..., None], m.cos_sin(), **kw)
    assert torch.equal(oq, want[0]) and torch.equal(ok, want[1])
    # No positions: text tokens, the ordinary rotation.
    tq, tk = m(q, k)
    pq, pk = rope_ext.apply_rotary_qk(q, k, torch.arange(S)[:, None], m.cos_sin())
    assert torch.equal(tq, pq) and torch.equal(tk, pk)


def test_plain_configs_have_no_mrope():
    c = {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert rope_ext.RopeCache.from_hf_config(c).mrope_section is None
    assert rope_ext.RotaryEmbedding.from_hf_config(c).mrope_section is None


@pytest.mark.parametrize("is_neox", [True, False])
def test_vllm_adapter_takes_mrope_positions(is_neox):
    from rope_ext.compat.vllm import rotary_embedding

    g = torch.Generator().manual_seed(13)
    T, D = 11, 128
    qkv = torch.randn(T, (28 + 4 + 4) * D, generator=g).to(torch.bfloat16)
    query, key = qkv[:, : 28 * D], qkv[:, 28 * D : 32 * D]
    pos = torch.randint(0, 100, (3, T), generator=g)
    cs = make_cos_sin(100, D)
    q0, k0 = query.clone().view(T, 28, D), key.clone().view(T, 4, D)
    rotary_embedding(pos, query, key, D, cs, is_neox, mrope_section=(16, 24, 24))
    kw = dict(interleaved=not is_neox, mrope_section=(16, 24, 24))
    want_q, want_k = rope_ext.apply_rotary_qk(q0, k0, pos[..., None], cs, **kw)
    assert torch.equal(query.view(T, 28, D), want_q) and torch.equal(key.view(T, 4, D), want_k)


# ---------------------------------------------------------------------------------------------------------
# patch_transformers on the text models of Qwen2-VL, Qwen2.5-VL and Qwen3-VL.


def _tiny_vl_text(model: str):
    if model == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel as Model

        sections, extra = [8, 12, 12], {}
    elif model == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel as Model

        sections, extra = [8, 12, 12], {}
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel as Model

        sections, extra = [12, 10, 10], {"mrope_interleaved": True}
    cfg = Config(
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=96,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections, **extra},
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    m = Model(cfg)
    with torch.no_grad():  # a realistic scale: attention far from uniform, so a wrong rotation shows
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return m


def _hidden_and_grads(model, ids, positions):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=positions).last_hidden_state
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(15))
    (out * w).sum().backward()  # (a square mean would be ~constant after the final RMSNorm)
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_patch_transformers_vl_text_models(model_name):
    from rope_ext.compat import HFRotaryAdapter, patch_transformers, unpatch_transformers

    model = _tiny_vl_text(model_name)
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, 96, (2, 20), generator=g)
    # An image block: tokens 4..15 share the temporal position, height and width run over a 3 x 4 grid.
    t = torch.arange(20).repeat(2, 1)
    hgt, wid = t.clone(), t.clone()
    t[:, 4:16] = 4
    hgt[:, 4:16] = 4 + torch.arange(12).div(4, rounding_mode="floor")
    wid[:, 4:16] = 4 + torch.arange(12) % 4
    positions = torch.stack([t, hgt, wid])
    ref = _hidden_and_grads(model, ids, positions)
    ref_text = _hidden_and_grads(model, ids, None)
    patch_transformers(model)
    try:
        assert isinstance(model.rotary_emb, HFRotaryAdapter)
        modeling = __import__(type(model).__module__, fromlist=["x"])
        assert getattr(modeling.apply_rotary_pos_emb, "_rope_ext", False)
        with torch.profiler.profile() as prof:
            got = _hidden_and_grads(model, ids, positions)
        assert any(e.name.startswith("rope_ext::rotary") for e in prof.events()), "rope_ext's op did not run"
        got_text = _hidden_and_grads(model, ids, None)
    finally:
        unpatch_transformers(model)
    for (a, ga), (b, gb) in ((got, ref), (got_text, ref_text)):
        scale = b.abs().max()
        # transformers' float32 angles against rope_ext's float64 ones (positions < 20): ~1e-6 relative
        assert (a - b).abs().max() <= 2e-5 * scale
        for n in gb:
            assert (ga[n] - gb[n]).abs().max() <= 2e-4 * gb[n].abs().max().clamp_min(1e-30), n
    # and a wrong section layout would not pass: the interleaved and contiguous mappings differ here
    assert not torch.equal(
        reference.mrope_rows(32, (12, 10, 10), True), reference.mrope_rows(32, (12, 10, 10))
    )

"""``patch_transformers`` on the vision towers of vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
GLM-4V, Pixtral, Llama 4): tiny random towers patched against unpatched (float32 outputs and gradients,
every attention layer's rotation through rope_ext's op, ``torch.compile(fullgraph=True)``), unpatching bit
for bit, a whole vision-language model (text and vision parts together), and the rules for vision functions
the probes reject or that the text part also calls.

The towers, their inputs and the accuracy contract (``OUT_RTOL``, ``GRAD_RTOL``: tighter than the text
families', since a tower keeps its own cos / sin) live in ``_hf_vision_helpers.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

from _hf_vision_helpers import (  # noqa: E402
    GRAD_RTOL,
    OUT_RTOL,
    SENSITIVITY,
    TOWERS,
    build,
    first_call,
    layers,
    out_error,
    outputs,
    run,
    swapped,
)
from hf_check import OpCounter, _recording_backend, grad_error, reinit  # noqa: E402
from hf_families import GRAD_RTOL as TEXT_GRAD_RTOL  # noqa: E402
from hf_families import LOGIT_RTOL as TEXT_LOGIT_RTOL  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from rope_ext.compat import HFRotaryAdapter, patch_transformers, unpatch_transformers  # noqa: E402
from rope_ext.compat.hf import TESTED_VISION_MODELS, vision_report  # noqa: E402

ROPE_QK = "rope_ext.rotary_qk.default"


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_tested_towers_are_listed():
    assert {t.model for t in TOWERS.values()} == set(TESTED_VISION_MODELS)


@pytest.mark.parametrize("name", list(TOWERS))
def test_tower_patched_equals_unpatched(name):
    """Eager forward and backward of the patched tower against the unpatched one, the op counted, and
    unpatching: the original function back (identity) and outputs and gradients bit-identical."""
    tower = TOWERS[name]
    module = tower.modeling
    original = getattr(module, tower.function)
    model, inputs = build(tower)
    ref = run(model, inputs)
    with swapped(module, tower.function, lambda q, k, *args, **kwargs: (q, k)), torch.no_grad():
        unrotated = outputs(model(**inputs))

    patch_transformers(model)
    try:
        stand_in = getattr(module, tower.function)
        assert stand_in is not original and stand_in._rope_ext_original is original
        report = vision_report(model)
        assert list(report["patched"]) == [f"{module.__name__}.{tower.function}"], report
        assert report["skipped"] == {}
        counter = OpCounter()
        got = run(model, inputs, mode=counter)
    finally:
        unpatch_transformers(model)

    # every attention layer rotated q and k with one rope_ext op call
    assert [c[0] for c in counter.calls] == [ROPE_QK] * layers(model), counter.calls
    out_err, grad_err = out_error(got[0], ref[0]), grad_error(got[1], ref[1])
    assert out_err <= OUT_RTOL and grad_err <= GRAD_RTOL, (out_err, grad_err)
    # the comparison is sensitive: the tower without its rotation moves by far more than the tolerance
    assert out_error(unrotated, ref[0]) >= SENSITIVITY * OUT_RTOL

    assert getattr(module, tower.function) is original
    assert vision_report(model) == {"patched": {}, "skipped": {}}
    back = run(model, inputs)
    assert _same(back[0], ref[0]) and _same_grads(back[1], ref[1])


@pytest.mark.parametrize("name", list(TOWERS))
def test_patched_rotation_compiles(name):
    """The stand-in on the tower's own first rotation call (its q, k and frequencies, as the attention
    passes them) compiles with ``fullgraph=True`` into one graph holding rope_ext's op, with the original's
    values and gradients; float64 and bfloat16 calls keep the original's dtype rules."""
    tower = TOWERS[name]
    module = tower.modeling
    original = getattr(module, tower.function)
    model, inputs = build(tower)
    args, kwargs = first_call(tower, model, inputs)
    q, k = args[0].requires_grad_(), args[1].requires_grad_()
    g = torch.Generator().manual_seed(3)
    wq, wk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)

    def loss_grads(fn):
        q.grad = k.grad = None
        oq, ok = fn(q, k, *args[2:], **kwargs)
        ((oq * wq).sum() + (ok * wk).sum()).backward()
        return [oq.detach(), ok.detach()], {"q": q.grad.clone(), "k": k.grad.clone()}

    want = loss_grads(original)
    patch_transformers(model)
    try:
        torch._dynamo.reset()
        graphs: list = []

        def call(*a, **kw):
            return getattr(module, tower.function)(*a, **kw)  # the global, as the attention reads it

        got = loss_grads(torch.compile(call, fullgraph=True, backend=_recording_backend(graphs)))
        has_op = any("rope_ext" in str(n.target) for gm in graphs for n in gm.graph.nodes)
        stand_in = getattr(module, tower.function)
        low = [a.detach().to(torch.bfloat16) for a in (q, k)]
        with OpCounter() as counter:
            got_bf16 = stand_in(*low, *args[2:], **kwargs)
        want_bf16 = original(*low, *args[2:], **kwargs)
    finally:
        unpatch_transformers(model)
        torch._dynamo.reset()
    assert len(graphs) == 1 and has_op
    assert out_error(got[0], want[0]) <= 1e-6 and grad_error(got[1], want[1]) <= 1e-6
    # bfloat16 q / k: the original's output dtype, through the op, within one bfloat16 rounding (2**-8)
    assert [t.dtype for t in got_bf16] == [t.dtype for t in want_bf16]
    assert len(counter.calls) == 1 and out_error(list(got_bf16), list(want_bf16)) <= 2**-8


@pytest.mark.parametrize("name", [n for n, t in TOWERS.items() if t.fullgraph])
def test_whole_tower_compiles(name):
    """Towers without data-dependent packing (Pixtral, Llama 4) compile whole, patched, into one graph."""
    tower = TOWERS[name]
    model, inputs = build(tower)
    ref = run(model, inputs)
    patch_transformers(model)
    try:
        torch._dynamo.reset()
        graphs: list = []
        compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
        got = run(model, inputs, runner=compiled)
    finally:
        unpatch_transformers(model)
        torch._dynamo.reset()
    assert len(graphs) == 1
    ops = [n for gm in graphs for n in gm.graph.nodes if "rope_ext" in str(n.target)]
    assert len(ops) == layers(model)
    out_err, grad_err = out_error(got[0], ref[0]), grad_error(got[1], ref[1])
    assert out_err <= OUT_RTOL and grad_err <= GRAD_RTOL, (out_err, grad_err)


# ---------------------------------------------------------------------------------------------
# A whole vision-language model


def test_whole_qwen2_vl_patches_text_and_vision():
    """Qwen2-VL with an image: the text rotary embedding becomes an adapter, the text function and the
    vision function both run rope_ext's op (2 + 2 layers), logits within the text contract (the adapter's
    float64 angles), and unpatching restores everything bit for bit."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import modeling_qwen2_vl as modeling

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    vision = dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, patch_size=4)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
        vision_end_token_id=103,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    reinit(model)
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[5, 6, 102] + [100] * 6 + [103, 7, 8, 9]])
    inputs = dict(
        input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == 100).long()
    )

    functions = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_vision")
    originals = {f: getattr(modeling, f) for f in functions}
    rotary = model.model.language_model.rotary_emb

    class Logits:
        """run()'s view of the model: an output with a ``last_hidden_state``."""

        def __init__(self, logits):
            self.last_hidden_state = logits

    def runner(**kw):
        return Logits(model(**kw).logits)

    ref = run(model, inputs, runner=runner)
    patch_transformers(model)
    try:
        assert isinstance(model.model.language_model.rotary_emb, HFRotaryAdapter)
        assert all(getattr(modeling, f) is not originals[f] for f in functions)
        counter = OpCounter()
        got = run(model, inputs, runner=runner, mode=counter)
    finally:
        unpatch_transformers(model)
    assert [c[0] for c in counter.calls] == [ROPE_QK] * 4
    out_err, grad_err = out_error(got[0], ref[0]), grad_error(got[1], ref[1])
    assert out_err <= TEXT_LOGIT_RTOL and grad_err <= TEXT_GRAD_RTOL, (out_err, grad_err)
    assert all(getattr(modeling, f) is originals[f] for f in functions)
    assert model.model.language_model.rotary_emb is rotary
    back = run(model, inputs, runner=runner)
    assert _same(back[0], ref[0]) and _same_grads(back[1], ref[1])


# ---------------------------------------------------------------------------------------------
# Vision functions the probes reject, and functions the text part calls too


def apply_rotary_pos_emb_vision_scaled(q, k, cos, sin):
    """Not a rotation (the sin term is doubled): the probes must reject it."""
    return q * cos + 2 * q.flip(-1) * sin, k * cos + 2 * k.flip(-1) * sin


class ScaledVisionAttention(nn.Module):
    def forward(self, x, cos, sin):
        return apply_rotary_pos_emb_vision_scaled(x, x, cos, sin)


def _tiny_llama() -> nn.Module:
    config = modeling_llama.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return modeling_llama.LlamaModel(config).eval()


def test_rejected_vision_function_is_left_alone():
    """A vision function the probes reject stays unpatched and is reported, while the text part is
    patched; a model with nothing else to patch is refused (TypeError), unchanged."""
    module = sys.modules[__name__]
    model = nn.ModuleDict({"text": _tiny_llama(), "vision": ScaledVisionAttention()})
    text_original = modeling_llama.apply_rotary_pos_emb
    patch_transformers(model)
    try:
        assert modeling_llama.apply_rotary_pos_emb is not text_original
        assert module.apply_rotary_pos_emb_vision_scaled is apply_rotary_pos_emb_vision_scaled
        report = vision_report(model)
        assert report["patched"] == {}
        assert list(report["skipped"]) == [f"{__name__}.apply_rotary_pos_emb_vision_scaled"], report
    finally:
        unpatch_transformers(model)
    assert modeling_llama.apply_rotary_pos_emb is text_original and vision_report(model)["skipped"] == {}

    alone = ScaledVisionAttention()
    with pytest.raises(TypeError, match="nor a vision rotation function rope_ext computes.*scaled"):
        patch_transformers(alone)
    assert module.apply_rotary_pos_emb_vision_scaled is apply_rotary_pos_emb_vision_scaled
    assert "_rope_ext_vision_functions" not in alone.__dict__


def test_function_shared_with_the_text_part_checks_its_cos_sin():
    """A function the text part swaps and the vision part calls too (here Llama's attention outside the
    text model) is swapped once, by the text patch, and then checks eagerly that cos / sin are laid out as
    the text adapter's are: cos / sin that are not go to the original, bit for bit."""
    text = _tiny_llama()
    outside = modeling_llama.LlamaAttention(text.config, layer_idx=0)
    model = nn.ModuleDict({"text": text, "vision": outside})
    original = modeling_llama.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 1, 5, 16, generator=g)
    cos, sin = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)  # not cat((c, c))
    patch_transformers(model)
    try:
        assert vision_report(model)["patched"] == {}  # left to the text patch
        stand_in = modeling_llama.apply_rotary_pos_emb
        with OpCounter() as counter:
            got = stand_in(q, k, cos, sin)
        assert counter.calls == [] and _same(list(got), list(original(q, k, cos, sin)))
        cat_cos, cat_sin = (torch.cat([t[..., :8], t[..., :8]], -1) for t in (cos, sin))
        with OpCounter() as counter:
            got = stand_in(q, k, cat_cos, cat_sin)
        assert len(counter.calls) == 1
        assert out_error(list(got), list(original(q, k, cat_cos, cat_sin))) <= 1e-6
    finally:
        unpatch_transformers(model)
    assert modeling_llama.apply_rotary_pos_emb is original

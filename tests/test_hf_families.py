"""``patch_transformers`` on tiny random models of every supported family, the checks that refuse a modeling
module whose rotation rope_ext does not compute, ``supported_model_types()`` and README.md's table.

The families and their tiny configs live in ``hf_families.py``, the per-family check in ``hf_check.py``
(both shared with ``benchmarks/model_table.py``, which renders the same results into README.md).
"""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

import hf_check
import hf_families as families
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.llama import modeling_llama

import rope_ext.compat
from rope_ext.compat import (
    SUPPORTED_MODEL_TYPES,
    HFRotaryAdapter,
    patch_transformers,
    supported_model_types,
)
from rope_ext.compat.hf import patch as hf_patch
from rope_ext.compat.hf.probes import _signature
from rope_ext.compat.hf.rotation import _Rotation

README = Path(__file__).resolve().parents[1] / "README.md"
_RESULTS: dict[str, hf_check.Result] = {}


def _result(model_type: str) -> hf_check.Result:
    """The family's check, run once per session (the README test reuses the family tests' results)."""
    if model_type not in _RESULTS:
        _RESULTS[model_type] = hf_check.check(families.FAMILIES[model_type])
    return _RESULTS[model_type]


@pytest.mark.parametrize("model_type", list(families.FAMILIES))
def test_family_patched_equals_unpatched(model_type):
    why = families.missing(families.FAMILIES[model_type])
    if why is not None:
        pytest.skip(why)
    r = _result(model_type)
    assert r.failures == [], r.status + r.trace
    # float32 logits and gradients within the contract (see hf_families.LOGIT_RTOL / GRAD_RTOL), eagerly ...
    assert r.logit_err <= families.LOGIT_RTOL and r.grad_err <= families.GRAD_RTOL
    # ... and compiled with fullgraph=True: one graph, rope_ext's op in it
    assert r.compiled_logit_err <= families.LOGIT_RTOL and r.compiled_grad_err <= families.GRAD_RTOL
    assert r.graphs == 1 and r.graph_has_op
    # every attention layer's rotation went through rope_ext's op
    assert r.op_calls == r.layers
    # the comparison is sensitive: the other pairing moves the logits by far more than the tolerance
    assert r.wrong_rotation_change >= families.SENSITIVITY * families.LOGIT_RTOL
    # unpatching restores the modules and functions, and the outputs bit for bit
    assert r.restored and r.unpatched_exact


# ---------------------------------------------------------------------------------------------
# Modeling modules whose rotation rope_ext does not compute are refused, with nothing patched.


@pytest.fixture
def module_copy():
    """Makes a copy of a transformers modeling module with its source edited, registered in sys.modules
    (its classes then look their functions up in the copy); removed afterwards."""
    made = []

    def make(module: types.ModuleType, old: str, new: str) -> types.ModuleType:
        src = inspect.getsource(module)
        assert src.count(old) == 1, "the source to edit is not in this transformers version"
        name = f"{module.__name__}_rope_ext_test_copy"
        copy = types.ModuleType(name)
        copy.__package__ = module.__package__
        copy.__file__ = module.__file__
        sys.modules[name] = copy
        made.append(name)
        exec(compile(src.replace(old, new), module.__file__, "exec"), copy.__dict__)
        return copy

    yield make
    for name in made:
        sys.modules.pop(name, None)


def _state(model: torch.nn.Module, module: types.ModuleType):
    return (
        [(n, m) for n, m in model.named_modules() if n.endswith("rotary_emb")],
        {k: v for k, v in vars(module).items() if k.startswith("apply_rotary")},
    )


def _assert_unchanged(model, module, before):
    rotary, functions = _state(model, module)
    assert [(n, id(m)) for n, m in rotary] == [(n, id(m)) for n, m in before[0]]
    assert not any(isinstance(m, HFRotaryAdapter) for _, m in rotary)
    assert functions.keys() == before[1].keys()
    assert all(functions[k] is before[1][k] for k in functions)


_HALF = """    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)"""
_EVERY_TWO = """    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)"""


def test_llama_copy_with_interleaved_rotate_half_is_refused(module_copy):
    """A copy of Llama's modeling module whose rotate_half pairs (2j, 2j+1) against cos / sin laid out
    cat((c, c)): not a rotation rope_ext computes (each pair would mix two frequencies). Patching it as
    Llama would change the logits by O(1); it raises TypeError naming the function and the check."""
    copy = module_copy(modeling_llama, _HALF, _EVERY_TWO)
    cfg = LlamaConfig(**{**families.COMMON, "num_attention_heads": 2, "num_key_value_heads": 1})
    torch.manual_seed(0)
    model = copy.LlamaForCausalLM(cfg).eval()
    hf_check.reinit(model)
    call = hf_check.make_call(families.FAMILIES["llama"], 24, seed=3)
    with torch.no_grad():
        ref = hf_check.forward(model, call)
    before = _state(model, copy)
    with pytest.raises(TypeError, match=r"apply_rotary_pos_emb\(q, k, cos, sin\) on q .* computes none of"):
        patch_transformers(model)
    _assert_unchanged(model, copy, before)
    # What a patch by model type alone would have done: Llama's rotation in place of the copy's.
    original = copy.apply_rotary_pos_emb
    try:
        rot = _Rotation("half", "cat")
        copy.apply_rotary_pos_emb = hf_patch._make_patched(original, rot, _signature(original))
        with torch.no_grad():
            wrong = hf_check.forward(model, call)
    finally:
        copy.apply_rotary_pos_emb = original
    assert hf_check.logit_error(wrong, ref) > 100 * families.LOGIT_RTOL


def test_deepseek_copy_with_one_broken_function_patches_nothing(module_copy):
    """DeepSeek-V3's modeling module calls two functions; with the interleaved one broken (its second output
    half computed with the wrong sign: not a rotation), patching raises and neither the working
    apply_rotary_pos_emb nor the rotary module is swapped."""
    copy = module_copy(
        modeling_deepseek_v3,
        "q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)",
        "q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos - q1 * sin], dim=-1)",
    )
    fam = families.FAMILIES["deepseek_v3"]
    config_cls = modeling_deepseek_v3.DeepseekV3Config
    cfg = config_cls(**{k: v for k, v in {**families.COMMON, **fam.kwargs}.items() if v is not None})
    model = copy.DeepseekV3ForCausalLM(cfg).eval()
    before = _state(model, copy)
    with pytest.raises(
        TypeError, match=r"apply_rotary_pos_emb_interleave\(q, k, cos, sin\) .* computes none of"
    ):
        patch_transformers(model)
    _assert_unchanged(model, copy, before)


class ShiftedRotaryEmbedding(modeling_llama.LlamaRotaryEmbedding):
    """Llama's rotary embedding at positions shifted by one: cos / sin rope_ext's caches do not give."""

    def forward(self, x, position_ids):
        return super().forward(x, position_ids + 1)


def test_rotary_module_with_other_cos_sin_is_refused():
    cfg = LlamaConfig(**{**families.COMMON, "num_attention_heads": 2, "num_key_value_heads": 1})
    model = modeling_llama.LlamaForCausalLM(cfg).eval()
    model.model.rotary_emb = ShiftedRotaryEmbedding(cfg)
    before = _state(model, modeling_llama)
    with pytest.raises(
        TypeError, match=r"ShiftedRotaryEmbedding cos differs from rope_ext's default RoPE by"
    ):
        patch_transformers(model)
    _assert_unchanged(model, modeling_llama, before)


# ---------------------------------------------------------------------------------------------
# The patched function: transformers' calling conventions


def test_patched_function_takes_the_original_signature():
    """The stand-in binds arguments as the original does (Llama's ``unsqueeze_dim`` is its fifth
    positional parameter in transformers 5), uses the op for them, and runs the original for anything the
    op does not compute (cos requiring grad)."""
    original = modeling_llama.apply_rotary_pos_emb
    patched = hf_patch._make_patched(original, _Rotation("half", "cat"), _signature(original))
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 3, 32, generator=g), torch.randn(2, 5, 1, 32, generator=g)
    c = torch.randn(2, 5, 16, generator=g)
    cos, sin = torch.cat([c.cos(), c.cos()], -1), torch.cat([c.sin(), c.sin()], -1)
    counter = hf_check.OpCounter()
    with counter:
        for args, kwargs in (((2,), {}), ((), {"unsqueeze_dim": 2})):
            got, want = patched(q, k, cos, sin, *args, **kwargs), original(q, k, cos, sin, *args, **kwargs)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(counter.calls) == 2
    counter = hf_check.OpCounter()
    cos_g = cos.clone().requires_grad_()
    with counter:
        got = patched(q, k, cos_g, sin, unsqueeze_dim=2)
    assert counter.calls == [] and got[0].grad_fn is not None  # the original: gradients to cos as well


# ---------------------------------------------------------------------------------------------
# supported_model_types()


def test_supported_model_types_is_computed(monkeypatch):
    found = supported_model_types()
    assert rope_ext.compat.supported_model_types is supported_model_types
    assert list(found) == [t for t in SUPPORTED_MODEL_TYPES if t in found]
    for model_type, fam in families.FAMILIES.items():
        assert (model_type in found) == (families.missing(fam) is None), model_type
    # a model type the installed transformers lacks is left out, not claimed
    monkeypatch.setattr(hf_patch, "SUPPORTED_MODEL_TYPES", ("no_such_model", "llama"))
    assert hf_patch.supported_model_types.__wrapped__() == ("llama",)


# ---------------------------------------------------------------------------------------------
# README.md's table


def test_readme_table_is_current():
    """README.md's table of families is what benchmarks/model_table.py renders from these checks."""
    want = hf_check.render_table([_result(model_type) for model_type in families.FAMILIES])
    assert hf_check.table_in(README.read_text()) == want, (
        "README.md's model table is stale: run `python benchmarks/model_table.py --write README.md`"
    )

"""The transformers families ``patch_transformers`` supports, as tiny configs (:data:`FAMILIES`), and the
accuracy contract a patched model is held to (:data:`LOGIT_RTOL`, :data:`GRAD_RTOL`, :data:`SENSITIVITY`).

``hf_check.py`` builds each family's model and runs the per-family check on it; ``tests/test_hf_families.py``
asserts on the check's results, and ``benchmarks/model_table.py`` renders the same results as README.md's
table of supported families.

Each :class:`Family` builds a two-layer model with a head (vocabulary 128, hidden 64 or 128, head_dim 32 or
64) from its transformers config and model classes, with every weight matrix redrawn at a realistic scale
(``hf_check.reinit``): transformers' 0.02 init leaves attention nearly uniform, so that a wrong rotation would
barely move the logits. ``hf_check.check`` then compares the patched model with the unpatched one (float32
logits and gradients, eagerly and under ``torch.compile(fullgraph=True)``), counts the rope_ext op calls,
measures how far a deliberately wrong rotation moves the logits, and unpatches.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import transformers

VOCAB = 128
BATCH = 2

# Accuracy contract of a patched float32 model against the unpatched one, relative to the largest |logit|
# (or to the largest |gradient| of each parameter). rope_ext's cos / sin come from float64 angles,
# transformers' from float32 ones: at positions < 32 an angle is off by up to ~32 * 2**-24 (~2e-6), and
# the rotated q / k by as much relative to their size; two layers of attention, MLP and norms carry that
# to the logits at the same order. 2e-5 leaves a factor ~10 of margin; the gradients (a backward through
# the same layers, sums over the batch and sequence) get 1e-4.
LOGIT_RTOL = 2e-5
GRAD_RTOL = 1e-4
# A deliberately wrong rotation (the other pairing) must move the logits by at least this factor times
# LOGIT_RTOL: the comparison above would see it.
SENSITIVITY = 100.0

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    attn_implementation="sdpa",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: where transformers keeps it and a tiny config of it.

    ``package`` is the folder under ``transformers.models``; ``config`` / ``model`` are class names in its
    configuration / modeling modules; ``kwargs`` override :data:`COMMON` (``None`` drops a key);
    ``lengths`` are the sequence lengths of the eager calls (the last one is also compiled); ``mrope``
    passes ``[3, batch, seq]`` position ids with an image block (temporal / height / width sections);
    ``notes`` go to the table.
    """

    model_type: str
    package: str
    config: str
    model: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    lengths: tuple[int, ...] = (24,)
    mrope: bool = False
    notes: str = ""

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.package}.modeling_{self.package}"

    @property
    def configuration(self) -> str:
        return f"transformers.models.{self.package}.configuration_{self.package}"


def _longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * j for j in range(half)],
        "long_factor": [1.0 + 0.75 * j for j in range(half)],
        "original_max_position_embeddings": 16,
    }


_MOE = dict(num_experts_per_tok=2)
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "llama",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            ),
        ),
        Family("mistral", "mistral", "MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
        Family(
            "mixtral", "mixtral", "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **_MOE)
        ),
        Family(
            "qwen2",
            "qwen2",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            ),
        ),
        Family(
            "qwen2_moe",
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_MOE),
        ),
        Family("qwen3", "qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
        Family(
            "qwen3_moe",
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            dict(head_dim=32, num_experts=4, moe_intermediate_size=32, **_MOE),
        ),
        Family("gemma", "gemma", "GemmaConfig", "GemmaForCausalLM", dict(head_dim=32)),
        Family(
            "gemma2",
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            dict(head_dim=32, sliding_window=8, attn_implementation="eager"),  # no SDPA for Gemma 2
        ),
        Family(
            "gemma3_text",
            "gemma3",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            dict(
                head_dim=32,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                },
            ),
            notes="local and global RoPE: one table per layer type",
        ),
        Family(
            "phi3",
            "phi3",
            "Phi3Config",
            "Phi3ForCausalLM",
            dict(
                num_attention_heads=2,
                num_key_value_heads=2,
                original_max_position_embeddings=16,
                rope_parameters={**_longrope(24), "partial_rotary_factor": 0.75},
            ),
            lengths=(12, 24),
            notes="short and long factors around the trained length 16",
        ),
        Family("olmo2", "olmo2", "Olmo2Config", "Olmo2ForCausalLM"),
        Family("granite", "granite", "GraniteConfig", "GraniteForCausalLM"),
        Family("cohere", "cohere", "CohereConfig", "CohereForCausalLM", dict(logit_scale=1.0)),
        Family(
            "gpt_neox",
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            dict(
                hidden_size=128,
                intermediate_size=128,
                num_key_value_heads=None,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                },
            ),
        ),
        Family(
            "stablelm",
            "stablelm",
            "StableLmConfig",
            "StableLmForCausalLM",
            dict(
                hidden_size=128,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                },
            ),
        ),
        Family(
            "starcoder2", "starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=16)
        ),
        Family(
            "deepseek_v3",
            "deepseek_v3",
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            dict(
                num_key_value_heads=2,
                q_lora_rank=None,
                kv_lora_rank=32,
                qk_rope_head_dim=32,
                qk_nope_head_dim=32,
                v_head_dim=32,
                head_dim=32,
                rope_interleave=True,
                n_routed_experts=4,
                n_shared_experts=1,
                moe_intermediate_size=32,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
                **_MOE,
            ),
            notes="MLA: RoPE on the 32 rope features of each 64-feature q / k head",
        ),
        Family(
            "glm",
            "glm",
            "GlmConfig",
            "GlmForCausalLM",
            dict(
                hidden_size=128,
                head_dim=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            ),
        ),
        Family(
            "qwen2_vl_text",
            "qwen2_vl",
            "Qwen2VLTextConfig",
            "Qwen2VLTextModel",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
            mrope=True,
            notes="MRoPE sections, `[3, batch, seq]` position ids",
        ),
        Family(
            "qwen2_5_vl_text",
            "qwen2_5_vl",
            "Qwen2_5_VLTextConfig",
            "Qwen2_5_VLTextModel",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
            mrope=True,
            notes="MRoPE sections, `[3, batch, seq]` position ids",
        ),
        Family(
            "qwen3_vl_text",
            "qwen3_vl",
            "Qwen3VLTextConfig",
            "Qwen3VLTextModel",
            dict(
                head_dim=32,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 5e5,
                    "mrope_section": [6, 5, 5],
                    "mrope_interleaved": True,
                },
            ),
            mrope=True,
            notes="interleaved MRoPE sections, `[3, batch, seq]` position ids",
        ),
        Family(
            "ernie4_5_vl_moe",
            "ernie4_5_vl_moe",
            "Ernie4_5_VLMoeTextConfig",
            "Ernie4_5_VLMoeTextModel",
            dict(
                head_dim=32,
                moe_num_experts=4,
                moe_k=2,
                moe_intermediate_size=[32, 32],
                rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 6, 4]},
            ),
            mrope=True,
            notes="its text model: alternating MRoPE axes (height, width, .., then temporal), "
            "`[3, batch, seq]` position ids",
        ),
        Family(
            "modernbert",
            "modernbert",
            "ModernBertConfig",
            "ModernBertForMaskedLM",
            dict(
                num_key_value_heads=None,
                global_attn_every_n_layers=2,
                cls_token_id=1,
                sep_token_id=2,
                local_attention=8,
                layer_types=["full_attention", "sliding_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            ),
            notes="encoder; local and global RoPE: one table per layer type",
        ),
    )
}


def missing(family: Family) -> str | None:
    """Why the installed transformers cannot build ``family`` (the missing module or class), or None."""
    for module, name in ((family.configuration, family.config), (family.modeling, family.model)):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return f"transformers {transformers.__version__} has no module {module}"
        if not hasattr(mod, name):
            return f"transformers {transformers.__version__} has no {module}.{name}"
    return None

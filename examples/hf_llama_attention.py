"""A tiny random Llama from transformers: logits with and without rope_ext's patch agree.

``patch_transformers(model)`` swaps the model's rotary embedding for rope_ext's float64-built table and
its ``apply_rotary_pos_emb`` for rope_ext's op; ``unpatch_transformers`` restores both. The logits move
only by the float32 rounding of transformers' own cos/sin (relative 2e-5 at most here).

Run from the repository root after ``make build`` (or with rope_ext installed):
``PYTHONPATH=. python examples/hf_llama_attention.py``. Exits non-zero when a check fails.
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rope_ext.compat import patch_transformers, unpatch_transformers

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    attn_implementation="sdpa",
)
model = LlamaForCausalLM(config).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 48))
position_ids = torch.arange(900, 948).expand(2, -1)  # late positions: where angles are largest

with torch.no_grad():
    before = model(input_ids, position_ids=position_ids).logits
    patch_transformers(model)
    print("rotary module after patching:", type(model.model.rotary_emb).__name__)
    patched = model(input_ids, position_ids=position_ids).logits
    unpatch_transformers(model)
    restored = model(input_ids, position_ids=position_ids).logits

diff = (patched - before).abs().max().item()
rel = diff / before.abs().max().item()
print(f"max |logits(patched) - logits(transformers)| = {diff:.3g} (relative {rel:.3g})")
failures = []
if not rel <= 2e-5:
    failures.append(f"patched logits differ by {rel:.3g} relative (> 2e-5)")
if not torch.equal(restored, before):
    failures.append("unpatched logits are not bit-identical to the original ones")
print("restored after unpatch_transformers:", torch.equal(restored, before))
print("FAIL: " + "; ".join(failures) if failures else "OK")
sys.exit(1 if failures else 0)

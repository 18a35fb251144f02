"""Llama-3.1's RoPE (llama3 scaling, 131072 positions) from its config, checked at long positions.

``RopeCache.from_hf_config`` sizes the table to ``max_position_embeddings``; q and k rotated by rope_ext
are compared with the float64 reference, and transformers' own float32 cos/sin with float64 for contrast.

Run from the repository root after ``make build`` (or with rope_ext installed):
``PYTHONPATH=. python examples/llama31_cache.py``. Exits non-zero when a check fails.
"""

import sys

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import rope_ext
from rope_ext.reference import rotary_matrix

llama31_rope = dict(  # Llama-3.1's published rope settings
    rope_type="llama3",
    rope_theta=5e5,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
config = LlamaConfig(  # Llama-3.1-8B's attention shape; no weights needed
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_parameters=llama31_rope,
)
cache = rope_ext.RopeCache.from_hf_config(config)
print(cache)
positions = torch.tensor([0, 8191, 8192, 65537, 131071])
g = torch.Generator().manual_seed(0)
q, k = torch.randn(len(positions), 32, 128, generator=g), torch.randn(len(positions), 8, 128, generator=g)
q_rot, k_rot = rope_ext.apply_rotary_qk(q, k, positions[:, None], cache.cos_sin)

# float64 reference: angles p * inv_freq (float64 frequencies of llama3 scaling), one row per token
angles = positions.double()[:, None] * cache.inv_freq[None, :]
exact = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [tokens, 128]: cos half, then sin half
rows = torch.arange(len(positions))[:, None]
err_q = (q_rot.double() - rotary_matrix(q, rows, exact)).abs().max().item()
err_k = (k_rot.double() - rotary_matrix(k, rows, exact)).abs().max().item()
err_table = (cache.cos_sin[positions].double() - exact).abs().max().item()
print(f"rope_ext  cos/sin table vs float64: {err_table:.3g}; rotated q {err_q:.3g}, k {err_k:.3g}")

hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q[None], positions[None])  # float32 angles
half = exact.shape[1] // 2
hf_err = torch.maximum(
    (hf_cos[0, :, :half].double() - exact[:, :half]).abs(),
    (hf_sin[0, :, :half].double() - exact[:, half:]).abs(),
).amax(dim=1)
for p, e in zip(positions.tolist(), hf_err.tolist(), strict=True):
    print(f"transformers float32 cos/sin vs float64 at position {p:6d}: {e:.3g}")

failures = []
if not max(err_q, err_k) <= 1e-6 * max(q.abs().max().item(), k.abs().max().item()):
    failures.append(f"rotation error {max(err_q, err_k):.3g} above the 1e-6 * max|x| contract")
try:
    rope_ext.apply_rotary_qk(q[:1], k[:1], torch.tensor([[131072]]), cache.cos_sin)
    failures.append("position 131072 (= max_position_embeddings) did not raise")
except IndexError as e:
    print("position 131072 raises IndexError:", e)
print("FAIL: " + "; ".join(failures) if failures else "OK")
sys.exit(1 if failures else 0)

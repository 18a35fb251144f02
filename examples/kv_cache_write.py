"""RoPE fused with the paged KV-cache write, on a packed qkv, checked against the float64 reference.

``apply_rotary_qk_and_cache_`` rotates q and k in place (views of one packed ``[T, (Hq + 2 Hk) * D]``
tensor, as a server's qkv projection returns it) and stores the rotated k and v at ``slot_mapping`` in a
vLLM-style ``[num_blocks, block_size, Hk, D]`` cache: bf16, then fp8 with per-tensor scales.

Run from the repository root after ``make build`` (or with rope_ext installed):
``PYTHONPATH=. python examples/kv_cache_write.py``. Exits non-zero when a check fails.
"""

import sys

import torch

import rope_ext
from rope_ext import reference

T, Hq, Hk, D, BLOCKS, BLOCK_SIZE = 7, 8, 2, 128, 16, 16
cos_sin = rope_ext.RopeCache(D, base=1e6, max_positions=4096).cos_sin
positions = torch.tensor([0, 1, 2, 3, 4, 1000, 4095])  # a 5-token prompt, then two decode tokens
slot_mapping = torch.tensor([16, 17, 18, 19, 20, -1, 255])  # -1: padding, rotated but not stored
failures = []
g = torch.Generator().manual_seed(0)
for cache_dtype, scale in ((torch.bfloat16, None), (torch.float8_e4m3fn, torch.tensor([0.02]))):
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(torch.bfloat16)
    q, k, v = qkv.view(T, Hq + 2 * Hk, D).split([Hq, Hk, Hk], dim=1)
    q0, k0 = q.clone(), k.clone()
    key_cache = torch.zeros(BLOCKS, BLOCK_SIZE, Hk, D, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    kc0, vc0 = key_cache.clone(), value_cache.clone()
    rope_ext.apply_rotary_qk_and_cache_(
        q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, k_scale=scale, v_scale=scale
    )
    # q and k: the project's contract, one bf16 ulp (<= 2**-7 |ref|) of the float64 rotation + 2**-22 max|x|
    for name, got, x in (("q", q, q0), ("k", k, k0)):
        ref = reference.rotary_matrix(x, positions[:, None], cos_sin)
        err = (got.double() - ref).abs()
        ok = bool((err <= 2.0**-7 * ref.abs() + 2.0**-22 * x.abs().max().double()).all())
        print(f"{cache_dtype}: rotated {name} max error vs float64 {err.max().item():.3g} ok={ok}")
        failures += [] if ok else [f"{cache_dtype} {name}"]
    # caches: the reference write of the rotated k and of v, bit for bit (every other slot untouched)
    want_k, want_v = reference.kv_cache_write(k, v, kc0, vc0, slot_mapping, k_scale=scale, v_scale=scale)
    same = torch.equal(key_cache.view(torch.uint8), want_k.view(torch.uint8)) and torch.equal(
        value_cache.view(torch.uint8), want_v.view(torch.uint8)
    )
    print(f"{cache_dtype}: cache equals reference.kv_cache_write bit for bit: {same}")
    failures += [] if same else [f"{cache_dtype} cache"]
print("FAIL: " + ", ".join(failures) if failures else "OK")
sys.exit(1 if failures else 0)

"""Decode steps of the cache write into slots no call has touched lately, as a server writes them.

    python benchmarks/fresh_slots.py [--tokens 1,8,64] [--cache bf16,fp8] [--layout NHD] [--calls 640]

Llama-3-8B shapes (32 q / 8 kv heads of 128, bf16 activations, positions 1000), caches of 8192 blocks
of 16 slots (256 MiB each in bf16; NHD, or HND with `--layout HND`). Each call writes T slots drawn anew
(no repeats) from the whole cache, so its rows lie on pages and lines that the earlier calls left cold; q
and k are fresh copies, v and cos/sin stay warm. Times `apply_rotary_qk_and_cache_` alone under
`torch.inference_mode()`: the median over the calls after the first 64, one line per case. rope-bench's
decode steps rewrite the same slots on every call instead (benchmarks/cpu-zen4.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rope_ext

HQ, HK, D, BLOCK, BLOCKS = 32, 8, 128, 16, 8192


def median_us(tokens: int, fp8: bool, layout: str, calls: int) -> float:
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shape = (BLOCKS, BLOCK, HK, D) if layout == "NHD" else (BLOCKS, HK, BLOCK, D)
    key_cache = torch.zeros(shape, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(4096, dtype=torch.float64)[:, None] * inv_freq
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).float()
    q = torch.randn(tokens, HQ, D, dtype=torch.bfloat16)
    k = torch.randn(tokens, HK, D, dtype=torch.bfloat16)
    v = torch.randn(tokens, HK, D, dtype=torch.bfloat16)
    positions = torch.full((tokens,), 1000, dtype=torch.int64)
    scale = torch.tensor([0.02]) if fp8 else None
    times = []
    with torch.inference_mode():
        for _ in range(calls):
            slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
            qc, kc = q.clone(), k.clone()
            start = time.perf_counter_ns()
            rope_ext.apply_rotary_qk_and_cache_(
                qc, kc, v, positions, cos_sin, key_cache, value_cache, slots,
                layout=layout, k_scale=scale, v_scale=scale,
            )  # fmt: skip
            times.append(time.perf_counter_ns() - start)
    return statistics.median(times[64:]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64", help="tokens per step, comma-separated")
    parser.add_argument("--cache", default="bf16,fp8", help="cache dtypes: bf16, fp8 (e4m3, scale 0.02)")
    parser.add_argument("--layout", choices=["NHD", "HND"], default="NHD")
    parser.add_argument("--calls", type=int, default=640)
    args = parser.parse_args()
    for cache in args.cache.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            us = median_us(tokens, cache == "fp8", args.layout, args.calls)
            case = f"T={tokens} {cache} {args.layout} cache"
            print(f"{case}, fresh slots: median {us:.1f} us ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()

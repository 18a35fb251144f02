"""Every float32 bit pattern through the CPU fp8 cache write against torch's conversion of the quotient.

    python benchmarks/fp8_exhaustive.py SCALE {float8_e4m3fn,float8_e5m2} [--isa SET]

The 2^32 patterns go as the v rows of ``apply_rotary_qk_and_cache_`` (identity rotation) in 256 calls of 2^24
values; the fp8 cache must hold ``(v / scale).clamp(-max, max).to(fp8)`` bit for bit (NaNs compared as one
code). About 90 s per scale with two threads (benchmarks/cpu-fp8-rows.md); the test suite draws 2^20 patterns
(tests/test_serving_isa.py::test_fp8_rows_random_bit_patterns).
"""

from __future__ import annotations

import argparse
import time

import torch

import rope_ext
from rope_ext import reference


def codes(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.float().isnan(), 0x7F, t.view(torch.uint8).int())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scale", type=float)
    parser.add_argument("fp8", choices=["float8_e4m3fn", "float8_e5m2"])
    parser.add_argument("--isa", default=None, help="CPU instruction set (default: the best this CPU runs)")
    args = parser.parse_args()
    if args.isa:
        rope_ext._set_cpu_isa(args.isa)
    fp8 = getattr(torch, args.fp8)
    heads, dim, n = 8, 128, 1 << 24
    tokens = n // (heads * dim)
    m = reference.FP8_MAX[fp8]
    q, k = torch.zeros(tokens, 1, dim), torch.zeros(tokens, heads, dim)
    cs = torch.cat([torch.ones(1, dim // 2), torch.zeros(1, dim // 2)], dim=1)
    kc = torch.zeros(tokens, 1, heads, dim, dtype=fp8)
    vc = torch.zeros_like(kc)
    pos, slots, sc = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens), torch.tensor([args.scale])
    bad, start = 0, time.perf_counter()
    for c in range(1 << 32 >> 24):
        bits = torch.arange(c * n, (c + 1) * n, dtype=torch.int64) - (1 << 31)
        v = bits.to(torch.int32).view(torch.float32).view(tokens, heads, dim)
        rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, slots, k_scale=sc, v_scale=sc)
        wrong = codes(vc[:, 0]) != codes((v / sc).clamp(-m, m).to(fp8))
        if wrong.any():
            bad += int(wrong.sum())
            print("mismatch at", v[wrong][:4].tolist())
    isa = rope_ext._cpu_isa()
    took = time.perf_counter() - start
    print(f"{isa}, scale {args.scale}, {args.fp8}: 2^32 patterns, {bad} mismatches, {took:.0f} s")


if __name__ == "__main__":
    main()

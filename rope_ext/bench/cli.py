"""Command line of ``rope-bench`` (also ``python -m rope_ext.bench``): arguments, config, entry point."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence

import torch

from .parts import PART_OF
from .presets import ALL_MODES, DECODE_TOKENS, DTYPES, MODES, PREFILL_TOKENS, PRESETS, Preset
from .providers import PROVIDERS
from .report import plot, print_table, write_csv, write_json
from .runner import run_benchmark
from .workloads import Config

__all__ = ["config_from_args", "main", "parse_args"]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()] if s.strip() else []


def _custom_preset(spec: str, base: float) -> Preset:
    """``Q,KV,D[,R]``: q heads, kv heads, head_dim, rotary_dim (default head_dim)."""
    v = _ints(spec)
    if len(v) not in (3, 4):
        raise argparse.ArgumentTypeError(f"--shape wants Q,KV,D[,R], got {spec!r}")
    r = v[3] if len(v) == 4 else v[2]
    return Preset(
        f"custom-{v[0]}x{v[1]}x{v[2]}" + (f"r{r}" if r != v[2] else ""), v[0], v[1], v[2], r, False, base
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` when ``argv`` is None)."""
    ap = argparse.ArgumentParser(
        prog="rope-bench",
        description="Validate and time rotary-embedding kernels against each other and this machine's "
        "memory bandwidth.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        default=None,
        help="comma-separated model presets, or 'all' (see --list); default: llama-3-8b, none with --shape",
    )
    ap.add_argument("--shape", action="append", default=[], help="custom shape Q,KV,D[,R] (repeatable)")
    ap.add_argument("--base", type=float, default=1e4, help="rope base for --shape")
    ap.add_argument(
        "--tokens",
        default=",".join(map(str, PREFILL_TOKENS)),
        help="prefill token counts (empty: none); 'model' adds each vision / diffusion preset's own prefill "
        "(flux 4608, wan2.1-* 32760, qwen2-vl-vision 4096; other presets none), e.g. 'model' or 'model,1024'",
    )
    ap.add_argument(
        "--decode-tokens", default=",".join(map(str, DECODE_TOKENS)), help="decode token counts (empty: none)"
    )
    ap.add_argument(
        "--seqs",
        default="",
        help="packed prefill: comma-separated sequence counts N; each prefill becomes a packed batch of N "
        "sequences of mixed lengths summing to its tokens (seeded), positions from "
        "rope_ext.varlen_positions, adding the rope_ext+varlen provider and the varlen_positions part "
        "(empty: not packed; MRoPE and vision presets stay unpacked, counts above the token count are "
        "skipped)",
    )
    ap.add_argument("--dtype", default="fp32,bf16", help=f"comma-separated, of {','.join(DTYPES)}")
    ap.add_argument(
        "--pairing", default="model", help="model (the preset's), half, interleaved, both; comma-separated"
    )
    ap.add_argument(
        "--mode",
        default=",".join(MODES),
        help=f"comma-separated, of {','.join(ALL_MODES)}; the serving modes run only when named: cache "
        "(RoPE + paged KV-cache write, caches of q's dtype), cache-fp8 (float8_e4m3fn caches with k/v "
        "scales), qknorm (QK-RMSNorm + RoPE on a packed qkv), mla (RoPE + MLA latent-cache write, a cache "
        "of q's dtype; presets with an MLA shape: deepseek-v3), mla-fp8 (float8_e4m3fn cache with kv_scale), "
        "rerotate (the keys of T tokens in a paged KV cache of q's dtype rotated in place by per-token "
        "shifts, every preset), rerotate-fp8 (float8_e4m3fn cache with k_scale)",
    )
    ap.add_argument("--providers", default=None, help="comma-separated provider names (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    ap.add_argument("--rounds", type=int, default=10, help="timing rounds (each runs every provider in turn)")
    ap.add_argument("--min-run-time", type=float, default=0.1, help="seconds per provider per round")
    ap.add_argument(
        "--allocator",
        default="fresh",
        choices=["fresh", "reuse", "default"],
        help="CPU: fresh = new outputs always page-fault (large blocks mmapped per call), reuse = freed "
        "memory reused (no faults), default = glibc as is (depends on history)",
    )
    ap.add_argument(
        "--cache",
        default="cold",
        choices=["cold", "warm"],
        help="CPU: cold = workloads of 1 MiB or more cycle through copies of their inputs spanning 3x the "
        "last-level cache, so repeated calls do not run from cache; warm = one input set",
    )
    ap.add_argument("--tol-ulps", type=float, default=8.0, help="validation tolerance (eps * max|x| units)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small run for CI (make bench): llama-3-8b fp32, decode 1 and prefill 2048 tokens, in place "
        "and out of place, 6 rounds of 0.05 s per provider",
    )
    ap.add_argument("--json", default=None, help="write results as JSON")
    ap.add_argument("--csv", default=None, help="write results as CSV")
    ap.add_argument("--plot", default=None, help="write GB/s-vs-tokens plot (PNG)")
    ap.add_argument(
        "--omp-wait",
        default="passive",
        choices=["passive", "active", "inherit"],
        help="OMP_WAIT_POLICY for the run (the command re-executes itself to set it): passive keeps idle "
        "OpenMP workers asleep, so that on a shared machine a parallel region does not wait a scheduler "
        "tick for a worker that lost its core while spinning; inherit leaves the environment as is",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--list", action="store_true", help="list presets and providers, then exit")
    return ap.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> Config:
    """The :class:`Config` of parsed arguments (``--quick`` sets the workload and timing options).

    Exits (``SystemExit``) on an unknown preset, dtype, pairing or mode.
    """
    if a.quick:
        a.preset, a.tokens, a.decode_tokens = "llama-3-8b", "2048", "1"
        a.dtype, a.pairing, a.mode = "fp32", "model", "inplace,out"
        a.rounds, a.min_run_time = 6, 0.05
    presets: list[Preset] = []
    if a.preset is None and not a.shape:
        a.preset = "llama-3-8b"
    if a.preset:
        names = list(PRESETS) if a.preset == "all" else [n.strip() for n in a.preset.split(",") if n.strip()]
        for n in names:
            if n not in PRESETS:
                raise SystemExit(f"unknown preset {n!r}; known: {', '.join(PRESETS)}")
            presets.append(PRESETS[n])
    if a.shape:
        presets += [_custom_preset(s, a.base) for s in a.shape]
    dtypes = []
    for d in a.dtype.split(","):
        if d.strip() not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
        dtypes.append(DTYPES[d.strip()])
    pairings = []
    for p in a.pairing.split(","):
        p = p.strip()
        if p == "both":
            pairings += ["half", "interleaved"]
        elif p in ("model", "half", "interleaved"):
            pairings.append(p)
        else:
            raise SystemExit(f"unknown pairing {p!r}: model, half, interleaved or both")
    seqs = _ints(a.seqs)
    words = [t.strip() for t in a.tokens.split(",")]
    model_tokens = "model" in words
    prefill = _ints(",".join(t for t in words if t != "model"))
    if any(n < 1 for n in seqs):
        raise SystemExit(f"--seqs wants sequence counts >= 1, got {a.seqs!r}")
    modes = [m.strip() for m in a.mode.split(",") if m.strip()]
    for m in modes:
        if m not in ALL_MODES:
            raise SystemExit(f"unknown mode {m!r}; known: {', '.join(ALL_MODES)}")
    return Config(
        presets=presets,
        prefill_tokens=prefill,
        decode_tokens=_ints(a.decode_tokens),
        dtypes=dtypes,
        pairings=pairings,
        modes=modes,
        providers=[p.strip() for p in a.providers.split(",")] if a.providers else None,
        device=a.device,
        rounds=a.rounds,
        min_run_time=a.min_run_time,
        tol_ulps=a.tol_ulps,
        allocator=a.allocator,
        cache=a.cache,
        progress=not a.no_progress,
        seqs=seqs,
        model_tokens=model_tokens,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rope-bench``; returns 1 when a provider was wrong or raised, else 0."""
    a = parse_args(argv)
    want = a.omp_wait.upper()
    if argv is None and a.omp_wait != "inherit" and os.environ.get("OMP_WAIT_POLICY", "").upper() != want:
        # OpenMP reads its wait policy once, when torch loads it: start again with it set.
        os.environ["OMP_WAIT_POLICY"] = want
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "rope_ext.bench", *sys.argv[1:]])
    if a.list:
        for p in PRESETS.values():
            print(
                f"{p.name:18s} q {p.q_heads:3d} kv {p.kv_heads:3d} head_dim {p.head_dim:3d} "
                f"rotary_dim {p.rotary_dim:3d} {'interleaved' if p.interleaved else 'half-split'} "
                f"base {p.base:g}"
                + (f" mrope {'/'.join(map(str, p.mrope_section))}" if p.mrope_section else "")
                + (
                    f" axes {'/'.join(map(str, p.axes.dims))} ({p.axes.layout}, {p.axes.tokens} tokens)"
                    if p.axes
                    else ""
                )
                + (f" mla nope {p.mla.qk_nope_head_dim} kv_lora_rank {p.mla.kv_lora_rank}" if p.mla else "")
            )
        print("providers: " + ", ".join(sorted({f"{p.name} ({p.mode})" for p in PROVIDERS})))
        print("parts: " + ", ".join(PART_OF))
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = config_from_args(a)
    t0 = time.perf_counter()
    result = run_benchmark(cfg)
    result["command"] = "rope-bench " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)
    )
    result["elapsed_s"] = time.perf_counter() - t0
    print_table(result)
    print(f"elapsed {result['elapsed_s']:.1f} s", file=sys.stdout)
    if a.json:
        write_json(result, a.json)
    if a.csv:
        write_csv(result, a.csv)
    if a.plot:
        plot(result, a.plot)
    bad = [r for r in result["rows"] if r["status"] in ("wrong", "error")]
    return 1 if bad else 0

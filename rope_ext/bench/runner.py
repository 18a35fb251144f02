"""The run: every workload's providers validated, then timed in rounds with the ceilings, rows derived.

Timing runs in several rounds, each running every provider and every ceiling once in turn, so that noise
from other processes hits them alike; the median over all rounds is reported with its spread (25th-75th
percentiles). Parts (:mod:`.parts`, e.g. ``varlen_positions`` of a packed workload) are timed in the same
rounds and reported as a fraction of the rotation they feed.

The serving modes (``cache``, ``cache-fp8``, ``qknorm``, ``mla``, ``mla-fp8``, ``rerotate``, ``rerotate-fp8``)
run on the same workloads, after the other modes' rows, each against its own baseline (the unfused eager path)
and ceiling; ``qknorm``, MLA and rerotate rows also carry ``speedup_vs_compile`` (the ``torch.compile
unfused`` time over theirs). The MLA modes run on presets with an MLA shape only (a note names the presets
they skipped); the rerotate modes on every preset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

import rope_ext

from .ceilings import CEILING_FOR_MODE, SERVING_STREAMS, ceiling_bytes, ceilings
from .parts import PART_OF, parts
from .presets import MLA_MODES, MODES, REROTATE_MODES, SERVING_MODES, dtype_name
from .providers import PROVIDERS, Provider, Skip
from .timing import Timer, set_cpu_allocator, stats
from .validation import check
from .workloads import Config, cycle, input_sets, make_case, workloads

__all__ = ["machine_info", "run_benchmark"]


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "rope_ext": rope_ext.__version__,
        "rope_ext_cpu_isa": str(torch.ops.rope_ext._cpu_isa()),
        "rope_ext_cpu_prefetch": int(torch.ops.rope_ext._cpu_prefetch()),
        "rope_ext_cpu_prefetch_level": int(torch.ops.rope_ext._cpu_prefetch_level()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
    }
    with contextlib.suppress(OSError):
        info["loadavg"] = list(os.getloadavg())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def run_benchmark(
    cfg: Config, extra_providers: Iterable[Provider] = (), log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Runs every workload of ``cfg``; returns ``{"machine", "config", "rows", "notes"}``.

    Each row is one (workload, provider), (workload, ceiling) or (workload, part): status ``ok`` (timed),
    ``wrong`` (disagrees with the float64 reference; not timed) or ``error`` (raised; not timed).
    """
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    provs = [p for p in [*PROVIDERS, *extra_providers] if p.mode in cfg.modes]
    if cfg.providers is not None:
        provs = [p for p in provs if p.name in cfg.providers]
    else:
        provs = [p for p in provs if not p.opt_in]
    # The rotary modes' rows as before (family by family), then each serving mode's rows together.
    provs.sort(key=lambda p: 0 if p.mode in MODES else 1 + SERVING_MODES.index(p.mode))
    timer = Timer(device, cfg.min_run_time)
    notes: dict[str, None] = {}
    rows: list[dict[str, Any]] = []
    machine = machine_info(device)
    if device.type == "cpu":
        machine["cpu_allocator"] = set_cpu_allocator(cfg.allocator)
    wls = workloads(cfg)
    if cfg.seqs and any(p.mrope_section is not None for p in cfg.presets):
        notes["--seqs packs presets with one position per token; MRoPE presets ran unpacked prefills"] = None
    if cfg.seqs and any(p.axes is not None for p in cfg.presets):
        notes["--seqs packs presets with one position per token; axes presets ran unpacked prefills"] = None
    if cfg.decode_tokens and any(p.axes is not None for p in cfg.presets):
        notes["vision / diffusion presets (axes) have no decode step: they ran prefills only"] = None
    bar = None
    if cfg.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(wls), desc="rope-bench", unit="workload", leave=False, file=sys.stderr)
        except ImportError:
            bar = None

    for preset, tokens, phase, dtype, il, seqs in wls:
        if bar is not None:
            bar.set_postfix_str(
                f"{preset.name} {dtype_name(dtype)} {'il' if il else 'half'} T={tokens}"
                + (f" seqs={seqs}" if seqs else "")
            )
        case = make_case(preset, tokens, phase, dtype, il, device, seqs=seqs)
        base = {
            "preset": preset.name,
            "q_heads": preset.q_heads,
            "kv_heads": preset.kv_heads,
            "head_dim": preset.head_dim,
            "rotary_dim": preset.rotary_dim,
            "pairing": case.pairing,
            "dtype": dtype_name(dtype),
            "phase": phase,
            "tokens": tokens,
            "seqs": seqs or None,
            "mrope_section": list(preset.sections) if preset.sections else None,
            "axes_dim": list(preset.axes.dims) if preset.axes else None,
            "qk_nope_head_dim": preset.mla.qk_nope_head_dim if preset.mla else None,
            "kv_lora_rank": preset.mla.kv_lora_rank if preset.mla else None,
            "bytes": case.bytes_moved(),
            "qk_bytes": sum(case.qk_bytes()),
        }
        n_sets = input_sets(case, cfg.cache)
        cases = [case] + [case.copy_inputs() for _ in range(n_sets - 1)]
        base["input_sets"] = n_sets
        # Validate (on the first input set) and build every provider.
        runners: dict[str, Callable[[], Any]] = {}
        wl_rows: dict[str, dict[str, Any]] = {}
        for p in provs:
            if p.mode in MLA_MODES and preset.mla is None:
                notes[
                    f"{p.mode} runs on presets with an MLA shape (deepseek-v3): skipped on {preset.name}"
                ] = None
                continue
            key = f"{p.name}|{p.mode}"
            row = {**base, "provider": p.name, "mode": p.mode, "kind": "provider", "baseline": p.baseline}
            if p.mode in SERVING_MODES:
                row["bytes"] = case.bytes_moved(p.mode)
            try:
                fn = p.build(case)
                source = getattr(fn, "source", None)
                info = check(case, p.mode, fn(), cfg.tol_ulps)
                ok = info.pop("ok")
                if ok and n_sets > 1:
                    fn = cycle([fn] + [p.build(c) for c in cases[1:]])
            except Skip as e:
                notes[f"skipped {p.name} ({p.mode}): {e}"] = None
                continue
            except Exception as e:  # a provider that raises is reported, not fatal
                row.update(status="error", detail=f"{type(e).__name__}: {e}".splitlines()[0][:200])
                rows.append(row)
                continue
            row.update(status="ok" if ok else "wrong", **info)
            if source:
                row["source"] = source
            wl_rows[key] = row
            rows.append(row)
            if ok:
                runners[key] = fn
        ceils = [ceilings(c, cfg.modes) for c in cases]
        for name in ceils[0]:
            if name in ("no-op call", "tiny kernel") and tokens > 256:
                continue
            fn = cycle([c[name] for c in ceils])
            key = f"{name}|ceiling"
            row = {**base, "provider": name, "mode": "ceiling", "kind": "ceiling", "status": "ok"}
            row["stream_bytes"] = ceiling_bytes(case, name)
            if name in SERVING_STREAMS:
                row["bytes"] = row["stream_bytes"]
            wl_rows[key] = row
            rows.append(row)
            runners[key] = fn
        for name, fn in parts(case).items():
            if cfg.providers is not None and name not in cfg.providers:
                continue
            key = f"{name}|part"
            row = {**base, "provider": name, "mode": "part", "kind": "part", "status": "ok"}
            wl_rows[key] = row
            rows.append(row)
            runners[key] = fn
        # Time in rounds: every runner once per round, in turn.
        for fn in runners.values():
            timer.warm(fn)
        times: dict[str, list[float]] = {key: [] for key in runners}
        for _ in range(cfg.rounds):
            for key, fn in runners.items():
                times[key] += timer.measure(fn)
        for key, ts in times.items():
            wl_rows[key].update(stats(ts))
        _derive(wl_rows)
        del case, cases, runners, ceils
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    cfg_dict = dataclasses.asdict(cfg)
    cfg_dict["presets"] = [p.name for p in cfg.presets]
    cfg_dict["dtypes"] = [dtype_name(d) for d in cfg.dtypes]
    return {"machine": machine, "config": cfg_dict, "rows": rows, "notes": list(notes)}


# The mode whose baseline ("vs eager") each mode's rows are compared with; a serving mode, its own.
BASELINE_MODE = {"inplace": "out", "out": "out", "backward": "backward"}
# The compiled unfused reference of a mode, whose time over a row's is its speedup_vs_compile.
COMPILED_REF = {m: f"torch.compile unfused|{m}" for m in ("qknorm", *MLA_MODES, *REROTATE_MODES)}
# Presets with the model's own RoPE code (axes): their rotary rows' eager baseline is model-eager (not the
# HF formula) and their speedup_vs_compile is against model-compile.
MODEL_EAGER, MODEL_COMPILE = "model-eager|out", "model-compile|out"


def _derive(wl: dict[str, dict[str, Any]]) -> None:
    """GB/s, fraction of the mode's ceiling, speedup vs eager (and vs the compiled unfused reference),
    call-overhead ratio and parts' fraction of the rotation, in place."""
    eager = {r["mode"]: r for r in wl.values() if r.get("baseline") and "median_s" in r}
    model_eager = wl.get(MODEL_EAGER)
    if model_eager and "median_s" in model_eager:
        eager["out"] = model_eager
    # On a GPU the decode floor is the device time of a tiny kernel; on a CPU, the cost of a call.
    noop = wl.get("tiny kernel|ceiling") or wl.get("no-op call|ceiling")
    for r in wl.values():
        t = r.get("median_s")
        if not t:
            continue
        if r["kind"] == "part":
            whole = wl.get(PART_OF[r["provider"]])
            if whole and whole.get("median_s"):
                r["frac_rotation"] = t / whole["median_s"]
                r["frac_rotation_min"] = r["min_s"] / whole["min_s"]
            continue
        r["gbps"] = r["bytes"] / t / 1e9
        if r["kind"] == "ceiling":
            # q and k read and written (stream cache / mla: and v / kv_c read, cache rows written), no cos/sin
            # or positions
            r["gbps"] = r.get("stream_bytes", 2 * r["qk_bytes"]) / t / 1e9
            continue
        ceil = wl.get(f"{CEILING_FOR_MODE[r['mode']]}|ceiling")
        if ceil and ceil.get("median_s"):
            r["ceiling"] = ceil["provider"]
            r["frac_ceiling"] = ceil["median_s"] / t
            r["frac_ceiling_min"] = ceil["min_s"] / r["min_s"]  # best runs of each: least disturbed
        ref = eager.get(BASELINE_MODE.get(r["mode"], r["mode"]))
        if ref:
            r["speedup_vs_eager"] = ref["median_s"] / t
        comp = wl.get(COMPILED_REF.get(r["mode"], ""))
        if comp is None and r["mode"] in ("inplace", "out"):
            comp = wl.get(MODEL_COMPILE)
        if comp and comp.get("median_s"):
            r["speedup_vs_compile"] = comp["median_s"] / t
        if noop and noop.get("median_s"):
            r["x_noop_call"] = t / noop["median_s"]
        fwd = wl.get(f"{r['provider']}|out")
        if r["mode"] == "backward" and fwd and fwd.get("median_s"):
            r["x_forward"] = t / fwd["median_s"]

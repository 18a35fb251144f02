"""Markdown tables of a rope-bench JSON file (used to write cpu-results.md).

Usage: ``python benchmarks/render_results.py benchmarks/runs/cpu-targets.json``
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _ms(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def render(result: dict[str, Any]) -> str:
    """The machine, the command, one table of every timed row, and the summary lines."""
    from rope_ext.bench import summary

    m = result["machine"]
    out = [
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['torch_threads']} torch threads, "
        f"ISA {m['rope_ext_cpu_isa']}, torch {m['torch']}, allocator {m.get('cpu_allocator', 'n/a')}, "
        f"load average at start {m['loadavg']} and end {m.get('loadavg_end')}; "
        f"run took {result.get('elapsed_s', 0):.0f} s.",
        "",
        "| workload | mode | provider | median | p25 - p75 | GB/s | % ceiling | vs eager | x no-op |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        wl = f"{r['dtype']} {r['pairing']} {r['phase']} T={r['tokens']}"
        status = "" if r["status"] == "ok" else f" ({r['status'].upper()})"
        out.append(
            f"| {wl} | {r['mode']} | {r['provider']}{status} | {_ms(r.get('median_s'))} | "
            f"{_ms(r.get('p25_s'))} - {_ms(r.get('p75_s'))} | "
            + (f"{r['gbps']:.1f}" if "gbps" in r else "")
            + " | "
            + (f"{100 * r['frac_ceiling']:.0f}%" if "frac_ceiling" in r else "")
            + " | "
            + (f"{r['speedup_vs_eager']:.1f}x" if "speedup_vs_eager" in r else "")
            + " | "
            + (f"{r['x_noop_call']:.2f}" if "x_noop_call" in r else "")
            + " |"
        )
    out += ["", "```", *summary(result), "```"]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))

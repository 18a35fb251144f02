"""Report: the results table, one summary line per workload, JSON, CSV and the GB/s-vs-tokens plot.

Bytes counted per call (the minimum traffic of the op, the same for every provider): q and k read
once and written once, one cos/sin row (``rotary_dim`` values of the cache dtype) and one position
read per token. GB/s = bytes / median time.

``% ceil`` is the ceiling's time divided by the provider's time (in place against the in-place stream,
out of place and backward against clone); cos/sin and positions are not credited to the provider there.
A part's (``varlen_positions``) ``% rot`` is its time divided by the rotation's (``rope_ext`` in place).

The serving modes count their own bytes (:meth:`~rope_ext.bench.workloads.Case.bytes_moved`): ``cache`` /
``cache-fp8`` add v read, the cache rows written and the slots read, and take ``% ceil`` against
``stream cache`` / ``stream cache-fp8`` (those bytes streamed; see :mod:`.ceilings`); ``qknorm`` against
``stream in-place`` (its q and k heads read and written); ``mla`` / ``mla-fp8`` count q's rope part and k_pe
read and written, kv_c read, the latent cache rows written and the slots read (:mod:`.mla`), ``% ceil``
against ``stream mla`` / ``stream mla-fp8``; ``rerotate`` / ``rerotate-fp8`` count the cache rows' rotated
features read and written and the slots and deltas read (:mod:`.rerotate`), ``% ceil`` against ``stream
rerotate`` / ``stream rerotate-fp8``. Their ``vs eager`` is against the mode's unfused eager path
(``rope_ext unfused``, ``eager unfused``); the summary adds the ratio to ``torch.compile unfused``
(``qknorm``, MLA and rerotate modes), a decode step's ratio to ``rope_ext`` in place on the same tokens (for
the MLA modes: the rotation of the same q_pe and k_pe; for the rerotate modes: of the q and k of as many
tokens), and whether the issue's floors are met (:data:`SERVING_FLOORS`).

Vision and diffusion presets (``axes``): ``vs eager`` is against ``model-eager`` (the model's own RoPE code,
diffusers' or transformers'), and the summary gives rope_ext's ratios to ``model-compile`` and
``model-eager`` and whether a prefill meets the issue's targets
(:data:`~rope_ext.bench.presets.VISION_TARGETS`).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from typing import Any

from .presets import SERVING_MODES, VISION_TARGETS

__all__ = [
    "CEILING_STYLE",
    "CSV_FIELDS",
    "SERVING_FLOORS",
    "TABLE_COLUMNS",
    "plot",
    "print_table",
    "summary",
    "table_rows",
    "write_csv",
    "write_json",
]


def _fmt_time(s: float | None) -> str:
    if s is None:
        return ""
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.2f} ms"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


TABLE_COLUMNS = [
    "workload",
    "mode",
    "provider",
    "status",
    "median",
    "spread (p25-p75)",
    "bytes",
    "GB/s",
    "% ceil",
    "vs eager",
    "x no-op",
]


def _workload(r: dict[str, Any]) -> str:
    return (
        f"{r['preset']} {r['dtype']} {'il' if r['pairing'] == 'interleaved' else 'half'} "
        f"{r['phase']} T={r['tokens']}" + (f" seqs={r['seqs']}" if r.get("seqs") else "")
    )


def _pct(r: dict[str, Any]) -> str:
    if "frac_ceiling" in r:
        return f"{100 * r['frac_ceiling']:.0f}%"
    if "frac_rotation" in r:
        return f"{100 * r['frac_rotation']:.1f}% rot"
    return ""


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """The rows of the printed table, as strings."""
    out = []
    for r in result["rows"]:
        wl = _workload(r)
        status = r["status"]
        if status == "wrong":
            if r.get("err_fp8_codes", 0) > 1:
                status = f"WRONG ({r['err_fp8_codes']:.3g} fp8 codes)"
            elif r.get("detail"):
                status = f"WRONG ({r['detail']})"
            else:
                status = f"WRONG ({r['err_ulps']:.3g} ulp)"
        elif status == "error":
            status = f"ERROR {r.get('detail', '').split(':')[0][:28]}"
        t = r.get("median_s")
        spread = f"{_fmt_time(r.get('p25_s'))} - {_fmt_time(r.get('p75_s'))}" if t else ""
        out.append(
            [
                wl,
                r["mode"],
                r["provider"],
                status,
                _fmt_time(t),
                spread,
                "" if r["kind"] == "part" else _fmt_bytes(r["bytes"]),
                f"{r['gbps']:.1f}" if "gbps" in r else "",
                _pct(r),
                f"{r['speedup_vs_eager']:.1f}x" if "speedup_vs_eager" in r else "",
                f"{r['x_noop_call']:.2f}" if "x_noop_call" in r else "",
            ]
        )
    return out


def print_table(result: dict[str, Any], file: Any = None) -> None:
    """Prints the results table (rich when installed, plain text otherwise), then the notes."""
    file = file or sys.stdout
    rows = table_rows(result)
    m = result["machine"]
    head = (
        f"rope-bench on {m['cpu']} ({m['torch_threads']} threads, ISA {m['rope_ext_cpu_isa']}"
        + (f", prefetch {m['rope_ext_cpu_prefetch']} B" if "rope_ext_cpu_prefetch" in m else "")
        + (f" into L{m['rope_ext_cpu_prefetch_level']}" if "rope_ext_cpu_prefetch_level" in m else "")
        + (f", GPU {m['gpu']}" if "gpu" in m else "")
        + (f", allocator {m['cpu_allocator']}" if "cpu_allocator" in m else "")
        + f"), torch {m['torch']}, load {', '.join(f'{x:.2f}' for x in m.get('loadavg', []))}"
    )
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        widths = [
            max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(TABLE_COLUMNS)
        ]
        print(head, file=file)
        print("  ".join(c.ljust(w) for c, w in zip(TABLE_COLUMNS, widths, strict=True)), file=file)
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)), file=file)
    else:
        console = Console(file=file, width=max(180, Console(file=file).width))
        table = Table(title=escape(head), title_justify="left", show_lines=False)
        for c in TABLE_COLUMNS:
            table.add_column(
                c,
                justify="right" if c not in ("workload", "mode", "provider", "status") else "left",
                no_wrap=c in ("workload", "provider"),
            )
        prev = None
        for r in rows:
            if prev is not None and r[0] != prev:
                table.add_section()
            prev = r[0]
            style = "red" if r[3].startswith(("WRONG", "ERROR")) else ("dim" if r[1] == "ceiling" else None)
            table.add_row(*(escape(v) for v in r), style=style)  # "rope_ext[avx2]" is not markup
        console.print(table)
    print(
        "bytes: q and k read + written once, cos/sin row + position read once per token; "
        "% ceil: ceiling time / provider time on the same q, k bytes (in place vs 'stream in-place', "
        "out/backward vs 'clone'); % rot: part time / rotation time (rope_ext in place); vs eager: "
        "hf-eager time / time (vision / diffusion presets: model-eager, the model's own RoPE code); "
        "x no-op: time / registered no-op call.",
        file=file,
    )
    if any(r["mode"] in _SERVING for r in result["rows"]):
        print(
            "serving modes: cache bytes add v read, cache rows written, slots read; % ceil vs 'stream "
            "cache[-fp8]' (those bytes streamed), qknorm vs 'stream in-place' (q, k heads); mla bytes: q's "
            "rope part and k_pe read + written, kv_c read, latent cache rows written, slots read, % ceil vs "
            "'stream mla[-fp8]'; rerotate bytes: the cache rows' rotated features read + written, slots and "
            "deltas read, % ceil vs 'stream rerotate[-fp8]'; vs eager: the unfused eager path (rope_ext "
            "unfused / eager unfused) time / time.",
            file=file,
        )
    for line in summary(result):
        print(line, file=file)
    for n in result["notes"]:
        print(f"note: {n}", file=file)


def summary(result: dict[str, Any], name: str = "rope_ext") -> list[str]:
    """One line per workload: how provider ``name`` stands against the ceilings and the references.

    Each serving mode that ran adds its own line per workload: time, % of its ceiling, the ratios to the
    unfused references, for a decode step its ratio to ``name`` in place, and the issue's floors, met or not
    (:data:`SERVING_FLOORS`). Packed workloads add ``name+varlen`` in place and the ``varlen_positions``
    part; then one line per prefill that ran with several sequence counts compares ``name`` in place
    across them.
    """
    lines = []
    by_wl: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in result["rows"]:
        key = (r["preset"], r["dtype"], r["pairing"], r["phase"], r["tokens"], r.get("seqs"))
        by_wl.setdefault(key, {})[f"{r['provider']}|{r['mode']}"] = r
    for (preset, dt, pairing, phase, tokens, seqs), rows in by_wl.items():
        parts = []
        ip, out, bwd = rows.get(f"{name}|inplace"), rows.get(f"{name}|out"), rows.get(f"{name}|backward")
        if ip and "frac_ceiling" in ip:
            parts.append(
                f"in place {100 * ip['frac_ceiling']:.0f}% of stream (best runs "
                f"{100 * ip['frac_ceiling_min']:.0f}%)"
            )
        vl, vp = rows.get(f"{name}+varlen|inplace"), rows.get("varlen_positions|part")
        if vl and "frac_ceiling" in vl:
            parts.append(
                f"with varlen_positions {100 * vl['frac_ceiling']:.0f}% of stream (best runs "
                f"{100 * vl['frac_ceiling_min']:.0f}%)"
            )
        if vp and "frac_rotation" in vp:
            parts.append(
                f"varlen_positions {100 * vp['frac_rotation']:.1f}% of the rotation (best runs "
                f"{100 * vp['frac_rotation_min']:.1f}%)"
            )
        if out and "frac_ceiling" in out:
            parts.append(
                f"out of place {100 * out['frac_ceiling']:.0f}% of clone (best runs "
                f"{100 * out['frac_ceiling_min']:.0f}%)"
            )
            for ref in ("hf-compile", "hf-eager"):
                rr = rows.get(f"{ref}|out")
                if rr and rr.get("median_s"):
                    parts.append(f"{rr['median_s'] / out['median_s']:.1f}x {ref}")
        if ip and (rows.get("model-eager|out") or rows.get("model-compile|out")) and "median_s" in ip:
            parts += _vision_words(ip, rows, cpu="gpu" not in result["machine"])
        if bwd and "x_forward" in bwd:
            parts.append(f"backward {bwd['x_forward']:.2f}x forward")
        for r in (ip, out):
            if r and "x_noop_call" in r and phase == "decode":
                parts.append(f"{r['mode']} call {r['x_noop_call']:.2f}x no-op")
        wl = f"{preset} {dt} {pairing} {phase} T={tokens}" + (f" seqs={seqs}" if seqs else "")
        if parts:
            lines.append(f"{name} {wl}: " + ", ".join(parts))
        for mode, words in _serving_parts(result, rows, name, phase, tokens):
            lines.append(f"{name} {mode} {wl}: " + ", ".join(words))
    # The same prefill packed as different numbers of sequences: the token-parallel grid should not care.
    by_seqs: dict[tuple, list[dict[str, Any]]] = {}
    for (preset, dt, pairing, phase, tokens, seqs), rows in by_wl.items():
        ip = rows.get(f"{name}|inplace")
        if seqs and ip and "frac_ceiling" in ip:
            by_seqs.setdefault((preset, dt, pairing, phase, tokens), []).append(ip)
    for (preset, dt, pairing, phase, tokens), ips in by_seqs.items():
        if len(ips) < 2:
            continue
        each = ", ".join(
            f"{r['seqs']}: {_fmt_time(r['median_s'])} {100 * r['frac_ceiling']:.0f}% "
            f"({100 * r['frac_ceiling_min']:.0f}%)"
            for r in ips
        )
        fr = [r["frac_ceiling"] for r in ips]
        fm = [r["frac_ceiling_min"] for r in ips]
        lines.append(
            f"{name} in place by sequences, {preset} {dt} {pairing} {phase} T={tokens}: {each}; "
            f"% of stream max / min {max(fr) / min(fr):.2f}x (best runs {max(fm) / min(fm):.2f}x)"
        )
    return lines


def _vision_words(ip: dict[str, Any], rows: dict[str, dict[str, Any]], cpu: bool) -> list[str]:
    """In place against the model's own RoPE code, and the issue's targets (a CPU's prefill)."""
    t = VISION_TARGETS
    words, checks = [], []
    if "frac_ceiling" in ip:
        checks.append((ip["frac_ceiling"], t["frac_ceiling"], f"{100 * t['frac_ceiling']:.0f}% of stream"))
    for ref, key in (("model-compile", "speedup_vs_compile"), ("model-eager", "speedup_vs_eager")):
        rr = rows.get(f"{ref}|out")
        if rr and rr.get("median_s"):
            x = rr["median_s"] / ip["median_s"]
            words.append(f"in place {x:.1f}x {ref}")
            checks.append((x, t[key], f"{t[key]:g}x {ref}"))
    if cpu and ip["phase"] == "prefill":
        words += [f"target {text}: {_met(got >= want)}" for got, want, text in checks]
    return words


_SERVING = SERVING_MODES
# The floors for the fused serving ops, Llama-3-8B-sized: a prefill of prefill_tokens or more at
# frac_ceiling of its ceiling (every serving mode, on a CPU or a GPU), the QK norm there at least
# qknorm_speedup_vs_compile times torch.compile of the unfused reference (on a CPU); a decode step of at most
# decode_max_tokens within decode_x_inplace of rope_ext's in-place rotation of the same q and k.
SERVING_FLOORS = {
    "prefill_tokens": 4096,
    "frac_ceiling": 0.85,
    "qknorm_speedup_vs_compile": 2.0,
    "decode_max_tokens": 64,
    "decode_x_inplace": 1.5,
}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _serving_parts(
    result: dict[str, Any], rows: dict[str, dict[str, Any]], name: str, phase: str, tokens: int
) -> list[tuple[str, list[str]]]:
    """The summary's words on each serving mode of one workload (see :func:`summary`)."""
    parts = []
    f = SERVING_FLOORS
    cpu = "gpu" not in result["machine"]
    ip = rows.get(f"{name}|inplace")
    for mode in _SERVING:
        r = rows.get(f"{name}|{mode}")
        if not r or "median_s" not in r:
            continue
        words = [f"{mode} {_fmt_time(r['median_s'])}"]
        if "frac_ceiling" in r:
            pct, best = 100 * r["frac_ceiling"], 100 * r["frac_ceiling_min"]
            words.append(f"{pct:.0f}% of {r['ceiling']} (best runs {best:.0f}%)")
        if "speedup_vs_compile" in r:
            words.append(f"{r['speedup_vs_compile']:.2f}x torch.compile unfused")
        base = next((b for b in rows.values() if b.get("baseline") and b["mode"] == mode), None)
        if base and "speedup_vs_eager" in r:
            words.append(f"{r['speedup_vs_eager']:.2f}x {base['provider']}")
        if "x_noop_call" in r and phase == "decode":
            words.append(f"call {r['x_noop_call']:.2f}x no-op")
        if phase == "decode" and ip and ip.get("median_s"):
            x = r["median_s"] / ip["median_s"]
            words.append(f"{x:.2f}x {name} in place")
            if tokens <= f["decode_max_tokens"]:
                words.append(f"floor {f['decode_x_inplace']:g}x in place: {_met(x <= f['decode_x_inplace'])}")
        if phase == "prefill" and tokens >= f["prefill_tokens"]:
            floors = [("frac_ceiling", f["frac_ceiling"], f"{100 * f['frac_ceiling']:.0f}% of ceiling")]
            if mode == "qknorm" and cpu:
                want = f["qknorm_speedup_vs_compile"]
                floors.append(("speedup_vs_compile", want, f"{want:g}x torch.compile unfused"))
            for k, want, text in floors:
                if k in r:
                    words.append(f"floor {text}: {_met(r[k] >= want)}")
        parts.append((mode, words))
    return parts


CSV_FIELDS = [
    "preset",
    "q_heads",
    "kv_heads",
    "head_dim",
    "rotary_dim",
    "pairing",
    "dtype",
    "phase",
    "tokens",
    "seqs",
    "mode",
    "provider",
    "kind",
    "status",
    "err_ulps",
    "median_s",
    "p25_s",
    "p75_s",
    "min_s",
    "n",
    "bytes",
    "gbps",
    "ceiling",
    "frac_ceiling",
    "frac_ceiling_min",
    "speedup_vs_eager",
    "speedup_vs_compile",
    "x_noop_call",
    "x_forward",
    "frac_rotation",
    "frac_rotation_min",
    "input_sets",
    "err_fp8_codes",
    "stream_bytes",
    "detail",
]


def write_csv(result: dict[str, Any], path: str) -> None:
    """One line per row of ``result``, the columns of :data:`CSV_FIELDS`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow(r)


def write_json(result: dict[str, Any], path: str) -> None:
    """The whole ``result`` (machine, config, command, rows, notes) as JSON."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


# Line style and colour of each ceiling in the plot.
CEILING_STYLE = {
    "stream in-place": ("--", "black"),
    "clone": ("--", "gray"),
    "copy into": (":", "black"),
    "stream cache": ("-.", "black"),
    "stream cache-fp8": ("-.", "gray"),
    "stream mla": (":", "tab:blue"),
    "stream mla-fp8": (":", "tab:cyan"),
    "stream rerotate": ("-.", "tab:green"),
    "stream rerotate-fp8": ("-.", "tab:olive"),
}


def plot(result: dict[str, Any], path: str) -> None:
    """GB/s against tokens, one line per provider and mode, dashed lines for the ceilings.

    One panel per (preset, dtype, pairing).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        if "gbps" in r:
            groups.setdefault((r["preset"], r["dtype"], r["pairing"]), []).append(r)
    n = max(len(groups), 1)
    cols = min(n, 2)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.2 * cols, 3.8 * nrows), squeeze=False)
    for ax, ((preset, dt, pairing), rs) in zip(axes.flat, sorted(groups.items()), strict=False):
        lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rs:
            if r["provider"] == "no-op call":
                continue
            if r["kind"] == "ceiling" and any(
                x == r["tokens"] for x, _ in lines.get((r["provider"], "ceiling"), [])
            ):
                continue  # one ceiling point per token count (packed workloads repeat it per sequence count)
            label = r["provider"] + (
                f", {r['seqs']} seqs" if r.get("seqs") and r["kind"] != "ceiling" else ""
            )
            lines.setdefault((label, r["mode"]), []).append((r["tokens"], r["gbps"]))
        for (name, mode), pts in sorted(lines.items(), key=lambda kv: (kv[0][1] == "ceiling", kv[0])):
            pts.sort()
            xs, ys = zip(*pts, strict=True)
            if mode == "ceiling":
                style = CEILING_STYLE.get(name, ("--", "gray"))
                ax.plot(xs, ys, style[0], color=style[1], lw=1.1, label=f"ceiling: {name}")
            else:
                ax.plot(xs, ys, "o-", ms=3, lw=1.3, label=f"{name} ({mode})")
        cold = [r["tokens"] for r in rs if r.get("input_sets", 1) > 1]
        if cold:
            ax.axvline(min(cold), color="0.6", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{preset} {dt} {pairing}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    for ax in list(axes.flat)[len(groups) :]:
        ax.axis("off")
    m = result["machine"]
    fig.suptitle(
        f"rope-bench: {m.get('gpu', m['cpu'])}, {m['torch_threads']} threads "
        "(dotted: from here on, inputs rotated so calls run from memory, not cache)",
        fontsize=9,
    )
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if nrows == 1 else 0.05, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)

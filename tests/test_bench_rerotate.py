"""rope-bench's rerotate modes (``rerotate``, ``rerotate-fp8``: cached keys rotated in place by per-token
shifts), tiny. Never timings."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import rope_ext
from rope_ext import bench
from rope_ext.bench.ceilings import ceiling_bytes
from rope_ext.bench.rerotate import expected_cache, rerotate_tensors
from rope_ext.reference import quantize_fp8

# Partial rotary (8 of 16 features, half-split) and an MLA-shaped preset: the rerotate modes run on both.
TINY = bench.Preset("tiny", 4, 2, 16, 8, False)
TINY_MLA = bench.Preset(
    "tiny-mla", 4, 1, 8, 8, True, 1e4, mla=bench.Mla(qk_nope_head_dim=16, kv_lora_rank=32)
)
CPU = torch.device("cpu")


def rerotate_config(**kw) -> bench.Config:
    base = dict(
        presets=[TINY],
        prefill_tokens=[8],
        decode_tokens=[2],
        dtypes=[torch.bfloat16],
        pairings=["model"],
        modes=["inplace", "rerotate", "rerotate-fp8"],
        providers=["rope_ext", "eager unfused"],
        rounds=1,
        min_run_time=0.001,
        progress=False,
    )
    base.update(kw)
    return bench.Config(**base)


def test_rerotate_modes_parse():
    assert bench.REROTATE_MODES == ("rerotate", "rerotate-fp8")
    assert set(bench.REROTATE_MODES) <= set(bench.SERVING_MODES) <= set(bench.ALL_MODES)
    assert bench.config_from_args(bench.parse_args([])).modes == ["inplace", "out", "backward"]
    argv = ["--preset", "llama-3-8b", "--mode", "inplace,rerotate,rerotate-fp8", "--tokens", "4096"]
    cfg = bench.config_from_args(bench.parse_args(argv + ["--decode-tokens", "1,8,64"]))
    assert cfg.modes == ["inplace", "rerotate", "rerotate-fp8"] and cfg.prefill_tokens == [4096]
    assert cfg.decode_tokens == [1, 8, 64]
    assert bench.CEILING_FOR_MODE["rerotate-fp8"] == "stream rerotate-fp8"


def test_rerotate_bytes_by_hand():
    # tiny, T = 8, bf16: 8 tokens x 2 heads x 8 rotated features x 2 B read and written (the 8 pass-through
    # features untouched), an int64 slot and an int64 delta per token; fp8: one byte per feature.
    case = bench.make_case(TINY, 8, "prefill", torch.bfloat16, False, CPU)
    rows, slots, deltas = 8 * 2 * 8 * 2, 8 * 8, 8 * 8
    assert case.bytes_moved("rerotate") == 2 * rows + slots + deltas == 640
    assert case.bytes_moved("rerotate-fp8") == 2 * 128 + slots + deltas == 384
    # The ceiling streams the rows' rotated features in place, without slots and deltas.
    assert ceiling_bytes(case, "stream rerotate") == 512 and ceiling_bytes(case, "stream rerotate-fp8") == 256
    # The target: 4096 cached tokens of Llama-3-8B (8 kv heads of 128) in bf16.
    case = bench.make_case(bench.PRESETS["llama-3-8b"], 4096, "prefill", torch.bfloat16, False, CPU)
    assert case.bytes_moved("rerotate") == 2 * 4096 * 8 * 128 * 2 + 16 * 4096 == 16_842_752


def test_rerotate_inputs():
    case = bench.make_case(TINY, 8, "prefill", torch.bfloat16, False, CPU)
    s = case.rerotate
    assert s is case.rerotate and s.num_blocks == 1 and s.slot_mapping.dtype == s.delta.dtype == torch.int64
    slots = s.slot_mapping.tolist()
    assert len(set(slots)) == 8 and max(slots) < bench.KV_BLOCK_SIZE  # a cache of just its tokens' block
    assert int(s.delta.abs().max()) < case.cos_sin.shape[0] and (s.delta < 0).any() and (s.delta > 0).any()
    cache = rerotate_tensors(case, fp8=False)
    assert cache.shape == (1, bench.KV_BLOCK_SIZE, 2, 16) and cache.dtype == torch.bfloat16
    assert cache.data_ptr() != s.key_cache.data_ptr()  # each provider rotates its own copy
    flat = cache.view(-1, 2, 16)
    others = [i for i in range(bench.KV_BLOCK_SIZE) if i not in slots]
    assert torch.equal(flat[s.slot_mapping], case.k) and not flat[others].any()
    fp8 = rerotate_tensors(case, fp8=True)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == cache.shape
    want = quantize_fp8(case.k, s.k_scale, torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(fp8.view(torch.uint8).view(-1, 2, 16)[s.slot_mapping], want)
    decode = bench.make_case(TINY, 3, "decode", torch.bfloat16, False, CPU)
    assert decode.rerotate.num_blocks * bench.KV_BLOCK_SIZE == 4096  # DECODE_CACHE_SLOTS, as the cache modes
    assert int(decode.rerotate.delta.abs().max()) < bench.DECODE_CONTEXT


def test_rerotate_modes_validate_with_their_ceilings():
    result = bench.run_benchmark(rerotate_config(presets=[TINY, TINY_MLA], pairings=["half", "interleaved"]))
    provs = [r for r in result["rows"] if r["kind"] == "provider"]
    assert all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]
    rr = [r for r in provs if r["mode"] in bench.REROTATE_MODES]
    # rope_ext and eager unfused, 2 modes x 2 presets (every preset) x 2 pairings x (prefill 8, decode 2).
    assert len(rr) == 2 * 2 * 2 * 2 * 2 and {r["preset"] for r in rr} == {"tiny", "tiny-mla"}
    for r in rr:
        assert r["ceiling"] == f"stream {r['mode']}" and r["frac_ceiling"] > 0 and r["speedup_vs_eager"] > 0
        preset = TINY if r["preset"] == "tiny" else TINY_MLA
        il = r["pairing"] == "interleaved"
        case = bench.make_case(preset, r["tokens"], r["phase"], torch.bfloat16, il, CPU)
        assert r["bytes"] == case.bytes_moved(r["mode"])
    assert all(r["err_ulps"] < 2 for r in rr if r["mode"] == "rerotate")
    assert all(r["err_fp8_codes"] <= 1 for r in rr if r["mode"] == "rerotate-fp8")
    assert all(
        r["err_fp8_codes"] == 0 for r in rr if r["mode"] == "rerotate-fp8" and r["provider"] == "rope_ext"
    )
    ceilings = [r for r in result["rows"] if r["provider"].startswith("stream rerotate")]
    assert len(ceilings) == 2 * 2 * 2 * 2
    for r in ceilings:
        assert r["bytes"] == r["stream_bytes"] and r["gbps"] == pytest.approx(
            r["bytes"] / r["median_s"] / 1e9
        )
    assert not result["notes"]  # no preset skipped
    table = bench.table_rows(result)
    assert all(r[8].endswith("%") for r in table if r[1] in bench.REROTATE_MODES)  # the % ceil column
    lines = bench.summary(result)
    line = next(s for s in lines if s.startswith("rope_ext rerotate tiny bf16 half-split decode T=2:"))
    assert "% of stream rerotate" in line and "x eager unfused" in line and "x rope_ext in place" in line
    assert any(s.startswith("rope_ext rerotate-fp8 tiny-mla bf16 interleaved prefill T=8:") for s in lines)


def test_rerotate_compiled_baseline():
    cfg = rerotate_config(
        modes=["rerotate-fp8"],
        decode_tokens=[],
        providers=["rope_ext", "eager unfused", "torch.compile unfused"],
    )
    result = bench.run_benchmark(cfg)
    provs = {r["provider"]: r for r in result["rows"] if r["kind"] == "provider"}
    assert all(r["status"] == "ok" for r in provs.values()), provs
    if "torch.compile unfused" not in provs:
        assert any("torch.compile unfused" in n for n in result["notes"])
        pytest.skip("torch.compile unavailable here")
    assert provs["rope_ext"]["speedup_vs_compile"] > 0
    assert any("x torch.compile unfused" in s for s in bench.summary(result))


def test_wrong_rerotate_provider_is_reported(monkeypatch):
    op = rope_ext.rerotate_kv_cache_

    def wrong_sign(cache, slots, delta, cos_sin, **kw):
        op(cache, slots, -delta, cos_sin, **kw)

    def shifts_swapped(cache, slots, delta, cos_sin, **kw):
        op(cache, slots, delta.roll(1), cos_sin, **kw)  # each row by another token's shift

    def touches_another_row(cache, slots, delta, cos_sin, **kw):
        op(cache, slots, delta, cos_sin, **kw)
        cache.view(torch.uint8).view(-1, *cache.shape[2:])[-1, 0, 0] += 1  # decode: a slot not rotated

    def run(mode, decode=False):
        cfg = rerotate_config(
            modes=[mode], prefill_tokens=[] if decode else [8], decode_tokens=[2] if decode else []
        )
        result = bench.run_benchmark(cfg)
        rows = {r["provider"]: r for r in result["rows"] if r["kind"] == "provider"}
        assert rows["eager unfused"]["status"] == "ok"
        assert rows["rope_ext"]["status"] == "wrong" and "median_s" not in rows["rope_ext"]
        return rows["rope_ext"], "\n".join(" ".join(r) for r in bench.table_rows(result))

    monkeypatch.setattr(rope_ext, "rerotate_kv_cache_", wrong_sign)
    row, table = run("rerotate")
    assert row["err_ulps"] > 100 and "ulp" in table
    monkeypatch.setattr(rope_ext, "rerotate_kv_cache_", shifts_swapped)
    row, table = run("rerotate-fp8")
    assert row["err_fp8_codes"] > 1 and "fp8 codes" in table
    monkeypatch.setattr(rope_ext, "rerotate_kv_cache_", touches_another_row)
    row, table = run("rerotate", decode=True)
    assert row["detail"] == "rows or features not rotated changed" and "not rotated changed" in table


def test_expected_cache_is_the_op_in_float64():
    # A shift and its inverse: the reference puts the keys back where they were (within rounding).
    case = bench.make_case(TINY, 8, "prefill", torch.float32, True, CPU)
    exp = expected_cache(case, fp8=False)
    cache = rerotate_tensors(case, fp8=False)
    slots, delta = case.rerotate.slot_mapping, case.rerotate.delta
    rope_ext.rerotate_kv_cache_(cache, slots, delta, case.cos_sin, interleaved=True)
    assert torch.allclose(cache.view(exp.shape).double(), exp, atol=1e-6)
    rope_ext.rerotate_kv_cache_(cache, slots, -delta, case.cos_sin, interleaved=True)
    assert torch.allclose(cache, case.rerotate.key_cache, atol=1e-5)


def _render_markdown(result: dict) -> str:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "render_results.py"
    spec = importlib.util.spec_from_file_location("render_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render(result)


def test_cli_rerotate_json_csv_and_markdown(tmp_path, capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "rope_ext (rerotate)" in out and "eager unfused (rerotate-fp8)" in out
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    argv = ["--preset", "llama-3.2-1b", "--tokens", "16", "--decode-tokens", "1", "--dtype", "bf16"]
    argv += ["--mode", "inplace,rerotate,rerotate-fp8", "--providers", "rope_ext,eager unfused"]
    argv += ["--rounds", "1", "--min-run-time", "0.001", "--no-progress", "--json", str(js), "--csv", str(cs)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "stream rerotate" in out and "rerotate bytes:" in out
    assert "rope_ext rerotate llama-3.2-1b bf16 half-split prefill T=16:" in out
    data = json.loads(js.read_text())
    rows = [r for r in data["rows"] if r["mode"] in bench.REROTATE_MODES]
    assert {(r["provider"], r["mode"], r["phase"]) for r in rows} == {
        (p, m, ph)
        for p in ("rope_ext", "eager unfused")
        for m in bench.REROTATE_MODES
        for ph in ("prefill", "decode")
    }
    for r in rows:
        assert r["status"] == "ok" and r["frac_ceiling"] > 0 and r["ceiling"] == f"stream {r['mode']}"
    # llama-3.2-1b: 8 kv heads of 64; one decode token in bf16: 8 x 64 x 2 B read + written, slot, delta.
    fused = next(
        r for r in rows if r["provider"] == "rope_ext" and r["mode"] == "rerotate" and r["phase"] == "decode"
    )
    assert fused["bytes"] == 2 * 8 * 64 * 2 + 16 == 2064
    stream = next(
        r for r in data["rows"] if r["provider"] == "stream rerotate-fp8" and r["phase"] == "decode"
    )
    assert stream["bytes"] == stream["stream_bytes"] == 2 * 8 * 64
    with open(cs) as f:
        csv_rows = list(csv.DictReader(f))
    assert {r["provider"] for r in csv_rows} >= {"stream rerotate", "stream rerotate-fp8", "eager unfused"}
    assert any(r["mode"] == "rerotate-fp8" and r["err_fp8_codes"] for r in csv_rows)
    md = _render_markdown(data)
    assert "| bf16 half-split prefill T=16 | rerotate | rope_ext |" in md
    assert "rope_ext rerotate-fp8 llama-3.2-1b bf16 half-split decode T=1:" in md

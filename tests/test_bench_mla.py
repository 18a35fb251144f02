"""rope-bench's MLA modes (``mla``, ``mla-fp8``: RoPE + MLA latent-cache write), tiny. Never timings."""

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
from rope_ext.bench.mla import mla_tensors

# q [T, 4, 16 + 8], k_pe [T, 1, 8], kv_c [T, 32]: the preset's head_dim and rotary_dim are the rope part.
TINY_MLA = bench.Preset(
    "tiny-mla", 4, 1, 8, 8, True, 1e4, mla=bench.Mla(qk_nope_head_dim=16, kv_lora_rank=32)
)
TINY = bench.Preset("tiny", 4, 2, 16, 8, False)  # no MLA shape
CPU = torch.device("cpu")


def mla_config(**kw) -> bench.Config:
    base = dict(
        presets=[TINY_MLA],
        prefill_tokens=[8],
        decode_tokens=[1],
        dtypes=[torch.bfloat16],
        pairings=["model"],
        modes=["inplace", "mla", "mla-fp8"],
        providers=["rope_ext", "eager unfused"],
        rounds=1,
        min_run_time=0.001,
        progress=False,
    )
    base.update(kw)
    return bench.Config(**base)


def _provider_rows(result) -> list[dict]:
    provs = [r for r in result["rows"] if r["kind"] == "provider"]
    assert provs and all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]
    return provs


def test_mla_modes_parse_and_preset():
    assert bench.MLA_MODES == ("mla", "mla-fp8") and set(bench.MLA_MODES) <= set(bench.SERVING_MODES)
    assert bench.config_from_args(bench.parse_args([])).modes == ["inplace", "out", "backward"]
    cfg = bench.config_from_args(bench.parse_args(["--preset", "deepseek-v3", "--mode", "mla,mla-fp8"]))
    assert cfg.modes == ["mla", "mla-fp8"] and cfg.presets == [bench.PRESETS["deepseek-v3"]]
    p = bench.PRESETS["deepseek-v3"]
    assert (p.q_heads, p.kv_heads, p.head_dim, p.rotary_dim, p.interleaved, p.base) == (
        128,
        1,
        64,
        64,
        True,
        1e4,
    )
    assert p.mla == bench.Mla(qk_nope_head_dim=128, kv_lora_rank=512)
    assert [n for n, q in bench.PRESETS.items() if q.mla is not None] == ["deepseek-v3"]
    with pytest.raises(ValueError, match="MLA preset"):
        bench.Preset("bad", 4, 2, 8, 8, True, mla=bench.Mla(16, 32))  # k_pe is one head
    with pytest.raises(ValueError, match="MLA shape"):
        bench.Mla(16, 0)


def test_mla_bytes_by_hand():
    # tiny-mla, T = 8, bf16: q's rope part 8 x 4 x 8 x 2 B and k_pe 8 x 8 x 2 B, both read and written;
    # kv_c 8 x 32 x 2 B read; cache rows 8 x (32 + 8) values written (2 B each; fp8 1 B); slots 8 x 8 B;
    # cos/sin rows 8 x 8 x 4 B and positions 8 x 8 B read.
    case = bench.make_case(TINY_MLA, 8, "prefill", torch.bfloat16, True, CPU)
    q_rope, k_pe, kv_c, slots, cos_sin, pos = 512, 128, 512, 64, 256, 64
    assert case.bytes_moved("mla") == 2 * q_rope + 2 * k_pe + kv_c + 640 + slots + cos_sin + pos == 2816
    assert case.bytes_moved("mla-fp8") == 2816 - 320
    assert (
        case.kv_c_bytes() == 512 and case.mla_cache_bytes(False) == 640 and case.mla_cache_bytes(True) == 320
    )
    # The ceiling streams the same bytes but cos/sin, positions and slots.
    assert ceiling_bytes(case, "stream mla") == 2 * q_rope + 2 * k_pe + kv_c + 640 == 2432
    assert ceiling_bytes(case, "stream mla-fp8") == 2432 - 320
    # DeepSeek-V3, one decode token, bf16: q_pe 128 x 64 and k_pe 64 read + written, kv_c 512 read,
    # 576 cache values written, 8 B slot, 64 float32 cos/sin, 8 B position.
    case = bench.make_case(bench.PRESETS["deepseek-v3"], 1, "decode", torch.bfloat16, True, CPU)
    want = 2 * 128 * 64 * 2 + 2 * 64 * 2 + 512 * 2 + 576 * 2 + 8 + 64 * 4 + 8
    assert case.bytes_moved("mla") == want == 35_472
    assert case.bytes_moved("mla-fp8") == want - 576
    with pytest.raises(ValueError, match="no MLA shape"):
        bench.make_case(TINY, 8, "prefill", torch.bfloat16, False, CPU).bytes_moved("mla")


def test_mla_inputs():
    case = bench.make_case(TINY_MLA, 8, "prefill", torch.bfloat16, True, CPU)
    s = case.mla
    assert s is case.mla and s.q_nope.shape == (8, 4, 16) and s.kv_c.shape == (8, 32)
    assert s.num_blocks == 1 and sorted(s.slot_mapping.tolist()) == sorted(set(s.slot_mapping.tolist()))
    q, kv_c, k_pe, cache = mla_tensors(case, fp8=True)
    assert q.shape == (8, 4, 24) and torch.equal(q[..., 16:], case.q) and torch.equal(q[..., :16], s.q_nope)
    assert k_pe.shape == (8, 1, 8) and torch.equal(k_pe, case.k) and torch.equal(kv_c, s.kv_c)
    assert kv_c.untyped_storage().data_ptr() == k_pe.untyped_storage().data_ptr()  # one projection output
    assert cache.shape == (1, bench.MLA_BLOCK_SIZE, 40) and cache.dtype == torch.float8_e4m3fn
    decode = bench.make_case(TINY_MLA, 3, "decode", torch.bfloat16, True, CPU)
    assert decode.mla.num_blocks * bench.MLA_BLOCK_SIZE == 4096  # DECODE_CACHE_SLOTS, as the cache modes


def test_mla_modes_validate_with_their_ceilings():
    result = bench.run_benchmark(mla_config(presets=[TINY_MLA, TINY], pairings=["half", "interleaved"]))
    provs = _provider_rows(result)
    mla = [r for r in provs if r["mode"] in bench.MLA_MODES]
    # rope_ext and eager unfused, 2 modes x 2 pairings x (prefill 8, decode 1), tiny-mla only.
    assert {(r["provider"], r["mode"]) for r in mla} == {
        (n, m) for n in ("rope_ext", "eager unfused") for m in bench.MLA_MODES
    }
    assert len(mla) == 2 * 2 * 2 * 2 and {r["preset"] for r in mla} == {"tiny-mla"}
    assert {r["phase"] for r in mla} == {"prefill", "decode"}
    for r in mla:
        assert r["ceiling"] == f"stream {r['mode']}" and r["frac_ceiling"] > 0
        assert r["speedup_vs_eager"] > 0  # against eager unfused
        assert (r["qk_nope_head_dim"], r["kv_lora_rank"]) == (16, 32)
        case = bench.make_case(TINY_MLA, r["tokens"], r["phase"], torch.bfloat16, True, CPU)
        assert r["bytes"] == case.bytes_moved(r["mode"])
    assert all(r["err_ulps"] < 2 for r in mla if r["provider"] == "rope_ext")
    assert all(r["err_fp8_codes"] <= 1 for r in mla if r["mode"] == "mla-fp8")
    ceilings = [
        r for r in result["rows"] if r["kind"] == "ceiling" and r["provider"].startswith("stream mla")
    ]
    assert {r["preset"] for r in ceilings} == {"tiny-mla"}  # none for a preset without an MLA shape
    for r in ceilings:
        assert r["bytes"] == r["stream_bytes"] and r["gbps"] == pytest.approx(
            r["bytes"] / r["median_s"] / 1e9
        )
    # The preset without an MLA shape: its rotary rows, no MLA rows, one note per mode.
    assert any(r["preset"] == "tiny" and r["mode"] == "inplace" for r in provs)
    assert any("mla runs on presets with an MLA shape" in n and "tiny" in n for n in result["notes"])
    table = bench.table_rows(result)
    assert all(r[8].endswith("%") for r in table if r[1] in bench.MLA_MODES)  # the % ceil column
    assert any("stream mla-fp8" in r for r in table)
    lines = bench.summary(result)
    line = next(s for s in lines if s.startswith("rope_ext mla tiny-mla bf16 interleaved decode T=1:"))
    assert "% of stream mla" in line and "x eager unfused" in line and "x rope_ext in place" in line
    assert any(s.startswith("rope_ext mla-fp8 tiny-mla bf16 half-split prefill T=8:") for s in lines)


def test_mla_compiled_baseline():
    cfg = mla_config(
        modes=["mla-fp8"], decode_tokens=[], providers=["rope_ext", "eager unfused", "torch.compile unfused"]
    )
    result = bench.run_benchmark(cfg)
    provs = _provider_rows(result)
    names = {r["provider"] for r in provs}
    if "torch.compile unfused" not in names:
        assert any("torch.compile unfused" in n for n in result["notes"])
        pytest.skip("torch.compile unavailable here")
    fused = next(r for r in provs if r["provider"] == "rope_ext")
    assert fused["speedup_vs_compile"] > 0
    assert any("x torch.compile unfused" in s for s in bench.summary(result))


def test_wrong_mla_provider_is_reported(monkeypatch):
    fused = rope_ext.apply_mla_rotary_and_cache_

    def misplaced(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping, **kw):
        fused(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping.flip(0), **kw)

    def bad_scale(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping, **kw):
        fused(
            q,
            kv_c,
            k_pe,
            positions,
            cos_sin,
            kv_cache,
            slot_mapping,
            **{**kw, "kv_scale": kw["kv_scale"] * 2},
        )

    def touches_nope(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping, **kw):
        fused(q, kv_c, k_pe, positions, cos_sin, kv_cache, slot_mapping, **kw)
        q[..., 0] += 1

    def run(mode):
        cfg = mla_config(modes=[mode], providers=["rope_ext", "eager unfused"], decode_tokens=[])
        result = bench.run_benchmark(cfg)
        rows = {r["provider"]: r for r in result["rows"] if r["kind"] == "provider"}
        assert rows["eager unfused"]["status"] == "ok"
        assert rows["rope_ext"]["status"] == "wrong" and "median_s" not in rows["rope_ext"]
        return rows["rope_ext"], "\n".join(" ".join(r) for r in bench.table_rows(result))

    monkeypatch.setattr(rope_ext, "apply_mla_rotary_and_cache_", misplaced)
    row, _ = run("mla")
    assert row["err_ulps"] > 100  # k_pe rows in each other's slots
    monkeypatch.setattr(rope_ext, "apply_mla_rotary_and_cache_", bad_scale)
    row, table = run("mla-fp8")
    assert row["err_fp8_codes"] > 1 and row["err_ulps"] < 2 and "fp8 codes" in table
    monkeypatch.setattr(rope_ext, "apply_mla_rotary_and_cache_", touches_nope)
    row, table = run("mla")
    assert row["detail"] == "q's nope part changed" and "nope part changed" in table


def _render_markdown(result: dict) -> str:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "render_results.py"
    spec = importlib.util.spec_from_file_location("render_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render(result)


def test_cli_mla_json_csv_and_markdown(tmp_path, capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3 " in out and "mla nope 128 kv_lora_rank 512" in out
    assert "rope_ext (mla)" in out and "eager unfused (mla-fp8)" in out
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    argv = ["--preset", "deepseek-v3", "--tokens", "8", "--decode-tokens", "1", "--dtype", "bf16"]
    argv += ["--mode", "inplace,mla,mla-fp8", "--providers", "rope_ext,eager unfused"]
    argv += ["--rounds", "1", "--min-run-time", "0.001", "--no-progress", "--json", str(js), "--csv", str(cs)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "stream mla" in out and "mla bytes:" in out
    assert "rope_ext mla deepseek-v3 bf16 interleaved prefill T=8:" in out
    data = json.loads(js.read_text())
    rows = [r for r in data["rows"] if r["mode"] in bench.MLA_MODES]
    assert {(r["provider"], r["mode"], r["phase"]) for r in rows} == {
        (p, m, ph)
        for p in ("rope_ext", "eager unfused")
        for m in bench.MLA_MODES
        for ph in ("prefill", "decode")
    }
    for r in rows:
        assert r["status"] == "ok" and r["frac_ceiling"] > 0 and r["ceiling"] == f"stream {r['mode']}"
        assert r["kv_lora_rank"] == 512 and r["qk_nope_head_dim"] == 128
    fused = next(
        r for r in rows if r["provider"] == "rope_ext" and r["mode"] == "mla" and r["phase"] == "decode"
    )
    assert fused["bytes"] == 35_472  # test_mla_bytes_by_hand
    with open(cs) as f:
        csv_rows = list(csv.DictReader(f))
    assert {r["provider"] for r in csv_rows} >= {"stream mla", "stream mla-fp8", "eager unfused"}
    md = _render_markdown(data)
    assert "| bf16 interleaved prefill T=8 | mla | rope_ext |" in md
    assert "| bf16 interleaved decode T=1 | mla-fp8 | eager unfused |" in md
    assert "rope_ext mla-fp8 deepseek-v3 bf16 interleaved decode T=1:" in md

"""The benchmark harness in a tiny mode: validation, outputs, a wrong provider caught. Never timings."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import rope_ext
from rope_ext import bench

TINY = bench.Preset("tiny", 4, 2, 16, 8, False)


def tiny_config(**kw) -> bench.Config:
    base = dict(
        presets=[TINY],
        prefill_tokens=[8],
        decode_tokens=[1],
        dtypes=[torch.float32],
        pairings=["model"],
        modes=["inplace", "out", "backward"],
        providers=["rope_ext", "hf-eager"],
        rounds=1,
        min_run_time=0.001,
        progress=False,
    )
    base.update(kw)
    return bench.Config(**base)


def test_providers_validated_and_timed():
    result = bench.run_benchmark(
        tiny_config(dtypes=[torch.float32, torch.bfloat16], pairings=["half", "interleaved"])
    )
    rows = result["rows"]
    provs = [r for r in rows if r["kind"] == "provider"]
    # rope_ext: 3 modes, hf-eager: out and backward; 2 dtypes x 2 pairings x 2 token counts.
    assert len(provs) == 5 * 2 * 2 * 2
    assert all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]
    for r in rows:
        assert r["median_s"] > 0 and r["p25_s"] <= r["median_s"] <= r["p75_s"]
        assert r["gbps"] > 0
    inplace = [r for r in provs if r["mode"] == "inplace"]
    assert all(r["ceiling"] == "stream in-place" and r["frac_ceiling"] > 0 for r in inplace)
    assert all("speedup_vs_eager" in r and "x_noop_call" in r for r in provs)
    ceilings = {r["provider"] for r in rows if r["kind"] == "ceiling"}
    assert ceilings == {"stream in-place", "clone", "copy into", "no-op call"}


def test_rope_ext_error_is_small():
    result = bench.run_benchmark(tiny_config(providers=["rope_ext"], modes=["inplace", "out"]))
    assert all(r["err_ulps"] < 2 for r in result["rows"] if r["kind"] == "provider")


def test_wrong_provider_is_reported_not_timed():
    def wrong_sign(case: bench.Case) -> bench.Runner:
        cos, sin = case.hf_cos_sin()
        return lambda: bench.hf_apply_rotary_pos_emb(case.q, case.k, cos, -sin, case.interleaved)

    def raises(case: bench.Case) -> bench.Runner:
        raise RuntimeError("boom")

    def skipped(case: bench.Case) -> bench.Runner:
        raise bench.Skip("not installed")

    extra = [
        bench.Provider("wrong-sign", "out", wrong_sign),
        bench.Provider("raises", "out", raises),
        bench.Provider("absent", "out", skipped),
    ]
    cfg = tiny_config(
        providers=["rope_ext", "wrong-sign", "raises", "absent"], modes=["out"], decode_tokens=[]
    )
    result = bench.run_benchmark(cfg, extra_providers=extra)
    by_name = {r["provider"]: r for r in result["rows"]}
    assert by_name["rope_ext"]["status"] == "ok"
    assert by_name["wrong-sign"]["status"] == "wrong" and by_name["wrong-sign"]["err_ulps"] > 1000
    assert "median_s" not in by_name["wrong-sign"]
    assert by_name["raises"]["status"] == "error" and "boom" in by_name["raises"]["detail"]
    assert "absent" not in by_name
    assert any("absent" in n and "not installed" in n for n in result["notes"])
    table = "\n".join(" ".join(r) for r in bench.table_rows(result))
    assert "WRONG" in table and "ERROR" in table


def test_cli_writes_json_csv_and_plot(tmp_path, capsys):
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    argv = [
        "--shape",
        "4,2,16,8",
        "--tokens",
        "4,8",
        "--decode-tokens",
        "1",
        "--dtype",
        "fp32",
        "--pairing",
        "interleaved",
        "--providers",
        "rope_ext,hf-eager",
        "--rounds",
        "1",
        "--min-run-time",
        "0.001",
        "--no-progress",
        "--json",
        str(js),
        "--csv",
        str(cs),
        "--plot",
        str(png),
    ]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "rope_ext" in out and "stream in-place" in out
    data = json.loads(js.read_text())
    assert data["command"].startswith("rope-bench --shape")
    assert {"machine", "config", "rows", "notes"} <= set(data)
    assert data["machine"]["rope_ext_cpu_isa"] == rope_ext._cpu_isa()
    assert {r["pairing"] for r in data["rows"]} == {"interleaved"}
    with open(cs) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data["rows"]) and set(rows[0]) == set(bench.CSV_FIELDS)
    assert png.stat().st_size > 1000


def test_hf_reference_matches_float64_reference():
    for il in (False, True):
        case = bench.make_case(TINY, 5, "decode", torch.float64, il, torch.device("cpu"))
        cos, sin = case.hf_cos_sin()
        q, k = bench.hf_apply_rotary_pos_emb(case.q, case.k, cos, sin, il)
        eq, ek = case.expected("out")
        torch.testing.assert_close(q, eq)
        torch.testing.assert_close(k, ek)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        bench.config_from_args(bench.parse_args(["--preset", "nope"]))
    with pytest.raises(SystemExit):
        bench.config_from_args(bench.parse_args(["--dtype", "int8"]))
    cfg = bench.config_from_args(bench.parse_args(["--quick"]))
    assert cfg.presets == [bench.PRESETS["llama-3-8b"]] and cfg.modes == ["inplace", "out"]

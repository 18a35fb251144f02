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


TINY_MROPE = bench.Preset("tiny-mrope", 4, 2, 16, 16, False, 1e4, (2, 3, 3))


def test_mrope_preset_validates():
    preset = bench.PRESETS["qwen2.5-vl-7b"]
    assert (preset.q_heads, preset.kv_heads, preset.head_dim, preset.rotary_dim) == (28, 4, 128, 128)
    assert preset.mrope_section == (16, 24, 24) and not preset.interleaved and preset.base == 1e6
    result = bench.run_benchmark(
        tiny_config(
            presets=[preset, TINY_MROPE],
            prefill_tokens=[40],
            decode_tokens=[2],
            dtypes=[torch.float32, torch.bfloat16],
            pairings=["half", "interleaved"],
        )
    )
    provs = [r for r in result["rows"] if r["kind"] == "provider"]
    # rope_ext: 3 modes, hf-eager: out and backward; 2 presets x 2 dtypes x 2 pairings x 2 token counts.
    assert len(provs) == 5 * 2 * 2 * 2 * 2
    assert all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]
    assert all(r["err_ulps"] < 2 for r in provs if r["provider"] == "rope_ext" and r["dtype"] == "fp32")
    assert {tuple(r["mrope_section"]) for r in provs} == {(16, 24, 24), (2, 3, 3)}
    # Three positions per token are counted.
    row = next(r for r in provs if r["preset"] == "tiny-mrope" and r["phase"] == "prefill")
    assert row["bytes"] == 2 * row["qk_bytes"] + 40 * (16 * 4 + 3 * 8)
    # A ceiling's GB/s counts q and k read and written (not cos/sin nor positions).
    ceil = next(r for r in result["rows"] if r["kind"] == "ceiling" and r["tokens"] == 40)
    assert ceil["gbps"] == pytest.approx(2 * ceil["qk_bytes"] / ceil["median_s"] / 1e9)


def test_mrope_positions():
    pos = bench.mrope_prefill_positions(40)  # a 4 x 4 image after 12 text tokens, then 12 text tokens
    assert pos.shape == (3, 40) and pos.dtype == torch.int64
    assert torch.equal(pos[:, :12], torch.arange(12).expand(3, 12))
    image = pos[:, 12:28]
    assert torch.equal(image[0], torch.full((16,), 12))
    assert torch.equal(image[1], 12 + torch.arange(4).repeat_interleave(4))
    assert torch.equal(image[2], 12 + torch.arange(4).repeat(4))
    assert torch.equal(pos[:, 28:], torch.arange(16, 28).expand(3, 12))
    case = bench.make_case(TINY_MROPE, 3, "decode", torch.float32, False, torch.device("cpu"))
    assert case.positions.shape == (3, 3) and (case.positions == case.positions[0]).all()
    assert case.rope_positions.shape == (3, 3, 1)


def test_packed_cu_seqlens():
    g = torch.Generator().manual_seed(0)
    cu = bench.packed_cu_seqlens(100, 7, g)
    assert cu.dtype == torch.int32 and cu.shape == (8,) and cu[0] == 0 and cu[-1] == 100
    assert ((cu[1:] - cu[:-1]) >= 1).all()
    assert torch.equal(cu, bench.packed_cu_seqlens(100, 7, torch.Generator().manual_seed(0)))
    assert torch.equal(bench.packed_cu_seqlens(5, 5, g), torch.arange(6, dtype=torch.int32))
    with pytest.raises(ValueError):
        bench.packed_cu_seqlens(4, 5, g)
    case = bench.make_case(TINY, 100, "prefill", torch.float32, False, torch.device("cpu"), seqs=7)
    assert case.seqs == 7 and case.positions.dtype == torch.int64
    starts = case.cu_seqlens[:-1].long()
    assert (case.positions[starts] == 0).all() and int(case.positions.max()) < 100


def test_varlen_several_sequence_counts():
    result = bench.run_benchmark(
        tiny_config(
            presets=[TINY, TINY_MROPE],
            prefill_tokens=[16],
            seqs=[1, 4, 16, 32],
            dtypes=[torch.float32, torch.bfloat16],
            modes=["inplace", "out"],
            providers=["rope_ext", "rope_ext+varlen", "varlen_positions", "hf-eager"],
        )
    )
    rows = result["rows"]
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    tiny = [r for r in rows if r["preset"] == "tiny" and r["phase"] == "prefill"]
    assert {r["seqs"] for r in tiny} == {1, 4, 16}  # 32 sequences do not fit in 16 tokens
    for n in (1, 4, 16):
        wl = {(r["provider"], r["mode"]): r for r in tiny if r["seqs"] == n and r["dtype"] == "bf16"}
        assert wl["rope_ext+varlen", "inplace"]["frac_ceiling"] > 0
        part = wl["varlen_positions", "part"]
        assert part["kind"] == "part" and part["frac_rotation"] > 0 and "gbps" not in part
        assert {("rope_ext", "inplace"), ("rope_ext", "out"), ("hf-eager", "out")} <= set(wl)
    # Not packed: decode steps, and MRoPE presets (with a note); no varlen rows there.
    others = [r for r in rows if r not in tiny]
    assert all(r["seqs"] is None and "varlen" not in r["provider"] for r in others)
    assert any(r["preset"] == "tiny-mrope" and r["phase"] == "prefill" for r in others)
    assert any("MRoPE presets ran unpacked" in n for n in result["notes"])
    lines = bench.summary(result)
    assert any(
        "tiny fp32 half-split prefill T=16 seqs=4: in place" in s and "varlen_positions" in s for s in lines
    )
    assert any(s.startswith("rope_ext in place by sequences, tiny bf16") for s in lines)
    table = "\n".join(" ".join(r) for r in bench.table_rows(result))
    assert "seqs=16" in table and "% rot" in table


def test_cli_list_and_seqs(tmp_path, capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-vl-7b" in out and "mrope 16/24/24" in out
    assert "rope_ext+varlen (inplace)" in out and "varlen_positions" in out
    cs = tmp_path / "r.csv"
    argv = [
        "--shape",
        "4,2,16,8",
        "--tokens",
        "16",
        "--decode-tokens",
        "",
        "--seqs",
        "1,5",
        "--dtype",
        "bf16",
    ]
    argv += ["--mode", "inplace", "--providers", "rope_ext,rope_ext+varlen,varlen_positions"]
    argv += ["--rounds", "1", "--min-run-time", "0.001", "--no-progress", "--csv", str(cs)]
    assert bench.main(argv) == 0
    assert "seqs=5" in capsys.readouterr().out
    with open(cs) as f:
        rows = list(csv.DictReader(f))
    assert {r["seqs"] for r in rows} == {"1", "5"}
    assert {r["provider"] for r in rows if r["kind"] != "ceiling"} == {
        "rope_ext",
        "rope_ext+varlen",
        "varlen_positions",
    }
    assert all(float(r["frac_rotation"]) > 0 for r in rows if r["kind"] == "part")
    assert bench.config_from_args(bench.parse_args(["--seqs", "1,200"])).seqs == [1, 200]
    with pytest.raises(SystemExit):
        bench.config_from_args(bench.parse_args(["--seqs", "0"]))

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
    assert data["machine"]["rope_ext_cpu_prefetch"] == rope_ext._cpu_prefetch()
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


# Serving modes: RoPE + paged KV-cache write (cache, cache-fp8) and fused QK-RMSNorm + RoPE (qknorm). ------


def serving_config(modes, **kw) -> bench.Config:
    # providers=None: every provider of the modes (vLLM, FlashInfer, SGLang skip when not installed).
    return tiny_config(**{"modes": modes, "providers": None, "dtypes": [torch.bfloat16], **kw})


def _ok_providers(result) -> list[dict]:
    provs = [r for r in result["rows"] if r["kind"] == "provider"]
    assert provs and all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]
    return provs


def test_serving_modes_not_run_by_default():
    cfg = bench.config_from_args(bench.parse_args([]))
    assert cfg.modes == ["inplace", "out", "backward"]
    assert bench.config_from_args(bench.parse_args(["--mode", "cache,cache-fp8,qknorm"])).modes == [
        "cache",
        "cache-fp8",
        "qknorm",
    ]
    with pytest.raises(SystemExit):
        bench.config_from_args(bench.parse_args(["--mode", "cache,nope"]))


def test_cache_modes_validate_with_their_ceilings():
    result = bench.run_benchmark(serving_config(["cache", "cache-fp8"], pairings=["half", "interleaved"]))
    provs = _ok_providers(result)
    # rope_ext, rope_ext page table and rope_ext unfused, 2 modes x 2 pairings x (prefill 8, decode 1).
    names = ("rope_ext", "rope_ext page table", "rope_ext unfused")
    assert {(r["provider"], r["mode"]) for r in provs} == {
        (n, m) for n in names for m in ("cache", "cache-fp8")
    }
    assert len(provs) == 3 * 2 * 2 * 2
    assert {r["phase"] for r in provs} == {"prefill", "decode"}
    for r in provs:
        assert r["ceiling"] == f"stream {r['mode']}" and r["frac_ceiling"] > 0
        assert r["speedup_vs_eager"] > 0  # against rope_ext unfused
        assert r["err_ulps"] < 2
    assert all(r["err_fp8_codes"] <= 1 for r in provs if r["mode"] == "cache-fp8")
    case = bench.make_case(TINY, 8, "prefill", torch.bfloat16, False, torch.device("cpu"))
    row = next(r for r in provs if r["phase"] == "prefill" and r["mode"] == "cache")
    assert row["bytes"] == case.bytes_moved("cache") > case.bytes_moved()
    # q, k read + written, v read, k and v cache rows written (bf16, then one byte per value for fp8).
    qk = sum(case.qk_bytes())
    for name, cache_bytes in (("stream cache", 2 * 8 * 2 * 16 * 2), ("stream cache-fp8", 2 * 8 * 2 * 16)):
        ceil = next(r for r in result["rows"] if r["provider"] == name and r["phase"] == "prefill")
        assert ceil["stream_bytes"] == 2 * qk + 8 * 2 * 16 * 2 + cache_bytes
        assert ceil["gbps"] == pytest.approx(ceil["stream_bytes"] / ceil["median_s"] / 1e9)
    table = bench.table_rows(result)
    assert all(r[8].endswith("%") for r in table if r[1] in ("cache", "cache-fp8"))  # the % ceil column
    assert any("stream cache-fp8" in r for r in table)
    lines = bench.summary(result)
    assert any(s.startswith("rope_ext cache-fp8 tiny bf16 interleaved prefill") for s in lines)
    assert any("skipped vllm (cache)" in n for n in result["notes"])


def test_qknorm_mode_validates_with_compile_ratio():
    result = bench.run_benchmark(serving_config(["qknorm"]))
    provs = _ok_providers(result)
    names = {r["provider"] for r in provs}
    assert {"rope_ext", "eager unfused"} <= names <= {"rope_ext", "eager unfused", "torch.compile unfused"}
    assert all(r["ceiling"] == "stream in-place" and r["frac_ceiling"] > 0 for r in provs)
    fused = [r for r in provs if r["provider"] == "rope_ext"]
    assert {r["phase"] for r in fused} == {"prefill", "decode"}
    assert all(r["err_ulps"] < 2 for r in fused)
    if "torch.compile unfused" in names:
        assert all(r["speedup_vs_compile"] > 0 for r in fused)
        assert any("x torch.compile unfused" in s for s in bench.summary(result))


def test_wrong_cache_provider_is_reported(monkeypatch):
    fused = rope_ext.apply_rotary_qk_and_cache_

    def misplaced(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, **kw):
        # q, k rotated right; the cache rows land in each other's slots.
        fused(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping.flip(0), **kw)

    def bad_scale(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, **kw):
        kw["k_scale"] = kw["k_scale"] * 2
        fused(q, k, v, positions, cos_sin, key_cache, value_cache, slot_mapping, **kw)

    monkeypatch.setattr(rope_ext, "apply_rotary_qk_and_cache_", misplaced)
    cfg = serving_config(["cache"], providers=["rope_ext", "rope_ext unfused"], decode_tokens=[])
    rows = {r["provider"]: r for r in bench.run_benchmark(cfg)["rows"] if r["kind"] == "provider"}
    assert rows["rope_ext unfused"]["status"] == "ok"
    assert rows["rope_ext"]["status"] == "wrong" and rows["rope_ext"]["err_ulps"] > 100
    assert "median_s" not in rows["rope_ext"]

    monkeypatch.setattr(rope_ext, "apply_rotary_qk_and_cache_", bad_scale)
    cfg = serving_config(["cache-fp8"], providers=["rope_ext"], decode_tokens=[])
    result = bench.run_benchmark(cfg)
    row = next(r for r in result["rows"] if r["kind"] == "provider")
    assert row["status"] == "wrong" and row["err_fp8_codes"] > 1 and row["err_ulps"] < 2
    assert "fp8 codes" in "\n".join(" ".join(r) for r in bench.table_rows(result))


def _row(provider, mode, phase, tokens, median_s, **extra):
    wl = {"preset": "llama-3-8b", "dtype": "bf16", "pairing": "half-split", "seqs": None}
    return {
        **wl,
        "provider": provider,
        "mode": mode,
        "phase": phase,
        "tokens": tokens,
        "median_s": median_s,
        **extra,
    }


@pytest.mark.parametrize("machine", [{"cpu": "x"}, {"cpu": "x", "gpu": "y"}], ids=["cpu", "gpu"])
def test_summary_says_which_serving_floors_are_met(machine):
    frac = {"ceiling": "stream cache", "frac_ceiling_min": 0.5}
    rows = [
        # Decode of 16 tokens: the cache write at 1.4x the in-place rotation (met), the QK norm at 2x (not).
        _row("rope_ext", "inplace", "decode", 16, 10e-6),
        _row("rope_ext", "cache", "decode", 16, 14e-6),
        _row("rope_ext", "qknorm", "decode", 16, 20e-6),
        # 128 tokens is past the decode floor's range: the ratio alone.
        _row("rope_ext", "inplace", "decode", 128, 10e-6),
        _row("rope_ext", "cache", "decode", 128, 20e-6),
        # Prefill of 4096: cache at 90% of its ceiling (met), fp8 at 40% and the QK norm at 30% (not met),
        # the QK norm 5x torch.compile (met; a CPU floor).
        _row("rope_ext", "cache", "prefill", 4096, 1e-3, frac_ceiling=0.9, **frac),
        _row("rope_ext", "cache-fp8", "prefill", 4096, 1e-3, frac_ceiling=0.4, **frac),
        _row("rope_ext", "qknorm", "prefill", 4096, 1e-3, frac_ceiling=0.3, speedup_vs_compile=5.0, **frac),
    ]
    lines = bench.summary({"machine": machine, "rows": rows, "notes": []})

    def line(mode, phase, tokens):
        (found,) = [
            s
            for s in lines
            if s.startswith(f"rope_ext {mode} llama-3-8b bf16 half-split {phase} T={tokens}:")
        ]
        return found

    assert "1.40x rope_ext in place, floor 1.5x in place: met" in line("cache", "decode", 16)
    assert "2.00x rope_ext in place, floor 1.5x in place: NOT met" in line("qknorm", "decode", 16)
    assert "2.00x rope_ext in place" in line("cache", "decode", 128) and "floor" not in line(
        "cache", "decode", 128
    )
    assert "floor 85% of ceiling: met" in line("cache", "prefill", 4096)
    assert "floor 85% of ceiling: NOT met" in line("cache-fp8", "prefill", 4096)
    qk = line("qknorm", "prefill", 4096)
    assert "floor 85% of ceiling: NOT met" in qk
    assert ("floor 2x torch.compile unfused: met" in qk) == ("gpu" not in machine)


def test_last_level_cache_read_past_entries_without_a_size(tmp_path, monkeypatch):
    (tmp_path / "uevent").write_text("")  # sysfs lists it with the cache indexes, often first
    for idx, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / idx).mkdir()
        (tmp_path / idx / "size").write_text(size + "\n")
    monkeypatch.setattr(bench.workloads, "_CPU_CACHE_SYSFS", str(tmp_path))
    assert bench.last_level_cache_bytes() == 480 << 20
    monkeypatch.setattr(bench.workloads, "_CPU_CACHE_SYSFS", str(tmp_path / "absent"))
    assert bench.last_level_cache_bytes() == 32 << 20

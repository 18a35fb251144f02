"""rope-bench's vision and diffusion presets (FLUX, Wan 2.1, Qwen2-VL's vision tower) and the model-code
providers (``model-eager``, ``model-compile``): shapes against the installed diffusers / transformers, the
positions each model lays out, the per-axis tables, and tiny validated runs. Never timings."""

from __future__ import annotations

import pytest
import torch

import rope_ext
from rope_ext import bench
from rope_ext.bench.presets import VISION_TARGETS, Axes
from rope_ext.bench.workloads import axes_prefill_positions

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionRotaryEmbedding  # noqa: E402
from transformers.vision_utils import get_vision_position_ids  # noqa: E402

VISION = ("flux", "wan2.1-14b", "wan2.1-1.3b", "qwen2-vl-vision")
CPU = torch.device("cpu")


def _config(**kw) -> bench.Config:
    base = dict(
        presets=[bench.PRESETS[n] for n in ("flux", "wan2.1-1.3b", "qwen2-vl-vision")],
        prefill_tokens=[40],
        decode_tokens=[1],
        dtypes=[torch.float32, torch.bfloat16],
        pairings=["model"],
        modes=["inplace", "out"],
        providers=["rope_ext", "model-eager"],
        rounds=1,
        min_run_time=0.001,
        progress=False,
    )
    base.update(kw)
    return bench.Config(**base)


def test_presets_match_the_models():
    p = {n: bench.PRESETS[n] for n in VISION}
    shape = {
        n: (x.q_heads, x.kv_heads, x.head_dim, x.rotary_dim, x.interleaved, x.base) for n, x in p.items()
    }
    assert shape == {
        "flux": (24, 24, 128, 128, True, 1e4),
        "wan2.1-14b": (40, 40, 128, 128, True, 1e4),
        "wan2.1-1.3b": (12, 12, 128, 128, True, 1e4),
        "qwen2-vl-vision": (16, 16, 80, 80, False, 1e4),
    }
    assert p["flux"].axes.dims == (16, 56, 56) and p["flux"].sections == (8, 28, 28)
    rope = WanRotaryPosEmbed(128, (1, 2, 2), max_seq_len=8)
    assert p["wan2.1-14b"].axes.dims == (rope.t_dim, rope.h_dim, rope.w_dim) == (44, 42, 42)
    assert p["wan2.1-14b"].axes.grid == (30, 52) and p["wan2.1-14b"].axes.tokens == 21 * 30 * 52
    cfg = Qwen2VLVisionConfig()
    assert (cfg.num_heads, cfg.embed_dim // cfg.num_heads, cfg.rope_parameters["rope_theta"]) == (16, 80, 1e4)
    assert p["qwen2-vl-vision"].axes.dims == (40, 40) and p["qwen2-vl-vision"].sections == (20, 20)
    assert all(x.mrope_section is None for x in p.values())
    assert bench.PRESETS["qwen2.5-vl-7b"].sections == (16, 24, 24)  # MRoPE presets as before
    assert bench.PRESETS["llama-3-8b"].sections is None
    with pytest.raises(ValueError):
        bench.Preset("bad", 2, 2, 16, 16, True, axes=Axes((8, 4), "image", 4, "x"))  # dims sum 12
    with pytest.raises(ValueError):
        bench.Preset("bad", 2, 2, 16, 16, True, 1e4, (2, 3, 3), Axes((8, 8), "image", 4, "x"))
    with pytest.raises(ValueError):
        Axes((8, 8, 8), "video", 4, "wan")  # no grid


def test_prefill_positions_are_the_models():
    flux = axes_prefill_positions(bench.PRESETS["flux"].axes, 4608)
    assert flux.shape == (3, 4608) and flux.dtype == torch.int64
    assert (flux[:, :512] == 0).all()  # txt_ids: zeros
    assert torch.equal(flux[1:, 512:].T, torch.cartesian_prod(torch.arange(64), torch.arange(64)))
    assert (flux[0, 512:] == 0).all()
    small = axes_prefill_positions(bench.PRESETS["flux"].axes, 40)  # 4 text tokens, a 6 x 6 image
    assert (small[:, :4] == 0).all() and int(small[1].max()) == 5
    wan = axes_prefill_positions(bench.PRESETS["wan2.1-14b"].axes, 32760)
    assert (
        wan[:, 0].tolist() == [0, 0, 0]
        and wan[:, 53].tolist() == [0, 1, 1]
        and wan[:, -1].tolist() == [20, 29, 51]
    )
    assert torch.equal(axes_prefill_positions(bench.PRESETS["wan2.1-14b"].axes, 100), wan[:, :100])
    axes = bench.PRESETS["qwen2-vl-vision"].axes
    for side, tokens in ((64, 4096), (8, 40), (2, 1)):
        want = get_vision_position_ids(torch.tensor([[1, side, side]]), 2).T[:, :tokens]
        assert torch.equal(axes_prefill_positions(axes, tokens), want)


@pytest.mark.parametrize("name", VISION)
def test_case_table_restarts_per_axis(name):
    preset = bench.PRESETS[name]
    case = bench.make_case(preset, 40, "prefill", torch.float32, preset.interleaved, CPU)
    assert case.positions.shape == (len(preset.axes.dims), 40) and case.mrope_section == preset.sections
    n = int(case.positions.max()) + 1
    want = rope_ext.RopeCache.for_axes(list(preset.axes.dims), theta=preset.base, max_positions=n).cos_sin
    assert torch.equal(case.cos_sin, want)
    with pytest.raises(ValueError):
        bench.make_case(preset, 2, "decode", torch.float32, preset.interleaved, CPU)


def test_model_pos_embeds_give_the_table():
    """FLUX's and Wan's pos-embeds compute float64 angles and round to float32: their cos / sin are the
    workload's table bit for bit. Qwen2-VL vision's module computes float32 angles: within 1e-5, the same
    layout (h frequencies, w frequencies, both again)."""
    flux = bench.make_case(bench.PRESETS["flux"], 40, "prefill", torch.float32, True, CPU)
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(flux.positions.T.float())
    assert torch.equal(torch.cat([cos[:, 0::2], sin[:, 1::2]], -1), flux.cos_sin_rows())
    wan = bench.make_case(bench.PRESETS["wan2.1-1.3b"], 1600, "prefill", torch.float32, True, CPU)
    cos, sin = WanRotaryPosEmbed(128, (1, 2, 2), max_seq_len=1024)(torch.empty(1, 0, 2, 60, 104))
    assert torch.equal(torch.cat([cos[0, :1600, 0, 0::2], sin[0, :1600, 0, 1::2]], -1), wan.cos_sin_rows())
    qwen = bench.make_case(bench.PRESETS["qwen2-vl-vision"], 4096, "prefill", torch.float32, False, CPU)
    cos, sin = Qwen2VLVisionRotaryEmbedding(Qwen2VLVisionConfig())(torch.zeros(1), qwen.positions.T)
    want_cos, want_sin = qwen.hf_cos_sin(torch.float32)
    torch.testing.assert_close(cos, want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, want_sin, atol=1e-5, rtol=0)


def test_model_providers_validate_against_float64():
    result = bench.run_benchmark(_config())
    provs = [r for r in result["rows"] if r["kind"] == "provider"]
    # rope_ext in place and out, model-eager; 3 presets x 2 dtypes, prefills only.
    assert len(provs) == 3 * 3 * 2 and {r["phase"] for r in provs} == {"prefill"}
    assert all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]
    assert all(r["err_ulps"] < 2 for r in provs if r["dtype"] == "fp32")
    eager = {r["preset"]: r["source"] for r in provs if r["provider"] == "model-eager"}
    assert "FluxPosEmbed" in eager["flux"] and "WanAttnProcessor" in eager["wan2.1-1.3b"]
    assert "apply_rotary_pos_emb_vision" in eager["qwen2-vl-vision"]
    row = next(r for r in provs if r["preset"] == "flux" and r["provider"] == "rope_ext")
    assert row["axes_dim"] == [16, 56, 56] and row["mrope_section"] == [8, 28, 28]
    assert row["bytes"] == 2 * row["qk_bytes"] + 40 * (128 * 4 + 3 * 8)
    # the model's eager code is the baseline of these presets
    for r in provs:
        ref = next(
            x
            for x in provs
            if x["provider"] == "model-eager" and x["preset"] == r["preset"] and x["dtype"] == r["dtype"]
        )
        assert r["speedup_vs_eager"] == pytest.approx(ref["median_s"] / r["median_s"])
    assert any("no decode step" in n for n in result["notes"])
    lines = bench.summary(result)
    assert any(
        s.startswith("rope_ext flux bf16 interleaved prefill T=40:") and "x model-eager" in s for s in lines
    )


def test_model_providers_skip_elsewhere():
    cfg = _config(
        presets=[bench.PRESETS["llama-3-8b"], bench.PRESETS["qwen2-vl-vision"]],
        prefill_tokens=[8],
        decode_tokens=[],
        dtypes=[torch.float32],
        pairings=["interleaved"],
        providers=["model-eager", "model-compile"],
    )
    result = bench.run_benchmark(cfg)
    assert not [r for r in result["rows"] if r["kind"] == "provider"]
    assert any("vision / diffusion models" in n for n in result["notes"])
    assert any("half-split" in n or "own pairing" in n for n in result["notes"])


def test_model_compile_validates():
    pytest.importorskip("torch._inductor")
    cfg = _config(
        presets=[bench.PRESETS["wan2.1-1.3b"]],
        dtypes=[torch.bfloat16],
        modes=["inplace", "out"],
        providers=["rope_ext", "model-eager", "model-compile"],
    )
    result = bench.run_benchmark(cfg)
    rows = {r["provider"]: r for r in result["rows"] if r["kind"] == "provider" and r["mode"] != "inplace"}
    if "model-compile" not in rows:
        assert any("model-compile" in n for n in result["notes"])  # no C++ compiler
        return
    assert rows["model-compile"]["status"] == "ok" and rows["model-compile"]["source"].startswith(
        "torch.compile"
    )
    ip = next(r for r in result["rows"] if r["provider"] == "rope_ext" and r["mode"] == "inplace")
    assert ip["speedup_vs_compile"] == pytest.approx(rows["model-compile"]["median_s"] / ip["median_s"])


def test_cli_model_tokens_and_list(capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "axes 16/56/56 (flux, 4608 tokens)" in out and "qwen2-vl-vision" in out
    assert "model-eager (out)" in out and "model-compile (out)" in out
    cfg = bench.config_from_args(
        bench.parse_args(["--preset", "flux,wan2.1-14b,llama-3-8b", "--tokens", "model"])
    )
    assert cfg.model_tokens and cfg.prefill_tokens == []
    wls = bench.workloads.workloads(cfg)
    assert {(p.name, t, phase) for p, t, phase, *_ in wls} == {
        ("flux", 4608, "prefill"),
        ("wan2.1-14b", 32760, "prefill"),
        ("llama-3-8b", 1, "decode"),
        ("llama-3-8b", 4, "decode"),
        ("llama-3-8b", 16, "decode"),
        ("llama-3-8b", 64, "decode"),
        ("llama-3-8b", 256, "decode"),
    }
    cfg = bench.config_from_args(
        bench.parse_args(["--preset", "qwen2-vl-vision", "--tokens", "model,64,4096"])
    )
    assert cfg.prefill_tokens == [64, 4096]
    assert [t for _, t, *_ in bench.workloads.workloads(cfg)] == [64, 4096] * 2  # fp32, bf16


def _row(provider, mode, median_s, **extra):
    wl = {"preset": "flux", "dtype": "bf16", "pairing": "interleaved", "seqs": None, "phase": "prefill"}
    return {**wl, "provider": provider, "mode": mode, "tokens": 4608, "median_s": median_s, **extra}


@pytest.mark.parametrize("machine", [{"cpu": "x"}, {"cpu": "x", "gpu": "y"}], ids=["cpu", "gpu"])
def test_summary_says_which_vision_targets_are_met(machine):
    rows = [
        _row("rope_ext", "inplace", 1e-3, frac_ceiling=0.93, frac_ceiling_min=0.95),
        _row("model-compile", "out", 2.5e-3),
        _row("model-eager", "out", 9e-3),
    ]
    (line,) = bench.summary({"machine": machine, "rows": rows, "notes": []})
    assert line.startswith("rope_ext flux bf16 interleaved prefill T=4608: in place 93% of stream")
    assert "in place 2.5x model-compile, in place 9.0x model-eager" in line
    if "gpu" in machine:
        assert "target" not in line
        return
    assert f"target {100 * VISION_TARGETS['frac_ceiling']:.0f}% of stream: met" in line
    assert "target 3x model-compile: NOT met" in line and "target 8x model-eager: met" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vision_presets_on_cuda():
    cfg = _config(device="cuda", providers=["rope_ext", "model-eager", "hf-eager"], prefill_tokens=[40, 1000])
    result = bench.run_benchmark(cfg)
    provs = [r for r in result["rows"] if r["kind"] == "provider"]
    assert len(provs) == 3 * 2 * 2 * 4
    assert all(r["status"] == "ok" for r in provs), [r for r in provs if r["status"] != "ok"]

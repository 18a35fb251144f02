"""benchmarks/gpu_check.sh --dry-run: without a GPU, every command of the one-call GPU check is printed and
what it names is checked (the pytest selections collect, rope-bench parses its options, the sanitizer script
runs its cases on the CPU). The check covers every step: the GPU tests with the CUDA-graph capture tests, the
distributed tests, the four compute-sanitizer tools and rope-bench in every mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rope_ext.bench.presets import ALL_MODES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
STEPS = ["build", "tests", "tests-dist", *(f"sanitize-{t}" for t in TOOLS)]
STEPS += ["bench", "bench-serving", "bench-mla", "bench-vision"]
CAPTURED_OPS = ["cache-bf16", "cache-fp8", "mla-fp8", "rerotate", "qk-norm", "qk-norm-packed"]
CAPTURED_OPS += ["rotary-qk-inplace"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, out


def test_dry_run_succeeds_and_lists_every_step(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    text = done.stdout
    for name in STEPS:
        assert re.search(rf"^== step {re.escape(name)} \(", text, re.M), f"step {name} not listed"
        assert re.search(rf"^ok {re.escape(name)}: ", text, re.M), f"step {name} not checked"
    for tool in TOOLS:
        assert f"--tool {tool} --error-exitcode 1" in text and "benchmarks/gpu_sanitize.py" in text
    assert re.search(r"^ok sanitizer script: gpu_sanitize: (\d+) of \1 cases ok on cpu", text, re.M)
    modes = {m for line in re.findall(r"modes: (\S+)", text) for m in line.split(",")}
    assert modes == set(ALL_MODES), f"rope-bench modes run: {sorted(modes)}"
    summary = (out / "summary.md").read_text()
    for name in [*STEPS, "sanitize-script"]:
        assert re.search(rf"^\| {re.escape(name)} \| ok \|", summary, re.M), f"{name} not in summary.md"


def test_gpu_tests_include_capture_and_cuda_backends(dry_run):
    """The GPU tests step selects the CUDA-graph capture of every serving op with position checks off and on,
    and the cuda backends of the serving test matrices."""
    done, out = dry_run
    assert done.returncode == 0
    ids = (out / "dry-tests.log").read_text()
    for op in CAPTURED_OPS:
        for checks in ("off", "on"):
            assert f"test_graph_replay_equals_eager[{op}-checks-{checks}]" in ids, (op, checks)
    for name in (
        "test_serving_cache.py::test_matches_reference_and_cache_model[",
        "test_serving_cache.py::test_unaligned_shapes_take_the_scalar_path[",
        "test_serving_cache.py::test_mrope_matches_reference_and_cache_model[",
        "test_serving_fp8.py::test_fp8_conversion_bit_exact_against_torch[",
        "test_serving_norm.py::test_matches_reference_on_cuda[",
        "test_serving_norm.py::test_mrope_matches_reference[",
    ):
        cases = [line.split("::", 1)[1] for line in ids.splitlines() if name in line]
        assert any("cuda" in c for c in cases), f"no cuda case of {name}"
    assert "test_gpu_check.py" not in ids

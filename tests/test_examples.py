"""The scripts in examples/ run and pass their own checks (each exits non-zero when one fails)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import child_env

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_examples_found():
    assert {p.name for p in EXAMPLES} >= {"hf_llama_attention.py", "llama31_cache.py", "kv_cache_write.py"}


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=child_env(),
        timeout=300,
        check=False,
    )
    out = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{out}"
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout

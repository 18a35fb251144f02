"""CMakeLists.txt configures on its own and builds the same op library against libtorch, loadable with
torch.ops.load_library. The library is the one of the shared native build (``_helpers.native_build``, also
used by test_export_aoti.py), which builds this CMakeLists.txt as a subproject."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import cmake_build, native_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_build_loads_and_matches(tmp_path):
    cmake_build(ROOT, tmp_path, build_it=False)  # the top-level project configures
    lib = native_build() / "rope_ext" / "librope_ext_ops.so"
    assert lib.exists()
    # A fresh interpreter without the Python extension: the library alone registers the ops.
    code = f"""
import torch
torch.ops.load_library({str(lib)!r})
x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
pos = torch.arange(5)[:, None]
inv = 10000 ** -(torch.arange(0, 32, 2, dtype=torch.float64) / 32)
ang = torch.arange(5, dtype=torch.float64)[:, None] * inv
cs = torch.cat([ang.cos(), ang.sin()], -1).float()
torch.save(torch.ops.rope_ext.rotary(x, pos, cs, False, False), {str(tmp_path / "out.pt")!r})
# An ordinary build (no ROPE_EXT_TESTING) ships no test-only op.
assert not hasattr(torch.ops.rope_ext, "_cuda_emulated")
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    out = torch.load(tmp_path / "out.pt")
    import rope_ext

    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    expected = rope_ext.apply_rotary(
        x, torch.arange(5)[:, None], rope_ext.RopeCache(32, max_positions=5).cos_sin
    )
    assert torch.equal(out, expected)

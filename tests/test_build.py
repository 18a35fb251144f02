"""The build: CUDA kernels (their own library, rope_ext._C_cuda) present whenever nvcc was available."""

from __future__ import annotations

import os
import shutil

import torch

import rope_ext
from rope_ext.specs import built_with_cuda

OPS = ["rotary", "rotary_qk", "rotary_qk_"]


def _nvcc_available() -> bool:
    home = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else "")
    return torch.version.cuda is not None and (
        os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc") is not None
    )


def test_cuda_kernels_registered_when_nvcc_found():
    built = built_with_cuda()
    if _nvcc_available() and os.environ.get("ROPE_EXT_CPU_ONLY") != "1":
        assert built, "nvcc is available but the extension was built without its CUDA kernels"
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rope_ext::{op}", "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rope_ext::{op}", "CUDA") == built


def _cuobjdump() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    for cand in (os.path.join(home, "bin", "cuobjdump"), shutil.which("cuobjdump")):
        if cand and os.path.exists(cand):
            return cand
    try:  # triton ships one beside its NVIDIA backend
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return cand if os.path.exists(cand) else None
    except ImportError:
        return None


def test_cuda_vector_path_uses_128_bit_accesses():
    """The vectorized kernels move q/k with single 128-bit loads and stores (checked in the SASS)."""
    import re
    import subprocess

    if not built_with_cuda():
        import pytest

        pytest.skip("built without CUDA")
    tool = _cuobjdump()
    assert tool is not None, "no cuobjdump to inspect the CUDA build"
    so = rope_ext.specs.CUDA_LIBRARY
    sass = subprocess.run([tool, "-sass", so], capture_output=True, text=True, check=True).stdout
    kernels = re.split(r"\n\s*Function : ", sass)[1:]
    vec = [k for k in kernels if re.search(r"rotary_kernel\w*Lb[01]ELb1E", k.split("\n", 1)[0])]
    assert vec, "no vectorized kernel found in the SASS"
    for k in vec:
        name = k.split("\n", 1)[0]
        assert re.search(r"LDG\.E\.128", k) and re.search(r"STG\.E\.128", k), name
        assert not re.search(r"STG\.E(\.U16)?\s", k), f"{name}: narrow stores in the vector path"


def test_cpu_library_does_not_need_cuda():
    """rope_ext._C (schemas and CPU kernels) links no CUDA library, so it loads under a CPU-only torch."""
    import subprocess

    out = subprocess.run(["readelf", "-d", rope_ext._C.__file__], capture_output=True, text=True, check=True)
    needed = [line for line in out.stdout.splitlines() if "NEEDED" in line]
    assert needed and not [n for n in needed if "cuda" in n.lower()], needed

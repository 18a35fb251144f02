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


def test_cpu_library_does_not_need_cuda():
    """rope_ext._C (schemas and CPU kernels) links no CUDA library, so it loads under a CPU-only torch."""
    import subprocess

    out = subprocess.run(["readelf", "-d", rope_ext._C.__file__], capture_output=True, text=True, check=True)
    needed = [line for line in out.stdout.splitlines() if "NEEDED" in line]
    assert needed and not [n for n in needed if "cuda" in n.lower()], needed

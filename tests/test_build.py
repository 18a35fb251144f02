"""The build: CUDA kernels present whenever nvcc was available, CPU kernel vectorized."""

from __future__ import annotations

import os
import shutil

import torch

import rope_ext  # noqa: F401

OPS = ["rotary", "rotary_qk", "rotary_qk_"]


def _nvcc_available() -> bool:
    home = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else "")
    return torch.version.cuda is not None and (
        os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc") is not None
    )


def test_cuda_kernels_registered_when_nvcc_found():
    built = torch.ops.rope_ext._built_with_cuda()
    if _nvcc_available() and os.environ.get("ROPE_EXT_CPU_ONLY") != "1":
        assert built, "nvcc is available but the extension was built without its CUDA kernels"
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rope_ext::{op}", "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rope_ext::{op}", "CUDA") == built


def test_cpu_kernel_uses_avx2_where_available():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if all(f" {f}" in flags for f in ("avx2", "fma", "f16c")):
        assert torch.ops.rope_ext._cpu_isa() == "avx2"
    else:
        assert torch.ops.rope_ext._cpu_isa() == "scalar"

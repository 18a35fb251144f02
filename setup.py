"""Build of the rope_ext op library (CPU, plus CUDA when torch and nvcc have it).

Environment:
  ROPE_EXT_CPU_ONLY=1       build without the CUDA kernels even when nvcc is found
  ROPE_EXT_TESTING=1        add the test-only ops (_cuda_emulated: the CUDA kernel body run on the CPU);
                            `make test` and CI build this way, a wheel built the ordinary way does not
  TORCH_CUDA_ARCH_LIST      CUDA architectures; default: the visible GPU's, else "8.0;9.0+PTX"
  CUDA_HOME                 CUDA toolkit; default /usr/local/cuda when it exists
"""

import glob
import os
import shutil

from setuptools import setup

# torch guesses CUDA_HOME from the nvcc on PATH when import time comes; point it
# at the toolkit folder first (the nvcc on PATH may be a wrapper script).
if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


def want_cuda() -> bool:
    if os.environ.get("ROPE_EXT_CPU_ONLY") == "1" or torch.version.cuda is None:
        return False
    home = cpp_extension.CUDA_HOME
    return bool(home) and (os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc"))


def extension():
    # -fopenmp: at::parallel_for is inline OpenMP code from the ATen headers; without the flag it
    # compiles to a serial loop. libgomp.so.1 resolves to the one torch has already loaded.
    # -ffp-contract=off: the host compiler never fuses a * b + c on its own (the AVX2 kernel's FMAs
    # are explicit intrinsics), so results do not depend on compiler defaults. On the GPU,
    # --fmad=true is the documented choice of the CUDA kernel.
    cxx = ["-O3", "-std=c++20", "-fno-fast-math", "-ffp-contract=off", "-fopenmp"]
    link = ["-fopenmp"]
    testing = os.environ.get("ROPE_EXT_TESTING") == "1"
    sources = [
        f
        for f in sorted(glob.glob("csrc/ops/*.cpp")) + sorted(glob.glob("csrc/rope/*.cpp"))
        if testing or os.path.basename(f) != "cuda_emulated.cpp"
    ]
    macros = [("ROPE_EXT_PYTHON_MODULE", None)] + ([("ROPE_EXT_TESTING", "1")] if testing else [])
    if want_cuda():
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
        nvcc = ["-O3", "-std=c++20", "--fmad=true", "-lineinfo", "-Xcompiler", "-ffp-contract=off"]
        return cpp_extension.CUDAExtension(
            "rope_ext._C",
            sources + sorted(glob.glob("csrc/rope/*.cu")) + sorted(glob.glob("csrc/ops/*.cu")),
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            define_macros=macros + [("ROPE_EXT_WITH_CUDA", "1")],
            extra_link_args=link,
            py_limited_api=False,
        )
    return cpp_extension.CppExtension(
        "rope_ext._C",
        sources,
        extra_compile_args={"cxx": cxx},
        define_macros=macros,
        extra_link_args=link,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)

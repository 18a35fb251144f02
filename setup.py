"""Build of the rope_ext op libraries, on the LibTorch stable ABI (one build serves several torch releases).

Extensions (Python modules that expose no functions; importing one registers its ops):
  rope_ext._C          the schemas and the CPU kernels (no CUDA dependency)
  rope_ext._C_cuda     the CUDA kernels, when torch and nvcc have CUDA; rope_ext loads it only under a
                       torch with CUDA
  rope_ext._C_testing  test-only ops (ROPE_EXT_TESTING=1): _cuda_emulated, the CUDA kernel body run on
                       the CPU; `make test` and CI build it, a wheel built the ordinary way does not

Environment:
  ROPE_EXT_CPU_ONLY=1       build without the CUDA kernels even when nvcc is found
  ROPE_EXT_TESTING=1        add rope_ext._C_testing
  ROPE_EXT_SANITIZE=1       build with AddressSanitizer and UndefinedBehaviorSanitizer (`make test-sanitize`;
                            CPU only: run with libasan preloaded)
  TORCH_CUDA_ARCH_LIST      CUDA architectures; default: the visible GPU's, else cmake/cuda_arch_list.txt
                            ("8.0;9.0+PTX", the list CMake uses too)
  CUDA_HOME                 CUDA toolkit; default /usr/local/cuda when it exists
  ROPE_EXT_METADATA_ONLY=1  build no library: `make` installs the tree in editable mode this way
                            (metadata, the rope-bench command) over the libraries it built in place

Wheel: `pip wheel --no-build-isolation .` (or `python -m build --wheel --no-isolation`) gives a
cp310-abi3 wheel.
"""

import glob
import os
import shutil
import threading
from pathlib import Path

from setuptools import setup

# torch guesses CUDA_HOME from the nvcc on PATH when import time comes; point it
# at the toolkit folder first (the nvcc on PATH may be a wrapper script).
if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

# The oldest torch whose stable ABI has everything the bindings use (torch::stable::parallel_for,
# get_num_threads, empty, std::string arguments): 2.10. Headers hide what is newer.
TORCH_TARGET_VERSION = "0x020A000000000000"
# Without a visible GPU, the CUDA architectures built: one list, shared with CMake.
DEFAULT_CUDA_ARCH_LIST = Path(__file__).with_name("cmake").joinpath("cuda_arch_list.txt").read_text().strip()


def want_cuda() -> bool:
    if os.environ.get("ROPE_EXT_CPU_ONLY") == "1" or torch.version.cuda is None:
        return False
    home = cpp_extension.CUDA_HOME
    return bool(home) and (os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc"))


def extensions():
    # -ffp-contract=off: the host compiler never fuses a * b + c on its own (the rotation's FMAs are
    # explicit: intrinsics in the vector kernels, fma_rn in rope.h), so results do not depend on compiler
    # defaults. On the GPU --fmad=true may contract other arithmetic; the rotation is written with
    # __fmaf_rn / __fmul_rn and gives the host's bits. -fvisibility=hidden: the libraries
    # share the binding code and must not resolve each other's copies.
    cxx = ["-O3", "-std=c++20", "-fno-fast-math", "-ffp-contract=off", "-fvisibility=hidden"]
    link = []
    if os.environ.get("ROPE_EXT_SANITIZE") == "1":
        # Every report is fatal (-fno-sanitize-recover): a test that triggers one fails. -O1, as the
        # sanitizers recommend: reports keep their lines, and the build takes half the time of -O3.
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
        cxx = ["-O1", "-g", *cxx[1:], *sanitize]
        link = sanitize
    macros = [("ROPE_EXT_PYTHON_MODULE", None), ("TORCH_TARGET_VERSION", TORCH_TARGET_VERSION)]
    common = dict(define_macros=macros, py_limited_api=True, extra_link_args=link)
    binding = [
        "csrc/ops/binding.cpp",
        "csrc/ops/layout.cpp",
        "csrc/ops/page_table.cpp",
        "csrc/ops/serving_binding.cpp",
        "csrc/ops/rerotate_binding.cpp",
    ]
    exts = [
        cpp_extension.CppExtension(
            "rope_ext._C",
            binding
            + ["csrc/ops/ops_cpu.cpp", "csrc/ops/registration.cpp"]
            + sorted(glob.glob("csrc/rope/cpu/*.cpp")),
            extra_compile_args={"cxx": cxx},
            **common,
        )
    ]
    if os.environ.get("ROPE_EXT_TESTING") == "1":
        exts.append(
            cpp_extension.CppExtension(
                "rope_ext._C_testing",
                binding + sorted(glob.glob("csrc/ops/emulated/*.cpp")),
                extra_compile_args={"cxx": cxx},
                **common,
            )
        )
    if want_cuda() and os.environ.get("ROPE_EXT_SANITIZE") != "1":
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
        nvcc = ["-O3", "-std=c++20", "--fmad=true", "-lineinfo", "-Xcompiler", "-ffp-contract=off"]
        nvcc += ["-Xcompiler", "-fvisibility=hidden"]
        exts.append(
            cpp_extension.CUDAExtension(
                "rope_ext._C_cuda",
                binding + ["csrc/ops/ops_cuda.cu"] + sorted(glob.glob("csrc/rope/cuda/*.cu")),
                extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                define_macros=macros + [("USE_CUDA", None)],
                py_limited_api=True,
            )
        )
    return exts


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """One build folder per extension: they share sources (the binding) compiled with different flags."""

    def run(self):
        # build/lib is shared by every build of this tree: drop the libraries this build does not make
        # (a test build's _C_testing, another Python's module), so that a wheel holds exactly its own.
        # An in-place build replaces the tree's libraries the same way (a CPU-only build drops _C_cuda).
        wanted = {self.get_ext_filename(e.name) for e in self.extensions}
        for lib in ([self.build_lib] + (["."] if self.inplace else [])) if wanted else []:
            for old in glob.glob(os.path.join(lib, "rope_ext", "_C*.so")):
                if os.path.relpath(old, lib) not in wanted:
                    os.remove(old)
        super().run()

    # build_temp as the running extension's folder: a per-thread value, as `build_ext --parallel` builds
    # the extensions on threads of one command object.
    _building = threading.local()

    @property
    def build_temp(self):
        return getattr(self._building, "build_temp", None) or self._build_temp

    @build_temp.setter
    def build_temp(self, value):
        self._build_temp = value

    def build_extension(self, ext):
        self._building.build_temp = os.path.join(self._build_temp, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self._building.build_temp = None


setup(
    ext_modules=[] if os.environ.get("ROPE_EXT_METADATA_ONLY") == "1" else extensions(),
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)

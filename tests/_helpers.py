"""What the test files share: dtypes, device and build capabilities, the accuracy contract, a cos/sin table.

Test files import from here (``from _helpers import ...``; tests/ is on ``sys.path`` like ``backends``
and ``_strategies``); conftest.py only holds pytest fixtures, hooks and the hypothesis profiles.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

import rope_ext

# The CUDA kernel body run on the CPU (``torch.ops.rope_ext._cuda_emulated``) is a test-only op in its own
# library, rope_ext._C_testing, built only with ROPE_EXT_TESTING=1 (what ``make test`` and CI build).
if importlib.util.find_spec("rope_ext._C_testing") is not None:
    import rope_ext._C_testing  # noqa: F401  (registers torch.ops.rope_ext._cuda_emulated)


def child_env() -> dict[str, str]:
    """The environment of a child Python that imports the rope_ext this process runs (the in-place build,
    or the sanitizer build of ``make test-sanitize``) and the test helpers."""
    package_root = Path(rope_ext.__file__).resolve().parents[1]
    tests = Path(__file__).resolve().parent
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_root), str(tests)]))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)

HAS_EMULATION = hasattr(torch.ops.rope_ext, "_cuda_emulated")
NO_EMULATION = "built without ROPE_EXT_TESTING=1: no _cuda_emulated op"
requires_emulation = pytest.mark.skipif(not HAS_EMULATION, reason=NO_EMULATION)


def skip_without_emulation() -> None:
    """Skips the running test when the build has no ``_cuda_emulated`` op (for parametrised backends)."""
    if not HAS_EMULATION:
        pytest.skip(NO_EMULATION)


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at each value of the float64 tensor `t` (one unit in the last place)."""
    finfo = torch.finfo(dtype)
    mag = t.abs().clamp_min(finfo.smallest_normal)
    exp = torch.floor(torch.log2(mag))
    return torch.exp2(exp) * finfo.eps


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, x_max: float) -> None:
    """The project's accuracy contract against the float64 reference (same cos_sin):

    * float32 / float64: |out - ref| <= 1e-6 * max|x| (fp32 arithmetic on values of size max|x|
      accumulates a few ulps of 2^-24 ~ 6e-8, well inside 1e-6);
    * float16 / bfloat16: |out - ref| <= one ulp of the output dtype at the reference value, plus
      2^-22 * max|x|. The fp32 result is within a few 2^-24 * max|x| of the exact value, so rounding it
      gives <= 1/2 ulp plus that; the extra term matters only when ``x1 c - x2 s`` nearly cancels (a
      result far smaller than x, where no fp32 computation can promise 1 ulp of the tiny value; see
      CANCELLATION_* in test_property.py), elsewhere it is below 2^-12 ulp.
    """
    assert out.shape == ref.shape
    err = (out.double() - ref).abs()
    if out.dtype in (torch.float32, torch.float64):
        tol = 1e-6 * max(x_max, 1e-30)
        assert err.max().item() <= tol, f"max error {err.max().item():.3g} > {tol:.3g}"
    else:
        tol = ulp(ref, out.dtype) + 2.0**-22 * x_max
        bad = err > tol
        assert not bad.any(), (
            f"{int(bad.sum())} elements off by more than 1 ulp + 2^-22 max|x|; worst {err.max().item():.3g} "
            f"at ref {ref.flatten()[(err - tol).flatten().argmax()].item():.6g}"
        )


def make_cos_sin(n_positions: int, rotary_dim: int, base: float = 10000.0, device="cpu", dtype=torch.float32):
    return rope_ext.RopeCache(rotary_dim, base, max_positions=n_positions, device=device, dtype=dtype).cos_sin


def to_device(values, device):
    """``(moved, write_back)``: ``values`` (a list or a dict) with each tensor replaced by one on ``device``
    that has its storage's bytes, strides and storage offset, so that views of one storage stay views of one
    storage (a packed qkv, a cache view, strided or misaligned layouts) and the guard bytes around them
    travel too. ``write_back()`` copies every storage's bytes back into the host tensors, which then hold
    what the device op wrote: the host backend's checks apply to them unchanged."""
    pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes()) if st.nbytes() else (id(t), 0)
        if key not in pairs:
            host = torch.empty(0, dtype=torch.uint8).set_(st)
            pairs[key] = host, host.to(device, copy=True)
        dev = pairs[key][1].untyped_storage()
        return torch.empty(0, dtype=t.dtype, device=device).set_(dev, t.storage_offset(), t.shape, t.stride())

    def write_back() -> None:
        for host, dev in pairs.values():
            host.copy_(dev)

    if isinstance(values, dict):
        return {n: move(v) for n, v in values.items()}, write_back
    return [move(v) for v in values], write_back


__all__ = [
    "DTYPES",
    "HAS_CUDA",
    "HAS_EMULATION",
    "NO_CUDA",
    "NO_EMULATION",
    "assert_close_to_reference",
    "make_cos_sin",
    "requires_cuda",
    "requires_emulation",
    "skip_without_emulation",
    "to_device",
    "ulp",
]


NATIVE_BUILD = Path(__file__).resolve().parents[1] / "build" / "cmake-tests"


def native_build() -> Path:
    """Builds tests/native/aoti_runner (the C++ runner of AOTInductor packages and, as its subproject, the
    repository's CMakeLists.txt: the op library ``rope_ext/librope_ext_ops.so``) into build/cmake-tests,
    once for every test process (a file lock; CMake rebuilds only what changed); returns the folder."""
    from filelock import FileLock

    NATIVE_BUILD.mkdir(parents=True, exist_ok=True)
    with FileLock(str(NATIVE_BUILD) + ".lock"):
        cmake_build(NATIVE_BUILD.parents[1] / "tests" / "native" / "aoti_runner", NATIVE_BUILD)
    return NATIVE_BUILD


def cmake_build(source: Path, build: Path, build_it: bool = True) -> None:
    """Configures and builds the CMake project ``source`` into ``build`` against this torch's libtorch.

    No GPU needed. A CUDA build of libtorch links nvrtc, which pip-installed CUDA keeps beside torch (not in
    the toolkit), and looks for the toolkit at configure time (CUDA_HOME, default /usr/local/cuda).
    ``build_it=False`` only configures. The tests build without optimisation (-O0 compiles the kernels
    about ten times faster than the default Release build, and they run small inputs).
    """
    prefix = f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"
    unoptimised = ["-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS_DEBUG=-O0"]
    configure = ["cmake", "-S", str(source), "-B", str(build), prefix, *unoptimised]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    nvrtc = glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*"))
    if torch.version.cuda and nvrtc:
        configure.append(f"-DCUDA_nvrtc_LIBRARY={os.path.realpath(sorted(nvrtc)[0])}")
    env = dict(os.environ)
    if not env.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
        env["CUDA_HOME"] = "/usr/local/cuda"
    for cmd in (configure, ["cmake", "--build", str(build), "-j2"])[: 1 + build_it]:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

"""One wheel across torch releases: the LibTorch stable ABI and a CUDA library loaded only under CUDA torch.

* Every built library references libtorch only through the stable C ABI (no ``at::`` / ``c10::`` /
  ``torch::`` C++ symbol), and the CPU library links no CUDA library.
* The wheel ``pip wheel --no-build-isolation .`` (or ``python -m build --wheel --no-isolation``, the same
  files) builds against the pinned torch (a CUDA build) is a cp310-abi3 wheel without the test-only
  library; installed into a virtual environment with another torch
  release (``WHEEL_TEST_TORCH``, default the CPU-only ``2.13.0+cpu``), it passes a smoke test there: every
  op against the float64 reference, ``torch.compile(fullgraph=True)``, the cache, and the CUDA kernels
  registered exactly when that torch has CUDA. The environment is kept in the user cache folder
  (``$XDG_CACHE_HOME/rope_ext``), so repeated runs do not reinstall torch; without the package index
  (offline, no find-links) the test skips and says so.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import rope_ext

ROOT = Path(__file__).resolve().parents[1]
OTHER_TORCH = os.environ.get("WHEEL_TEST_TORCH", "2.13.0+cpu")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rope_ext"
LIBRARIES = sorted(glob.glob(str(ROOT / "rope_ext" / "_C*.so")))


def _undefined_cxx_symbols(lib: str) -> list[str]:
    out = subprocess.run(
        ["nm", "-D", "--undefined-only", "-C", lib], capture_output=True, text=True, check=True
    )
    names = [line.split(None, 1)[-1].split(None, 1)[-1] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if re.match(r"(at|c10|torch|caffe2)::", n)]


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils) to read the libraries' symbols")
@pytest.mark.parametrize("lib", LIBRARIES, ids=[os.path.basename(p) for p in LIBRARIES])
def test_libraries_use_only_the_stable_abi(lib):
    assert _undefined_cxx_symbols(lib) == []
    needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    assert "libtorch_python" not in needed
    if not os.path.basename(lib).startswith("_C_cuda"):
        assert "cuda" not in needed.lower(), f"{lib} links a CUDA library"


SMOKE = r"""
import sys, torch, rope_ext
from rope_ext import reference
assert rope_ext.__file__.startswith(sys.argv[1]), rope_ext.__file__  # the installed wheel, not the tree
print("torch", torch.__version__, "isa", rope_ext._cpu_isa())
g = torch.Generator().manual_seed(0)
cache = rope_ext.RopeCache(64, max_positions=64)
cs = cache.cos_sin
q, k = torch.randn(5, 4, 96, generator=g), torch.randn(5, 2, 96, generator=g)
pos = torch.randint(0, 64, (5, 1), generator=g)
pos3 = torch.randint(0, 64, (3, 5, 1), generator=g)

def close(out, ref):
    assert (out.double() - ref).abs().max().item() < 1e-5, (out.double() - ref).abs().max()

for kw, p in ((dict(), pos), (dict(interleaved=True, rotary_offset=32), pos),
              (dict(mrope_section=(8, 12, 12)), pos3)):
    close(rope_ext.apply_rotary(q, p, cs, **kw), reference.rotary_hadamard(q, p, cs, **kw))
    qo, ko = rope_ext.apply_rotary_qk(q, k, p, cs, **kw)
    close(ko, reference.rotary_hadamard(k, p, cs, **kw))
    qi, ki = q.clone(), k.clone()
    rope_ext.apply_rotary_qk_(qi, ki, p, cs, **kw)
    assert torch.equal(qi, qo) and torch.equal(ki, ko)
x = q.clone().requires_grad_()
rope_ext.apply_rotary(x, pos, cs).sum().backward()
close(x.grad, reference.rotary_hadamard(torch.ones_like(q), pos, cs, inverse=True))
try:
    rope_ext.apply_rotary(q.int(), pos, cs)
    raise AssertionError("integer q accepted")
except TypeError as e:
    assert "x must be a floating tensor" in str(e)
f = torch.compile(lambda a, b: rope_ext.apply_rotary_qk(a, b, pos, cs), fullgraph=True, backend="aot_eager")
qc, kc = f(q, k)
assert torch.equal(qc, rope_ext.apply_rotary(q, pos, cs))
# The CUDA kernels: registered when this torch has CUDA and the wheel has them (argv[2]), never loaded else.
cuda = rope_ext.specs.built_with_cuda()
assert cuda == (torch.version.cuda is not None and sys.argv[2] == "1"), cuda
has = torch._C._dispatch_has_kernel_for_dispatch_key
for op in ("rotary", "rotary_qk", "rotary_qk_"):
    assert has(f"rope_ext::{op}", "CPU") and has(f"rope_ext::{op}", "CUDA") == cuda
assert not hasattr(torch.ops.rope_ext, "_cuda_emulated")
print("cuda kernels", rope_ext.specs.built_with_cuda(), "ok")
"""


def _venv_with_other_torch() -> Path:
    """A virtual environment (cached) holding torch ``OTHER_TORCH``; skips when pip cannot get it."""
    venv = CACHE / f"wheel-test-torch-{OTHER_TORCH}"
    py = venv / "bin" / "python"
    stamp = venv / ".torch-installed"
    if stamp.exists():
        return py
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", f"torch=={OTHER_TORCH}", "numpy"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if r.returncode != 0:
        if "No matching distribution" in r.stderr or "Could not find a version" in r.stderr:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(
                f"torch=={OTHER_TORCH} cannot be installed here (offline?): {r.stderr.strip()[-300:]}"
            )
        raise AssertionError(f"installing torch=={OTHER_TORCH} failed:\n{r.stderr[-3000:]}")
    stamp.touch()
    return py


@pytest.mark.slow
def test_wheel_runs_under_another_torch_release(tmp_path):
    py = _venv_with_other_torch()
    other = subprocess.run(
        [str(py), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other != torch.__version__, f"the test needs a torch other than the build's ({other})"

    # The ordinary build (no test-only library); it shares the build folder, and so the objects, with
    # the test build.
    env = {k: v for k, v in os.environ.items() if k != "ROPE_EXT_TESTING"}
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        env=env,
        cwd=ROOT,
        timeout=1500,
    )
    (wheel,) = dist.glob("rope_ext-*.whl")
    # The other documented way builds the same wheel.
    dist_b = tmp_path / "dist-build"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist_b), str(ROOT)],
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=1500,
    )
    (wheel_b,) = dist_b.glob("rope_ext-*.whl")
    assert wheel_b.name == wheel.name
    assert sorted(zipfile.ZipFile(wheel_b).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())
    assert wheel.name.endswith("-cp310-abi3-linux_x86_64.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    libs = sorted(n for n in names if n.endswith(".so"))
    expected = ["rope_ext/_C.abi3.so"] + (
        ["rope_ext/_C_cuda.abi3.so"] if rope_ext.specs.built_with_cuda() else []
    )
    assert libs == expected, libs

    target = tmp_path / "site"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=600,
    )
    run_env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run(
        [str(py), "-c", SMOKE, str(target), "1" if "rope_ext/_C_cuda.abi3.so" in libs else "0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=run_env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"torch {other}" in r.stdout and "ok" in r.stdout, r.stdout

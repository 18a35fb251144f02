"""The aarch64 NEON build of the CPU kernel (``csrc/rope/cpu/neon.cpp``), checked on any machine.

* ``tests/native/neon_check.cpp`` (torch-free) is cross-compiled with the kernel sources for aarch64 at
  -O3 and run under qemu: NEON against the portable build (bit for bit), a float64 reference and the
  fused formula of rope.h; bf16/fp16 rounding bit-exact with rope.h; pass-through, strides, positions
  outside the cache, NaN/inf (see the file's header).
* The aarch64 object of ``cpu/neon.cpp`` (-O0, where every inline function is emitted, and -O3) holds
  NEON code (fused multiply-adds on ``.4s`` vectors, fp16/bf16 conversions) in its own functions, and no
  fp16 arithmetic.

Needs ``aarch64-linux-gnu-g++`` (and objdump) and ``qemu-aarch64``; skipped when missing (``.ci/run``
installs them where it can).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "csrc" / "rope"
DRIVER = ROOT / "tests" / "native" / "neon_check.cpp"
SYSROOT = Path("/usr/aarch64-linux-gnu")
INSTALL = "`apt-get install g++-aarch64-linux-gnu qemu-user` (.ci/run installs them)"

CXX = shutil.which("aarch64-linux-gnu-g++")
OBJDUMP = shutil.which("aarch64-linux-gnu-objdump")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
FLAGS = ["-std=c++20", "-march=armv8-a", "-ffp-contract=off", "-Wall", "-Werror", f"-I{KERNELS}"]


def _need(**tools: str | None) -> None:
    missing = [name for name, path in tools.items() if not path]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: {INSTALL}")


@functools.cache
def _objects(opt: str) -> dict[str, Path]:
    """The aarch64 objects of the driver, the portable kernel and the NEON kernel at ``opt``, compiled
    side by side once per run (the qemu check links them; the object check reads cpu_neon.o)."""
    out = Path(tempfile.mkdtemp(prefix=f"neon{opt}"))
    sources = {
        "neon_check": DRIVER,
        "cpu_kernel": KERNELS / "cpu/kernel.cpp",
        "cpu_neon": KERNELS / "cpu/neon.cpp",
    }
    procs = {
        name: subprocess.Popen(
            [CXX, *FLAGS, opt, "-fPIC", "-c", str(src), "-o", str(out / f"{name}.o")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, src in sources.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-2000:]}"
    return {name: out / f"{name}.o" for name in sources}


def _build_and_run(opt: str) -> subprocess.CompletedProcess:
    objs = _objects(opt)
    exe = objs["neon_check"].with_name("neon_check")
    cmd = [CXX, *map(str, objs.values()), "-o", str(exe)]
    # Static, so that qemu needs no aarch64 sysroot; else the cross toolchain's.
    static = subprocess.run(cmd + ["-static"], capture_output=True, text=True, timeout=600)
    if static.returncode == 0:
        run = [QEMU, str(exe)]
    else:
        dynamic = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert dynamic.returncode == 0, f"link failed:\n{static.stderr}\n{dynamic.stderr}"
        run = [QEMU, "-L", str(SYSROOT), str(exe)]
    return subprocess.run(run, capture_output=True, text=True, timeout=600)


# The optimised build, the one that ships, runs under qemu; the object check also reads the -O0 object
# (where every inline function is emitted).
def test_neon_kernel_matches_scalar_and_reference_under_qemu():
    _need(**{"aarch64-linux-gnu-g++": CXX, "qemu-aarch64": QEMU})
    res = _build_and_run("-O3")
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"neon_check failed (exit {res.returncode}):\n{out[-6000:]}"
    m = re.search(r"^neon_check: (\d+) cases, 0 failures$", res.stdout, re.M)
    assert m and int(m.group(1)) > 1000, out[-3000:]


def _functions(obj: Path) -> dict[str, list[tuple[str, str]]]:
    """Function (demangled) -> its (mnemonic, operands), from the aarch64 disassembly of `obj`."""
    asm = subprocess.run(
        [OBJDUMP, "-d", "-C", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    funcs: dict[str, list[tuple[str, str]]] = {}
    name = None
    for line in asm.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            name = m.group(1)
            funcs.setdefault(name, [])
            continue
        m = re.match(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$", line)
        if m and name is not None:
            funcs[name].append((m.group(1), m.group(2)))
    return funcs


@pytest.mark.parametrize("opt", ["-O0", "-O3"])
def test_neon_object_has_vector_code_and_no_fp16_arithmetic(opt):
    _need(**{"aarch64-linux-gnu-g++": CXX, "aarch64-linux-gnu-objdump": OBJDUMP})
    funcs = _functions(_objects(opt)["cpu_neon"])
    own = {
        f: insns
        for f, insns in funcs.items()
        if "rope::neon::" in f or "rope::cpu::detail::rotate_tokens_neon" in f
    }
    assert own, f"no rope::neon function in the object: {sorted(funcs)[:10]}"
    insns = [i for f in own.values() for i in f]
    fused = [i for i in insns if i[0] in ("fmla", "fmls") and ".4s" in i[1]]
    assert fused, "no fused multiply-add on .4s vectors in the NEON build"
    for mnemonic in ("fcvtl", "fcvtn", "shrn"):  # fp16 widen / narrow, bf16 narrow
        assert any(i[0].startswith(mnemonic) for i in insns), f"no {mnemonic} in the NEON build"
    # The numerics rule: fp32 arithmetic, never fp16 (vector .4h/.8h or scalar h registers).
    fp16_math = [
        i
        for f in funcs.values()
        for i in f
        if re.match(r"f(add|sub|mul|mla|mls|madd|msub|nmadd|nmsub|div|neg|abs)", i[0])
        and re.search(r"\.[48]h\b|\bh\d+\b", i[1])
    ]
    assert not fp16_math, f"fp16 arithmetic in the NEON build: {fp16_math[:5]}"

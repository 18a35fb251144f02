"""The layers depend one way (kernels <- bindings <- Python), and the vector builds cannot leak into the
portable path.

* ``csrc/rope`` (kernels) includes nothing from torch or ``csrc/ops``, and compiles with a plain C++
  compiler and no torch headers; ``csrc/ops`` includes only ``csrc/rope`` headers, its own and torch's;
  ``registration.cpp`` (the schemas) includes no kernel header; only ``rope_ext/specs.py`` imports ``_C``.
* ``cpu/avx2.cpp`` is compiled for AVX2/FMA/F16C, ``cpu/avx512.cpp`` and ``cpu/avx512_bf16.cpp`` for
  AVX-512. Every function a vector build emits with those instructions must be its own
  (``rope::<isa>::...`` or its entry point ``rope::cpu::detail::rotate_tokens_<isa>``): a vector copy of a
  shared inline function (a weak symbol) may be the one the linker keeps for every caller, and a CPU
  without that instruction set then dies with SIGILL. Checked in the objects at -O0 (every inline function
  emitted) and -O3, and in the built library. Only the avx512_bf16 build uses the AVX512_BF16 conversion.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import rope_ext

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "csrc" / "rope"
BINDINGS = ROOT / "csrc" / "ops"
STD_OR_CUDA = re.compile(r"^[a-z_]+(\.h)?$|^cuda[a-z_]*\.h$|^immintrin\.h$|^arm_neon\.h$")
X86_BUILDS = ("avx2", "avx512", "avx512_bf16")


def _includes(path: Path) -> list[str]:
    return re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', path.read_text(), re.M)


def _sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh"))


def _room(path: Path) -> str:
    """The folder of csrc/rope a kernel file stands in: "" (the shared headers), "cpu" or "cuda"."""
    parts = path.relative_to(KERNELS).parts
    return parts[0] if len(parts) > 1 else ""


def test_kernel_layer_includes_only_itself_the_standard_library_and_cuda():
    """csrc/rope includes its own files, the standard library and CUDA's; cpu/ and cuda/ build on the shared
    headers at the top (parameters, per-pair math), never on each other."""
    own = set(_sources(KERNELS))
    for src in own:
        for inc in _includes(src):
            target = (src.parent / inc).resolve()
            name = src.relative_to(KERNELS)
            if target in own:
                assert _room(target) in ("", _room(src)), f"{name} includes {inc} (another room)"
            else:
                assert STD_OR_CUDA.match(inc), f"{name} includes {inc}"


def test_binding_layer_includes_only_kernel_headers_its_own_and_torch():
    own = {p.resolve() for p in _sources(BINDINGS)}
    kernel_headers = {p.resolve() for p in _sources(KERNELS) if p.suffix in (".h", ".cuh")}
    for src in _sources(BINDINGS):
        for inc in _includes(src):
            target = (src.parent / inc).resolve()
            ok = (
                target in own
                or target in kernel_headers
                or inc.split("/")[0] in ("torch", "ATen", "c10")
                or inc == "Python.h"
                or STD_OR_CUDA.match(inc)
            )
            assert ok, f"{src.relative_to(BINDINGS)} includes {inc}"
    assert not [i for i in _includes(BINDINGS / "registration.cpp") if i.startswith("../rope/")]


def test_python_package_imports_the_extension_in_one_place():
    pattern = re.compile(r"^\s*from \. import _C|import rope_ext\._C|from rope_ext import _C", re.M)
    importers = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "rope_ext").rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert importers == ["rope_ext/specs.py"]


needs_x86_gcc = pytest.mark.skipif(
    platform.machine() != "x86_64" or not shutil.which("g++") or not shutil.which("objdump"),
    reason="needs x86-64, g++ and objdump",
)


def _vex_functions(path: Path) -> dict[str, str]:
    """Function -> first AVX (VEX/EVEX-encoded or ymm/zmm) instruction, for every function in `path`."""
    asm = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, str] = {}
    name = None
    for line in asm.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            name = m.group(1)
            continue
        m = re.match(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$", line)
        if m and name is not None:
            mnemonic, operands = m.groups()
            if mnemonic.startswith("v") or "%ymm" in operands or "%zmm" in operands:
                found.setdefault(name, mnemonic)
    return found


def _owner(function: str) -> str | None:
    """The vector build a function belongs to (its namespace or entry point), or None."""
    for isa in sorted(X86_BUILDS, key=len, reverse=True):  # avx512_bf16 before avx512
        if f"rope::{isa}::" in function or f"rope::cpu::detail::rotate_tokens_{isa}(" in function:
            return isa
    return None


def _leaks(path: Path, isa: str | None = None) -> dict[str, str]:
    """AVX code in `path` outside the vector build `isa` (None: outside every vector build)."""
    return {
        f: insn
        for f, insn in _vex_functions(path).items()
        if (_owner(f) is None if isa is None else _owner(f) != isa)
    }


def test_kernel_layer_compiles_without_torch(tmp_path):
    if not shutil.which("g++"):
        pytest.skip("no g++")
    for src in sorted(KERNELS.rglob("*.cpp")):
        subprocess.run(
            ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", f"-I{KERNELS}", str(src)],
            check=True,
            capture_output=True,
        )


def _built_objects(names: list[str]) -> dict[str, Path] | None:
    """The objects of ``names`` from the in-place build (setup.py: -O3 and the flags that ship) when they
    are newer than every kernel source, else None."""
    newest = max(p.stat().st_mtime for p in _sources(KERNELS))
    for folder in sorted(ROOT.glob("build/temp.*/_C/csrc/rope/cpu")):
        objs = {n: folder / f"{n}.o" for n in names}
        if all(o.exists() and o.stat().st_mtime >= newest for o in objs.values()):
            return objs
    return None


@needs_x86_gcc
@pytest.mark.parametrize("opt", ["-O0", "-O3"])
def test_vector_builds_emit_no_avx_copy_of_shared_code(tmp_path, opt):
    names = ["kernel", *X86_BUILDS]  # csrc/rope/cpu/<name>.cpp
    built = _built_objects(names) if opt == "-O3" else None
    objs, compiles = built or {}, {}
    for name in [] if built else names:  # compiled side by side
        objs[name] = tmp_path / f"{name}.o"
        source = KERNELS / "cpu" / f"{name}.cpp"
        compiles[name] = subprocess.Popen(
            [
                "g++",
                "-std=c++20",
                opt,
                "-fPIC",
                "-ffp-contract=off",
                "-c",
                str(source),
                "-o",
                str(objs[name]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, proc in compiles.items():
        _, err = proc.communicate()
        assert proc.returncode == 0, f"{name}.cpp: {err[-2000:]}"
    assert not _vex_functions(objs["kernel"]), "the portable kernel contains AVX code"
    for isa in X86_BUILDS:
        avx = _vex_functions(objs[isa])
        assert any(_owner(f) == isa for f in avx), f"the {isa} build has no vector code"
        leaks = _leaks(objs[isa], isa)
        assert not leaks, f"AVX code outside rope::{isa}: {sorted(leaks)[:10]}"
    zmm = {isa: _disassembly(objs[isa]) for isa in X86_BUILDS}
    assert "%zmm" not in zmm["avx2"] and "%zmm" in zmm["avx512"] and "%zmm" in zmm["avx512_bf16"]
    assert "vcvtneps2bf16" in zmm["avx512_bf16"]
    assert "vcvtneps2bf16" not in zmm["avx512"] and "vcvtneps2bf16" not in zmm["avx2"]


def _disassembly(path: Path, *flags: str) -> str:
    command = ["objdump", "-d", *flags, str(path)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


@needs_x86_gcc
def test_built_library_keeps_avx_code_inside_the_vector_builds():
    leaks = _leaks(Path(rope_ext._C.__file__))
    assert not leaks, f"AVX code outside the vector builds in the op library: {sorted(leaks)[:10]}"


def _prefetching_functions(path: Path) -> set[str]:
    """The functions of `path` that issue a software prefetch."""
    found, name = set(), None
    for line in _disassembly(path, "-C", "--no-show-raw-insn").splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            name = m.group(1)
        elif name is not None and re.match(r"^\s+[0-9a-f]+:\s+prefetch", line):
            found.add(name)
    return found


@needs_x86_gcc
def test_built_library_hints_the_cache_rows():
    """gcc deletes a `__builtin_prefetch` from a loop that does nothing else, silently: the cache write's
    hints of its rows (kv_cache.cpp, hint_rows) must reach the library."""
    hinting = _prefetching_functions(Path(rope_ext._C.__file__))
    assert any("hint_rows" in f or "cache_step" in f for f in hinting), "no hint of the cache rows"

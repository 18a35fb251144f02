"""The built CUDA kernels, read from the library (``cuobjdump``): what a GPU would pay for is checked here.

Every kernel instance (each dtype, table dtype, positions dtype, pairing, vector or scalar path, each
architecture of the build) is listed by ``cuobjdump --dump-resource-usage``: registers per thread and the
stack frame (local memory: run-time indexed arrays and register spills). The floor is no stack at all and at
most ``kMaxRegisters`` (64, csrc/rope/cuda/rotary.cuh) registers; the vector instances must move their data
in single 128-bit loads and stores. No 64-bit integer division (a subroutine call of ~70 instructions) may
run inside a loop over heads: ``nvdisasm`` reads each call's inlining chain of source lines from the build's
line table, and the loops over heads are the source's ``for`` loops tagged ``// per head``. Skipped only where
no CUDA library was built or no ``cuobjdump`` (the toolkit's, or the copy Triton ships) exists.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import rope_ext

LIB = rope_ext.specs.CUDA_LIBRARY if rope_ext.specs.built_with_cuda() else None
MAX_REGISTERS = 64
# Per kernel, the most registers and the largest stack frame in bytes of any instance, on any
# architecture; no instance may get worse.
CEILING = {
    "rotary_kernel": (64, 0),
    "cache_kernel": (64, 0),
    "norm_kernel": (64, 0),
    "rerotate_kernel": (64, 0),
    "angle_rows_kernel": (64, 0),  # the table-free rows: one pair per thread, no vector instance
}
VECTOR_FAMILIES = set(CEILING) - {"angle_rows_kernel"}


def _cuobjdump() -> str | None:
    """The toolkit's cuobjdump, or the copy Triton ships beside its NVIDIA backend."""
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    candidates = [os.path.join(home, "bin", "cuobjdump"), shutil.which("cuobjdump")]
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


CUOBJDUMP = _cuobjdump()
pytestmark = [
    pytest.mark.skipif(LIB is None, reason="no CUDA library built (rope_ext._C_cuda)"),
    pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or Triton)"),
]


@functools.cache
def instances() -> list[tuple[str, str, int, int]]:
    """(arch, mangled name, registers, stack bytes) of every kernel instance in the library."""
    out = subprocess.run(
        [CUOBJDUMP, "--dump-resource-usage", str(LIB)], capture_output=True, text=True, check=True
    )
    rows, arch, name = [], None, None
    for line in out.stdout.splitlines():
        if m := re.search(r"arch = (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function (\S+):", line):
            name = m.group(1)
        elif m := re.search(r"REG:(\d+) STACK:(\d+)", line):
            rows.append((arch, name, int(m.group(1)), int(m.group(2))))
    return rows


def kernel(name: str) -> str:
    return re.search("(" + "|".join(CEILING) + ")", name).group(1)


def test_every_kernel_is_listed():
    rows = instances()
    families = {kernel(n) for _, n, _, _ in rows}
    assert families == set(CEILING), families
    assert {a for a, _, _, _ in rows} >= {"sm_90"}


def test_no_instance_above_its_ceiling():
    worst = defaultdict(lambda: (0, 0))
    for arch, name, regs, stack in instances():
        k = kernel(name)
        r, s = worst[arch, k]
        worst[arch, k] = (max(r, regs), max(s, stack))
    for (arch, k), (regs, stack) in sorted(worst.items()):
        assert regs <= CEILING[k][0] and stack <= CEILING[k][1], (arch, k, regs, stack)


def test_rotary_kernel_within_the_register_budget():
    for arch, name, regs, _ in instances():
        if kernel(name) == "rotary_kernel":
            assert regs <= MAX_REGISTERS, (arch, name, regs)


def test_every_instance_meets_the_floor():
    bad = [(a, n, r, s) for a, n, r, s in instances() if r > MAX_REGISTERS or s > 0]
    assert not bad, f"{len(bad)} instances above the floor, e.g. {bad[:3]}"


@functools.cache
def vector_instances() -> list[tuple[str, str]]:
    """(mangled name, SASS) of every instance whose last template argument (Vectorized) is true."""
    out = subprocess.run([CUOBJDUMP, "-sass", str(LIB)], capture_output=True, text=True, check=True).stdout
    blocks = [(b.split(None, 1)[0], b) for b in re.split(r"\n\s*Function : ", out)[1:]]
    return [(name, block) for name, block in blocks if re.search(r"Lb1EEEvN", name)]


def test_vector_instances_use_128_bit_accesses():
    """Every vector instance loads and stores 16 bytes at once; the rotation's vector instances store nothing
    narrower."""
    checked = defaultdict(int)
    for name, block in vector_instances():
        checked[kernel(name)] += 1
        assert re.search(r"LDG\.E\.128", block), f"no 128-bit load in {name}"
        assert re.search(r"STG\.E\.128", block), f"no 128-bit store in {name}"
        if kernel(name) == "rotary_kernel":
            assert not re.search(r"STG\.E(\.U16)?\s", block), f"{name}: narrow stores in the vector path"
    assert set(checked) == VECTOR_FAMILIES, dict(checked)


def test_vector_instances_read_the_table_through_the_read_only_cache():
    """The cos/sin table, re-read by every head of a token and never written while a kernel runs, is loaded
    through the read-only data cache (``__ldg``: ``LDG.E.*.CONSTANT``) in every vector instance; the
    activations, read once, are not (``.CONSTANT`` on them would be wrong for in-place calls)."""
    checked = 0
    for name, block in vector_instances():
        constant = re.findall(r"LDG\.E(?:\.64|\.128)?\.CONSTANT", block)
        assert constant, f"no read-only table load in {name}"
        assert re.search(r"LDG\.E\.128(?!\.CONSTANT)", block), f"{name}: activations read-only"
        checked += 1
    assert checked


SOURCES = Path(__file__).resolve().parents[1] / "csrc" / "rope"
# A call of the toolkit's 64-bit division or remainder subroutine, in nvdisasm's SASS.
DIVISION_CALL = r"CALL\.REL\.NOINC `\(\$__internal_\d+_\$__cuda_sm\d+_((?:div|rem)_[su]64)\)"


@functools.cache
def per_head_loops() -> dict[str, list[tuple[int, int]]]:
    """{file name: [(first, last) line of each loop over heads]}: the ``for`` loops whose opening brace
    ends a line with ``// per head``, to their closing brace."""
    loops = defaultdict(list)
    for path in sorted(SOURCES.rglob("*.cu*")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not re.search(r"\{\s*// per head$", line):
                continue
            depth, end = 0, None
            for j in range(i, len(lines)):
                code = lines[j].split("//")[0]
                depth += code.count("{") - code.count("}")
                if depth <= 0:
                    end = j
                    break
            assert end is not None, f"{path.name}:{i + 1}: unbalanced braces"
            loops[path.name].append((i + 1, end + 1))
    return dict(loops)


def _division_calls(cubin: str) -> list[tuple[str, str, tuple[tuple[str, int], ...]]]:
    """(kernel, subroutine, inlining chain of (file name, line), innermost first) of each call of a 64-bit
    integer division or remainder in one cubin's SASS."""
    nvdisasm = os.path.join(os.path.dirname(CUOBJDUMP), "nvdisasm")
    if not os.access(nvdisasm, os.X_OK):
        nvdisasm = shutil.which("nvdisasm")
    text = subprocess.run([nvdisasm, "-gi", "-c", cubin], capture_output=True, text=True, check=True).stdout
    calls, chain, fresh, fn = [], (), False, None
    for line in text.splitlines():
        if m := re.match(r"\s*\.text\.(\S+):$", line):
            fn = m.group(1)
        elif "//## File" in line:
            frames = tuple((f, int(n)) for f, n in re.findall(r'"[^"]*/([^/"]+)", line (\d+)', line))
            chain = (chain if fresh else ()) + tuple(f for f in frames if f not in chain)
            fresh = True
            continue
        elif m := re.search(DIVISION_CALL, line):
            calls.append((fn, m.group(1), chain))
        fresh = False
    return calls


@functools.cache
def division_calls() -> list[tuple[str, str, tuple[tuple[str, int], ...]]]:
    """Every 64-bit division call of every kernel instance in the library (each architecture's cubin)."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([CUOBJDUMP, "-xelf", "all", str(LIB)], cwd=d, capture_output=True, check=True)
        cubins = sorted(str(p) for p in Path(d).glob("*.cubin"))
        assert cubins, "no cubin in the library"
        with ThreadPoolExecutor(2) as pool:
            return [c for calls in pool.map(_division_calls, cubins) for c in calls]


def test_no_64_bit_division_inside_a_loop_over_heads():
    loops = per_head_loops()
    # every kernel's loop over heads is tagged: rotation, cache write, QK norm (its items), re-rotation
    assert {"rotary.cuh", "serving.cuh", "norm_launch.cu", "rerotate.cuh"} <= set(loops), loops
    calls = division_calls()
    # the read works: the per-token divisions (multi-dim token offsets, cache slots) are found
    assert any(kernel(fn) == "cache_kernel" and what.startswith("div") for fn, what, _ in calls), calls[:3]
    bad = {
        (kernel(fn), what, chain)
        for fn, what, chain in calls
        if any(a <= line <= b for f, line in chain for a, b in loops.get(f, ()))
    }
    assert not bad, f"64-bit divisions inside loops over heads: {sorted(bad)[:5]}"

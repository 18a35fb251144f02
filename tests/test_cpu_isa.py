"""The CPU kernel's instruction sets: run-time choice, the ROPE_EXT_CPU_ISA cap, and every set through the
same test matrix.

Each set this CPU runs is forced in turn (``ROPE_EXT_CPU_ISA`` in a child pytest, or
``rope_ext._set_cpu_isa`` here); a set the CPU lacks is skipped with the reason. The bf16 rounding of every
set is bit-exact with round-to-nearest-even, the AVX512_BF16 conversion's denormal flushing included.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import assert_close_to_reference, make_cos_sin

import rope_ext
from rope_ext import reference
from rope_ext.ops import CPU_ISAS

ROOT = Path(__file__).resolve().parents[1]
ARCH_ISAS = (
    ("scalar", "neon")
    if platform.machine() in ("aarch64", "arm64")
    else ("scalar", "avx2", "avx512", "avx512_bf16")
)
RANK = {"scalar": 0, "avx2": 1, "neon": 1, "avx512": 2, "avx512_bf16": 3}
SUPPORTED = [isa for isa in ARCH_ISAS if torch.ops.rope_ext._cpu_isa_supported(isa)]
DEFAULT = rope_ext._cpu_isa()

# The tests every set runs: the vector-path matrix (dtypes, pairings, partial rotary, odd head dims, tails,
# strides), the CPU op tests and the hypothesis agreement tests.
MATRIX = ["tests/test_cpu_vector_paths.py", "tests/test_property.py"]
# `make test` runs tests/test_ops.py on every set again in its sanitizer reruns (the Makefile's SAN_ISA_TESTS)
# and says so with ROPE_EXT_ISA_RERUNS=1; run otherwise, the matrix holds it.
if os.environ.get("ROPE_EXT_ISA_RERUNS") != "1":
    MATRIX.insert(1, "tests/test_ops.py")
# The cases of MATRIX that run the CPU kernel: the emulated CUDA bodies and the GPU ones do not depend on
# the CPU's instruction set (the default set's run covers them).
# 100 fixed draws per property test: the best set's run (the whole suite) draws 500.
ISA_ONLY = ["-k", "not emu and not cuda", "--hypothesis-profile=short"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _expected_supported() -> list[str]:
    """The sets this CPU runs, from /proc/cpuinfo (x86-64 Linux) or the architecture."""
    if platform.machine() in ("aarch64", "arm64"):
        return ["scalar", "neon"]
    f = _cpu_flags()
    out = ["scalar"]
    if {"avx2", "fma", "f16c"} <= f:
        out.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
            out.append("avx512")
            if "avx512_bf16" in f:
                out.append("avx512_bf16")
    return out


def _require(isa: str) -> None:
    if isa not in SUPPORTED:
        pytest.skip(f"this CPU does not run the {isa} kernel (it runs: {', '.join(SUPPORTED)})")


@pytest.fixture
def isa_switch():
    """``use(isa)`` forces a set for the rest of the test; the process's choice is restored after it."""
    default = rope_ext._cpu_isa()

    def use(isa: str) -> None:
        _require(isa)
        rope_ext._set_cpu_isa(isa)
        assert rope_ext._cpu_isa() == isa

    yield use
    rope_ext._set_cpu_isa(default)


def _child_isa(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ROPE_EXT_CPU_ISA"}
    if env_value is not None:
        env["ROPE_EXT_CPU_ISA"] = env_value
    return subprocess.run(
        [sys.executable, "-c", "import rope_ext; print(rope_ext._cpu_isa())"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo to know the CPU")
def test_best_supported_set_is_chosen():
    assert SUPPORTED == _expected_supported()
    child = _child_isa(None)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == SUPPORTED[-1]


@pytest.mark.parametrize("asked", CPU_ISAS)
def test_environment_variable_caps_the_set(asked):
    child = _child_isa(asked)
    assert child.returncode == 0, child.stderr
    want = max((i for i in SUPPORTED if RANK[i] <= RANK[asked]), key=RANK.get)
    assert child.stdout.strip() == want


def test_unknown_environment_value_is_rejected_at_import():
    child = _child_isa("avx1024")
    assert child.returncode != 0
    assert (
        "ValueError: ROPE_EXT_CPU_ISA must be one of scalar, avx2, avx512, avx512_bf16, neon, got 'avx1024'"
        in (child.stderr)
    )


def test_set_cpu_isa_rejects_unknown_and_unsupported(isa_switch):
    with pytest.raises(ValueError, match=r"name must be one of .*got 'sse9'"):
        rope_ext._set_cpu_isa("sse9")
    missing = [i for i in CPU_ISAS if i not in SUPPORTED]
    before = rope_ext._cpu_isa()
    for isa in missing:
        with pytest.raises(ValueError, match=f"this CPU does not run the {isa} kernel"):
            rope_ext._set_cpu_isa(isa)
        assert rope_ext._cpu_isa() == before


@pytest.mark.slow
@pytest.mark.parametrize("isa", ARCH_ISAS)
def test_every_set_passes_the_cpu_matrix(isa):
    """The CPU test matrix in a child pytest with ROPE_EXT_CPU_ISA=isa (the child checks it runs ``isa``)."""
    _require(isa)
    if isa == DEFAULT:
        pytest.skip(f"{isa} is this process's set: the whole suite runs it")
    env = dict(os.environ, ROPE_EXT_CPU_ISA=isa, ROPE_EXT_EXPECT_CPU_ISA=isa)
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not gpu",
            *ISA_ONLY,
            *MATRIX,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = "\n".join(child.stdout.splitlines()[-15:])
    assert child.returncode == 0, f"{isa}:\n{tail}\n{child.stderr[-2000:]}"
    assert " passed" in tail and " failed" not in tail, tail


# Cases where the AVX2 build runs whole vectors (half-split: rotary_dim/2 a multiple of 8; interleaved:
# rotary_dim a multiple of 8), so its fp32 results are the AVX-512 build's bit for bit (same fused products).
WHOLE_VECTOR_SHAPES = [(128, 128), (64, 64), (96, 96), (256, 64), (160, 160), (48, 32)]
# Masked AVX-512 tails of 1, 2, 4, 15 lanes (half-split) and scalar AVX2 tails.
TAIL_SHAPES = [(34, 34), (36, 36), (80, 40), (62, 62), (130, 130), (6, 2), (98, 66)]


def _run_all(isa_switch, isa, shapes, dtypes, inverse=False):
    isa_switch(isa)
    out = {}
    for dtype in dtypes:
        for il in (False, True):
            for D, R in shapes:
                g = torch.Generator().manual_seed(D * 31 + R)
                q = torch.randn(11, 3, D, generator=g).to(dtype)
                k = torch.randn(11, 2, D, generator=g).to(dtype)
                pos = torch.randint(0, 300, (11, 1), generator=g)
                cs = make_cos_sin(300, R)
                out[(dtype, il, D, R)] = (
                    q,
                    pos,
                    cs,
                    torch.ops.rope_ext.rotary_qk(q, k, pos, cs, il, inverse),
                )
    return out


@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16"])
def test_avx512_fp32_equals_avx2_bit_for_bit_on_whole_vectors(isa_switch, isa):
    _require("avx2")
    a = _run_all(isa_switch, "avx2", WHOLE_VECTOR_SHAPES, [torch.float32])
    b = _run_all(isa_switch, isa, WHOLE_VECTOR_SHAPES, [torch.float32])
    for key in a:
        for x, y in zip(a[key][3], b[key][3], strict=True):
            assert torch.equal(x, y), key


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_bf16", "neon"])
@pytest.mark.parametrize("inverse", [False, True])
def test_tails_and_partial_rotary_match_reference(isa_switch, isa, inverse):
    if isa not in ARCH_ISAS:
        pytest.skip(f"{isa} is not a set of {platform.machine()}")
    res = _run_all(
        isa_switch,
        isa,
        TAIL_SHAPES + WHOLE_VECTOR_SHAPES,
        [torch.float32, torch.float16, torch.bfloat16],
        inverse,
    )
    for (dtype, il, D, R), (q, pos, cs, (qo, _)) in res.items():
        ref = reference.rotary_hadamard(q, pos, cs, interleaved=il, inverse=inverse)
        assert_close_to_reference(qo, ref, float(q.abs().max()))
        assert torch.equal(qo[..., R:], q[..., R:]), (dtype, il, D, R)


def _bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 bits by round to nearest even on the integer bits (rope.h's float_to_bf16)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet = (u >> 16) | 0x40
    bits = torch.where(x.isnan(), quiet, rounded) & 0xFFFF
    return bits.to(torch.int32).to(torch.int16)  # wraps to the same 16 bits


def _special_bf16_inputs(n_heads: int, D: int) -> torch.Tensor:
    """bf16 values of every class: normals, denormals (whose products are fp32 denormals), zeros, inf, NaN."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, n_heads, D, generator=g)
    x[1] *= 1e-38  # products near and below the smallest normal (1.2e-38)
    x[2] *= 3e-39
    x[3, 0, ::7] = float("inf")
    x[3, 1, ::5] = float("nan")
    x[4] *= 3e38  # products that round to inf
    x[5, :, ::3] = 0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_bf16", "neon"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D", [128, 36])
def test_bf16_rounding_is_exact_for_every_class(isa_switch, isa, interleaved, D):
    """bf16 output bits = round-to-nearest-even of the fp32 result, for denormals (which vcvtneps2bf16 alone
    would flush to zero), NaN, inf and overflow alike."""
    if isa not in ARCH_ISAS:
        pytest.skip(f"{isa} is not a set of {platform.machine()}")
    isa_switch(isa)
    x = _special_bf16_inputs(4, D)
    pos = torch.tensor([[0], [3], [17], [40], [63], [9]])
    cs = make_cos_sin(64, D)
    out = rope_ext.apply_rotary(x, pos, cs, interleaved=interleaved)
    fp32 = rope_ext.apply_rotary(x.float(), pos, cs, interleaved=interleaved)
    if isa != "scalar":  # fp32 results of the same set, so the same fused products
        assert torch.equal(out.view(torch.int16), _bf16_rne(fp32))
    denormal = (fp32 != 0) & (fp32.abs() < torch.finfo(torch.float32).tiny)
    assert denormal.sum() > 10, "the inputs must produce fp32 denormals"
    assert (out[denormal] != 0).any(), "denormal results flushed to zero"


def test_avx512_builds_round_bf16_identically(isa_switch):
    _require("avx512_bf16")
    for D in (128, 64, 36, 130):
        x = _special_bf16_inputs(3, D)
        pos = torch.tensor([[0], [3], [17], [40], [63], [9]])
        cs = make_cos_sin(64, D)
        outs = []
        for isa in ("avx512", "avx512_bf16"):
            isa_switch(isa)
            outs.append(rope_ext.apply_rotary(x, pos, cs).view(torch.int16))
        assert torch.equal(*outs)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


# (rotary_dim, sections, interleaved sections): vector tables for 64/128 (unrolled) and 96 (generic),
# 48 (a multiple of 8 but not 16 pairs: AVX-512 builds the merged row), 12 (scalar table).
MROPE_CONFIGS = [
    (128, (16, 24, 24), False),
    (128, (24, 20, 20), True),
    (64, (8, 12, 12), False),
    (96, (16, 16, 16), True),
    (48, (8, 8, 8), False),
    (12, (2, 2, 2), True),
]


@pytest.mark.parametrize("isa", ARCH_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_equals_plain_rotation_of_the_gathered_rows(isa_switch, isa, dtype, interleaved):
    """MRoPE pairs each feature pair with the cos/sin row of its section's position. Gathering those rows
    into one table per token in Python and rotating with positions 0..T-1 must give the same bits: every
    way a set builds the MRoPE table (masked loads from the three rows, or the merged row) is a copy."""
    isa_switch(isa)
    g = torch.Generator().manual_seed(7)
    T, max_pos = 37, 200
    for R, sec, mil in MROPE_CONFIGS:
        D = R + 6
        q = torch.randn(T, 5, D, generator=g).to(dtype)
        k = torch.randn(T, 2, D, generator=g).to(dtype)
        pos = torch.randint(0, max_pos, (3, T, 1), generator=g)
        pos[:, :9] = pos[0, :9]  # text tokens: three equal positions
        for cs_dtype in (torch.float32, dtype):
            cs = make_cos_sin(max_pos, R).to(cs_dtype)
            for inverse in (False, True):
                qo, ko = q.clone(), k.clone()
                torch.ops.rope_ext.rotary_qk_(qo, ko, pos, cs, interleaved, inverse, 0, list(sec), mil)
                # The per-token table: pair j from the row of its section's position.
                h = R // 2
                rows = reference.mrope_rows(h, sec, mil)
                pair_pos = pos[rows, :, 0]  # [h, T]
                j = torch.arange(h)[:, None]
                gathered = torch.cat([cs[pair_pos, j].T, cs[pair_pos, h + j].T], -1)
                qe, ke = q.clone(), k.clone()
                torch.ops.rope_ext.rotary_qk_(
                    qe, ke, torch.arange(T)[:, None], gathered, interleaved, inverse
                )
                assert torch.equal(_bits(qo), _bits(qe)), (R, sec, cs_dtype, inverse)
                assert torch.equal(_bits(ko), _bits(ke)), (R, sec, cs_dtype, inverse)

"""The CUDA path's hazards that only parallel hardware shows, caught on the CPU.

* The emulated launch (``csrc/ops/emulated/launch.h``) runs every CUDA body twice, in launch order and
  shuffled, and fails on a byte that one thread writes and another reads or writes: checked here on toy
  bodies (``tests/native/race_check.cpp``) and on the real cache op with two tokens sharing a slot.
* Written tensors that hold what every thread reads (positions, cos/sin, slots, scales, norm weights)
  are refused before anything is written, by the CPU ops and the CUDA bodies alike.
* The cache op rotates q when k and v have no heads (the CUDA launch used to skip the whole op).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _helpers import HAS_EMULATION, NO_EMULATION, make_cos_sin
from _serving_cache_helpers import EMU_BACKENDS, build, emulated, run

import rope_ext
from rope_ext import reference

ROOT = Path(__file__).resolve().parents[1]
OPS = torch.ops.rope_ext
requires_emulation = pytest.mark.skipif(not HAS_EMULATION, reason=NO_EMULATION)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_emulated_launch_finds_races_and_order_dependence(tmp_path):
    exe = tmp_path / "race_check"
    subprocess.run(
        [
            "g++",
            "-std=c++20",
            "-O1",
            "-Wall",
            "-Werror",
            "-o",
            str(exe),
            str(ROOT / "tests/native/race_check.cpp"),
        ],
        check=True,
    )
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASS") == 5, out.stdout


@pytest.mark.parametrize("backend", ["cpu", *EMU_BACKENDS])
def test_cache_op_rotates_q_when_k_has_no_heads(backend):
    c = build(torch.float32, T=5, Hq=4, Hk=0, D=64, slots="mixed")
    q0 = c.q.clone()
    run(c, backend)
    ref = reference.rotary_hadamard(q0, c.positions.unsqueeze(-1), c.cos_sin, interleaved=False)
    torch.testing.assert_close(c.q.double(), ref, rtol=0, atol=1e-6 * float(q0.abs().max()))


def _duplicate(c):
    c.slot_mapping[3] = c.slot_mapping[1] = 7
    return c


def test_duplicate_slots_raise_on_cpu_before_writing():
    c = _duplicate(build(torch.bfloat16, T=6, slots="all"))
    before = c.snapshot()
    with pytest.raises(ValueError, match=r"slot_mapping holds slot 7 twice \(tokens 1 and 3\)"):
        rope_ext.apply_rotary_qk_and_cache_(**c.args())
    for name, t in before.items():
        assert torch.equal(t.view(torch.uint8), getattr(c, name).view(torch.uint8)), name


@requires_emulation
@pytest.mark.parametrize("backend", EMU_BACKENDS)
def test_duplicate_slots_are_a_race_on_the_gpu(backend):
    """The CUDA op does not check slots (position checks off): two blocks would write one cache row."""
    c = _duplicate(build(torch.bfloat16, T=6, slots="all"))
    with pytest.raises(RuntimeError, match="data race in the CUDA kernel body"):
        emulated(c.args(), *{"emu-132sm": (132, False), "emu-1sm": (1, False)}.get(backend, (1, True)))


# ---------------------------------------------------------------------------------------------------
# Written tensors that hold what the call reads.

T, H, D = 4, 2, 16


def _alias(buf: torch.Tensor, dtype: torch.dtype, n: int, value) -> torch.Tensor:
    """n elements of dtype at buf's first element (in buf's storage), set to value."""
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.empty(0, dtype=dtype).set_(
        buf.untyped_storage(), buf.storage_offset() * buf.element_size() // size, (n,)
    )
    t.fill_(value)
    return t


def _rotary_cases():
    """(name, what overlaps, call): in-place rotations whose q holds the positions or the table."""

    def positions_in_q():
        q = torch.randn(T, H, D)
        pos = _alias(q, torch.int64, T, 1).view(T, 1)
        return q, lambda: rope_ext.apply_rotary_qk_(q, torch.randn(T, H, D), pos, make_cos_sin(8, D))

    def table_in_q():
        q = torch.randn(T, H, D)
        cs = q.view(-1)[: 8 * D].view(8, D)
        return q, lambda: rope_ext.apply_rotary_qk_(
            q, torch.randn(T, H, D), torch.zeros(T, 1, dtype=torch.long), cs
        )

    def weight_in_q():
        q, k = torch.randn(T, H, D), torch.randn(T, H, D)
        w = q[0, 0]
        return q, lambda: OPS.qk_norm_rotary_(
            q, k, w, torch.ones(D), torch.zeros(T, dtype=torch.long), make_cos_sin(8, D), 1e-6, False, 0.0
        )

    return {"positions": positions_in_q, "cos_sin": table_in_q, "q_weight": weight_in_q}


@pytest.mark.parametrize("read", ["positions", "cos_sin", "q_weight"])
def test_in_place_rotation_refuses_q_holding_what_it_reads(read):
    q, call = _rotary_cases()[read]()
    before = q.clone()
    with pytest.raises(ValueError, match=rf"q and {read} overlap in memory"):
        call()
    assert torch.equal(q, before)


CACHE_ALIASES = [  # (written tensor, read tensor, dtype of the read tensor)
    ("key_cache", "slot_mapping", torch.int64),
    ("value_cache", "positions", torch.int64),
    ("key_cache", "k_scale", torch.float32),
    ("value_cache", "v_scale", torch.float32),
    ("k", "slot_mapping", torch.int64),
]


@pytest.mark.parametrize("path", ["api", "emulated"])
@pytest.mark.parametrize("written,read,dtype", CACHE_ALIASES, ids=[f"{w}-{r}" for w, r, _ in CACHE_ALIASES])
def test_cache_op_refuses_a_written_tensor_holding_what_it_reads(written, read, dtype, path):
    if path == "emulated" and not HAS_EMULATION:
        pytest.skip(NO_EMULATION)
    c = build(torch.float32, T=4, slots="all")
    target = getattr(c, written)
    n = {"slot_mapping": 4, "positions": 4}.get(read, 1)
    setattr(c, read, _alias(target, dtype, n, 0.5 if dtype.is_floating_point else 1))
    if read == "slot_mapping":
        c.slot_mapping.copy_(torch.arange(4))
    before = c.snapshot()
    with pytest.raises(ValueError, match=rf"{written} and {read} overlap in memory"):
        run(c, "cpu" if path == "api" else "emu-1sm")
    for name, t in before.items():
        assert torch.equal(t.view(torch.uint8), getattr(c, name).view(torch.uint8)), name

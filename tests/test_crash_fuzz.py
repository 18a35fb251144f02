"""Crash-proofing: malformed arguments give a Python exception or a correct result, never a crash or a hang;
NaN and Inf propagate as IEEE arithmetic says and never touch other rows.

The fuzz loop runs in a subprocess (this file run as a script), so that a segfault or an abort shows
as a failed test instead of killing pytest, and a hang is caught by a timeout.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import HAS_EMULATION, child_env, make_cos_sin, requires_emulation

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = (TypeError, ValueError, IndexError, RuntimeError, NotImplementedError)
FUZZ_CASES = 3000


# --------------------------------------------------------------------------------------------
# Argument generators (used in the subprocess).


def _tensor(rng: random.Random, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _x(rng: random.Random, rows: int, heads: int, d: int):
    """A q/k/x argument: mostly valid, often malformed."""
    kind = rng.choice(
        ["valid"] * 6
        + [
            "none",
            "int",
            "str",
            "list",
            "int-tensor",
            "bool-tensor",
            "complex",
            "scalar",
            "1d",
            "zero-size",
            "huge-expanded",
            "nan-inf",
            "strided-last",
            "meta",
            "sparse",
            "float8",
            "uint8",
            "transposed",
            "half",
            "bf16",
            "double",
            "huge-empty",
            "rank-7",
            "zero-head-dim",
            "odd-head-dim",
        ]
    )
    shape = (rows, heads, d)
    if kind == "valid":
        return kind, _tensor(rng, shape)
    if kind == "none":
        return kind, None
    if kind == "int":
        return kind, 3
    if kind == "str":
        return kind, "q"
    if kind == "list":
        return kind, [[0.0] * d]
    if kind == "int-tensor":
        return kind, torch.ones(shape, dtype=torch.int32)
    if kind == "bool-tensor":
        return kind, torch.ones(shape, dtype=torch.bool)
    if kind == "complex":
        return kind, torch.ones(shape, dtype=torch.complex64)
    if kind == "scalar":
        return kind, torch.tensor(1.0)
    if kind == "1d":
        return kind, _tensor(rng, (d,))
    if kind == "zero-size":
        return kind, torch.empty(rng.choice([(0, heads, d), (rows, 0, d), (0, 0, d)]))
    if kind == "huge-expanded":
        return kind, torch.zeros(1, 1, d).expand(2**30, 2**20, d)
    if kind == "nan-inf":
        t = _tensor(rng, shape)
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
        return kind, t
    if kind == "strided-last":
        return kind, _tensor(rng, (rows, heads, 2 * d))[..., ::2]
    if kind == "meta":
        return kind, torch.empty(shape, device="meta")
    if kind == "sparse":
        return kind, _tensor(rng, shape).to_sparse()
    if kind == "float8":
        return kind, torch.zeros(shape, dtype=torch.float8_e4m3fn)
    if kind == "uint8":
        return kind, torch.zeros(shape, dtype=torch.uint8)
    if kind == "transposed":
        return kind, _tensor(rng, (heads, rows, d)).transpose(0, 1)
    if kind == "half":
        return kind, _tensor(rng, shape, torch.float16)
    if kind == "bf16":
        return kind, _tensor(rng, shape, torch.bfloat16)
    if kind == "double":
        return kind, _tensor(rng, shape, torch.float64)
    if kind == "huge-empty":
        return kind, torch.empty(0, 2**40, d)
    if kind == "rank-7":
        return kind, _tensor(rng, (2, 1, 3, 1, 2, 1, d)).transpose(0, 4)
    if kind == "zero-head-dim":
        return kind, torch.empty(rows, heads, 0)
    return kind, _tensor(rng, (rows, heads, d + 1))


def _positions(rng: random.Random, rows: int, n_cache: int):
    kind = rng.choice(
        ["valid"] * 6
        + [
            "none",
            "float",
            "bool",
            "int8",
            "uint8",
            "negative",
            "too-big",
            "int64-min",
            "int64-max",
            "int32-max",
            "wrong-shape",
            "too-many-dims",
            "scalar",
            "meta",
            "expanded",
            "list",
            "0-dim-bad",
            "empty",
        ]
    )
    if kind == "valid":
        return kind, torch.randint(0, n_cache, (rows, 1))
    if kind == "none":
        return kind, None
    if kind == "float":
        return kind, torch.zeros(rows, 1)
    if kind == "bool":
        return kind, torch.zeros(rows, 1, dtype=torch.bool)
    if kind == "int8":
        return kind, torch.zeros(rows, 1, dtype=torch.int8)
    if kind == "uint8":
        return kind, torch.zeros(rows, 1, dtype=torch.uint8)
    if kind == "negative":
        return kind, torch.full((rows, 1), -rng.randrange(1, 2**40))
    if kind == "too-big":
        return kind, torch.full((rows, 1), n_cache + rng.randrange(0, 2**40))
    if kind == "int64-min":
        return kind, torch.full((rows, 1), -(2**63))
    if kind == "int64-max":
        return kind, torch.full((rows, 1), 2**63 - 1)
    if kind == "int32-max":
        return kind, torch.full((rows, 1), 2**31 - 1, dtype=torch.int32)
    if kind == "wrong-shape":
        return kind, torch.zeros(rows + 1, 1, dtype=torch.long)
    if kind == "too-many-dims":
        return kind, torch.zeros(1, 1, rows, 1, dtype=torch.long)
    if kind == "scalar":
        return kind, torch.tensor(0)
    if kind == "meta":
        return kind, torch.zeros(rows, 1, dtype=torch.long, device="meta")
    if kind == "expanded":
        return kind, torch.zeros(1, 1, dtype=torch.long).expand(rows, 1)
    if kind == "list":
        return kind, [0] * rows
    if kind == "0-dim-bad":
        return kind, torch.tensor(-5)
    return kind, torch.zeros(0, dtype=torch.long)


def _cos_sin(rng: random.Random, n_cache: int, r: int):
    from rope_ext import RopeCache

    kind = rng.choice(
        ["valid"] * 6
        + [
            "none",
            "1d",
            "3d",
            "zero-rows",
            "zero-cols",
            "odd-cols",
            "double",
            "half",
            "int",
            "strided",
            "nan",
            "inf",
            "meta",
            "huge-rows",
            "transposed",
            "too-wide",
            "list",
        ]
    )
    valid = RopeCache(r, max_positions=n_cache).cos_sin
    if kind == "valid":
        return kind, valid
    if kind == "none":
        return kind, None
    if kind == "1d":
        return kind, valid[0]
    if kind == "3d":
        return kind, valid[None]
    if kind == "zero-rows":
        return kind, valid[:0]
    if kind == "zero-cols":
        return kind, valid[:, :0]
    if kind == "odd-cols":
        return kind, valid[:, :-1]
    if kind == "double":
        return kind, valid.double()
    if kind == "half":
        return kind, valid.half()
    if kind == "int":
        return kind, valid.int()
    if kind == "strided":
        return kind, torch.cat([valid, valid], -1)[:, ::2]
    if kind == "nan":
        t = valid.clone()
        t[rng.randrange(n_cache)] = float("nan")
        return kind, t
    if kind == "inf":
        t = valid.clone()
        t[rng.randrange(n_cache), 0] = float("inf")
        return kind, t
    if kind == "meta":
        return kind, valid.to("meta")
    if kind == "huge-rows":
        return kind, valid[:1].expand(2**40, r)
    if kind == "transposed":
        return kind, valid.t().contiguous().t()
    if kind == "too-wide":
        return kind, RopeCache(2 * r + 2, max_positions=n_cache).cos_sin
    return kind, valid.tolist()


def _flag(rng: random.Random):
    return rng.choice([False, True, False, True, None, 1, "yes", 2.5])


def _check_result(op, out, args) -> str | None:
    """None when a successful call returned the right thing, else a description of what is wrong."""
    from rope_ext import reference

    x, k, positions, cos_sin, interleaved, inverse = args
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in (x, positions, cos_sin)):
        return None  # meta results carry no values
    if isinstance(interleaved, str) or isinstance(inverse, str):
        return "a string flag was accepted"
    if cos_sin.dim() == 2 and cos_sin.shape[0] > 1 and cos_sin.stride(0) == 0:
        cos_sin, positions = cos_sin[:1], positions * 0  # every row is the same: do not materialize
    tensors = [x] if op == "rotary" else [x, k]
    results = [out] if op == "rotary" else list(out) if op == "rotary_qk" else [x, k]
    for before, got in zip(tensors, results, strict=True):
        if before is None or got is None:
            continue
        if before.numel() == 0:
            continue
        ref = reference.rotary_hadamard(
            before.double(), positions, cos_sin, interleaved=bool(interleaved), inverse=bool(inverse)
        )
        g = got.double()
        nan_ok = torch.equal(g.isnan(), ref.isnan())
        finite = ref.isfinite() & g.isfinite()
        inf_ok = torch.equal(g[g.isinf()], ref[g.isinf()]) and torch.equal(g.isinf(), ref.isinf())
        if not (nan_ok and inf_ok):
            return f"{op}: NaN/Inf pattern differs from the reference"
        scale = before.double().abs().nan_to_num(0, 0, 0).max().item() or 1.0
        err = (g[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
        if err > 1e-2 * scale:
            return f"{op}: error {err:.3g} against the reference"
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes."""
    return torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def fuzz(n_cases: int, seed: int) -> dict:
    """Runs n_cases random malformed calls; returns counts by outcome and any bad outcome."""
    import rope_ext

    ops = torch.ops.rope_ext
    # The test-only op exists only in builds with ROPE_EXT_TESTING=1: without it, it is never drawn.
    op_names = ["rotary", "rotary_qk", "rotary_qk_", "raw_rotary", "raw_rotary_qk_"] + (
        ["emulated"] if HAS_EMULATION else []
    )
    rng = random.Random(seed)
    outcomes: dict = {"ok": 0, "exceptions": {}, "bad": [], "messages": {}}
    for i in range(n_cases):
        rows, heads, d = rng.choice([1, 2, 5]), rng.choice([1, 3]), rng.choice([2, 8, 16, 24])
        n_cache = rng.choice([1, 4, 64])
        r = rng.choice([2, d - d % 2 or 2])
        xk, x = _x(rng, rows, heads, d)
        kk, k = _x(rng, rows, rng.choice([1, 2]), d) if rng.random() < 0.6 else ("absent", None)
        pk, positions = _positions(rng, rows, n_cache)
        ck, cos_sin = _cos_sin(rng, n_cache, r)
        interleaved, inverse = _flag(rng), _flag(rng)
        op = rng.choice(op_names)
        desc = f"case {i}: op={op} x={xk} k={kk} positions={pk} cos_sin={ck} flags=({interleaved}, {inverse})"
        before = [
            t.clone()
            if isinstance(t, torch.Tensor)
            and t.device.type == "cpu"
            and t.numel() < 10**6
            and t.layout == torch.strided
            else t
            for t in (x, k)
        ]
        try:
            if op == "rotary":
                out = rope_ext.apply_rotary(x, positions, cos_sin, interleaved=interleaved, inverse=inverse)
                check = ("rotary", out)
            elif op == "rotary_qk":
                out = rope_ext.apply_rotary_qk(x, k, positions, cos_sin, interleaved=interleaved)
                check, inverse = ("rotary_qk", out), False
            elif op == "rotary_qk_":
                rope_ext.apply_rotary_qk_(x, k, positions, cos_sin, interleaved=interleaved)
                check, inverse = ("rotary_qk_", None), False
            elif op == "raw_rotary":
                out = ops.rotary(x, positions, cos_sin, interleaved, inverse)
                check = ("rotary", out)
            elif op == "raw_rotary_qk_":
                ops.rotary_qk_(x, k, positions, cos_sin, interleaved, inverse)
                check = ("rotary_qk_", None)
            else:
                num_sms = rng.choice([0, -1, 1, 132, 2**40])
                ops._cuda_emulated(
                    x, k, x, k, positions, cos_sin, interleaved, inverse, num_sms, rng.random() < 0.5
                )
                check = ("rotary_qk_", None)
                if (
                    isinstance(positions, torch.Tensor)
                    and positions.numel()
                    and not positions.is_floating_point()
                ):
                    if positions.min() < 0 or positions.max() >= cos_sin.shape[0]:
                        check = None  # NaN for out-of-cache positions, tested elsewhere
        except ALLOWED as e:
            name = type(e).__name__
            outcomes["exceptions"][name] = outcomes["exceptions"].get(name, 0) + 1
            msg = f"{name}: " + re.sub(r"\d+", "N", (str(e).splitlines() or [""])[0])[:100]
            outcomes["messages"][msg] = outcomes["messages"].get(msg, 0) + 1
            for b, t in zip(before, (x, k), strict=True):
                if isinstance(b, torch.Tensor) and b is not t and not _same_bits(b, t):
                    outcomes["bad"].append(f"{desc}: input changed by a rejected call")
            continue
        except Exception as e:  # noqa: BLE001 - an undocumented exception type is reported
            outcomes["bad"].append(f"{desc}: {type(e).__name__}: {e}")
            continue
        outcomes["ok"] += 1
        if check is not None:
            op_name, out = check
            args = (before[0], before[1], positions, cos_sin, interleaved, inverse)
            if op_name == "rotary_qk_":
                out = None
                args = (before[0], before[1], positions, cos_sin, interleaved, inverse)
                problem = _check_result("rotary_qk", (x, k), args)
            else:
                problem = _check_result(op_name, out, args)
            if problem:
                outcomes["bad"].append(f"{desc}: {problem}")
    return outcomes


def test_fuzz_malformed_arguments_in_subprocess():
    """FUZZ_CASES random malformed calls: each raises a documented exception type or is correct."""
    env = child_env()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), str(FUZZ_CASES), "1234"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"fuzz process died (status {proc.returncode}):\n{proc.stderr[-3000:]}"
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not outcomes["bad"], "\n".join(outcomes["bad"][:20])
    assert outcomes["ok"] > 0 and sum(outcomes["exceptions"].values()) > FUZZ_CASES // 4


# --------------------------------------------------------------------------------------------
# NaN / Inf propagation.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "backend",
    [
        "cpu",
        pytest.param("emulated-vector", marks=requires_emulation),
        pytest.param("emulated-scalar", marks=requires_emulation),
    ],
)
def test_nan_inf_stay_in_their_pair(dtype, interleaved, special, backend):
    """A special value in one feature makes only its own pair non-finite (as the reference computes it);
    every other element is bit-identical to the result without the special value."""
    from rope_ext import reference

    T_, H_, D_, R_ = 6, 3, 32, 16
    gen = torch.Generator().manual_seed(5)
    clean = torch.randn(T_, H_, D_, generator=gen).to(dtype)
    dirty = clean.clone()
    spots = [(1, 0, 3), (4, 2, R_ - 1), (2, 1, R_ + 4)]  # rotated, rotated (last pair), pass-through
    for s in spots:
        dirty[s] = special
    positions = torch.tensor([0, 5, 2, 9, 1, 3])[:, None]
    cs = make_cos_sin(16, R_)

    def rotate(x):
        if backend == "cpu":
            return torch.ops.rope_ext.rotary(x, positions, cs, interleaved, False)
        out = torch.empty_like(x)
        torch.ops.rope_ext._cuda_emulated(
            x, None, out, None, positions, cs, interleaved, False, 4, backend.endswith("scalar")
        )
        return out

    got, base = rotate(dirty), rotate(clean)
    ref = reference.rotary_hadamard(dirty, positions, cs, interleaved=interleaved)
    assert torch.equal(got.double().isnan(), ref.isnan())
    assert torch.equal(got.double().isinf(), ref.isinf())
    assert torch.equal(got.double()[ref.isinf()], ref[ref.isinf()])
    touched = torch.zeros(T_, H_, D_, dtype=torch.bool)
    for t, h, f in spots:
        touched[t, h, f] = True
        if f < R_:
            partner = (f ^ 1) if interleaved else (f + R_ // 2 if f < R_ // 2 else f - R_ // 2)
            touched[t, h, partner] = True
    assert torch.equal(got[~touched], base[~touched])


if __name__ == "__main__":
    print(json.dumps(fuzz(int(sys.argv[1]), int(sys.argv[2]))))

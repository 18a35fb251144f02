"""Hostile integer arguments: every integer of every op at 0, 1, -1, 2^31 - 1, 2^31, 2^32, 2^63 - 1, -2^63.

Each call (public function and bare ``torch.ops.rope_ext`` op, on every CPU instruction set this CPU runs)
either gives the answer of the float64 reference or raises a Python exception that names the argument,
and leaves every input tensor bit-identical. The calls run in a subprocess (this file as a script), so a
crash or heap corruption fails the test instead of killing pytest; the sanitizer build runs it too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import child_env

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = (0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63))
D = 60
T, HQ, HK = 8, 4, 2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _sections():
    """mrope_section values: hostile in each slot, sums that wrap, wrong lengths."""
    half = D // 2
    out = [[v, 0, half] for v in HOSTILE] + [[0, v, half] for v in HOSTILE] + [[half, 0, v] for v in HOSTILE]
    out += [[2**63 - 1, 2**63 - 1, 2 + half], [-(2**63), 2**63 - 1, half + 1], [2**62, 2**62, 2**63 - 2**62]]
    out += [[], [half], [half, 0], [half, 0, 0, 0], [10, 10, 10]]
    return out


def _must_raise(calls: list, start: int, value: bool | None) -> None:
    """Marks the calls from ``start`` on that have no mark yet: True, the arguments are invalid."""
    calls[start:] = [c if len(c) == 4 else (*c, value) for c in calls[start:]]


def _calls():
    """(description, argument name the error must name, call) for every op and integer argument."""
    import rope_ext

    ops = torch.ops.rope_ext
    g = torch.Generator().manual_seed(0)
    cs = rope_ext.RopeCache(D, max_positions=64).cos_sin
    narrow = rope_ext.RopeCache(D - 12, max_positions=64).cos_sin
    q, k, v = torch.randn(T, HQ, D, generator=g), torch.randn(T, HK, D, generator=g), torch.randn(T, HK, D)
    pos, pos3 = torch.randint(0, 64, (T,), generator=g), torch.randint(0, 64, (3, T), generator=g)
    w = torch.ones(D)

    def cache(**kw):
        kc, vc = torch.zeros(4, 4, HK, D), torch.zeros(4, 4, HK, D)
        qq, kk = q.clone(), k.clone()
        p = kw.pop("positions", pos)
        rope_ext.apply_rotary_qk_and_cache_(qq, kk, v, p, kw.pop("cs", cs), kc, vc, kw.pop("slots"), **kw)
        return qq, kk, kc, vc

    calls = []
    for sec in _sections():
        kw = dict(mrope_section=sec)
        n0 = len(calls)
        calls += [
            (
                "apply_rotary",
                "mrope_section",
                lambda kw=kw: rope_ext.apply_rotary(q, pos3[..., None], cs, **kw),
            ),
            ("rotary", "mrope_section", lambda s=sec: ops.rotary(q, pos3[..., None], cs, False, False, 0, s)),
            (
                "apply_rotary_qk",
                "mrope_section",
                lambda kw=kw: rope_ext.apply_rotary_qk(q, k, pos3[..., None], cs, **kw),
            ),
            (
                "apply_rotary_qk_",
                "mrope_section",
                lambda kw=kw: rope_ext.apply_rotary_qk_(q.clone(), k.clone(), pos3[..., None], cs, **kw),
            ),
            ("cache", "mrope_section", lambda kw=kw: cache(positions=pos3, slots=torch.arange(T), **kw)),
            (
                "qk_norm",
                "mrope_section",
                lambda kw=kw: rope_ext.apply_qk_norm_rotary(q, k, w, w, pos3, cs, **kw),
            ),
        ]
        valid = len(sec) == 3 and all(0 <= s <= D // 2 for s in sec) and sum(sec) == D // 2
        _must_raise(calls, n0, not valid)
    for off in HOSTILE + (6, 12, 13):
        kw = dict(rotary_offset=off)
        n0 = len(calls)
        calls += [
            (
                "apply_rotary",
                "rotary_offset",
                lambda kw=kw: rope_ext.apply_rotary(q, pos[:, None], narrow, **kw),
            ),
            ("rotary", "rotary_offset", lambda o=off: ops.rotary(q, pos[:, None], narrow, False, False, o)),
            (
                "apply_rotary_qk_",
                "rotary_offset",
                lambda kw=kw: rope_ext.apply_rotary_qk_(q.clone(), k.clone(), pos[:, None], narrow, **kw),
            ),
            ("cache", "rotary_offset", lambda kw=kw: cache(cs=narrow, slots=torch.arange(T), **kw)),
            (
                "qk_norm",
                "rotary_offset",
                lambda kw=kw: rope_ext.apply_qk_norm_rotary(q, k, w, w, pos, narrow, **kw),
            ),
        ]
        _must_raise(calls, n0, not 0 <= off <= 12)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g)
    for heads in (
        [(v1, HK, HK) for v1 in HOSTILE] + [(HQ, v1, HK) for v1 in HOSTILE] + [(HQ, HK, v1) for v1 in HOSTILE]
    ):
        calls += [
            (
                "apply_qk_norm_rotary_",
                "head counts",
                lambda h=heads: rope_ext.apply_qk_norm_rotary_(qkv.clone(), *h, w, w, pos, cs),
            ),
            (
                "qk_norm_rotary_packed_",
                "head counts",
                lambda h=heads: ops.qk_norm_rotary_packed_(qkv.clone(), *h, w, w, pos, cs),
            ),
        ]
    heads = (2**63 - 1, 2**63 - 1, 4)  # the sum wraps to 2
    calls.append(
        (
            "qk_norm_rotary_packed_",
            "head counts",
            lambda: ops.qk_norm_rotary_packed_(qkv.clone(), *heads, w, w, pos, cs),
        )
    )
    _must_raise(calls, len(calls) - 1, True)
    for slot in HOSTILE:
        calls.append(("cache", "slot_mapping", lambda s=slot: cache(slots=torch.full((T,), s))))
        _must_raise(calls, len(calls) - 1, slot not in (0, 1, -1))
    for p in HOSTILE:
        calls.append(
            ("apply_rotary", "positions", lambda p=p: rope_ext.apply_rotary(q, torch.full((T, 1), p), cs))
        )
        calls.append(
            ("cache", "positions", lambda p=p: cache(positions=torch.full((T,), p), slots=torch.arange(T)))
        )
        _must_raise(calls, len(calls) - 2, not 0 <= p < 64)
    for eps in (-1.0, float("nan"), float("inf"), 1e300, 0.0):
        calls.append(
            ("qk_norm", "eps", lambda e=eps: rope_ext.apply_qk_norm_rotary(q, k, w, w, pos, cs, eps=e))
        )
        _must_raise(calls, len(calls) - 1, eps != 0.0)
    for off in (float("nan"), float("inf"), -float("inf")):
        calls.append(
            (
                "qk_norm",
                "weight_offset",
                lambda o=off: rope_ext.apply_qk_norm_rotary(q, k, w, w, pos, cs, weight_offset=o),
            )
        )
    _must_raise(calls, len(calls) - 3, True)  # a weight_offset that is not finite
    _must_raise(calls, 0, None)  # the rest: either outcome, checked as every call is
    return calls, (q, k, v, pos, pos3, cs, narrow, qkv, w)


def run() -> dict:
    import rope_ext

    result = {"ok": 0, "raised": 0, "bad": []}
    for isa in rope_ext.ops.CPU_ISAS:
        try:
            rope_ext._set_cpu_isa(isa)
        except ValueError:
            continue
        calls, inputs = _calls()
        before = [_bits(t) for t in inputs]
        for name, arg, must_raise, call in ((n, a, m, c) for n, a, c, m in calls):
            try:
                call()
                result["ok"] += 1
                if must_raise:
                    result["bad"].append(f"{isa} {name}: an invalid {arg} was accepted")
            except (ValueError, TypeError, IndexError, RuntimeError) as e:
                result["raised"] += 1
                # Head counts that pass their own range check can still give a width or a head_dim that
                # other arguments contradict: those errors name what disagrees.
                words = {"head counts": ("head counts", "Hq+Hk+Hv", "q_weight must be [D]")}.get(arg, (arg,))
                if not any(w in str(e) for w in words) or isinstance(e, RuntimeError):
                    result["bad"].append(f"{isa} {name}: {type(e).__name__} does not name {arg}: {e}")
            if any(not torch.equal(b, _bits(t)) for b, t in zip(before, inputs, strict=True)):
                result["bad"].append(f"{isa} {name} ({arg}): an input changed")
                before = [_bits(t) for t in inputs]
    return result


def test_hostile_integers_raise_or_compute():
    proc = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=child_env(),
        check=False,
    )
    assert proc.returncode == 0, f"crashed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["raised"] > 0 and result["ok"] > 0
    assert not result["bad"], "\n".join(result["bad"][:20])


@pytest.mark.parametrize("value", [2**63 - 1, 2**32, -(2**63)])
def test_issue_example_section_sum_that_wraps(value):
    """The section sum 2^63 - 1 + 2^63 - 1 + 32 wraps to 30 in int64: rejected before the kernel."""
    import rope_ext

    cs = rope_ext.RopeCache(D).cos_sin
    x = torch.randn(64, 8, D)
    pos = torch.randint(0, 100, (3, 64, 1))
    snap = x.clone()
    with pytest.raises(ValueError, match="mrope_section"):
        rope_ext.apply_rotary(x, pos, cs, mrope_section=[value, 2**63 - 1, 2 + D // 2])
    assert torch.equal(x, snap)


if __name__ == "__main__":
    print(json.dumps(run()))

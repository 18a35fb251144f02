"""The CPU kernel's software prefetch: its distance changes no bit of any op, on any instruction set.

Before a head is rotated (or normalised), the head ``_cpu_prefetch()`` bytes further on in the loop's order
is hinted into L1: a later head of the token, or one of the next token's (csrc/rope/cpu/kernel.h, ``Ahead``,
whose targets a static_assert checks). The distance is set from ``ROPE_EXT_CPU_PREFETCH`` or the CPU's
vendor, and by ``rope_ext._set_cpu_prefetch`` for tests and benchmarks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rope_ext
from rope_ext import ops

ROOT = Path(__file__).resolve().parents[1]
ISAS = [i for i in ops.CPU_ISAS if torch.ops.rope_ext._cpu_isa_supported(i)]
# 0: no hints; 64: one head ahead; 2048: Intel's default; the largest: every head hints the next token's.
DISTANCES = [0, 64, 2048, ops.CPU_MAX_PREFETCH]
HQ, HK = 8, 2


@pytest.fixture
def restore():
    isa, distance = rope_ext._cpu_isa(), rope_ext._cpu_prefetch()
    yield
    rope_ext._set_cpu_isa(isa)
    rope_ext._set_cpu_prefetch(distance)


def _tokens(dtype, head_dim):
    """Tokens whose q and k heads hold 2 MiB: the kernels prefetch only in calls over 1 MiB of heads
    (kernel.h, kPrefetchMinBytes)."""
    return (2 << 20) // ((HQ + HK) * head_dim * dtype.itemsize) + 1


def _views(qkv, head_dim):
    """q, k, v of a packed qkv: the next token's heads lie past the token's v."""
    a, b = HQ * head_dim, (HQ + HK) * head_dim
    return tuple(t.unflatten(1, (-1, head_dim)) for t in (qkv[:, :a], qkv[:, a:b], qkv[:, b:]))


def _ops_outputs(dtype, head_dim, interleaved):
    """Every CPU op with a prefetching head loop, on separate q, k and on views of one packed qkv."""
    g = torch.Generator().manual_seed(head_dim)
    T = _tokens(dtype, head_dim)
    qkv = torch.randn(T, (HQ + 2 * HK) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 512, (T,), generator=g)
    cs = rope_ext.RopeCache(head_dim, max_positions=512).cos_sin
    il = {"interleaved": interleaved}
    q, k, _ = _views(qkv, head_dim)
    out = {
        "apply_rotary_qk": rope_ext.apply_rotary_qk(q.contiguous(), k.contiguous(), pos[:, None], cs, **il)
    }
    packed = qkv.clone()
    q, k, _ = _views(packed, head_dim)
    rope_ext.apply_rotary_qk_(q, k, pos[:, None], cs, **il)
    out["apply_rotary_qk_"] = (packed,)
    cached = qkv.clone()
    key_cache = torch.zeros(T + 3, 1, HK, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(T + 3, generator=g)[:T]
    rope_ext.apply_rotary_qk_and_cache_(
        *_views(cached, head_dim), pos, cs, key_cache, value_cache, slots, **il
    )
    out["apply_rotary_qk_and_cache_"] = (cached, key_cache, value_cache)
    w = torch.randn(head_dim, generator=g).to(dtype) * 0.1 + 1
    normed = qkv.clone()
    rope_ext.apply_qk_norm_rotary_(normed, HQ, HK, HK, w, w, pos, cs, **il)
    out["apply_qk_norm_rotary_"] = (normed,)
    return out


@pytest.mark.parametrize("head_dim", [128, 64, 46])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefetch_distance_changes_no_bit(restore, dtype, interleaved, head_dim):
    """128 and 64 take the unrolled head loops (AVX-512's rotate_heads and one-pass QK norm), 46 the
    generic ones."""
    for isa in ISAS:
        rope_ext._set_cpu_isa(isa)
        rope_ext._set_cpu_prefetch(0)
        want = _ops_outputs(dtype, head_dim, interleaved)
        for distance in DISTANCES[1:]:
            rope_ext._set_cpu_prefetch(distance)
            got = _ops_outputs(dtype, head_dim, interleaved)
            for name, value in want.items():
                for a, b in zip(got[name], value, strict=True):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{isa} {distance} {name}"


@pytest.mark.parametrize("bad", [-1, 2**31, 2**63 - 1, ops.CPU_MAX_PREFETCH + 1, True, 2048.0, "2048", None])
def test_set_cpu_prefetch_refuses_what_is_not_a_distance(restore, bad):
    before = rope_ext._cpu_prefetch()
    with pytest.raises(ValueError, match=r"bytes_ahead must be an int from 0 to 1048576"):
        rope_ext._set_cpu_prefetch(bad)
    assert rope_ext._cpu_prefetch() == before
    assert torch.ops.rope_ext._set_cpu_prefetch(-1) is False
    assert torch.ops.rope_ext._set_cpu_prefetch(2**63 - 1) is False
    assert rope_ext._cpu_prefetch() == before


def test_set_cpu_prefetch_returns_the_previous_distance(restore):
    rope_ext._set_cpu_prefetch(4096)
    assert rope_ext._set_cpu_prefetch(0) == 4096
    assert rope_ext._cpu_prefetch() == 0


def _child(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ROPE_EXT_CPU_PREFETCH"}
    if value is not None:
        env["ROPE_EXT_CPU_PREFETCH"] = value
    code = "import rope_ext; print(rope_ext._cpu_prefetch())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_distance_from_the_environment_or_the_vendor():
    """The environment's value when given; else 2048 bytes on Intel CPUs, none on others."""
    assert _child("4096").stdout.strip() == "4096"
    assert _child("0").stdout.strip() == "0"
    intel = "GenuineIntel" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False
    assert _child(None).stdout.strip() == ("2048" if intel else "0")
    for bad in ["-5", "2k", str(ops.CPU_MAX_PREFETCH + 1), " 64", "\u00b2"]:
        child = _child(bad)
        assert child.returncode != 0
        assert (
            f"ValueError: ROPE_EXT_CPU_PREFETCH must be a number of bytes from 0 to 1048576, got {bad!r}"
            in (child.stderr)
        )

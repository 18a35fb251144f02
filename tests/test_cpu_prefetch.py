"""The CPU kernel's software prefetch: its distance and level change no bit of any op, on any instruction set.

Before a head is rotated (or normalised), the head ``_cpu_prefetch()`` bytes further on in the loop's order
is hinted into cache level ``_cpu_prefetch_level()`` (1: L1, 2: L2): a later head of the token, or one of the
next token's (csrc/rope/cpu/kernel.h, ``Ahead``, whose targets a static_assert checks). Both are set from
``ROPE_EXT_CPU_PREFETCH`` / ``ROPE_EXT_CPU_PREFETCH_LEVEL`` or the CPU's vendor, and by
``rope_ext._set_cpu_prefetch`` / ``_set_cpu_prefetch_level`` for tests and benchmarks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rope_ext
from rope_ext import ops

ROOT = Path(__file__).resolve().parents[1]
ISAS = [i for i in ops.CPU_ISAS if torch.ops.rope_ext._cpu_isa_supported(i)]
# (bytes, level): 0: no hints; 64: one head ahead; 2048 into L1: Intel's default; 8192 into L2: AMD's
# (Zen 3 on); the largest: every head hints the next token's.
SETTINGS = [(0, 1), (64, 1), (2048, 1), (8192, 2), (ops.CPU_MAX_PREFETCH, 2)]
HQ, HK = 8, 2


@pytest.fixture
def restore():
    isa, distance, level = rope_ext._cpu_isa(), rope_ext._cpu_prefetch(), rope_ext._cpu_prefetch_level()
    yield
    rope_ext._set_cpu_isa(isa)
    rope_ext._set_cpu_prefetch(distance)
    rope_ext._set_cpu_prefetch_level(level)


def _tokens(dtype, head_dim):
    """Tokens whose q and k heads hold 2 MiB: the kernels prefetch only in calls over 1 MiB of heads
    (256 KiB with hints into L2: cpu.h, hints)."""
    return (2 << 20) // ((HQ + HK) * head_dim * dtype.itemsize) + 1


def _views(qkv, head_dim):
    """q, k, v of a packed qkv: the next token's heads lie past the token's v."""
    a, b = HQ * head_dim, (HQ + HK) * head_dim
    return tuple(t.unflatten(1, (-1, head_dim)) for t in (qkv[:, :a], qkv[:, a:b], qkv[:, b:]))


def _ops_outputs(dtype, head_dim, interleaved):
    """Every CPU op that hints memory ahead, on separate q, k and on views of one packed qkv."""
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
    # the re-rotation of those keys (its fp8 path hints the next token's row), float and fp8
    delta = torch.randint(-511, 512, (T,), generator=g)
    shifted = key_cache.clone()
    rope_ext.rerotate_kv_cache_(shifted, slots, delta, cs, **il)
    codes = key_cache.to(torch.float8_e4m3fn)
    rope_ext.rerotate_kv_cache_(codes, slots, delta, cs, k_scale=torch.tensor([0.37]), **il)
    out["rerotate_kv_cache_"] = (shifted, codes)
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
        for distance, level in SETTINGS[1:]:
            rope_ext._set_cpu_prefetch(distance)
            rope_ext._set_cpu_prefetch_level(level)
            got = _ops_outputs(dtype, head_dim, interleaved)
            for name, value in want.items():
                for a, b in zip(got[name], value, strict=True):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
                        f"{isa} {distance} L{level} {name}"
                    )


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


@pytest.mark.parametrize("bad", [0, 3, -1, 2**63 - 1, True, 2.0, "2", None])
def test_set_cpu_prefetch_level_refuses_what_is_not_a_level(restore, bad):
    before = rope_ext._cpu_prefetch_level()
    with pytest.raises(ValueError, match=r"level must be 1 or 2"):
        rope_ext._set_cpu_prefetch_level(bad)
    assert rope_ext._cpu_prefetch_level() == before
    for raw in (0, 3, -1, 2**63 - 1):
        assert torch.ops.rope_ext._set_cpu_prefetch_level(raw) is False
    assert rope_ext._cpu_prefetch_level() == before


def test_set_cpu_prefetch_level_returns_the_previous_level(restore):
    rope_ext._set_cpu_prefetch_level(2)
    assert rope_ext._set_cpu_prefetch_level(1) == 2
    assert rope_ext._cpu_prefetch_level() == 1


def _child(value: str | None, level: str | None = None) -> subprocess.CompletedProcess:
    names = ("ROPE_EXT_CPU_PREFETCH", "ROPE_EXT_CPU_PREFETCH_LEVEL")
    env = {k: v for k, v in os.environ.items() if k not in names}
    for name, v in zip(names, (value, level), strict=True):
        if v is not None:
            env[name] = v
    code = "import rope_ext; print(rope_ext._cpu_prefetch(), rope_ext._cpu_prefetch_level())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _vendor_default() -> str:
    """2048 bytes into L1 on Intel; 8192 into L2 on AMD from family 19h (Zen 3 on); none on others."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "GenuineIntel" in info:
        return "2048 1"
    family = re.search(r"^cpu family\s*:\s*(\d+)", info, re.M)
    if "AuthenticAMD" in info and family and int(family.group(1)) >= 0x19:
        return "8192 2"
    return "0 1"


def test_distance_from_the_environment_or_the_vendor():
    """The environment's values when given; else the vendor's."""
    default = _vendor_default()
    assert _child(None).stdout.strip() == default
    assert _child("4096").stdout.strip() == "4096 " + default.split()[1]
    assert _child("0", "2").stdout.strip() == "0 2"
    assert _child(None, "1").stdout.strip() == default.split()[0] + " 1"
    for bad in ["0", "3", "l2", " 1", "\u00b9"]:
        child = _child(None, bad)
        assert child.returncode != 0
        assert f"ValueError: ROPE_EXT_CPU_PREFETCH_LEVEL must be 1 or 2, got {bad!r}" in child.stderr
    for bad in ["-5", "2k", str(ops.CPU_MAX_PREFETCH + 1), " 64", "\u00b2"]:
        child = _child(bad)
        assert child.returncode != 0
        assert (
            f"ValueError: ROPE_EXT_CPU_PREFETCH must be a number of bytes from 0 to 1048576, got {bad!r}"
            in (child.stderr)
        )

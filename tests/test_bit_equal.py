"""One rotation, bit for bit, on every path.

For the same inputs and the same float32 table, every way rope_ext rotates a tensor gives the same bits:
``apply_rotary``, ``apply_rotary_qk``, ``apply_rotary_qk_`` (no grad, with grad, under ``torch.compile``),
the KV-cache op's in-place q / k and the k it stores, ``RotaryEmbedding`` and transformers'
``apply_rotary_pos_emb`` replacement, on every CPU instruction set this CPU runs, in the host emulation of
the CUDA kernel (three launch shapes) and on a GPU when there is one. Each path computes
``y1 = fma(x1, c, x2 (-s))``, ``y2 = fma(x2, c, x1 s)`` in float32 with the product rounded first
(rope.h ``rotate_pair``), then rounds once to the output dtype.

The fused QK-norm ops give one result on every CPU instruction set too (their sum of squares runs in 16 fixed
lanes); the CUDA body reduces over a warp in its own order (README, "Numerics").
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, HAS_EMULATION
from backends import EMULATION, emulate

import rope_ext
from rope_ext import ops
from rope_ext.compat.hf import apply_rotary_pos_emb

ISAS = [i for i in ops.CPU_ISAS if torch.ops.rope_ext._cpu_isa_supported(i)]
T, HQ, HK, P = 11, 3, 2, 4096

# Whole vectors of 8, 16, 32 lanes with tails of 1-15 pairs (23, 35, 65 pairs), partial rotary.
SHAPES = [(64, 64), (46, 46), (80, 40), (130, 130), (102, 70)]


def _inputs(dtype, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(head_dim * 131 + rotary_dim)
    # Values over several binades, so that products round differently from fused multiply-adds.
    scale = torch.exp2(torch.randint(-6, 7, (T, 1, 1), generator=g).double())
    q = (torch.randn(T, HQ, head_dim, generator=g, dtype=torch.float64) * scale).to(dtype)
    k = (torch.randn(T, HK, head_dim, generator=g, dtype=torch.float64) * scale).to(dtype)
    pos = torch.randint(0, P, (T,), generator=g)
    cs = rope_ext.RopeCache(rotary_dim, max_positions=P).cos_sin
    return q, k, pos, cs


def _cpu_paths(q, k, pos, cs, interleaved, head_dim, rotary_dim):
    """{path: (q_rot, k_rot)} of every CPU entry point, on the instruction set in use."""
    il = {"interleaved": interleaved}
    out = {
        "apply_rotary": (
            rope_ext.apply_rotary(q, pos[:, None], cs, **il),
            rope_ext.apply_rotary(k, pos[:, None], cs, **il),
        )
    }
    out["apply_rotary_qk"] = rope_ext.apply_rotary_qk(q, k, pos[:, None], cs, **il)
    q2, k2 = q.clone(), k.clone()
    rope_ext.apply_rotary_qk_(q2, k2, pos[:, None], cs, **il)
    out["apply_rotary_qk_"] = (q2, k2)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    q3, k3 = qg * 1, kg * 1
    rope_ext.apply_rotary_qk_(q3, k3, pos[:, None], cs, **il)
    out["apply_rotary_qk_ (grad)"] = (q3.detach(), k3.detach())

    q4, k4, v = q.clone(), k.clone(), torch.zeros_like(k)
    key_cache = torch.zeros(T, 1, HK, head_dim, dtype=q.dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(T, generator=torch.Generator().manual_seed(3))
    rope_ext.apply_rotary_qk_and_cache_(q4, k4, v, pos, cs, key_cache, value_cache, slots, **il)
    out["cache op (in place)"] = (q4, k4)
    out["cache op (stored k)"] = (q4, key_cache[slots, 0])

    m = rope_ext.RotaryEmbedding(head_dim, rotary_dim=rotary_dim, max_positions=P, interleaved=interleaved)
    assert torch.equal(m.cache.cos_sin, cs)
    qm, km = m(q[None], k[None], pos[None])
    out["RotaryEmbedding"] = (qm[0], km[0])

    if not interleaved and rotary_dim == head_dim:
        # transformers' form: cos / sin [batch, seq, head_dim] (halves repeated), q [batch, heads, seq, D].
        c, s = cs[pos].to(q.dtype).chunk(2, dim=-1)
        cos, sin = torch.cat([c, c], -1)[None], torch.cat([s, s], -1)[None]
        if q.dtype == torch.float32:
            qh, kh = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            out["compat apply_rotary_pos_emb"] = (qh[0].transpose(0, 1), kh[0].transpose(0, 1))
    return out


def _assert_equal(path, got, want):
    for name, g, w in zip("qk", got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, path
        diff = (g.float() - w.float()).abs()
        as_int = {2: torch.int16, 4: torch.int32}[g.element_size()]
        same = torch.equal(g.contiguous().view(as_int), w.contiguous().view(as_int))
        assert same, (
            f"{path}: {name} differs from the scalar kernel in {int((diff > 0).sum())} elements "
            f"(max {diff.max().item():.3g})"
        )


@pytest.mark.parametrize("head_dim,rotary_dim", SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_path_gives_the_same_bits(dtype, interleaved, head_dim, rotary_dim):
    q, k, pos, cs = _inputs(dtype, head_dim, rotary_dim)
    previous = ops._set_cpu_isa("scalar")
    try:
        want = (
            rope_ext.apply_rotary(q, pos[:, None], cs, interleaved=interleaved),
            rope_ext.apply_rotary(k, pos[:, None], cs, interleaved=interleaved),
        )
        for isa in ISAS:
            ops._set_cpu_isa(isa)
            for path, got in _cpu_paths(q, k, pos, cs, interleaved, head_dim, rotary_dim).items():
                _assert_equal(f"{isa} {path}", got, want)
    finally:
        ops._set_cpu_isa(previous)
    if HAS_EMULATION:
        for backend in EMULATION:
            qe, ke, _ = emulate(backend, q, k, pos[:, None], cs, interleaved=interleaved)
            _assert_equal(f"CUDA emulation {backend}", (qe, ke), want)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("head_dim,rotary_dim", SHAPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_gives_the_cpu_bits(dtype, interleaved, head_dim, rotary_dim):
    """The CUDA kernels (rotation and KV-cache op) against the CPU's bits."""
    q, k, pos, cs = _inputs(dtype, head_dim, rotary_dim)
    want = rope_ext.apply_rotary_qk(q, k, pos[:, None], cs, interleaved=interleaved)
    qc, kc, pc, csc = (t.cuda() for t in (q, k, pos, cs))
    got = rope_ext.apply_rotary_qk(qc, kc, pc[:, None], csc, interleaved=interleaved)
    _assert_equal("CUDA apply_rotary_qk", [t.cpu() for t in got], want)
    key_cache = torch.zeros(T, 1, HK, head_dim, dtype=dtype, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(T, device="cuda")
    rope_ext.apply_rotary_qk_and_cache_(
        qc, kc, torch.zeros_like(kc), pc, csc, key_cache, value_cache, slots, interleaved=interleaved
    )
    _assert_equal("CUDA cache op", (qc.cpu(), key_cache[:, 0].cpu()), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_paths_give_the_same_bits(dtype):
    """torch.compile(fullgraph=True) with Inductor: the op and the in-place op are the same kernel."""
    q, k, pos, cs = _inputs(dtype, 46, 46)
    want = rope_ext.apply_rotary_qk(q, k, pos[:, None], cs)

    @torch.compile(fullgraph=True)
    def rotate(q, k, pos, cs):
        a, b = rope_ext.apply_rotary_qk(q, k, pos[:, None], cs)
        q2, k2 = q * 1, k * 1
        rope_ext.apply_rotary_qk_(q2, k2, pos[:, None], cs)
        return a, b, q2, k2

    a, b, q2, k2 = rotate(q, k, pos, cs)
    _assert_equal("compiled apply_rotary_qk", (a, b), want)
    _assert_equal("compiled apply_rotary_qk_", (q2, k2), want)


@pytest.mark.parametrize("head_dim", [64, 46, 130])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_norm_gives_the_same_bits_on_every_instruction_set(dtype, interleaved, head_dim):
    q, k, pos, cs = _inputs(dtype, head_dim, head_dim)
    g = torch.Generator().manual_seed(7)
    wq, wk = (torch.randn(head_dim, generator=g) * 0.1 + 1 for _ in range(2))
    qkv = torch.cat([q.flatten(1), k.flatten(1), k.flatten(1)], 1)
    previous = ops._set_cpu_isa("scalar")
    try:
        out = {}
        for isa in ISAS:
            ops._set_cpu_isa(isa)
            a = rope_ext.apply_qk_norm_rotary(
                q, k, wq.to(dtype), wk.to(dtype), pos, cs, interleaved=interleaved
            )
            packed = qkv.clone()
            rope_ext.apply_qk_norm_rotary_(
                packed, HQ, HK, HK, wq.to(dtype), wk.to(dtype), pos, cs, interleaved=interleaved
            )
            b = (
                packed[:, : HQ * head_dim].view_as(q),
                packed[:, HQ * head_dim : (HQ + HK) * head_dim].view_as(k),
            )
            out[isa] = a
            _assert_equal(f"{isa} apply_qk_norm_rotary_", b, a)
        for isa in ISAS:
            _assert_equal(f"{isa} apply_qk_norm_rotary", out[isa], out["scalar"])
    finally:
        ops._set_cpu_isa(previous)

"""GPU-only behaviour: CUDA graphs, reduce-overhead compile, streams, determinism.

The numerical comparisons of every op on CUDA run in the other test files (the ``cuda`` backend).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, assert_close_to_reference

import rope_ext
from rope_ext import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"),
]


def _inputs(tokens=64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, 32, 128, device="cuda", generator=g).to(dtype)
    k = torch.randn(tokens, 8, 128, device="cuda", generator=g).to(dtype)
    pos = torch.randint(0, 4096, (tokens, 1), device="cuda", generator=g)
    cs = rope_ext.RopeCache(128, 500000.0, max_positions=4096, device="cuda").cos_sin
    return q, k, pos, cs


def test_cuda_graph_capture_and_replay():
    q, k, pos, cs = _inputs()
    q0, k0 = q.clone(), k.clone()
    rope_ext.apply_rotary_qk_(q, k, pos, cs)  # warm-up on a side stream is not needed: no allocation
    q.copy_(q0)
    k.copy_(k0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_ext.apply_rotary_qk_(q, k, pos, cs)
    q.copy_(q0)
    k.copy_(k0)
    new_pos = torch.randint(0, 4096, pos.shape, device="cuda")
    pos.copy_(new_pos)
    graph.replay()
    torch.cuda.synchronize()
    ref_q = reference.rotary_hadamard(q0, new_pos, cs)
    assert_close_to_reference(q, ref_q, q0.abs().max().item())
    expected_q, expected_k = rope_ext.apply_rotary_qk(q0, k0, new_pos, cs)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def test_compile_reduce_overhead_fullgraph():
    q, k, pos, cs = _inputs()

    def f(q, k, pos):
        qr, kr = rope_ext.apply_rotary_qk(q, k, pos, cs)
        return qr * 2, kr + 1

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = compiled(q, k, pos)
    want = f(q, k, pos)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_non_default_stream():
    q, k, pos, cs = _inputs(tokens=4096)
    expected = rope_ext.apply_rotary_qk(q, k, pos, cs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = rope_ext.apply_rotary_qk(q, k, pos, cs)
        rope_ext.apply_rotary_qk_(q, k, pos, cs)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(got[0], expected[0]) and torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_bitwise_deterministic():
    q, k, pos, cs = _inputs(tokens=2048)
    first = rope_ext.apply_rotary_qk(q, k, pos, cs)
    for _ in range(5):
        again = rope_ext.apply_rotary_qk(q, k, pos, cs)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_out_of_cache_position_is_nan_or_raises():
    q, k, pos, cs = _inputs(tokens=8)
    pos[3] = 10_000
    out = rope_ext.apply_rotary(q, pos, cs)
    assert out[3].isnan().all() and not out[torch.arange(8, device="cuda") != 3].isnan().any()
    rope_ext.set_position_checks(True)
    try:
        with pytest.raises(IndexError, match="positions"):
            rope_ext.apply_rotary_qk_(q, k, pos, cs)
    finally:
        rope_ext.set_position_checks(False)


def test_matches_cpu_kernel():
    q, k, pos, cs = _inputs(tokens=333, dtype=torch.float32)
    gq, gk = rope_ext.apply_rotary_qk(q, k, pos, cs, interleaved=True)
    cq, ck = rope_ext.apply_rotary_qk(q.cpu(), k.cpu(), pos.cpu(), cs.cpu(), interleaved=True)
    assert (gq.cpu() - cq).abs().max().item() < 1e-5 and (gk.cpu() - ck).abs().max().item() < 1e-5

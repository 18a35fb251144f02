"""Thread safety: one RopeCache shared by 8 threads that grow it while rotating with it.

Every thread calls ``ensure`` with growing sizes and rotates with the table it gets back (out of place,
q/k, in place on its own tensors); the results must be bit-identical to single-threaded results with a
table built once at full size, no call may raise, and no thread may hang.
"""

from __future__ import annotations

import threading

import torch
from _strategies import bits

import rope_ext
from rope_ext import RopeCache

N_THREADS = 8
ROTARY_DIM = 32
HEAD_DIM = 48
MAX_N = 40_000
ITERATIONS = 100
ROUNDS = 5


def _work(tid: int, cache: RopeCache, full: torch.Tensor, barrier: threading.Barrier, failures: list) -> None:
    """One thread: grow (even tids) or just read (odd tids) the cache and check every rotation."""
    gen = torch.Generator().manual_seed(tid)
    try:
        barrier.wait()
        seen = 0
        for it in range(ITERATIONS):
            if tid % 2 == 0:
                n = 16 + (MAX_N - 16) * (it + 1) * (tid + 2) // (ITERATIONS * (N_THREADS + 1))
            else:
                n = int(torch.randint(1, max(2, cache.capacity), (1,), generator=gen))
            cs = cache.ensure(n).cos_sin
            if cs.shape[0] < n or cs.shape[0] < seen:
                failures.append(f"thread {tid}: capacity {cs.shape[0]} after ensure({n}), saw {seen}")
            seen = cs.shape[0]
            if not torch.equal(bits(cs), bits(full[: cs.shape[0]])):
                failures.append(f"thread {tid}: table rows differ from a table built at full size")
            tokens = int(torch.randint(1, 24, (1,), generator=gen))
            positions = torch.randint(0, n, (tokens, 1), generator=gen)
            q = torch.randn(tokens, 4, HEAD_DIM, generator=gen)
            k = torch.randn(tokens, 2, HEAD_DIM, generator=gen).to(torch.bfloat16)
            interleaved = bool(it % 2)
            want_q = rope_ext.apply_rotary(q, positions, full, interleaved=interleaved)
            got_q = rope_ext.apply_rotary(q, positions, cs, interleaved=interleaved)
            got_q2, got_k = rope_ext.apply_rotary_qk(q, k.float(), positions, cs, interleaved=interleaved)
            k_inplace = k.clone()
            rope_ext.apply_rotary_qk_(k_inplace, None, positions, cs, interleaved=interleaved)
            want_k = rope_ext.apply_rotary(k, positions, full, interleaved=interleaved)
            if not (torch.equal(got_q, want_q) and torch.equal(got_q2, want_q)):
                failures.append(f"thread {tid}: q result differs")
            if not torch.equal(bits(k_inplace), bits(want_k)):
                failures.append(f"thread {tid}: in-place k result differs")
            if not torch.equal(
                got_k, rope_ext.apply_rotary(k.float(), positions, full, interleaved=interleaved)
            ):
                failures.append(f"thread {tid}: k result differs")
    except BaseException as e:  # noqa: BLE001 - any exception is a failure of the test
        failures.append(f"thread {tid}: {type(e).__name__}: {e}")
        barrier.abort()


def test_shared_cache_grows_while_threads_rotate():
    """8 threads share a RopeCache (ROUNDS fresh caches): results are right, nothing raises or hangs."""
    full = RopeCache(ROTARY_DIM, max_positions=4 * MAX_N).cos_sin
    for _ in range(ROUNDS):
        cache = RopeCache(ROTARY_DIM, max_positions=16)
        barrier = threading.Barrier(N_THREADS)
        failures: list = []
        threads = [
            threading.Thread(target=_work, args=(t, cache, full, barrier, failures), daemon=True)
            for t in range(N_THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a thread hangs"
        assert not failures, "\n".join(failures[:10])
        assert cache.capacity >= MAX_N // 2


def test_ops_on_shared_inputs_from_threads():
    """Read-only inputs shared by threads (out-of-place calls) and disjoint in-place targets of one
    packed buffer rotated from different threads give the single-threaded results."""
    cs = RopeCache(ROTARY_DIM, max_positions=512).cos_sin
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, HEAD_DIM, generator=gen)
    positions = torch.randint(0, 512, (64, 1), generator=gen)
    want = rope_ext.apply_rotary(x, positions, cs)
    packed = x.clone()
    failures: list = []

    def work(tid: int) -> None:
        try:
            for _ in range(20):
                if not torch.equal(rope_ext.apply_rotary(x, positions, cs), want):
                    failures.append(f"thread {tid}: out-of-place result differs")
            # each thread rotates its own head of the shared buffer, in place, once
            rope_ext.apply_rotary_qk_(packed[:, tid : tid + 1], None, positions, cs)
        except BaseException as e:  # noqa: BLE001
            failures.append(f"thread {tid}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not failures, "\n".join(failures[:10])
    assert torch.equal(packed, want)


def test_dynamic_scaling_cache_rebuilt_while_threads_rotate():
    """A ``dynamic`` (NTK) cache rebuilds every row as the length grows: each table a thread gets is whole
    (cos^2 + sin^2 = 1, at least the rows asked for) and rotating with it matches a single-threaded call."""
    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64}
    cache = RopeCache(ROTARY_DIM, max_positions=64, scaling=scaling)
    barrier = threading.Barrier(N_THREADS)
    failures: list = []
    tables: list = []
    h = ROTARY_DIM // 2

    def work(tid: int) -> None:
        gen = torch.Generator().manual_seed(tid)
        try:
            barrier.wait()
            for it in range(40):
                n = 64 + 50 * it * (tid + 1)
                cs = cache.ensure(n).cos_sin_on("cpu")
                if cs.shape[0] < n:
                    failures.append(f"thread {tid}: {cs.shape[0]} rows after ensure({n})")
                if (cs[:, :h].double() ** 2 + cs[:, h:].double() ** 2 - 1).abs().max() > 1e-6:
                    failures.append(f"thread {tid}: a table with cos^2 + sin^2 != 1")
                positions = torch.randint(0, n, (8, 1), generator=gen)
                x = torch.randn(8, 2, HEAD_DIM, generator=gen)
                tables.append((x, positions, cs, rope_ext.apply_rotary(x, positions, cs)))
        except BaseException as e:  # noqa: BLE001
            failures.append(f"thread {tid}: {type(e).__name__}: {e}")
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not failures, "\n".join(failures[:10])
    for x, positions, cs, got in tables:
        assert torch.equal(got, rope_ext.apply_rotary(x, positions, cs))

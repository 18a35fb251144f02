"""Regression tests for four latent bugs, each of which made its test fail before the fix:

1. ``RopeCache.cos_sin_on`` published a grown table before its version: a reader in between got the old,
   smaller per-device copy although ``ensure`` had already answered yes.
2. Whether an output needs the pass-through features copied was guessed from pointer equality, once for
   the whole CUDA launch from q: with ``q_out is q`` but a separate ``k_out``, k_out's features past
   rotary_dim were never written.
3. (tests/test_layers.py) The AVX2 translation unit emitted AVX2/FMA copies of shared inline functions
   that the linker could pick for the portable path.
4. head_dim was narrowed to 32 bits without a range check.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from _helpers import assert_close_to_reference, make_cos_sin, requires_emulation

import rope_ext
from rope_ext import reference

# 1. The cache publishes a table and its version together ----------------------------------------------


class _HookedCache(rope_ext.RopeCache):
    """Runs `hook` right after every attribute assignment: inside any window between two of them."""

    hook = None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if self.hook is not None:
            self.hook()


def test_cos_sin_on_never_returns_a_copy_smaller_than_the_cache():
    cache = _HookedCache(8, max_positions=4)
    cache.cos_sin_on("meta")  # a per-device copy of the first table
    seen: list[tuple[int, int]] = []

    def reader():
        # What a server thread does: the cache already holds n rows, so ensure/reserve take the fast path,
        # then it fetches the table for its device.
        n = cache.capacity
        cache.reserve(n)
        seen.append((n, cache.cos_sin_on("meta").shape[0]))

    def between_assignments():
        t = threading.Thread(target=reader)
        t.start()
        # A reader that takes the lock waits for the writer: it is checked once the writer is done.
        t.join(timeout=0.2)
        pending.append(t)

    pending: list[threading.Thread] = []
    cache.hook = between_assignments
    for n in (5, 9, 17, 40, 100):
        cache.ensure(n)
    cache.hook = None
    for t in pending:
        t.join()
    assert len(seen) == len(pending) > 0
    bad = [(n, rows) for n, rows in seen if rows < n]
    assert not bad, f"cos_sin_on returned fewer rows than the cache had: (capacity, rows) {bad}"


def test_cos_sin_on_after_ensure_has_the_rows_under_thread_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        cache = rope_ext.RopeCache(4, max_positions=1)
        errors: list[str] = []

        def worker(start: int) -> None:
            for n in range(start, 3000, 7):
                cache.ensure(n)
                rows = cache.cos_sin_on("meta").shape[0]
                if rows < n:
                    errors.append(f"ensure({n}) then {rows} rows")

        threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:5]


# 2. Pass-through copy decided per tensor ---------------------------------------------------------------


@requires_emulation
@pytest.mark.parametrize("num_sms,scalar", [(1, False), (100_000, False), (4, True)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_emulated_kernel_copies_pass_through_of_a_separate_k_out(num_sms, scalar, interleaved):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 4, 64, generator=g), torch.randn(6, 2, 64, generator=g)
    positions = torch.randint(0, 50, (6, 1), generator=g)
    cs = make_cos_sin(50, 32)
    q_ref = reference.rotary_hadamard(q, positions, cs, interleaved=interleaved)
    k_ref = reference.rotary_hadamard(k, positions, cs, interleaved=interleaved)
    k_out = torch.full_like(k, float("nan"))
    torch.ops.rope_ext._cuda_emulated(q, k, q, k_out, positions, cs, interleaved, False, num_sms, scalar)
    assert torch.equal(k_out[..., 32:], k[..., 32:]), "k_out's pass-through features were not copied"
    assert_close_to_reference(k_out, k_ref, k.abs().max().item())
    assert_close_to_reference(q, q_ref, q.abs().max().item())


@requires_emulation
def test_emulated_kernel_in_place_k_with_separate_q_out():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 2, 48, generator=g), torch.randn(3, 5, 48, generator=g)
    positions = torch.arange(3)[:, None]
    cs = make_cos_sin(3, 16)
    k_before = k.clone()
    q_out = torch.full_like(q, float("nan"))
    torch.ops.rope_ext._cuda_emulated(q, k, q_out, k, positions, cs, False, False, 1, False)
    assert torch.equal(q_out[..., 16:], q[..., 16:])
    assert torch.equal(k[..., 16:], k_before[..., 16:])
    assert_close_to_reference(k, reference.rotary_hadamard(k_before, positions, cs), 5.0)


# 4. head_dim range --------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [2**31 + 2, 2**29 + 2])
def test_head_dim_past_the_kernel_range_is_rejected(head_dim):
    # 2**31 + 2 wrapped to a negative int; both are past rope::kMaxHeadDim = 2**29. The pages of the
    # bfloat16 buffer (1-4 GiB) are never touched: the call must fail before reading or writing any.
    base = torch.empty(head_dim, dtype=torch.bfloat16)
    x = base[None].expand(2, head_dim)  # [2, head_dim], an expanded view
    cs = torch.ones(4, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(head_dim\) must be at most 536870912"):
        rope_ext.apply_rotary(x, torch.zeros(2, dtype=torch.int64), cs)

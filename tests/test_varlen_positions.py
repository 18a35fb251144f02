"""rope_ext.varlen_positions against TransformerEngine's THD semantics, without TransformerEngine.

The reference below ports TE's unfused ``apply_rotary_pos_emb(t, freqs, tensor_format="thd",
cu_seqlens=..., start_positions=..., cp_size=..., cp_rank=...)`` to float64: a Python loop over the
sequences of ``cu_seqlens // cp_size`` that rotates each one with the freqs (angles) of its positions,
``freqs[start_positions[b]:]`` cut to this context-parallel rank's two half-chunks (TE's
``_get_freqs_on_this_cp_rank``: chunks ``r`` and ``2 cp_size - 1 - r`` of the full padded sequence).
``rope_ext.apply_rotary(x, varlen_positions(...)[:, None], cos_sin)`` must match it within the
project's accuracy contract, and the positions themselves (the same loop run on ``freqs = arange``)
must match exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from _helpers import HAS_CUDA, assert_close_to_reference
from hypothesis import given, settings
from hypothesis import strategies as st

import rope_ext
from rope_ext.reference import cos_sin_table, inv_freq, rotary_hadamard

N_POS = 2048  # table rows: every start_position + full padded length below stays inside
ROTARY_DIM = 16
HEAD_DIM = 20  # partial rotary: the last 4 features pass through
HEADS = 3
COS_SIN64 = cos_sin_table(N_POS, ROTARY_DIM)
COS_SIN = COS_SIN64.float()


# ---------------------------------------------------------------------------------------------
# The float64 port of TransformerEngine's unfused THD rotation (transformer_engine/pytorch/...
# /rope.py: RotaryPositionEmbedding, _rotate_half, _apply_rotary_pos_emb_base,
# _get_freqs_on_this_cp_rank, apply_rotary_pos_emb(tensor_format="thd")).


def te_freqs(n: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """TE's RotaryPositionEmbedding output, float64 ``[n, 1, 1, rotary_dim]``: the angle of every pair,
    duplicated (``cat((f, f))``, or ``stack((f, f), -1)`` when interleaved)."""
    f = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq(rotary_dim)[None, :]
    emb = torch.stack([f, f], dim=-1).flatten(-2) if interleaved else torch.cat([f, f], dim=-1)
    return emb[:, None, None, :]


def te_rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def te_apply_base(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``_apply_rotary_pos_emb_base`` for sbhd ``t [s, 1, h, d]``, freqs ``[s2 >= s, 1, 1, d2]``."""
    freqs = freqs[: t.shape[0]]
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = t * torch.cos(freqs) + te_rotate_half(t, interleaved) * torch.sin(freqs)
    return torch.cat((t, t_pass), dim=-1)


def te_freqs_on_cp_rank(freqs: torch.Tensor, seqlen: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``_get_freqs_on_this_cp_rank``; ``seqlen`` is the sequence's length on this rank."""
    if cp_size > 1:
        cp_seg = seqlen // 2
        full_seqlen = cp_size * seqlen
        return torch.cat(
            [
                freqs[cp_rank * cp_seg : (cp_rank + 1) * cp_seg],
                freqs[full_seqlen - (cp_rank + 1) * cp_seg : full_seqlen - cp_rank * cp_seg],
            ]
        )
    return freqs[:seqlen]


def te_apply_thd(t, freqs, cu_seqlens, start_positions=None, cp_size=1, cp_rank=0, interleaved=False):
    """``apply_rotary_pos_emb(t, freqs, "thd", start_positions, interleaved, cu_seqlens=cu_seqlens,
    cp_size=cp_size, cp_rank=cp_rank)`` unfused, in float64. ``t`` is this rank's ``[T, H, D]``."""
    cu = cu_seqlens.cpu().long() // cp_size
    seqlens = (cu[1:] - cu[:-1]).tolist()
    t = t.cpu().double()
    out = [torch.empty(0, *t.shape[1:], dtype=torch.float64)]
    for idx, x in enumerate(torch.split(t, seqlens)):
        f = freqs if start_positions is None else freqs[int(start_positions[idx]) :]
        f = te_freqs_on_cp_rank(f, x.shape[0], cp_size, cp_rank)
        out.append(te_apply_base(x.unsqueeze(1), f, interleaved).squeeze(1))
    return torch.cat(out)


def te_positions(cu_seqlens, start_positions=None, cp_size=1, cp_rank=0) -> list[int]:
    """The position TE gives every token of this rank: the same loop, run on ``freqs = arange``."""
    cu = cu_seqlens.cpu().long() // cp_size
    ar = torch.arange(N_POS, dtype=torch.float64)
    out: list[int] = []
    for b in range(cu.shape[0] - 1):
        seqlen = int(cu[b + 1] - cu[b])
        f = ar if start_positions is None else ar[int(start_positions[b]) :]
        out += te_freqs_on_cp_rank(f, seqlen, cp_size, cp_rank)[:seqlen].long().tolist()
    return out


def rank_token_indices(lengths: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Global token indices, in the packed order of this rank's tokens: for every sequence, chunk r then
    chunk 2 cp_size - 1 - r of its ``2 cp_size`` equal chunks (every token when cp_size == 1)."""
    if cp_size == 1:
        return list(range(sum(lengths)))
    out: list[int] = []
    start = 0
    for n in lengths:
        c = n // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out += range(start + chunk * c, start + (chunk + 1) * c)
        start += n
    return out


def cu_of(lengths, dtype=torch.int32, device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype, device=device)


def rotate(x, positions, interleaved=False):
    return rope_ext.apply_rotary(
        x, positions[:, None], COS_SIN.to(x.device), interleaved=interleaved
    )  # [T, H, D]


def assert_close(out, ref, x):
    """The accuracy contract (``assert_close_to_reference``); empty results only need the shape."""
    assert out.shape == ref.shape
    if out.numel():
        assert_close_to_reference(out.cpu(), ref, x.abs().max().item())


def check_rotation(x, positions, ref, interleaved=False):
    assert_close(rotate(x, positions, interleaved), ref, x)
    # The project's own float64 reference, given the same positions, agrees with TE's formula.
    if x.numel():
        ours = rotary_hadamard(x.cpu(), positions.cpu()[:, None], COS_SIN64, interleaved=interleaved)
        assert (ours - ref).abs().max().item() <= 1e-12 * x.abs().max().item()


PACKINGS = {
    "single": [13],
    "packed": [5, 1, 9, 3, 7],
    "empty_first": [0, 4, 6],
    "empty_middle": [3, 0, 0, 5],
    "empty_last": [2, 7, 0],
    "all_empty": [0, 0, 0],
    "no_sequence": [],
    "long": [1000, 17, 500],
}


# ---------------------------------------------------------------------------------------------
# cp_size == 1: packed sequences.


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_packed_matches_te(device, packing, interleaved):
    lengths = PACKINGS[packing]
    cu = cu_of(lengths, device=device)
    total = sum(lengths)
    x = torch.randn(total, HEADS, HEAD_DIM, device=device)
    pos = rope_ext.varlen_positions(cu, total_tokens=total)
    assert pos.dtype == torch.int32 and pos.device == cu.device and pos.shape == (total,)
    assert pos.cpu().tolist() == te_positions(cu)
    ref = te_apply_thd(x, te_freqs(N_POS, ROTARY_DIM, interleaved), cu, interleaved=interleaved)
    check_rotation(x, pos, ref, interleaved)


def test_single_sequence_is_arange(device):
    cu = torch.tensor([0, 37], device=device)
    assert torch.equal(rope_ext.varlen_positions(cu).cpu(), torch.arange(37, dtype=torch.int32))


@pytest.mark.parametrize("packing", ["single", "packed", "empty_middle", "long"])
def test_start_positions_match_te(device, packing):
    lengths = PACKINGS[packing]
    cu = cu_of(lengths, device=device)
    total = sum(lengths)
    start = torch.randint(0, 400, (len(lengths),), device=device)
    x = torch.randn(total, HEADS, HEAD_DIM, device=device)
    pos = rope_ext.varlen_positions(cu, total_tokens=total, start_positions=start)
    expect = [int(start[b]) + i for b, n in enumerate(lengths) for i in range(n)]
    assert pos.cpu().tolist() == expect == te_positions(cu, start)
    ref = te_apply_thd(x, te_freqs(N_POS, ROTARY_DIM, False), cu, start_positions=start)
    check_rotation(x, pos, ref)


def test_decode_continuation(device):
    """One new token per sequence after prefixes of 5, 0 and 11 tokens: positions are the prefix lengths."""
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=device)
    cache_lens = torch.tensor([5, 0, 11], dtype=torch.int32, device=device)
    pos = rope_ext.varlen_positions(cu, total_tokens=3, start_positions=cache_lens)
    assert pos.cpu().tolist() == [5, 0, 11]


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("start_dtype", [None, torch.int32, torch.int64])
def test_dtypes(device, cu_dtype, out_dtype, start_dtype):
    lengths = [4, 0, 9, 2]
    cu = cu_of(lengths, dtype=cu_dtype, device=device)
    start = None if start_dtype is None else torch.tensor([1, 2, 3, 4], dtype=start_dtype, device=device)
    pos = rope_ext.varlen_positions(cu, start_positions=start, dtype=out_dtype)
    assert pos.dtype == out_dtype and pos.device == cu.device
    assert pos.cpu().tolist() == te_positions(cu, start)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("with_start", [False, True])
def test_total_tokens_given_or_not(device, cp_size, with_start):
    lengths = [8 * cp_size, 0, 2 * cp_size, 6 * cp_size]
    cu = cu_of(lengths, device=device)
    start = torch.tensor([3, 1, 4, 1], device=device) if with_start else None
    for rank in range(cp_size):
        a = rope_ext.varlen_positions(cu, start_positions=start, cp_size=cp_size, cp_rank=rank)
        b = rope_ext.varlen_positions(
            cu, total_tokens=sum(lengths) // cp_size, start_positions=start, cp_size=cp_size, cp_rank=rank
        )
        assert torch.equal(a, b) and a.shape == (sum(lengths) // cp_size,)


def test_strided_cu_seqlens():
    cu = torch.tensor([0, 99, 3, 99, 3, 99, 10])[::2]  # [0, 3, 3, 10], not contiguous
    assert rope_ext.varlen_positions(cu).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------------------------
# Context parallelism: TE's load-balanced layout (chunks r and 2 cp_size - 1 - r of every sequence).

CP_PACKINGS = {
    "single": [1],
    "packed": [3, 1, 0, 5, 2],
    "empty_first": [0, 2, 1],
    "long": [64, 3, 0, 32],
}


def _cp_case(packing, cp_size, device):
    lengths = [n * 2 * cp_size for n in CP_PACKINGS[packing]]  # padded lengths, multiples of 2 cp_size
    return lengths, cu_of(lengths, device=device)


@pytest.mark.parametrize("with_start", [False, True], ids=["no_start", "start"])
@pytest.mark.parametrize("packing", list(CP_PACKINGS))
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_rank_matches_te(device, cp_size, packing, with_start):
    """Each rank's tokens, rotated with varlen_positions, equal TE's CP rotation of that rank's tokens."""
    lengths, cu = _cp_case(packing, cp_size, device)
    start = torch.randint(0, 300, (len(lengths),), device=device) if with_start else None
    full_x = torch.randn(sum(lengths), HEADS, HEAD_DIM, device=device)
    freqs = te_freqs(N_POS, ROTARY_DIM, False)
    for rank in range(cp_size):
        idx = rank_token_indices(lengths, cp_size, rank)
        x = full_x[torch.tensor(idx, dtype=torch.long, device=device)]
        pos = rope_ext.varlen_positions(
            cu, total_tokens=len(idx), start_positions=start, cp_size=cp_size, cp_rank=rank
        )
        assert pos.shape == (sum(lengths) // cp_size,) == (len(idx),)
        assert pos.cpu().tolist() == te_positions(cu, start, cp_size, rank)
        ref = te_apply_thd(x, freqs, cu, start_positions=start, cp_size=cp_size, cp_rank=rank)
        check_rotation(x, pos, ref)


@pytest.mark.parametrize("with_start", [False, True], ids=["no_start", "start"])
@pytest.mark.parametrize("packing", list(CP_PACKINGS))
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_ranks_gather_to_full_rotation(device, cp_size, packing, with_start):
    """Every rank rotates its local tokens; placed back at their global indices, the ranks' results
    cover every token once and equal the rotation of the whole packed batch (cp_size == 1)."""
    lengths, cu = _cp_case(packing, cp_size, device)
    total = sum(lengths)
    start = torch.randint(0, 300, (len(lengths),), device=device) if with_start else None
    full_x = torch.randn(total, HEADS, HEAD_DIM, device=device)
    gathered = torch.full((total, HEADS, HEAD_DIM), float("nan"), device=device)
    gathered_pos = torch.full((total,), -1, dtype=torch.int32, device=device)
    for rank in range(cp_size):
        idx = torch.tensor(rank_token_indices(lengths, cp_size, rank), dtype=torch.long, device=device)
        pos = rope_ext.varlen_positions(
            cu, total_tokens=idx.numel(), start_positions=start, cp_size=cp_size, cp_rank=rank
        )
        assert bool((gathered_pos[idx] == -1).all()), "two ranks hold the same token"
        gathered_pos[idx] = pos
        gathered[idx] = rotate(full_x[idx], pos)
    full_pos = rope_ext.varlen_positions(cu, total_tokens=total, start_positions=start)
    assert torch.equal(gathered_pos, full_pos)
    ref = te_apply_thd(full_x, te_freqs(N_POS, ROTARY_DIM, False), cu, start_positions=start)
    assert_close(gathered, ref, full_x)


# ---------------------------------------------------------------------------------------------
# Random packings.


@st.composite
def packings(draw):
    cp_size = draw(st.sampled_from([1, 2, 4]))
    unit = 2 * cp_size if cp_size > 1 else 1
    lengths = [n * unit for n in draw(st.lists(st.integers(0, 12), max_size=8))]
    cp_rank = draw(st.integers(0, cp_size - 1))
    starts = draw(st.none() | st.lists(st.integers(0, 500), min_size=len(lengths), max_size=len(lengths)))
    cu_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    out_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    give_total = draw(st.booleans())
    return lengths, cp_size, cp_rank, starts, cu_dtype, out_dtype, give_total


@settings(max_examples=50, deadline=None)
@given(case=packings(), seed=st.integers(0, 2**31 - 1))
def test_random_packings(case, seed):
    lengths, cp_size, cp_rank, starts, cu_dtype, out_dtype, give_total = case
    cu = cu_of(lengths, dtype=cu_dtype)
    start = None if starts is None else torch.tensor(starts, dtype=cu_dtype)
    local = sum(lengths) // cp_size
    kw = dict(start_positions=start, cp_size=cp_size, dtype=out_dtype)
    pos = rope_ext.varlen_positions(cu, total_tokens=local if give_total else None, cp_rank=cp_rank, **kw)
    assert pos.dtype == out_dtype and pos.shape == (local,)
    assert pos.tolist() == te_positions(cu, start, cp_size, cp_rank)
    # This rank's tokens rotated as TE would.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(local, 2, HEAD_DIM, generator=gen)
    ref = te_apply_thd(x, te_freqs(N_POS, ROTARY_DIM, False), cu, start, cp_size, cp_rank)
    assert_close(rotate(x, pos), ref, x)
    # All ranks together: the full packed batch's positions at the global token indices.
    gathered = torch.full((sum(lengths),), -1, dtype=torch.int64)
    for r in range(cp_size):
        idx = torch.tensor(rank_token_indices(lengths, cp_size, r), dtype=torch.long)
        gathered[idx] = rope_ext.varlen_positions(cu, total_tokens=local, cp_rank=r, **kw).long()
    assert gathered.tolist() == te_positions(cu, start)


# ---------------------------------------------------------------------------------------------
# Errors.

CU = torch.tensor([0, 4, 4, 12], dtype=torch.int32)  # valid for cp_size 1 and 2


def _bad_inputs():
    yield "cu not a tensor", TypeError, "cu_seqlens", dict(cu_seqlens=[0, 4, 4, 12])
    yield "cu 2-D", ValueError, "cu_seqlens must be 1-D", dict(cu_seqlens=CU[None])
    yield "cu 0-D", ValueError, "cu_seqlens must be 1-D", dict(cu_seqlens=CU[0])
    yield "cu empty", ValueError, "cu_seqlens must be 1-D", dict(cu_seqlens=CU[:0])
    yield "cu float", TypeError, "cu_seqlens must have an integer dtype", dict(cu_seqlens=CU.float())
    yield "cu bool", TypeError, "cu_seqlens must have an integer dtype", dict(cu_seqlens=CU.bool())
    yield (
        "cu decreasing",
        ValueError,
        "cu_seqlens must be non-decreasing",
        dict(cu_seqlens=torch.tensor([0, 5, 3, 8])),
    )
    yield "cu not from 0", ValueError, "cu_seqlens must start at 0", dict(cu_seqlens=torch.tensor([2, 5, 8]))
    yield (
        "cu unpadded",
        ValueError,
        r"cu_seqlens must hold padded lengths, multiples of 2 \* cp_size = 4",
        dict(cu_seqlens=torch.tensor([0, 4, 6, 10]), cp_size=2),
    )
    yield "cp_size 0", ValueError, "cp_size must be >= 1", dict(cp_size=0)
    yield "cp_size float", TypeError, "cp_size must be an int", dict(cp_size=2.0)
    yield "cp_size bool", TypeError, "cp_size must be an int", dict(cp_size=True)
    yield "cp_rank negative", ValueError, "cp_rank must be >= 0", dict(cp_size=2, cp_rank=-1)
    yield (
        "cp_rank too big",
        ValueError,
        r"cp_rank must be in \[0, cp_size\) = \[0, 2\)",
        dict(cp_size=2, cp_rank=2),
    )
    yield "cp_rank not int", TypeError, "cp_rank must be an int", dict(cp_rank=torch.tensor(0))
    yield "start list", TypeError, "start_positions must be a torch.Tensor", dict(start_positions=[0, 0, 0])
    yield (
        "start short",
        ValueError,
        r"start_positions must have shape \[batch\] = \[3\]",
        dict(start_positions=torch.zeros(2, dtype=torch.int32)),
    )
    yield (
        "start 2-D",
        ValueError,
        r"start_positions must have shape \[batch\] = \[3\]",
        dict(start_positions=torch.zeros(3, 1, dtype=torch.int32)),
    )
    yield (
        "start float",
        TypeError,
        "start_positions must have an integer dtype",
        dict(start_positions=torch.zeros(3)),
    )
    yield (
        "start other device",
        ValueError,
        "start_positions must be on the device of cu_seqlens",
        dict(start_positions=torch.zeros(3, dtype=torch.int32, device="meta")),
    )
    yield (
        "total_tokens wrong",
        ValueError,
        r"total_tokens must equal cu_seqlens\[-1\] = 12, got 11",
        dict(total_tokens=11),
    )
    yield (
        "total_tokens full with cp",
        ValueError,
        r"total_tokens must equal cu_seqlens\[-1\] / cp_size",
        dict(total_tokens=12, cp_size=2),
    )
    yield "total_tokens negative", ValueError, "total_tokens must be >= 0", dict(total_tokens=-1)
    yield "total_tokens float", TypeError, "total_tokens must be an int", dict(total_tokens=12.0)
    yield "total_tokens tensor", TypeError, "total_tokens must be an int", dict(total_tokens=torch.tensor(12))
    yield "dtype float", ValueError, "dtype must be torch.int32 or torch.int64", dict(dtype=torch.float32)
    yield "dtype int16", ValueError, "dtype must be torch.int32 or torch.int64", dict(dtype=torch.int16)


BAD = list(_bad_inputs())


@pytest.mark.parametrize("exc,match,kwargs", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(exc, match, kwargs):
    kwargs = dict(kwargs)
    cu = kwargs.pop("cu_seqlens", CU)
    with pytest.raises(exc, match=match):
        rope_ext.varlen_positions(cu, **kwargs)


def test_good_cp_input_accepted():
    # The CU of the error cases is valid for cp_size 2: the errors above come from the bad argument.
    assert rope_ext.varlen_positions(CU, total_tokens=6, cp_size=2, cp_rank=1).tolist() == [1, 2, 2, 3, 4, 5]


# ---------------------------------------------------------------------------------------------
# torch.compile and unchecked input.


def _rotate_packed(x, cu, start, cos_sin):
    pos = rope_ext.varlen_positions(cu, total_tokens=x.shape[0], start_positions=start)
    return rope_ext.apply_rotary(x, pos[:, None], cos_sin)


def _rotate_cp_rank(x, cu, cos_sin):
    pos = rope_ext.varlen_positions(cu, total_tokens=x.shape[0], cp_size=2, cp_rank=1, dtype=torch.int64)
    return rope_ext.apply_rotary(x, pos[:, None], cos_sin)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    packed = torch.compile(_rotate_packed, fullgraph=True, dynamic=dynamic, backend=cnt)
    cp = torch.compile(_rotate_cp_rank, fullgraph=True, dynamic=dynamic)
    for lengths in ([3, 0, 6], [5, 4, 1], [20, 2, 10]):
        cu = cu_of(lengths)
        x = torch.randn(sum(lengths), HEADS, HEAD_DIM)
        start = torch.tensor([7, 0, 30])
        assert torch.equal(packed(x, cu, start, COS_SIN), _rotate_packed(x, cu, start, COS_SIN))
        cu_cp = cu_of([n * 4 for n in lengths])
        x_cp = torch.randn(sum(lengths) * 2, HEADS, HEAD_DIM)
        assert torch.equal(cp(x_cp, cu_cp, COS_SIN), _rotate_cp_rank(x_cp, cu_cp, COS_SIN))
    if dynamic:
        assert cnt.frame_count == 1, "recompiled for a new total_tokens"


def test_unchecked_garbage_stays_in_bounds():
    """Under torch.compile the value checks are skipped: bad cu_seqlens or total_tokens give garbage
    positions of the requested length, never an out-of-bounds read (on the CPU, index_select would
    raise for one)."""
    f = torch.compile(
        lambda cu, start, n: rope_ext.varlen_positions(cu, total_tokens=n, start_positions=start, cp_size=2),
        fullgraph=True,
    )
    cases = [
        (torch.tensor([0, 8, 4]), 6),  # decreasing
        (torch.tensor([3, 8, 12]), 6),  # not from 0
        (torch.tensor([0, 6, 12]), 6),  # unpadded
        (torch.tensor([0, 4, 8]), 40),  # total_tokens past the end
        (torch.tensor([0, -8, 8]), 4),  # negative length
    ]
    for cu, n in cases:
        out = f(cu, torch.tensor([1, 2]), n)
        assert out.shape == (n,) and out.dtype == torch.int32
        with pytest.raises(ValueError):
            rope_ext.varlen_positions(cu, total_tokens=n, start_positions=torch.tensor([1, 2]), cp_size=2)


# ---------------------------------------------------------------------------------------------
# CUDA: no synchronisation, CUDA graphs, opt-in value checks.


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("cp_size", [1, 2])
def test_cuda_no_sync_with_total_tokens(cp_size):
    cu = cu_of([8, 0, 16, 4], device="cuda")
    start = torch.tensor([3, 0, 7, 1], device="cuda")
    expect = [
        rope_ext.varlen_positions(cu.cpu(), start_positions=start.cpu(), cp_size=cp_size, cp_rank=r)
        for r in range(cp_size)
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [
            rope_ext.varlen_positions(
                cu, total_tokens=28 // cp_size, start_positions=start, cp_size=cp_size, cp_rank=r
            )
            for r in range(cp_size)
        ]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for out, ref in zip(outs, expect, strict=True):
        assert out.device == cu.device and torch.equal(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_graph_replay_with_new_packing():
    cu = cu_of([8, 0, 16, 8], device="cuda")
    start = torch.tensor([3, 0, 7, 1], device="cuda")

    def fn():
        return rope_ext.varlen_positions(cu, total_tokens=16, start_positions=start, cp_size=2, cp_rank=1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for lengths, starts in (([8, 0, 16, 8], [3, 0, 7, 1]), ([4, 12, 0, 16], [0, 9, 2, 5])):
        cu.copy_(cu_of(lengths, device="cuda"))
        start.copy_(torch.tensor(starts, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = rope_ext.varlen_positions(cu.cpu(), start_positions=start.cpu(), cp_size=2, cp_rank=1)
        assert torch.equal(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_value_checks_opt_in():
    bad = torch.tensor([0, 8, 4], device="cuda")
    out = rope_ext.varlen_positions(bad, total_tokens=6)  # unchecked: garbage, in bounds
    torch.cuda.synchronize()
    assert out.shape == (6,)
    rope_ext.set_position_checks(True)
    try:
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            rope_ext.varlen_positions(bad, total_tokens=6)
        with pytest.raises(ValueError, match="total_tokens must equal"):
            rope_ext.varlen_positions(torch.tensor([0, 8], device="cuda"), total_tokens=6)
    finally:
        rope_ext.set_position_checks(False)

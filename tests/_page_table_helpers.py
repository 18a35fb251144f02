"""Shared by test_page_table.py: random FlashInfer page tables (:func:`random_table`), the cache ops' calls
with a page table on each backend (:func:`run_gqa`, :func:`run_mla`), the check that such a call writes
what the same call with ``slot_mapping=reference.page_table_slots(...)`` writes, bit for bit
(:func:`assert_table_is_its_slots`), a fixed table with its faults (:data:`FAULTS`) and the property test's
draws (:func:`table_cases`).

A page table places token t at entry ``positions[t]`` of request ``batch_indices[t]``: row ``positions[t] %
block_size`` of page ``kv_indices[kv_indptr[b] + positions[t] // block_size]``. The random tables give each
request a random number of pages (shuffled pages of the cache, so a request's pages are not in order), a
random length (``kv_last_page_len``), and write a random subset of the entries in a random order, with
padding tokens (batch index -1, positions that no table holds) and ``T' <= T``.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, HAS_EMULATION, NO_CUDA, NO_EMULATION, to_device
from _serving_cache_helpers import BACKENDS, FP8, _default_threads, same_bits
from _serving_cache_helpers import build as gqa_build
from _serving_mla_helpers import build as mla_build
from _serving_mla_helpers import outputs as mla_outputs
from hypothesis import strategies as st

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
HAS_EMU = HAS_EMULATION and hasattr(OPS, "_cuda_emulated_cache") and hasattr(OPS, "_cuda_emulated_mla")
I32, I64 = torch.int32, torch.int64
INTS = (I32, I64)
FIELDS = rope_ext.PageTable._fields


def random_table(
    gen: torch.Generator, *, num_blocks: int, block_size: int, T: int, n_req: int = 3, last_len: bool = True,
    n_tokens: int | None = None, pad: float = 0.2, dtypes=None, spare: int = 0,
) -> rope_ext.PageTable:  # fmt: skip
    """A valid page table over a cache of ``num_blocks`` pages of ``block_size`` rows.

    ``n_req`` requests (0: kv_indptr ``[0]``, every token padding) share a random number (half the cache or
    more) of shuffled pages, each with a random length. ``n_tokens`` (default: up to T) tokens, ``pad`` of
    them padding (-1; more when the requests hold fewer entries), the others distinct entries of the
    requests in a random order. ``dtypes``: the five tensors' dtypes (default: each int32 or int64 at
    random); ``last_len=False`` leaves kv_last_page_len None (every row of a request's pages an entry).
    ``spare`` entries of kv_indices past the last request's, pages outside the cache (never read)."""

    def randint(lo: int, hi: int) -> int:  # in [lo, hi]
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    if dtypes is None:
        dtypes = [INTS[randint(0, 1)] for _ in FIELDS]
    n_pages = randint((num_blocks + 1) // 2, num_blocks) if n_req else 0
    pages = torch.randperm(num_blocks, generator=gen)[:n_pages].tolist()
    cuts = sorted(randint(0, n_pages) for _ in range(max(n_req - 1, 0)))
    counts = [b - a for a, b in zip([0, *cuts], [*cuts, n_pages], strict=True)] if n_req else []
    last = [randint(1, block_size) if n and randint(0, 5) else randint(0, block_size) for n in counts]
    lengths = [
        max(n - 1, 0) * block_size + min(lst, block_size * n) if last_len else n * block_size
        for n, lst in zip(counts, last, strict=True)
    ]
    entries = [(b, e) for b, n in enumerate(lengths) for e in range(n)]
    n_tokens = randint(0, T) if n_tokens is None else n_tokens
    n_pad = sum(1 for _ in range(n_tokens) if float(torch.rand((), generator=gen)) < pad)
    chosen = torch.randperm(len(entries), generator=gen)[: n_tokens - n_pad].tolist()
    n_pad = n_tokens - len(chosen)  # more padding where the requests hold fewer entries
    tokens = [entries[i] for i in chosen] + [(-1, randint(-(10**6), 10**6)) for _ in range(n_pad)]
    order = torch.randperm(len(tokens), generator=gen).tolist()
    tokens = [tokens[i] for i in order]
    indptr = torch.tensor([0, *counts]).cumsum(0).tolist()
    indices = pages + [randint(num_blocks, 2**31 - 1) for _ in range(spare)]
    values = ([b for b, _ in tokens], [e for _, e in tokens], indices, indptr, last)
    pt = [torch.tensor(v, dtype=torch.int64).to(d) for v, d in zip(values, dtypes, strict=True)]
    return rope_ext.PageTable(*pt[:4], pt[4] if last_len else None)


def table_list(pt) -> list[torch.Tensor]:
    """The op's ``page_table`` argument: the tensors, no kv_last_page_len when it is None."""
    return [t for t in pt if t is not None]


def ref_slots(pt, block_size: int, num_blocks: int) -> torch.Tensor:
    return reference.page_table_slots(*pt, block_size=block_size, num_blocks=num_blocks)


def gqa_geometry(a: dict) -> tuple[int, int]:
    """(num_blocks, block_size) of a GQA call's key cache."""
    kc = a["key_cache"]
    return kc.shape[0], kc.shape[1 if a["layout"] == "NHD" else 2]


def _backend(backend):
    spec = BACKENDS[backend] if isinstance(backend, str) else backend
    if spec == "cuda" and not HAS_CUDA:
        pytest.skip(NO_CUDA)
    if isinstance(spec, tuple) and not HAS_EMU:
        pytest.skip(NO_EMULATION)
    return spec


def run_gqa(a: dict, backend) -> None:
    """apply_rotary_qk_and_cache_'s call ``a`` (slot_mapping or page_table) on ``backend`` (a BACKENDS key or
    (num_sms, force_scalar)): the API on the CPU or on CUDA, or the emulated CUDA body."""
    spec = _backend(backend)
    if spec is None:
        with _default_threads():
            rope_ext.apply_rotary_qk_and_cache_(**a)
    elif spec == "cuda":
        moved, write_back = to_device(a, "cuda")
        if moved.get("page_table") is not None:
            moved["page_table"] = to_device(list(a["page_table"]), "cuda")[0]
        rope_ext.apply_rotary_qk_and_cache_(**moved)
        write_back()
    else:
        pt = a.get("page_table")
        OPS._cuda_emulated_cache(
            a["q"], a["k"], a["v"], a["positions"], a["cos_sin"], a["key_cache"], a["value_cache"],
            a.get("slot_mapping"), a["k_scale"], a["v_scale"], a["q_out"], a["q_scale"], a["interleaved"],
            a["layout"], *spec, a["rotary_offset"], page_table=None if pt is None else table_list(pt),
        )  # fmt: skip


def run_mla(a: dict, backend) -> None:
    """As :func:`run_gqa`, for apply_mla_rotary_and_cache_."""
    spec = _backend(backend)
    if spec is None:
        with _default_threads():
            rope_ext.apply_mla_rotary_and_cache_(**a)
    elif spec == "cuda":
        moved, write_back = to_device(a, "cuda")
        if moved.get("page_table") is not None:
            moved["page_table"] = to_device(list(a["page_table"]), "cuda")[0]
        rope_ext.apply_mla_rotary_and_cache_(**moved)
        write_back()
    else:
        pt = a.get("page_table")
        OPS._cuda_emulated_mla(
            a["q"], a["kv_c"], a["k_pe"], a["positions"], a["cos_sin"], a["kv_cache"], a.get("slot_mapping"),
            a["kv_scale"], a["q_out"], a["q_scale"], a["interleaved"], a["rotary_offset"], *spec,
            page_table=None if pt is None else table_list(pt),
        )  # fmt: skip


def gqa_outputs(c) -> list[torch.Tensor]:
    """Everything apply_rotary_qk_and_cache_ may write (the caches' guard-filled bases) and v."""
    return [c.q, c.k, c.v, c.kc_base, c.vc_base] + ([] if c.q_out is None else [c.q_out])


def assert_table_is_its_slots(make, pt, backend, mla: bool = False) -> tuple:
    """``make()`` builds a case (the same tensors on each call). The call with ``page_table=pt`` writes, bit
    for bit, what the call with the reference's slots writes, on ``backend``; the table is not written.
    Returns (case run with the table, its slots)."""
    run, outputs = (run_mla, mla_outputs) if mla else (run_gqa, gqa_outputs)
    c_pt, c_sl = make(), make()
    geometry = (c_pt.kv_cache.shape[0], c_pt.kv_cache.shape[1]) if mla else gqa_geometry(c_pt.args())
    slots = ref_slots(pt, geometry[1], geometry[0])
    assert slots.shape == pt.batch_indices.shape
    table0 = [t.clone() for t in table_list(pt)]
    before = [t.clone() for t in outputs(c_pt)]
    run({**c_pt.args(), "slot_mapping": None, "page_table": pt}, backend)
    run({**c_sl.args(), "slot_mapping": slots}, backend)
    for i, (got, want) in enumerate(zip(outputs(c_pt), outputs(c_sl), strict=True)):
        assert same_bits(got, want), f"output {i}: page_table and its slot mapping differ"
    for t, t0 in zip(table_list(pt), table0, strict=True):
        assert same_bits(t, t0), "the page table changed"
    if bool((slots >= 0).any()):  # the comparison is not vacuous: a cache was written
        cache = 2 if mla else 3  # kv_cache's base; key_cache's
        assert not same_bits(outputs(c_pt)[cache], before[cache]), "nothing written"
    return c_pt, slots


# ---------------------------------------------------------------------------------------------------------
# A fixed table and its faults (test_page_table.py: refused on the CPU, skipped by the CUDA body).

# Request 0: pages [3, 5], 6 entries; request 1: pages [1, 0, 2], 9 entries. A cache of 6 pages of 4 rows.
BASE = dict(
    batch_indices=[0, 0, 0, 0, 1, 1, 1, 1, 1, 1], positions=[2, 3, 4, 5, 3, 4, 5, 6, 7, 8],
    kv_indices=[3, 5, 1, 0, 2], kv_indptr=[0, 2, 5], kv_last_page_len=[2, 1],
)  # fmt: skip
BASE_SLOTS = [14, 15, 20, 21, 7, 0, 1, 2, 3, 8]
BASE_DTYPES = dict(zip(FIELDS, (I32, I64, I32, I64, I32), strict=True))  # a mix; int64 where a value needs it
NB, BS, T_BAD = 6, 4, 10


def base_table(changes=(), last_len=True) -> rope_ext.PageTable:
    """BASE with ``changes`` ((field, index, value), ...): its tensors of BASE_DTYPES, int64 where a value
    needs it; kv_last_page_len None unless ``last_len``."""
    values = {n: list(v) for n, v in BASE.items()}
    dtypes = dict(BASE_DTYPES)
    for field, i, value in changes:
        values[field][i] = value
        if not -(2**31) <= value < 2**31:
            dtypes[field] = I64
    tensors = [torch.tensor(values[n], dtype=dtypes[n]) for n in FIELDS]
    return rope_ext.PageTable(*tensors[:4], tensors[4] if last_len else None)


IE, VE = IndexError, ValueError
R0, R1 = [0, 1, 2, 3], [4, 5, 6, 7, 8, 9]  # the tokens of request 0, of request 1
LAST = r", the last holding kv_last_page_len = {}\)"
OUTSIDE = r"positions\[1\] = {} is outside request 0 \(2 pages of 4 rows" + LAST.format(2)
BIG = 2**63 - 1
# (id, changes (field, index, value), with kv_last_page_len, exception of the CPU op, message, the tokens
# the table no longer places)
FAULTS = [
    ("batch-batch_size", [("batch_indices", 3, 2)], True, IE,
     r"page_table's batch_indices\[3\] = 2 must be -1 or in \[0, batch_size\) = \[0, 2\)", [3]),
    ("batch-minus-2", [("batch_indices", 3, -2)], True, IE, r"batch_indices\[3\] = -2 must be -1", [3]),
    ("batch-2^31-1", [("batch_indices", 3, 2**31 - 1)], True, IE,
     r"batch_indices\[3\] = 2147483647 must", [3]),
    ("batch-2^63-1", [("batch_indices", 3, BIG)], True, IE, rf"batch_indices\[3\] = {BIG} must", [3]),
    ("batch-int64-min", [("batch_indices", 0, -BIG - 1)], False, IE,
     rf"batch_indices\[0\] = {-BIG - 1} must", [0]),
    ("position-minus-1", [("positions", 1, -1)], True, IE, OUTSIDE.format(-1), [1]),
    ("position-past-length", [("positions", 1, 6)], True, IE, OUTSIDE.format(6), [1]),
    ("position-past-pages", [("positions", 1, 8)], False, IE,
     r"positions\[1\] = 8 is outside request 0 \(2 pages of 4 rows\)$", [1]),
    ("position-2^63-1", [("positions", 1, BIG)], True, IE, OUTSIDE.format(BIG), [1]),
    ("position-int64-min", [("positions", 1, -BIG - 1)], False, IE, rf"positions\[1\] = {-BIG - 1} is", [1]),
    ("no-pages", [("kv_indptr", 2, 2), ("positions", 4, 0)], True, IE,
     r"positions\[4\] = 0 is outside request 1 \(0 pages of 4 rows" + LAST.format(1), R1),
    ("last-len-0", [("kv_last_page_len", 0, 0)], True, IE,
     r"positions\[2\] = 4 is outside request 0 \(2 pages of 4 rows" + LAST.format(0), [2, 3]),
    ("indptr-decreasing", [("kv_indptr", 2, 1)], True, IE,
     r"page_table's kv_indptr\[1\], kv_indptr\[2\] = 2, 1 \(the pages of request 1, token 4\) must be in "
     r"order within \[0, kv_indices.numel\(\)\] = \[0, 5\]", R1),
    ("indptr-past-indices", [("kv_indptr", 2, 6)], True, IE, r"kv_indptr\[1\], kv_indptr\[2\] = 2, 6 ", R1),
    ("indptr-negative", [("kv_indptr", 0, -1)], False, IE,
     r"kv_indptr\[0\], kv_indptr\[1\] = -1, 2 \(the pages of request 0, token 0\)", R0),
    ("indptr-2^63-1", [("kv_indptr", 2, BIG)], True, IE, rf"kv_indptr\[1\], kv_indptr\[2\] = 2, {BIG} ", R1),
    ("page-negative", [("kv_indices", 1, -1)], True, IE,
     r"page_table's kv_indices\[1\] = -1 \(token 2\) must be a page of the cache, in \[0, num_blocks\) = "
     r"\[0, 6\)", [2, 3]),
    ("page-num_blocks", [("kv_indices", 4, 6)], True, IE, r"kv_indices\[4\] = 6 \(token 9\)", [9]),
    ("page-2^31-1", [("kv_indices", 0, 2**31 - 1)], False, IE,
     r"kv_indices\[0\] = 2147483647 \(token 0\)", [0, 1]),
    ("page-2^63-1", [("kv_indices", 2, BIG)], True, IE, rf"kv_indices\[2\] = {BIG} \(token 4\)", [4]),
    ("last-len-past-page", [("kv_last_page_len", 1, 5)], True, VE,
     r"page_table's kv_last_page_len\[1\] = 5 must be in \[0, page_size\] = \[0, 4\]", R1),
    ("last-len-minus-1", [("kv_last_page_len", 0, -1)], True, VE,
     r"kv_last_page_len\[0\] = -1 must be in", R0),
]  # fmt: skip
# Two tokens on one slot: refused on the CPU; a data race on the CUDA body.
TWICE = [
    ("slot-twice", [("positions", 1, 2)], True, VE, r"page_table holds slot 14 twice \(tokens 0 and 1\)"),
    ("page-shared", [("kv_indices", 2, 3)], False, VE, r"page_table holds slot 15 twice \(tokens 1 and 4\)"),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The property test's draws.


@st.composite
def table_cases(draw):
    """(mla, dtype, the build options, random_table's options, the table's seed, backend): a GQA or MLA call
    of a random shape, cache dtype and q_out, a random table, on the CPU op or the CUDA body (drawn grid and
    path)."""
    mla = draw(st.booleans())
    bs = draw(st.sampled_from([1, 2, 3, 4, 16]))
    T = draw(st.integers(0, 24))
    common = dict(
        T=T, block_size=bs, seed=draw(st.integers(0, 2**31 - 1)), interleaved=draw(st.booleans()),
        cache_dtype=draw(st.sampled_from([None, None, *FP8])),
        q_out=draw(st.sampled_from([None, None, "same", FP8[0]])),
    )  # fmt: skip
    if mla:
        kw = dict(
            H=draw(st.integers(1, 3)), nope=draw(st.sampled_from([0, 16])), R=draw(st.sampled_from([8, 16]))
        )
        kw |= dict(L=draw(st.sampled_from([16, 32])), packed=draw(st.booleans()))
    else:
        hk = draw(st.integers(1, 2))
        kw = dict(Hq=hk * draw(st.integers(1, 2)), Hk=hk, D=draw(st.sampled_from([16, 32, 64])))
        kw |= dict(layout=draw(st.sampled_from(["NHD", "HND"])), packed=draw(st.booleans()))
    table = dict(
        n_req=draw(st.integers(0, 5)), last_len=draw(st.booleans()), spare=draw(st.integers(0, 2)),
        pad=draw(st.sampled_from([0.0, 0.2, 1.0])), n_tokens=draw(st.integers(0, T)),
        dtypes=[draw(st.sampled_from([I32, I64])) for _ in FIELDS],
    )  # fmt: skip
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    backend = draw(st.sampled_from(["cpu", (132, False), (1, True), (4, False)]))
    return mla, dtype, dict(common, **kw), table, draw(st.integers(0, 2**31 - 1)), backend


# ---------------------------------------------------------------------------------------------------------
# The compiled calls (test_page_table.py's test_compile_fullgraph_matches_eager).


def compiled_body(gqa: list, mla: list, gqa_table: list, mla_table: list):
    q, k, v, pos, cs, kc, vc, k_scale, v_scale = gqa
    rope_ext.apply_rotary_qk_and_cache_(
        q, k, v, pos, cs, kc, vc, layout="HND", k_scale=k_scale, v_scale=v_scale,
        page_table=rope_ext.PageTable(*gqa_table),
    )  # fmt: skip
    q, kv_c, k_pe, pos, cs, cache = mla
    rope_ext.apply_mla_rotary_and_cache_(
        q, kv_c, k_pe, pos, cs, cache, rotary_offset=16, page_table=mla_table
    )
    return k * 2  # read after the in-place op


def compile_inputs(T: int):
    """compiled_body's arguments for T tokens (tables of int32 and int64 tensors, the same dtypes for every
    T), then everything the calls write."""
    kw = dict(Hq=2, Hk=1, D=32, block_size=4, layout="HND", cache_dtype=FP8[0], seed=T)
    c = gqa_build(torch.bfloat16, T=T, **kw)
    m = mla_build(torch.float16, T=T, H=2, block_size=4, kv_scale=None, seed=T)
    gqa = [c.q, c.k, c.v, c.positions, c.cos_sin, c.key_cache, c.value_cache, c.k_scale, c.v_scale]
    mla = [m.q, m.kv_c, m.k_pe, m.positions, m.cos_sin, m.kv_cache]
    dtypes = [I32, I64, I32, I32, I64]
    t1 = random_table(
        torch.Generator().manual_seed(T),
        num_blocks=c.key_cache.shape[0],
        block_size=4,
        T=T,
        n_tokens=T - 1,
        dtypes=dtypes,
    )
    t2 = random_table(
        torch.Generator().manual_seed(T + 1),
        num_blocks=m.kv_cache.shape[0],
        block_size=4,
        T=T,
        last_len=False,
        dtypes=dtypes,
    )
    return gqa, mla, list(t1), table_list(t2), gqa_outputs(c) + mla_outputs(m)

"""The cache ops' page_table (FlashInfer's ``append_paged_kv_cache`` arguments, :class:`rope_ext.PageTable`).

A call with ``page_table=pt`` must write, bit for bit, what the same call with ``slot_mapping=
reference.page_table_slots(pt)`` writes (q, k, q_out, both caches, every guard byte), on every backend: the
CPU op, the CUDA body run on the host (vector and scalar path) and the CUDA op with a GPU; for
apply_rotary_qk_and_cache_ (NHD and HND, float and fp8 caches, q_out) and apply_mla_rotary_and_cache_.
The tables are random (:func:`_page_table_helpers.random_table`): several requests on shuffled pages, random
lengths, padding tokens, ``T' < T``, int32 / int64 tensors mixed, with and without kv_last_page_len.

A table that cannot place a token is refused on the CPU before anything is written (IndexError naming the
entry; ValueError for kv_last_page_len outside [0, page_size] and for two tokens on one slot); the CUDA body
skips that token instead, which the reference marks -1. Then the argument checks, opcheck, torch.compile and
a hypothesis agreement draw.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, NO_CUDA
from _page_table_helpers import (
    BASE_SLOTS,
    BS,
    FAULTS,
    HAS_EMU,
    I32,
    I64,
    NB,
    OPS,
    T_BAD,
    TWICE,
    VE,
    assert_table_is_its_slots,
    base_table,
    compile_inputs,
    compiled_body,
    gqa_outputs,
    random_table,
    ref_slots,
    run_gqa,
    run_mla,
    table_cases,
    table_list,
)
from _serving_cache_helpers import (
    FP8,
    _one_thread,  # noqa: F401 - the autouse fixture: one thread in this module
    same_bits,
)
from _serving_cache_helpers import build as gqa_build
from _serving_mla_helpers import build as mla_build
from _serving_mla_helpers import outputs as mla_outputs
from _strategies import property_settings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.library import opcheck

import rope_ext
from rope_ext import reference

E4M3, E5M2 = FP8
TE = TypeError
BACKENDS = ["cpu", "emu-132sm", "emu-1sm-scalar", "cuda"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------
# The reference's slots: the rule, and the CPU op's slots.


def test_reference_slots_of_a_small_table():
    """Two requests: pages [3, 5] holding 6 entries, pages [1, 0, 2] holding 9; padding; T' < T."""
    pt = rope_ext.PageTable(
        torch.tensor([0, -1, 0, 1, 1, 1, 0, 1], dtype=I32), torch.tensor([2, 99, 5, 3, 4, 8, 0, 0]),
        torch.tensor([3, 5, 1, 0, 2], dtype=I32), torch.tensor([0, 2, 5]), torch.tensor([2, 1], dtype=I32),
    )  # fmt: skip
    want = [3 * 4 + 2, -1, 5 * 4 + 1, 1 * 4 + 3, 0 * 4 + 0, 2 * 4 + 0, 3 * 4 + 0, 1 * 4 + 0]
    got = reference.page_table_slots(*pt, block_size=4, num_blocks=6)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert OPS._page_table_slots(table_list(pt), 4, 6).tolist() == want
    # Without kv_last_page_len every row of a request's pages is an entry: request 0 holds 8.
    pt2 = pt._replace(positions=torch.tensor([7, 0, 6, 3, 4, 8, 0, 0]), kv_last_page_len=None)
    want2 = [5 * 4 + 3, -1, 5 * 4 + 2, *want[3:]]
    assert reference.page_table_slots(*pt2, 4, 6).tolist() == want2
    assert OPS._page_table_slots(table_list(pt2), 4, 6).tolist() == want2


def test_reference_refuses_malformed_tables():
    ok = [torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1])]
    for i, bad in ((1, torch.tensor([0, 0])), (3, torch.tensor([], dtype=I64)), (4, torch.tensor([1, 1]))):
        with pytest.raises(ValueError):
            reference.page_table_slots(*ok[:i], bad, *ok[i + 1 :], block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match="integer and 1-d"):
        reference.page_table_slots(ok[0].float(), *ok[1:], block_size=4, num_blocks=2)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_reference_slots_are_the_cpu_ops(block_size):
    """On random valid tables the reference's slots are rope_ext::_page_table_slots's (the CPU op's)."""
    gen = _gen(block_size)
    for i in range(40):
        nb = 1 + i % 9
        pt = random_table(
            gen, num_blocks=nb, block_size=block_size, T=30, n_req=i % 6, last_len=i % 3 > 0, spare=i % 2
        )
        want = OPS._page_table_slots(table_list(pt), block_size, nb)
        got = ref_slots(pt, block_size, nb)
        assert same_bits(got, want), (i, pt)
        written = got[got >= 0]
        assert written.unique().numel() == written.numel() and bool((written < nb * block_size).all())


# ---------------------------------------------------------------------------------------------------------
# Random tables: the call with the table writes what the call with its slots writes, bit for bit.

# (dtype, build options, table options)
GQA_CONFIGS = {
    "f32-NHD": (torch.float32, dict(layout="NHD"), dict(last_len=True)),
    "bf16-HND-q_out-nolast": (torch.bfloat16, dict(layout="HND", q_out="same"), dict(last_len=False)),
    "f16-NHD-e4m3-blocks": (torch.float16, dict(cache_dtype=E4M3, cache_view="blocks"), dict(last_len=True)),
    "bf16-HND-e4m3-q_out-e4m3": (
        torch.bfloat16,
        dict(layout="HND", cache_dtype=E4M3, q_out=E4M3, interleaved=True),
        dict(n_req=5),
    ),
    "f32-HND-heads-packed": (torch.float32, dict(layout="HND", cache_view="heads", packed=True), {}),
    "f16-NHD-bs1-e5m2": (torch.float16, dict(block_size=1, cache_dtype=E5M2), dict(n_req=4, pad=0.5)),
    "f64-NHD-offset": (torch.float64, dict(rotary_offset=32, D=96, Dv=48), dict(last_len=False)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", list(GQA_CONFIGS))
def test_gqa_table_writes_its_slots(config, backend):
    dtype, kw, table_kw = GQA_CONFIGS[config]
    kw = dict(dict(T=24, Hq=4, Hk=2, D=64, block_size=4), **kw)
    gen = _gen(len(config))
    for seed in range(3):

        def make(seed=seed):
            return gqa_build(dtype, **kw, seed=seed)

        a = make().args()
        nb, bs = a["key_cache"].shape[0], kw["block_size"]
        pt = random_table(gen, num_blocks=nb, block_size=bs, T=24, n_tokens=20 - 4 * seed, **table_kw)
        c, slots = assert_table_is_its_slots(make, pt, backend)
        assert len(slots) == 20 - 4 * seed < 24
        if backend != "cpu" and dtype != torch.float64:  # every path writes the CPU op's bits
            cpu = make()
            run_gqa({**cpu.args(), "slot_mapping": None, "page_table": pt}, "cpu")
            for got, want in zip(gqa_outputs(c), gqa_outputs(cpu), strict=True):
                assert same_bits(got, want), f"{backend} differs from the CPU op"


MLA_CONFIGS = {
    "f32": (torch.float32, dict(), dict(last_len=True)),
    "bf16-e4m3-q_out-e5m2": (torch.bfloat16, dict(cache_dtype=E4M3, q_out=E5M2, packed=True), dict(n_req=5)),
    "f16-same-rows-nolast": (
        torch.float16,
        dict(q_out="same", cache_view="rows", interleaved=True),
        dict(last_len=False),
    ),
    "bf16-bs1-e5m2": (torch.bfloat16, dict(block_size=1, cache_dtype=E5M2, kv_scale=None), dict(pad=0.5)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", list(MLA_CONFIGS))
def test_mla_table_writes_its_slots(config, backend):
    dtype, kw, table_kw = MLA_CONFIGS[config]
    kw = dict(dict(T=20, H=2, nope=16, R=16, L=32, block_size=4), **kw)
    gen = _gen(len(config) + 100)
    for seed in range(3):

        def make(seed=seed):
            return mla_build(dtype, **kw, seed=seed)

        nb = make().kv_cache.shape[0]
        pt = random_table(
            gen, num_blocks=nb, block_size=kw["block_size"], T=20, n_tokens=18 - 5 * seed, **table_kw
        )
        c, _ = assert_table_is_its_slots(make, pt, backend, mla=True)
        if backend != "cpu":
            cpu = make()
            run_mla({**cpu.args(), "slot_mapping": None, "page_table": pt}, "cpu")
            for got, want in zip(mla_outputs(c), mla_outputs(cpu), strict=True):
                assert same_bits(got, want), f"{backend} differs from the CPU op"


EDGES = {
    "no-tokens": dict(n_tokens=0),
    "no-requests": dict(n_req=0),  # kv_indptr [0]: every token is padding
    "all-padding": dict(pad=1.0),
    "one-decode-token": dict(n_tokens=1, pad=0.0),
    "spare-indices": dict(spare=3, n_req=1),  # kv_indices past the last request: never read
    "all-int64": dict(dtypes=[I64] * 5),
    "all-int32": dict(dtypes=[I32] * 5, n_req=6),
}


@pytest.mark.parametrize("backend", ["cpu", "emu-132sm"])
@pytest.mark.parametrize("edge", list(EDGES))
def test_edge_tables(edge, backend):
    gen = _gen(7)
    for seed in range(2):

        def make(seed=seed):
            return gqa_build(torch.bfloat16, T=9, Hq=2, Hk=1, D=32, block_size=2, seed=seed)

        nb = make().key_cache.shape[0]
        pt = random_table(gen, num_blocks=nb, block_size=2, T=9, **EDGES[edge])
        assert_table_is_its_slots(make, pt, backend)


def test_no_tokens_at_all():
    """T = 0: an empty table is fine and writes nothing."""
    c = gqa_build(torch.float32, T=0, block_size=4)
    pt = random_table(_gen(0), num_blocks=c.key_cache.shape[0], block_size=4, T=0)
    before = [t.clone() for t in gqa_outputs(c)]
    rope_ext.apply_rotary_qk_and_cache_(**{**c.args(), "slot_mapping": None, "page_table": pt})
    assert all(same_bits(x, y) for x, y in zip(gqa_outputs(c), before, strict=True))


def test_table_positions_may_be_the_rotary_positions():
    """One tensor as the rotary positions and the table's (each request's tokens at their positions): both
    are read only, so they may share memory."""
    c0 = gqa_build(torch.bfloat16, T=12, block_size=4)
    pt = random_table(_gen(4), num_blocks=c0.key_cache.shape[0], block_size=4, T=12, n_tokens=12, pad=0.0)
    assert bool((pt.batch_indices >= 0).all())  # no padding: every position is a row of cos_sin

    def make():
        c = gqa_build(torch.bfloat16, T=12, block_size=4)
        c.positions = pt.positions
        return c

    assert_table_is_its_slots(make, pt, "cpu")


def test_the_table_forms_agree():
    """A PageTable (kv_last_page_len None or not), a tuple and a list of its tensors: one write."""
    c0 = gqa_build(torch.float16, T=12, block_size=4, seed=3)
    pt = random_table(_gen(3), num_blocks=c0.key_cache.shape[0], block_size=4, T=12, last_len=False)
    forms = [pt, tuple(pt), pt[:4], list(pt[:4]), rope_ext.PageTable(*pt[:4])]
    results = []
    for form in forms:
        c = gqa_build(torch.float16, T=12, block_size=4, seed=3)
        rope_ext.apply_rotary_qk_and_cache_(**{**c.args(), "slot_mapping": None, "page_table": form})
        results.append(gqa_outputs(c))
    for r in results[1:]:
        assert all(same_bits(x, y) for x, y in zip(r, results[0], strict=True))


# ---------------------------------------------------------------------------------------------------------
# Tables that cannot place a token: refused on the CPU before any write, skipped by the CUDA body.


def _gqa_case(seed=0):
    return gqa_build(torch.float32, T=T_BAD, Hq=2, Hk=2, D=16, block_size=BS, q_out="same", seed=seed)


def _mla_case(seed=0):
    kw = dict(T=T_BAD, H=2, nope=16, R=8, L=32, block_size=BS, cache_dtype=E4M3, packed=True)
    return mla_build(torch.bfloat16, **kw, seed=seed)


def _case(op: str):
    c = _gqa_case() if op == "gqa" else _mla_case()
    assert c.args()["key_cache" if op == "gqa" else "kv_cache"].shape[0] == NB
    return c


def _api(op: str, c, pt) -> None:
    a = {**c.args(), "slot_mapping": None, "page_table": pt}
    (rope_ext.apply_rotary_qk_and_cache_ if op == "gqa" else rope_ext.apply_mla_rotary_and_cache_)(**a)


def _everything(c, pt) -> list[torch.Tensor]:
    tensors = [t for t in c.args().values() if isinstance(t, torch.Tensor)]
    bases = [getattr(c, n) for n in ("kc_base", "vc_base", "cache_base", "q_out_base") if hasattr(c, n)]
    return tensors + [b for b in bases if b is not None] + table_list(pt)


def test_base_table_is_valid():
    assert reference.page_table_slots(*base_table(), BS, NB).tolist() == BASE_SLOTS
    assert OPS._page_table_slots(table_list(base_table()), BS, NB).tolist() == BASE_SLOTS


@pytest.mark.parametrize("op", ["gqa", "mla"])
@pytest.mark.parametrize(
    "name,changes,last_len,exc,match", [f[:5] for f in FAULTS] + TWICE, ids=[f[0] for f in FAULTS + TWICE]
)
def test_bad_table_is_refused_before_any_write(name, changes, last_len, exc, match, op):
    """The CPU op raises the right class naming the entry, and q, k, v, the caches and the table keep their
    bits; rope_ext::_page_table_slots raises the same."""
    c, pt = _case(op), base_table(changes, last_len)
    everything = _everything(c, pt)
    before = [t.clone() for t in everything]
    with pytest.raises(exc, match=match):
        _api(op, c, pt)
    for i, (t, t0) in enumerate(zip(everything, before, strict=True)):
        assert same_bits(t, t0), f"tensor {i} changed by a refused call"
    with pytest.raises(exc, match=match):
        OPS._page_table_slots(table_list(pt), BS, NB)


@pytest.mark.parametrize("backend", ["emu-132sm", "emu-1sm-scalar", "cuda"])
@pytest.mark.parametrize("op", ["gqa", "mla"])
@pytest.mark.parametrize(
    "name,changes,last_len,bad", [f[:3] + f[5:] for f in FAULTS], ids=[f[0] for f in FAULTS]
)
def test_bad_table_skips_the_token_on_cuda(name, changes, last_len, bad, op, backend):
    """The CUDA body raises nothing and writes what the reference's slots say: the token the table cannot
    place (-1) is rotated, not written; every other token is written."""
    pt = base_table(changes, last_len)
    slots = reference.page_table_slots(*pt, BS, NB).tolist()
    assert slots == [-1 if t in bad else s for t, s in enumerate(BASE_SLOTS)], slots
    assert_table_is_its_slots(_gqa_case if op == "gqa" else _mla_case, pt, backend, mla=op == "mla")


@pytest.mark.parametrize("name,changes,last_len", [t[:3] for t in TWICE], ids=[t[0] for t in TWICE])
def test_two_tokens_on_one_slot_race_on_emulation(name, changes, last_len):
    """The CUDA body does not check for repeated slots (two tokens writing one row race, which the emulation
    reports); the reference returns both."""
    if not HAS_EMU:
        pytest.skip("built without ROPE_EXT_TESTING=1")
    pt = base_table(changes, last_len)
    slots = reference.page_table_slots(*pt, BS, NB)
    assert slots.unique().numel() == len(slots) - 1
    c = _gqa_case()
    with pytest.raises(RuntimeError, match="data race"):
        run_gqa({**c.args(), "slot_mapping": None, "page_table": pt}, "emu-132sm")


CHECKED = [f[:5] for f in FAULTS[::3]] + TWICE  # a few faults of each kind


@pytest.mark.parametrize("name,changes,last_len,exc,match", CHECKED, ids=[f[0] for f in CHECKED])
def test_position_checks_refuse_bad_tables_on_cuda(name, changes, last_len, exc, match):
    """With rope_ext.set_position_checks(True) an eager CUDA call checks the table on the host, as the CPU op
    does."""
    if not HAS_CUDA:
        pytest.skip(NO_CUDA)
    c, pt = _gqa_case(), base_table(changes, last_len)
    rope_ext.set_position_checks(True)
    try:
        with pytest.raises(exc, match=match):
            run_gqa({**c.args(), "slot_mapping": None, "page_table": pt}, "cuda")
    finally:
        rope_ext.set_position_checks(False)


# ---------------------------------------------------------------------------------------------------------
# Argument errors.


def _entry(i: int, fn):
    """Replaces table entry i (0..4) with fn(entry)."""
    return lambda pt, c: [fn(t) if j == i else t for j, t in enumerate(pt)]


def _k_holds_table(pt, c):
    return [c.k[0, 0, :T_BAD].view(torch.int32), *pt[1:]]


def _cache_holds_table(pt, c):
    return [pt[0], pt[1], c.key_cache.view(torch.int32).flatten()[:5], *pt[3:]]


PT_WANTS = r"page_table must be \(batch_indices, positions, kv_indices, kv_indptr\[, kv_last_page_len\]\) "
PTS = "page_table's "
# (id, change (table, case) -> page_table, exception of the API, message)
ARG_ERRORS = [
    ("three-tensors", lambda pt, c: list(pt[:3]), VE, PT_WANTS + r"\(rope_ext.PageTable\), got list of 3"),
    ("six-tensors", lambda pt, c: [*pt, pt[0]], VE, "got list of 6"),
    ("a-tensor", lambda pt, c: pt[0], VE, "got Tensor"),
    ("str-entry", _entry(3, lambda t: "x"), TE, PTS + "kv_indptr must be a torch.Tensor, got str"),
    ("None-entry", _entry(0, lambda t: None), TE, PTS + "batch_indices must be a torch.Tensor, got None"),
    ("list-entry", _entry(2, lambda t: t.tolist()), TE, PTS + "kv_indices must be a torch.Tensor, got list"),
    ("float-entry", _entry(2, lambda t: t.float()), TE,
     PTS + "kv_indices must be an int32 or int64 tensor, got Float"),
    ("int16-entry", _entry(4, lambda t: t.short()), TE, PTS + "kv_last_page_len must be an int32 or int64"),
    ("uint8-entry", _entry(0, lambda t: t.to(torch.uint8)), TE, PTS + "batch_indices must be an int32"),
    ("2d-entry", _entry(2, lambda t: t[:, None]), VE, PTS + r"kv_indices must be 1-d, got shape \[5, 1\]"),
    ("0d-entry", _entry(3, lambda t: t[0]), VE, PTS + r"kv_indptr must be 1-d, got shape \[\]"),
    ("strided-entry", _entry(1, lambda t: torch.stack([t, t], 1)[:, 0]), VE,
     PTS + r"positions must be contiguous, got strides \[2\]"),
    ("lengths-differ", _entry(1, lambda t: t[:-1]), VE,
     PTS + r"batch_indices and positions must be \[T'\] with T' <= T = 10, got shapes \[10\] and \[9\]"),
    ("longer-than-T", lambda pt, c: [torch.cat([t, t[:1]]) for t in pt[:2]] + list(pt[2:]), VE,
     r"with T' <= T = 10, got shapes \[11\] and \[11\]"),
    ("last-len-short", _entry(4, lambda t: t[:1]), VE,
     PTS + r"kv_last_page_len must be \[batch_size\] = \[2\] \(kv_indptr is \[batch_size \+ 1\]\), "
     r"got shape \[1\]"),
    ("indptr-empty", _entry(3, lambda t: t[:0]), VE, PTS + r"kv_indptr must be \[batch_size \+ 1\], got"),
    ("meta-entry", _entry(2, lambda t: t.to("meta")), VE, PTS + r"kv_indices must be on the device of q \("),
    ("k-holds-table", _k_holds_table, VE, "k and page_table overlap in memory"),
    ("cache-holds-table", _cache_holds_table, VE, "key_cache and page_table overlap in memory"),
]  # fmt: skip


@pytest.mark.parametrize("name,change,exc,match", ARG_ERRORS, ids=[e[0] for e in ARG_ERRORS])
def test_argument_errors(name, change, exc, match):
    """A malformed page_table raises through the API, naming the entry, and writes nothing."""
    c = _gqa_case()
    pt = change(base_table(), c)
    everything = _everything(c, base_table())
    before = [t.clone() for t in everything]
    with pytest.raises(exc, match=match):
        _api("gqa", c, pt)
    for t, t0 in zip(everything, before, strict=True):
        assert same_bits(t, t0)


def test_bare_op_errors():
    """The bare ops: a type error is a ValueError tagged "[type] " (the API's TypeError); the others as in
    the API."""
    c, pt = _gqa_case(), table_list(base_table())
    a = list(c.args().values())[:8]  # q .. slot_mapping
    with pytest.raises(
        ValueError, match=r"^\[type\] page_table's positions must be an int32 or int64 tensor"
    ):
        OPS.rotary_qk_cache_(*a[:7], None, page_table=[pt[0], pt[1].double(), *pt[2:]])
    with pytest.raises(ValueError, match=r"page_table must be \(batch_indices, .*\), got 3 tensors"):
        OPS.rotary_qk_cache_(*a[:7], None, page_table=pt[:3])
    with pytest.raises(ValueError, match="slot_mapping must be None when page_table is given"):
        OPS.rotary_qk_cache_(*a[:7], torch.arange(T_BAD), page_table=pt)
    with pytest.raises(ValueError, match=r"^\[type\] slot_mapping must be a tensor, got None \(or pass"):
        OPS.rotary_qk_cache_(*a[:7], None)
    with pytest.raises(ValueError, match="block_size and num_blocks must be non-negative"):
        OPS._page_table_slots(pt, -1, NB)
    with pytest.raises(ValueError, match="their product an int64"):
        OPS._page_table_slots(pt, 2**62, 4)


@pytest.mark.parametrize("op", ["gqa", "mla"])
def test_slot_mapping_xor_page_table(op):
    """One of slot_mapping and page_table: both is a ValueError, neither a TypeError; nothing written."""
    c, pt = _case(op), base_table()
    everything = _everything(c, pt)
    before = [t.clone() for t in everything]
    fn = rope_ext.apply_rotary_qk_and_cache_ if op == "gqa" else rope_ext.apply_mla_rotary_and_cache_
    slots = torch.tensor(BASE_SLOTS)
    with pytest.raises(ValueError, match="slot_mapping must be None when page_table is given"):
        fn(**{**c.args(), "slot_mapping": slots, "page_table": pt})
    with pytest.raises(TypeError, match=r"slot_mapping must be a tensor, got None \(or pass page_table\)"):
        fn(**{**c.args(), "slot_mapping": None})
    with pytest.raises(ValueError, match=PT_WANTS + ".*got tuple of 3"):
        fn(**{**c.args(), "slot_mapping": None, "page_table": tuple(pt[:3])})
    for t, t0 in zip(everything, before, strict=True):
        assert same_bits(t, t0)


def test_emulated_body_checks_the_table_shape():
    """The CUDA body takes the op's argument checks (shapes and dtypes), not the per-token checks."""
    if not HAS_EMU:
        pytest.skip("built without ROPE_EXT_TESTING=1")
    c, pt = _gqa_case(), base_table()
    with pytest.raises(ValueError, match=r"^\[type\] page_table's kv_indptr must be an int32 or int64"):
        run_gqa({**c.args(), "slot_mapping": None, "page_table": [*pt[:3], pt[3].float()]}, "emu-132sm")
    with pytest.raises(ValueError, match=r"page_table's kv_last_page_len must be \[batch_size\]"):
        run_gqa({**c.args(), "slot_mapping": None, "page_table": [*pt[:4], pt[4][:1]]}, "emu-132sm")


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile.

NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_opcheck(fp8):
    # test_schema compares mutated arguments with torch.allclose, which has no fp8 kernel: fp8 calls skip it.
    utils = NO_SCHEMA if fp8 else ("test_schema", *NO_SCHEMA)
    cdt = E4M3 if fp8 else None
    c = gqa_build(
        torch.float32, T=6, Hq=2, Hk=1, D=16, block_size=4, layout="HND", cache_dtype=cdt, q_out="same"
    )
    pt = random_table(_gen(1), num_blocks=c.key_cache.shape[0], block_size=4, T=6, n_tokens=5, pad=0.3)
    a = c.args()
    args = tuple(a[n] for n in ("q", "k", "v", "positions", "cos_sin", "key_cache", "value_cache")) + (None,)
    kw = {n: a[n] for n in ("k_scale", "v_scale", "q_out", "q_scale", "layout")}
    opcheck(OPS.rotary_qk_cache_.default, args, {**kw, "page_table": table_list(pt)}, test_utils=utils)
    m = mla_build(torch.bfloat16, T=5, H=2, block_size=4, cache_dtype=cdt, q_out="same")
    pt = random_table(_gen(2), num_blocks=m.kv_cache.shape[0], block_size=4, T=5, last_len=False)
    a = m.args()
    args = tuple(a[n] for n in ("q", "kv_c", "k_pe", "positions", "cos_sin", "kv_cache")) + (None,)
    kw = {n: a[n] for n in ("kv_scale", "q_out", "q_scale", "interleaved", "rotary_offset")}
    opcheck(OPS.mla_rotary_cache_.default, args, {**kw, "page_table": table_list(pt)}, test_utils=utils)


@pytest.mark.parametrize(
    "backend,dynamic", [("aot_eager", False), ("aot_eager", True), ("inductor", False)], ids=str
)
def test_compile_fullgraph_matches_eager(backend, dynamic):
    """torch.compile(fullgraph=True) of both APIs with a page table writes what eager writes, bit for bit;
    dynamic=True runs two token counts (and table sizes) through one graph (without duck sizing, which would
    guard on table sizes that happen to be equal)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(compiled_body, fullgraph=True, backend=backend, dynamic=dynamic)
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        _compile_runs(compiled, (7, 13) if dynamic else (7,))
    assert counters["stats"]["unique_graphs"] == 1, "recompiled"


def _compile_runs(compiled, token_counts) -> None:
    for T in token_counts:
        *args, out_c = compile_inputs(T)
        *args2, out_e = compile_inputs(T)
        got, want = compiled(*args), compiled_body(*args2)
        assert same_bits(got, want), "compiled and eager differ"
        for x, y in zip(out_c, out_e, strict=True):
            assert same_bits(x, y), "compiled and eager differ"


# ---------------------------------------------------------------------------------------------------------
# Property test: random tables, shapes, dtypes and caches; the call with the table writes its slots' bits.


@property_settings()  # the existing ops' draws: 500 (more under the 'long' profile)
@given(drawn=table_cases())
def test_property_table_writes_its_slots(drawn):
    mla, dtype, kw, table, table_seed, backend = drawn
    build = mla_build if mla else gqa_build
    c = build(dtype, **kw)
    nb = (c.kv_cache if mla else c.key_cache).shape[0]
    pt = random_table(_gen(table_seed), num_blocks=nb, block_size=kw["block_size"], T=kw["T"], **table)
    assert_table_is_its_slots(lambda: build(dtype, **kw), pt, backend, mla=mla)


HOSTILE = [-1, -2, 0, 1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]


@property_settings(200)
@given(
    seed=st.integers(0, 2**31 - 1), field=st.integers(0, 4), at=st.integers(0, 2**16),
    value=st.one_of(st.sampled_from(HOSTILE), st.integers(-3, 40)), last_len=st.booleans(),
    backend=st.sampled_from([(132, False), (1, True), (4, False)]),
)  # fmt: skip
def test_property_corrupted_table(seed, field, at, value, last_len, backend):
    """One entry of a valid table set to a random or hostile value: the CPU op raises (writing nothing)
    exactly when the reference leaves a token with a request unplaced or places two tokens on one slot, and
    otherwise writes the reference's slots; the CUDA body writes the reference's slots (a race on a repeated
    slot)."""

    def make():
        return gqa_build(torch.float16, T=12, Hq=2, Hk=1, D=32, block_size=4, seed=seed % 97)

    nb = make().key_cache.shape[0]
    tensors = list(random_table(_gen(seed), num_blocks=nb, block_size=4, T=12, last_len=last_len))
    t = tensors[field]
    if t is not None and t.numel():
        tensors[field] = t = t.long() if not -(2**31) <= value < 2**31 else t
        t[at % t.numel()] = value
    pt = rope_ext.PageTable(*tensors)
    slots = ref_slots(pt, 4, nb)
    written = slots[slots >= 0]
    twice = written.unique().numel() < written.numel()
    unplaced = bool((slots[pt.batch_indices != -1] == -1).any())  # the first fault is raised
    if unplaced or twice:
        c = make()
        before = [x.clone() for x in gqa_outputs(c)]
        with pytest.raises((IndexError, ValueError) if unplaced else ValueError, match="page_table"):
            run_gqa({**c.args(), "slot_mapping": None, "page_table": pt}, "cpu")
        assert all(same_bits(x, y) for x, y in zip(gqa_outputs(c), before, strict=True))
    else:
        assert_table_is_its_slots(make, pt, "cpu")
    if twice:
        if HAS_EMU:
            with pytest.raises(RuntimeError, match="data race"):
                run_gqa({**make().args(), "slot_mapping": None, "page_table": pt}, backend)
    else:
        assert_table_is_its_slots(make, pt, backend)

"""apply_rotary_qk_and_cache_ (rotary fused with the paged KV-cache write) against float64 references.

Each call runs on the CPU op (the public API), on the CUDA kernel body run on the host
(``_cuda_emulated_cache``, vector and scalar path, a few grid shapes) and, with a GPU, on the CUDA op. q
and k must agree with ``reference.rotary_hadamard`` at the project tolerance (pass-through features
bit-exact); the caches must equal, bit for bit, a pure-PyTorch model that index_puts the rotated k (as
written to k) and v into clones of the guard-filled caches (``reference.quantize_fp8`` for fp8 caches), so
every slot not named in slot_mapping and every element outside a cache view keeps its bits.

The cases, backends and checks live in ``_serving_cache_helpers.py``; the fp8 tests (saturation, infinities,
NaN, the conversion against torch's) in ``test_serving_fp8.py``.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import NO_EMULATION, to_device
from _serving_cache_helpers import (
    BACKENDS,
    E4M3,
    E5M2,
    EMU_BACKENDS,
    FP8,
    HAS_EMU,
    MATRIX,
    N_POS,
    OPS,
    _one_thread,  # noqa: F401 - the autouse fixture: one thread in this module
    build,
    check,
    emulated,
    run,
    run_checked,
    same_bits,
)
from _strategies import property_settings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.library import opcheck

import rope_ext

# ---------------------------------------------------------------------------------------------------------
# The matrix: dtypes x pairings x shapes / layouts / caches / q_out x backends.

CONFIGS = {
    "base": {},
    "hnd-bs32": dict(layout="HND", block_size=32),
    "partial64": dict(rotary_dim=64),
    "offset": dict(rotary_dim=32, rotary_offset=64, layout="HND"),
    "mha-bs1": dict(Hq=4, Hk=4, block_size=1),
    "short-slots": dict(slots="short", block_size=1, layout="HND"),
    "all-slots-int32pos": dict(slots="all", pos_dtype=torch.int32),
    "packed": dict(packed=True, T=23),
    "packed-hnd-qout": dict(packed=True, layout="HND", q_out="same", rotary_dim=64),
    "dv64": dict(Dv=64, cache_view="heads"),
    "dv256-hnd": dict(Dv=256, layout="HND", cache_view="blocks", rotary_dim=96),
    "cache-view-blocks": dict(cache_view="blocks", block_size=32),
    "cache-view-heads-hnd": dict(cache_view="heads", layout="HND", Hq=2, Hk=2),
    "q_out-same": dict(q_out="same", slots="all"),
    "e4m3": dict(cache_dtype=E4M3),
    "e5m2-hnd-qout8": dict(cache_dtype=E5M2, layout="HND", q_out=E4M3, rotary_dim=64, block_size=1),
    "e4m3-packed-qout8": dict(cache_dtype=E4M3, packed=True, q_out=E5M2, cache_view="heads"),
    "e5m2-offset": dict(cache_dtype=E5M2, rotary_dim=64, rotary_offset=32, slots="short", Dv=32),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("backend", MATRIX)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_reference_and_cache_model(config, dtype, interleaved, backend):
    """Every config on every dtype and pairing; the emulated body takes the 16-byte path unless forced off."""
    kw = CONFIGS[config]
    seed = 100 * list(CONFIGS).index(config) + 10 * DTYPES.index(dtype) + interleaved
    c = build(dtype, interleaved=interleaved, seed=seed, **kw)
    run_checked(c, backend, vectorized=True)  # every config is 16-byte aligned


def test_unaligned_falls_back_to_scalar():
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    for backend in ("emu-132sm", "emu-1sm"):  # not force_scalar, still the scalar path
        c = build(torch.float16, D=12, rotary_dim=6, Hq=3, Hk=1, Dv=5, block_size=3)
        run_checked(c, backend, vectorized=False)


# Shapes no 16-byte access fits (head_dim, rotary_dim, offset or Dv): the scalar path of the CUDA body.
UNALIGNED = {
    "d12-dv5": dict(D=12, rotary_dim=6, Hq=3, Hk=1, Dv=5, block_size=3),
    "d20-offset-hnd": dict(D=20, rotary_dim=10, rotary_offset=6, Hq=2, Hk=2, Dv=7, layout="HND",
                           block_size=5),
    "d7-packed-e5m2-qout8": dict(D=7, rotary_dim=4, rotary_offset=1, Hq=3, Hk=1, packed=True,
                                 cache_dtype=E5M2, q_out=E5M2, block_size=2, cache_view="heads"),
    "d14-e4m3-view": dict(D=14, rotary_dim=14, Hq=2, Hk=1, Dv=3, cache_dtype=E4M3, cache_view="blocks", T=5),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["emu-132sm", "cuda"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("config", list(UNALIGNED))
def test_unaligned_shapes_take_the_scalar_path(config, dtype, interleaved, backend):
    """Unaligned shapes on every dtype: the emulated body (not forced scalar) shows they take the scalar path,
    and the CUDA op runs the same cases."""
    c = build(dtype, interleaved=interleaved, seed=7 + list(UNALIGNED).index(config), **UNALIGNED[config])
    run_checked(c, backend, vectorized=False)


# Several position axes (MRoPE: positions [3, T]; 2-D and 4-axis ones): not an argument of the emulated
# op; the CPU and CUDA ops.
MROPE = {
    "mrope": dict(mrope_section=(16, 24, 24)),
    "mrope-interleaved-hnd-e4m3": dict(mrope_section=(24, 20, 20), mrope_interleaved=True, layout="HND",
                                       cache_dtype=E4M3, packed=True),
    "mrope-offset-e5m2-qout8": dict(rotary_dim=64, rotary_offset=32, mrope_section=(8, 12, 12), q_out=E5M2,
                                    cache_dtype=E5M2, slots="short"),
    "axes-2": dict(mrope_section=(32, 32)),
    "axes-4-interleaved-e4m3": dict(mrope_section=(8, 8, 8, 8), mrope_interleaved=True, rotary_dim=64,
                                    cache_dtype=E4M3),
    "mrope-alternating": dict(mrope_section=(20, 22, 22), mrope_interleaved="alternating"),
    "axes-4-alternating-e4m3": dict(mrope_section=(10, 18, 18, 18), mrope_interleaved=2, cache_dtype=E4M3),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("config", list(MROPE))
def test_mrope_matches_reference_and_cache_model(config, dtype, interleaved, backend):
    c = build(dtype, interleaved=interleaved, seed=3 + list(MROPE).index(config), **MROPE[config])
    run_checked(c, backend)


def _decode(T: int, backend: str) -> None:
    for dtype, cache in ((torch.bfloat16, E4M3), (torch.float32, None)):
        slots = "all" if T < 3 else "mixed"
        c = build(dtype, T=T, cache_dtype=cache, slots=slots, q_out="same" if T == 2 else None)
        s = c.snapshot()
        run(c, backend)
        check(c, s, backend)
        if T == 0:
            assert same_bits(c.kc_base, s["kc_base"]) and same_bits(c.vc_base, s["vc_base"])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_decode_shapes(T, backend):
    """Decode: T = 1..4 (on the emulated grid the heads of a token spread over blocks)."""
    _decode(T, backend)


def test_no_tokens_is_a_no_op_on_cpu():
    _decode(0, "cpu")


def test_no_tokens_is_a_no_op_on_emulation():
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    for b in EMU_BACKENDS:
        _decode(0, b)


def _out_of_range_slot(bad, backend: str, fp8: bool) -> None:
    c = build(torch.float16, T=9, slots="all", cache_dtype=E4M3 if fp8 else None)
    n_slots = c.key_cache.shape[0] * c.key_cache.shape[1]
    c.slot_mapping[3] = n_slots if bad == "n_slots" else bad
    c.slot_mapping[7] = -1
    run_checked(c, backend)  # the model skips the token; q and k are still checked rotated


@pytest.mark.parametrize("bad", [-7, -2, 10**6, "n_slots"])
def test_out_of_range_slot_is_skipped_on_emulation(bad):
    """The CUDA body never writes outside the cache: that token's row is skipped, the others written."""
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    for backend in EMU_BACKENDS:
        _out_of_range_slot(bad, backend, backend == "emu-1sm")


@pytest.mark.parametrize("fp8", [False, True], ids=["f16-cache", "e4m3-cache"])
@pytest.mark.parametrize("bad", [-7, -2, 10**6, "n_slots"])
def test_out_of_range_slot_is_skipped_on_cuda(bad, fp8):
    """What the CUDA op documents (position checks off, the default): the token's write is skipped."""
    _out_of_range_slot(bad, "cuda", fp8)


def test_moved_cases_keep_their_storages():
    """The cuda backend's move (``_helpers.to_device``), here to new host storages: views of one storage stay
    views of one new storage with their strides and offsets, and the results come back on write_back."""
    c = build(torch.bfloat16, packed=True, cache_view="heads", q_out="same", layout="HND", slots="short")
    s = c.snapshot()
    a = c.args()
    moved, write_back = to_device(a, "cpu")
    ptr = {n: t.untyped_storage().data_ptr() for n, t in moved.items() if isinstance(t, torch.Tensor)}
    assert ptr["q"] == ptr["k"] == ptr["v"] != c.q.untyped_storage().data_ptr()
    for n, t in a.items():
        if isinstance(t, torch.Tensor):
            assert (moved[n].stride(), moved[n].storage_offset()) == (t.stride(), t.storage_offset()), n
            assert same_bits(moved[n], t), n
    rope_ext.apply_rotary_qk_and_cache_(**moved)
    assert same_bits(c.kc_base, s["kc_base"]) and same_bits(c.q_out, s["q_out"]), "written before write_back"
    write_back()
    check(c, s)


# ---------------------------------------------------------------------------------------------------------
# Rejected calls: the right exception naming the argument, and nothing written.


def _set(key, fn, src=None):
    """Replaces argument ``key`` with ``fn(a[src or key])`` (``fn`` a value: that value)."""
    return lambda a: a.update({key: fn(a[src or key]) if callable(fn) else fn})


def _overlap_caches(a):
    buf = a["key_cache"].new_empty((a["key_cache"].numel() + 32,))
    a["key_cache"] = buf[: a["key_cache"].numel()].view(a["key_cache"].shape)
    a["value_cache"] = buf[32:].view(a["value_cache"].shape)


def _fp8_q_out(scale):
    return lambda a: a.update(q_out=torch.zeros(a["q"].shape, dtype=E4M3), q_scale=scale)


VE, TE, IE = ValueError, TypeError, IndexError
# (id, change to a good call, exception of the API, message). The emulated op raises ValueError for the
# API's TypeError; it has no check of positions or slots against the table and cache (NO_EMU_CHECK), and
# layout, slot_mapping and rotary_offset of the wrong Python type fail in its argument parsing.
REJECTED = [
    ("v-dtype", _set("v", lambda v: v.double()), TE, "v must have the dtype of q"),
    ("v-heads", _set("v", lambda v: v[:, :1]), VE, "v must have the heads of k"),
    ("v-tokens", _set("v", lambda v: v[1:]), VE, "q, k and v must have the same tokens"),
    ("kc-shape", _set("key_cache", lambda c: c[:, :, :1]), VE, "key_cache must have shape"),
    ("vc-shape", _set("value_cache", lambda c: c[..., :8]), VE, "value_cache must have shape"),
    ("kc-3d", _set("key_cache", lambda c: c[0]), VE, "key_cache must be 4-d"),
    ("kc-dtype", _set("key_cache", lambda c: c.half()), TE, "key_cache must have the dtype of q"),
    ("vc-dtype", _set("value_cache", lambda c: c.view(E5M2)), TE, "value_cache must have the dtype"),
    ("kc-last-dim", _set("key_cache", lambda c: c.view(torch.uint8).repeat(1, 1, 1, 2)[..., ::2].view(E4M3)),
     VE, "key_cache must have a contiguous last dim"),
    ("kc-expanded", _set("key_cache", lambda c: c[:1].expand_as(c)), VE, "key_cache has elements that"),
    ("caches-same", _set("value_cache", lambda c: c, "key_cache"), VE, "key_cache and value_cache overlap"),
    ("caches-overlap", _overlap_caches, VE, "key_cache and value_cache overlap"),
    ("layout-str", _set("layout", "nhd"), VE, "layout must be 'NHD' or 'HND'"),
    ("layout-type", _set("layout", 1), TE, "layout must be 'NHD' or 'HND', got int"),
    ("slots-int32", _set("slot_mapping", lambda s: s.int()), TE, "slot_mapping must be an int64 tensor"),
    ("slots-2d", _set("slot_mapping", lambda s: s[:, None]), VE, r"slot_mapping must be \[T'\]"),
    ("slots-long", _set("slot_mapping", torch.arange(7)), VE, r"slot_mapping must be \[T'\] with T' <= T"),
    ("slots-strided", _set("slot_mapping", torch.arange(12)[::2]), VE, "slot_mapping must be contiguous"),
    ("slots-list", _set("slot_mapping", [0, 1, 2, 3, 4, 5]), TE, "slot_mapping must be a torch.Tensor"),
    ("k_scale-f64", _set("k_scale", torch.tensor([0.5]).double()), TE, "k_scale must be a float32"),
    ("k_scale-2", _set("k_scale", torch.tensor([0.5, 0.5])), VE, "k_scale must have one element"),
    ("v_scale-int", _set("v_scale", torch.tensor([2])), TE, "v_scale must be a float32"),
    ("q_scale-2", _fp8_q_out(torch.ones(2)), VE, "q_scale must have one element"),
    ("q_scale-f16", _fp8_q_out(torch.ones(1, dtype=torch.float16)), TE, "q_scale must be a float32"),
    ("q_out-shape", _set("q_out", lambda q: q[:, :2].clone(), "q"), VE, "q_out must have the shape of q"),
    ("q_out-dtype", _set("q_out", lambda q: q.half(), "q"), TE, "q_out must have the dtype of q"),
    ("q_out-is-q", _set("q_out", lambda q: q, "q"), VE, "q_out and q overlap"),
    ("q-k-overlap", _set("k", lambda q: q[:, :2], "q"), VE, "q and k overlap"),
    ("k-v-overlap", _set("v", lambda k: k, "k"), VE, "k and v overlap"),
    ("q-2d", _set("q", lambda q: q[:, 0]), VE, r"q must be \[T, Hq, D\]"),
    ("positions-2d", _set("positions", lambda p: p[None]), VE, r"positions of shape .* must be"),
    ("positions-len", _set("positions", lambda p: p[:4]), VE, r"positions of shape \[4(, 1)?\] must be"),
    ("positions-one", _set("positions", lambda p: p[:1]), VE, "positions must hold one position per token"),
    ("rotary_offset", _set("rotary_offset", 20), VE, "rotary_offset must be in"),
    ("rotary_offset-type", _set("rotary_offset", 1.0), TE, "rotary_offset must be an int"),
    ("position-range", _set("positions", lambda p: p + N_POS), IE, r"positions must be in \[0, "),
    ("slot-range", _set("slot_mapping", lambda s: s + 10**4), IE, "slot_mapping must hold -1 or slots in"),
    ("slot-minus-2", _set("slot_mapping", lambda s: s.clamp(max=-2)), IE, "slot_mapping must hold -1 or"),
]  # fmt: skip
NO_EMU_CHECK = {"layout-type", "slots-list", "rotary_offset-type"}
NO_EMU_CHECK |= {"position-range", "slot-range", "slot-minus-2"}


def _good_call() -> dict:
    return build(
        torch.float32, T=6, Hq=4, Hk=2, D=32, rotary_dim=16, block_size=4, cache_dtype=E4M3, slots="all"
    ).args()


@pytest.mark.parametrize("path", ["api", "emulated"])
@pytest.mark.parametrize("name,change,exc,match", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_call_writes_nothing(name, change, exc, match, path):
    """Each bad call raises the right exception, naming the argument, before anything is written."""
    a = _good_call()
    change(a)
    if path == "emulated":
        if not HAS_EMU:
            pytest.skip(NO_EMULATION)
        if name in NO_EMU_CHECK:
            pytest.skip("not a check of the emulated op (Python-level, or skipped there by design)")
        exc = ValueError if exc is TypeError else exc
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc, match=match):
        rope_ext.apply_rotary_qk_and_cache_(**a) if path == "api" else emulated(a, 132, False)
    for n, t in before.items():
        assert same_bits(a[n], t), f"{n} changed by a rejected call"


def test_requires_grad_raises_and_writes_nothing():
    a = _good_call()
    a["q"].requires_grad_(True)
    before = {n: t.detach().clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(RuntimeError, match="no_grad"):
        rope_ext.apply_rotary_qk_and_cache_(**a)
    for n, t in before.items():
        assert same_bits(a[n].detach(), t), n
    with torch.no_grad():  # the same call is fine without grad mode
        rope_ext.apply_rotary_qk_and_cache_(**a)


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile.


def test_opcheck():
    # test_schema compares mutated arguments with torch.allclose, which has no fp8 kernel: fp8 calls skip it.
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for dtype, kw in (
        (torch.float16, dict(q_out="same", interleaved=True, rotary_dim=32, rotary_offset=64)),
        (torch.bfloat16, dict(cache_dtype=E4M3, q_out=E5M2, layout="HND", slots="short")),
        (torch.float32, dict(cache_dtype=E5M2, packed=True, cache_view="heads", T=1)),
    ):
        c = build(dtype, **{"T": 5, "Hq": 4, "Hk": 2, "block_size": 4, **kw})
        a = c.args()
        args = [a[n] for n in ("q", "k", "v")] + [c.positions[:, None]]
        args += [a[n] for n in ("cos_sin", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale")]
        args += [a[n] for n in ("q_out", "q_scale", "interleaved", "layout", "rotary_offset")] + [None, False]
        utils = no_schema if "cache_dtype" in kw or kw.get("q_out") in FP8 else ("test_schema", *no_schema)
        opcheck(OPS.rotary_qk_cache_.default, tuple(args), test_utils=utils)


H_Q, H_K, HEAD = 4, 2, 64


def _compiled_body(separate: list, packed: list):
    """(a) separate q, k, v (fp8 HND cache, interleaved, offset); (b) views of a packed qkv made here."""
    q, k, v, pos, cs, kc, vc, sm, ks, vs = separate
    kw = dict(k_scale=ks, v_scale=vs, layout="HND", interleaved=True, rotary_offset=16)
    rope_ext.apply_rotary_qk_and_cache_(q, k, v, pos, cs, kc, vc, sm, **kw)
    qkv, pos, cs, kc, vc, sm = packed
    x = qkv.view(qkv.shape[0], H_Q + 2 * H_K, HEAD)
    q2, k2, v2 = x[:, :H_Q], x[:, H_Q : H_Q + H_K], x[:, H_Q + H_K :]
    rope_ext.apply_rotary_qk_and_cache_(q2, k2, v2, pos, cs, kc, vc, sm)
    return k * 2  # read after the in-place op (exact: no reduction order to differ)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(dynamic):
    """torch.compile(fullgraph=True) (Inductor) writes what eager writes, bit for bit, and what the references
    say; dynamic=True runs two token counts through one graph."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_body, fullgraph=True, dynamic=dynamic)
    for T in (9, 21) if dynamic else (9,):  # 3 cache blocks for both (no size equal to another by chance)
        kw = dict(T=T, Hq=H_Q, Hk=H_K, D=HEAD, rotary_dim=32, seed=T)
        a = build(torch.float16, layout="HND", cache_dtype=E4M3, rotary_offset=16, interleaved=True, **kw)
        b = build(torch.bfloat16, packed=True, **kw)
        sep = [a.q, a.k, a.v, a.positions, a.cos_sin, a.key_cache, a.value_cache, a.slot_mapping]
        sep += [a.k_scale, a.v_scale]
        packed = [b.q._base.view(T, -1), b.positions, b.cos_sin, b.key_cache, b.value_cache, b.slot_mapping]
        snaps = a.snapshot(), b.snapshot()
        sep2, packed2 = ([t.clone() for t in ts] for ts in (sep, packed))
        got, want = compiled(sep, packed), _compiled_body(sep2, packed2)
        for x, y in zip([got, *sep, *packed], [want, *sep2, *packed2], strict=True):
            assert same_bits(x, y), "compiled and eager differ"
        check(a, snaps[0])
        check(b, snaps[1])
    assert counters["stats"]["unique_graphs"] == 1, "recompiled"


# ---------------------------------------------------------------------------------------------------------
# Property test: random shapes, layouts, caches, q_out and slot patterns on every backend.


@st.composite
def cache_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    hk = draw(st.integers(1, 4))
    D = 2 * draw(st.one_of(st.integers(1, 12), st.integers(1, 128)))
    rd = 2 * draw(st.integers(1, D // 2))
    kw = dict(
        T=draw(st.integers(0, 40)), Hk=hk, Hq=hk * draw(st.sampled_from([1, 1, 2, 4])), D=D, rotary_dim=rd,
        rotary_offset=draw(st.sampled_from([0, 0, D - rd, (D - rd) // 2])),
        interleaved=draw(st.booleans()), layout=draw(st.sampled_from(["NHD", "HND"])),
        block_size=draw(st.sampled_from([1, 3, 16, 32])),
        cache_dtype=draw(st.sampled_from([None, None, E4M3, E5M2])),
        q_out=draw(st.sampled_from([None, None, "same", E4M3, E5M2])),
        slots=draw(st.sampled_from(["all", "mixed", "short", "none"])),
        cache_view=draw(st.sampled_from([None, "blocks", "heads"])),
        scale=draw(st.sampled_from([1.0, 0.01, 300.0])), seed=draw(st.integers(0, 2**31 - 1)),
        pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )  # fmt: skip
    if draw(st.booleans()):
        kw["packed"] = True
    else:
        kw["Dv"] = draw(st.sampled_from([D, 2 * draw(st.integers(1, 128)), draw(st.integers(1, 40))]))
    kw["T"] = min(kw["T"], 6000 // (kw["Hq"] * D))  # keeps a draw to a few milliseconds
    return dtype, kw, draw(st.sampled_from([1, 4, 132])), draw(st.booleans())


@property_settings()  # the existing ops' draws: 500 (more under the 'long' profile)
@given(drawn=cache_cases())
def test_property_matches_reference(drawn):
    """Random dtype, pairing, heads, D, rotary_dim and offset, T, layout, block size, cache dtype, q_out, slot
    pattern and cache view; the CPU op and the emulated body (drawn grid and path) against the references."""
    dtype, kw, num_sms, force_scalar = drawn
    run_checked(build(dtype, **kw), "cpu")
    if HAS_EMU:
        run_checked(build(dtype, **kw), (num_sms, force_scalar))

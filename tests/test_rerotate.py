"""rerotate_kv_cache_: keys already in a paged cache rotated in place by delta positions.

The definition (``_rerotate_helpers``): the key at each named slot becomes ``apply_rotary`` of it by the table
row ``|delta|`` (inversely for a negative delta), bit for bit; an fp8 key is dequantized, rotated in float32
and requantized with ``reference.quantize_fp8``, its pass-through bytes untouched. Every backend (the CPU op,
the CUDA body run on the host on two grids, vector and scalar path, and the CUDA op with a GPU) must write
exactly that on guard-filled caches and cache views, and nothing else.

Accuracy (:func:`test_shift_matches_rotation_at_the_new_position`): a key written at position p and shifted
by delta agrees with the key written at p + delta within ``(3u + (2 + sqrt 2) a) |pair| + (2 + sqrt 2) u
tiny`` per component (u: rounding unit of the cache dtype, a: arithmetic and table error of one rotation,
|pair|: the magnitude of the key's pair, tiny: the smallest normal; the test says why). Measured worst, in eps
of the cache dtype times |pair|, 512 keys of 2 x 128 features at p and p + delta in [0, 4096) (half-split /
interleaved; the bound in brackets):

* float64 (float64 table) 1.98 / 2.58 (5.6); float32 1.90 / 2.02 (5.6);
* bfloat16 0.997 / 0.997 (1.5); float16 0.998 / 0.999 (1.5; 1.34 at a subnormal |pair|, the tiny term);
* float64 keys with a float32 table 0.81 / 0.80 float32 eps (2.4: the table's rounding dominates);
* fp8 (k_scale 0.37), normal |pair|: e4m3 0.97 / 0.97 (1.59), e5m2 0.94 / 0.93 (1.69): within one fp8 step
  plus the requantization; near zero the subnormal spacing dominates (16.0 and 2.5 eps |pair|, within the
  tiny term).

Every case stays within 0.67 of its bound.

Drift (:func:`test_drift_of_successive_shifts`): n shifts by +1 against one shift by n, from keys written by
``apply_rotary_qk_and_cache_`` (256 tokens, 2 heads of 128 features, half-split, float32 table); the worst
difference in eps times |pair|, the root mean square in brackets:

=========  ============  ==============  ===============
dtype      n = 1         n = 10          n = 100
=========  ============  ==============  ===============
bfloat16   0 (0)         4.30 (0.76)     38.1 (5.04)
float32    0 (0)         5.18 (1.17)     39.5 (10.7)
=========  ============  ==============  ===============

The worst grows about linearly, some 0.4 eps |pair| per shift in both. float32's root mean square grows
linearly too: the float32 table's row 1 differs from the exact rotation by one fixed error, which n shifts
repeat; bfloat16's 8-bit roundings partly cancel. So n small shifts cost n / 5 to n / 3 times the error of one
shift by their total: a cache that shifts keys often should shift by the total once.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from _helpers import HAS_CUDA, NO_CUDA, NO_EMULATION, child_env, make_cos_sin
from _rerotate_helpers import (
    BACKENDS,
    DTYPES,
    E4M3,
    E5M2,
    EMU_BACKENDS,
    FP8,
    HAS_EMU,
    MATRIX,
    N_POS,
    OPS,
    bits,
    build,
    check,
    default_threads,
    delta_of,
    differences,
    dtype_id,
    emulated,
    one_thread,  # noqa: F401 - the autouse fixture: one thread for the references in this module
    run,
    run_checked,
    same_bits,
    slots_of,
    vectorizes,
)
from _strategies import property_settings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.library import opcheck

import rope_ext
from rope_ext import reference
from rope_ext.ops import CPU_ISAS

# ---------------------------------------------------------------------------------------------------------
# The matrix: dtypes x pairings x layouts x shapes x block sizes x backends, against the definition.

SHAPES = {
    "d128": dict(D=128),
    "d128-r64-off64": dict(D=128, R=64, offset=64),
    "d64-r32-off16": dict(D=64, R=32, offset=16, Hk=3),
    "d12-r6-off2": dict(D=12, R=6, offset=2, Hk=3),  # no 16-byte access fits (but float64 interleaved)
}
VIEWS = (None, "blocks", "heads")
ONE_SHIFT = ("one", "int", "0d")


def _vectorizes(dtype, shape: str, interleaved: bool) -> bool:
    kw = SHAPES[shape]
    offset = kw.get("offset", 0)
    return vectorizes(dtype, kw["D"], kw.get("R", kw["D"] - offset), offset, interleaved)


@pytest.mark.parametrize("backend", MATRIX)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_definition(dtype, shape, interleaved, layout, block_size, backend):
    """Two calls on one guard-filled cache: one shift per token (mixed signs, 0, -1, +-(P - 1); some slots
    -1), then one shift for all (a one-element tensor, a Python int or a 0-d tensor; every token named).
    Across the matrix the case also cycles the delta dtype, the cache view (none, a narrow() along blocks or
    heads), k_scale (fp8: 0.37 or None) and, for the float caches that allow it, a table of the cache's dtype.
    The emulated body takes its 16-byte path where the shape allows it (float caches)."""
    i = (
        DTYPES.index(dtype) * 97 + list(SHAPES).index(shape) * 31 + interleaved * 7
        + (layout == "HND") * 3 + (block_size == 16)
    )  # fmt: skip
    same_table = dtype in (torch.float64, torch.float16, torch.bfloat16) and i % 3 == 1
    kw = dict(
        interleaved=interleaved, layout=layout, block_size=block_size, view=VIEWS[i % 3],
        delta_dtype=(torch.int64, torch.int32)[i % 2], cs_dtype=dtype if same_table else torch.float32,
        scale=None if i % 4 == 0 else 0.37, seed=i, **SHAPES[shape],
    )  # fmt: skip
    c = build(dtype, **kw)
    vectorized = _vectorizes(dtype, shape, interleaved)
    run_checked(c, backend, vectorized)
    gen = torch.Generator().manual_seed(i + 1)
    n_slots = c.key_cache.shape[0] * c.key_cache.shape[1 if layout == "NHD" else 2]
    c.slot_mapping = slots_of("all", 7, n_slots, gen)
    c.delta = delta_of(ONE_SHIFT[i % 3], 7, N_POS, kw["delta_dtype"], gen)
    run_checked(c, backend, vectorized)


def _prefix_slots() -> torch.Tensor:
    """700 distinct slots of a 720-slot cache (block size 16) as a prefix shift names them: ascending runs
    across block boundaries, -1 padding, a descending stretch and runs that resume where others stopped."""
    pieces = [
        torch.arange(5, 300), torch.full((5,), -1), torch.arange(301, 420), torch.arange(500, 470, -1),
        torch.arange(600, 720), torch.arange(420, 470), torch.arange(501, 582),
    ]  # fmt: skip
    return torch.cat(pieces)


@pytest.mark.parametrize("backend", MATRIX)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_runs_of_consecutive_slots(dtype, layout, backend):
    """Consecutive slots (the CPU op rotates the consecutive rows of one block shifted one way in one call):
    runs across block boundaries and broken by -1, by a descending order and by a change of direction, one
    shift per token (signs in stretches, zeros among them) then one shift for all; 700 tokens, so that the
    parallel loop's chunks split runs too."""
    c = build(dtype, T=700, D=64, R=32, offset=16, layout=layout, interleaved=layout == "HND", seed=7)
    assert c.key_cache.shape[0] * 16 == 720
    c.slot_mapping = _prefix_slots()
    t = torch.arange(700)
    g = torch.Generator().manual_seed(8)
    sign = torch.where((t // 37) % 3 == 0, -1, 1)
    c.delta = torch.randint(1, N_POS, (700,), generator=g) * sign * (t % 29 != 0)
    run_checked(c, backend)
    c.delta = torch.tensor([-N_POS + 1], dtype=torch.int32)
    run_checked(c, backend)


NOTHING_NAMED = (("none", 9, "tokens"), ("none", 3, "int"), ("all", 0, "tokens"), ("all", 0, "one"))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_no_named_slot_writes_nothing(dtype, backend):
    """Every slot -1, or no token at all (T = 0; delta of shape [0], one element or an int): nothing moves.
    (The emulated body with T = 0 runs in a child process: test_no_tokens_on_emulation.)"""
    for slots, T, delta in NOTHING_NAMED:
        if T == 0 and backend in EMU_BACKENDS:
            continue
        c = build(dtype, T=T, slots=slots, delta=delta, layout="HND", view="heads", seed=T)
        s = c.snapshot()
        run(c, backend)
        check(c, s, backend)
        assert same_bits(c.base, s["base"])


_NO_TOKENS_ON_EMULATION = """
import torch

import rope_ext
import rope_ext._C_testing

cs = rope_ext.RopeCache(16, max_positions=20).cos_sin
for dtype in (torch.float32, torch.float8_e4m3fn):
    for delta in (torch.zeros(0, dtype=torch.long), torch.tensor([3])):
        for num_sms, force_scalar in ((132, False), (1, True), (1, False), (132, True)):
            cache = torch.randn(3, 4, 2, 32).to(dtype)
            before = cache.clone()
            torch.ops.rope_ext._cuda_emulated_rerotate(
                cache, torch.zeros(0, dtype=torch.long), delta, cs, None, False, "NHD", 0, num_sms,
                force_scalar,
            )
            assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
print("ok")
"""


def test_no_tokens_on_emulation():
    """The emulated CUDA body with no token (T = 0) writes nothing and returns; a child process, since a
    crash there (an integer division by the token count) would take the test worker with it."""
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    done = subprocess.run(
        [sys.executable, "-c", _NO_TOKENS_ON_EMULATION], capture_output=True, text=True, env=child_env(),
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        f"exit status {done.returncode} (negative: the signal that ended it):\n{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_decode_shapes(backend):
    """One to four tokens (decode; on the emulated grid a token's heads spread over blocks), many heads."""
    for T in (1, 2, 3, 4):
        for dtype in (torch.bfloat16, E4M3):
            c = build(dtype, T=T, Hk=8, slots="all", delta="tokens", seed=T, interleaved=T % 2 == 1)
            run_checked(c, backend)


def test_delta_of_unnamed_tokens_is_not_checked():
    """A token with slot -1 is skipped before its shift is read: any shift, even one no table holds."""
    for delta_dtype, huge in ((torch.int64, (2**63 - 1, -(2**63))), (torch.int32, (2**31 - 1, -(2**31)))):
        c = build(torch.float32, T=6, slots="all", seed=5, delta_dtype=delta_dtype)
        c.slot_mapping[1] = c.slot_mapping[4] = -1
        c.delta[1], c.delta[4] = huge
        run_checked(c, "cpu")


# The CUDA op and its emulation skip a token whose slot is outside the cache or whose shift no table row holds
# (the CPU op raises: test_rejected_call_writes_nothing); the other tokens are shifted.
BAD_TOKENS = {
    "slot-minus-2": dict(slot=-2),
    "slot-num-slots": dict(slot="n"),
    "slot-int64-max": dict(slot=2**63 - 1),
    "slot-int64-min": dict(slot=-(2**63)),
    "delta-plus-P": dict(delta=N_POS),
    "delta-minus-P": dict(delta=-N_POS),
    "delta-int64-max": dict(delta=2**63 - 1),
    "delta-int64-min": dict(delta=-(2**63)),
    "delta-int32-min": dict(delta=-(2**31), delta_dtype=torch.int32),
}


@pytest.mark.parametrize("backend", [*EMU_BACKENDS, "cuda"])
@pytest.mark.parametrize("bad", list(BAD_TOKENS))
def test_out_of_range_token_is_skipped_on_device(bad, backend):
    spec = BAD_TOKENS[bad]
    for dtype in (torch.float16, E5M2):
        c = build(dtype, T=9, slots="all", delta_dtype=spec.get("delta_dtype", torch.int64), seed=3)
        n_slots = c.key_cache.shape[0] * c.key_cache.shape[1]
        if "slot" in spec:
            c.slot_mapping[3] = n_slots if spec["slot"] == "n" else spec["slot"]
        else:
            c.delta[3] = spec["delta"]
        c.slot_mapping[7] = -1
        run_checked(c, backend)


# ---------------------------------------------------------------------------------------------------------
# Signed zeros: the formula of every path (rope.h rotate_pair; test_bit_equal.py: one rotation, bit for bit,
# on every path) settles the sign of an exact zero.


def _pairs(rows: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``[N, D/2, 2]`` view of ``rows [N, D]``: the two features of each pair."""
    n, d = rows.shape
    return rows.view(n, d // 2, 2) if interleaved else rows.view(n, 2, d // 2).transpose(1, 2)


@pytest.mark.parametrize("backend", ["cpu", "emu-132sm", "emu-1sm-scalar", "cuda"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, E4M3], ids=dtype_id)
def test_signed_zeros_follow_rotate_pair(dtype, interleaved, backend):
    """Pairs of +-0 and +-1 (all 16) shifted by 0 (cos 1, sin 0: an exact zero takes its sign from the
    formula) and by -1, D = 16 and 128 (the vector kernels' block and whole-head paths), on every CPU
    instruction set and on the emulated CUDA body: the bits of rotate_pair, ``y1 = fma(x1, c, x2 (-s))``,
    ``y2 = fma(x2, c, x1 s)``. With these inputs every product is exact and the fma one rounding of an exact
    float64 sum, signed zeros included."""
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0], dtype=torch.float64)
    x1, x2 = vals.repeat_interleave(4)[:, None], vals.repeat(4)[:, None]
    isas = [i for i in CPU_ISAS if OPS._cpu_isa_supported(i)] if backend == "cpu" else [None]
    for D in (16, 128):
        cs = make_cos_sin(4, D)
        for d in (0, -1):
            c, s = cs[abs(d), : D // 2].double(), cs[abs(d), D // 2 :].double() * (-1.0 if d < 0 else 1.0)
            want = torch.zeros(16, D)
            _pairs(want, interleaved)[..., 0] = (x1 * c + x2 * -s).float()
            _pairs(want, interleaved)[..., 1] = (x2 * c + x1 * s).float()
            want = want.to(dtype)
            for isa in isas:
                rows = torch.zeros(16, D)
                _pairs(rows, interleaved)[..., 0], _pairs(rows, interleaved)[..., 1] = x1.float(), x2.float()
                cache = rows.to(dtype).view(16, 1, 1, D)
                a = dict(key_cache=cache, slot_mapping=torch.arange(16), delta=d, cos_sin=cs, layout="NHD",
                         interleaved=interleaved, k_scale=None, rotary_offset=0)  # fmt: skip
                previous = rope_ext._set_cpu_isa(isa) if isa else None
                try:
                    run(a, backend)
                finally:
                    if previous:
                        rope_ext._set_cpu_isa(previous)
                got = cache.view(16, D)
                assert same_bits(got, want), f"isa {isa}, D {D}, delta {d}: " + differences(got, want)


# ---------------------------------------------------------------------------------------------------------
# Every CPU instruction set: one result.

ISAS = [i for i in CPU_ISAS if OPS._cpu_isa_supported(i)]
ISA_SHAPES = [
    dict(D=128),
    dict(D=128, R=64, offset=64),
    dict(D=64, R=32, offset=16),
    dict(D=12, R=6, offset=2),
    dict(D=130, R=130),  # vector blocks with tails of 1 and 3 pairs
    dict(D=80, R=46, offset=18),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_every_cpu_isa_gives_the_same_bits(dtype):
    """The CPU op under each instruction set this CPU runs (rope_ext._set_cpu_isa, restored after) writes the
    bits of the portable ("scalar") build, which are the definition's."""
    for j, shape in enumerate(ISA_SHAPES):
        for interleaved in (False, True):
            kw = dict(T=16, Hk=3, interleaved=interleaved, seed=j, view=VIEWS[j % 3], **shape)
            want = None
            for isa in ISAS:
                c = build(dtype, **kw)
                s = c.snapshot()
                previous = rope_ext._set_cpu_isa(isa)
                try:
                    run(c, "cpu")
                    if isa == "scalar":
                        check(c, s)  # the definition, under the portable build's apply_rotary
                finally:
                    rope_ext._set_cpu_isa(previous)
                if want is None:
                    want = c.base
                where = f"{isa} vs {ISAS[0]}, {shape}, interleaved={interleaved}: "
                assert same_bits(c.base, want), where + differences(c.base, want)


# ---------------------------------------------------------------------------------------------------------
# Accuracy: a shifted key against the key rotated at its new position.

P_ACC = 4096
U32 = 2.0**-24
SQRT2 = math.sqrt(2.0)
# id: (cache dtype, table dtype)
ACCURACY = {
    "float64": (torch.float64, torch.float64),
    "float64-f32-table": (torch.float64, torch.float32),
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.float32),
    "float16": (torch.float16, torch.float32),
    "float8_e4m3fn": (E4M3, torch.float32),
    "float8_e5m2": (E5M2, torch.float32),
}
FP8_SCALE = 0.37


def _contract(dtype, table_dtype) -> tuple[float, float, float]:
    """``(u, a, tiny)``: the rounding unit of the stored values (half their eps), the error of one rotation's
    arithmetic and table per unit of |pair| (beyond the rounding to the stored dtype), and the smallest normal
    stored value (the subnormal spacing is ``2 u tiny``). Per rotated component:

    * float32, float64 (products and fma in the dtype): the product ``x2 s`` rounded (u) and the table's
      error ``tau`` on c and s (``sqrt 2 tau |pair|``); the fma's rounding is the rounding to the dtype. A
      float32 table is within ``tau = u32`` of cos and sin; the float64 one within one float64 rounding unit
      (measured with mpmath: 0.98 u64), so ``a = (1 + sqrt 2) u`` with the table of the cache's dtype and
      ``u64 + sqrt 2 u32`` for float64 keys with a float32 table.
    * bfloat16, float16: float32 product, fma and table: ``a = (2 + sqrt 2) u32``; fp8 also dequantizes
      (one more float32 product): ``a = (3 + sqrt 2) u32``.
    """
    if dtype in FP8:
        f = torch.finfo(dtype)
        return f.eps / 2, (3 + SQRT2) * U32, f.smallest_normal * FP8_SCALE
    f = torch.finfo(dtype)
    u = f.eps / 2
    if dtype in (torch.float32, torch.float64):
        if table_dtype == dtype:
            return u, (1 + SQRT2) * u, f.smallest_normal
        return u, u + SQRT2 * U32, f.smallest_normal
    return u, (2 + SQRT2) * U32, f.smallest_normal


def _pair_magnitude(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """sqrt(x1^2 + x2^2) of each feature's pair (float64, x's shape): what a rotation keeps."""
    x = x.double()
    h = x.shape[-1] // 2
    if interleaved:
        return x.unflatten(-1, (h, 2)).norm(dim=-1).repeat_interleave(2, dim=-1)
    m = torch.sqrt(x[..., :h] ** 2 + x[..., h:] ** 2)
    return torch.cat([m, m], dim=-1)


def _written_keys(dtype, table_dtype, interleaved, T, H, D, seed, p_max=P_ACC, first=()):
    """Keys k0 (fp8 caches: float32 keys) written at random positions p (the first ones ``first``) into a
    cache of ``dtype`` by apply_rotary_qk_and_cache_. Returns (k0, p, cache, slots, cos_sin, k_scale)."""
    g = torch.Generator().manual_seed(seed)
    fp8 = dtype in FP8
    kdt = torch.float32 if fp8 else dtype
    # magnitudes over 16 binades (fp8: below the saturation at 448 * scale; float16: into its subnormals)
    lo, hi = (-12, 4) if fp8 else (-8, 8)
    mag = torch.exp2(torch.randint(lo, hi + 1, (T, H, 1), generator=g).double())
    k0 = (torch.randn(T, H, D, generator=g, dtype=torch.float64) * mag).to(kdt)
    p = torch.randint(0, p_max, (T,), generator=g)
    p[: len(first)] = torch.tensor(first, dtype=p.dtype)
    cs = make_cos_sin(P_ACC, D, dtype=table_dtype)
    nb = T // 16 + 2
    cache = torch.zeros(nb, 16, H, D, dtype=dtype)
    slots = torch.randperm(nb * 16, generator=g)[:T]
    scale = torch.tensor([FP8_SCALE]) if fp8 else None
    k = k0.clone()
    rope_ext.apply_rotary_qk_and_cache_(
        torch.zeros(T, 1, D, dtype=kdt), k, torch.zeros_like(k), p, cs, cache, torch.zeros_like(cache), slots,
        interleaved=interleaved, k_scale=scale, v_scale=scale,
    )  # fmt: skip
    return k0, p, cache, slots, cs, scale


def _dequantized(rows: torch.Tensor, scale) -> torch.Tensor:
    return rows.double() * (1.0 if scale is None else float(scale))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", list(ACCURACY))
def test_shift_matches_rotation_at_the_new_position(case, interleaved):
    """Keys written at p (apply_rotary_qk_and_cache_), shifted by delta (p + delta in [0, 4096): negative
    shifts to p - |delta| too, 0, and the extremes +-4095), against the keys written at p + delta:

        |shifted - direct| <= (3u + (2 + sqrt 2) a) |pair| + (2 + sqrt 2) u tiny     (per component)

    (u, a, tiny: :func:`_contract`; fp8: values dequantized, u and tiny of the fp8 type, tiny times the scale,
    |pair| of the float32 keys, and the bound times 1 + u for the rotation of a quantized key). Why: the
    rotations are exact rotations R(p), R(delta), R(p + delta) = R(delta) R(p) plus errors. Rounding to the
    stored dtype errs by at most u |y_i| per component (u tiny more below tiny), so the written key's rounding
    error, a vector of norm <= u |pair|, rotated, adds <= u |pair| to each component, the shift's and the
    direct write's roundings u |pair| each: 3u. The arithmetic and table errors a |pair| per component (both
    components: sqrt 2 a as a vector) of the three rotations add (sqrt 2 + 1 + 1) a. In eps (2u): float64,
    float32 5.6; bfloat16, float16 1.5 (+ 1e-4 bf16, 7e-4 f16); fp8 1.5 (1 + u): one fp8 step plus the
    requantization, e4m3 1.59, e5m2 1.69; float64 keys with a float32 table 2.4 float32 eps. Measured: see
    the module docstring.
    """
    dtype, table_dtype = ACCURACY[case]
    T, H, D = 512, 2, 128
    seed = list(ACCURACY).index(case) * 2 + interleaved
    first = (0, P_ACC - 1, 17)
    k0, p, cache, slots, cs, scale = _written_keys(
        dtype, table_dtype, interleaved, T, H, D, seed, first=first
    )
    g = torch.Generator().manual_seed(seed + 100)
    new = torch.randint(0, P_ACC, (T,), generator=g)
    new[:3] = torch.tensor([P_ACC - 1, 0, 17])  # shifts +4095, -4095, 0
    assert (new < p).sum() > T // 3 and (new > p).sum() > T // 3
    with default_threads():
        rope_ext.rerotate_kv_cache_(cache, slots, new - p, cs, interleaved=interleaved, k_scale=scale)
    shifted = cache.view(-1, H, D)[slots]
    direct = rope_ext.apply_rotary(k0, new[:, None], cs, interleaved=interleaved)
    if dtype in FP8:
        direct = reference.quantize_fp8(direct, scale, dtype)
    err = (_dequantized(shifted, scale) - _dequantized(direct, scale)).abs()
    u, a, tiny = _contract(dtype, table_dtype)
    pair = _pair_magnitude(k0, interleaved)
    bound = (3 * u + (2 + SQRT2) * a) * pair + (2 + SQRT2) * u * tiny
    if dtype in FP8:
        bound = bound * (1 + u)
    bad = err > bound
    worst = (err / (2 * u * pair).clamp_min(1e-300)).max().item()
    assert not bad.any(), (
        f"{int(bad.sum())} components past the bound; worst {worst:.3f} eps |pair| at p, delta = "
        f"{p[bad.nonzero()[0, 0]].item()}, {(new - p)[bad.nonzero()[0, 0]].item()}"
    )


# n: (bf16 bound, float32 bound) on the worst difference after n shifts by +1 against one shift by n, in eps
# |pair|: about twice the measured (module docstring), so that a change that loses more precision shows.
DRIFT = {1: (0.0, 0.0), 10: (8.0, 10.0), 100: (64.0, 80.0)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_drift_of_successive_shifts(dtype):
    """n shifts by +1 against one shift by n, n = 1, 10, 100 (module docstring: the measured drift). One shift
    by 1 is the shift by n = 1, bit for bit."""
    T, H, D = 256, 2, 128
    k0, p, cache, slots, cs, _ = _written_keys(
        dtype, torch.float32, False, T, H, D, seed=5, p_max=P_ACC - 128
    )
    pair = _pair_magnitude(k0, False)
    eps = torch.finfo(dtype).eps
    for n, bounds in DRIFT.items():
        stepped, once = cache.clone(), cache.clone()
        with default_threads():
            for _ in range(n):
                rope_ext.rerotate_kv_cache_(stepped, slots, 1, cs)
            rope_ext.rerotate_kv_cache_(once, slots, n, cs)
        a, b = (x.view(-1, H, D)[slots].double() for x in (stepped, once))
        worst = ((a - b).abs() / (eps * pair)).max().item()
        assert worst <= bounds[dtype == torch.float32], f"n = {n}: drift {worst:.3f} eps |pair|"


# ---------------------------------------------------------------------------------------------------------
# Rejected calls: the right exception naming the argument, and nothing written.


def _set(key, fn):
    """Replaces argument ``key`` with ``fn(a[key])`` (``fn`` a value: that value)."""
    return lambda a: a.update({key: fn(a[key]) if callable(fn) else fn})


def _at(key, i, value, dtype=None):
    """Element i of tensor argument ``key`` set to ``value`` (the tensor converted to ``dtype`` first)."""

    def change(a):
        t = a[key].clone() if dtype is None else a[key].to(dtype)
        t[i] = value
        a[key] = t

    return change


def _in_cache(key, n, dtype=None):
    """Argument ``key`` replaced by n elements (of ``dtype``) of the cache's own memory."""

    def change(a):
        cache = a["key_cache"]
        flat = cache.view(-1) if dtype is None else cache.view(dtype).view(-1)
        a[key] = flat[:n] if key != "cos_sin" else flat[: n * a["cos_sin"].shape[1]].view(n, -1)

    return change


def _f64_cache(a):
    a["key_cache"] = torch.randn(a["key_cache"].shape, dtype=torch.float64)
    a["cos_sin"] = a["cos_sin"].double()


def _dup(a):
    s = a["slot_mapping"].clone()
    s[4] = s[0]
    a["slot_mapping"] = s


VE, TE, IE = ValueError, TypeError, IndexError
N_SLOTS = 4 * 4  # the good call's cache: 4 blocks of 4 rows
# (id, change to a good call, exception, message). The good call: a float32 NHD cache [4, 4, 2, 32], T = 6,
# every slot named, one shift per token, a [32, 16] table at rotary_offset 8; fp8 entries ("-fp8") on an
# e4m3 cache with k_scale.
REJECTED = [
    ("slot-minus-2", _at("slot_mapping", 1, -2), IE, r"slot_mapping must hold -1 or slots in \[0, .*got -2"),
    ("slot-num-slots", _at("slot_mapping", 1, N_SLOTS), IE, f"slot_mapping must hold .*got {N_SLOTS}"),
    ("slot-int64-max", _at("slot_mapping", 1, 2**63 - 1), IE, f"slot_mapping must hold .*got {2**63 - 1}"),
    ("slot-int64-min", _at("slot_mapping", 1, -(2**63)), IE, f"slot_mapping must hold .*got {-(2**63)}"),
    ("slot-duplicate", _dup, VE, "slot_mapping holds slot .* twice"),
    ("delta-plus-P", _at("delta", 2, 32), IE, r"delta must be in \(-cos_sin.shape\[0\], .*got 32"),
    ("delta-minus-P", _at("delta", 2, -32), IE, "delta must be in .*got -32"),
    ("delta-int64-max", _at("delta", 2, 2**63 - 1), IE, f"delta must be in .*got {2**63 - 1}"),
    ("delta-int64-min", _at("delta", 2, -(2**63)), IE, f"delta must be in .*got {-(2**63)}"),
    ("delta-int32-min", _at("delta", 2, -(2**31), torch.int32), IE, f"delta must be in .*got {-(2**31)}"),
    ("delta-one-P", _set("delta", torch.tensor([32])), IE, "delta must be in .*got 32"),
    ("delta-int-P", _set("delta", 32), IE, "delta must be in .*got 32"),
    ("delta-int-minus-P", _set("delta", -32), IE, "delta must be in .*got -32"),
    ("delta-int-2**63", _set("delta", 2**63), IE, f"delta must be in .*got {2**63}"),
    ("delta-int-minus-2**63", _set("delta", -(2**63)), IE, f"delta must be in .*got {-(2**63)}"),
    ("delta-int-minus-2**63-1", _set("delta", -(2**63) - 1), IE, f"delta must be in .*got {-(2**63) - 1}"),
    ("offset-minus-1", _set("rotary_offset", -1), VE, r"rotary_offset must be in \[0, head_dim - rot"),
    ("offset-too-big", _set("rotary_offset", 17), VE, r"rotary_offset must be .* = \[0, 16\], got 17"),
    ("offset-int64-max", _set("rotary_offset", 2**63 - 1), VE, f"rotary_offset must be in .*got {2**63 - 1}"),
    ("offset-float", _set("rotary_offset", 8.0), TE, "rotary_offset must be an int"),
    ("cache-int8", _set("key_cache", lambda c: torch.zeros(c.shape, dtype=torch.int8)), TE,
     "key_cache must be a float or fp8 tensor"),
    ("delta-float", _set("delta", lambda d: d.float()), TE, "delta must be an int32 or int64 tensor"),
    ("delta-python-float", _set("delta", 1.0), TE, "delta must be a torch.Tensor, got float"),
    ("delta-bool", _set("delta", True), TE, "delta must be a torch.Tensor, got bool"),
    ("slots-int32", _set("slot_mapping", lambda s: s.int()), TE, "slot_mapping must be an int64 tensor"),
    ("cos_sin-f64", _set("cos_sin", lambda c: c.double()), TE,
     r"cos_sin must be float32 or the dtype of key_cache \(Float\), got Double"),
    ("k_scale-f64-fp8", _set("k_scale", torch.tensor([0.5]).double()), TE, "k_scale must be a float32"),
    ("k_scale-f64", _set("k_scale", torch.tensor([0.5]).double()), TE, "k_scale must be a float32"),
    ("k_scale-two-fp8", _set("k_scale", torch.tensor([0.5, 0.5])), VE, "k_scale must have one element"),
    ("k_scale-int-fp8", _set("k_scale", torch.tensor([2])), TE, "k_scale must be a float32"),
    ("cos_sin-f16-fp8", _set("cos_sin", lambda c: c.half()), TE, "cos_sin must be float32 or the dtype"),
    ("cos_sin-fp8-fp8", _set("cos_sin", lambda c: c.to(E4M3)), TE, "cos_sin must be float32 for an fp8 key"),
    ("cache-3d", _set("key_cache", lambda c: c[0]), VE, r"key_cache must be 4-d \[num_blocks, block_size"),
    ("cache-5d", _set("key_cache", lambda c: c[None]), VE, "key_cache must be 4-d"),
    ("slots-2d", _set("slot_mapping", lambda s: s[None]), VE, r"slot_mapping must be \[T\], got shape \[1,"),
    ("delta-short", _set("delta", lambda d: d[:5]), VE, r"delta must be \[T\] .*T = 6.*got shape \[5\]"),
    ("delta-2d", _set("delta", lambda d: d[None]), VE, r"delta must be \[T\] .*got shape \[1, 6\]"),
    ("delta-empty", _set("delta", lambda d: d[:0]), VE, r"delta must be \[T\] .*got shape \[0\]"),
    ("cache-expanded", _set("key_cache", lambda c: c[:1].expand_as(c)), VE,
     r"key_cache has elements that overlap in memory \(expanded"),
    ("cache-last-dim", _set("key_cache", lambda c: c.repeat(1, 1, 1, 2)[..., ::2]), VE,
     "key_cache must have a contiguous last dim"),
    ("cos_sin-in-cache", _in_cache("cos_sin", 32), VE, "key_cache and cos_sin overlap in memory"),
    ("slots-in-cache", lambda a: (_f64_cache(a), _in_cache("slot_mapping", 6, torch.int64)(a)), VE,
     "key_cache and slot_mapping overlap in memory"),
    ("delta-in-cache", lambda a: (_f64_cache(a), _in_cache("delta", 6, torch.int64)(a)), VE,
     "key_cache and delta overlap in memory"),
    ("k_scale-in-cache", _in_cache("k_scale", 1), VE, "key_cache and k_scale overlap in memory"),
    ("layout-lower", _set("layout", "nhd"), VE, "layout must be 'NHD' or 'HND', got 'nhd'"),
    ("layout-int", _set("layout", 1), TE, "layout must be 'NHD' or 'HND', got int"),
    ("cos_sin-odd", _set("cos_sin", lambda c: c[:, :15]), VE, r"rotary_dim \(cos_sin.shape\[-1\]\) must"),
    ("cos_sin-wide", _set("cos_sin", lambda c: torch.cat([c, c, c], 1)), VE, r"must be <= head_dim"),
    ("cos_sin-1d", _set("cos_sin", lambda c: c[0]), VE, r"cos_sin must have shape \[positions, rotary_dim\]"),
    ("slots-list", _set("slot_mapping", lambda s: s.tolist()), TE, "slot_mapping must be a torch.Tensor"),
    ("cache-none", _set("key_cache", None), TE, "key_cache must be a torch.Tensor, got NoneType"),
    ("slots-none", _set("slot_mapping", None), TE, "slot_mapping must be a torch.Tensor, got NoneType"),
    ("delta-none", _set("delta", None), TE, "delta must be a torch.Tensor, got NoneType"),
    ("cos_sin-none", _set("cos_sin", None), TE, "cos_sin must be a torch.Tensor, got NoneType"),
]  # fmt: skip
# Checks of the API alone (Python types, and the CPU op's range checks, which the CUDA body replaces by
# skipping the token): not checks of the emulated op.
NO_EMU_CHECK = {r[0] for r in REJECTED if r[2] is IE} | {
    "offset-float", "delta-python-float", "delta-bool", "layout-int", "slots-list", "slot-duplicate",
    "cache-none", "slots-none", "delta-none", "cos_sin-none",
}  # fmt: skip


def _good_call(fp8: bool) -> dict:
    g = torch.Generator().manual_seed(11)
    dtype = E4M3 if fp8 else torch.float32
    cache = (torch.randn(4, 4, 2, 32, generator=g) * 3).to(dtype)
    return dict(
        key_cache=cache, slot_mapping=torch.randperm(N_SLOTS, generator=g)[:6],
        delta=torch.tensor([3, -5, 0, 31, -31, 1]), cos_sin=make_cos_sin(32, 16), layout="NHD",
        interleaved=fp8, k_scale=torch.tensor([0.5]) if fp8 else None, rotary_offset=8,
    )  # fmt: skip


REJECTED_CALLS = [
    pytest.param(*r, path, id=f"{r[0]}-{path}")
    for path in ("api", "emulated")
    for r in REJECTED
    if path == "api" or r[0] not in NO_EMU_CHECK
]


@pytest.mark.parametrize("name,change,exc,match,path", REJECTED_CALLS)
def test_rejected_call_writes_nothing(name, change, exc, match, path):
    """Each bad call raises the right exception, naming the argument, before anything is written: the cache
    (and every other tensor) keeps its bits. The emulated op raises ValueError for the API's TypeError."""
    a = _good_call(fp8=name.endswith("-fp8"))
    change(a)
    if path == "emulated":
        if not HAS_EMU:
            pytest.skip(NO_EMULATION)
        exc = ValueError if exc is TypeError else exc
    before = {n: (t, t.clone()) for n, t in a.items() if isinstance(t, torch.Tensor)}
    if isinstance(a["key_cache"], torch.Tensor) and a["key_cache"]._base is not None:
        base = a["key_cache"]._base
        before["cache base"] = (base, base.clone())
    with pytest.raises(exc, match=match):
        with default_threads():
            rope_ext.rerotate_kv_cache_(**a) if path == "api" else emulated(a, 132, False)
    for n, (t, t0) in before.items():
        assert torch.equal(bits(t), bits(t0)), f"{n} changed by a rejected call"


def test_requires_grad_raises_and_writes_nothing():
    a = _good_call(fp8=False)
    a["key_cache"].requires_grad_(True)
    before = a["key_cache"].detach().clone()
    with pytest.raises(RuntimeError, match="key_cache requires grad.*no_grad"):
        rope_ext.rerotate_kv_cache_(**a)
    assert torch.equal(bits(a["key_cache"].detach()), bits(before))
    with torch.no_grad():  # the same call is fine without grad mode
        rope_ext.rerotate_kv_cache_(**a)
    assert not torch.equal(a["key_cache"].detach(), before)


def test_position_checks_on_cuda():
    """With rope_ext.set_position_checks(True), eager CUDA calls raise as the CPU op does, nothing written."""
    if not HAS_CUDA:
        pytest.skip(NO_CUDA)
    cases = [(_at("slot_mapping", 1, N_SLOTS), IE), (_at("delta", 2, -32), IE), (_dup, VE)]
    rope_ext.set_position_checks(True)
    try:
        for change, exc in cases:
            a = _good_call(fp8=False)
            change(a)
            a = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in a.items()}
            before = a["key_cache"].clone()
            with pytest.raises(exc):
                rope_ext.rerotate_kv_cache_(**a)
            assert torch.equal(a["key_cache"], before)
    finally:
        rope_ext.set_position_checks(False)


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile.


def test_opcheck():
    # test_schema compares mutated arguments with torch.allclose, which has no fp8 kernel: fp8 calls skip it.
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for dtype, kw in (
        (torch.bfloat16, dict(interleaved=True, R=32, offset=64)),
        (torch.float32, dict(layout="HND", delta="one", delta_dtype=torch.int32, slots="mixed")),
        (torch.float64, dict(cs_dtype=torch.float64, block_size=1)),
        (E4M3, dict(layout="HND", R=64, offset=32, slots="mixed")),
        (E5M2, dict(interleaved=True, scale=None, delta="one")),
    ):
        c = build(
            dtype, **{"T": 5, "Hk": 2, "D": 128, "block_size": 4, "specials": False, "slots": "all", **kw}
        )
        args = (c.key_cache, c.slot_mapping, c.delta, c.cos_sin, c.k_scale, c.interleaved, c.layout,
                c.rotary_offset)  # fmt: skip
        utils = no_schema if dtype in FP8 else ("test_schema", *no_schema)
        opcheck(OPS.rerotate_kv_cache_.default, args, test_utils=utils)


def _compiled_body(cache, base, slots, delta, cos_sin, k_scale):
    """A cache view given as an argument (HND, interleaved, offset, per-token shifts), then a view made in
    the graph (NHD, a Python int shift), then a read of the first cache after the in-place ops."""
    kw = dict(k_scale=k_scale, rotary_offset=16)
    rope_ext.rerotate_kv_cache_(cache, slots, delta, cos_sin, layout="HND", interleaved=True, **kw)
    rope_ext.rerotate_kv_cache_(base.narrow(0, 1, base.shape[0] - 3), slots, -7, cos_sin, **kw)
    return cache.float() * 2


def _compile_inputs(dtype, T):
    """The arguments of _compiled_body and the two cases they come from (the second: its NHD call)."""
    kw = dict(T=T, D=64, R=32, offset=16, block_size=4, seed=T)
    hnd = build(dtype, layout="HND", view="heads", interleaved=True, delta_dtype=torch.int32, **kw)
    nhd = build(dtype, layout="NHD", view="blocks", **kw)  # a view of blocks 1 .. nb of its base
    nhd.slot_mapping, nhd.delta = hnd.slot_mapping, -7
    return [hnd.key_cache, nhd.base, hnd.slot_mapping, hnd.delta, hnd.cos_sin, hnd.k_scale], hnd, nhd


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=dtype_id)
def test_compile_fullgraph_matches_eager(dtype, backend, dynamic):
    """torch.compile(fullgraph=True) writes what eager writes, bit for bit, on cache views (passed in, and
    made in the graph; the guards around them kept) and returns the same read of the cache after it;
    dynamic=True runs two token counts through one graph."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_body, fullgraph=True, backend=backend, dynamic=dynamic)
    for T in (9, 21) if dynamic else (7,):  # no size of one run equal to another by chance
        args, hnd, nhd = _compile_inputs(dtype, T)
        snapshots = hnd.snapshot(), nhd.snapshot()
        args2, hnd2, nhd2 = _compile_inputs(dtype, T)
        got, want = compiled(*args), _compiled_body(*args2)
        assert same_bits(got, want), "compiled and eager read different caches"
        assert same_bits(hnd.base, hnd2.base) and same_bits(nhd.base, nhd2.base), "compiled and eager differ"
        check(hnd, snapshots[0])  # and both are the definition
        check(nhd, snapshots[1])
    assert counters["stats"]["unique_graphs"] == 1, "recompiled"


# ---------------------------------------------------------------------------------------------------------
# Property test: random shapes, dtypes, shifts, slots and views against the definition.


@st.composite
def rerotate_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    D = 2 * draw(st.one_of(st.integers(1, 12), st.integers(1, 128)))
    R = 2 * draw(st.integers(1, D // 2))
    same_table = dtype not in FP8 and dtype != torch.float32 and draw(st.booleans())
    kw = dict(
        D=D, R=R, offset=draw(st.sampled_from([0, D - R, (D - R) // 2])), Hk=draw(st.integers(1, 4)),
        block_size=draw(st.sampled_from([1, 3, 16])), layout=draw(st.sampled_from(["NHD", "HND"])),
        interleaved=draw(st.booleans()), T=draw(st.integers(0, 24)),
        slots=draw(st.sampled_from(["all", "mixed", "none"])),
        delta=draw(st.sampled_from(["tokens", "one", "0d", "int"])),
        delta_dtype=draw(st.sampled_from([torch.int32, torch.int64])), view=draw(st.sampled_from(VIEWS)),
        cs_dtype=dtype if same_table else torch.float32, scale=draw(st.sampled_from([None, 0.37, 3.0])),
        n_pos=draw(st.sampled_from([2, 7, N_POS])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip
    kw["T"] = min(kw["T"], 4000 // (kw["Hk"] * D))  # keeps a draw to a few milliseconds
    return dtype, kw


@property_settings(ci=300)
@given(drawn=rerotate_cases())
def test_property_matches_definition(drawn):
    """Random dtype, head_dim, rotary_dim and offset, heads, block size, layout, pairing, T, slot pattern,
    shift kind and dtype, cache view, table dtype and length, k_scale: the CPU op writes the definition."""
    dtype, kw = drawn
    run_checked(build(dtype, **kw), "cpu")

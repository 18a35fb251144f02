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
from _helpers import NO_EMULATION, child_env, make_cos_sin
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
    VIEWS,
    build,
    check,
    default_threads,
    delta_of,
    differences,
    dtype_id,
    one_thread,  # noqa: F401 - the autouse fixture: one thread for the references in this module
    run,
    run_checked,
    same_bits,
    slots_of,
    vectorizes,
)

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


@pytest.mark.parametrize("scale", [None, 0.37, 2.0**-3], ids=["no-scale", "0.37", "2^-3"])
@pytest.mark.parametrize("dtype", FP8, ids=dtype_id)
def test_fp8_every_code_under_every_cpu_isa(dtype, scale):
    """Every fp8 code (zeros, subnormals, normals, the largest, NaN and, for e5m2, the infinities; both signs)
    at random features of 600 tokens of 8 heads of 64 features, dequantized by each instruction set's row
    kernel: the bits of the portable build, which are the definition's. Each thread's 300 tokens span several
    runs of the fp8 path's scratch (64 tokens of these rows), one shift per token of mixed signs."""
    want = None
    for isa in ISAS:
        c = build(dtype, T=600, Hk=8, D=64, block_size=16, scale=scale, seed=5)
        n = c.key_cache.numel()  # a contiguous cache (no view): every code at least n // 256 times
        gen = torch.Generator().manual_seed(11)
        codes = (torch.arange(n) % 256)[torch.randperm(n, generator=gen)].to(torch.uint8)
        c.key_cache.view(torch.uint8).view(-1).copy_(codes)
        s = c.snapshot()
        previous = rope_ext._set_cpu_isa(isa)
        try:
            run(c, "cpu")
            if isa == "scalar":
                check(c, s)
        finally:
            rope_ext._set_cpu_isa(previous)
        if want is None:
            want = c.base
        assert same_bits(c.base, want), f"{isa} vs {ISAS[0]}: " + differences(c.base, want)


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

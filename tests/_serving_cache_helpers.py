"""Shared by the tests of apply_rotary_qk_and_cache_ (test_serving_cache.py, test_serving_fp8.py): the cases
(:func:`build`), the runs on the CPU op, the CUDA op and the emulated CUDA body (:func:`run`), and the checks
against the float64 references and the pure-PyTorch cache model (:func:`check`).

Each call runs on the CPU op (the public API), on the CUDA kernel body run on the host
(``_cuda_emulated_cache``, vector and scalar path, a few grid shapes) and, on a machine with a GPU, on the
CUDA op (the public API on the case's tensors moved to the GPU with their storages, results copied back and
checked on the host as the CPU op's). q and k must agree with
``reference.rotary_hadamard`` at the project tolerance (pass-through features bit-exact); the caches must
equal, bit for bit, a pure-PyTorch model that index_puts the rotated k (as written to k) and v into
clones of the guard-filled caches (``reference.quantize_fp8`` for fp8 caches), so every slot not
named in slot_mapping and every element outside a cache view keeps its bits.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from _helpers import HAS_CUDA, HAS_EMULATION, NO_CUDA, NO_EMULATION, make_cos_sin, to_device, ulp

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
HAS_EMU = HAS_EMULATION and hasattr(OPS, "_cuda_emulated_cache")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3, E5M2 = FP8
N_POS = 300  # rows of the cos/sin table
# None: the public API on CPU tensors; "cuda": the public API on CUDA tensors (skipped without a GPU); else
# (num_sms, force_scalar) of the emulated CUDA body. The matrix (MATRIX) runs cpu, the vector path on a
# 132-SM grid, the scalar path on one SM and cuda; the other tests all of them.
BACKENDS = {
    "cpu": None,
    "emu-132sm": (132, False),
    "emu-1sm-scalar": (1, True),
    "emu-1sm": (1, False),
    "emu-132sm-scalar": (132, True),
    "cuda": "cuda",
}
MATRIX = ["cpu", "emu-132sm", "emu-1sm-scalar", "cuda"]
EMU_BACKENDS = [b for b, spec in BACKENDS.items() if isinstance(spec, tuple)]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The many small float64 reference ops run on one thread: on a busy 2-core machine OpenMP's pool makes
    them ~100x slower. The op under test keeps the default thread count (``run``)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(_THREADS)


@contextlib.contextmanager
def _default_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@functools.lru_cache
def _cos_sin(rotary_dim: int) -> torch.Tensor:
    return make_cos_sin(N_POS, rotary_dim)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (sees NaN payloads, -0 and fp8 codes)."""
    return t.contiguous().view(_INT[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _guard(shape, dtype, gen) -> torch.Tensor:
    """Random guard values (random bytes for fp8, NaN codes included)."""
    if dtype in FP8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 7 + 1).to(dtype)


class Case:
    """One call: its tensors (cache bases kept for guard checks) and keyword arguments."""

    def args(self) -> dict:
        return dict(
            q=self.q, k=self.k, v=self.v, positions=self.positions, cos_sin=self.cos_sin,
            key_cache=self.key_cache, value_cache=self.value_cache, slot_mapping=self.slot_mapping,
            interleaved=self.interleaved, layout=self.layout, k_scale=self.k_scale, v_scale=self.v_scale,
            q_out=self.q_out, q_scale=self.q_scale, rotary_offset=self.rotary_offset,
            mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved,
        )  # fmt: skip

    def snapshot(self) -> dict:
        names = ("q", "k", "v", "positions", "cos_sin", "slot_mapping", "q_out", "kc_base", "vc_base")
        return {n: getattr(self, n).clone() for n in names if getattr(self, n) is not None}


def _cache(layout, nb, bs, h, d, dtype, view, gen):
    """A paged cache, or a view of a bigger guard-filled tensor along the blocks or the heads dim."""
    shape = [nb, bs, h, d] if layout == "NHD" else [nb, h, bs, d]
    hd = 2 if layout == "NHD" else 1
    big = list(shape)
    if view == "blocks":
        big[0] += 3
    elif view == "heads":
        big[hd] += 2
    base = _guard(big, dtype, gen)
    return base, base.narrow(0, 1 if view == "blocks" else 0, nb).narrow(hd, 1 if view == "heads" else 0, h)


def _slots(pattern: str, T: int, n_slots: int, gen) -> torch.Tensor:
    n = max(T - 3, 0) if pattern == "short" else T
    slots = torch.randperm(n_slots, generator=gen)[:n]
    if pattern in ("mixed", "short"):
        slots[torch.rand(n, generator=gen) < 0.3] = -1
        if n >= 2:
            slots[n // 2] = -1
    elif pattern == "none":
        slots[:] = -1
    return slots


def build(
    dtype=torch.float16, *, T=11, Hq=8, Hk=2, D=128, Dv=None, rotary_dim=None, rotary_offset=0,
    interleaved=False, layout="NHD", block_size=16, cache_dtype=None, q_out=None, slots="mixed",
    packed=False, cache_view=None, scale=2.0, pos_dtype=torch.int64, seed=0, mrope_section=None,
    mrope_interleaved=False,
) -> Case:  # fmt: skip
    """``q_out``: None, "same" (q's dtype) or an fp8 dtype. ``packed``: q, k, v views of one qkv.
    ``mrope_section``: several position axes (MRoPE), positions ``[len(mrope_section), T]``."""
    gen = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    rd = D - rotary_offset if rotary_dim is None else rotary_dim
    c = Case()

    def rnd(*shape):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    if packed:
        assert Dv == D
        qkv = rnd(T, Hq + 2 * Hk, D)
        c.q, c.k, c.v = qkv[:, :Hq], qkv[:, Hq : Hq + Hk], qkv[:, Hq + Hk :]
    else:  # separate, strided: q head-major, k every other head, v at a storage offset
        c.q = rnd(Hq, T, D).transpose(0, 1)
        c.k = rnd(T, 2 * Hk, D)[:, ::2]
        c.v = rnd(T + 1, Hk, Dv)[1:]
    pos_shape = (T,) if mrope_section is None else (len(mrope_section), T)
    c.positions = torch.randint(0, N_POS, pos_shape, generator=gen).to(pos_dtype)
    c.cos_sin = _cos_sin(rd)
    cdt = dtype if cache_dtype is None else cache_dtype
    nb = (T + 8 + block_size - 1) // block_size + 1
    c.kc_base, c.key_cache = _cache(layout, nb, block_size, Hk, D, cdt, cache_view, gen)
    c.vc_base, c.value_cache = _cache(layout, nb, block_size, Hk, Dv, cdt, cache_view, gen)
    c.slot_mapping = _slots(slots, T, nb * block_size, gen)
    c.k_scale, c.v_scale, c.q_scale = (torch.tensor([s]) for s in (0.37, 1.9, 0.61))
    c.q_out = None if q_out is None else _guard((T, Hq, D), dtype if q_out == "same" else q_out, gen)
    c.interleaved, c.layout, c.rotary_offset, c.rotary_dim = interleaved, layout, rotary_offset, rd
    c.mrope_section, c.mrope_interleaved = mrope_section, mrope_interleaved
    return c


def run(c: Case | dict, backend) -> list | None:
    """Runs the call (a case, or its arguments) on ``backend`` (a BACKENDS key, or (num_sms, force_scalar));
    returns the emulated launch (grid_x, grid_y, block_x, block_y, vectorized) or None."""
    a = c.args() if isinstance(c, Case) else c
    spec = BACKENDS[backend] if isinstance(backend, str) else backend
    if spec is None:
        with _default_threads():
            rope_ext.apply_rotary_qk_and_cache_(**a)
        return None
    if spec == "cuda":
        if not HAS_CUDA:
            pytest.skip(NO_CUDA)
        moved, write_back = to_device(a, "cuda")
        rope_ext.apply_rotary_qk_and_cache_(**moved)
        write_back()
        return None
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    if a.get("mrope_section") is not None:
        pytest.skip("the emulated cache op takes no mrope_section")
    return emulated(a, *spec)


def emulated(a: dict, num_sms: int, force_scalar: bool):
    pos = a["positions"]
    return OPS._cuda_emulated_cache(
        a["q"], a["k"], a["v"], pos.unsqueeze(-1) if isinstance(pos, torch.Tensor) else pos, a["cos_sin"],
        a["key_cache"], a["value_cache"], a["slot_mapping"], a["k_scale"], a["v_scale"], a["q_out"],
        a["q_scale"], a["interleaved"], a["layout"], num_sms, force_scalar, a["rotary_offset"],
    )  # fmt: skip


def assert_rotated(out, x0, c: Case) -> torch.Tensor:
    """``out`` is ``x0`` rotated: pass-through features bit-exact, rotated ones within tolerance.

    rtol=0 throughout. float32: 1e-6 max|x| (fp32 arithmetic, a few 2^-24 max|x|; seen: 1.1e-7); float64:
    1e-13 max|x| (seen: 2.3e-16). float16 / bfloat16: the kernel rounds its fp32 result once, so one ulp of
    the dtype at the reference value, plus 2^-22 max|x| for results that nearly cancel (x1 c - x2 s much
    smaller than x: fp32 is then off by a few 2^-24 max|x|, more than one ulp of the tiny result; seen: up
    to 5 such ulps, never above 1 ulp elsewhere). The project's contract (_helpers.assert_close_to_reference)
    for the half types. Returns the float64 reference.
    """
    ref = reference.rotary_hadamard(
        x0, c.positions.unsqueeze(-1), c.cos_sin, interleaved=c.interleaved, rotary_offset=c.rotary_offset,
        mrope_section=c.mrope_section, mrope_interleaved=c.mrope_interleaved,
    )  # fmt: skip
    lo, hi = c.rotary_offset, c.rotary_offset + c.rotary_dim
    assert same_bits(out[..., :lo], x0[..., :lo]) and same_bits(out[..., hi:], x0[..., hi:]), "pass-through"
    if out.numel() == 0:
        return ref
    err = (out[..., lo:hi].double() - ref[..., lo:hi]).abs()
    x_max = x0[..., lo:hi].double().abs().max().item()
    if out.dtype in (torch.float32, torch.float64):
        tol = torch.tensor((1e-6 if out.dtype == torch.float32 else 1e-13) * x_max)
    else:
        tol = ulp(ref[..., lo:hi], out.dtype) + 2.0**-22 * x_max
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} rotated values off; worst {err.max().item():.3g}"
    return ref


def model_cache(base0, cache, values, slots, layout, scale) -> torch.Tensor:
    """The expected cache base: a clone of ``base0`` with ``values[t]`` index_put at slot_mapping[t]
    (tokens t < T' with a slot in the cache; fp8 through reference.quantize_fp8)."""
    out = base0.clone()
    view = out.as_strided(cache.shape, cache.stride(), cache.storage_offset())
    bs = cache.shape[1 if layout == "NHD" else 2]
    toks = [t for t, s in enumerate(slots.tolist()) if 0 <= s < cache.shape[0] * bs]
    if not toks:
        return out
    tok = torch.tensor(toks)
    s = slots[tok]
    vals = values[tok]
    if cache.dtype in FP8:
        vals = reference.quantize_fp8(vals, scale, cache.dtype)
    rows = view if layout == "NHD" else view.transpose(1, 2)  # [blocks, block_size, heads, dim]
    rows.view(_INT[out.element_size()]).index_put_((s // bs, s % bs), bits(vals))
    return out


def check_fp8_q_out(c: Case, s: dict, backend) -> None:
    """An fp8 q_out is quantize_fp8 of the rotation rounded to q's dtype: the one the same backend writes to
    a q_out of q's dtype (held to the reference here), bit for bit. (Not quantize_fp8 of the reference
    rounded: the rounded rotation may be the other neighbour, within the tolerance of assert_rotated, and
    that moves the fp8 code where it sits on an fp8 rounding boundary.)"""
    a = {**c.args(), "q": s["q"].clone(), "k": s["k"].clone(), "v": s["v"].clone(), "q_scale": None}
    a |= dict(
        key_cache=c.key_cache.clone(), value_cache=c.value_cache.clone(), q_out=torch.empty_like(a["q"])
    )
    run(a, backend)
    assert_rotated(a["q_out"], s["q"], c)
    want = reference.quantize_fp8(a["q_out"], c.q_scale, c.q_out.dtype)
    assert same_bits(c.q_out, want), "fp8 q_out is not quantize_fp8 of the rotation in q's dtype"


def check(c: Case, s: dict, backend="cpu") -> None:
    """The call on ``c`` (snapshot ``s`` before it) did what the docstring says, and nothing else."""
    for name in ("v", "positions", "cos_sin", "slot_mapping"):
        assert same_bits(getattr(c, name), s[name]), f"{name} changed"
    if c.q_out is None:
        assert_rotated(c.q, s["q"], c)
    else:
        assert same_bits(c.q, s["q"]), "q changed though q_out was given"
        if c.q_out.dtype == c.q.dtype:
            assert_rotated(c.q_out, s["q"], c)
        else:
            check_fp8_q_out(c, s, backend)
    assert_rotated(c.k, s["k"], c)
    kc = model_cache(s["kc_base"], c.key_cache, c.k, c.slot_mapping, c.layout, c.k_scale)
    vc = model_cache(s["vc_base"], c.value_cache, s["v"], c.slot_mapping, c.layout, c.v_scale)
    assert same_bits(c.kc_base, kc), "key cache differs from the model (written rows or guards)"
    assert same_bits(c.vc_base, vc), "value cache differs from the model (written rows or guards)"
    n_slots = c.key_cache.shape[0] * c.key_cache.shape[1 if c.layout == "NHD" else 2]
    if bool(((c.slot_mapping >= -1) & (c.slot_mapping < n_slots)).all()):  # the reference's domain
        kr, vr = reference.kv_cache_write(
            c.k, s["v"], c.key_cache.clone(), c.value_cache.clone(), c.slot_mapping, layout=c.layout,
            k_scale=c.k_scale, v_scale=c.v_scale,
        )  # fmt: skip
        assert same_bits(c.key_cache, kr) and same_bits(c.value_cache, vr), "reference.kv_cache_write"


def run_checked(c: Case, backend: str, vectorized: bool | None = None) -> None:
    s = c.snapshot()
    launch = run(c, backend)
    check(c, s, backend)
    if launch is not None and vectorized is not None:
        assert launch[4] == int(vectorized and not BACKENDS[backend][1]), launch

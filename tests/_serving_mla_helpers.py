"""Shared by the tests of apply_mla_rotary_and_cache_ (test_serving_mla.py): the cases (:func:`build`), the
runs on the CPU op, the CUDA op and the emulated CUDA body (:func:`run`), and the checks against the float64
reference (``reference.mla_cache_write``) and a pure-PyTorch model of the latent cache (:func:`check`).

The model of the GQA cache tests (_serving_cache_helpers.py), for the MLA layout: q and k_pe must agree with
the float64 reference at the project tolerance (pass-through features bit-exact); the latent cache must
equal, bit for bit, a clone of the guard-filled cache base with ``cat(kv_c[t], k_pe[t])`` index_put at each
written slot, k_pe as the op left it (``reference.quantize_fp8`` of both halves for fp8 caches), so that every
row not named in slot_mapping and every element outside a cache view keeps its bits; and the reference's
own cache must equal it wherever the op's rounded k_pe has the reference's bits.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import HAS_CUDA, HAS_EMULATION, NO_CUDA, NO_EMULATION, to_device, ulp
from _serving_cache_helpers import (
    BACKENDS,
    FP8,
    N_POS,
    _cos_sin,
    _default_threads,
    _guard,
    _slots,
    bits,
    same_bits,
)

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
HAS_EMU = HAS_EMULATION and hasattr(OPS, "_cuda_emulated_mla")
__all__ = [
    "BACKENDS", "FP8", "HAS_EMU", "N_POS", "OPS", "Case", "as_gqa", "assert_rotated", "build", "check",
    "emulated", "model_cache", "outputs", "run", "run_checked",
]  # fmt: skip


class Case:
    """One call: its tensors (the cache's guard-filled base kept) and options."""

    NAMES = ("q", "kv_c", "k_pe", "positions", "cos_sin", "kv_cache", "slot_mapping")
    OPTIONS = ("rotary_offset", "interleaved", "kv_scale", "q_out", "q_scale")

    def args(self) -> dict:
        return {n: getattr(self, n) for n in self.NAMES + self.OPTIONS}

    def snapshot(self) -> dict:
        names = (
            "q",
            "kv_c",
            "k_pe",
            "positions",
            "cos_sin",
            "slot_mapping",
            "q_out",
            "q_out_base",
            "cache_base",
        )
        names += ("kv_scale", "q_scale")
        return {n: getattr(self, n).clone() for n in names if getattr(self, n) is not None}

    @property
    def rotary_dim(self) -> int:
        return self.cos_sin.shape[-1]

    @property
    def lora(self) -> int:
        return self.kv_c.shape[-1]


def _kv_cache(nb, bs, width, dtype, view, gen):
    """A guard-filled latent cache, or a narrow() view of a bigger one along the blocks ("blocks"), the rows
    of a block ("rows") or the columns ("cols": rows padded, 16 guard columns before the cache's)."""
    big = [nb + 3 * (view == "blocks"), bs + 2 * (view == "rows"), width + 32 * (view == "cols")]
    base = _guard(big, dtype, gen)
    cache = base.narrow(0, 1 if view == "blocks" else 0, nb).narrow(1, 1 if view == "rows" else 0, bs)
    return base, cache.narrow(2, 16 if view == "cols" else 0, width)


def build(
    dtype=torch.float16, *, T=11, H=4, nope=16, R=8, extra=0, L=32, block_size=16, interleaved=False,
    cache_dtype=None, q_out=None, slots="mixed", packed=False, kpe="2d", q_layout="head-major",
    cache_view=None, scale=2.0, pos_dtype=torch.int64, kv_scale=0.37, q_scale=0.61, q_out_view=False,
    strided_tables=False, seed=0,
) -> Case:  # fmt: skip
    """q ``[T, H, nope + R + extra]`` rotated at ``rotary_offset = nope``; ``kv_c [T, L]``; ``k_pe [T, R]``
    (``kpe="3d"``: ``[T, 1, R]``). ``packed``: kv_c and k_pe are the two column ranges of one projection
    output ``[T, L + R]`` (DeepSeek's kv_a split); else separate strided views. ``q_layout``: "head-major"
    (a transposed ``[H, T, D]``), "padded" (the first D columns of wider rows, at a storage offset) or
    "contiguous". ``q_out``: None, "same" (q's dtype) or an fp8 dtype; ``q_out_view``: q_out is a head-major
    view of wider guard-filled rows (``q_out_base``). ``kv_scale`` / ``q_scale``: numbers (one-element float32
    tensors) or None. ``strided_tables``: positions every other element of a buffer of out-of-range
    positions, cos_sin the middle columns of a NaN-filled wider table."""
    gen = torch.Generator().manual_seed(seed)
    D = nope + R + extra
    c = Case()

    def rnd(*shape):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    if q_layout == "head-major":
        c.q = rnd(H, T, D).transpose(0, 1)
    elif q_layout == "padded":
        c.q = rnd(T + 1, H, D + 8)[1:, :, 8:]
    else:
        c.q = rnd(T, H, D)
    if packed:
        c.proj = rnd(T, L + R)
        c.kv_c, c.k_pe = c.proj[:, :L], c.proj[:, L:]
    else:
        c.proj = None
        c.kv_c = rnd(T + 1, L)[1:]
        c.k_pe = rnd(T, 2, R)[:, 1]
    if kpe == "3d":
        c.k_pe = c.k_pe.unsqueeze(1)
    c.positions = torch.randint(0, N_POS, (T,), generator=gen).to(pos_dtype)
    c.cos_sin = _cos_sin(R)
    if strided_tables:
        buf = torch.full((2 * T,), 10**6, dtype=pos_dtype)
        buf[::2] = c.positions
        c.positions = buf[::2]
        wide = torch.full((N_POS, 3 * R), float("nan"))
        wide[:, R : 2 * R] = c.cos_sin
        c.cos_sin = wide[:, R : 2 * R]
    nb = (T + 8 + block_size - 1) // block_size + 1
    cdt = dtype if cache_dtype is None else cache_dtype
    c.cache_base, c.kv_cache = _kv_cache(nb, block_size, L + R, cdt, cache_view, gen)
    c.slot_mapping = _slots(slots, T, nb * block_size, gen)
    c.kv_scale = None if kv_scale is None else torch.tensor([float(kv_scale)])
    c.q_scale = None if q_scale is None else torch.tensor([float(q_scale)])
    c.q_out = c.q_out_base = None
    if q_out is not None:
        qdt = dtype if q_out == "same" else q_out
        if q_out_view:
            c.q_out_base = _guard((H, T, D + 16), qdt, gen)
            c.q_out = c.q_out_base.transpose(0, 1)[..., 16:]
        else:
            c.q_out = c.q_out_base = _guard((T, H, D), qdt, gen)
    c.interleaved, c.rotary_offset = interleaved, nope
    return c


def emulated(a: dict, num_sms: int, force_scalar: bool) -> list:
    """The CUDA body on the host (positions [T], as the op takes them)."""
    return OPS._cuda_emulated_mla(
        a["q"], a["kv_c"], a["k_pe"], a["positions"], a["cos_sin"], a["kv_cache"], a["slot_mapping"],
        a["kv_scale"], a["q_out"], a["q_scale"], a["interleaved"], a["rotary_offset"], num_sms, force_scalar,
    )  # fmt: skip


def run(c: Case | dict, backend) -> list | None:
    """Runs the call (a case, or its arguments) on ``backend`` (a BACKENDS key, or (num_sms, force_scalar));
    returns the emulated launch (grid_x, grid_y, block_x, block_y, vectorized) or None."""
    a = c.args() if isinstance(c, Case) else c
    spec = BACKENDS[backend] if isinstance(backend, str) else backend
    if spec is None:
        with _default_threads():
            rope_ext.apply_mla_rotary_and_cache_(**a)
        return None
    if spec == "cuda":
        if not HAS_CUDA:
            pytest.skip(NO_CUDA)
        moved, write_back = to_device(a, "cuda")
        rope_ext.apply_mla_rotary_and_cache_(**moved)
        write_back()
        return None
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    return emulated(a, *spec)


def assert_rotated(out: torch.Tensor, x0: torch.Tensor, ref: torch.Tensor, lo: int, hi: int) -> None:
    """``out`` is ``x0`` with features ``[lo, hi)`` rotated to ``ref`` (float64), the others bit-exact:
    the rotated ones within the tolerance of the GQA cache tests (_serving_cache_helpers.assert_rotated, rtol
    0): float32 1e-6 max|x|, float64 1e-13 max|x|, float16 / bfloat16 one ulp at the reference value plus
    2^-22 max|x|."""
    assert out.shape == x0.shape == ref.shape, (out.shape, x0.shape, ref.shape)
    assert same_bits(out[..., :lo], x0[..., :lo]) and same_bits(out[..., hi:], x0[..., hi:]), "pass-through"
    if out.numel() == 0:
        return
    err = (out[..., lo:hi].double() - ref[..., lo:hi]).abs()
    x_max = x0[..., lo:hi].double().abs().max().item()
    if out.dtype in (torch.float32, torch.float64):
        tol = torch.tensor((1e-6 if out.dtype == torch.float32 else 1e-13) * x_max)
    else:
        tol = ulp(ref[..., lo:hi], out.dtype) + 2.0**-22 * x_max
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} rotated values off; worst {err.max().item():.3g}"


def _rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
    """The tokens written (slot in the cache; t < T') and their (block, row) indices."""
    bs = cache.shape[1]
    toks = [t for t, s in enumerate(slots.tolist()) if 0 <= s < cache.shape[0] * bs]
    s = slots[torch.tensor(toks, dtype=torch.long)]
    return toks, (s // bs, s % bs)


def model_cache(base0: torch.Tensor, cache: torch.Tensor, kv_c, k_pe, slots, scale) -> torch.Tensor:
    """The expected cache base: a clone of ``base0`` with ``cat(kv_c[t], k_pe[t])`` index_put at the written
    rows (fp8: reference.quantize_fp8 of each half with ``scale``, None as 1.0)."""
    out = base0.clone()
    view = out.as_strided(cache.shape, cache.stride(), cache.storage_offset())  # base0: a clone, offset 0
    toks, rows = _rows(cache, slots)
    if not toks:
        return out
    tok = torch.tensor(toks)
    halves = [kv_c[tok], k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])[tok]]
    if cache.dtype in FP8:
        halves = [reference.quantize_fp8(h, 1.0 if scale is None else scale, cache.dtype) for h in halves]
    row_bits = torch.cat([bits(h) for h in halves], dim=-1)
    view.view(row_bits.dtype).index_put_(rows, row_bits)
    return out


def _proxy(c: Case, s: dict, **kw) -> dict:
    """The reference's arguments for the call of ``c`` (inputs as snapshot in ``s``)."""
    a = dict(
        rotary_offset=c.rotary_offset, interleaved=c.interleaved, kv_scale=c.kv_scale, q_out=c.q_out,
        q_scale=c.q_scale,
    )  # fmt: skip
    cache0 = s["cache_base"].as_strided(c.kv_cache.shape, c.kv_cache.stride(), c.kv_cache.storage_offset())
    inputs = dict(
        q=s["q"], kv_c=s["kv_c"], k_pe=s["k_pe"], positions=s["positions"], cos_sin=s["cos_sin"],
        kv_cache=cache0, slot_mapping=s["slot_mapping"],
    )  # fmt: skip
    return {**inputs, **a, **kw}


def check_fp8_q_out(c: Case, s: dict, backend, q_ref: torch.Tensor) -> None:
    """An fp8 q_out is quantize_fp8 of the rotation rounded to q's dtype: of the one the same backend writes
    to a q_out of q's dtype (held to the reference here), bit for bit; and the reference's fp8 q_out wherever
    that rotation has the bits of the reference's rounded one."""
    a = {**c.args(), "q": s["q"].clone(), "kv_c": s["kv_c"].clone(), "k_pe": s["k_pe"].clone()}
    a |= dict(kv_cache=c.kv_cache.clone(), q_out=torch.empty_like(a["q"]), q_scale=None)
    run(a, backend)
    lo, hi = c.rotary_offset, c.rotary_offset + c.rotary_dim
    assert_rotated(a["q_out"], s["q"], q_ref, lo, hi)
    scale = 1.0 if c.q_scale is None else c.q_scale
    assert same_bits(c.q_out, reference.quantize_fp8(a["q_out"], scale, c.q_out.dtype)), "fp8 q_out"
    want = reference.mla_cache_write(**_proxy(c, s))[0]
    agree = bits(a["q_out"]) == bits(q_ref.to(a["q_out"].dtype))
    assert torch.equal(bits(c.q_out)[agree], bits(want)[agree]), "reference.mla_cache_write's fp8 q_out"


def check(c: Case, s: dict, backend="cpu") -> None:
    """The call on ``c`` (snapshot ``s`` before it) did what the docstring says, and nothing else."""
    for name in ("kv_c", "positions", "cos_sin", "slot_mapping", "kv_scale", "q_scale"):
        if name in s:
            assert same_bits(getattr(c, name), s[name]), f"{name} changed"
    valid = bool(
        ((s["slot_mapping"] >= -1) & (s["slot_mapping"] < c.kv_cache.shape[0] * c.kv_cache.shape[1])).all()
    )
    if valid:  # the reference's domain
        q_ref, k_ref, cache_ref = reference.mla_cache_write(**_proxy(c, s, q_out=None))
    else:  # the cache part needs valid slots; the rotations do not
        q_ref, k_ref, _ = reference.mla_cache_write(
            **_proxy(c, s, q_out=None, slot_mapping=s["slot_mapping"][:0])
        )
    lo, hi = c.rotary_offset, c.rotary_offset + c.rotary_dim
    if c.q_out is None:
        assert_rotated(c.q, s["q"], q_ref, lo, hi)
    else:
        assert same_bits(c.q, s["q"]), "q changed though q_out was given"
        if c.q_out.dtype == c.q.dtype:
            assert_rotated(c.q_out, s["q"], q_ref, lo, hi)
        else:
            check_fp8_q_out(c, s, backend, q_ref)
    if c.q_out is not None:  # nothing written around a q_out view
        around = s["q_out_base"].clone()
        around.as_strided(c.q_out.shape, c.q_out.stride(), c.q_out.storage_offset()).copy_(c.q_out)
        assert same_bits(c.q_out_base, around), "written outside q_out"
    assert_rotated(c.k_pe, s["k_pe"], k_ref, 0, c.rotary_dim)
    want = model_cache(s["cache_base"], c.kv_cache, s["kv_c"], c.k_pe, c.slot_mapping, c.kv_scale)
    assert same_bits(c.cache_base, want), "kv_cache differs from the model (written rows or guards)"
    if valid:
        # The reference rounds its float64 k_pe: its cache must be the op's wherever the op's rounded k_pe
        # has the reference's bits (elsewhere the two differ within the tolerance checked above).
        k2 = c.k_pe.reshape(c.k_pe.shape[0], c.rotary_dim)
        differs = bits(k2) != bits(k_ref.reshape(k2.shape).to(k2.dtype))
        mask = torch.zeros(c.kv_cache.shape, dtype=torch.bool)
        toks, rows = _rows(c.kv_cache, c.slot_mapping)
        if toks:
            mask[..., c.lora :].index_put_(rows, differs[torch.tensor(toks)])
        assert torch.equal(bits(c.kv_cache)[~mask], bits(cache_ref)[~mask]), (
            "reference.mla_cache_write's cache"
        )


def outputs(c: Case) -> list[torch.Tensor]:
    """Everything a call may write: q (or q_out), k_pe and the whole cache base."""
    return [c.q, c.k_pe, c.cache_base] + ([] if c.q_out is None else [c.q_out_base])


def run_checked(kw: dict, backend, vectorized: bool | None = None) -> Case:
    """Builds ``build(**kw)``, runs it on ``backend`` and checks it; on a backend other than the CPU op, the
    results must also be the CPU op's, bit for bit, for float32, float16 and bfloat16 (where test_bit_equal.py
    holds every path to one result; float64 rotations are held to the reference's 1e-13 only, as there).
    ``vectorized``: the emulated body's expected path."""
    c = build(**kw)
    s = c.snapshot()
    launch = run(c, backend)
    check(c, s, backend)
    spec = BACKENDS[backend] if isinstance(backend, str) else backend
    if launch is not None and vectorized is not None:
        assert launch[4] == int(vectorized and not spec[1]), launch
    if spec is not None and kw.get("dtype", torch.float16) != torch.float64:
        cpu = build(**kw)
        run(cpu, "cpu")
        for got, want in zip(outputs(c), outputs(cpu), strict=True):
            assert same_bits(got, want), f"{backend} differs from the CPU op"
    return c


def as_gqa(a: dict) -> dict:
    """The arguments of apply_rotary_qk_and_cache_ that do what the MLA call ``a`` does: q's rope columns as
    q (rotary_offset 0), k_pe and kv_c as one head each, and kv_cache's two column ranges as two NHD caches of
    one head (q_out likewise: its rope columns)."""
    L, R = a["kv_c"].shape[-1], a["cos_sin"].shape[-1]
    lo = a["rotary_offset"]
    T = a["q"].shape[0]
    cache = a["kv_cache"]
    return dict(
        q=a["q"][..., lo : lo + R], k=a["k_pe"].view(T, 1, R), v=a["kv_c"].unsqueeze(1),
        positions=a["positions"], cos_sin=a["cos_sin"], key_cache=cache[:, :, None, L:],
        value_cache=cache[:, :, None, :L], slot_mapping=a["slot_mapping"], interleaved=a["interleaved"],
        k_scale=a["kv_scale"], v_scale=a["kv_scale"], q_scale=a["q_scale"],
        q_out=None if a["q_out"] is None else a["q_out"][..., lo : lo + R],
    )  # fmt: skip

"""Shared by the tests of rerotate_kv_cache_ (test_rerotate.py): the cases (:func:`build`), the runs on the
CPU op, the CUDA kernel body run on the host and the CUDA op (:func:`run`), and the op's definition, which
every backend must equal bit for bit (:func:`expected`).

The definition (the op's docstring): each token t whose slot ``s = slot_mapping[t]`` is not -1 names the
key at block ``s // block_size``, row ``s % block_size`` of the cache (NHD ``[num_blocks, block_size, Hk,
D]``, HND ``[num_blocks, Hk, block_size, D]``); every head of it has its features ``[rotary_offset,
rotary_offset + R)`` (``R = cos_sin.shape[-1]``) rotated by ``delta[t]`` positions, by the table row
``|delta[t]|``, inversely when ``delta[t] < 0``:

* float caches: the row becomes ``rope_ext.apply_rotary(row, |delta|, cos_sin, interleaved=...,
  inverse=delta < 0, rotary_offset=...)``;
* fp8 caches: the rotated features become ``reference.quantize_fp8(apply_rotary(row.float() * scale, ...),
  scale)`` (dequantized in float32, rotated in float32 with the float32 table, requantized); the other bytes
  are not touched. ``scale`` is ``k_scale`` (1 without).

The caches are guard-filled (random values with NaN, infinities and -0 for float caches; random bytes, NaN
codes and e5m2 infinities included, for fp8) and are often views (``narrow``) of a bigger guard-filled tensor:
the whole tensor must equal a clone of it with the named rows replaced, so rows not named and elements outside
the view keep their bits. Bits compare exactly, except that a NaN equals any NaN (the sign of a rotated NaN is
not specified).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import HAS_CUDA, NO_CUDA, NO_EMULATION, make_cos_sin, to_device

import rope_ext
from rope_ext import reference

OPS = torch.ops.rope_ext
HAS_EMU = hasattr(OPS, "_cuda_emulated_rerotate")  # _helpers imported rope_ext._C_testing when built
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3, E5M2 = FP8
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DTYPES = (*FLOATS, *FP8)
N_POS = 300  # rows of the cos/sin table
# None: the public API on CPU tensors; "cuda": the public API on CUDA tensors (skipped without a GPU); else
# (num_sms, force_scalar) of the emulated CUDA body. MATRIX: the CPU op, the vector path on a 132-SM grid,
# the scalar path on one SM, and CUDA.
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
VIEWS = (None, "blocks", "heads")  # the cache as it is, or a view of a larger guard-filled tensor


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The many small reference ops run on one thread (on a busy 2-core machine OpenMP's pool makes them
    ~100x slower); the op under test keeps the default thread count (:func:`run`)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(_THREADS)


@contextlib.contextmanager
def default_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (sees NaN payloads, -0 and fp8 codes)."""
    return t.contiguous().view(_INT[t.element_size()])


def _isnan(t: torch.Tensor) -> torch.Tensor:
    return t.float().isnan() if t.dtype in FP8 else t.isnan()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits; a NaN equals any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((bits(a) == bits(b)) | (_isnan(a) & _isnan(b))).all())


def differences(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where ``a`` and ``b`` (same shape and dtype) differ, for a failure message."""
    bad = (bits(a) != bits(b)) & ~(_isnan(a) & _isnan(b))
    idx = bad.nonzero()
    first = tuple(idx[0].tolist()) if len(idx) else None
    got = a[first].item() if first is not None else None
    want = b[first].item() if first is not None else None
    return f"{int(bad.sum())} elements differ; first at {first}: got {got}, want {want}"


def _guard(shape, dtype, gen, specials: bool = True) -> torch.Tensor:
    """Random values: for fp8 random bytes (NaN codes, e5m2 infinities); for floats N(1, 7) with NaN,
    infinities and -0 sprinkled in (``specials``; without, finite values and finite fp8 codes)."""
    if dtype in FP8:
        codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        if not specials:
            codes &= 0xF7 if dtype == E4M3 else 0xFB  # the exponent's low bit cleared: never the top one
        return codes.view(dtype)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 7 + 1
    if not specials:
        return x.to(dtype)
    flat = x.view(-1)
    flat[::97] = float("nan")
    flat[13::89] = float("inf")
    flat[29::101] = float("-inf")
    flat[41::103] = -0.0
    return x.to(dtype)


def cache_tensor(layout, nb, bs, hk, d, dtype, view, gen, specials=True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, cache)``: a paged cache, or a view of a bigger guard-filled tensor along the blocks or the
    heads dim (``view``: None, "blocks" or "heads")."""
    shape = [nb, bs, hk, d] if layout == "NHD" else [nb, hk, bs, d]
    hd = 2 if layout == "NHD" else 1
    big = list(shape)
    if view == "blocks":
        big[0] += 3
    elif view == "heads":
        big[hd] += 2
    base = _guard(big, dtype, gen, specials)
    cache = base.narrow(0, 1 if view == "blocks" else 0, nb).narrow(hd, 1 if view == "heads" else 0, hk)
    return base, cache


def slots_of(pattern: str, T: int, n_slots: int, gen) -> torch.Tensor:
    """Distinct slots for T tokens: "all" named, "mixed" (about a third -1, the middle one too), "none"."""
    slots = torch.randperm(n_slots, generator=gen)[:T]
    if pattern == "mixed":
        slots[torch.rand(T, generator=gen) < 0.3] = -1
        if T >= 2:
            slots[T // 2] = -1
    elif pattern == "none":
        slots[:] = -1
    else:
        assert pattern == "all", pattern
    return slots


def delta_of(kind: str, T: int, n_pos: int, dtype: torch.dtype, gen) -> torch.Tensor | int:
    """``kind``: "tokens" (one shift per token, mixed signs, zero, -1 and the largest ones +-(n_pos - 1)), or
    one shift for all as "one" (a one-element tensor), "0d" (a 0-d tensor) or "int" (a Python int)."""
    if kind == "tokens":
        d = torch.randint(-(n_pos - 1), n_pos, (T,), generator=gen)
        for i, v in enumerate((0, n_pos - 1, -(n_pos - 1), -1)[:T]):
            d[-1 - i] = v
        return d.to(dtype)
    v = int(torch.randint(1, n_pos, (), generator=gen)) * (
        -1 if bool(torch.rand((), generator=gen) < 0.5) else 1
    )
    if kind == "int":
        return v
    return torch.tensor([v] if kind == "one" else v, dtype=dtype)


class Case:
    """One call: the cache (and its guard-filled base) and the other arguments."""

    def kwargs(self) -> dict:
        return dict(
            key_cache=self.key_cache, slot_mapping=self.slot_mapping, delta=self.delta, cos_sin=self.cos_sin,
            layout=self.layout, interleaved=self.interleaved, k_scale=self.k_scale,
            rotary_offset=self.rotary_offset,
        )  # fmt: skip

    def snapshot(self) -> dict:
        s = {n: getattr(self, n) for n in ("base", "slot_mapping", "delta", "cos_sin", "k_scale")}
        return {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in s.items()}


def build(
    dtype=torch.float16, *, D=128, R=None, offset=0, Hk=2, block_size=16, layout="NHD", interleaved=False,
    T=11, slots="mixed", delta="tokens", delta_dtype=torch.int64, view=None, cs_dtype=torch.float32,
    scale=0.37, n_pos=N_POS, seed=0, specials=True,
) -> Case:  # fmt: skip
    """A call on a guard-filled cache of ``dtype``; ``scale``: k_scale's value (None: no k_scale);
    ``specials``: NaN, infinities and -0 among the cached values (fp8: NaN codes and infinities)."""
    gen = torch.Generator().manual_seed(seed)
    c = Case()
    R = D - offset if R is None else R
    nb = (T + 4 + block_size - 1) // block_size + 1
    c.base, c.key_cache = cache_tensor(layout, nb, block_size, Hk, D, dtype, view, gen, specials)
    c.slot_mapping = slots_of(slots, T, nb * block_size, gen)
    c.delta = delta_of(delta, T, n_pos, delta_dtype, gen)
    c.cos_sin = make_cos_sin(n_pos, R, dtype=cs_dtype)
    c.k_scale = None if scale is None else torch.tensor([scale])
    c.layout, c.interleaved, c.rotary_offset = layout, interleaved, offset
    return c


def vectorizes(dtype, D: int, R: int, offset: int, interleaved: bool) -> bool:
    """Whether the CUDA body takes its 16-byte path (float caches; fp8 ones always go pair by pair): the
    rotated features start, and their pairing splits, on 16-byte boundaries (rotary.cuh can_vectorize)."""
    if dtype in FP8:
        return False
    v = 16 // dtype.itemsize
    return D % v == 0 and offset % v == 0 and (R if interleaved else R // 2) % v == 0


def shifts(delta, T: int) -> list[int]:
    """``delta`` (a tensor or an int) as T Python ints."""
    if isinstance(delta, int):
        return [delta] * T
    d = delta.reshape(-1).tolist()
    return d * T if len(d) == 1 else d


def expected(c: Case, s: dict, device: bool = False) -> torch.Tensor:
    """The cache's base after the call, from the snapshot ``s`` taken before it: the definition (module
    docstring) applied row by row. ``device``: tokens whose slot is outside the cache or whose shift no table
    row holds are skipped, as the CUDA op and its emulation do (the CPU op raises instead)."""
    out = s["base"].clone()
    kc = c.key_cache
    view = out.as_strided(kc.shape, kc.stride(), kc.storage_offset())
    rows = view if c.layout == "NHD" else view.transpose(1, 2)  # [blocks, block_size, heads, dim]
    bs = rows.shape[1]
    n_slots = rows.shape[0] * bs
    cs = s["cos_sin"]
    n_pos, lo, hi = cs.shape[0], c.rotary_offset, c.rotary_offset + cs.shape[1]
    slots = s["slot_mapping"].tolist()
    for t, d in zip(range(len(slots)), shifts(s["delta"], len(slots)), strict=True):
        slot = slots[t]
        if slot == -1:
            continue
        if not 0 <= slot < n_slots or abs(d) >= n_pos:
            assert device, f"token {t}: slot {slot}, delta {d} is not a call the CPU op runs"
            continue
        row = rows[slot // bs, slot % bs]  # [Hk, D], a view of out
        kw = dict(interleaved=c.interleaved, inverse=d < 0, rotary_offset=c.rotary_offset)
        pos = torch.tensor(abs(d))
        if kc.dtype in FP8:
            scale = torch.tensor([1.0]) if s["k_scale"] is None else s["k_scale"]
            y = rope_ext.apply_rotary(row.float() * scale, pos, cs, **kw)
            codes = reference.quantize_fp8(y[..., lo:hi], scale, kc.dtype)
            row[..., lo:hi].view(torch.uint8).copy_(codes.view(torch.uint8))
        else:
            y = rope_ext.apply_rotary(row.clone(), pos, cs, **kw)
            row.view(_INT[row.element_size()]).copy_(bits(y))
    return out


def emulated(a: dict, num_sms: int, force_scalar: bool) -> list:
    """The CUDA body run on the host over its grid (an int delta as a one-element tensor)."""
    delta = torch.tensor([a["delta"]]) if isinstance(a["delta"], int) else a["delta"]
    return OPS._cuda_emulated_rerotate(
        a["key_cache"], a["slot_mapping"], delta, a["cos_sin"], a["k_scale"], a["interleaved"], a["layout"],
        a["rotary_offset"], num_sms, force_scalar,
    )  # fmt: skip


def run(c: Case | dict, backend) -> list | None:
    """Runs the call (a case, or its arguments) on ``backend`` (a BACKENDS key, or (num_sms, force_scalar));
    returns the emulated launch (grid_x, grid_y, block_x, block_y, vectorized) or None. The cuda backend runs
    the public API on copies of the tensors' storages on the GPU (views stay views) and copies them back."""
    a = c.kwargs() if isinstance(c, Case) else c
    spec = BACKENDS[backend] if isinstance(backend, str) else backend
    if spec is None:
        with default_threads():
            rope_ext.rerotate_kv_cache_(**a)
        return None
    if spec == "cuda":
        if not HAS_CUDA:
            pytest.skip(NO_CUDA)
        moved, write_back = to_device(a, "cuda")
        rope_ext.rerotate_kv_cache_(**moved)
        write_back()
        return None
    if not HAS_EMU:
        pytest.skip(NO_EMULATION)
    return emulated(a, *spec)


def is_device(backend) -> bool:
    return backend != "cpu" and BACKENDS.get(backend, backend) is not None


def check(c: Case, s: dict, backend="cpu") -> None:
    """The call on ``c`` (snapshot ``s`` before it) did what the definition says, and nothing else."""
    for name in ("slot_mapping", "delta", "cos_sin", "k_scale"):
        if isinstance(s[name], torch.Tensor):
            assert same_bits(getattr(c, name), s[name]), f"{name} changed"
    want = expected(c, s, device=is_device(backend))
    assert same_bits(c.base, want), "cache differs from the definition: " + differences(c.base, want)


def run_checked(c: Case, backend, vectorized: bool | None = None) -> None:
    """Runs and checks ``c``; ``vectorized``: whether the emulated body must take its 16-byte path (unless
    the backend forces the scalar one)."""
    s = c.snapshot()
    launch = run(c, backend)
    check(c, s, backend)
    if launch is not None and vectorized is not None:
        spec = BACKENDS[backend] if isinstance(backend, str) else backend
        assert launch[4] == int(vectorized and not spec[1]), launch

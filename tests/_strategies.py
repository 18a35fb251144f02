"""Hypothesis profiles and strategies for the randomized agreement tests.

A drawn :class:`Case` describes one call completely: dtype, shapes of q (and k), which batch dims carry
positions (token dims) and which broadcast them (head dims), where every tensor lies in a flat buffer
(any dim order, steps, padding, storage offsets, stride-0 expansion for read-only inputs, q and k
packed in one buffer), the cos/sin table and a seed for the values. :func:`build` turns it into
tensors; everything outside the views is filled with guard values that a correct kernel never reads
(positions out of range, NaN in the cos/sin buffer) and never writes.

Profiles (``--hypothesis-profile=NAME``): ``ci`` (500 draws per property test, the default count of
these tests anyway, the same draws on every run: ``make test`` uses it), ``long`` (20,000 draws per
property test), ``quick`` (25 fixed draws, ``make test-quick``) and ``short`` (100 fixed draws: the
sanitizer build of ``make test-sanitize``, and the reruns on the lower CPU instruction sets in
test_cpu_isa.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from rope_ext.checks import axis_layout

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=500, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=20_000, **_COMMON)
settings.register_profile("quick", max_examples=25, derandomize=True, database=None, **_COMMON)
settings.register_profile("short", max_examples=100, derandomize=True, database=None, **_COMMON)

CI_DRAWS = 500
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16}
INT_OF[torch.bfloat16] = torch.int16
MAX_ELEMENTS = 6000  # per tensor: keeps a draw to a few milliseconds


def n_draws(ci: int = CI_DRAWS) -> int:
    """Draws for one property test: ``ci`` at most under a derandomized profile (``ci`` itself; fewer under
    ``quick`` and ``short``), otherwise at least ``ci``, more if the profile asks (``long``)."""
    drawn = settings.default.max_examples
    return min(ci, drawn) if settings.default.derandomize else max(ci, drawn)


def property_settings(ci: int = CI_DRAWS) -> settings:
    """Settings of the property tests: profile defaults, at least ``ci`` draws, no deadline."""
    return settings(max_examples=n_draws(ci), **_COMMON)


@dataclass(frozen=True)
class View:
    """A logical tensor inside a flat buffer: sizes, strides and storage offset, all in elements."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    def end(self) -> int:
        """One past the largest element index the view reaches (``offset`` when empty)."""
        if 0 in self.shape:
            return self.offset
        return self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True)) + 1

    def of(self, buf: torch.Tensor) -> torch.Tensor:
        """The view as a tensor over the flat buffer ``buf``."""
        return buf.as_strided(self.shape, self.strides, self.offset)

    def shifted(self, by: int) -> View:
        """The same view, ``by`` elements further in the buffer."""
        return View(self.shape, self.strides, self.offset + by)


@st.composite
def views(draw, shape, *, contiguous_last=True, expand=False, align=1, start=0) -> View:
    """Places ``shape`` in a buffer: any dim order (the last dim innermost with stride 1 when
    ``contiguous_last``), steps and padding on the other dims, a leading offset; ``expand`` lets dims
    of size > 1 get stride 0 (read-only inputs). Strides and offsets are multiples of ``align``."""
    n = len(shape)
    batch = list(range(n - 1)) if contiguous_last else list(range(n))
    order = draw(st.permutations(batch)) + ([n - 1] if contiguous_last else [])
    strides = [0] * n
    offset = start + align * draw(st.integers(0, 3))
    acc = 1
    for d in reversed(order):  # innermost first
        last = contiguous_last and d == n - 1
        step = 1 if last else draw(st.sampled_from([1, 1, 1, 2, 3]))
        pad = align * draw(st.integers(0, 2))
        lead = align * draw(st.integers(0, pad // align)) if pad else 0
        strides[d] = step * acc
        offset += lead * acc
        acc *= max(shape[d], 1) * step + pad
    for d in range(n):
        if contiguous_last and d == n - 1:
            continue
        if shape[d] == 1 and draw(st.booleans()):
            strides[d] = align * draw(st.sampled_from([0, 1, 5]))  # any stride: the dim is never stepped
        elif expand and shape[d] > 1 and draw(st.integers(0, 9)) == 0:
            strides[d] = 0
    return View(tuple(shape), tuple(strides), offset)


@dataclass
class Case:
    """One drawn call (see the module docstring)."""

    dtype: torch.dtype
    head_dim: int
    rotary_dim: int
    q: View
    k: View | None
    shared_buffer: bool  # q and k in one buffer (else two)
    pos: View
    pos_dtype: torch.dtype
    n_cache: int
    cs_dtype: torch.dtype
    cs_pad: tuple[int, int]  # columns before / after the table in its buffer
    interleaved: bool
    inverse: bool
    scale: float
    seed: int
    out: View | None = None  # emulation: where the out-of-place result goes
    out_k: View | None = None
    notes: dict = field(default_factory=dict)
    rotary_offset: int = 0  # features [rotary_offset, rotary_offset + rotary_dim) rotate
    mrope_section: tuple[int, int, int] | None = None  # positions then carry a leading dim of 3
    mrope_interleaved: bool | str = False

    def rope_kwargs(self) -> dict:
        """The keyword arguments of the public ops (and the reference) besides the pairing."""
        return dict(
            rotary_offset=self.rotary_offset,
            mrope_section=self.mrope_section,
            mrope_interleaved=self.mrope_interleaved,
        )

    def op_tail(self) -> tuple:
        """The registered ops' trailing arguments: rotary_offset, mrope_section, mrope_interleaved."""
        sec = None if self.mrope_section is None else list(self.mrope_section)
        return (self.rotary_offset, sec, axis_layout(self.mrope_interleaved))

    def with_k(self, k: View) -> Case:
        """This case with a k (in its own buffer)."""
        from dataclasses import replace

        return replace(self, k=k, shared_buffer=False)

    def __repr__(self) -> str:
        k = None if self.k is None else f"{self.k}"
        return (
            f"Case({self.dtype}, D={self.head_dim}, r={self.rotary_dim}, q={self.q}, k={k}, "
            f"shared={self.shared_buffer}, pos={self.pos} {self.pos_dtype}, P={self.n_cache}, "
            f"cs={self.cs_dtype} pad={self.cs_pad}, interleaved={self.interleaved}, inverse={self.inverse}, "
            f"scale={self.scale}, seed={self.seed}, out={self.out}, out_k={self.out_k}, "
            f"rotary_offset={self.rotary_offset}, mrope_section={self.mrope_section}, "
            f"mrope_interleaved={self.mrope_interleaved})"
        )


def _sizes(draw, n: int, budget: int) -> list[int]:
    """``n`` batch sizes in 0..5 whose product stays within ``budget`` rows."""
    sizes = []
    rows = 1
    for _ in range(n):
        s = draw(st.sampled_from([0, 1, 1, 2, 2, 3, 3, 4, 5]))
        s = min(s, max(1, budget // max(rows, 1)))
        sizes.append(s)
        rows *= max(s, 1)
    return sizes


@st.composite
def cases(draw, *, qk: bool, inplace: bool, aligned: bool = False, emulated_out: bool = False) -> Case:
    """A random call of a rotary op; ``qk`` draws a k (same rank and head_dim, other head counts),
    ``inplace`` keeps every target free of overlap, ``aligned`` makes the 16-byte vector path of the
    CUDA kernel body applicable, ``emulated_out`` draws strided output views too."""
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(2, 5))
    if aligned:
        rotary_dim = 16 * draw(st.integers(1, 8))
        head_dim = rotary_dim + 16 * draw(st.integers(0, 3))
    else:
        head_dim = draw(st.one_of(st.integers(2, 24), st.integers(2, 512)))
        rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    budget = max(1, MAX_ELEMENTS // head_dim)
    q_batch = _sizes(draw, rank - 1, budget)
    token = [draw(st.booleans()) for _ in q_batch]
    if qk:
        k_batch = [
            s if t or draw(st.booleans()) else draw(st.integers(0, 4))
            for s, t in zip(q_batch, token, strict=True)
        ]
        rows = math.prod(max(s, 1) for s in k_batch)
        k_batch = [s if rows <= budget or t else min(s, 1) for s, t in zip(k_batch, token, strict=True)]
    # Positions: size of q where they vary, else 1 (full rank); the positions rule (rope_ext.positions)
    # also takes leading size-1 dims dropped when the last dim is 1.
    full = [s if t else 1 for s, t in zip(q_batch, token, strict=True)]
    forms = [full]
    if full and full[-1] == 1:
        lead_ones = next((i for i, t in enumerate(token) if t), len(token))
        forms += [full[i:] for i in range(1, lead_ones + 1)]
    pos_shape = draw(st.sampled_from(forms))
    align = 8 if aligned else 1

    shape_q = (*q_batch, head_dim)
    k = None
    shared = False
    if qk:
        shape_k = (*k_batch, head_dim)
        differ = [d for d in range(rank) if shape_q[d] != shape_k[d]]
        mode = draw(
            st.sampled_from(["separate", "shared", "packed"] if len(differ) <= 1 else ["separate", "shared"])
        )
        if mode == "packed":
            d = differ[0] if differ else draw(st.integers(0, rank - 1))
            gap = draw(st.integers(0, 1)) * (align if d == rank - 1 else 1)
            packed_shape = list(shape_q)
            packed_shape[d] = shape_q[d] + gap + shape_k[d] + draw(st.integers(0, 2)) * align
            pv = draw(views(tuple(packed_shape), align=align))
            if d == rank - 1 and pv.strides[d] != 1:
                pv = View(pv.shape, tuple(1 if i == d else s for i, s in enumerate(pv.strides)), pv.offset)
            # Size-1 dims may have any stride; packed q and k must not meet through them.
            if any(n == 1 and s == 0 for n, s in zip(packed_shape, pv.strides, strict=True)):
                pv = View(pv.shape, tuple(s if s else 1 for s in pv.strides), pv.offset)
            q = View(shape_q, pv.strides, pv.offset)
            k = View(shape_k, pv.strides, pv.offset + (shape_q[d] + gap) * pv.strides[d])
            shared = True
        else:
            q = draw(views(shape_q, expand=not inplace, align=align))
            shared = mode == "shared"
            start = (q.end() + align + draw(st.integers(0, 2)) * align) if shared else 0
            start = -(-start // align) * align
            k = draw(views(shape_k, expand=not inplace, align=align, start=start))
    else:
        q = draw(views(shape_q, expand=not inplace, align=align))
    # Rotary part at an offset (vLLM's rope_dim_offset; a multiple of 16 keeps the vector path of an
    # aligned case) and MRoPE sections (positions get a leading dim of 3), each in about a third of the draws.
    rotary_offset = 0
    if head_dim > rotary_dim and draw(st.integers(0, 2)) == 0:
        step = 16 if aligned else 1
        rotary_offset = step * draw(st.integers(0, (head_dim - rotary_dim) // step))
    mrope_section = None
    mrope_interleaved = False
    if draw(st.integers(0, 2)) == 0:
        half = rotary_dim // 2
        mrope_interleaved = draw(st.sampled_from([False, True, "alternating"]))
        if mrope_interleaved == "alternating":  # height and width take turns: as many pairs each
            h = draw(st.integers(0, half // 2))
            mrope_section = (half - 2 * h, h, h)
        else:
            t = draw(st.integers(0, half))
            h = draw(st.integers(0, half - t))
            mrope_section = (t, h, half - t - h)
        pos_shape = [3, *pos_shape]
    pos = draw(views(tuple(pos_shape), contiguous_last=False, expand=True))
    out = out_k = None
    if emulated_out:
        out = draw(views(shape_q, align=align))
        if k is not None:
            out_k = draw(views(k.shape, align=align))
    n_cache = draw(st.one_of(st.integers(1, 40), st.integers(1, 5000)))
    return Case(
        dtype=dtype,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        q=q,
        k=k,
        shared_buffer=shared,
        pos=pos,
        pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        n_cache=n_cache,
        cs_dtype=draw(st.sampled_from([torch.float32, dtype])),
        cs_pad=(align * draw(st.integers(0, 2)), align * draw(st.integers(0, 2))),
        interleaved=draw(st.booleans()),
        inverse=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 1.0, 0.01, 300.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
        out=out,
        out_k=out_k,
        rotary_offset=rotary_offset,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
    )


@dataclass
class Built:
    """Tensors of a case: flat buffers (``bufs``) and the views into them."""

    bufs: list[torch.Tensor]
    q: torch.Tensor
    k: torch.Tensor | None
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_view: View
    k_view: View | None
    k_buf: int  # index of k's buffer in bufs


def _random(n: int, dtype: torch.dtype, scale: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)


def build(case: Case) -> Built:
    """Materializes a case; guard values fill every element outside the views."""
    from rope_ext import RopeCache

    gen = torch.Generator().manual_seed(case.seed)
    bufs = []
    q_len = case.q.end() + 3
    if case.k is not None and case.shared_buffer:
        q_len = max(q_len, case.k.end() + 3)
    bufs.append(_random(q_len, case.dtype, case.scale, gen))
    k_buf = 0
    if case.k is not None and not case.shared_buffer:
        bufs.append(_random(case.k.end() + 3, case.dtype, case.scale, gen))
        k_buf = 1
    q = case.q.of(bufs[0])
    k = None if case.k is None else case.k.of(bufs[k_buf])
    # Positions: in range inside the view, far out of range outside it.
    pbuf = torch.full((case.pos.end() + 2,), case.n_cache + 10**6, dtype=case.pos_dtype)
    inside = view_mask(case.pos, pbuf.numel())
    pbuf[inside] = torch.randint(0, case.n_cache, (int(inside.sum()),), generator=gen).to(case.pos_dtype)
    positions = case.pos.of(pbuf)
    table = RopeCache(case.rotary_dim, 10000.0, max_positions=case.n_cache, dtype=case.cs_dtype).cos_sin
    before, after = case.cs_pad
    cbuf = torch.full((case.n_cache, before + case.rotary_dim + after), float("nan"), dtype=case.cs_dtype)
    cbuf[:, before : before + case.rotary_dim] = table
    cos_sin = cbuf[:, before : before + case.rotary_dim]
    return Built(bufs, q, k, positions, cos_sin, case.q, case.k, k_buf)


def view_mask(view: View, length: int) -> torch.Tensor:
    """Bool ``[length]``: the buffer elements that ``view`` covers."""
    mask = torch.zeros(length, dtype=torch.bool)
    if 0 not in view.shape:
        mask[torch.arange(length).as_strided(view.shape, view.strides, view.offset).flatten()] = True
    return mask


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a floating tensor (for bit-exact comparisons that see NaN payloads and -0)."""
    return t.contiguous().view(INT_OF[t.dtype])

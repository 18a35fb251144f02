"""Every CUDA kernel of rope_ext on tiny shapes, for NVIDIA compute-sanitizer.

``benchmarks/gpu_check.sh`` runs this script under compute-sanitizer's memcheck, racecheck, synccheck and
initcheck. Each case calls a public op once or twice on CUDA tensors, covering every kernel family:

* ``apply_rotary`` (half-split and interleaved pairing, out of place, inverse, backward),
  ``apply_rotary_qk``, ``apply_rotary_qk_`` (in place, k None), partial rotary and ``rotary_offset``, MRoPE
  (contiguous and interleaved sections), decode (T = 1: heads split over blocks), int32 positions, a cos/sin
  table in x's dtype, ``varlen_positions`` (with context parallelism) feeding a rotation;
* ``apply_rotary_qk_and_cache_``: caches of q's dtype (NHD and HND), fp8 caches with scales, a q_out of q's
  dtype and fp8 q_out, packed q/k/v views, cache views, padding slots, MRoPE, FlashInfer page tables;
* ``apply_mla_rotary_and_cache_``: latent caches of q's dtype and fp8, q_out of q's dtype and fp8, kv_c and
  k_pe as views of one projection, shapes no vector access fits, a DeepSeek-V3 decode step;
* ``rerotate_kv_cache_``: float and fp8 caches, NHD and HND, shifts of both signs, one shift for all,
  partial rotary, unaligned views, a decode step;
* ``apply_qk_norm_rotary`` (and its backward) and the packed in-place ``apply_qk_norm_rotary_``;

each on float32, bfloat16, float16 and float64, on shapes the 16-byte vector path takes and on unaligned
shapes and views (the scalar fallback). The inputs are drawn on the CPU and copied to the device (the only
other CUDA kernels are PyTorch's copies, clones and fills). Every result is copied back and compared with the
same call on CPU tensors (loosely: a few units in the last place; one step for fp8 codes), so a kernel that
did not run or wrote garbage fails the run as well.

Usage: ``python benchmarks/gpu_sanitize.py [--device cuda|cpu] [--only SUBSTRING] [--list]``. ``--device
cpu`` runs every case twice on the CPU and compares (a check of the script without a GPU). Exits 1 when a call
raised or disagreed, 0 otherwise; compute-sanitizer's ``--error-exitcode`` reports its own findings.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable

import torch

import rope_ext

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
P = 64  # rows of every cos/sin table
# Allowed |cuda - cpu|, relative to the largest magnitude of the CPU result: a few ulps of the dtype (the
# QK norm sums in another order on the GPU); fp8: one code step at the top of the range.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 4e-3}
TOLERANCE |= {E4M3: 0.13, E5M2: 0.26}


class Inputs:
    """Draws a case's tensors on the CPU (one seeded generator per case) and puts them on ``device``, so the
    CPU and the device runs of a case get the same values."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype=torch.float32, lead: int = 0, pad: int = 0) -> torch.Tensor:
        """``[*shape]``; with ``lead`` / ``pad``, a view of a wider tensor along the last dim (``lead`` odd:
        misaligned for every dtype)."""
        *rest, last = shape
        base = torch.randn(*rest, last + lead + pad, generator=self.gen, dtype=torch.float64)
        return (base * 2).to(dtype).to(self.device)[..., lead : lead + last]

    def positions(self, *shape: int, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(0, P, shape, generator=self.gen).to(dtype).to(self.device)

    def table(self, rotary_dim: int, dtype=torch.float32) -> torch.Tensor:
        return rope_ext.reference.cos_sin_table(P, rotary_dim).to(dtype).to(self.device)

    def slots(self, n: int, n_slots: int) -> torch.Tensor:
        s = torch.randperm(n_slots, generator=self.gen)[:n]
        s[torch.rand(n, generator=self.gen) < 0.25] = -1  # padding tokens: rotated, not written
        return s.to(self.device)

    def cache(self, shape, dtype) -> torch.Tensor:
        if dtype in (E4M3, E5M2):  # random codes, NaN included: the slots not written keep them
            codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.gen)
            return codes.view(dtype).to(self.device)
        return self.randn(*shape, dtype=dtype)

    def scale(self, value: float) -> torch.Tensor:
        return torch.tensor([value]).to(self.device)


Case = Callable[[Inputs], list[torch.Tensor]]
CASES: dict[str, Case] = {}


def case(name: str):
    def register(fn: Case) -> Case:
        assert name not in CASES, name
        CASES[name] = fn
        return fn

    return register


# Shapes: (tokens, q heads, k heads, head_dim, rotary_dim, rotary_offset, lead of the views). "vec": 16-byte
# accesses for every dtype; "odd": head_dim, rotary_dim, offset and views no vector access fits.
SHAPES = {"vec": (5, 4, 2, 64, 64, 0, 0), "odd": (3, 3, 1, 12, 6, 2, 1), "decode": (1, 8, 2, 64, 32, 32, 0)}


def _rotary_cases() -> None:
    for dname, dtype in DTYPES.items():
        for sname, (t, hq, hk, d, r, off, lead) in SHAPES.items():
            for il in (False, True):
                tag = f"{dname}-{sname}-{'interleaved' if il else 'half'}"
                kw = dict(interleaved=il, rotary_offset=off)

                @case(f"rotary-out-{tag}")
                def _(x: Inputs, t=t, hq=hq, hk=hk, d=d, r=r, lead=lead, dtype=dtype, kw=kw):
                    q = x.randn(t, hq, d, dtype=dtype, lead=lead)
                    k = x.randn(t, hk, d, dtype=dtype, lead=lead)
                    pos, cs = x.positions(t, 1), x.table(r)
                    return [
                        rope_ext.apply_rotary(q, pos, cs, **kw),
                        rope_ext.apply_rotary(k, pos, cs, inverse=True, **kw),
                        *rope_ext.apply_rotary_qk(q, k, pos, cs, **kw),
                    ]

                @case(f"rotary-inplace-{tag}")
                def _(x: Inputs, t=t, hq=hq, hk=hk, d=d, r=r, lead=lead, dtype=dtype, kw=kw):
                    q = x.randn(t, hq, d, dtype=dtype, lead=lead)
                    k = x.randn(t, hk, d, dtype=dtype, lead=lead)
                    pos = x.positions(t, 1, dtype=torch.int32)
                    rope_ext.apply_rotary_qk_(q, k, pos, x.table(r, dtype), **kw)  # cos/sin in x's dtype
                    q2 = x.randn(t, hq, d, dtype=dtype)
                    rope_ext.apply_rotary_qk_(q2, None, pos, x.table(r), **kw)
                    return [q, k, q2]

            if dtype in (torch.float32, torch.float64):

                @case(f"rotary-backward-{dname}-{sname}")
                def _(x: Inputs, t=t, hq=hq, d=d, r=r, off=off, lead=lead, dtype=dtype):
                    q = x.randn(t, hq, d, dtype=dtype, lead=lead).requires_grad_()
                    y = rope_ext.apply_rotary(q, x.positions(t, 1), x.table(r), rotary_offset=off)
                    y.backward(x.randn(t, hq, d, dtype=dtype))
                    return [y.detach(), q.grad]

    for il_sections in (False, True):

        @case(f"rotary-mrope-{'interleaved' if il_sections else 'sections'}")
        def _(x: Inputs, il_sections=il_sections):
            q, k = x.randn(4, 4, 64, dtype=torch.bfloat16), x.randn(4, 2, 64, dtype=torch.bfloat16)
            kw = dict(mrope_section=(16, 8, 8), mrope_interleaved=il_sections)
            pos, cs = x.positions(3, 4, 1), x.table(64)
            out = list(rope_ext.apply_rotary_qk(q, k, pos, cs, **kw))
            rope_ext.apply_rotary_qk_(q, k, pos, cs, **kw)
            return [*out, q, k]

    for kind in ("int64", "float64", "float32"):

        @case(f"rotary-table-free-{kind}-positions")
        def _(x: Inputs, kind=kind):
            """The rows' launch (rope/cuda/angles.cuh), then the rotation reading them (and MRoPE axes)."""
            freqs = rope_ext.RopeCache(64, max_positions=1).frequencies_on(x.device)
            q, k = x.randn(6, 4, 64, dtype=torch.bfloat16), x.randn(6, 2, 64, dtype=torch.bfloat16)
            pos = x.positions(6, 1).to(getattr(torch, kind))
            if kind != "int64":
                pos = pos / 3.0
            out = list(rope_ext.apply_rotary_qk(q, k, pos, freqs))
            axes = x.positions(3, 6, 1).to(pos.dtype)
            rope_ext.apply_rotary_qk_(q, k, axes, freqs, mrope_section=(16, 8, 8), interleaved=True)
            return [*out, q, k, torch.ops.rope_ext._angle_rows(pos[:, 0], freqs)]

    @case("varlen-positions-cp")
    def _(x: Inputs):
        cu = torch.tensor([0, 8, 8, 20, 32]).to(x.device)
        starts = torch.tensor([3, 0, 5, 1]).to(x.device)
        outs = [rope_ext.varlen_positions(cu, total_tokens=32, start_positions=starts)]
        outs += [rope_ext.varlen_positions(cu, total_tokens=16, cp_size=2, cp_rank=r) for r in (0, 1)]
        q = x.randn(16, 4, 32, dtype=torch.float16)
        outs.append(rope_ext.apply_rotary(q, outs[-1][:, None], x.table(32)))
        return outs


def _cache_call(
    x: Inputs, dtype, *, t=6, hq=4, hk=2, d=64, r=64, off=0, dv=None, lead=0, layout="NHD", cache_dtype=None,
    q_out=None, packed=False, view=False, block_size=4, interleaved=False, mrope=None, paged=False,
) -> list[torch.Tensor]:  # fmt: skip
    dv = d if dv is None else dv
    if packed:
        qkv = x.randn(t, hq + 2 * hk, d, dtype=dtype)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    else:
        q, k, v = (x.randn(t, h, n, dtype=dtype, lead=lead) for h, n in ((hq, d), (hk, d), (hk, dv)))
    nb = -(-(t + 2) // block_size)
    cdt = dtype if cache_dtype is None else cache_dtype
    extra = 1 if view else 0  # a view of a cache with one more block, the first one left out

    def cache(n):
        shape = (nb + extra, block_size, hk, n) if layout == "NHD" else (nb + extra, hk, block_size, n)
        return x.cache(shape, cdt)[extra:]

    kc, vc = cache(d), cache(dv)
    qo = None if q_out is None else x.cache((t, hq, d), dtype if q_out == "same" else q_out)
    pos = x.positions(t) if mrope is None else x.positions(3, t)
    slots = x.slots(t, nb * block_size)
    where = {"page_table": _page_table(slots, block_size)} if paged else {"slot_mapping": slots}
    rope_ext.apply_rotary_qk_and_cache_(
        q, k, v, pos, x.table(r), kc, vc, interleaved=interleaved, layout=layout,
        k_scale=x.scale(0.37), v_scale=x.scale(1.9), q_out=qo, q_scale=x.scale(0.61), rotary_offset=off,
        mrope_section=mrope, mrope_interleaved=False, **where,
    )  # fmt: skip
    return [t_ for t_ in (q, k, kc, vc, qo) if t_ is not None]


def _page_table(slots: torch.Tensor, block_size: int) -> rope_ext.PageTable:
    """FlashInfer's page table placing token t at slots[t] (slot -1: batch index -1): the tokens in two
    requests, the second with an int64 page list; each page holds one token's row."""
    t, i32 = slots.shape[0], torch.int32
    rows = (slots.clamp_min(0) % block_size).to(i32)
    half = t // 2
    # request 0: tokens [0, half), request 1: the rest; each token its own page in its request's list
    batch = (torch.arange(t, device=slots.device) >= half).to(i32).masked_fill(slots < 0, -1)
    pos = torch.arange(t, device=slots.device)
    pos = torch.where(pos < half, pos, pos - half) * block_size + rows
    pages = (slots.clamp_min(0) // block_size).to(torch.int64)
    indptr = torch.tensor([0, half, t], dtype=i32, device=slots.device)
    return rope_ext.PageTable(batch, pos.to(i32), pages, indptr, None)


def _cache_cases() -> None:
    variants = {
        "nhd": {},
        "hnd-interleaved": dict(layout="HND", interleaved=True),
        "e4m3-qout-same": dict(cache_dtype=E4M3, q_out="same", view=True),
        "e5m2-hnd-qout-e5m2": dict(cache_dtype=E5M2, layout="HND", q_out=E5M2, packed=True),
        "e4m3-offset-qout-e4m3": dict(cache_dtype=E4M3, r=32, off=16, q_out=E4M3, interleaved=True),
        "odd": dict(d=12, r=6, off=2, dv=5, lead=1, block_size=3),
        "odd-e5m2-hnd": dict(d=12, r=6, off=6, dv=7, lead=1, cache_dtype=E5M2, layout="HND", q_out=E5M2),
        "decode": dict(t=1, hq=8, r=32, off=32, block_size=16),
        "mrope": dict(mrope=(16, 8, 8), cache_dtype=E4M3),
        "paged-hnd": dict(layout="HND", paged=True),
        "paged-e4m3-decode": dict(t=1, hq=8, r=32, block_size=16, cache_dtype=E4M3, paged=True),
    }
    for dname, dtype in DTYPES.items():
        for vname, kw in variants.items():
            CASES[f"cache-{dname}-{vname}"] = lambda x, dtype=dtype, kw=kw: _cache_call(x, dtype, **kw)


def _mla_call(
    x: Inputs, dtype, *, t=6, h=4, nope=32, r=32, rank=64, lead=0, cache_dtype=None, q_out=None, block_size=4,
    interleaved=False,
) -> list[torch.Tensor]:  # fmt: skip
    q = x.randn(t, h, nope + r, dtype=dtype, lead=lead)
    kv = x.randn(t, rank + r, dtype=dtype, lead=lead)  # kv_c and k_pe: views of one projection
    kv_c, k_pe = kv[:, :rank], kv[:, rank:]
    nb = -(-(t + 2) // block_size)
    cache = x.cache((nb, block_size, rank + r), dtype if cache_dtype is None else cache_dtype)
    qo = None if q_out is None else x.cache((t, h, nope + r), dtype if q_out == "same" else q_out)
    rope_ext.apply_mla_rotary_and_cache_(
        q, kv_c, k_pe, x.positions(t), x.table(r), cache, x.slots(t, nb * block_size), rotary_offset=nope,
        interleaved=interleaved, kv_scale=x.scale(0.37), q_out=qo, q_scale=x.scale(0.61),
    )  # fmt: skip
    return [t_ for t_ in (q, k_pe, cache, qo) if t_ is not None]


def _mla_cases() -> None:
    variants = {
        "vec": {},
        "interleaved-e4m3-qout-e4m3": dict(interleaved=True, cache_dtype=E4M3, q_out=E4M3),
        "qout-same": dict(q_out="same"),
        "odd-e5m2": dict(nope=6, r=6, rank=10, lead=1, cache_dtype=E5M2, block_size=3),
        "decode": dict(t=1, h=16, nope=128, r=64, rank=512, block_size=16),
    }
    for dname, dtype in DTYPES.items():
        for vname, kw in variants.items():
            CASES[f"mla-{dname}-{vname}"] = lambda x, dtype=dtype, kw=kw: _mla_call(x, dtype, **kw)


def _rerotate_call(
    x: Inputs, dtype, *, t=6, hk=2, d=64, r=64, off=0, lead=0, layout="NHD", cache_dtype=None, block_size=4,
    interleaved=False, one_delta=False,
) -> list[torch.Tensor]:  # fmt: skip
    nb = -(-(t + 2) // block_size)
    cdt = dtype if cache_dtype is None else cache_dtype
    shape = (nb, block_size, hk, d + lead) if layout == "NHD" else (nb, hk, block_size, d + lead)
    cache = x.cache(shape, cdt)[..., lead:]
    delta = x.positions(1 if one_delta else t) - P // 2  # both signs
    rope_ext.rerotate_kv_cache_(
        cache, x.slots(t, nb * block_size), delta, x.table(r), layout=layout, interleaved=interleaved,
        k_scale=x.scale(0.37), rotary_offset=off,
    )  # fmt: skip
    return [cache]


def _rerotate_cases() -> None:
    variants = {
        "nhd": {},
        "hnd-interleaved-partial": dict(layout="HND", interleaved=True, r=32, off=16),
        "e4m3": dict(cache_dtype=E4M3, one_delta=True),
        "e5m2-hnd-interleaved": dict(cache_dtype=E5M2, layout="HND", interleaved=True),
        "odd": dict(d=12, r=6, off=2, lead=1, block_size=3),
        "decode": dict(t=1, hk=8, d=128, r=64, off=64, block_size=16),
    }
    for dname, dtype in DTYPES.items():
        for vname, kw in variants.items():
            CASES[f"rerotate-{dname}-{vname}"] = lambda x, dtype=dtype, kw=kw: _rerotate_call(x, dtype, **kw)


def _norm_call(x: Inputs, dtype, *, t=5, heads=(4, 2, 2), d=64, r=64, off=0, lead=0, il=False, mrope=None):
    qkv = x.randn(t, sum(heads) * d, dtype=dtype, lead=lead, pad=lead)
    qw, kw = x.randn(d), x.randn(d, dtype=dtype)
    pos = x.positions(t) if mrope is None else x.positions(3, t)
    opts = dict(eps=1e-6, interleaved=il, weight_offset=1.0, rotary_offset=off, mrope_section=mrope)
    hq, hk, _ = heads
    q = qkv[:, : hq * d].unflatten(-1, (hq, d))
    k = qkv[:, hq * d : (hq + hk) * d].unflatten(-1, (hk, d))
    out = list(rope_ext.apply_qk_norm_rotary(q, k, qw, kw, pos, x.table(r), **opts))
    rope_ext.apply_qk_norm_rotary_(qkv, *heads, qw, kw, pos, x.table(r), **opts)
    return [*out, qkv]


def _norm_cases() -> None:
    variants = {
        "vec": {},
        "vec-interleaved-partial": dict(r=32, il=True),
        "odd": dict(d=40, r=20, off=6, lead=1, heads=(3, 1, 0)),
        "decode-offset": dict(t=1, heads=(8, 2, 2), d=128, r=64, off=64),
        "head512": dict(t=2, heads=(2, 1, 1), d=512, r=128),
        "mrope": dict(mrope=(16, 8, 8)),
    }
    for dname, dtype in DTYPES.items():
        for vname, kw in variants.items():
            CASES[f"qknorm-{dname}-{vname}"] = lambda x, dtype=dtype, kw=kw: _norm_call(x, dtype, **kw)
        if dtype in (torch.float32, torch.float64):

            @case(f"qknorm-backward-{dname}")
            def _(x: Inputs, dtype=dtype):
                q = x.randn(3, 4, 32, dtype=dtype).requires_grad_()
                k = x.randn(3, 2, 32, dtype=dtype).requires_grad_()
                qw, kw = x.randn(32, dtype=dtype).requires_grad_(), x.randn(32, dtype=dtype)
                pos, cs = x.positions(3), x.table(16)
                qo, ko = rope_ext.apply_qk_norm_rotary(q, k, qw, kw, pos, cs, interleaved=True)
                (qo.square().sum() + (ko * 3).sum()).backward()
                return [qo.detach(), ko.detach(), q.grad, k.grad, qw.grad]


_rotary_cases()
_cache_cases()
_mla_cases()
_rerotate_cases()
_norm_cases()


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    """None when the device results agree with the CPU ones, else what differs."""
    if len(got) != len(want):
        return f"{len(got)} results, the CPU gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = g.cpu()
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"result {i}: {g.dtype}{list(g.shape)}, the CPU gives {w.dtype}{list(w.shape)}"
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return f"result {i}: integers differ"
            continue
        g64, w64 = g.double(), w.double()
        finite = w64.isfinite()
        if not torch.equal(g64.isnan(), w64.isnan()) or not torch.equal(g64[w64.isinf()], w64[w64.isinf()]):
            return f"result {i}: NaN or infinities at other places"
        g64, w64 = g64[finite], w64[finite]
        if w64.numel() == 0:
            continue
        err = (g64 - w64).abs().max().item()
        scale = max(w64.abs().max().item(), 1e-30)
        if not err <= TOLERANCE[w.dtype] * scale:
            return f"result {i} ({w.dtype}): max |device - cpu| = {err:.3g}, max |cpu| = {scale:.3g}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the cases run twice on the CPU)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this substring")
    ap.add_argument("--list", action="store_true", help="list the cases, then exit")
    a = ap.parse_args(argv)
    names = [n for n in CASES if a.only in n]
    if a.list:
        print("\n".join(names))
        return 0
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_sanitize: no CUDA device", file=sys.stderr)
        return 2
    failed = []
    start = time.perf_counter()
    for seed, name in enumerate(names):
        try:
            want = CASES[name](Inputs(torch.device("cpu"), seed))
            got = CASES[name](Inputs(device, seed))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            problem = compare(got, want)
            if problem:
                failed.append(name)
                print(f"DIFFERS {name}: {problem}", flush=True)
        except Exception:
            failed.append(name)
            print(f"ERROR {name}:\n{traceback.format_exc()}", flush=True)
    took = time.perf_counter() - start
    print(f"gpu_sanitize: {len(names) - len(failed)} of {len(names)} cases ok on {device} in {took:.1f} s")
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Workloads: the run's configuration, one workload's inputs (:class:`Case`) and its input sets.

A workload is a preset (or custom shape), a token count, a phase, a dtype, a pairing and, for a packed
prefill, a number of sequences. Its inputs are ``q [T, Hq, D]``, ``k [T, Hkv, D]`` (token-major,
contiguous), ``positions`` and a float32 cos/sin cache. Positions (int64):

* prefill: ``0..T-1``;
* packed prefill (``--seqs N``): ``N`` sequences of mixed lengths summing to ``T``
  (:func:`packed_cu_seqlens`), positions ``rope_ext.varlen_positions(cu_seqlens, total_tokens=T)``: each
  sequence counts from 0;
* decode: random positions in ``[0, DECODE_CONTEXT)``, one token of each of ``T`` sequences;
* MRoPE presets (``Preset.mrope_section``): ``[3, T]`` (temporal, height, width). Prefill: a prompt of
  text, one image, text (:func:`mrope_prefill_positions`); decode: text tokens, the three rows equal.
* vision and diffusion presets (``Preset.axes``): ``[n_axes, T]`` laid out as the model lays out its tokens
  (:func:`axes_prefill_positions`), the table ``RopeCache.for_axes(axes.dims, theta=base)`` (frequencies
  restarting per axis); prefills only.

The serving modes (``cache``, ``cache-fp8``, ``qknorm``) add, built on first use (:attr:`Case.serving`):
``v [T, Hkv, D]``, packed with q and k as servers hold them (:meth:`Case.packed_qkv`: ``[T, Hq+2Hkv, D]``,
q, k and v its views), a paged NHD KV cache (:meth:`Case.new_caches`: ``[num_blocks, KV_BLOCK_SIZE, Hkv,
D]`` of q's dtype or float8_e4m3fn, zeroed), distinct int64 slots (a prefill: a random permutation of a
cache of just its tokens; a decode step: random slots of ``DECODE_CACHE_SLOTS``), one-element float32
``k_scale``/``v_scale`` (fp8 caches) and random QK-norm weights ``[D]`` of q's dtype. The MLA modes (``mla``,
``mla-fp8``; presets with an MLA shape) take theirs from :mod:`.mla` (:attr:`Case.mla`), the rerotate modes
(``rerotate``, ``rerotate-fp8``: a cache holding k, per-token shifts) from :mod:`.rerotate`
(:attr:`Case.rerotate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import rope_ext
from rope_ext import reference

from .mla import MlaInputs, mla_inputs, mla_shape
from .presets import (
    DECODE_CACHE_SLOTS,
    DECODE_CONTEXT,
    KV_BLOCK_SIZE,
    MLA_MODES,
    QKNORM_EPS,
    QKNORM_WEIGHT,
    REROTATE_MODES,
    Axes,
    Preset,
)
from .rerotate import RerotateInputs, rerotate_bytes, rerotate_inputs

__all__ = [
    "FP8_CACHE_DTYPE",
    "Case",
    "Config",
    "ServingInputs",
    "axes_prefill_positions",
    "clones",
    "cycle",
    "input_sets",
    "last_level_cache_bytes",
    "make_case",
    "mrope_prefill_positions",
    "packed_cu_seqlens",
    "split_qkv",
    "workloads",
]

FP8_CACHE_DTYPE = torch.float8_e4m3fn  # the cache-fp8 mode's KV-cache dtype (vLLM's kv_cache_dtype="fp8")


@dataclass
class Config:
    """What to run; see ``rope-bench --help`` for the meaning of each field."""

    presets: list[Preset]
    prefill_tokens: list[int]
    decode_tokens: list[int]
    dtypes: list[torch.dtype]
    pairings: list[str]  # "model" | "half" | "interleaved"
    modes: list[str]
    providers: list[str] | None = None  # None: all
    device: str = "cpu"
    rounds: int = 10
    min_run_time: float = 0.1
    tol_ulps: float = 8.0
    allocator: str = "fresh"  # CPU: see timing.set_cpu_allocator
    cache: str = "cold"  # CPU: see input_sets
    progress: bool = True
    seqs: list[int] = field(default_factory=list)  # packed prefill: sequence counts (empty: not packed)
    model_tokens: bool = False  # also each axes preset's own prefill (Axes.tokens)


@dataclass
class Case:
    """One workload with its inputs and float64 expected results (built once, shared by providers)."""

    preset: Preset
    tokens: int
    phase: str  # "prefill" | "decode"
    dtype: torch.dtype
    interleaved: bool
    device: torch.device
    q: Tensor
    k: Tensor
    positions: Tensor  # int64 [T], or [n_axes, T] for MRoPE and axes presets
    cos_sin: Tensor  # float32 [P, rotary_dim]
    grad_q: Tensor
    grad_k: Tensor
    cu_seqlens: Tensor | None = None  # int32 [N + 1]: a packed prefill of N sequences
    freqs: Tensor | None = None  # float64 [rotary_dim]: cos_sin's frequencies (the table-free mode)
    _expected: dict[str, tuple[Tensor, ...]] = field(default_factory=dict)
    _serving: dict[str, Any] = field(default_factory=dict)  # built on first use, shared by copies

    @property
    def rotary_dim(self) -> int:
        return self.cos_sin.shape[-1]

    @property
    def pairing(self) -> str:
        return "interleaved" if self.interleaved else "half-split"

    @property
    def mrope_section(self) -> tuple[int, ...] | None:
        """What the ops take as ``mrope_section``: the MRoPE sections or the axes' pairs (or None)."""
        return self.preset.sections

    @property
    def seqs(self) -> int:
        """Number of packed sequences; 0 when the workload is not a packed batch."""
        return 0 if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    @property
    def rope_positions(self) -> Tensor:
        """``positions`` as the ops take them with q ``[T, H, D]``: ``[T, 1]``, or ``[n_axes, T, 1]``."""
        return self.positions[..., None]

    def expected(self, mode: str) -> tuple[Tensor, Tensor]:
        """Float64 reference: the rotation of (q, k), or for backward the inverse rotation of the grads."""
        key = "backward" if mode == "backward" else "forward"
        if key not in self._expected:
            pos = self.rope_positions.cpu()
            inverse = key == "backward"
            a, b = (self.grad_q, self.grad_k) if inverse else (self.q, self.k)
            self._expected[key] = tuple(  # type: ignore[assignment]
                reference.rotary_hadamard(
                    t.cpu(),
                    pos,
                    self.cos_sin.cpu(),
                    interleaved=self.interleaved,
                    inverse=inverse,
                    mrope_section=self.mrope_section,
                )
                for t in (a, b)
            )
        return self._expected[key]

    def copy_inputs(self) -> Case:
        """The same workload on fresh copies of q, k and the grads (positions, cos/sin, expected shared)."""
        return dataclasses.replace(
            self,
            q=self.q.clone(),
            k=self.k.clone(),
            grad_q=self.grad_q.clone(),
            grad_k=self.grad_k.clone(),
        )

    def bytes_moved(self, mode: str = "inplace") -> int:
        """The op's minimum traffic: one cos/sin row and the positions (3 for MRoPE) read per token, and

        * ``inplace``, ``out``, ``backward``, ``qknorm``: q and k read and written once (``qknorm``: plus
          the two norm weights; v is not touched);
        * ``cache``, ``cache-fp8``: q and k read and written once, v read once, the cache rows of k and v
          written once (:meth:`cache_bytes`) and the slot of each token (int64) read;
        * ``mla``, ``mla-fp8`` (q and k are the rope parts ``q_pe [T, H, R]``, ``k_pe [T, 1, R]``): q's rope
          part and k_pe read and written once, ``kv_c`` read once (:meth:`kv_c_bytes`), the latent cache rows
          written once (:meth:`mla_cache_bytes`) and the slots read: ``2 T H R e + 2 T R e + T L e + T (L +
          R) c + 8 T`` plus the cos/sin rows and positions (``e`` q's element size, ``c`` the cache's, ``L``
          kv_lora_rank; q's nope part is not touched; see :mod:`.mla`);

        except ``rerotate``, ``rerotate-fp8``, which touch neither q nor k (nor count cos/sin rows): the
        rotated features of the cache rows read and written once and one slot and one delta (int64) read per
        token, ``2 T Hk R c + 16 T`` (``c`` the cache's element size; :mod:`.rerotate`).
        """
        if mode in REROTATE_MODES:
            return rerotate_bytes(self, mode == "rerotate-fp8")
        qk = sum(self.qk_bytes())
        pos = self.positions.numel() * self.positions.element_size()
        n = 2 * qk + self.tokens * self.rotary_dim * self.cos_sin.element_size() + pos
        if mode == "qknorm":
            n += 2 * self.preset.head_dim * self.q.element_size()
        elif mode in ("cache", "cache-fp8"):
            n += self.v_bytes() + self.cache_bytes(mode == "cache-fp8") + 8 * self.tokens
        elif mode in MLA_MODES:
            n += self.kv_c_bytes() + self.mla_cache_bytes(mode == "mla-fp8") + 8 * self.tokens
        return n

    def qk_bytes(self) -> tuple[int, int]:
        return self.q.numel() * self.q.element_size(), self.k.numel() * self.k.element_size()

    def v_bytes(self) -> int:
        """Bytes of ``v [T, Hkv, D]`` (q's dtype)."""
        return self.k.numel() * self.k.element_size()

    def cache_bytes(self, fp8: bool) -> int:
        """Bytes of the key and value cache rows one call writes (q's dtype, or one byte per value)."""
        return 2 * self.k.numel() * (1 if fp8 else self.k.element_size())

    def kv_c_bytes(self) -> int:
        """Bytes of the MLA modes' ``kv_c [T, kv_lora_rank]`` (q's dtype)."""
        return self.tokens * mla_shape(self).kv_lora_rank * self.q.element_size()

    def mla_cache_bytes(self, fp8: bool) -> int:
        """Bytes of the latent cache rows one MLA call writes: ``kv_lora_rank + rotary_dim`` values a token
        (q's dtype, or one byte per value)."""
        width = mla_shape(self).kv_lora_rank + self.rotary_dim
        return self.tokens * width * (1 if fp8 else self.q.element_size())

    @property
    def mla(self) -> MlaInputs:
        """The MLA modes' extra inputs (:class:`~rope_ext.bench.mla.MlaInputs`), built on first use."""
        if "mla" not in self._serving:
            self._serving["mla"] = mla_inputs(self)
        return self._serving["mla"]

    @property
    def rerotate(self) -> RerotateInputs:
        """The rerotate modes' inputs (:class:`~rope_ext.bench.rerotate.RerotateInputs`), built on first
        use."""
        if "rerotate" not in self._serving:
            self._serving["rerotate"] = rerotate_inputs(self)
        return self._serving["rerotate"]

    @property
    def serving(self) -> ServingInputs:
        """The serving modes' extra inputs (:class:`ServingInputs`), built on first use, deterministic."""
        if "inputs" not in self._serving:
            self._serving["inputs"] = _serving_inputs(self)
        return self._serving["inputs"]

    def packed_qkv(self) -> Tensor:
        """A fresh packed ``qkv [T, Hq + 2 Hkv, D]``: q, k and ``serving.v`` (views: :func:`split_qkv`)."""
        return torch.cat([self.q, self.k, self.serving.v], dim=1)

    def new_caches(self, fp8: bool) -> tuple[Tensor, Tensor]:
        """Zeroed NHD ``key_cache``, ``value_cache`` ``[num_blocks, KV_BLOCK_SIZE, Hkv, D]``.

        Of q's dtype, or :data:`FP8_CACHE_DTYPE` when ``fp8``.
        """
        shape = (self.serving.num_blocks, KV_BLOCK_SIZE, self.preset.kv_heads, self.preset.head_dim)
        dt = FP8_CACHE_DTYPE if fp8 else self.dtype
        return tuple(torch.zeros(shape, dtype=dt, device=self.device) for _ in range(2))  # type: ignore[return-value]

    def cos_sin_rows(self) -> Tensor:
        """Each token's cos/sin row, ``[T, rotary_dim]`` float32 (cos half, then sin half).

        MRoPE and axes: pair ``j`` from the row of its section's axis, as HF's
        ``apply_multimodal_rotary_pos_emb`` builds its cos and sin once per forward.
        """
        rows = self.cos_sin[self.positions]  # [T, R], or [n_axes, T, R]
        if self.mrope_section is not None:
            sec = reference.mrope_rows(self.rotary_dim // 2, self.mrope_section).to(rows.device)
            rows = rows.gather(0, torch.cat([sec, sec]).expand(1, *rows.shape[1:]))[0]
        return rows

    def hf_cos_sin(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """HF-style ``cos``, ``sin`` ``[T, rotary_dim]`` gathered per token, in ``dtype`` (default x's)."""
        h = self.rotary_dim // 2
        rows = self.cos_sin_rows()
        c, s = rows[:, :h], rows[:, h:]
        if self.interleaved:
            c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        else:
            c, s = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
        dt = dtype or self.dtype
        return c.to(dt).contiguous(), s.to(dt).contiguous()


@dataclass
class ServingInputs:
    """The serving modes' inputs besides q, k, positions and cos/sin (see the module docstring)."""

    v: Tensor  # [T, Hkv, D], q's dtype
    slot_mapping: Tensor  # int64 [T], distinct slots of the cache
    num_blocks: int  # of the cache, KV_BLOCK_SIZE slots each
    k_scale: Tensor  # float32 [1] (fp8 caches)
    v_scale: Tensor  # float32 [1]
    q_weight: Tensor  # [D], q's dtype
    k_weight: Tensor  # [D]
    eps: float = QKNORM_EPS


def _serving_inputs(case: Case) -> ServingInputs:
    g = torch.Generator().manual_seed(1)  # independent of make_case's stream: q, k stay as they were
    t, p = case.tokens, case.preset
    v = torch.randn(t, p.kv_heads, p.head_dim, generator=g).to(case.dtype)
    slots_needed = max(t, DECODE_CACHE_SLOTS) if case.phase == "decode" else t
    num_blocks = max(1, math.ceil(slots_needed / KV_BLOCK_SIZE))
    slots = torch.randperm(num_blocks * KV_BLOCK_SIZE, generator=g)[:t].to(torch.int64)
    # QK-norm weights of one magnitude, random signs: each timed call normalises the output of the one
    # before, and with |w| constant every rotated pair (and unrotated feature) keeps its magnitude from
    # call to call. Weights of mixed magnitudes let the largest take over: the other features decay to
    # denormals within a few hundred calls, which CPUs handle slowly and real activations never hold.
    signs = [2 * torch.randint(0, 2, (p.head_dim,), generator=g) - 1 for _ in range(2)]
    w = [(QKNORM_WEIGHT * s).to(case.dtype) for s in signs]
    dev = case.device
    # Scales that use most of e4m3's range for standard-normal k (rotated: |k| up to ~7) and v.
    return ServingInputs(
        v=v.to(dev),
        slot_mapping=slots.to(dev),
        num_blocks=num_blocks,
        k_scale=torch.tensor([0.02], device=dev),
        v_scale=torch.tensor([0.015], device=dev),
        q_weight=w[0].to(dev),
        k_weight=w[1].to(dev),
    )


def split_qkv(qkv: Tensor, q_heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, D]`` of a packed ``qkv [T, Hq + 2 Hkv, D]``."""
    return qkv[:, :q_heads], qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]


def packed_cu_seqlens(tokens: int, seqs: int, generator: torch.Generator) -> Tensor:
    """``cu_seqlens`` (int32 ``[seqs + 1]``) of ``seqs`` sequences of mixed lengths summing to ``tokens``.

    The ``seqs - 1`` cuts are distinct tokens drawn uniformly from ``1..tokens-1``: every sequence has at
    least one token, lengths spread roughly exponentially around ``tokens / seqs`` (many short ones, a few
    several times the mean), deterministic for a seeded ``generator``.
    """
    if not 1 <= seqs <= tokens:
        raise ValueError(f"a packed batch needs 1 <= seqs <= tokens, got {seqs} sequences of {tokens} tokens")
    cuts = torch.randperm(tokens - 1, generator=generator)[: seqs - 1] + 1
    ends = torch.tensor([0, tokens])
    return torch.cat([ends[:1], cuts.sort().values, ends[1:]]).to(torch.int32)


def mrope_prefill_positions(tokens: int) -> Tensor:
    """MRoPE positions ``[3, tokens]`` (int64) of a prompt: text, one image, text.

    The image is a square grid of ``s x s`` tokens (after Qwen2-VL's 2x2 patch merge), ``s =
    isqrt(tokens / 2)``: about half the prompt; the text before it takes half of the rest. As Qwen2-VL's
    ``get_rope_index`` numbers them: a text token's three rows are equal and count on from the previous
    token; the image's tokens share the temporal position ``a`` (the number of text tokens before it)
    and have height ``a + row``, width ``a + column``; the text after it starts at ``a + s``.
    """
    s = math.isqrt(tokens // 2)
    a = (tokens - s * s) // 2
    b = tokens - s * s - a
    grid = torch.arange(s)
    image = torch.stack(
        [torch.full((s * s,), a), a + grid.repeat_interleave(s), a + grid.repeat(s)]
    )  # rows (t, h, w), tokens in row-major order of the grid
    return torch.cat(
        [torch.arange(a).expand(3, a), image, torch.arange(a + s, a + s + b).expand(3, b)], dim=1
    ).to(torch.int64)


def axes_prefill_positions(axes: Axes, tokens: int) -> Tensor:
    """Positions ``[len(axes.dims), tokens]`` (int64) of a prefill laid out as ``axes.layout`` says
    (:class:`~rope_ext.bench.presets.Axes`): ``flux`` text (zeros) then a square image ``(0, row, column)``,
    ``video`` ``(frame, row, column)`` in raster order over frames of ``axes.grid``, ``image`` ``(row,
    column)`` in 2 x 2 merge blocks."""
    i = torch.arange(tokens)
    if axes.layout == "flux":
        s = math.isqrt(tokens - tokens // 9)
        text = tokens - s * s
        image = torch.stack([torch.zeros(s * s, dtype=torch.long), i[: s * s] // s, i[: s * s] % s])
        return torch.cat([torch.zeros(3, text, dtype=torch.long), image], dim=1)
    if axes.layout == "video":
        rows, cols = axes.grid
        return torch.stack([i // (rows * cols), i // cols % rows, i % cols])
    s = math.isqrt(max(tokens, 1) - 1) + 1  # ceil(sqrt(T)), then even
    s += s % 2
    h, w = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    blocks = (s // 2, 2, s // 2, 2)  # get_vision_position_ids: 2 x 2 merge blocks, block-major
    grid = torch.stack(
        [h.reshape(blocks).transpose(1, 2).flatten(), w.reshape(blocks).transpose(1, 2).flatten()]
    )
    return grid[:, :tokens]


def make_case(
    preset: Preset,
    tokens: int,
    phase: str,
    dtype: torch.dtype,
    interleaved: bool,
    device: torch.device,
    seed: int = 0,
    seqs: int = 0,
) -> Case:
    """Random q, k, grads (standard normal) and positions for one workload (``seqs``: a packed prefill)."""
    g = torch.Generator().manual_seed(seed)
    mrope = preset.sections is not None
    cu_seqlens = None
    if seqs and (phase != "prefill" or mrope):
        raise ValueError("packed workloads (seqs) are prefills of presets with one position per token")
    if preset.axes is not None and phase != "prefill":
        raise ValueError(f"{preset.name}: presets with axes have prefills only")
    if preset.axes is not None:
        positions = axes_prefill_positions(preset.axes, tokens)
        n_pos = int(positions.max()) + 1 if tokens else 1
    elif phase == "decode":
        positions = torch.randint(0, DECODE_CONTEXT, (tokens,), generator=g, dtype=torch.int64)
        if mrope:
            positions = positions.expand(3, tokens).contiguous()
        n_pos = DECODE_CONTEXT
    elif seqs:
        cu_seqlens = packed_cu_seqlens(tokens, seqs, g)
        positions = rope_ext.varlen_positions(cu_seqlens, total_tokens=tokens, dtype=torch.int64)
        n_pos = max(tokens, 1)
    elif mrope:
        positions = mrope_prefill_positions(tokens)
        n_pos = int(positions.max()) + 1 if tokens else 1
    else:
        positions = torch.arange(tokens, dtype=torch.int64)
        n_pos = max(tokens, 1)
    if preset.axes is not None:
        cache = rope_ext.RopeCache.for_axes(list(preset.axes.dims), theta=preset.base, max_positions=n_pos)
    else:
        cache = rope_ext.RopeCache(preset.rotary_dim, preset.base, max_positions=n_pos)
    cos_sin = cache.cos_sin

    def rnd(h: int) -> Tensor:
        return torch.randn(tokens, h, preset.head_dim, generator=g).to(dtype)

    return Case(
        preset=preset,
        tokens=tokens,
        phase=phase,
        dtype=dtype,
        interleaved=interleaved,
        device=device,
        q=rnd(preset.q_heads).to(device),
        k=rnd(preset.kv_heads).to(device),
        positions=positions.to(device),
        cos_sin=cos_sin.to(device),
        grad_q=rnd(preset.q_heads).to(device),
        grad_k=rnd(preset.kv_heads).to(device),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device),
        freqs=cache.frequencies_on(device),
    )


def clones(case: Case) -> tuple[Tensor, Tensor]:
    """Fresh copies of the case's ``q`` and ``k`` (for the in-place providers and ceilings)."""
    return case.q.clone(), case.k.clone()


def workloads(cfg: Config) -> list[tuple[Preset, int, str, torch.dtype, bool, int]]:
    """Every ``(preset, tokens, phase, dtype, interleaved, seqs)`` of ``cfg``, in run order.

    ``seqs`` is 0 for a workload that is not packed. With ``cfg.seqs``, every prefill of a preset with one
    position per token is a packed batch of each of those sequence counts (counts above the token count
    skipped); MRoPE and axes presets keep their plain prefill. Axes presets have no decode step; with
    ``cfg.model_tokens`` they also run their own prefill (``Axes.tokens``).
    """
    out = []
    for preset in cfg.presets:
        pairs: list[bool] = []
        for p in cfg.pairings:
            il = preset.interleaved if p == "model" else p == "interleaved"
            if il not in pairs:
                pairs.append(il)
        packed = cfg.seqs if cfg.seqs and preset.sections is None else [0]
        decode = [] if preset.axes is not None else cfg.decode_tokens
        prefill = list(cfg.prefill_tokens)
        if cfg.model_tokens and preset.axes is not None and preset.axes.tokens not in prefill:
            prefill.append(preset.axes.tokens)
        for dt in cfg.dtypes:
            for il in pairs:
                for t in decode:
                    out.append((preset, t, "decode", dt, il, 0))
                for t in prefill:
                    out += [(preset, t, "prefill", dt, il, n) for n in packed if n <= t]
    return out


_CPU_CACHE_SYSFS = "/sys/devices/system/cpu/cpu0/cache"


def last_level_cache_bytes() -> int:
    """Size of the CPU's last-level cache (Linux sysfs), 32 MiB when unknown."""
    best = 0
    base = _CPU_CACHE_SYSFS
    with contextlib.suppress(OSError):
        for idx in os.listdir(base):
            with contextlib.suppress(OSError, ValueError):  # each index on its own: "uevent" has no size
                with open(f"{base}/{idx}/size") as f:
                    text = f.read().strip()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def input_sets(case: Case, cache: str) -> int:
    """How many copies of the inputs a timed run cycles through.

    ``cold`` on the CPU: a workload of 1 MiB or more (q and k read and written) cycles through enough
    copies to span three times the last-level cache, so that no call finds its data in the cache left
    by the previous calls (the CPU counterpart of flushing the GPU's L2); every provider and every
    ceiling gets the same treatment. Smaller workloads (decode steps) keep one set: their cost is the
    call, and in a model their q and k are still in cache from the projection that made them.
    ``warm``, and on a GPU (which flushes its L2 instead): one set.
    """
    if cache != "cold" or case.device.type != "cpu":
        return 1
    ws = case.bytes_moved()
    if ws < 1 << 20:
        return 1
    return int(min(64, math.ceil(3 * last_level_cache_bytes() / ws)))


def cycle(fns: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """A callable that calls ``fns`` in turn, one per call."""
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()

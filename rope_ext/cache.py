"""cos/sin cache: every scaling variant, angles in float64, stored as float32 (or the dtype asked for)."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .checks import typed_errors
from .scaling import LENGTH_DEPENDENT, inv_freq_and_attention_factor, normalize_scaling

__all__ = ["RopeCache", "cos_sin_rows", "frequencies"]

_CHUNK_ROWS = 1 << 13  # rows built per step (float64 temporaries stay small and cache-resident)


def frequencies(inv_freq: Tensor, attention_factor: float = 1.0) -> Tensor:
    """float64 ``[2 * len(inv_freq)]``: ``inv_freq`` then the factor of each pair's cos and sin.

    The ops' ``cos_sin`` argument in the table-free mode (README, "Angles without a table"): pair ``j``
    rotates by ``p * inv_freq[j]`` with cos and sin times ``attention_factor``, computed in the kernel.
    """
    inv = inv_freq.to(torch.float64)
    return torch.cat([inv, torch.full_like(inv, float(attention_factor))])


@typed_errors
def cos_sin_rows(positions: Tensor, inv_freq: Tensor, attention_factor: float = 1.0) -> Tensor:
    """float64 ``[len(positions), 2 * len(inv_freq)]``: ``A cos(p inv_j)`` then ``A sin(p inv_j)``.

    ``positions`` (1-d, int32/int64/float32/float64) and ``inv_freq`` (float64) on one device. The rows
    come from the kernels' own function (csrc/rope/angles.h, the op ``rope_ext._angle_rows``), so a table
    built from them and the table-free mode give the same bits. The angle is the exact product of ``p``
    and the float64 ``inv_j``, reduced in double-double arithmetic: the result is within a few float64
    ulps of the exact cos/sin, so rounding it to float32 is correctly rounded, or one ulp off when the
    exact value lies within ~2^-50 (relative) of a rounding boundary. A position whose angle cannot be
    formed (not finite, an int64 past 2^53, ``|p inv_j| >= 3.5e15``) raises ``ValueError`` on the CPU and
    gives NaN on CUDA.
    """
    freqs = frequencies(inv_freq, attention_factor).to(positions.device)
    return torch.ops.rope_ext._angle_rows(positions.reshape(-1), freqs)


class _Table(NamedTuple):
    """One published state of a cache: replaced whole (one assignment), never mutated.

    A reader takes ``cache._table`` once and sees a table, its frequencies, the length they were built
    for and their version together, whatever other threads publish meanwhile.
    """

    cos_sin: Tensor
    inv_freq: Tensor
    attention_factor: float
    seq_len: int
    version: int


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class RopeCache:
    """Table of ``A cos(p * inv_j)`` and ``A sin(p * inv_j)`` for positions ``0 .. capacity-1``.

    ``cos_sin`` is ``[capacity, rotary_dim]`` of ``dtype`` on ``device``: cos for ``j < rotary_dim/2``,
    then sin (vLLM's ``cos_sin_cache`` layout), ready for :func:`rope_ext.apply_rotary`. ``inv_freq``
    (``[rotary_dim / 2]``) and the attention factor ``A`` come from ``scaling`` (see
    :mod:`rope_ext.scaling`; ``None`` is plain RoPE, ``inv_j = base ** (-2j/rotary_dim)``, ``A = 1``).
    ``inv_freq`` and every angle are float64 (see :func:`cos_sin_rows`); only the final cos/sin are
    rounded to ``dtype`` (float32 by default; nothing is ever cast to a lower dtype unless ``dtype`` says
    so).

    **Length.** ``ensure(n)`` makes positions ``0 .. n-1`` available and records ``n`` as requested; the
    largest length requested so far (``max_positions`` at construction, then any larger ``n``) is
    ``seq_len``. The length-dependent variants are keyed on ``seq_len``, never on the padded capacity:
    ``dynamic`` rebuilds every row with a new base whenever ``seq_len`` grows past the trained length;
    ``longrope`` uses the short factors while ``seq_len <= original_max_position_embeddings`` and rebuilds
    every row with the long factors once it is larger. ``set_seq_len(n)`` sets ``seq_len`` exactly (it may
    go back down, as transformers does when a short sequence follows a long one); ``reserve(n)`` adds
    rows without counting ``n`` as requested.

    **Growth.** The table grows geometrically (to ``max(n, 2 * capacity)``) and never shrinks; ``ensure``
    is a couple of integer comparisons when nothing changes. Growth and rebuilds build a new tensor and
    never mutate one already handed out, so a tensor returned earlier stays valid (for the positions it
    had). ``cos_sin_on(device)`` returns one copy per device, made once per table version. All mutation
    happens under a lock: several threads may call ``ensure`` / ``cos_sin_on`` concurrently.

    **Serving, torch.compile and CUDA graphs.** Size the cache once, before capturing or compiling:
    construct it with ``max_positions`` = the longest context the server accepts (prompt + generated
    tokens; ``config.max_position_embeddings`` for a model), or call ``cache.ensure(max_len)`` at start-up,
    then fetch ``cache.cos_sin_on(device)`` once and pass that tensor to the ops. No growth or rebuild then
    happens inside a compiled graph or a captured CUDA graph (a rebuild would hand out a new tensor that a
    graph captured earlier would not see). For ``dynamic`` this fixes the NTK base for ``max_len``; for
    ``longrope`` with ``max_len > original_max_position_embeddings`` every position uses the long factors.
    The table costs ``max_len * rotary_dim * 4`` bytes in float32 (128 MiB for 262144 positions at 128).
    """

    def __init__(
        self,
        rotary_dim: int,
        base: float = 10000.0,
        *,
        max_positions: int = 2048,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        if (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, int)
            or rotary_dim <= 0
            or rotary_dim % 2
        ):
            raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
        if not isinstance(base, (int, float)) or not base > 1.0 or not math.isfinite(base):
            raise ValueError(f"base must be a finite number > 1, got {base!r}")
        if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.device = _as_device(device)
        self.dtype = dtype
        self.scaling: dict[str, Any] = normalize_scaling(scaling, rotary_dim)
        self._lock = threading.Lock()
        inv, attn = self._params(int(max_positions))
        self._table = _Table(self._rows(0, max_positions, inv, attn), inv, attn, int(max_positions), 0)
        self._copies: dict[torch.device, tuple[int, Tensor]] = {}
        self._freqs: dict[torch.device, tuple[int, Tensor]] = {}
        # Position axes (from_hf_config's MRoPE, for_axes), for the ops' mrope_section / mrope_interleaved.
        self.mrope_section: tuple[int, ...] | None = None if self._axes is None else self._axes[2]
        self.mrope_interleaved = False

    # Per-axis frequencies (for_axes): (dims, thetas, sections), else None.
    _axes: tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]] | None = None

    @classmethod
    def for_axes(
        cls, axes_dim: Sequence[int], theta: float | Sequence[float] = 10000.0, **kwargs: Any
    ) -> RopeCache:
        """The table of RoPE over several position axes, each with its own frequencies (FLUX's
        ``axes_dim``, HunyuanVideo's ``rope_dim``, Wan's t/h/w split; 2-D vision, 3-D video).

        Axis ``a`` rotates ``axes_dim[a]`` features (an even number; ``rotary_dim = sum(axes_dim)``) with
        the frequencies ``theta_a ** (-2 i / axes_dim[a])``, ``i < axes_dim[a] / 2``, restarting per axis
        (``theta`` is one base or one per axis); the table's pairs are axis 0's, then axis 1's, and so on.
        :attr:`mrope_section` is ``axes_dim / 2`` per axis: pass it to the ops with positions ``[n_axes,
        ...]`` (``interleaved=True`` for FLUX's and Wan's pairs ``(2j, 2j+1)``). Other keyword arguments are
        the constructor's (``max_positions``, ``device``, ``dtype``); no scaling.
        """
        from .checks import MAX_AXES

        dims = tuple(axes_dim) if isinstance(axes_dim, (list, tuple)) else ()
        if not 1 <= len(dims) <= MAX_AXES or not all(type(d) is int and d > 0 and d % 2 == 0 for d in dims):
            raise ValueError(f"axes_dim must be 1 to {MAX_AXES} positive even ints, got {axes_dim!r}")
        thetas = tuple(theta) if isinstance(theta, (list, tuple)) else (theta,) * len(dims)
        if len(thetas) != len(dims) or not all(
            isinstance(t, (int, float)) and t > 1.0 and math.isfinite(t) for t in thetas
        ):
            raise ValueError(f"theta must be a finite number > 1 or one per axis, got {theta!r}")
        if "scaling" in kwargs or "base" in kwargs:
            raise TypeError("for_axes takes theta, not base or scaling")
        cache = cls.__new__(cls)
        cache._axes = (dims, tuple(float(t) for t in thetas), tuple(d // 2 for d in dims))
        cache.__init__(sum(dims), float(thetas[0]), **kwargs)
        return cache

    # -- construction from a transformers config -------------------------------------------------

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        layer_type: str | None = None,
        max_positions: int | None = None,
        **kwargs: Any,
    ) -> RopeCache:
        """Build the cache a transformers model would use, from its config object or a plain dict.

        Reads both the 4.x form (top-level ``rope_theta``, ``partial_rotary_factor`` (or GPT-NeoX's
        ``rotary_pct``, GPT-J's ``rotary_dim``), ``head_dim`` (or ``hidden_size // num_attention_heads``),
        ``rope_scaling`` with ``type`` or ``rope_type``, legacy ``"su"``) and the 5.x form
        (``rope_parameters``, possibly nested per layer type, e.g. ``{"full_attention": {...},
        "sliding_attention": {...}}``: ``layer_type`` picks the entry). A config with a ``text_config``
        and no head size of its own is read through its ``text_config``. Other keyword arguments are
        the constructor's (``device``, ``dtype``).

        **Length.** Without ``max_positions`` the table holds the config's ``max_position_embeddings``
        positions (``0 .. max_position_embeddings - 1``; 2048 when the config has no such field), and the
        length-dependent variants start where transformers' rotary module starts: ``dynamic`` with the
        unscaled base (its trained length is ``max_position_embeddings``), ``longrope`` with the short
        factors (``seq_len`` is ``original_max_position_embeddings``; the other rows are reserved, see
        :meth:`reserve`). As in transformers, a longer sequence then switches them: ``ensure(n)`` (or
        :class:`~rope_ext.RotaryEmbedding` without ``positions``) rescales the ``dynamic`` base for ``n`` past
        ``max_position_embeddings`` and moves ``longrope`` to the long factors once ``n`` is past
        ``original_max_position_embeddings``, rebuilding every row (transformers also goes back to the short
        factors for a later short sequence; here that is ``set_seq_len(n)``). An explicit ``max_positions=n``
        is the constructor's: ``n`` rows and ``seq_len = n`` (so ``longrope`` with ``n`` past the original
        length uses the long factors everywhere: what a server sized once for its longest context wants).
        Positions past the table raise ``IndexError`` in the ops.

        MRoPE models (``mrope_section`` / ``mrope_interleaved`` in the rope dict: Qwen2-VL, Qwen2.5-VL,
        Qwen3-VL) set :attr:`mrope_section` and :attr:`mrope_interleaved`, the arguments to pass to the ops
        with ``[3, ...]`` positions.
        """
        from .hf_config import default_table_lengths, parse_hf_config, parse_mrope

        _, rotary_dim, base, scaling = parse_hf_config(config, layer_type=layer_type)
        if max_positions is None:
            seq_len, positions = default_table_lengths(config, scaling)
            cache = cls(rotary_dim, base, scaling=scaling, max_positions=seq_len, **kwargs).reserve(positions)
        else:
            cache = cls(rotary_dim, base, scaling=scaling, max_positions=max_positions, **kwargs)
        cache.mrope_section, cache.mrope_interleaved = parse_mrope(config, layer_type=layer_type)
        return cache

    # -- parameters --------------------------------------------------------------------------------

    def _params(self, seq_len: int) -> tuple[Tensor, float]:
        if self._axes is not None:
            dims, thetas, _ = self._axes
            inv = [
                t ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
                for d, t in zip(dims, thetas, strict=True)
            ]
            return torch.cat(inv), 1.0
        return inv_freq_and_attention_factor(self.rotary_dim, self.base, self.scaling, seq_len)

    @property
    def rope_type(self) -> str:
        return self.scaling["rope_type"]

    @property
    def inv_freq(self) -> Tensor:
        """float64 CPU ``[rotary_dim / 2]`` for the current ``seq_len``."""
        return self._table.inv_freq.clone()

    @property
    def attention_factor(self) -> float:
        """Factor multiplying both cos and sin (1.0 except yarn / longrope)."""
        return self._table.attention_factor

    @property
    def seq_len(self) -> int:
        """Largest length requested so far (what ``dynamic`` / ``longrope`` are keyed on)."""
        return self._table.seq_len

    @property
    def capacity(self) -> int:
        return self._table.cos_sin.shape[0]

    @property
    def cos_sin(self) -> Tensor:
        """``[capacity, rotary_dim]`` of ``dtype`` on ``device``."""
        return self._table.cos_sin

    def frequencies_on(self, device: torch.device | str | int | None = None) -> Tensor:
        """The table-free form of this cache on ``device`` (default: the cache's device): float64
        ``[rotary_dim]``, each pair's frequency then its factor (:func:`frequencies`). Pass it as the ops'
        ``cos_sin``: the kernels compute the same rows as the table's (bit for bit) from the positions,
        which may then be fractional and have no upper bound. One copy per device and table version."""
        d = _as_device(device) if device is not None else self.device
        t = self._table
        hit = self._freqs.get(d)
        if hit is None or hit[0] != t.version:
            hit = (t.version, frequencies(t.inv_freq, t.attention_factor).to(d))
            self._freqs[d] = hit
        return hit[1]

    @property
    def _version(self) -> int:
        """Bumped whenever the table grows or is rebuilt."""
        return self._table.version

    def _rows(
        self, start: int, stop: int, inv_freq: Tensor | None = None, attention_factor: float | None = None
    ) -> Tensor:
        """Rows ``start .. stop-1`` for ``inv_freq`` / ``attention_factor`` (default: the current ones)."""
        if inv_freq is None or attention_factor is None:
            inv_freq, attention_factor = self._table.inv_freq, self._table.attention_factor
        out = torch.empty(stop - start, self.rotary_dim, device=self.device, dtype=self.dtype)
        freqs = frequencies(inv_freq, attention_factor).to(self.device)
        for lo in range(start, stop, _CHUNK_ROWS):
            hi = min(stop, lo + _CHUNK_ROWS)
            p = torch.arange(lo, hi, dtype=torch.int64, device=self.device)
            out[lo - start : hi - start] = torch.ops.rope_ext._angle_rows(p, freqs)
        return out

    # -- length / growth ---------------------------------------------------------------------------

    def ensure(self, n: int) -> RopeCache:
        """Make positions ``0 .. n-1`` available; ``seq_len`` becomes ``max(seq_len, n)``.

        Cheap when ``n <= seq_len`` and ``n <= capacity``. Grows the table to ``max(n, 2 * capacity)``
        when needed; rebuilds every row when a length-dependent variant changes its frequencies.
        """
        t = self._table
        if n <= t.seq_len and n <= t.cos_sin.shape[0]:
            return self
        with self._lock:
            self._update(max(int(n), self._table.seq_len), int(n))
        return self

    def reserve(self, n: int) -> RopeCache:
        """Make positions ``0 .. n-1`` available without counting ``n`` as a requested length (``seq_len``
        and so the frequencies of ``dynamic`` / ``longrope`` stay as they are)."""
        if n <= self._table.cos_sin.shape[0]:
            return self
        with self._lock:
            self._update(self._table.seq_len, int(n))
        return self

    def set_seq_len(self, n: int) -> RopeCache:
        """Set ``seq_len`` to exactly ``n`` (it may decrease) and make positions ``0 .. n-1`` available."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        with self._lock:
            self._update(n, n)
        return self

    def _update(self, seq_len: int, needed: int) -> None:
        """Builds the next state and publishes it with one assignment (called under the lock)."""
        t = self._table
        cap = t.cos_sin.shape[0]
        new_cap = cap if needed <= cap else max(needed, 2 * cap)
        if seq_len != t.seq_len and self.rope_type in LENGTH_DEPENDENT:
            inv, attn = self._params(seq_len)
            if not torch.equal(inv, t.inv_freq) or attn != t.attention_factor:
                self._table = _Table(self._rows(0, new_cap, inv, attn), inv, attn, seq_len, t.version + 1)
                return
        if new_cap > cap:
            rows = self._rows(cap, new_cap, t.inv_freq, t.attention_factor)
            t = t._replace(cos_sin=torch.cat([t.cos_sin, rows], dim=0), version=t.version + 1)
        self._table = t._replace(seq_len=seq_len)

    def cos_sin_on(self, device: torch.device | str | int | None = None) -> Tensor:
        """The table on ``device`` (default: the cache's device): one copy per device, made once.

        The copy is refreshed only after the table grew or was rebuilt. It always has at least the
        rows the cache had when the call began (the table and its version are read together).
        """
        d = _as_device(device) if device is not None else self.device
        t = self._table
        if d == self.device:
            return t.cos_sin
        hit = self._copies.get(d)
        if hit is not None and hit[0] == t.version:
            return hit[1]
        with self._lock:
            t = self._table
            hit = self._copies.get(d)
            if hit is None or hit[0] != t.version:
                hit = (t.version, t.cos_sin.to(d))
                self._copies[d] = hit
            return hit[1]

    def __getstate__(self) -> dict[str, Any]:
        # copy.deepcopy / pickle (e.g. of a model holding the cache): no lock, no per-device copies.
        state = self.__dict__.copy()
        del state["_lock"]
        state["_copies"] = {}
        state["_freqs"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"RopeCache(rotary_dim={self.rotary_dim}, base={self.base}, rope_type={self.rope_type!r}, "
            f"seq_len={self.seq_len}, capacity={self.capacity}, device={self.device}, dtype={self.dtype})"
        )

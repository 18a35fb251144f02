"""transformers adapters: ``apply_rotary_pos_emb`` and patching a loaded model's RoPE.

* :func:`apply_rotary_pos_emb` - transformers' function (``q * cos + rotate_half(q) * sin``), same
  arguments, broadcasting, output dtypes and gradients, computed by rope_ext's op.
* :class:`HFRotaryAdapter` - stands in for a model's ``*RotaryEmbedding`` (cos / sin from rope_ext caches).
* :func:`patch_transformers` / :func:`unpatch_transformers` - route a loaded Llama, Mistral or Qwen2
  model's RoPE through rope_ext (adapter + the modeling module's ``apply_rotary_pos_emb``), and back.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from .._tables import DeviceTables
from ..cache import RopeCache
from ..ops import apply_rotary, apply_rotary_qk
from ..reference import rotate_half

__all__ = [
    "apply_rotary_pos_emb",
    "HFRotaryAdapter",
    "SUPPORTED_MODEL_TYPES",
    "patch_transformers",
    "unpatch_transformers",
]

_OP_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# HF transformers


def _hf_formula(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _fast_path(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the op computes exactly what the formula would (shapes, dtypes, devices, grads)."""
    d = q.shape[-1]
    if cos.shape != sin.shape or cos.dim() > min(q.dim(), k.dim()) or cos.dim() == 0:
        return False
    if d % 2 or k.shape[-1] != d or cos.shape[-1] != d:
        return False
    if cos.is_complex() or sin.is_complex() or cos.dtype != sin.dtype:
        return False
    if not all(t.dtype in _OP_DTYPES for t in (q, k, cos)):
        return False
    if not (q.device == k.device == cos.device == sin.device):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False  # the op gives no gradient to cos / sin; the formula does
    lead = cos.shape[:-1]
    try:
        return (
            torch.broadcast_shapes(q.shape[:-1], lead) == q.shape[:-1]
            and torch.broadcast_shapes(k.shape[:-1], lead) == k.shape[:-1]
        )
    except RuntimeError:
        return False


def _duplicated_halves(cos: Tensor, sin: Tensor) -> bool:
    h = cos.shape[-1] // 2
    return torch.equal(cos[..., :h], cos[..., h:]) and torch.equal(sin[..., :h], sin[..., h:])


def _rotate_hf(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int, check_halves: bool
) -> tuple[Tensor, Tensor]:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if not _fast_path(q, k, cos, sin) or (
        check_halves and not torch.compiler.is_compiling() and not _duplicated_halves(cos, sin)
    ):
        return _hf_formula(q, k, cos, sin)
    dq = torch.promote_types(q.dtype, cos.dtype)
    dk = torch.promote_types(k.dtype, cos.dtype)
    q = q.to(dq) if q.dtype != dq else q
    k = k.to(dk) if k.dtype != dk else k
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    h = cos.shape[-1] // 2
    lead = cos.shape[:-1]
    n = 1
    for s in lead:
        n *= s
    table = torch.cat([cos[..., :h], sin[..., :h]], dim=-1).reshape(n, 2 * h)
    positions = torch.arange(n, device=cos.device).view(lead)
    if dq == dk and table.dtype in (torch.float32, dq):
        return apply_rotary_qk(q, k, positions, table)
    tq = table if table.dtype in (torch.float32, dq) else table.float()
    tk = table if table.dtype in (torch.float32, dk) else table.float()
    return apply_rotary(q, positions, tq), apply_rotary(k, positions, tk)


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb``:
    ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` after
    ``cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)``.

    ``q`` ``[batch, heads, seq, head_dim]`` and ``k`` (its own head count) with ``cos`` / ``sin``
    ``[batch, seq, head_dim]`` and ``unsqueeze_dim=1`` (``unsqueeze_dim=2`` for ``[batch, seq, heads,
    head_dim]``); any shapes that broadcast as in transformers. ``position_ids`` is accepted and ignored
    (as in transformers 4.x, where it is deprecated and unused). Outputs have transformers' dtypes (the
    promotion of ``q`` / ``k`` with ``cos`` / ``sin``); gradients flow to ``q`` and ``k`` (and to ``cos``
    / ``sin`` when they require grad: that case uses the formula itself).

    The op reads ``cos[..., :head_dim/2]`` and ``sin[..., :head_dim/2]`` as the pair values, which is what
    every transformers rotary embedding builds (``cat((freqs, freqs))``). Eagerly, the two halves are
    compared first (one pass over ``cos`` / ``sin``, which are ``heads`` times smaller than ``q``) and the
    formula is used when they differ; under ``torch.compile`` they are assumed equal. Arithmetic is float32
    (transformers rounds after each product in the input dtype): for bf16 / fp16 results can differ by an
    ulp, more accurate than the formula.
    """
    return _rotate_hf(q, k, cos, sin, unsqueeze_dim, check_halves=True)


def _patched_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    # Installed in a patched model's modeling module: its cos / sin come from a rotary embedding
    # (duplicated halves by construction), so the eager check is skipped.
    return _rotate_hf(q, k, cos, sin, unsqueeze_dim, check_halves=False)


_patched_apply_rotary_pos_emb._rope_ext = True  # type: ignore[attr-defined]

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    # MRoPE (the text models of the vision-language families; [3, batch, seq] position ids)
    "qwen2_vl",
    "qwen2_vl_text",
    "qwen2_5_vl",
    "qwen2_5_vl_text",
    "qwen3_vl",
    "qwen3_vl_text",
)
_ORIGINAL_APPLY: dict[str, Any] = {}


class HFRotaryAdapter(nn.Module):
    """Replaces a transformers ``*RotaryEmbedding``: ``forward(x, position_ids) -> (cos, sin)``, each
    ``[batch, seq, head_dim]`` in ``x.dtype`` (``cat((c, c))`` with the attention factor applied), read
    from rope_ext caches (float64 angles, float32 table) instead of float32 angles.

    Length-dependent variants follow transformers' per-call rule (``seq_len = max(position_ids) + 1``):
    ``dynamic`` grows its base with ``seq_len`` and resets when a call is back under the trained length
    (eager only: under ``torch.compile`` the table as sized is used); ``longrope`` picks the long or
    short table per call, in-graph. Eagerly, the table grows to cover ``seq_len`` (one device sync per
    forward on CUDA); under ``torch.compile`` it must already be large enough (``max_positions``).
    """

    def __init__(self, original: nn.Module, config: Any, max_positions: int) -> None:
        super().__init__()
        object.__setattr__(self, "_original", original)  # not a submodule: kept for unpatching
        self.config = config
        probe = RopeCache.from_hf_config(config, max_positions=1)
        self.rope_type = probe.rope_type
        # MRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pair j's cos / sin come from the row of its section.
        self.mrope_section, self.mrope_interleaved = probe.mrope_section, probe.mrope_interleaved
        self._rotary_dim = probe.rotary_dim
        if self.mrope_section is not None:
            self.register_buffer("_mrope_rows", self._section_rows(), persistent=False)
        self.original_max = probe.scaling.get("original_max_position_embeddings")
        if self.rope_type == "longrope":
            o = self.original_max
            self.caches = {
                "short": RopeCache.from_hf_config(config, max_positions=o).reserve(max_positions),
                "long": RopeCache.from_hf_config(config, max_positions=o + 1).reserve(max_positions),
            }
        elif self.rope_type == "dynamic":
            self.caches = {"main": RopeCache.from_hf_config(config, max_positions=self.original_max)}
            self.caches["main"].reserve(max_positions)
        else:
            self.caches = {"main": RopeCache.from_hf_config(config, max_positions=max_positions)}
        self._device_tables = DeviceTables(self.caches)

    @property
    def _tables(self) -> dict[str, Tensor]:
        """Each cache's table as last fetched, on the module's device (what a compiled forward reads)."""
        return self._device_tables.tables

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self._original._apply(fn, recurse)
        self._device_tables.follow(fn)
        return self

    def reset_parameters(self) -> None:
        """Rebuild the kept original module's buffers (``inv_freq``, ...) after ``to_empty``.

        The adapter has no buffers of its own (its tables come from its caches, on the CPU, and follow
        the device), but it moves the original it keeps for :func:`unpatch_transformers`, so
        ``to_empty`` leaves that module's buffers uninitialised. They are rebuilt from a fresh original
        constructed on the CPU from its config (torchtune / FSDP2's ``reset_parameters`` convention).
        """
        if self.mrope_section is not None:
            with torch.no_grad():
                self._mrope_rows.copy_(self._section_rows())
        orig = self._original
        if next(orig.buffers(), None) is None:
            return
        with torch.device("cpu"):
            fresh = dict(type(orig)(getattr(orig, "config", self.config)).named_buffers())
        with torch.no_grad():
            for name, buf in orig.named_buffers():
                new = fresh.get(name)
                if new is not None and new.shape == buf.shape:
                    buf.copy_(new)

    def _section_rows(self) -> Tensor:
        from ..reference import mrope_rows

        return mrope_rows(self._rotary_dim // 2, self.mrope_section, self.mrope_interleaved)

    def _eager_update(self, position_ids: Tensor, device: torch.device) -> None:
        if position_ids.numel() == 0:
            return
        n = int(position_ids.max()) + 1
        if self.rope_type == "dynamic":
            c = self.caches["main"]
            if n > c.seq_len:
                c.set_seq_len(n)
            elif n < self.original_max < c.seq_len:
                c.set_seq_len(self.original_max)
        for c in self.caches.values():
            c.reserve(n)
        self._device_tables.on(device)

    def forward(
        self, x: Tensor, position_ids: Tensor, layer_type: str | None = None
    ) -> tuple[Tensor, Tensor]:
        if self.mrope_section is not None and position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)  # text: the same position in every section
        if not torch.compiler.is_compiling():
            self._eager_update(position_ids, x.device)
        tables = self._device_tables.tables
        if self.rope_type == "longrope":
            use_long = (position_ids.max() + 1) > self.original_max
            rows = torch.where(use_long, tables["long"][position_ids], tables["short"][position_ids])
        else:
            rows = tables["main"][position_ids]
        h = rows.shape[-1] // 2
        c, s = rows[..., :h], rows[..., h:]
        if self.mrope_section is not None:
            # rows [3, batch, seq, rotary_dim]: pair j from section self._mrope_rows[j]
            idx = self._mrope_rows.view(1, 1, 1, h).expand(1, *c.shape[1:])
            c, s = c.gather(0, idx)[0], s.gather(0, idx)[0]
        return torch.cat([c, c], dim=-1).to(x.dtype), torch.cat([s, s], dim=-1).to(x.dtype)


def _rotary_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if name == "rotary_emb" and type(child).__name__.endswith("RotaryEmbedding"):
                found.append((parent, name, child))
    return found


def patch_transformers(model: nn.Module, *, max_positions: int | None = None) -> nn.Module:
    """Route a loaded transformers model's RoPE through rope_ext; returns ``model``.

    Supported model types: :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2, and the text models of
    Qwen2-VL, Qwen2.5-VL and Qwen3-VL, whose MRoPE sections the adapter applies to ``[3, batch, seq]``
    position ids).

    Two things change. (1) ``model.model.rotary_emb`` is replaced by an :class:`HFRotaryAdapter`: cos / sin
    come from a :class:`~rope_ext.RopeCache` built by ``from_hf_config(model.config)`` (float64 angles)
    with ``max_positions`` rows up front (default ``config.max_position_embeddings``). (2) The attention
    layers call ``apply_rotary_pos_emb`` as a global of their modeling module (e.g.
    ``transformers.models.llama.modeling_llama``); that global is replaced by rope_ext's
    implementation, so q and k are rotated by rope_ext's op (one call for both, float32 arithmetic,
    differentiable). (2) is per model class, not per instance: other models of the same family in the
    process also use the op, with transformers' semantics. The patched model runs under
    ``torch.compile(fullgraph=True)``. :func:`unpatch_transformers` undoes both.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"patch_transformers supports model_type in {list(SUPPORTED_MODEL_TYPES)}, got {model_type!r}"
        )
    found = _rotary_modules(model)
    if not found:
        raise TypeError(f"no rotary_emb module found in {type(model).__name__}")
    if max_positions is None:
        max_positions = int(getattr(config, "max_position_embeddings", 2048))
    for parent, name, child in found:
        if isinstance(child, HFRotaryAdapter):
            continue
        modeling = sys.modules[type(child).__module__]
        current = getattr(modeling, "apply_rotary_pos_emb", None)
        if current is None:
            raise TypeError(f"{modeling.__name__} has no apply_rotary_pos_emb to patch")
        adapter = HFRotaryAdapter(child, child.config if hasattr(child, "config") else config, max_positions)
        device = next((b.device for b in child.buffers()), torch.device("cpu"))
        adapter.to(device)
        setattr(parent, name, adapter)
        if not getattr(current, "_rope_ext", False):
            _ORIGINAL_APPLY[modeling.__name__] = current
            modeling.apply_rotary_pos_emb = _patched_apply_rotary_pos_emb
    return model


def unpatch_transformers(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_transformers`: the original rotary module and modeling-module function return."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, HFRotaryAdapter):
                setattr(parent, name, child._original)
                modeling = sys.modules[type(child._original).__module__]
                original = _ORIGINAL_APPLY.pop(modeling.__name__, None)
                if original is not None:
                    modeling.apply_rotary_pos_emb = original
    return model

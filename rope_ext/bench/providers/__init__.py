"""The provider registry: named implementations of one mode, validated and timed side by side.

Adding a provider is one small function decorated with :func:`provider` in the module of its family
(one module per peer library; see the existing ones). A builder that cannot run (library not installed,
workload not supported) raises :class:`Skip`, and the run notes it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from .. import mla
from ..presets import ALL_MODES
from ..workloads import Case

__all__ = [
    "FAMILIES",
    "PROVIDERS",
    "Builder",
    "Provider",
    "Runner",
    "Skip",
    "flat",
    "mla_tensors",
    "provider",
]


class Skip(Exception):
    """Raised by a provider's builder when it cannot run: not installed, or not for this workload."""


Runner = Callable[[], tuple[Tensor, ...]]
Builder = Callable[[Case], Runner]


@dataclass
class Provider:
    """A named implementation of one mode.

    ``build(case)`` prepares its own copies of the inputs and returns a zero-argument callable, the
    thing that is timed; calling it returns the rotated ``(q, k)`` (for ``backward``: the gradients;
    ``cache``, ``cache-fp8``: ``(q, k, key_cache, value_cache)``; ``qknorm``: ``(qkv,)``; ``mla``,
    ``mla-fp8``: ``(q, k_pe, kv_cache)``, q the whole ``[T, H, nope + rope]``).
    It raises :class:`Skip` when the provider is not available.
    """

    name: str
    mode: str  # one of presets.ALL_MODES
    build: Builder
    baseline: bool = False  # the eager reference of its mode: speedups are relative to it
    opt_in: bool = False  # timed only when named in --providers


PROVIDERS: list[Provider] = []


def provider(
    name: str, mode: str, *, baseline: bool = False, opt_in: bool = False
) -> Callable[[Builder], Builder]:
    """Registers ``build(case) -> runner`` as provider ``name`` for ``mode``.

    An ``opt_in`` provider runs only when ``--providers`` names it.
    """
    if mode not in ALL_MODES:
        raise ValueError(f"mode must be one of {ALL_MODES}, got {mode!r}")

    def register(build: Builder) -> Builder:
        PROVIDERS.append(Provider(name, mode, build, baseline, opt_in))
        return build

    return register


def flat(t: Tensor) -> Tensor:
    """``[T, H, D]`` viewed as ``[T, H * D]`` (the layout vLLM's and FlashInfer's ops take)."""
    return t.reshape(t.shape[0], -1)


def mla_tensors(case: Case, fp8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fresh MLA inputs ``q, kv_c, k_pe, kv_cache`` (:func:`rope_ext.bench.mla.mla_tensors`); :class:`Skip`
    on a preset without an MLA shape."""
    if case.preset.mla is None:
        raise Skip(f"{case.preset.name} has no MLA shape")
    return mla.mla_tensors(case, fp8)


# One module per provider family, imported (so registered) in this order: the order of a workload's rows.
FAMILIES = ("rope_ext", "hf", "model", "vllm", "flashinfer", "sglang", "flash_attn", "liger", "onnxruntime")
for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")
del _family

"""rope_ext: rotary positional embeddings as compiled PyTorch ops (CPU and CUDA)."""

from . import distributed, reference, scaling
from .cache import RopeCache, frequencies
from .checks import PageTable
from .module import RotaryEmbedding
from .ops import _cpu_isa as _cpu_isa  # the CPU kernel's instruction set
from .ops import _cpu_prefetch as _cpu_prefetch  # its software prefetch distance
from .ops import _cpu_prefetch_level as _cpu_prefetch_level  # and the cache level it fills
from .ops import _set_cpu_isa as _set_cpu_isa
from .ops import _set_cpu_prefetch as _set_cpu_prefetch
from .ops import _set_cpu_prefetch_level as _set_cpu_prefetch_level
from .ops import apply_rotary, apply_rotary_qk, apply_rotary_qk_, set_position_checks
from .serving import (
    apply_mla_rotary_and_cache_,
    apply_qk_norm_rotary,
    apply_qk_norm_rotary_,
    apply_rotary_qk_and_cache_,
    rerotate_kv_cache_,
)
from .varlen import varlen_positions

__all__ = [
    "apply_rotary",
    "apply_rotary_qk",
    "apply_rotary_qk_",
    "apply_rotary_qk_and_cache_",
    "apply_mla_rotary_and_cache_",
    "rerotate_kv_cache_",
    "apply_qk_norm_rotary",
    "apply_qk_norm_rotary_",
    "set_position_checks",
    "varlen_positions",
    "frequencies",
    "PageTable",
    "RopeCache",
    "RotaryEmbedding",
    "compat",
    "reference",
    "scaling",
]
__version__ = "0.1.0"

# DTensor support (a no-op without torch.distributed): the sharding rules are registered now if
# torch.distributed.tensor is already imported, else right after its import; rope_ext does not import it.
distributed.register_sharding_rules_on_import()


def __getattr__(name: str):
    # rope_ext.compat (the adapters) is imported on first access: the ops do not need it.
    if name == "compat":
        import importlib

        return importlib.import_module(".compat", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "compat"})

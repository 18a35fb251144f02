"""rope_ext: rotary positional embeddings as compiled PyTorch ops (CPU and CUDA)."""

from . import compat, distributed, reference, scaling
from .cache import RopeCache
from .module import RotaryEmbedding
from .ops import _cpu_isa as _cpu_isa  # the CPU kernel's instruction set
from .ops import _set_cpu_isa as _set_cpu_isa
from .ops import apply_rotary, apply_rotary_qk, apply_rotary_qk_, set_position_checks
from .serving import apply_qk_norm_rotary, apply_qk_norm_rotary_, apply_rotary_qk_and_cache_
from .varlen import varlen_positions

__all__ = [
    "apply_rotary",
    "apply_rotary_qk",
    "apply_rotary_qk_",
    "apply_rotary_qk_and_cache_",
    "apply_qk_norm_rotary",
    "apply_qk_norm_rotary_",
    "set_position_checks",
    "varlen_positions",
    "RopeCache",
    "RotaryEmbedding",
    "compat",
    "reference",
    "scaling",
]
__version__ = "0.1.0"

distributed.register_sharding_rules()  # DTensor support (a no-op without torch.distributed)

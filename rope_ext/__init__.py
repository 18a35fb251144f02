"""rope_ext: rotary positional embeddings as compiled PyTorch ops (CPU and CUDA)."""

from . import reference
from .cache import RopeCache
from .ops import apply_rotary, apply_rotary_qk, apply_rotary_qk_, set_position_checks

__all__ = [
    "apply_rotary",
    "apply_rotary_qk",
    "apply_rotary_qk_",
    "set_position_checks",
    "RopeCache",
    "reference",
]
__version__ = "0.1.0"

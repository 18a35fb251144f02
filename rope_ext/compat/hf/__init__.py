"""transformers adapters: ``apply_rotary_pos_emb`` and patching a loaded model's RoPE.

* :func:`apply_rotary_pos_emb` - transformers' function (``q * cos + rotate_half(q) * sin``), same
  arguments, broadcasting, output dtypes and gradients, computed by rope_ext's op.
* :class:`HFRotaryAdapter` - stands in for a model's ``*RotaryEmbedding`` (cos / sin from rope_ext caches,
  one set per layer type where the model has several).
* :func:`patch_transformers` / :func:`unpatch_transformers` - route a loaded model's RoPE through rope_ext
  (adapter + the modeling module's ``apply_rotary*`` functions), after checking on probes that rope_ext
  computes what the model's own modules and functions compute, and back.
* :func:`supported_model_types` - the model types that pass those checks with the installed transformers.
* :func:`vision_report` / :data:`TESTED_VISION_MODELS` - what ``patch_transformers`` did with a model's
  vision-tower rotation functions (patched, or left alone and why); the vision towers tested.

Every public name is re-exported here (``from rope_ext.compat.hf import X``). The modules, each importing
only those listed above it (so, no cycles):

* :mod:`.rotation` - what a transformers rotary function computes (``_Rotation``), rope_ext's op computing
  it, and :func:`apply_rotary_pos_emb`;
* :mod:`.adapter` - :class:`HFRotaryAdapter`;
* :mod:`.probes` - the checks run before anything is patched: which rotation a function computes, whether
  an adapter gives a rotary module's cos / sin;
* :mod:`.qk_norm` - deferring Qwen3's q / k norms into one fused norm + rotation call;
* :mod:`.vision` - the vision towers' rotation functions, probed and swapped with the diffusers patcher's
  machinery (it imports :mod:`rope_ext.compat.diffusers`, none of its siblings);
* :mod:`.patch` - :func:`patch_transformers`, :func:`unpatch_transformers`, :func:`supported_model_types`.

transformers itself is imported only by the functions that need it, never on import of this package.
"""

from __future__ import annotations

from .adapter import HFRotaryAdapter
from .patch import SUPPORTED_MODEL_TYPES, patch_transformers, supported_model_types, unpatch_transformers
from .qk_norm import FUSED_QK_NORM_MODEL_TYPES
from .rotation import apply_rotary_pos_emb
from .vision import TESTED_VISION_MODELS, vision_report

__all__ = [
    "apply_rotary_pos_emb",
    "HFRotaryAdapter",
    "SUPPORTED_MODEL_TYPES",
    "supported_model_types",
    "patch_transformers",
    "unpatch_transformers",
    "FUSED_QK_NORM_MODEL_TYPES",
    "TESTED_VISION_MODELS",
    "vision_report",
]

"""diffusers adapters: routing a diffusers transformer's RoPE rotations through rope_ext.

* :func:`patch_diffusers` / :func:`unpatch_diffusers` - swap the rotation functions a model's attention
  processors call (diffusers' ``apply_rotary_emb``, model-local functions, functions defined inside a
  processor's ``__call__``) for rope_ext's op on the model's own cos / sin, after checking on probes that
  the op computes what each function does, and back.
* :data:`TESTED_DIFFUSERS_MODELS` - the models the tests patch and compare.

The modules, each importing only those listed above it (so, no cycles):

* :mod:`.rotation` - the call forms of a rotation function (``_Form``) and rope_ext's op computing them;
* :mod:`.probes` - which forms of a function rope_ext computes, found on random probes;
* :mod:`.patch` - finding a model's rotation functions, :func:`patch_diffusers`, :func:`unpatch_diffusers`.

diffusers itself is never imported by this package: the functions are found through the model's classes.
"""

from __future__ import annotations

from .patch import TESTED_DIFFUSERS_MODELS, patch_diffusers, unpatch_diffusers

__all__ = ["patch_diffusers", "unpatch_diffusers", "TESTED_DIFFUSERS_MODELS"]

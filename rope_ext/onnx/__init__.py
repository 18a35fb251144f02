"""ONNX export of models that call rope_ext ops: standard ONNX only (ai.onnx), no custom domain.

``import rope_ext.onnx`` registers the translations with torch's exporter, after which
``torch.onnx.export(model, args, dynamo=True, opset_version=23)`` exports a model that calls any rope_ext op,
in place or not. :func:`export` does the same through public APIs only (where the registration could not be
made, :data:`REGISTERED` is False), and :func:`translation_table` is a ``custom_translation_table``.

What each op becomes:

* the rotation (``rotary``, ``rotary_qk``, ``rotary_qk_`` and the rotation in the fused ops), opset >= 23:
  ``RotaryEmbedding`` for half-split or interleaved pairs, partial rotary, ``rotary_offset`` (the features
  before it sliced off and concatenated back) and ``inverse`` (the sin rows negated), any layout (positions
  broadcast over the heads), float32, float16 and bfloat16 (computed in float32, rounded once): each
  token's cos/sin rows are gathered from the table and passed as its 3-D caches, x as ``[tokens, 1,
  heads * head_dim]``, one node per tensor. MRoPE, float64 (RotaryEmbedding has no double) and opsets
  18-22: the decomposition: Gather of the cos/sin rows (MRoPE: of each position axis, each pair's axis
  picked with Where), Mul/Sub/Add, Slice/Concat;
* ``qk_norm_rotary[_|_packed_]``: the RMSNorm in float32 (ReduceMean, Sqrt, Reciprocal, Mul), rounded to the
  activation dtype, then the rotation;
* ``rotary_qk_cache_``: the rotation, then NonZero/Gather of the tokens with a slot and ScatterND into the
  caches (NHD and HND; fp8 caches: Div by the scale, Clip, a saturating Cast, scattered through float32);
  with a ``page_table`` instead of ``slot_mapping``, each token's slot computed in the graph (Gather of
  ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, Div/Mod by the block size), -1 (not written) where
  the table places no token, as the CUDA kernels skip it;
* ``mla_rotary_cache_``: the rotations of q and k_pe, then kv_c and the rotated k_pe concatenated and
  scattered into the latent cache as above;
* ``rerotate_kv_cache_``: the rows at the slots gathered (GatherND), rotated by the cos/sin row
  ``|delta|`` of each token with the sin negated for a negative delta (fp8: dequantized, quantized back),
  and scattered back;
* in-place ops export as their functional form: what they write flows on in the graph (a written model
  input, such as a KV cache passed in, is an output only if ``forward`` returns it).

A call that cannot be expressed raises :class:`ExportError` at export, naming the op and the option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._graph import ExportError
from ._ops import functionalize, translations

__all__ = ["REGISTERED", "ExportError", "export", "functionalize", "register", "translation_table"]


def translation_table() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``: every op a rope_ext graph
    exports through (the functional ops ``rotary``, ``rotary_qk``, ``qk_norm_rotary`` and the functional
    twins ``rope_ext_onnx::*`` that :func:`functionalize` puts in place of the in-place ops) -> its
    translation."""
    return dict(translations())


def export(
    model: torch.nn.Module | torch.export.ExportedProgram,
    args: tuple = (),
    f: Any = None,
    *,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    opset_version: int = 23,
    custom_translation_table: dict | None = None,
    strict: bool = False,
    **options: Any,
) -> torch.onnx.ONNXProgram:
    """``torch.onnx.export(model, args, f, dynamo=True, ...)`` for a model that calls rope_ext ops, through
    public APIs only: ``torch.export.export(model, args, kwargs, dynamic_shapes=..., strict=...)`` (or the
    ExportedProgram given, which is rewritten in place), :func:`functionalize`, then ``torch.onnx.export``
    of the program with :func:`translation_table` (merged under ``custom_translation_table``) at
    ``opset_version`` (23: the rotation as ``RotaryEmbedding``). ``options`` go to ``torch.onnx.export``.
    Returns its ONNXProgram."""
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    else:
        program = torch.export.export(
            model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict
        )
    table = {**translation_table(), **(custom_translation_table or {})}
    return torch.onnx.export(
        functionalize(program),
        (),
        f,
        dynamo=True,
        opset_version=opset_version,
        custom_translation_table=table,
        **options,
    )


def register() -> bool:
    """Registers the translations with torch's ONNX exporter, and :func:`functionalize` before its
    decompositions; idempotent. Returns whether it could. torch's exporter has no public registry: this
    appends to the list of ONNX Script functions it builds its registry from on every export and wraps its
    decomposition pass (torch 2.14's internals); where those differ, it returns False and changes nothing
    (:func:`export` still works). Called on import."""
    try:
        from torch.onnx._internal.exporter import _fx_passes, _registration
        from torch.onnx._internal.exporter._torchlib import _torchlib_registry

        registry = _torchlib_registry._registry
        original = _fx_passes.decompose_with_registry
        if getattr(original, "_rope_ext", False):
            return True
        metas = [
            _registration.OnnxDecompMeta(
                onnx_function=fn,
                fx_target=target,
                signature=None,
                is_custom=True,
                skip_signature_inference=True,
            )
            for target, fn in translations().items()
        ]
    except (ImportError, AttributeError, TypeError):
        return False
    if not isinstance(registry, list):
        return False

    def decompose_with_registry(exported_program, registry):
        return original(functionalize(exported_program), registry)

    decompose_with_registry._rope_ext = True
    decompose_with_registry.__wrapped__ = original
    registry.extend(metas)
    _fx_passes.decompose_with_registry = decompose_with_registry
    return True


REGISTERED = register()
"""Whether ``torch.onnx.export`` itself knows the rope_ext ops (see :func:`register`)."""

"""ONNX Runtime (CPU) running the rotation as rope_ext.onnx exports it; opt-in: ``--providers onnxruntime``.

The workload's call (``apply_rotary_qk_`` in place for ``inplace``, ``apply_rotary_qk`` for ``out``) is
exported once per workload shape with :func:`rope_ext.onnx.export` (opset 23: two ``RotaryEmbedding``
nodes; MRoPE presets: the decomposition) and run by an ``InferenceSession`` with ``torch.get_num_threads()``
intra-op threads, inputs bound to the workload's tensors (no copy). ``inplace``: the exported in-place op is
functional in ONNX, so its outputs are bound to buffers allocated once (the closest to in place ONNX Runtime
gets); ``out``: to new tensors on every call, as the out-of-place op allocates them. float32, float16 and
float64 (ONNX Runtime's Python API takes no bfloat16 buffers).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from ..workloads import Case, clones
from . import Runner, Skip, provider

_NUMPY = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64", torch.int64: "int64"}


class _Rotation(torch.nn.Module):
    def __init__(self, inplace: bool, interleaved: bool, mrope_section):
        super().__init__()
        self.inplace, self.options = inplace, {"interleaved": interleaved, "mrope_section": mrope_section}

    def forward(self, q, k, positions, cos_sin):
        import rope_ext

        if self.inplace:
            rope_ext.apply_rotary_qk_(q, k, positions, cos_sin, **self.options)
            return q, k
        return rope_ext.apply_rotary_qk(q, k, positions, cos_sin, **self.options)


@functools.cache
def _session(
    inplace: bool, shapes: tuple, dtype: torch.dtype, interleaved: bool, mrope_section, threads: int
):
    """The exported rotation for inputs of ``shapes`` (q, k, positions, cos_sin) in an InferenceSession."""
    import onnxruntime as ort

    import rope_ext.onnx

    q, k, positions, cos_sin = (
        torch.zeros(s, dtype=dt)
        for s, dt in zip(shapes, (dtype, dtype, torch.int64, torch.float32), strict=True)
    )
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")  # "torchvision is not installed"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.no_grad():
            model = rope_ext.onnx.export(
                _Rotation(inplace, interleaved, mrope_section), (q, k, positions, cos_sin), verbose=False
            )
    finally:
        quiet.setLevel(level)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(
        model.model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _bind(binding, name: str, t: Tensor, output: bool = False) -> None:
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, _NUMPY[t.dtype], list(t.shape), t.data_ptr())


def _build(case: Case, inplace: bool) -> Runner:
    try:
        import onnxruntime  # noqa: F401

        import rope_ext.onnx  # noqa: F401
    except Exception as e:
        raise Skip(f"onnxruntime, onnx or onnxscript not importable ({type(e).__name__})") from None
    if case.device.type != "cpu":
        raise Skip("the CPU execution provider only")
    if case.dtype not in _NUMPY:
        raise Skip(f"{case.dtype}: ONNX Runtime's Python API takes no buffers of it")
    q, k = clones(case) if inplace else (case.q, case.k)
    positions = case.rope_positions.contiguous()
    inputs = (q, k, positions, case.cos_sin)
    shapes = tuple(tuple(t.shape) for t in inputs)
    session = _session(
        inplace, shapes, case.dtype, case.interleaved, case.mrope_section, torch.get_num_threads()
    )
    binding = session.io_binding()
    for meta, t in zip(session.get_inputs(), inputs, strict=True):
        _bind(binding, meta.name, t)
    names = [o.name for o in session.get_outputs()]
    if inplace:
        outs = (torch.empty_like(q), torch.empty_like(k))
        for name, t in zip(names, outs, strict=True):
            _bind(binding, name, t, output=True)

        def run(keep=inputs) -> tuple[Tensor, Tensor]:  # keep: the bound tensors live as long as run
            session.run_with_iobinding(binding)
            return outs

        return run

    def run_out(keep=inputs) -> tuple[Tensor, Tensor]:
        outs = (torch.empty_like(q), torch.empty_like(k))
        for name, t in zip(names, outs, strict=True):
            _bind(binding, name, t, output=True)
        session.run_with_iobinding(binding)
        return outs

    return run_out


@provider("onnxruntime", "inplace", opt_in=True)
def _onnxruntime_inplace(case: Case) -> Runner:
    return _build(case, inplace=True)


@provider("onnxruntime", "out", opt_in=True)
def _onnxruntime_out(case: Case) -> Runner:
    return _build(case, inplace=False)

"""``patch_diffusers`` on tiny random diffusers transformers: FLUX, Wan, HunyuanVideo, LTX-Video, CogVideoX
and Qwen-Image, built from small configs (no downloads), float32, weights redrawn at N(0, 0.3**2).

Each model is checked against its unpatched self: outputs and gradients eagerly, the same under
``torch.compile(fullgraph=True)`` (one graph, rope_ext's op in it), every rotation call through rope_ext's op
(none left to the original functions), a deliberately wrong rotation moving the outputs by far more than the
tolerance, and ``unpatch_diffusers`` giving back the original functions and bit-identical outputs and
gradients. :data:`CASES` is shared with ``test_diffusers_table.py`` (README.md's table).

Tolerances, relative to the largest |output| (|gradient| per parameter): the patched rotation computes the
unpatched one's float32 formula ``x * cos + rotate(x) * sin`` (or its complex / matrix form) from the same
cos / sin, in float32 with a different order of operations, so rotated q / k differ by an ulp or two
(~1e-7 relative); one or two attention blocks carry that to the outputs at the same order (measured 1e-7 to
1e-6). :data:`OUT_RTOL` 1e-5 leaves a margin of ten or more; the gradients, sums over tokens and heads of
products of such terms, get :data:`GRAD_RTOL` 1e-4 (measured up to ~1e-5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

diffusers = pytest.importorskip("diffusers")

from rope_ext.compat import patch_diffusers, unpatch_diffusers  # noqa: E402
from rope_ext.compat.diffusers import patch as dpatch  # noqa: E402

OUT_RTOL = 1e-5
GRAD_RTOL = 1e-4
SENSITIVITY = 100.0
BATCH = 2


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _flux_inputs(g):
    hw, text = 16, 6
    ids = torch.stack([torch.zeros(hw), torch.arange(hw) // 4, torch.arange(hw) % 4], -1)
    return dict(
        hidden_states=_randn(g, BATCH, hw, 4),
        encoder_hidden_states=_randn(g, BATCH, text, 32),
        pooled_projections=_randn(g, BATCH, 32),
        timestep=torch.tensor([0.5, 0.25]),
        img_ids=ids,
        txt_ids=torch.zeros(text, 3),
    )


def _wan_inputs(g):
    return dict(
        hidden_states=_randn(g, BATCH, 4, 2, 8, 8),
        timestep=torch.tensor([500, 250]),
        encoder_hidden_states=_randn(g, BATCH, 6, 16),
    )


def _hunyuan_video_inputs(g):
    return dict(
        hidden_states=_randn(g, BATCH, 4, 2, 4, 4),
        timestep=torch.tensor([500, 250]),
        encoder_hidden_states=_randn(g, BATCH, 6, 16),
        encoder_attention_mask=torch.ones(BATCH, 6),
        pooled_projections=_randn(g, BATCH, 8),
        guidance=torch.tensor([3500.0, 3500.0]),
    )


def _ltx_inputs(g):
    frames, height, width = 2, 4, 4
    return dict(
        hidden_states=_randn(g, BATCH, frames * height * width, 4),
        encoder_hidden_states=_randn(g, BATCH, 6, 16),
        timestep=torch.tensor([500, 250]),
        encoder_attention_mask=torch.ones(BATCH, 6),
        num_frames=frames,
        height=height,
        width=width,
        # the pipeline's scale (VAE compression over frame rate, spatial compression): fractional positions
        rope_interpolation_scale=(8 / 25, 32.0, 32.0),
    )


def _cogvideox_inputs(g):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    frames, grid = 2, 4
    rotary = get_3d_rotary_pos_embed(
        embed_dim=16, crops_coords=((0, 0), (grid, grid)), grid_size=(grid, grid), temporal_size=frames
    )
    return dict(
        hidden_states=_randn(g, BATCH, frames, 4, 2 * grid, 2 * grid),
        encoder_hidden_states=_randn(g, BATCH, 8, 8),
        timestep=torch.tensor([500, 250]),
        image_rotary_emb=rotary,
    )


def _qwen_image_inputs(g):
    return dict(
        hidden_states=_randn(g, BATCH, 16, 16),
        encoder_hidden_states=_randn(g, BATCH, 6, 16),
        encoder_hidden_states_mask=torch.ones(BATCH, 6, dtype=torch.long),
        timestep=torch.tensor([0.5, 0.25]),
        img_shapes=[[(1, 4, 4)]] * BATCH,
    )


@dataclasses.dataclass(frozen=True)
class Case:
    """A diffusers model class (``name`` in ``diffusers``), a tiny config of it and its call's inputs."""

    name: str
    config: dict
    inputs: Callable[[torch.Generator], dict]
    note: str = ""

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = getattr(diffusers, self.name)(**self.config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        return model.float().eval()


CASES = {
    "flux": Case(
        "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
             axes_dims_rope=(4, 4, 8)),
        _flux_inputs,
    ),
    "wan": Case(
        "WanTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
             out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        _wan_inputs,
        "the rotation Wan's processor defines in its __call__",
    ),
    "hunyuan_video": Case(
        "HunyuanVideoTransformer3DModel",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
             text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4)),
        _hunyuan_video_inputs,
    ),
    "ltx_video": Case(
        "LTXVideoTransformer3DModel",
        dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
             attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=16,
             qk_norm="rms_norm_across_heads"),
        _ltx_inputs,
        "fractional positions; cos / sin over all heads' features",
    ),
    "cogvideox": Case(
        "CogVideoXTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
             text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
             temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True),
        _cogvideox_inputs,
        "cos / sin from the pipeline",
    ),
    "qwen_image": Case(
        "QwenImageTransformer2DModel",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4)),
        _qwen_image_inputs,
        "complex frequencies",
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The check


class OpCounter(TorchDispatchMode):
    """Counts rope_ext op calls (forward ones: the backward's are separate ops)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rope_ext" and "backward" not in func.name():
            self.calls += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_fast_path():
    """Counts the stand-ins' calls, by whether rope_ext's op (``True``) or the original function ran."""
    counts = {True: 0, False: 0}
    fast = dpatch._fast

    def counted(spec, args, kwargs):
        out = fast(spec, args, kwargs)
        counts[out is not None] += 1
        return out

    dpatch._fast = counted
    try:
        yield counts
    finally:
        dpatch._fast = fast


@contextlib.contextmanager
def wrong_pairing():
    """Every stand-in rotates with the other pairing (what a wrong patch would do)."""
    rotate = dpatch._rotate
    other = {"interleaved": "half", "half": "interleaved"}
    dpatch._rotate = lambda xs, form, freqs, rot, check: rotate(
        xs, form, freqs, rot._replace(pairing=other[rot.pairing]), check
    )
    try:
        yield
    finally:
        dpatch._rotate = rotate


def run(model, inputs: dict, runner=None, mode=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output of ``runner`` (default ``model``) and the gradients of ``(output * w).sum()`` (``w``
    N(0, 1)) for every parameter of ``model``."""
    model.zero_grad(set_to_none=True)
    with mode if mode is not None else contextlib.nullcontext():
        out = (model if runner is None else runner)(**inputs, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def out_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def grad_error(a: dict, b: dict) -> float:
    """Largest over parameters of ``max |a - b| / max |b|``, the scale floored at 1e-3 of the largest
    gradient of all: a key projection's bias gets a gradient that is zero but for rounding."""
    if a.keys() != b.keys():
        return float("inf")
    floor = 1e-3 * max(ref.abs().max().item() for ref in b.values())
    worst = 0.0
    for name, ref in b.items():
        scale, diff = max(ref.abs().max().item(), floor), (a[name] - ref).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else (float("inf") if diff > 0 else 0.0))
    return worst


@dataclasses.dataclass
class Result:
    out_err: float = float("nan")
    grad_err: float = float("nan")
    compiled_out_err: float = float("nan")
    compiled_grad_err: float = float("nan")
    wrong_change: float = float("nan")
    op_calls: int = -1
    fast: int = -1
    fallback: int = -1
    graphs: int = -1
    graph_has_op: bool = False
    restored: bool = False
    unpatched_exact: bool = False
    describe: str = ""


def check(case: Case) -> Result:
    """Patch a tiny model of ``case``, compare it with the unpatched one, unpatch it."""
    res = Result()
    model = case.build()
    inputs = case.inputs(torch.Generator().manual_seed(1))
    ref = run(model, inputs)
    patch_diffusers(model)
    keys = model.__dict__[dpatch._ATTR]
    try:
        before = {k: dpatch._ORIGINALS[k][2] for k in keys}
        res.describe = "; ".join(
            sorted({fn._rope_ext_spec.describe() for fn in _swapped_functions(keys)}, key=len)
        )
        counter = OpCounter()
        with counting_fast_path() as counts:
            got = run(model, inputs, mode=counter)
        res.op_calls, res.fast, res.fallback = counter.calls, counts[True], counts[False]
        res.out_err, res.grad_err = out_error(got[0], ref[0]), grad_error(got[1], ref[1])
        with wrong_pairing():
            wrong = run(model, inputs)
        res.wrong_change = out_error(wrong[0], ref[0])
        graphs: list = []
        aot_eager = torch._dynamo.lookup_backend("aot_eager")

        def backend(gm, example_inputs):
            graphs.append(gm)
            return aot_eager(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        got = run(model, inputs, runner=compiled)
        res.compiled_out_err, res.compiled_grad_err = out_error(got[0], ref[0]), grad_error(got[1], ref[1])
        res.graphs = len(graphs)
        res.graph_has_op = any("rope_ext" in str(n.target) for gm in graphs for n in gm.graph.nodes)
    finally:
        unpatch_diffusers(model)
        torch._dynamo.reset()
    res.restored = all(
        getattr(dpatch_owner(k), k[3] if k[0] == "nested" else k[2]) is v for k, v in before.items()
    ) and not any(k in dpatch._ORIGINALS for k in keys)
    again = run(model, inputs)
    res.unpatched_exact = torch.equal(again[0], ref[0]) and all(
        torch.equal(again[1][n], ref[1][n]) for n in ref[1]
    )
    return res


def dpatch_owner(key: tuple) -> Any:
    """The module or class a site key names."""
    owner: Any = sys.modules[key[1]]
    if key[0] == "nested" and key[2]:
        for part in key[2].split("."):
            owner = getattr(owner, part)
    return owner


def _swapped_functions(keys) -> list:
    """The stand-ins installed for ``keys`` (a module's function, or those a rewritten method calls)."""
    out = []
    for key in keys:
        owner, attr, _, added = dpatch._ORIGINALS[key]
        if added:
            out += [module.__dict__[name] for module, name in added]
        else:
            out.append(getattr(owner, attr))
    return out


_RESULTS: dict[str, Result] = {}


def result(name: str) -> Result:
    """The check of ``CASES[name]``, run once per session."""
    if name not in _RESULTS:
        _RESULTS[name] = check(CASES[name])
    return _RESULTS[name]


@pytest.mark.parametrize("name", list(CASES))
def test_patched_model_equals_unpatched(name):
    r = result(name)
    # every rotation through rope_ext's op, none left to the original function
    assert r.fast > 0 and r.fallback == 0 and r.op_calls == r.fast, r
    # float32 outputs and gradients within the contract (module docstring), eagerly ...
    assert r.out_err <= OUT_RTOL and r.grad_err <= GRAD_RTOL, r
    # ... and compiled with fullgraph=True: one graph, rope_ext's op in it
    assert r.compiled_out_err <= OUT_RTOL and r.compiled_grad_err <= GRAD_RTOL, r
    assert r.graphs == 1 and r.graph_has_op, r
    # the comparison is sensitive: the other pairing moves the outputs by far more than the tolerance
    assert r.wrong_change >= SENSITIVITY * OUT_RTOL, r
    # unpatching gives back diffusers' functions and the unpatched results bit for bit
    assert r.restored and r.unpatched_exact, r

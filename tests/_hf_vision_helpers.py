"""Tiny random vision towers of transformers' vision-language models, and what ``tests/test_hf_vision.py``
runs on them: the towers (:data:`TOWERS`: config, inputs, the rotation function their attention calls),
building one with realistic weights (:func:`build`), a forward with the gradients of a random projection of
its outputs (:func:`run`), and the first call of its rotation function, captured (:func:`first_call`).

The accuracy contract of a patched tower against the unpatched one (:data:`OUT_RTOL`, :data:`GRAD_RTOL`)
is tighter than the text families' (``hf_families.LOGIT_RTOL``): a vision tower keeps its own cos / sin, so
both runs rotate by the same float32 values and differ only in the rounding of the rotation itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from hf_check import reinit

# Relative to the largest |output| (or to the largest |gradient| of each parameter). Both runs rotate by
# the model's own float32 cos / sin; rope_ext's op and the model's formula round differently (float32, a
# product and a fused or separate sum: ~1 ulp, 6e-8 relative, per rotated element), and two layers of
# attention, MLP and norms carry that to the outputs at the same order (measured: up to ~2e-7 relative for
# outputs, ~1e-6 for gradients). 1e-5 / 1e-4 leave a margin of 50x or more; a tower whose rotation is
# skipped altogether moves by 1e-2 or more (SENSITIVITY checks that the comparison would see it).
OUT_RTOL = 1e-5
GRAD_RTOL = 1e-4
SENSITIVITY = 100.0


def _qwen_inputs(cfg) -> dict[str, torch.Tensor]:
    """Two images in one packed sequence (4 x 6 and 2 x 4 patches): ``[32, C * T * P * P]`` and their grid."""
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])
    n = int(grid.prod(-1).sum())
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    return {
        "hidden_states": torch.randn(n, width, generator=torch.Generator().manual_seed(1)),
        "grid_thw": grid,
    }


def _pixels(*shape: int) -> Callable[[Any], dict[str, torch.Tensor]]:
    return lambda cfg: {"pixel_values": torch.randn(*shape, generator=torch.Generator().manual_seed(1))}


_QWEN = dict(depth=2, num_heads=2, patch_size=4, attn_implementation="sdpa")


@dataclasses.dataclass(frozen=True)
class Tower:
    """A vision tower: ``package`` under ``transformers.models``, its config / model classes and config
    kwargs, its inputs, the rotation ``function`` of its modeling module its attention calls, and whether
    the whole tower compiles with ``fullgraph=True`` (the Qwen-VL and GLM-4V towers do not, patched or not:
    their patch-grid handling and packed-sequence attention depend on the values of ``grid_thw`` /
    ``cu_seqlens``)."""

    package: str
    config: str
    model: str
    kwargs: dict[str, Any]
    inputs: Callable[[Any], dict[str, torch.Tensor]]
    function: str
    fullgraph: bool = False

    @property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.package}.modeling_{self.package}")


def _ernie_inputs(cfg) -> dict[str, torch.Tensor]:
    """Two images in one packed sequence (4 x 6 and 2 x 4 patches): ``[32, C * P * P]`` and their grid."""
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])
    n = int(grid.prod(-1).sum())
    width = cfg.in_channels * cfg.patch_size**2
    return {
        "hidden_states": torch.randn(n, width, generator=torch.Generator().manual_seed(1)),
        "grid_thw": grid,
    }


TOWERS = {
    "qwen2_vl": Tower(
        "qwen2_vl",
        "Qwen2VLVisionConfig",
        "Qwen2VisionTransformerPretrainedModel",
        dict(_QWEN, embed_dim=64, hidden_size=64),
        _qwen_inputs,
        "apply_rotary_pos_emb_vision",
    ),
    "qwen2_5_vl": Tower(
        "qwen2_5_vl",
        "Qwen2_5_VLVisionConfig",
        "Qwen2_5_VisionTransformerPretrainedModel",
        dict(
            _QWEN,
            hidden_size=64,
            intermediate_size=96,
            out_hidden_size=64,
            window_size=16,
            fullatt_block_indexes=[1],
        ),
        _qwen_inputs,
        "apply_rotary_pos_emb_vision",
    ),
    "qwen3_vl": Tower(
        "qwen3_vl",
        "Qwen3VLVisionConfig",
        "Qwen3VLVisionModel",
        dict(
            _QWEN,
            hidden_size=64,
            intermediate_size=96,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
        _qwen_inputs,
        "apply_rotary_pos_emb_vision",
    ),
    "ernie4_5_vl_moe": Tower(
        "ernie4_5_vl_moe",
        "Ernie4_5_VLMoeVisionConfig",
        "Ernie4_5_VLMoeVisionTransformerPretrainedModel",
        dict(_QWEN, hidden_size=64, intermediate_size=96),
        _ernie_inputs,
        "apply_rotary_pos_emb_vision",
    ),
    "glm4v": Tower(
        "glm4v",
        "Glm4vVisionConfig",
        "Glm4vVisionModel",
        dict(_QWEN, hidden_size=64, intermediate_size=96, image_size=16, out_hidden_size=64),
        _qwen_inputs,
        "apply_rotary_pos_emb_vision",
    ),
    "pixtral": Tower(
        "pixtral",
        "PixtralVisionConfig",
        "PixtralVisionModel",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=4,
            attn_implementation="sdpa",
        ),
        _pixels(2, 3, 24, 32),  # two 6 x 8 patch images, one packed sequence with a block mask
        "apply_rotary_pos_emb",
        fullgraph=True,
    ),
    "llama4": Tower(
        "llama4",
        "Llama4VisionConfig",
        "Llama4VisionModel",
        dict(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
            attn_implementation="sdpa",
        ),
        _pixels(2, 3, 16, 16),  # 4 x 4 patches and a CLS token, complex freqs_ci [17, 1, 16]
        "vision_apply_rotary_emb",
        fullgraph=True,
    ),
}


def build(tower: Tower) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tower (float32, eval mode, every weight matrix redrawn by ``hf_check.reinit`` so that attention
    is far from uniform and the rotation matters) and its inputs."""
    config_module = importlib.import_module(
        f"transformers.models.{tower.package}.configuration_{tower.package}"
    )
    config = getattr(config_module, tower.config)(**tower.kwargs)
    torch.manual_seed(0)
    model = getattr(tower.modeling, tower.model)(config).eval()
    reinit(model)
    return model, tower.inputs(config)


def layers(model: torch.nn.Module) -> int:
    """The number of attention layers of a tower (one rotation call each per forward)."""
    config = model.config
    return getattr(config, "depth", None) or config.num_hidden_layers


def outputs(out) -> list[torch.Tensor]:
    """The tensors of a tower's output: its last hidden state and its pooled / merged output if any."""
    tensors = [out.last_hidden_state]
    pooled = getattr(out, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        tensors.append(pooled)
    return tensors


def run(model, inputs, runner=None, mode=None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The outputs of ``runner`` (default ``model``; e.g. its compiled form) and the gradients of a fixed
    random projection of them for every parameter of ``model``; ``mode`` (a dispatch mode) is active during
    the forward only."""
    model.zero_grad(set_to_none=True)
    with mode if mode is not None else contextlib.nullcontext():
        outs = outputs((model if runner is None else runner)(**inputs))
    g = torch.Generator().manual_seed(2)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], grads


def out_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest over the outputs of ``max |got - want| / max |want|``."""
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True))


@contextlib.contextmanager
def swapped(module, name: str, value):
    """``module.name`` set to ``value`` for the duration."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def first_call(tower: Tower, model, inputs) -> tuple[tuple, dict]:
    """The arguments of the first call of the tower's rotation function in a forward (detached clones)."""
    module = tower.modeling
    fn = getattr(module, tower.function)
    seen: list = []

    def recording(*args, **kwargs):
        if not seen:
            seen.append((args, kwargs))
        return fn(*args, **kwargs)

    with swapped(module, tower.function, recording), torch.no_grad():
        model(**inputs)
    args, kwargs = seen[0]

    def clone(x):
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    return tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()}

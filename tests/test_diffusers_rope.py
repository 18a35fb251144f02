"""diffusers' RoPE reproduced by rope_ext's ops called directly, no patching: FLUX, Wan and HunyuanVideo
(integer positions) from ``RopeCache.for_axes`` with ``[n_axes, ...]`` positions, LTX-Video (fractional
positions) from its own cos / sin as a table with ``arange`` positions.

Each model's pos-embed module computes cos / sin and its rotation (``embeddings.apply_rotary_emb``, Wan's
processor-local function, LTX-Video's ``apply_rotary_emb``) rotates float32 q / k ``[B, S, H, D]``; rope_ext's
op must give the same within :data:`RTOL` of ``max |x|`` (the project's float32 accuracy contract). FLUX and
Wan compute their angles in float64 and round cos / sin to float32, as ``RopeCache`` does: the tables agree
to the last bit, and the rotations differ by float32 rounding (measured ~6e-8). HunyuanVideo computes its
angles in float32: at positions below 8 and frequencies up to 1 an angle is off by at most ~8 * 2**-24
(measured 2e-7).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import rope_ext

pytest.importorskip("diffusers")

from diffusers.models import embeddings  # noqa: E402
from diffusers.models.transformers import transformer_flux, transformer_ltx, transformer_wan  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed  # noqa: E402

RTOL = 1e-6
B, H = 2, 3


def _error(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return ((got.double() - want.double()).abs().max() / x.abs().max()).item()


def _video_grid(frames: int, height: int, width: int) -> torch.Tensor:
    """``[3, S]`` integer (frame, row, column) of each token, frames outermost (diffusers' token order)."""
    f, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([f.flatten(), h.flatten(), w.flatten()])


def test_flux_is_for_axes():
    """FluxPosEmbed (axes_dim (16, 56, 56), theta 10000) on text ids (zeros) and image ids (0, row, column),
    rotated by ``apply_rotary_emb(..., sequence_dim=1)``: interleaved pairs, one row of positions per axis."""
    axes_dim, text, rows, cols = (16, 56, 56), 5, 6, 7
    grid = _video_grid(1, rows, cols)
    ids = torch.cat([torch.zeros(3, text, dtype=torch.long), grid], dim=1)  # [3, S]
    cos, sin = transformer_flux.FluxPosEmbed(theta=10000, axes_dim=list(axes_dim))(ids.T.float())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, ids.shape[1], H, 128, generator=g)
    want = embeddings.apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    cache = rope_ext.RopeCache.for_axes(axes_dim, theta=10000.0, max_positions=16)
    got = rope_ext.apply_rotary(
        x, ids[..., None], cache.cos_sin, interleaved=True, mrope_section=cache.mrope_section
    )  # positions [3, S, 1]: shared by the batch, the same for every head
    assert _error(got, want, x) <= RTOL
    # the same with the table the patch builds from FLUX's own cos / sin (pair values, positions arange)
    table = torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=-1)
    got = rope_ext.apply_rotary(x, torch.arange(ids.shape[1])[:, None], table, interleaved=True)
    assert _error(got, want, x) <= RTOL


def _wan_rotation() -> types.FunctionType:
    """The function WanAttnProcessor.__call__ defines and calls on q and k."""
    code = next(
        c
        for c in transformer_wan.WanAttnProcessor.__call__.__code__.co_consts
        if isinstance(c, types.CodeType) and c.co_name == "apply_rotary_emb"
    )
    return types.FunctionType(code, transformer_wan.__dict__, code.co_name)


def test_wan_is_for_axes():
    """WanRotaryPosEmbed (head_dim 128: t / h / w features 44 / 42 / 42, theta 10000, patches 1 x 2 x 2) on a
    3 x 8 x 10 latent, rotated by the processor's own function: per-axis frequencies over the patch grid."""
    head_dim, frames, height, width = 128, 3, 8, 10
    rope = transformer_wan.WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=64)
    cos, sin = rope(torch.zeros(B, 4, frames, height, width))  # [1, S, 1, 128]
    grid = _video_grid(frames, height // 2, width // 2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, grid.shape[1], H, head_dim, generator=g)
    want = _wan_rotation()(x, cos, sin)
    axes = (rope.t_dim, rope.h_dim, rope.w_dim)
    assert axes == (44, 42, 42)
    cache = rope_ext.RopeCache.for_axes(axes, theta=10000.0, max_positions=64)
    got = rope_ext.apply_rotary(
        x, grid[..., None], cache.cos_sin, interleaved=True, mrope_section=cache.mrope_section
    )
    assert _error(got, want, x) <= RTOL


def test_hunyuan_video_is_for_axes():
    """HunyuanVideoRotaryPosEmbed (rope_dim (16, 56, 56), theta 256) on a 4 x 6 x 5 latent, rotated by
    ``apply_rotary_emb(..., sequence_dim=1)``."""
    rope_dim, frames, height, width = (16, 56, 56), 4, 6, 5
    cos, sin = HunyuanVideoRotaryPosEmbed(1, 1, list(rope_dim), theta=256.0)(
        torch.zeros(B, 4, frames, height, width)
    )  # [S, 128]
    grid = _video_grid(frames, height, width)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, grid.shape[1], H, 128, generator=g)
    want = embeddings.apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    cache = rope_ext.RopeCache.for_axes(rope_dim, theta=256.0, max_positions=8)
    got = rope_ext.apply_rotary(
        x, grid[..., None], cache.cos_sin, interleaved=True, mrope_section=cache.mrope_section
    )
    assert _error(got, want, x) <= RTOL
    # and in place on q and k at once, bfloat16: within an ulp of the float32 result
    q, k = x.bfloat16(), x[:, :, :2].bfloat16().clone()
    rope_ext.apply_rotary_qk_(
        q, k, grid[..., None], cache.cos_sin, interleaved=True, mrope_section=cache.mrope_section
    )
    assert (q.double() - want.double()).abs().max() <= 2**-7 * x.abs().max()


def test_ltx_video_fractional_positions_as_a_table():
    """LTX-Video's positions are fractional (the frame / row / column grid scaled by
    ``rope_interpolation_scale`` over the base size) and its frequencies are not ``theta ** (-2i / d)``, so
    no ``RopeCache`` holds them: its own cos / sin ``[B, S, C]`` (C = all heads' features, interleaved pairs,
    padded with cos 1 / sin 0 to C) are the table (one row per batch and token, pair values once), with
    positions ``arange(B * S)`` as ``[B, S]``: the op then rotates ``[B, S, C]`` exactly as the model does."""
    channels, frames, height, width = 2 * 32, 3, 4, 5  # 32 % 6 != 0: LTX's padding is in the table too
    rope = transformer_ltx.LTXVideoRotaryPosEmbed(
        channels, base_num_frames=20, base_height=2048, base_width=2048
    )
    seq = frames * height * width
    cos, sin = rope(
        torch.zeros(B, seq, channels), frames, height, width, rope_interpolation_scale=(8 / 25, 32, 32)
    )
    assert cos.shape == (B, seq, channels)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, seq, channels, generator=g)
    want = transformer_ltx.apply_rotary_emb(x, (cos, sin))
    table = torch.cat([cos[..., 0::2], sin[..., 0::2]], dim=-1).reshape(B * seq, channels)
    positions = torch.arange(B * seq).view(B, seq)
    got = rope_ext.apply_rotary(x, positions, table, interleaved=True)
    assert _error(got, want, x) <= RTOL
    # the same rotation per head ([B, S, H, C / H]): each head's slice of the table, positions [B, S, 1]
    heads = 4
    per_head = torch.cat(
        [cos[..., 0::2].unflatten(-1, (heads, -1)), sin[..., 0::2].unflatten(-1, (heads, -1))], dim=-1
    )  # [B, S, heads, C / heads]
    got = rope_ext.apply_rotary(
        x.unflatten(-1, (heads, -1)),
        torch.arange(B * seq * heads).view(B, seq, heads),
        per_head.reshape(B * seq * heads, channels // heads),
        interleaved=True,
    )
    assert _error(got.flatten(-2), want, x) <= RTOL


def test_ltx_video_with_frequencies():
    """LTX-Video without a table: its frequencies ``theta ** linspace(0, 1, C // 6) * pi / 2`` (float32, as
    it computes them) per interleaved axis (pair ``j`` takes axis ``j % 3``: ``mrope_interleaved`` with three
    equal sections), its positions ``2 * coord - 1`` as float32, the ``C % 6`` padding features passed through
    (``rotary_offset``). Against the float64 rotation of the same frequencies and positions: within float32
    rounding. Against diffusers' own output: within its float32 angles' error (``f * p`` rounded to float32,
    up to ``15708 * 2^-24`` rad at the top frequency)."""
    channels, frames, height, width = 2 * 32, 3, 4, 5
    rope = transformer_ltx.LTXVideoRotaryPosEmbed(
        channels, base_num_frames=20, base_height=2048, base_width=2048
    )
    seq, scale = frames * height * width, (8 / 25, 32, 32)
    cos, sin = rope(torch.zeros(B, seq, channels), frames, height, width, rope_interpolation_scale=scale)
    grid = rope._prepare_video_coords(B, frames, height, width, scale, torch.device("cpu"))  # [B, S, 3]
    positions = (grid * 2 - 1).permute(2, 0, 1)  # [3, B, S], float32 as LTX computes them
    n = channels // 6
    f = 10000.0 ** torch.linspace(math.log(1.0, 10000.0), 1.0, n, dtype=torch.float32) * math.pi / 2.0
    freqs = rope_ext.frequencies(f.double().repeat_interleave(3))  # pair 3i + a: axis a, frequency f_i
    x = torch.randn(B, seq, channels, generator=torch.Generator().manual_seed(4))
    pad = channels % 6
    got = rope_ext.apply_rotary(
        x,
        positions,
        freqs,
        interleaved=True,
        rotary_offset=pad,
        mrope_section=(n, n, n),
        mrope_interleaved=True,
    )
    angle = positions.double().permute(1, 2, 0).repeat(1, 1, n) * f.double().repeat_interleave(
        3
    )  # [B, S, 3n]
    c, s = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
    xr = x[..., pad:].double()
    real, imag = xr.unflatten(-1, (-1, 2)).unbind(-1)
    ref = torch.cat([x[..., :pad].double(), xr * c + torch.stack([-imag, real], -1).flatten(-2) * s], -1)
    assert _error(got.double(), ref, x) <= 2**-23
    want = transformer_ltx.apply_rotary_emb(x, (cos, sin))
    assert _error(got, want, x) <= 2 * 15708 * 2**-24

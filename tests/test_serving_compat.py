"""Serving adapters against the float64 references: vLLM's ``fused_qk_norm_rope`` argument order and
SGLang's ``apply_rope_with_cos_sin_cache_inplace`` (with and without the fused KV-buffer write)."""

from __future__ import annotations

import pytest
import torch

from rope_ext import reference
from rope_ext.compat import FusedSetKVBufferArg, apply_rope_with_cos_sin_cache_inplace, fused_qk_norm_rope

T, HQ, HK, D = 11, 4, 2, 64


def _ulp_close(got, want, dtype):
    """Within 2 ulps of the dtype at the values' magnitude (the kernel's float32 norm may round the
    normalised value one ulp away from the float64 reference's before the rotation)."""
    eps = torch.finfo(dtype).eps
    scale = want.double().abs().amax().item()
    err = (got.double() - want.double()).abs().amax().item()
    assert err <= 2 * eps * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [D, D // 2])
def test_vllm_fused_qk_norm_rope(dtype, is_neox, rot_dim):
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(T, (HQ + 2 * HK) * D, generator=g) * 2).to(dtype)
    qw, kw = torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    pos = torch.randint(0, 128, (T,), generator=g)
    cache = reference.cos_sin_table(128, rot_dim).float()
    want = reference.qk_norm_rotary(qkv, HQ, HK, HK, qw, kw, pos, cache, eps=1e-5, interleaved=not is_neox)
    got = qkv.clone()
    fused_qk_norm_rope(got, HQ, HK, HK, D, 1e-5, qw, kw, cache, is_neox, pos)
    _ulp_close(got, want, dtype)
    assert torch.equal(got[:, (HQ + HK) * D :], qkv[:, (HQ + HK) * D :])  # v untouched
    with pytest.raises(ValueError, match="qkv must be"):
        fused_qk_norm_rope(got, HQ, HK, HK, D + 2, 1e-5, qw, kw, cache, is_neox, pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("buffer", [None, "same", "fp8"])
def test_sglang_rope_inplace_with_kv_buffer(dtype, is_neox, buffer):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=g).to(dtype)
    query, key = qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HK) * D]
    value = qkv[:, (HQ + HK) * D :]
    pos = torch.randint(0, 128, (T,), generator=g)
    cache = reference.cos_sin_table(128, D).float()
    q3, k3 = query.unflatten(-1, (HQ, D)), key.unflatten(-1, (HK, D))
    want_q = reference.rotary_hadamard(q3, pos[:, None], cache, interleaved=not is_neox).to(dtype)
    want_k = reference.rotary_hadamard(k3, pos[:, None], cache, interleaved=not is_neox).to(dtype)
    q, k = query.clone(), key.clone()
    arg = None
    if buffer is not None:
        buf_dtype = dtype if buffer == "same" else torch.float8_e4m3fn
        kb = torch.randn(64, HK * D, generator=g).to(buf_dtype)
        vb = torch.randn(64, HK * D, generator=g).to(buf_dtype)
        loc = torch.randperm(64, generator=g)[:T]
        scale = None if buffer == "same" else 0.5
        arg = FusedSetKVBufferArg(value, kb.clone(), vb.clone(), scale, scale, loc)
    apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, is_neox, fused_set_kv_buffer_arg=arg)
    # one rounding of a float32 rotation: within an ulp of the float64 reference (bf16: equal)
    _ulp_close(q.unflatten(-1, (HQ, D)), want_q, dtype)
    _ulp_close(k.unflatten(-1, (HK, D)), want_k, dtype)
    if arg is not None:
        # the buffers hold exactly the rotated key (as left in `key`) and the value
        want_kb, want_vb = reference.kv_cache_write(
            k.unflatten(-1, (HK, D)),
            value.unflatten(-1, (HK, D)),
            kb.view(64, 1, HK, D),
            vb.view(64, 1, HK, D),
            loc,
            k_scale=None if scale is None else torch.tensor([scale]),
            v_scale=None if scale is None else torch.tensor([scale]),
        )
        assert torch.equal(arg.k_buffer.view(torch.uint8), want_kb.view(64, HK * D).view(torch.uint8))
        assert torch.equal(arg.v_buffer.view(torch.uint8), want_vb.view(64, HK * D).view(torch.uint8))

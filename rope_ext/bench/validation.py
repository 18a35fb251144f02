"""Validation: every provider's output checked against the float64 reference before it is timed.

The reference is :func:`rope_ext.reference.rotary_hadamard` on the same inputs
(:meth:`~rope_ext.bench.workloads.Case.expected`); a provider that disagrees is reported as ``wrong``
and is not timed. The serving modes:

* ``cache``, ``cache-fp8``: the rotated q and k as in place, and both whole caches against
  :func:`rope_ext.reference.kv_cache_write` of the float64 rotated k (rows not written stay zero). Caches of
  q's dtype: key rows within the same ulp tolerance as q and k, value rows bit-exact (stored as they
  are). fp8 caches: against ``kv_cache_write`` of the reference k rounded to q's dtype, i.e.
  ``quantize_fp8(round(k_ref), k_scale)`` (and ``quantize_fp8(v, v_scale)``), within
  :data:`FP8_TOL_CODES` = 1 fp8 code (one fp8 ulp): a kernel whose k is off by one ulp of q's dtype from
  the correctly rounded value (float32 arithmetic) can land on the neighbouring fp8 value when that ulp
  crosses a rounding boundary, and ``x * (1 / scale)`` may differ from ``x / scale`` there too.
* ``qknorm``: the whole packed qkv against :func:`rope_ext.reference.qk_norm_rotary` (norm in float64
  rounded once to the dtype, rotation in float64 rounded): q and k heads within
  ``min(tol_ulps, QKNORM_TOL_ULPS)`` units of ``eps(dtype) * max|expected|`` (a float32 norm can round to
  the neighbour of the reference's rounded norm, which the rotation carries over: a couple of ulps), v
  heads bit-exact (untouched).
* ``mla``, ``mla-fp8`` (:mod:`.mla`): q's rope part and k_pe against the float64 rotation of the workload's
  q and k (as in place), q's nope part bit-exact (untouched), and the whole latent cache (rows not written
  stay zero). Of q's dtype: kv_c's columns bit-exact, k_pe's within the ulp tolerance of the float64 k_pe.
  fp8: within :data:`FP8_TOL_CODES` of ``quantize_fp8(cat(kv_c, k_pe_out), kv_scale)``, ``k_pe_out`` the
  provider's own rotated k_pe (in q's dtype, checked against the reference above): the eager baseline
  rotates in q's dtype (the HF formula), a few ulps of ``max|k|`` from the reference, which near zero is
  many fp8 codes; against its own k_pe the cache shows whether the provider stored what it rotated, at
  the right slots with the right scale (the fused op: ``quantize_fp8`` of its rounded k_pe, as cache-fp8).
* ``rerotate``, ``rerotate-fp8`` (:mod:`.rerotate`): the whole cache against
  :func:`~rope_ext.bench.rerotate.expected_cache` (the stored rows rotated by ``delta`` in float64). Of q's
  dtype: within the ulp tolerance, in units of ``eps(dtype) * max|k|``. fp8: within :data:`FP8_TOL_CODES` of
  ``quantize_fp8`` of the float64 rotation of the dequantized rows (the op rotates in float32: its value can
  round to the neighbouring code at a rounding boundary); ``err_ulps`` there in units of ``eps(e4m3) *
  max|k|`` (one fp8 rounding of the largest key). Both: rows not at the slots and the pass-through features
  of a partial rotary bit-exact (untouched).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rope_ext import reference

from .presets import MLA_BLOCK_SIZE, MLA_MODES, REROTATE_MODES
from .rerotate import expected_cache
from .workloads import FP8_CACHE_DTYPE, Case, split_qkv

__all__ = ["FP8_TOL_CODES", "QKNORM_TOL_ULPS", "check", "fp8_code_distance", "validate"]

FP8_TOL_CODES = 1
QKNORM_TOL_ULPS = 4.0


def _ulp_err(out: Tensor, exp: Tensor, scale_of: Tensor, eps: float) -> float:
    """Max ``|out - exp|`` in units of ``eps * max|scale_of|``; inf on a shape mismatch or NaN."""
    if tuple(out.shape) != tuple(exp.shape):
        return math.inf
    scale = eps * max(float(scale_of.abs().max()), 1e-30) if scale_of.numel() else 1.0
    err = float((out.detach().cpu().double() - exp.double()).abs().max()) if out.numel() else 0.0
    return math.inf if math.isnan(err) else err / scale


def validate(case: Case, mode: str, out: tuple[Tensor, ...], tol_ulps: float) -> tuple[bool, float]:
    """Max error over q and k, in units of ``eps(dtype) * max|input|``; ok if within ``tol_ulps``.

    The unit is one rounding of the largest value: fp32/fp64 kernels land well under 1, HF-style
    arithmetic in bf16/fp16 (three roundings, cos/sin rounded to the dtype) lands at a few, and any real
    mistake (wrong pairing, sign, position, stride) is of order ``1 / eps``. The serving modes: see the
    module docstring (:func:`check` also gives their details).
    """
    info = check(case, mode, out, tol_ulps)
    return info["ok"], info["err_ulps"]


def check(case: Case, mode: str, out: tuple[Tensor, ...], tol_ulps: float) -> dict[str, Any]:
    """``{"ok", "err_ulps"}``; for ``cache-fp8`` and ``mla-fp8`` also ``err_fp8_codes``, and ``detail`` when
    what must stay bit-exact (v, q's nope part, kv_c in the cache) differs (see the module docstring).
    ``out``: the provider's ``(q, k)``; ``(q, k, key_cache, value_cache)`` (cache modes); ``(qkv,)``
    (qknorm); ``(q [T, H, N + R], k_pe, kv_cache)`` (MLA modes); ``(key_cache,)`` (rerotate modes)."""
    if mode == "qknorm":
        return _check_qknorm(case, out, tol_ulps)
    if mode in REROTATE_MODES:
        return _check_rerotate(case, mode == "rerotate-fp8", out, tol_ulps)
    if mode in MLA_MODES:
        return _check_mla(case, mode == "mla-fp8", out, tol_ulps)
    eps = torch.finfo(case.dtype).eps
    if mode in ("cache", "cache-fp8"):
        if len(out) != 4:
            return {"ok": False, "err_ulps": math.inf}
        exp_q, exp_k = case.expected("inplace")
        worst = max(_ulp_err(out[0], exp_q, case.q, eps), _ulp_err(out[1], exp_k, case.k, eps))
        exp_kc, exp_vc = _expected_caches(case, mode == "cache-fp8")
        kc, vc = out[2], out[3]
        if mode == "cache":
            worst = max(worst, _ulp_err(kc, exp_kc, case.k, eps))
            if tuple(vc.shape) == tuple(exp_vc.shape) and torch.equal(vc.cpu().double(), exp_vc):
                return {"ok": worst <= tol_ulps, "err_ulps": worst}
            worst = max(worst, _ulp_err(vc, exp_vc, case.serving.v, eps))
            return {"ok": False, "err_ulps": worst, "detail": "value cache not bit-exact"}
        codes = max(fp8_code_distance(kc, exp_kc), fp8_code_distance(vc, exp_vc))
        return {
            "ok": worst <= tol_ulps and codes <= FP8_TOL_CODES,
            "err_ulps": worst,
            "err_fp8_codes": codes,
        }
    exp = case.expected(mode)
    inputs = (case.grad_q, case.grad_k) if mode == "backward" else (case.q, case.k)
    if len(out) != 2:
        return {"ok": False, "err_ulps": math.inf}
    worst = 0.0
    for o, e, x in zip(out, exp, inputs, strict=True):
        worst = max(worst, _ulp_err(o, e, x, eps))
    return {"ok": worst <= tol_ulps, "err_ulps": worst}


def _expected_caches(case: Case, fp8: bool) -> tuple[Tensor, Tensor]:
    """``kv_cache_write`` into zeroed caches: float64 caches of the float64 rotated k (and v), or fp8
    caches of the reference k rounded to q's dtype (cached on the case)."""
    key = "cache-fp8" if fp8 else "cache"
    if key not in case._expected:
        s = case.serving
        exp_k = case.expected("inplace")[1]
        slots = s.slot_mapping.cpu()
        if fp8:
            kc, vc = (t.cpu() for t in case.new_caches(True))
            k, v = exp_k.to(case.dtype), s.v.cpu()
            scales = {"k_scale": s.k_scale.cpu(), "v_scale": s.v_scale.cpu()}
        else:
            kc, vc = (t.cpu().double() for t in case.new_caches(False))
            k, v = exp_k, s.v.cpu().double()
            scales = {}
        case._expected[key] = reference.kv_cache_write(k, v, kc, vc, slots, **scales)
    return case._expected[key]  # type: ignore[return-value]


def fp8_code_distance(a: Tensor, b: Tensor) -> float:
    """Max distance between two fp8 tensors in representable values (codes); inf on a shape mismatch or
    where one is NaN and the other not. Sign-magnitude codes, -0 == +0."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return math.inf
    if not a.numel():
        return 0.0
    a, b = a.cpu(), b.cpu()
    if not torch.equal(a.float().isnan(), b.float().isnan()):
        return math.inf

    def ordinal(x: Tensor) -> Tensor:
        bits = x.view(torch.uint8).to(torch.int32)
        mag = bits & 0x7F
        return torch.where(bits >= 0x80, -mag, mag)

    return float((ordinal(a) - ordinal(b)).abs().max())


def _expected_qknorm(case: Case) -> Tensor:
    if "qknorm" not in case._expected:
        s = case.serving
        qkv = case.packed_qkv().cpu()
        p = case.preset
        case._expected["qknorm"] = (
            reference.qk_norm_rotary(
                qkv.flatten(1),
                p.q_heads,
                p.kv_heads,
                p.kv_heads,
                s.q_weight.cpu(),
                s.k_weight.cpu(),
                case.positions.cpu(),
                case.cos_sin.cpu(),
                eps=s.eps,
                interleaved=case.interleaved,
            ).view(qkv.shape),
        )
    return case._expected["qknorm"][0]


def _check_qknorm(case: Case, out: tuple[Tensor, ...], tol_ulps: float) -> dict[str, Any]:
    exp = _expected_qknorm(case)  # [T, Hq + 2 Hkv, D], the dtype
    if len(out) != 1 or out[0].numel() != exp.numel():
        return {"ok": False, "err_ulps": math.inf}
    got = out[0].detach().cpu().reshape(exp.shape)
    p, eps = case.preset, torch.finfo(case.dtype).eps
    tol = min(tol_ulps, QKNORM_TOL_ULPS)
    (oq, ok, ov), (eq, ek, ev) = (split_qkv(x, p.q_heads, p.kv_heads) for x in (got, exp))
    worst = max(_ulp_err(oq, eq, eq, eps), _ulp_err(ok, ek, ek, eps))
    if not torch.equal(ov, ev):
        worst = max(worst, _ulp_err(ov, ev, ev, eps))
        return {"ok": False, "err_ulps": worst, "detail": "v heads changed"}
    return {"ok": worst <= tol, "err_ulps": worst}


def _expected_mla_cache(case: Case, fp8: bool) -> Tensor:
    """The latent cache ``[num_slots, L + R]`` with ``cat(kv_c, k_pe_ref)`` at the slots, zeros elsewhere:
    float64 of the float64 rotated k_pe; fp8 (as its bytes, uint8) of ``quantize_fp8(kv_c)``, the k_pe
    columns left zero (:func:`_check_mla` fills them). Cached on the case."""
    key = "mla-fp8" if fp8 else "mla"
    if key not in case._expected:
        s = case.mla
        exp_k = case.expected("inplace")[1][:, 0]  # [T, R] float64
        kv_c, slots = s.kv_c.cpu(), s.slot_mapping.cpu()
        width = kv_c.shape[1] + case.rotary_dim
        if fp8:
            cache = torch.zeros(s.num_blocks * MLA_BLOCK_SIZE, width, dtype=torch.uint8)
            rows = reference.quantize_fp8(kv_c, s.kv_scale.cpu(), FP8_CACHE_DTYPE)
            cache[slots, : kv_c.shape[1]] = rows.view(torch.uint8)
        else:
            cache = torch.zeros(s.num_blocks * MLA_BLOCK_SIZE, width, dtype=torch.float64)
            cache[slots] = torch.cat([kv_c.double(), exp_k], -1)
        case._expected[key] = (cache,)
    return case._expected[key][0]


def _check_mla(case: Case, fp8: bool, out: tuple[Tensor, ...], tol_ulps: float) -> dict[str, Any]:
    fail: dict[str, Any] = {"ok": False, "err_ulps": math.inf}
    exp_q, exp_k = case.expected("inplace")  # the rope parts [T, H, R], [T, 1, R]
    if len(out) != 3 or out[1].numel() != exp_k.numel():
        return fail
    q, k_pe, cache = (t.detach().cpu() for t in out)
    m, eps = case.mla, torch.finfo(case.dtype).eps
    n, latent = m.q_nope.shape[-1], m.kv_c.shape[-1]
    k_pe = k_pe.reshape(exp_k.shape)
    exp_cache = _expected_mla_cache(case, fp8)
    want_dtype = FP8_CACHE_DTYPE if fp8 else case.dtype
    if tuple(q.shape) != (*exp_q.shape[:2], n + exp_q.shape[-1]) or cache.dtype != want_dtype:
        return fail
    if cache.numel() != exp_cache.numel() or cache.shape[-1] != exp_cache.shape[-1]:
        return fail
    cache = cache.reshape(exp_cache.shape)
    worst = max(_ulp_err(q[..., n:], exp_q, case.q, eps), _ulp_err(k_pe, exp_k, case.k, eps))
    info: dict[str, Any] = {"err_ulps": worst}
    if fp8:
        own = reference.quantize_fp8(k_pe[:, 0].to(case.dtype), m.kv_scale.cpu(), FP8_CACHE_DTYPE)
        exp = exp_cache.clone()
        exp[m.slot_mapping.cpu(), latent:] = own.view(torch.uint8)
        info["err_fp8_codes"] = codes = fp8_code_distance(cache, exp.view(FP8_CACHE_DTYPE))
        info["ok"] = worst <= tol_ulps and codes <= FP8_TOL_CODES
    else:
        worst = max(worst, _ulp_err(cache[:, latent:], exp_cache[:, latent:], case.k, eps))
        info.update(ok=worst <= tol_ulps, err_ulps=worst)
        if not torch.equal(cache[:, :latent].double(), exp_cache[:, :latent]):
            err = _ulp_err(cache[:, :latent], exp_cache[:, :latent], m.kv_c, eps)
            info.update(ok=False, err_ulps=max(worst, err), detail="kv_c not bit-exact in the cache")
    if not torch.equal(q[..., :n], m.q_nope.cpu()):
        info.update(ok=False, detail="q's nope part changed")
    return info


def _check_rerotate(case: Case, fp8: bool, out: tuple[Tensor, ...], tol_ulps: float) -> dict[str, Any]:
    exp = expected_cache(case, fp8)  # [num_slots, Hk, D]: float64, or fp8
    want_dtype = FP8_CACHE_DTYPE if fp8 else case.dtype
    if len(out) != 1 or out[0].dtype != want_dtype or out[0].numel() != exp.numel():
        return {"ok": False, "err_ulps": math.inf}
    got = out[0].detach().cpu().reshape(exp.shape)
    s = case.rerotate
    # what the op must not touch: the rows not at the slots, the pass-through features of the rows at them
    untouched = torch.ones(exp.shape[:-1], dtype=torch.bool)
    untouched[s.slot_mapping.cpu()] = False
    r = case.rotary_dim
    if fp8:
        fe = torch.finfo(FP8_CACHE_DTYPE).eps
        err = _ulp_err(got.float() * float(s.k_scale), exp.float() * float(s.k_scale), case.k, fe)
        codes = fp8_code_distance(got, exp)
        info: dict[str, Any] = {"ok": codes <= FP8_TOL_CODES, "err_ulps": err, "err_fp8_codes": codes}
        got_b, exp_b = got.view(torch.uint8), exp.view(torch.uint8)
    else:
        err = _ulp_err(got, exp, case.k, torch.finfo(case.dtype).eps)
        info = {"ok": err <= tol_ulps, "err_ulps": err}
        got_b, exp_b = got.double(), exp
    if not (torch.equal(got_b[untouched], exp_b[untouched]) and torch.equal(got_b[..., r:], exp_b[..., r:])):
        info.update(ok=False, detail="rows or features not rotated changed")
    return info

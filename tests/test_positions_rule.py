"""The positions rule (README, "Positions"; rope_ext/positions.py) against every layout and op.

For each layout the intended positions are one per token (random, over the token dims); every shape a
caller could plausibly pass for them (full rank, leading 1s dropped, token dims only with or without a
trailing 1, the last token dim alone; MRoPE with a leading 3) is tried with sizes that coincide (T == H,
B == S == H), so a positions dim aligned with the wrong dim of x cannot fail a size check by luck. Each
call must give the answer of the unambiguous full-rank call, bit for bit, or raise ValueError, and a
rejected call writes nothing. The shapes the README documents must be accepted. (A full-rank tensor is
taken as it is: one that puts the tokens on the heads' dim, such as ``[1, T]`` for ``[T, H, D]``, says
per head.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

import rope_ext
from rope_ext import reference
from rope_ext.positions import positions_shape

D = 16
N_POS = 64
CS = rope_ext.RopeCache(D, max_positions=N_POS).cos_sin
# name: (sizes of x.shape[:-1], which of them are token dims)
LAYOUTS = {
    "THD": ((4, 4), (True, False)),
    "BSHD": ((4, 4, 4), (True, True, False)),
    "BSHD-B1": ((1, 4, 4), (True, True, False)),
    "BHSD": ((4, 4, 4), (True, False, True)),
    "SBHD": ((4, 4, 4), (True, True, False)),
}
# Shapes the README's table documents, per layout (with T = S = B = 4).
DOCUMENTED = {
    "THD": [(4, 1)],
    "BSHD": [(4, 4, 1)],
    "BSHD-B1": [(1, 4, 1), (4, 1)],
    "BHSD": [(4, 1, 4)],
    "SBHD": [(4, 4, 1)],
}


def _candidates(full: torch.Tensor, token: tuple[bool, ...]) -> dict[str, torch.Tensor]:
    """Every shape a caller could pass for the positions ``full`` (full rank, 1 at the heads)."""
    out = {"full": full}
    lead = 0
    while lead < full.dim() and full.shape[lead] == 1:
        lead += 1
        out[f"drop {lead} leading"] = full.reshape(full.shape[lead:])
    tok = full.reshape([s for s, t in zip(full.shape, token, strict=True) if t])
    out["tokens only"] = tok
    out["tokens only, trailing 1"] = tok[..., None]
    if tok.dim() == 2:
        out["last token dim only"] = tok[0]
    # A full-rank tensor of another shape states other positions (per head), not these.
    return {n: c for n, c in out.items() if c.dim() != full.dim() or c.shape == full.shape}


def _rotary(x, pos, **kw):
    return rope_ext.apply_rotary(x, pos, CS, **kw)


def _rotary_qk(x, pos, **kw):
    return rope_ext.apply_rotary_qk(x, x.flip(-1), pos, CS, **kw)


def _rotary_qk_inplace(x, pos, **kw):
    q, k = x.clone(), x.flip(-1)
    rope_ext.apply_rotary_qk_(q, k, pos, CS, **kw)
    return q, k


def _bare_rotary(x, pos, **kw):
    sec = kw.get("mrope_section")
    return torch.ops.rope_ext.rotary(x, pos, CS, False, False, 0, sec, False)


GENERAL_OPS = {
    "apply_rotary": _rotary,
    "apply_rotary_qk": _rotary_qk,
    "apply_rotary_qk_": _rotary_qk_inplace,
    "rope_ext::rotary": _bare_rotary,
}


def _outcome(fn, x, pos, **kw):
    before = x.clone()
    try:
        out = fn(x, pos, **kw)
    except ValueError:
        assert torch.equal(x, before), "a rejected call wrote its input"
        return None
    return out if isinstance(out, tuple) else (out,)


def _intended(sizes, token, gen, mrope: bool) -> torch.Tensor:
    shape = [s if t else 1 for s, t in zip(sizes, token, strict=True)]
    if mrope:
        shape = [3, *shape]
    return torch.randint(0, N_POS, shape, generator=gen)


@pytest.mark.parametrize("mrope", [False, True], ids=["plain", "mrope"])
@pytest.mark.parametrize("op", list(GENERAL_OPS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_general_ops_right_or_error(layout, op, mrope):
    sizes, token = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(hash((layout, op, mrope)) % 2**31)
    x = torch.randn(*sizes, D, generator=gen)
    kw = {"mrope_section": [2, 3, 3]} if mrope else {}
    full = _intended(sizes, token, gen, mrope)
    fn = GENERAL_OPS[op]
    want = _outcome(fn, x, full, **kw)
    assert want is not None
    if op == "apply_rotary":
        ref = reference.rotary_hadamard(x.double(), full, CS, **kw).float()
        torch.testing.assert_close(want[0], ref, rtol=1e-5, atol=1e-5)
    accepted = set()
    sections = full if mrope else full[None]
    for name, cand in _candidates(sections[0], token).items():
        pos = torch.stack([c for c in (cand, *[_candidates(s, token)[name] for s in sections[1:]])])
        pos = pos if mrope else pos[0]
        got = _outcome(fn, x, pos, **kw)
        if got is None:
            continue
        accepted.add(tuple(pos.shape[1:] if mrope else pos.shape))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"{layout} {op}: positions {name} {list(pos.shape)} silently wrong"
    for shape in DOCUMENTED[layout]:
        assert shape in accepted or shape == tuple(full.shape[-len(shape) :]), (layout, shape, accepted)


def _token_major_ops():
    T, Hq, Hk = 4, 4, 2
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(T, Hq, D, generator=gen)
    k = torch.randn(T, Hk, D, generator=gen)
    v = torch.randn(T, Hk, D, generator=gen)
    wq, wk = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5

    def cache(pos):
        qq, kk = q.clone(), k.clone()
        kc, vc = torch.zeros(2, 4, Hk, D), torch.zeros(2, 4, Hk, D)
        rope_ext.apply_rotary_qk_and_cache_(qq, kk, v, pos, CS, kc, vc, torch.tensor([5, 0, 7, 2]))
        return qq, kk, kc, vc

    def norm_(pos):
        qq, kk = q.clone(), k.clone()
        torch.ops.rope_ext.qk_norm_rotary_(qq, kk, wq, wk, pos, CS)
        return qq, kk

    def norm(pos):
        return rope_ext.apply_qk_norm_rotary(q, k, wq, wk, pos, CS)

    def packed(pos):
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        rope_ext.apply_qk_norm_rotary_(qkv, Hq, Hk, Hk, wq, wk, pos, CS)
        return (qkv,)

    return T, {"cache": cache, "rope_ext::qk_norm_rotary_": norm_, "qk_norm": norm, "packed qk_norm_": packed}


@pytest.mark.parametrize("op", ["cache", "rope_ext::qk_norm_rotary_", "qk_norm", "packed qk_norm_"])
def test_token_major_ops_take_t_and_t1(op):
    T, ops = _token_major_ops()
    fn = ops[op]
    pos = torch.randint(0, N_POS, (T,), generator=torch.Generator().manual_seed(3))
    want = fn(pos)
    got = fn(pos[:, None])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for bad in (pos[None], pos[:, None].expand(T, 2), pos[:1], pos.view(2, 2)):
        with pytest.raises(ValueError, match="positions"):
            fn(bad)


def test_token_major_mrope_takes_3t_and_3t1():
    T, Hq, Hk = 4, 4, 2
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(T, Hq, D, generator=gen), torch.randn(T, Hk, D, generator=gen)
    wq, wk = torch.ones(D), torch.ones(D)
    pos = torch.randint(0, N_POS, (3, T), generator=gen)
    a = rope_ext.apply_qk_norm_rotary(q, k, wq, wk, pos, CS, mrope_section=[2, 3, 3])
    b = rope_ext.apply_qk_norm_rotary(q, k, wq, wk, pos[..., None], CS, mrope_section=[2, 3, 3])
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_per_token_positions_never_per_head():
    """The example of issue: [T] with T == H rotated head h by position h."""
    x = torch.randn(4, 4, D)
    with pytest.raises(ValueError, match=r"positions\[\.\.\., None\]"):
        rope_ext.apply_rotary(x, torch.arange(4), CS)


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
def test_rule_matches_kernels_and_fake(rank):
    """positions_shape (fake kernels, references) decides as the C++ checks do, for every small shape."""
    batch = (2, 3, 2, 3)[:rank]
    x = torch.zeros(*batch, 4)
    cs = rope_ext.RopeCache(4, max_positions=8).cos_sin
    shapes = {s for n in range(rank + 2) for s in itertools.product((1, 2, 3), repeat=n)}
    for shape in sorted(shapes):
        pos = torch.zeros(shape, dtype=torch.long)
        try:
            positions_shape(shape, batch)
            python_ok = True
        except ValueError:
            python_ok = False
        try:
            torch.ops.rope_ext.rotary(x, pos, cs)
            kernel_ok = True
        except ValueError:
            kernel_ok = False
        assert python_ok == kernel_ok, (shape, batch)
        with torch._subclasses.FakeTensorMode() as mode:
            fx, fpos, fcs = (mode.from_tensor(t) for t in (x, pos, cs))
            try:
                torch.ops.rope_ext.rotary(fx, fpos, fcs)
                fake_ok = True
            except (ValueError, RuntimeError):
                fake_ok = False
        assert fake_ok == kernel_ok, (shape, batch)

"""The checks ``patch_diffusers`` runs and the stand-ins it installs, function by function: which call forms
the probes find, the stand-in against the original function on every form of diffusers' ``apply_rotary_emb``
(dtypes, gradients, and where it leaves the call to the original) and on every form the probes found of eight
model-local functions, a model refused with ``TypeError`` and nothing changed, and the swaps shared by two
models (patched on the meta device: patching needs no weights)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers  # noqa: E402
from diffusers.models import embeddings  # noqa: E402
from diffusers.models.transformers import transformer_wan  # noqa: E402

from rope_ext.compat import patch_diffusers, unpatch_diffusers  # noqa: E402
from rope_ext.compat.diffusers import patch as dpatch  # noqa: E402
from rope_ext.compat.diffusers import probes  # noqa: E402
from rope_ext.compat.diffusers.probes import _CheckFailed, _function_spec  # noqa: E402
from rope_ext.compat.diffusers.rotation import _Form, _make_freqs, _positions_shape  # noqa: E402


def _snapshot() -> dict:
    """Every function and class attribute of diffusers' loaded modules, by identity."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("diffusers.") and module is not None:
            for key, value in vars(module).items():
                out[(name, key)] = value
                if isinstance(value, type) and value.__module__ == name:
                    for attr, member in vars(value).items():
                        out[(name, key, attr)] = member
    return out


def _meta(name: str, **config) -> torch.nn.Module:
    with torch.device("meta"):
        return getattr(diffusers, name)(**config)


# ---------------------------------------------------------------------------------------------
# What the probes find


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_hf(q, k, cos, sin):
    """transformers' form on [B, H, S, D] with cos [B, S, D]: half-split pairs, promoted dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary_partial(x, freqs):
    """Rotates the first cos.shape[-1] features of [B, S, H, D] (MiniMax's form), x's dtype."""
    cos, sin = freqs
    w = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    r = x[..., :w] * cos + _rotate_half(x[..., :w]) * sin
    return torch.cat((r, x[..., w:]), dim=-1)


def apply_rotary_not_a_rotation(x, freqs):
    cos, sin = freqs
    return x * cos[:, None] + x * sin[:, None]


def apply_rotary_bf16(x, freqs):
    """A rotation whose output is always bfloat16 (Kandinsky 5's processor-local function does this)."""
    return embeddings.apply_rotary_emb(x, freqs, sequence_dim=1).to(torch.bfloat16)


def test_probe_finds_the_call_forms():
    spec = _function_spec(apply_rotary_hf, "hf")
    assert spec.n_x == 2 and spec.modes == ()
    (key, rot), *_ = spec.forms.items()
    assert key == ((), "args", 4, (False,))  # cos [S, D]: [S, 1, D] against [B, S, H, D]
    assert rot == _Form("half", "cat", (1,), keep_dtype=False, float64=True)
    assert spec.forms[((), "args", 4, (False, False))].dims == (0, 2)  # [B, S, D]: [B, 1, S, D]

    spec = _function_spec(apply_rotary_partial, "partial")
    assert {(k[1], k[2]) for k in spec.forms} == {("tuple", 4)}
    assert all(r.partial and r.keep_dtype and r.pairing == "half" for r in spec.forms.values())

    spec = _function_spec(embeddings.apply_rotary_emb, "apply_rotary_emb")
    assert spec.modes == ("use_real", "use_real_unbind_dim", "sequence_dim") and spec.positional == 3
    found = {
        (k[0], k[1], len(k[3])): r[:3] for k, r in spec.forms.items() if k[2] == 4
    }  # pairing, layout, dims
    assert found[((True, -1, 1), "tuple", 1)] == ("interleaved", "repeat", (1,))  # FLUX, HunyuanVideo: [S, D]
    assert found[((True, -1, 2), "tuple", 1)] == ("interleaved", "repeat", (2,))  # CogVideoX
    assert found[((True, -2, 2), "tuple", 1)] == ("half", "cat", (2,))  # Stable Audio, Cosmos
    assert found[((False, -1, 2), "complex", 2)] == ("interleaved", "", (0, 1))  # Lumina: [B, S, D / 2]
    assert not any(r.float64 for r in spec.forms.values())  # it computes float64 x in float32

    for fn, why in (
        (apply_rotary_not_a_rotation, "gives outputs that no rotation rope_ext implements matches"),
        (apply_rotary_bf16, "returns torch.bfloat16 for float32 inputs"),
        (embeddings.apply_rotary_emb_allegro, "raises on every probe"),
        (lambda x: x, "takes 1 required arguments"),
    ):
        with pytest.raises(_CheckFailed, match=why):
            _function_spec(fn, "f")


# ---------------------------------------------------------------------------------------------
# The stand-in against the original


class _Counter:
    """Counts the stand-ins' calls by whether rope_ext's op ran."""

    def __init__(self, monkeypatch):
        self.fast = self.fallback = 0
        fast = dpatch._fast

        def counted(spec, args, kwargs):
            out = fast(spec, args, kwargs)
            if out is None:
                self.fallback += 1
            else:
                self.fast += 1
            return out

        monkeypatch.setattr(dpatch, "_fast", counted)


def _stand_in(fn):
    return dpatch._make_patched(fn, dpatch._spec(fn, fn.__name__))


def _freqs(seq: int, dim: int, real: bool, repeat: bool, dtype=torch.float32):
    pos = torch.arange(seq, dtype=torch.float32) * 1.7
    out = embeddings.get_1d_rotary_pos_embed(dim, pos, use_real=real, repeat_interleave_real=repeat)
    return tuple(t.to(dtype) for t in out) if real else out[None]  # complex: Lumina's [1, S, D / 2]


CASES = [
    # (kwargs, layout of x, real cos / sin (repeat_interleave or cat) or complex)
    (dict(sequence_dim=1), "bshd", "repeat"),
    (dict(), "bhsd", "repeat"),
    (dict(use_real_unbind_dim=-2), "bhsd", "cat"),
    (dict(use_real_unbind_dim=-2, sequence_dim=1), "bshd", "cat"),
    (dict(use_real=False), "bshd", "complex"),
]


@pytest.mark.parametrize("kwargs,layout,freqs", CASES, ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_stand_in_equals_apply_rotary_emb(monkeypatch, kwargs, layout, freqs, dtype):
    counter = _Counter(monkeypatch)
    patched = _stand_in(embeddings.apply_rotary_emb)
    B, S, H, D = 2, 7, 3, 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn((B, S, H, D) if layout == "bshd" else (B, H, S, D), generator=g).to(dtype)
    f = _freqs(S, D, freqs != "complex", freqs == "repeat")
    want = embeddings.apply_rotary_emb(x, f, **kwargs)
    got = patched(x, f, **kwargs)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    # float64 x: the original rotates in float32, so the stand-in leaves the call to it
    assert (counter.fast, counter.fallback) == ((0, 1) if dtype == torch.float64 else (1, 0))
    err = (got.double() - want.double()).abs().max().item()
    tol = {torch.float32: 1e-6, torch.float64: 0.0}.get(dtype, 2 * torch.finfo(dtype).eps)
    assert err <= tol * x.abs().max().item()
    # gradients to x (float32 for float64): the op's backward against autograd through the original
    if dtype == torch.float64:
        x, tol = x.float(), 1e-6
    xg = x.detach().clone().requires_grad_()
    w = torch.randn(want.shape, generator=g).to(xg.dtype)
    (embeddings.apply_rotary_emb(xg, f, **kwargs) * w).sum().backward()
    want_grad, xg.grad = xg.grad, None
    (patched(xg, f, **kwargs) * w).sum().backward()
    assert (xg.grad.double() - want_grad.double()).abs().max() <= 4 * tol * w.abs().max()


FUNCTIONS = [
    "transformers.transformer_ltx.apply_rotary_emb",  # (cos, sin) over all heads' features, [B, S, H * D]
    "transformers.transformer_qwenimage.apply_rotary_emb_qwen",  # complex
    "transformers.transformer_helios.apply_rotary_emb_transposed",  # cat((cos, sin))
    "transformers.transformer_hidream_image.apply_rope",  # (q, k, 2x2 matrices)
    "transformers.transformer_prx.apply_rope",  # 2x2 matrices
    "transformers.transformer_ltx2.apply_split_rotary_emb",  # half-width pair values
    "transformers.transformer_minimax_h3._apply_rotary_emb",  # cos, sin; partial rotary
    "transformers.transformer_joyimage._apply_rotary_emb",  # (q, k, (cos, sin))
]


@pytest.mark.parametrize("path", FUNCTIONS, ids=[p.rsplit(".", 2)[1] for p in FUNCTIONS])
def test_stand_in_equals_the_function_in_every_form_found(monkeypatch, path):
    """Each call form the probes found, called with cos / sin of real angles: the stand-in takes the op's
    path and gives the function's result."""
    module, name = path.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"diffusers.models.{module}"), name)
    spec = dpatch._spec(fn, name)
    patched = dpatch._make_patched(fn, spec)
    counter = _Counter(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for i, ((values, form, rank, pattern), rot) in enumerate(spec.forms.items()):
        lead = next(ld for ld in probes._LEADS if tuple(d == 1 for d in ld) == pattern)
        x_shape = next(
            s
            for s in probes._X_SHAPES
            if len(s) == rank and _positions_shape(lead, rank - 1, rot.dims, (s[:-1],)) is not None
        )
        wide = 4 if rot.partial else 0
        xs = [torch.randn(*x_shape[:-1], x_shape[-1] + wide, generator=g) for _ in range(spec.n_x)]
        angles = torch.rand(*lead, x_shape[-1] // 2, generator=g) * 6.0
        freqs = _make_freqs(form, rot.layout, angles.cos(), angles.sin())
        kwargs = {m: v for m, v, d in zip(spec.modes, values, spec.defaults, strict=True) if v is not d}
        got, want = patched(*xs, *freqs, **kwargs), fn(*xs, *freqs, **kwargs)
        assert counter.fast == i + 1 and counter.fallback == 0, (values, form, rank, pattern)
        for a, b in zip(got if spec.n_x == 2 else (got,), want if spec.n_x == 2 else (want,), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert (a - b).abs().max() <= 1e-6 * max(x.abs().max() for x in xs)


def test_stand_in_leaves_what_the_op_cannot_compute_to_the_original(monkeypatch):
    counter = _Counter(monkeypatch)
    patched = _stand_in(embeddings.apply_rotary_emb)
    x = torch.randn(2, 5, 3, 16)
    cos, sin = _freqs(5, 16, True, True)

    def same(*args, **kwargs):
        return torch.equal(patched(*args, **kwargs), embeddings.apply_rotary_emb(*args, **kwargs))

    # cos requiring grad: the original, which gives cos its gradient
    c = cos.clone().requires_grad_()
    out = patched(x, (c, sin), sequence_dim=1)
    out.sum().backward()
    assert c.grad is not None and counter.fallback == 1
    # pair values not laid out as the probes found (eagerly checked), a rank the probes did not cover,
    # sequence_dim=0 (the original raises), an argument the function does not take
    assert same(x, (cos + torch.rand_like(cos), sin), sequence_dim=1)
    with pytest.raises(RuntimeError):
        patched(x[None], (cos, sin), sequence_dim=1)
    with pytest.raises(ValueError, match="sequence_dim"):
        patched(x, (cos, sin), sequence_dim=0)
    with pytest.raises(TypeError):
        patched(x, (cos, sin), sequence_dim=1, extra=1)
    assert (counter.fast, counter.fallback) == (0, 5)
    # modes passed by position: the op
    got, want = patched(x, (cos, sin), True, -1, 1), embeddings.apply_rotary_emb(x, (cos, sin), True, -1, 1)
    assert counter.fast == 1 and (got - want).abs().max() <= 1e-6 * x.abs().max()


# ---------------------------------------------------------------------------------------------
# Refused models, shared swaps


class _Attention(torch.nn.Module):
    def forward(self, x, freqs):
        return apply_rotary_not_a_rotation(apply_rotary_partial(x, freqs), freqs)


class _Refused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attention()


@pytest.mark.parametrize(
    "build,why",
    [
        (_Refused, "apply_rotary_not_a_rotation computes none of the rotations rope_ext implements"),
        (lambda: _meta("Kandinsky5Transformer3DModel", num_text_blocks=1, num_visual_blocks=1),
         "Kandinsky5AttnProcessor.__call__.apply_rotary computes none .* returns torch.bfloat16"),
        (lambda: _meta("Cosmos3OmniTransformer", num_hidden_layers=1), "call no apply_\\*rotary\\*"),
    ],
    ids=["synthetic", "Kandinsky5", "Cosmos3"],
)  # fmt: skip
def test_refused_model_raises_and_patches_nothing(build, why):
    model = build()
    before, originals, this = _snapshot(), dict(dpatch._ORIGINALS), dict(vars(sys.modules[__name__]))
    with pytest.raises(TypeError, match=f"patch_diffusers supports .*: .*{why}"):
        patch_diffusers(model)
    after = _snapshot()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert dpatch._ORIGINALS == originals and dpatch._ATTR not in model.__dict__
    # the synthetic model's good function stays too: nothing is swapped before every check has passed
    assert all(vars(sys.modules[__name__])[k] is v for k, v in this.items())


def test_two_models_share_the_swaps():
    """Wan's processor-local rotation: the method is rewritten once for both models and returns when the
    last one is unpatched; FLUX's module function likewise. Patching twice changes nothing."""
    call = transformer_wan.WanAttnProcessor.__call__
    flux_fn = sys.modules["diffusers.models.transformers.transformer_flux"].apply_rotary_emb
    a, b = _meta("WanTransformer3DModel", num_layers=1), _meta("WanTransformer3DModel", num_layers=1)
    flux = _meta("FluxTransformer2DModel", num_layers=1, num_single_layers=1)
    patch_diffusers(a)
    rewritten = transformer_wan.WanAttnProcessor.__call__
    assert rewritten is not call and rewritten._rope_ext_original is call
    stand_ins = [k for k in vars(transformer_wan) if k.startswith("_rope_ext_")]
    assert stand_ins == ["_rope_ext_WanAttnProcessor___call___apply_rotary_emb"]
    # the rewritten method calls the stand-in where the original defined its function
    nested = [c for c in rewritten.__code__.co_consts if isinstance(c, types.CodeType)]
    assert [c.co_name for c in nested] == ["apply_rotary_emb"] and stand_ins[0] in nested[0].co_names
    patch_diffusers(b)
    patch_diffusers(b)
    patch_diffusers(flux)
    assert transformer_wan.WanAttnProcessor.__call__ is rewritten
    assert sys.modules["diffusers.models.transformers.transformer_flux"].apply_rotary_emb._rope_ext
    unpatch_diffusers(a)
    assert transformer_wan.WanAttnProcessor.__call__ is rewritten
    unpatch_diffusers(b)
    assert transformer_wan.WanAttnProcessor.__call__ is call
    assert not [k for k in vars(transformer_wan) if k.startswith("_rope_ext_")]
    unpatch_diffusers(flux)
    assert sys.modules["diffusers.models.transformers.transformer_flux"].apply_rotary_emb is flux_fn
    assert not dpatch._ORIGINALS and not dpatch._USERS

"""QK RMSNorm + rotary (rope_ext.apply_qk_norm_rotary_ / apply_qk_norm_rotary) against the float64 reference.

Backends: the CPU kernel through the public API, the CUDA kernel body run on the CPU through the test-only op
``_cuda_emulated_norm`` (vector path, scalar path, grids of 1 and 132 SMs) and, with a GPU, the CUDA kernel.
The inputs, backends, reference and tolerance (its derivation in the module docstring) live in
``_serving_norm_helpers.py``.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import make_cos_sin, requires_cuda
from _serving_norm_helpers import (
    BACKENDS,
    GQA,
    HAS_NORM_EMULATION,
    HOST_BACKENDS,
    N_POS,
    NO_V,
    OPS,
    backend_param,
    check,
    expected,
    make_qkv,
    make_weights,
    run,
    split,
    vectorizable,
)
from _strategies import bits, property_settings
from hypothesis import given
from hypothesis import strategies as st
from torch.library import opcheck

import rope_ext
import rope_ext.compat.vllm
from rope_ext import reference

# ---------------------------------------------------------------------------------------------------------
# 1. Against the reference: every backend, dtype, pairing, head_dim, layout and option.

# (heads, rotary ("full", "half" or "offset": D/2 features from D/4), weight_offset, weight dtype
# ("f32" or the activation's), eps, qkv layout): each value of each axis in several combinations.
VARIANTS = {
    "full-gqa": (GQA, "full", 0.0, "f32", 1e-6, "contiguous"),
    "half-gqa-gemma": (GQA, "half", 1.0, "act", 1e-5, "aligned"),
    "offset-nov-gemma": (NO_V, "offset", 1.0, "f32", 1e-6, "aligned"),
    "full-nov-gemma": (NO_V, "full", 1.0, "act", 1e-5, "odd"),
    "half-nov": (NO_V, "half", 0.0, "f32", 1e-6, "contiguous"),
    "offset-gqa": (GQA, "offset", 0.0, "act", 1e-5, "contiguous"),
}


HEAD_DIMS = [64, 128, 256, 80, 96, 192, 512, 40]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, interleaved, head_dim, variant):
    """Every host backend of BACKENDS on the same inputs (the emulated ones skipped without the op)."""
    _against_reference(dtype, interleaved, head_dim, variant, HOST_BACKENDS)


@requires_cuda
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_on_cuda(dtype, interleaved, head_dim, variant):
    """The same cases on the CUDA kernel (aligned and odd layouts: the vector and scalar paths)."""
    _against_reference(dtype, interleaved, head_dim, variant, {"cuda": BACKENDS["cuda"]})


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "mrope_interleaved,n_axes",
    [(False, 3), (True, 3), (False, 2), (True, 4), ("alternating", 3), (2, 4)],
    ids=[
        "mrope",
        "mrope-interleaved",
        "axes-2",
        "axes-4-interleaved",
        "mrope-alternating",
        "axes-4-alternating",
    ],
)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mrope_matches_reference(dtype, interleaved, head_dim, variant, mrope_interleaved, n_axes, backend):
    """Several position axes (MRoPE: positions [3, T]; 2 and 4 axes; not an argument of the emulated op):
    the CPU and CUDA kernels."""
    _against_reference(
        dtype,
        interleaved,
        head_dim,
        variant,
        {backend: BACKENDS[backend]},
        mrope_interleaved=mrope_interleaved,
        n_axes=n_axes,
    )


def _against_reference(dtype, interleaved, head_dim, variant, backends, mrope_interleaved=None, n_axes=3):
    """The VARIANTS case on each of ``backends``; ``n_axes`` position axes (MRoPE with 3: sections t, h, w
    of about a third of the pairs each) unless ``mrope_interleaved`` is None."""
    heads, rotary, weight_offset, w_kind, eps, layout = VARIANTS[variant]
    d = head_dim
    rotary_dim = d if rotary == "full" else d // 2
    rotary_offset = 2 * (d // 8) if rotary == "offset" else 0
    seed = 10 * head_dim + list(VARIANTS).index(variant)
    tokens = 7
    big0, qkv0 = make_qkv(tokens, heads, d, dtype, layout=layout, seed=seed)
    qw, kw = make_weights(d, torch.float32 if w_kind == "f32" else dtype, weight_offset, seed=seed + 1)
    pos_shape = (tokens,) if mrope_interleaved is None else (n_axes, tokens)
    pos = torch.randint(0, N_POS, pos_shape, generator=torch.Generator().manual_seed(seed))
    cs = make_cos_sin(N_POS, rotary_dim)
    opts = dict(eps=eps, interleaved=interleaved, weight_offset=weight_offset, rotary_offset=rotary_offset)
    if mrope_interleaved is not None:
        part = rotary_dim // (2 * n_axes)
        sections = [rotary_dim // 2 - (n_axes - 1) * part] + [part] * (n_axes - 1)
        opts |= dict(mrope_section=sections, mrope_interleaved=mrope_interleaved)
    ref, tol = expected(qkv0, heads, qw, kw, pos, cs, **opts)
    state = [t.clone() for t in (qw, kw, pos, cs)]
    outside = torch.ones_like(big0, dtype=torch.bool)
    outside.as_strided(qkv0.shape, qkv0.stride(), qkv0.storage_offset()).fill_(False)
    for backend, emulation in backends.items():
        if isinstance(emulation, tuple) and not HAS_NORM_EMULATION:
            continue
        big = big0.clone()
        qkv = big.as_strided(qkv0.shape, qkv0.stride(), qkv0.storage_offset())
        info = run(backend, qkv, heads, qw, kw, pos, cs, **opts)
        try:
            check(qkv, ref, tol, qkv0, heads)
        except AssertionError as e:
            raise AssertionError(f"{backend}: {e}") from None
        # Nothing else written: the rest of the wider tensor and the read-only inputs keep their bits.
        assert torch.equal(bits(big)[outside], bits(big0)[outside]), backend
        assert all(torch.equal(a, b) for a, b in zip((qw, kw, pos, cs), state, strict=True)), backend
        if info is not None:
            sms, scalar = emulation
            q, k, _ = split(qkv, *heads)
            items = tokens * (heads[0] + heads[1])
            # A group of lanes per (token, head): as many as the head has units (a power of two, at
            # most 32), so no lane of a warp idles; the grid covers the warps' items.
            v = 16 // q.element_size() if info[2] else 1
            rd = cs.shape[-1]
            units = (rd // 2) // ((max(v // 2, 1)) if interleaved else v) + (q.shape[-1] - rd) // v
            assert info[3] == min(32, 1 << (units - 1).bit_length()), backend
            warp_items = -(-items // (32 // info[3]))
            assert info[0] == min(-(-warp_items // info[1]), 16 * sms), backend
            assert info[2] == int(not scalar and vectorizable(q, k, cs, rotary_offset, interleaved)), backend


# ---------------------------------------------------------------------------------------------------------
# 2. Out of place equals in place; 7. decode (T=1) and T=0.


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("d,rotary_dim,rotary_offset,weight_offset", [(128, 128, 0, 0.0), (96, 48, 16, 1.0)])
def test_out_of_place_equals_in_place(dtype, interleaved, d, rotary_dim, rotary_offset, weight_offset):
    _, qkv = make_qkv(9, GQA, d, dtype, layout="aligned", seed=d)
    qw, kw = make_weights(d, dtype, weight_offset)
    pos = torch.randint(0, N_POS, (9,))
    cs = make_cos_sin(N_POS, rotary_dim)
    opts = dict(interleaved=interleaved, weight_offset=weight_offset, rotary_offset=rotary_offset, eps=1e-5)
    q, k, _ = split(qkv, *GQA)
    q0, k0 = q.clone(), k.clone()
    q2, k2 = rope_ext.apply_qk_norm_rotary(q, k, qw, kw, pos, cs, **opts)
    assert torch.equal(bits(q), bits(q0)) and torch.equal(bits(k), bits(k0)), "inputs changed"
    assert q2.shape == q.shape and k2.shape == k.shape and q2.dtype == k2.dtype == dtype
    rope_ext.apply_qk_norm_rotary_(qkv, *GQA, qw, kw, pos, cs, **opts)
    assert torch.equal(bits(q2), bits(q)) and torch.equal(bits(k2), bits(k))
    # The raw ops (positions [T, 1]) are what the wrappers call.
    tail = (1e-5, interleaved, weight_offset, rotary_offset, None, False)
    q3, k3 = OPS.qk_norm_rotary(q0, k0, qw, kw, pos[:, None], cs, *tail)
    OPS.qk_norm_rotary_(q0, k0, qw, kw, pos[:, None], cs, *tail)
    for a, b in ((q3, q2), (k3, k2), (q0, q2), (k0, k2)):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_and_empty(backend, dtype):
    heads, d = GQA, 128
    qw, kw = make_weights(d, torch.float32, 0.0)
    cs = make_cos_sin(4096, d)
    _, qkv = make_qkv(1, heads, d, dtype)
    pos = torch.tensor([4000])
    ref, tol = expected(qkv, heads, qw, kw, pos, cs)
    before = qkv.clone()
    run(backend, qkv, heads, qw, kw, pos, cs)
    check(qkv, ref, tol, before, heads)
    empty = torch.empty(0, sum(heads) * d, dtype=dtype)
    info = run(backend, empty, heads, qw, kw, torch.empty(0, dtype=torch.long), cs)
    assert info is None or info[0] == 0
    q, k, _ = split(empty, *heads)
    q2, k2 = rope_ext.apply_qk_norm_rotary(q, k, qw, kw, torch.empty(0, dtype=torch.int32), cs)
    assert q2.shape == q.shape and k2.shape == k.shape


@pytest.mark.parametrize("tokens", [2, 5, 6, 7, 13, 40])
def test_tokens_split_over_threads_keep_their_bits(tokens):
    """Llama-3-8B heads, bf16: from 8 tokens on, the CPU op splits the tokens over two threads while
    OpenMP's workers spin (its grain weighs the norm's work, ops_cpu.cpp). Each token must be normalised
    and rotated exactly once: the bits are those of one thread, and match the reference."""
    heads, d = (32, 8, 8), 128
    qw, kw = make_weights(d, torch.bfloat16, 0.0)
    cs = make_cos_sin(N_POS, d)
    _, src = make_qkv(tokens, heads, d, torch.bfloat16, seed=tokens)
    pos = torch.randint(0, N_POS, (tokens,), generator=torch.Generator().manual_seed(tokens))
    ref, tol = expected(src, heads, qw, kw, pos, cs)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            qkv = src.clone()
            run("cpu", qkv, heads, qw, kw, pos, cs)
            results.append(qkv)
    finally:
        torch.set_num_threads(threads)
    check(results[1], ref, tol, src, heads)
    assert torch.equal(bits(results[0]), bits(results[1]))


# ---------------------------------------------------------------------------------------------------------
# 3. Gradients.


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("rotary_dim,rotary_offset", [(8, 0), (4, 0), (4, 2)])
def test_gradcheck(interleaved, weight_offset, rotary_dim, rotary_offset):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    qw, kw = (w.requires_grad_() for w in make_weights(8, torch.float64, weight_offset))
    pos = torch.tensor([0, 5, 17])
    cs = make_cos_sin(20, rotary_dim, dtype=torch.float64)
    opts = dict(interleaved=interleaved, weight_offset=weight_offset, rotary_offset=rotary_offset, eps=1e-5)
    assert torch.autograd.gradcheck(
        lambda *a: rope_ext.apply_qk_norm_rotary(*a, pos, cs, **opts), (q, k, qw, kw)
    )


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_float32_gradients_match_unfused_reference(interleaved, weight_offset, rotary_dim):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(11, 4, 64, generator=g) * 3
    k = torch.randn(11, 2, 64, generator=g) * 3
    weights = make_weights(64, torch.float32, weight_offset)
    pos = torch.randint(0, N_POS, (11,), generator=g)
    cs = make_cos_sin(N_POS, rotary_dim)
    opts = dict(interleaved=interleaved, weight_offset=weight_offset, eps=1e-6)
    up = torch.randn(11, 4, 64, generator=g), torch.randn(11, 2, 64, generator=g)
    grads = []
    for fn, dtype in (
        (rope_ext.apply_qk_norm_rotary, torch.float32),
        (reference.qk_norm_rotary_unfused, None),
    ):
        leaves = [t.to(dtype or torch.float64).requires_grad_() for t in (q, k, *weights)]
        outs = fn(*leaves, pos, cs, **opts)
        loss = sum((o * u.to(o.dtype)).sum() for o, u in zip(outs, up, strict=True))
        grads.append(torch.autograd.grad(loss, leaves))
    for got, want in zip(*grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("wrt", ["qkv-and-weights", "weights"])
def test_gradient_through_in_place(wrt):
    """In place on a non-leaf qkv (``x * 1``), or on a plain qkv with trained weights."""
    heads, d = (4, 2, 2), 32
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, sum(heads) * d, generator=g)
    weights = make_weights(d, torch.float32, 1.0)
    pos = torch.randint(0, N_POS, (6,), generator=g)
    cs = make_cos_sin(N_POS, 16)
    opts = dict(interleaved=True, weight_offset=1.0, eps=1e-6)
    up = torch.randn(x.shape, generator=g)
    leaves = [t.clone().requires_grad_(i > 0 or wrt != "weights") for i, t in enumerate((x, *weights))]
    qkv = leaves[0] * 1
    rope_ext.apply_qk_norm_rotary_(qkv, *heads, *leaves[1:], pos, cs, **opts)
    wanted = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad((qkv * up).sum(), wanted)
    ref_leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    q, k, v = split(ref_leaves[0], *heads)
    qr, kr = reference.qk_norm_rotary_unfused(q, k, *ref_leaves[1:], pos, cs, **opts)
    out = torch.cat([qr.flatten(1), kr.flatten(1), v], dim=1)
    torch.testing.assert_close(qkv.detach().double(), out.detach(), rtol=1e-5, atol=1e-5)
    want = torch.autograd.grad((out * up.double()).sum(), [t for t in ref_leaves if t.requires_grad])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    x_leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable"):
        rope_ext.apply_qk_norm_rotary_(x_leaf, *heads, *leaves[1:], pos, cs)


# ---------------------------------------------------------------------------------------------------------
# 4. Rejected calls write nothing.


REJECTED = {  # name: (error, arguments that differ from a valid call on D=64; d: qkv's head_dim)
    "head_dim 514": (ValueError, dict(d=514, qw=torch.ones(514), kw=torch.ones(514), cs=(N_POS, 514))),
    "weight shape": (ValueError, dict(qw=torch.ones(66))),
    "2-d weight": (ValueError, dict(kw=torch.ones(1, 64))),
    "int weight": (TypeError, dict(kw=torch.ones(64, dtype=torch.int32))),
    "position >= P": (IndexError, dict(pos=torch.tensor([0, 1, 2, 3, N_POS]))),
    "position < 0": (IndexError, dict(pos=torch.tensor([0, -1, 2, 3, 4]))),
    "rotary_dim > D": (ValueError, dict(cs=(N_POS, 128))),
    "odd rotary_dim": (ValueError, dict(cs=torch.randn(N_POS, 7))),
    "float positions": (TypeError, dict(pos=torch.arange(5.0))),
    "positions [1, T]": (ValueError, dict(pos=torch.arange(5)[None])),
    "positions [T, 2]": (ValueError, dict(pos=torch.arange(10).view(5, 2))),
    "negative eps": (ValueError, dict(eps=-1.0)),
    "rotary_offset past D": (ValueError, dict(cs=(N_POS, 32), rotary_offset=34)),
    "width": (ValueError, dict(heads=(3, 2, 2))),
    "num_heads_q=0": (ValueError, dict(heads=(0, 2, 10))),
    "num_heads_k=0": (ValueError, dict(heads=(10, 0, 2))),
    "head counts that wrap": (ValueError, dict(heads=(2**63 - 1, 2**63 - 1, 4))),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_rejected_calls_leave_qkv_unchanged(name):
    error, over = REJECTED[name]
    a = dict(d=64, heads=GQA, qw=torch.ones(64), kw=torch.ones(64), pos=torch.arange(5), cs=(N_POS, 64))
    a |= over
    cs = make_cos_sin(*a["cs"]) if isinstance(a["cs"], tuple) else a["cs"]
    _, qkv = make_qkv(5, GQA, a["d"], torch.bfloat16, layout="aligned")
    before = qkv.clone()
    opts = {key: a[key] for key in ("eps", "rotary_offset") if key in a}
    with pytest.raises(error):
        rope_ext.apply_qk_norm_rotary_(qkv, *a["heads"], a["qw"], a["kw"], a["pos"], cs, **opts)
    assert torch.equal(bits(qkv), bits(before))
    if "heads" not in over:  # the out-of-place op rejects the same arguments
        q, k, _ = split(qkv, *GQA)
        with pytest.raises(error):
            rope_ext.apply_qk_norm_rotary(q, k, a["qw"], a["kw"], a["pos"], cs, **opts)
        assert torch.equal(bits(qkv), bits(before))


# ---------------------------------------------------------------------------------------------------------
# 5. opcheck and torch.compile.


def test_opcheck():
    heads, d = (4, 2, 2), 64
    qw, kw = make_weights(d, torch.float32, 0.0)
    pos = torch.randint(0, N_POS, (5, 1))
    for dtype, cs, tail in (
        (torch.float32, make_cos_sin(N_POS, d), (1e-6, False, 0.0, 0, None, False)),
        (torch.bfloat16, make_cos_sin(N_POS, 32), (1e-5, True, 1.0, 16, None, False)),
    ):
        _, qkv = make_qkv(5, heads, d, dtype, layout="aligned")
        q, k, _ = split(qkv, *heads)
        opcheck(OPS.qk_norm_rotary_.default, (q.clone(), k.clone(), qw, kw, pos, cs, *tail))
        opcheck(OPS.qk_norm_rotary_.default, (q, k, qw, kw, pos.int(), cs, *tail))  # views of one qkv
        grad = dtype == torch.float32  # the registered backward too
        args = (q.detach().requires_grad_(grad), k.clone().requires_grad_(grad), qw.requires_grad_(grad), kw)
        opcheck(OPS.qk_norm_rotary.default, (*args, pos, cs, *tail))


def test_compile_training_step_matches_eager():
    torch._dynamo.reset()
    cs = make_cos_sin(N_POS, 32)
    pos = torch.randint(0, N_POS, (8,))
    weights = make_weights(64, torch.float32, 1.0)

    def loss(q, k, qw, kw):
        qr, kr = rope_ext.apply_qk_norm_rotary(q, k, qw, kw, pos, cs, weight_offset=1.0, interleaved=True)
        return (qr[:, :2] * kr).sum(), qr

    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(8, 4, 64, generator=g), torch.randn(8, 2, 64, generator=g), *weights]
    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        inputs = [t.clone().requires_grad_() for t in leaves]
        value, qr = fn(*inputs)
        results.append((qr.detach(), *torch.autograd.grad(value, inputs)))
    assert torch.equal(results[0][0], results[1][0]), "forward: the same kernel runs"
    for a, b in zip(results[0][1:], results[1][1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())


def _serve(qkv, parts, qw, kw, pos, cs):
    """A packed qkv passed in, and one made inside, both normalised and rotated in place."""
    rope_ext.apply_qk_norm_rotary_(qkv, *GQA, qw, kw, pos, cs, eps=1e-5)
    made = torch.cat(parts, dim=-1)
    rope_ext.apply_qk_norm_rotary_(made, *NO_V, qw, kw, pos, cs, interleaved=True, weight_offset=1.0)
    return made


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_in_place_matches_eager(dynamic):
    torch._dynamo.reset()
    d = 64
    qw, kw = make_weights(d, torch.bfloat16, 0.0)
    cs = make_cos_sin(N_POS, 32)
    compiled = torch.compile(_serve, fullgraph=True, dynamic=dynamic)
    for tokens in (7, 12) if dynamic else (7,):
        _, qkv = make_qkv(tokens, GQA, d, torch.bfloat16, layout="aligned", seed=tokens)
        _, made = make_qkv(tokens, NO_V, d, torch.bfloat16, seed=tokens + 1)
        parts = (made[:, : 8 * d], made[:, 8 * d :])
        pos = torch.randint(0, N_POS, (tokens,))
        a, b = qkv.clone(), qkv.clone()
        want = _serve(a, parts, qw, kw, pos, cs)
        got = compiled(b, parts, qw, kw, pos, cs)
        assert torch.equal(bits(a), bits(b)) and torch.equal(bits(want), bits(got))
        ref, tol = expected(made, NO_V, qw, kw, pos, cs, interleaved=True, weight_offset=1.0)
        check(got, ref, tol, made, NO_V)


# ---------------------------------------------------------------------------------------------------------
# 6. Randomised: both kernels against the reference (the loaded profile's number of examples).


@st.composite
def norm_cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    heads = (draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.integers(0, 4)))
    d = 2 * draw(st.one_of(st.integers(1, 12), st.integers(1, 256)))
    rotary_dim = 2 * draw(st.integers(1, d // 2))
    rotary_offset = draw(st.integers(0, d - rotary_dim)) if draw(st.integers(0, 3)) == 0 else 0
    tokens = min(draw(st.integers(0, 24)), max(1, 40_000 // (sum(heads) * d)))
    return dict(
        dtype=dtype,
        heads=heads,
        d=d,
        rotary_dim=rotary_dim,
        tokens=tokens,
        w_dtype=draw(st.sampled_from([torch.float32, dtype])),
        layout=draw(st.sampled_from(["contiguous", "aligned", "odd"])),
        scale=draw(st.sampled_from([1.0, 0.01, 100.0])),
        n_pos=draw(st.sampled_from([1, 64, 5000])),
        emulation=(draw(st.sampled_from([1, 4, 132])), draw(st.booleans())),
        opts=dict(
            interleaved=draw(st.booleans()),
            weight_offset=draw(st.sampled_from([0.0, 1.0])),
            eps=draw(st.sampled_from([1e-6, 1e-5])),
            rotary_offset=rotary_offset,
        ),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@property_settings()  # the existing ops' draws: 500 (more under the 'long' profile)
@given(case=norm_cases())
def test_property_matches_reference(case):
    c = case
    heads, d = c["heads"], c["d"]
    _, qkv = make_qkv(c["tokens"], heads, d, c["dtype"], layout=c["layout"], seed=c["seed"], scale=c["scale"])
    qw, kw = make_weights(d, c["w_dtype"], c["opts"]["weight_offset"], seed=c["seed"] + 1)
    g = torch.Generator().manual_seed(c["seed"])
    pos = torch.randint(0, c["n_pos"], (c["tokens"],), generator=g)
    cs = make_cos_sin(c["n_pos"], c["rotary_dim"])
    ref, tol = expected(qkv, heads, qw, kw, pos, cs, **c["opts"])
    for backend in ["cpu"] + ([c["emulation"]] if HAS_NORM_EMULATION else []):
        out = qkv.clone()
        info = run(backend, out, heads, qw, kw, pos, cs, **c["opts"])
        assert info is None or not (backend[1] and info[2]), "force_scalar ran the vector path"
        check(out, ref, tol, qkv, heads)


def test_float64_uses_float64_eps_and_weight_offset():
    """float64 inputs compute in float64 (module docstring of rope_ext.serving): eps and weight_offset too.

    Fails while the kernels keep them as float32 (1e-6 becomes 9.99999997e-7, 0.1 becomes 0.100000001): with
    mean(x^2) ~ eps the result is then off by ~4e-10, with weight_offset=0.1 by ~2e-9 (float64 ulps: 2e-16).
    """
    heads, pos = (1, 1, 0), torch.zeros(1, dtype=torch.long)
    w = torch.ones(2, dtype=torch.float64)
    cs = make_cos_sin(1, 2, dtype=torch.float64)
    for x, opts in (
        ([0.001, 0.002, 0.0, 0.0], dict(eps=1e-6)),
        ([3.0, 4.0, 1.0, 2.0], dict(weight_offset=0.1)),
    ):
        x = torch.tensor([x], dtype=torch.float64)
        ref = reference.qk_norm_rotary(x, *heads, w, w, pos, cs, **opts)
        for backend in ["cpu"] + [(1, False)] * HAS_NORM_EMULATION:
            y = x.clone()
            run(backend, y, heads, w, w, pos, cs, **opts)
            torch.testing.assert_close(y, ref, rtol=1e-14, atol=0, msg=lambda m, o=opts: f"{o}: {m}")


# ---------------------------------------------------------------------------------------------------------
# 8. vLLM's fused_qk_norm_rope argument order (rope_ext.compat.vllm).


@pytest.mark.parametrize("is_neox", [True, False])
def test_vllm_fused_qk_norm_rope(is_neox):
    if not hasattr(rope_ext.compat.vllm, "fused_qk_norm_rope"):
        pytest.skip("rope_ext.compat.vllm.fused_qk_norm_rope is not there yet")
    heads, d = GQA, 128
    _, qkv = make_qkv(6, heads, d, torch.bfloat16)
    qw, kw = make_weights(d, torch.bfloat16, 0.0)
    cs = make_cos_sin(N_POS, 64)
    pos = torch.randint(0, N_POS, (6,))
    want = qkv.clone()
    rope_ext.apply_qk_norm_rotary_(want, *heads, qw, kw, pos, cs, eps=1e-5, interleaved=not is_neox)
    fused = rope_ext.compat.vllm.fused_qk_norm_rope
    got = qkv.clone()
    assert fused(got, *heads, d, 1e-5, qw, kw, cs, is_neox, pos) is None
    assert torch.equal(bits(got), bits(want))
    # A float64 cache (neither float32 nor qkv's dtype) is used as float32.
    cs64 = reference.cos_sin_table(N_POS, 64)
    want, got = qkv.clone(), qkv.clone()
    rope_ext.apply_qk_norm_rotary_(want, *heads, qw, kw, pos, cs64.float(), eps=1e-5, interleaved=not is_neox)
    fused(got, *heads, d, 1e-5, qw, kw, cs64, is_neox, pos)
    assert torch.equal(bits(got), bits(want))
    with pytest.raises(ValueError):  # head_dim that does not match qkv's width
        fused(got, *heads, d // 2, 1e-5, qw, kw, cs, is_neox, pos)
    assert torch.equal(bits(got), bits(want))


def test_packed_op_equals_views_op_and_passes_opcheck():
    """``qk_norm_rotary_packed_`` (the eager API's one call on qkv) equals ``qk_norm_rotary_`` on the q / k
    views bit for bit, and passes opcheck (schema, fake kernel, dispatch)."""
    g = torch.Generator().manual_seed(5)
    T, heads, D = 5, (4, 2, 2), 64
    base = torch.randn(T, sum(heads) * D + 16, generator=g).to(torch.bfloat16)
    qkv = base[:, : sum(heads) * D]  # a strided view
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    pos = torch.randint(0, 64, (T,), generator=g)
    cs = reference.cos_sin_table(64, D // 2).float()
    a = qkv.clone()
    torch.ops.rope_ext.qk_norm_rotary_packed_(a, *heads, qw, kw, pos, cs, 1e-6, True, 0.5)
    b = qkv.clone()
    q, k, _ = split(b, *heads)
    torch.ops.rope_ext.qk_norm_rotary_(q, k, qw, kw, pos, cs, 1e-6, True, 0.5)
    assert torch.equal(a, b)
    torch.library.opcheck(
        torch.ops.rope_ext.qk_norm_rotary_packed_.default,
        (qkv.clone(), *heads, qw, kw, pos, cs, 1e-6, False, 0.0),
    )
    with pytest.raises(ValueError, match="not a multiple"):
        torch.ops.rope_ext.qk_norm_rotary_packed_(qkv.clone(), 3, 2, 2, qw, kw, pos, cs)

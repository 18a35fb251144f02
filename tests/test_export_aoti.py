"""Ahead-of-time deployment: an attention block using the rotary ops survives ``torch.export`` (dynamic token
count), ``torch.export.save`` / ``load``, ``torch._inductor.aoti_compile_and_package`` and
``aoti_load_package``, and its outputs equal eager.

What a user must know (torch 2.14.1, found by these tests):

* ``apply_rotary_qk_`` works in place on views of a packed QKV tensor; no contiguous copies are needed.
  While exporting, ``torch.compiler.is_compiling()`` is true, so the wrapper records a view argument as the
  functional ``rope_ext.rotary_qk`` plus ``aten.copy_`` into the views (the path that also works around
  Inductor's dropped storage offset, see test_compile_views.py). Tensors that require grad take the same
  path (the traced autograd one; q and k do when the parameters do, unless frozen or exported under
  ``torch.no_grad()``). Only on tensors that are neither (e.g. ``.contiguous()`` copies in a frozen block)
  is the in-place ``rope_ext.rotary_qk_`` itself in the graph. Every form exports, saves, loads, compiles
  and matches eager.
* An AOTI package calls the custom op through AOTInductor's proxy executor, which looks its schema up in the
  dispatcher when the package is loaded: the op library must be loaded *before* ``aoti_load_package``
  (``import rope_ext``, or just ``torch.ops.load_library(<path of rope_ext/_C*.so>)``), else loading raises
  ``RuntimeError: Could not find schema for rope_ext::rotary_qk``. A C++ runtime must likewise load the op
  library (the ``rope_ext_ops`` CMake target) before creating its ``AOTIModelPackageLoader``:
  ``tests/native/aoti_runner.cpp`` dlopens ``librope_ext_ops.so`` and runs the packages with libtorch only,
  built with the op library by ``tests/native/aoti_runner/CMakeLists.txt``.

Accuracy: the exported program runs the same ATen and rope_ext kernels as eager, in the same order, so its
outputs are bitwise equal (``torch.equal``). The AOTI package runs the same rope_ext kernel, but Inductor
generates its own C++ for the projections, GQA copies and attention (e.g. a fused CPU flash-attention
kernel), whose float32 summation order may differ from ATen's: those outputs are held to 1e-6 of the largest
eager value (a few float32 ulps; bitwise equality is what was observed on x86-64, not a guarantee). The C++
runner runs the same compiled model and is held to the same tolerance.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import native_build
from torch import nn
from torch.export import Dim

import rope_ext

HIDDEN = 48
MAX_POSITIONS = 256
MAX_TOKENS = 128
EXPORT_TOKENS = 8  # the example input's token count
RUN_TOKENS = (5, 19)  # the other counts each program is run at
ROOT = Path(__file__).resolve().parents[1]


class AttentionBlock(nn.Module):
    """Packed QKV projection, rotary on the q/k heads, causal GQA attention, output projection.

    ``mode``: ``"inplace"`` rotates the views of the packed tensor with ``apply_rotary_qk_``, ``"contiguous"``
    rotates contiguous copies of them in place, ``"functional"`` uses ``apply_rotary_qk``. ``head_dim >
    rotary_dim`` gives an MLA-like ``[nope | rope]`` head (``rotary_offset = head_dim - rotary_dim``);
    ``mrope_section`` makes ``positions`` ``[3, T]`` (MRoPE). ``frozen``: no parameter requires grad (so
    neither do q and k while exporting). Returns the block's output and the rotated q, k.
    """

    def __init__(
        self,
        mode: str = "inplace",
        *,
        hq: int = 4,
        hk: int = 2,
        head_dim: int = 16,
        rotary_dim: int = 16,
        mrope_section: tuple[int, int, int] | None = None,
        mrope_interleaved: bool = False,
        frozen: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        assert mode in ("inplace", "contiguous", "functional")
        self.mode, self.hq, self.hk, self.head_dim = mode, hq, hk, head_dim
        self.rope_kwargs = {"rotary_offset": head_dim - rotary_dim}
        if mrope_section is not None:
            self.rope_kwargs.update(mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
        self.qkv = nn.Linear(HIDDEN, (hq + 2 * hk) * head_dim, bias=False)
        self.o = nn.Linear(hq * head_dim, HIDDEN, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (self.qkv, self.o):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features**0.5)
        self.register_buffer("cos_sin", rope_ext.RopeCache(rotary_dim, max_positions=MAX_POSITIONS).cos_sin)
        self.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        T, D = x.shape[0], self.head_dim
        qkv = self.qkv(x)  # [T, (hq + 2 hk) D]
        q = qkv[:, : self.hq * D].view(T, self.hq, D)
        k = qkv[:, self.hq * D : (self.hq + self.hk) * D].view(T, self.hk, D)
        v = qkv[:, (self.hq + self.hk) * D :].view(T, self.hk, D)
        pos = positions[..., None]  # [T, 1], or [3, T, 1] with MRoPE: broadcasts to [T, H]
        if self.mode == "functional":
            q, k = rope_ext.apply_rotary_qk(q, k, pos, self.cos_sin, **self.rope_kwargs)
        else:
            if self.mode == "contiguous":
                q, k = q.contiguous(), k.contiguous()
            rope_ext.apply_rotary_qk_(q, k, pos, self.cos_sin, **self.rope_kwargs)
        rep = self.hq // self.hk
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.repeat_interleave(rep, dim=1).transpose(0, 1)[None],
            v.repeat_interleave(rep, dim=1).transpose(0, 1)[None],
            is_causal=True,
        )  # [1, hq, T, D]
        return self.o(attn[0].transpose(0, 1).reshape(T, self.hq * D)), q, k


VARIANTS = {
    "inplace": dict(mode="inplace"),
    "inplace-frozen": dict(mode="inplace", frozen=True),
    "contiguous": dict(mode="contiguous"),
    "contiguous-frozen": dict(mode="contiguous", frozen=True),
    "functional": dict(mode="functional"),
    "mla-inplace": dict(mode="inplace", head_dim=24, rotary_dim=16),
    "mla-functional": dict(mode="functional", head_dim=24, rotary_dim=16),
    "mrope-inplace": dict(mode="inplace", rotary_dim=16, mrope_section=(2, 3, 3)),
    "mrope-functional": dict(mode="functional", head_dim=20, rotary_dim=16, mrope_section=(4, 2, 2)),
    "mrope-interleaved": dict(mode="inplace", rotary_dim=16, mrope_section=(2, 3, 3), mrope_interleaved=True),
}


class Stack(nn.Module):
    """Several blocks in a row (one AOTI package for many variants); ``positions`` is ``[3, T]``: the MRoPE
    blocks take all of it, the others its first row. Returns every block's outputs."""

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = names
        self.blocks = nn.ModuleList(AttentionBlock(**VARIANTS[n], seed=i) for i, n in enumerate(names))

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        outs = []
        for block in self.blocks:
            pos = positions if "mrope_section" in block.rope_kwargs else positions[0]
            out, q, k = block(x, pos)
            outs += [out, q, k]
            x = out
        return tuple(outs)


def _inputs(tokens: int, mrope: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    if mrope:  # temporal positions in order, height / width anywhere in the cache
        t = torch.arange(tokens) + torch.randint(0, MAX_POSITIONS - tokens, (1,), generator=g)
        hw = torch.randint(0, MAX_POSITIONS, (2, tokens), generator=g)
        return x, torch.cat([t[None], hw])
    start = torch.randint(0, MAX_POSITIONS - tokens, (1,), generator=g)
    return x, torch.randperm(tokens, generator=g) + start


def _export(module: nn.Module, mrope: bool) -> torch.export.ExportedProgram:
    T = Dim("T", min=2, max=MAX_TOKENS)
    x, positions = _inputs(EXPORT_TOKENS, mrope, seed=100)
    shapes = {"x": {0: T}, "positions": {1: T} if mrope else {0: T}}
    return torch.export.export(module, (x, positions), dynamic_shapes=shapes)


def _rope_targets(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "rope_ext" in str(n.target)]


def _eager(module: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(t.clone() for t in module(x, positions))


def _run_inputs(mrope: bool) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    return [(tokens, *_inputs(tokens, mrope, seed=i)) for i, tokens in enumerate(RUN_TOKENS)]


def _assert_like_eager(got: tuple, expected: tuple, tokens: int, exact: bool) -> None:
    assert len(got) == len(expected)
    for j, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.shape == e.shape, (tokens, j)
        err = (g - e).abs().max().item()
        if exact:
            assert torch.equal(g, e), f"T={tokens}, output {j}: max error {err:.3g}"
        else:
            tol = 1e-6 * e.abs().max().item()
            assert err <= tol, f"T={tokens}, output {j}: max error {err:.3g} > {tol:.3g}"


def _assert_runs_like_eager(run, module: nn.Module, mrope: bool, exact: bool) -> None:
    for tokens, x, positions in _run_inputs(mrope):
        expected = _eager(module, x, positions)
        with torch.no_grad():
            got = tuple(run(x.clone(), positions.clone()))
        _assert_like_eager(got, expected, tokens, exact)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_save_load_matches_eager(name, tmp_path):
    block = AttentionBlock(**VARIANTS[name]).eval()
    mrope = "mrope_section" in VARIANTS[name]
    ep = _export(block, mrope)
    targets = _rope_targets(ep)
    if name == "contiguous-frozen":
        # Neither a view nor requiring grad: the in-place op itself.
        assert targets == ["rope_ext.rotary_qk_.default"]
    else:
        # The out-of-place call, and in-place calls on views or on tensors that require grad (the traced
        # autograd path): the functional op, plus copy_ into the rotated tensors for the in-place calls.
        assert targets == ["rope_ext.rotary_qk.default"]
    copies = sum(n.target is torch.ops.aten.copy_.default for n in ep.graph.nodes)
    copied = VARIANTS[name]["mode"] != "functional" and name != "contiguous-frozen"
    assert copies == (2 if copied else 0)  # q and k
    _assert_runs_like_eager(ep.module(), block, mrope, exact=True)

    path = tmp_path / "block.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    assert _rope_targets(loaded) == targets
    _assert_runs_like_eager(loaded.module(), block, mrope, exact=True)


def test_export_strict_inplace_views():
    block = AttentionBlock("inplace").eval()
    T = Dim("T", min=2, max=MAX_TOKENS)
    ep = torch.export.export(
        block, _inputs(EXPORT_TOKENS, False, seed=100), dynamic_shapes=({0: T}, {0: T}), strict=True
    )
    assert _rope_targets(ep) == ["rope_ext.rotary_qk.default"]
    _assert_runs_like_eager(ep.module(), block, False, exact=True)


def _aoti_package(module: nn.Module, mrope: bool, path) -> str:
    """Export, save, load back (as a deployment would), compile and package; returns the package path."""
    ep_path = path.with_suffix(".ep.pt2")
    torch.export.save(_export(module, mrope), ep_path)
    ep = torch.export.load(ep_path)
    assert _rope_targets(ep), "rope_ext op missing from the exported graph"
    return torch._inductor.aoti_compile_and_package(ep, package_path=str(path))


@pytest.fixture(scope="module")
def inplace_package(tmp_path_factory):
    block = AttentionBlock("inplace").eval()
    return block, _aoti_package(block, False, tmp_path_factory.mktemp("aoti") / "block.pt2")


@pytest.fixture(scope="module")
def stack_package(tmp_path_factory):
    # Every variant except the one packaged above, in one package (one compile).
    stack = Stack([n for n in VARIANTS if n != "inplace"]).eval()
    return stack, _aoti_package(stack, True, tmp_path_factory.mktemp("aoti") / "stack.pt2")


@pytest.mark.slow
def test_aoti_inplace_block_matches_eager(inplace_package):
    block, path = inplace_package
    # The op library is loaded (rope_ext is imported above): see test_aoti_package_needs_the_op_library.
    compiled = torch._inductor.aoti_load_package(path)
    _assert_runs_like_eager(compiled, block, False, exact=False)


@pytest.mark.slow
def test_aoti_stack_of_variants_matches_eager(stack_package):
    stack, path = stack_package
    compiled = torch._inductor.aoti_load_package(path)
    _assert_runs_like_eager(compiled, stack, True, exact=False)


_LOAD_SCRIPT = """
import sys, torch
package, x, positions, want = sys.argv[1], *torch.load(sys.argv[2])
if sys.argv[3] == "load_library":
    torch.ops.load_library(sys.argv[4])  # the op library only: no rope_ext Python package
try:
    compiled = torch._inductor.aoti_load_package(package)
except RuntimeError as e:
    print("LOAD FAILED:", e)
    sys.exit(0)
assert "rope_ext" not in sys.modules
out = compiled(x, positions)[0]
torch.testing.assert_close(out, want, rtol=0, atol=1e-6 * want.abs().max().item())
print("RAN")
"""


@pytest.mark.slow
def test_aoti_package_needs_the_op_library(inplace_package, tmp_path):
    """In a fresh process, loading the package without the op library fails; loading the library suffices."""
    block, path = inplace_package
    x, positions = _inputs(RUN_TOKENS[0], False, seed=0)
    io = tmp_path / "io.pt"
    torch.save((x, positions, _eager(block, x, positions)[0]), io)
    script = textwrap.dedent(_LOAD_SCRIPT)

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", script, path, str(io), *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "LOAD FAILED: Could not find schema for rope_ext::rotary_qk" in run("bare")
    assert "RAN" in run("load_library", rope_ext._C.__file__)


@pytest.fixture(scope="session")
def aoti_runner() -> tuple[Path, Path]:
    """The runner and the op library, against libtorch (the shared native build); returns the paths of the
    runner and of librope_ext_ops.so."""
    build = native_build()
    return build / "aoti_runner", build / "rope_ext" / "librope_ext_ops.so"


def _run_cpp(runner: Path, package: str, op_library: str, *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(runner), package, op_library, *map(str, files)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
@pytest.mark.parametrize("package", ["inplace_package", "stack_package"])
def test_aoti_package_runs_from_cpp(package, request, aoti_runner, tmp_path):
    """The packages of apply_rotary_qk_ (inplace) and of every variant, apply_rotary_qk included (stack), run
    from C++ (libtorch, the op library dlopened, AOTIModelPackageLoader; no Python) at two token counts, in
    one loaded model, like eager."""
    module, path = request.getfixturevalue(package)
    runs = _run_inputs(mrope=package == "stack_package")
    files = []
    for i, (_, x, positions) in enumerate(runs):
        torch.save((x, positions), tmp_path / f"in{i}.pt")
        files += [tmp_path / f"in{i}.pt", tmp_path / f"out{i}.pt"]
    runner, op_library = aoti_runner
    done = _run_cpp(runner, path, str(op_library), *files)
    assert done.returncode == 0, done.stderr
    for i, (tokens, x, positions) in enumerate(runs):
        got = torch.load(tmp_path / f"out{i}.pt", weights_only=True)
        _assert_like_eager(tuple(got), _eager(module, x, positions), tokens, exact=False)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_aoti_cpp_runner_needs_the_op_library(inplace_package, aoti_runner, tmp_path):
    """Without the dlopen of the op library, AOTIModelPackageLoader fails as aoti_load_package does."""
    x, positions = _inputs(RUN_TOKENS[0], False, seed=0)
    torch.save((x, positions), tmp_path / "in.pt")
    done = _run_cpp(aoti_runner[0], inplace_package[1], "none", tmp_path / "in.pt", tmp_path / "out.pt")
    assert done.returncode == 1
    assert "Could not find schema for rope_ext::rotary_qk" in done.stderr

"""A patched transformers Llama on several CPU ranks (gloo), end to end: tensor parallel (heads sharded,
rope on the local heads) and FSDP2 training (rope_ext's backward), against the single-process run.

Each test spawns real ranks with ``_distributed.run_ranks``; the workers below are module-level so that
the spawned processes can import this module by name. Every rank builds the same tiny Llama from the same
seed, so the single-process reference is the same model before it is parallelised or sharded. The
patch (``patch_transformers`` replaces the modeling module's ``apply_rotary_pos_emb``) is made in the
ranks' own processes and never reaches the test process.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys

# The spawned ranks unpickle their worker as ``test_distributed_models.<fn>``: this folder must be on
# their sys.path (spawn passes the parent's sys.path on; pytest has put it there, this makes sure).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
from _distributed import run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
    # run_ranks picks NCCL for ROPE_EXT_DIST_DEVICE=cuda with a GPU per rank; these models are on the CPU.
    pytest.mark.skipif(
        os.environ.get("ROPE_EXT_DIST_DEVICE", "cpu") != "cpu",
        reason="the distributed model tests run CPU tensors over gloo (ROPE_EXT_DIST_DEVICE is not cpu)",
    ),
]

N_LAYERS = 2
VOCAB = 96
STEPS = 5
TIMEOUT = 240.0


# ---------------------------------------------------------------------------------------------
# The model and data (the same on every rank)


def _tiny_llama(heads: int, kv_heads: int, head_dim: int = 16):
    """A tiny random float32 Llama (sdpa attention, untied head) with weights at a realistic scale.

    transformers' init (std 0.02) leaves attention almost uniform, so a wrong rotation would barely move
    the logits; normal weights with std 0.15 give peaked attention and a residual stream of order one.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=heads * head_dim,
        intermediate_size=3 * heads * head_dim // 2,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            else:  # RMSNorm weights: around one, not all equal
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def _tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the mean next-token cross entropy (every row has the same number of targets)."""
    logits = model(ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return logits, loss


def _maybe_patch(model, patched: bool):
    if patched:
        from rope_ext.compat import patch_transformers

        patch_transformers(model)
    return model


class _Seen:
    """Records what reaches rope_ext's q/k op from the patched model (the tensors' types and shapes)."""

    def __init__(self):
        from rope_ext.compat.hf import rotation  # the module whose _rotate calls the op

        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self._hf, self._real = rotation, rotation.apply_rotary_qk
        rotation.apply_rotary_qk = self

    def __call__(self, q, k, *args, **kwargs):
        self.calls.append((type(q).__name__, tuple(q.shape), tuple(k.shape)))
        return self._real(q, k, *args, **kwargs)


def _rope_events(prof) -> int:
    """How many times rope_ext's rotary ops ran (forward and backward) in a profile."""
    return sum(1 for e in prof.events() if e.name.startswith("rope_ext::rotary"))


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _out(t: torch.Tensor):
    """A tensor to return from a rank, as a numpy array: torch.multiprocessing's queue would pass a tensor
    by a shared-memory handle that dies with the rank's process before the parent reads it."""
    return t.detach().numpy().copy()


# ---------------------------------------------------------------------------------------------
# Workers (run in each rank's process)


def _tp_worker(rank: int, world_size: int, patched: bool, heads: int, kv_heads: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _maybe_patch(_tiny_llama(heads, kv_heads), patched)
    ids = _tokens(2, 24, seed=3)

    # The single-process run of the same model (every rank computes it; they agree).
    ref = copy.deepcopy(model)
    ref_logits, ref_loss = _loss(ref, ids)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    # Sensitivity: positions scaled by two (another rotation) move the logits far beyond the tolerance.
    with torch.no_grad():
        pos2 = (2 * torch.arange(ids.shape[1])).expand_as(ids)
        moved = _max_rel(ref(ids, position_ids=pos2, use_cache=False).logits, ref_logits)

    mesh = init_device_mesh("cpu", (world_size,))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}

    seen = _Seen() if patched else None
    with torch.profiler.profile() as prof_fwd:
        logits, loss = _loss(model, ids)
    with torch.profiler.profile() as prof_bwd:
        loss.backward()
    grads = {}
    for n, p in model.named_parameters():  # the same order on every rank: full_tensor is a collective
        g = p.grad
        grads[n] = g.full_tensor() if isinstance(g, DTensor) else g
    return {
        "logits": _out(logits),
        "loss": loss.item(),
        "ref_logits": _out(ref_logits),
        "ref_loss": ref_loss.item(),
        "grad_rel": {n: _max_rel(grads[n], ref_grads[n]) for n in ref_grads},
        "grads": {n: _out(g) for n, g in grads.items()},
        "sharded": sorted(sharded),
        "moved": moved,
        "seen": None if seen is None else seen.calls,
        "rope_fwd": _rope_events(prof_fwd),
        "rope_bwd": _rope_events(prof_bwd),
    }


def _train(model, batches: list[torch.Tensor], lr: float = 0.05, profile_step: int = 1):
    """``STEPS`` SGD steps (momentum 0.9), one batch each (the same ``batches`` cycle); returns the
    loss of each step (before its update) and the rope_ext op count of step ``profile_step``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, rope = [], None
    for step in range(STEPS):
        ids = batches[step % len(batches)]
        prof = torch.profiler.profile() if step == profile_step else contextlib.nullcontext()
        with prof:
            _, loss = _loss(model, ids)
            loss.backward()
        if step == profile_step:
            rope = _rope_events(prof)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, rope


def _fsdp_worker(rank: int, world_size: int, patched: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _maybe_patch(_tiny_llama(4, 2), patched)
    ref = copy.deepcopy(model) if rank == 0 else None
    # Two fixed global batches of 4 sequences; data parallel: rank r takes rows r::world_size.
    batches = [_tokens(4, 16, seed=10), _tokens(4, 16, seed=11)]

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())

    seen = _Seen() if patched else None
    local, rope = _train(model, [b[rank::world_size] for b in batches])
    # The global loss of each step: the mean of the ranks' means (equal row counts, equal lengths).
    curve = torch.stack(local)
    dist.all_reduce(curve, op=dist.ReduceOp.AVG)
    out = {
        "curve": _out(curve),
        "sharded": sharded,
        "rope": rope,
        "seen": None if seen is None else list(seen.calls),
    }
    if rank == 0:  # the single-process run of the same steps on the full batches
        out["ref_curve"] = _out(torch.stack(_train(ref, batches)[0]))
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# Runs (each configuration once per test session)


@functools.cache
def _tp(world_size: int, patched: bool) -> list[dict]:
    heads, kv_heads = 2 * world_size, world_size  # heads split evenly: 2 q heads, 1 kv head per rank
    return [_tensors(r) for r in run_ranks(_tp_worker, world_size, patched, heads, kv_heads, timeout=TIMEOUT)]


@functools.cache
def _fsdp(world_size: int, patched: bool) -> list[dict]:
    return [_tensors(r) for r in run_ranks(_fsdp_worker, world_size, patched, timeout=TIMEOUT)]


def _tensors(result: dict) -> dict:
    """A rank's result with its numpy arrays back as tensors."""
    import numpy as np

    def conv(v):
        if isinstance(v, np.ndarray):
            return torch.from_numpy(v)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(result)


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_patched_llama_matches_single_process(world_size):
    """q/k/v colwise, o rowwise (and the MLP likewise): each rank rotates its own heads with rope_ext's
    op; logits, loss and every gradient equal the single-process patched model's."""
    heads, kv_heads = 2 * world_size, world_size
    results = _tp(world_size, patched=True)
    r0 = results[0]
    assert any(n.endswith("self_attn.q_proj.weight") for n in r0["sharded"])
    assert r0["moved"] > 0.05, f"the logits barely depend on the rotation ({r0['moved']:.2e})"
    for rank, r in enumerate(results):
        # rope_ext saw plain local tensors: the rank's 2 q heads and 1 kv head, not DTensors.
        assert r["seen"] and all(
            t == "Tensor" and q[1] == heads // world_size and k[1] == kv_heads // world_size
            for t, q, k in r["seen"]
        ), (rank, r["seen"])
        assert len(r["seen"]) == N_LAYERS
        assert r["rope_fwd"] == N_LAYERS and r["rope_bwd"] == N_LAYERS, (r["rope_fwd"], r["rope_bwd"])
        assert torch.equal(r["ref_logits"], r0["ref_logits"])
        assert _max_rel(r["logits"], r["ref_logits"]) <= 1e-5
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        bad = {n: e for n, e in r["grad_rel"].items() if not e <= 2e-5}
        assert not bad, (rank, bad)


@pytest.mark.slow
def test_fsdp2_patched_llama_loss_curve_matches_single_process():
    """fully_shard per decoder layer and the root, data parallel over 2 ranks: 5 SGD steps through
    rope_ext's forward and backward give the single-process loss curve on the full batches."""
    results = _fsdp(2, patched=True)
    r0 = results[0]
    for r in results:
        assert r["sharded"]
        assert torch.equal(r["curve"], r0["curve"])
        # one step: rope_ext's op once per layer forward and once per layer backward
        assert r["rope"] == 2 * N_LAYERS, r["rope"]
        # rope_ext saw plain tensors: the rank's 2 rows with all 4 q / 2 kv heads (parameters unsharded)
        assert len(r["seen"]) == STEPS * N_LAYERS
        assert all(t == "Tensor" and q[:2] == (2, 4) and k[:2] == (2, 2) for t, q, k in r["seen"]), r["seen"]
    curve, ref = r0["curve"], r0["ref_curve"]
    assert curve[-1] < 0.9 * curve[0], curve  # it trains
    torch.testing.assert_close(curve, ref, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_distributed_patched_matches_transformers():
    """The same TP and FSDP2 runs without ``patch_transformers``: transformers' own rotation gives the
    same logits, gradients and loss curve, within float32 rounding of rope_ext's float64-angle cos / sin."""
    tp_ours, tp_theirs = _tp(2, patched=True), _tp(2, patched=False)
    for ours, theirs in zip(tp_ours, tp_theirs, strict=True):
        assert (ours["rope_fwd"], ours["rope_bwd"]) == (N_LAYERS, N_LAYERS)
        assert (theirs["rope_fwd"], theirs["rope_bwd"]) == (0, 0)  # unpatched: transformers' formula
        assert _max_rel(ours["logits"], theirs["logits"]) <= 1e-5
        assert _max_rel(ours["ref_logits"], theirs["ref_logits"]) <= 1e-5
        bad = {n: e for n, g in ours["grads"].items() if not (e := _max_rel(g, theirs["grads"][n])) <= 2e-5}
        assert not bad, bad
    fsdp_ours, fsdp_theirs = _fsdp(2, patched=True), _fsdp(2, patched=False)
    assert fsdp_ours[0]["rope"] == 2 * N_LAYERS and fsdp_theirs[0]["rope"] == 0
    torch.testing.assert_close(fsdp_ours[0]["curve"], fsdp_theirs[0]["curve"], rtol=1e-5, atol=0)
    torch.testing.assert_close(fsdp_theirs[0]["curve"], fsdp_theirs[0]["ref_curve"], rtol=1e-5, atol=0)

"""Patched Qwen3 models run from two threads at once (a threaded server, DataParallel replicas).

``patch_transformers`` defers Qwen3's q / k norms into the rotary function while an attention layer runs;
which attention is running must be known per thread, or one thread's norm and rotation read the other's
layer (the norm applied twice, with the other layer's weights). Two threads run two tiny models with
different weights, then one model shared by both, hundreds of forwards each: every logit must be bit-equal
to a single-threaded run.

Left to the scheduler, the two threads rarely switch inside the few operations between an attention's start
and its norms. So every other forward, the threads meet at a barrier inside an attention layer (a pre-hook
of its ``q_proj``, which runs after the attention's forward has begun and before its norms): thread ``t``
in layer ``t``, so that both are inside different attention layers at once, of one model or of two. The
forwards in between run unsynchronized.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from hf_check import reinit
from transformers import Qwen3Config, Qwen3ForCausalLM

from rope_ext.compat import patch_transformers, unpatch_transformers
from rope_ext.compat.hf import qk_norm as hf_qk_norm

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    attn_implementation="sdpa",
)
ITERATIONS = 200  # forwards per thread
N_CALLS = 3  # distinct inputs, taken in turn
SEQ = 6


def _model(seed: int) -> torch.nn.Module:
    """A tiny float32 Qwen3 with realistic weights, its q / k norm weights far from 1 (a norm applied twice
    or with another layer's weights changes the logits)."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).eval()
    reinit(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=g))
    return model


@pytest.fixture
def models():
    pair = [_model(0), _model(1)]
    for m in pair:
        patch_transformers(m)
    yield pair
    for m in pair:
        unpatch_transformers(m)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread: set where the forward runs
        return model(ids).logits


# The layer whose attention the current thread stops in at the barrier; none in the main thread.
_MEET = threading.local()


def _meeting_hooks(model: torch.nn.Module, barrier: threading.Barrier) -> list:
    def hook(layer: int):
        def pre_hook(module, args):
            if getattr(_MEET, "layer", None) == layer:
                barrier.wait()

        return pre_hook

    return [
        decoder.self_attn.q_proj.register_forward_pre_hook(hook(i))
        for i, decoder in enumerate(model.model.layers)
    ]


def _worker(tid, model, calls, want, barrier, failures) -> None:
    try:
        for it in range(ITERATIONS):
            _MEET.layer = tid if it % 2 == 0 else None
            i = (it + tid) % N_CALLS  # a shared model runs different inputs in the two threads
            if not torch.equal(_logits(model, calls[i]), want[i]):
                failures.append(f"thread {tid}, forward {it}: logits differ from the single-threaded run")
    except Exception as e:  # noqa: BLE001 - reported by the test, and the other thread released
        failures.append(f"thread {tid}: {e!r}")
        barrier.abort()


@pytest.mark.parametrize("shared", [False, True], ids=["two_models", "one_model"])
def test_two_threads_give_single_threaded_logits(models, shared, monkeypatch):
    g = torch.Generator().manual_seed(7)
    calls = [torch.randint(0, CONFIG["vocab_size"], (1, SEQ), generator=g) for _ in range(N_CALLS)]
    per_thread = [models[0], models[0] if shared else models[1]]
    fused = []
    real = hf_qk_norm.apply_qk_norm_rotary
    monkeypatch.setattr(hf_qk_norm, "apply_qk_norm_rotary", lambda *a, **k: fused.append(1) or real(*a, **k))
    want = {id(m): [_logits(m, ids) for ids in calls] for m in models}
    # the fused QK-norm path runs: one call per layer and forward
    assert len(fused) == len(models) * N_CALLS * CONFIG["num_hidden_layers"]
    monkeypatch.undo()
    assert not torch.equal(want[id(models[0])][0], want[id(models[1])][0])

    barrier = threading.Barrier(2, timeout=60)
    hooks = [h for m in models for h in _meeting_hooks(m, barrier)]
    failures: list[str] = []
    threads = [
        threading.Thread(target=_worker, args=(t, m, calls, want[id(m)], barrier, failures))
        for t, m in enumerate(per_thread)
    ]
    # Switch threads as often as the interpreter allows: unsynchronized forwards interleave at more points.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
        for h in hooks:
            h.remove()
    assert not failures, f"{len(failures)} failures, first: {failures[:3]}"

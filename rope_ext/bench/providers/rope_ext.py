"""rope_ext's own ops: in place, out of place and backward (``rope_ext.apply_rotary_qk[_]``).

MRoPE presets pass ``mrope_section`` with their ``[3, T, 1]`` positions. ``rope_ext+varlen`` (packed
workloads): ``rope_ext.varlen_positions`` then the rotation in place, timed together.
"""

from __future__ import annotations

import torch
from torch import Tensor

import rope_ext

from ..workloads import Case, clones
from . import Runner, Skip, provider


@provider("rope_ext", "inplace")
def _rope_ext_inplace(case: Case) -> Runner:
    q, k = clones(case)
    pos, cs, il, sec = case.rope_positions, case.cos_sin, case.interleaved, case.mrope_section
    apply = rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, Tensor]:
        apply(q, k, pos, cs, interleaved=il, mrope_section=sec)
        return q, k

    return run


@provider("rope_ext", "out")
def _rope_ext_out(case: Case) -> Runner:
    q, k = case.q, case.k
    pos, cs, il, sec = case.rope_positions, case.cos_sin, case.interleaved, case.mrope_section
    apply = rope_ext.apply_rotary_qk
    return lambda: apply(q, k, pos, cs, interleaved=il, mrope_section=sec)


@provider("rope_ext", "backward")
def _rope_ext_backward(case: Case) -> Runner:
    q, k = (t.clone().requires_grad_(True) for t in (case.q, case.k))
    outs = rope_ext.apply_rotary_qk(
        q,
        k,
        case.rope_positions,
        case.cos_sin,
        interleaved=case.interleaved,
        mrope_section=case.mrope_section,
    )
    grads = (case.grad_q, case.grad_k)
    return lambda: torch.autograd.grad(outs, (q, k), grads, retain_graph=True)


@provider("rope_ext+varlen", "inplace")
def _rope_ext_varlen(case: Case) -> Runner:
    if case.cu_seqlens is None:
        raise Skip("for packed workloads (--seqs)")
    q, k = clones(case)
    cu, tokens, cs, il = case.cu_seqlens, case.tokens, case.cos_sin, case.interleaved
    positions, apply = rope_ext.varlen_positions, rope_ext.apply_rotary_qk_

    def run() -> tuple[Tensor, Tensor]:
        apply(q, k, positions(cu, total_tokens=tokens)[:, None], cs, interleaved=il)
        return q, k

    return run


def _forced_isa(isa: str, build):
    """``build``'s runner with the CPU kernel switched to ``isa`` for each call (and back after it).

    Prefill only: the two switches cost about as much as a decode step.
    """

    def build_forced(case: Case) -> Runner:
        if case.device.type != "cpu":
            raise Skip("forced CPU instruction sets are for --device cpu")
        if case.phase != "prefill":
            raise Skip("forced CPU instruction sets time prefill only")
        if not torch.ops.rope_ext._cpu_isa_supported(isa):
            raise Skip(f"this CPU does not run the {isa} kernel")
        run = build(case)
        switch = torch.ops.rope_ext._set_cpu_isa
        default = rope_ext._cpu_isa()

        def run_forced() -> tuple[Tensor, Tensor]:
            switch(isa)
            try:
                return run()
            finally:
                switch(default)

        return run_forced

    return build_forced


# rope_ext[scalar], rope_ext[avx2], ...: one CPU kernel build each, compared in one run (opt-in).
for _isa in rope_ext.ops.CPU_ISAS:
    provider(f"rope_ext[{_isa}]", "inplace", opt_in=True)(_forced_isa(_isa, _rope_ext_inplace))
    provider(f"rope_ext[{_isa}]", "out", opt_in=True)(_forced_isa(_isa, _rope_ext_out))
del _isa

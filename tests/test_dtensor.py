"""rope_ext's ops on DTensors: sharding rules (rope_ext/distributed.py) on real gloo process groups.

Every op (rotary, rotary_qk, rotary_qk_, and the backward through DTensor autograd) gives the single-device
result with the expected output placements for q / k sharded on heads, tokens or batch (positions sharded
along or replicated), on a 2-D mesh, with MRoPE and rotary_offset; the last dim sharded, Partial inputs and
inconsistent shardings are redistributed first. The serving ops too, the cache writes placed by slot_mapping
or by a page table. Context parallelism: each rank rotates its load-balanced
chunks with ``varlen_positions(..., cp_size, cp_rank)``; gathered, they equal the full-sequence rotation.
"""

from __future__ import annotations

import pytest
import torch
from _distributed import DEVICE, run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="ROPE_EXT_DIST_DEVICE=cuda: no GPU"
    ),
]


def _inputs(mrope: bool = False):
    import rope_ext

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 32, generator=g)
    k = torch.randn(2, 8, 2, 32, generator=g)
    pos = torch.randint(0, 64, (3, 2, 8, 1) if mrope else (2, 8, 1), generator=g)
    cs = rope_ext.RopeCache(32, max_positions=64).cos_sin
    return tuple(t.to(DEVICE) for t in (q, k, pos, cs))


def _check_all_ops(mesh, q, k, pos, cs, q_pl, k_pl, pos_pl, want_pl, **kw):
    """Every op on DTensors placed as given against the plain tensors; outputs placed as ``want_pl``."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    import rope_ext

    def d(t, pl):
        return distribute_tensor(t, mesh, pl)

    dq, dk, dp, dc = d(q, q_pl), d(k, k_pl), d(pos, pos_pl), d(cs, [Replicate()] * mesh.ndim)
    want_q, want_k = rope_ext.apply_rotary_qk(q, k, pos, cs, **kw)
    oq, ok = rope_ext.apply_rotary_qk(dq, dk, dp, dc, **kw)
    assert tuple(oq.placements) == tuple(want_pl), (oq.placements, want_pl)
    assert torch.equal(oq.full_tensor(), want_q) and torch.equal(ok.full_tensor(), want_k)
    ox = rope_ext.apply_rotary(dq, dp, dc, inverse=True, **kw)
    assert torch.equal(ox.full_tensor(), rope_ext.apply_rotary(q, pos, cs, inverse=True, **kw))
    # backward: the gradient of a DTensor input, placed like it
    gq = dq.detach().requires_grad_(True)
    (rope_ext.apply_rotary(gq, dp, dc, **kw) * d(want_q, q_pl)).sum().backward()
    rq = q.clone().requires_grad_(True)
    (rope_ext.apply_rotary(rq, pos, cs, **kw) * want_q).sum().backward()
    torch.testing.assert_close(gq.grad.full_tensor(), rq.grad, rtol=1e-6, atol=1e-6)
    # in place: placements kept, only local shards written
    if tuple(q_pl) == tuple(want_pl) and tuple(k_pl) == tuple(want_pl):
        iq, ik = d(q, q_pl), d(k, k_pl)
        rope_ext.apply_rotary_qk_(iq, ik, dp, dc, **kw)
        assert tuple(iq.placements) == tuple(q_pl) and tuple(ik.placements) == tuple(k_pl)
        assert torch.equal(iq.full_tensor(), want_q) and torch.equal(ik.full_tensor(), want_k)


def _placements_1d(rank, world_size):
    from torch.distributed.tensor import Partial, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh(DEVICE, (world_size,))
    q, k, pos, cs = _inputs()
    S, R = Shard, Replicate()
    cases = [
        ("heads (TP), positions replicated", [S(2)], [S(2)], [R], [S(2)]),
        ("tokens (SP/CP), positions sharded", [S(1)], [S(1)], [S(1)], [S(1)]),
        ("tokens, positions replicated", [S(1)], [S(1)], [R], [S(1)]),
        ("batch (DP), positions sharded", [S(0)], [S(0)], [S(0)], [S(0)]),
        ("replicated", [R], [R], [R], [R]),
    ]
    for _name, qp, kp, pp, want in cases:
        _check_all_ops(mesh, q, k, pos, cs, qp, kp, pp, want)
    # redistributed first: last dim sharded, inconsistent q / k / positions shardings
    _check_all_ops(mesh, q, k, pos, cs, [S(3)], [S(3)], [R], [R])
    _check_all_ops(mesh, q, k, pos, cs, [S(2)], [S(1)], [S(0)], [S(2)])
    # Partial input: reduced first (the rotation is linear, but the rule does not rely on it)
    from torch.distributed.tensor import DTensor

    import rope_ext

    dc = DTensor.from_local(cs, mesh, [R])
    dp = DTensor.from_local(pos, mesh, [R])
    part = DTensor.from_local(q / world_size, mesh, [Partial()])
    out = rope_ext.apply_rotary(part, dp, dc)
    torch.testing.assert_close(out.full_tensor(), rope_ext.apply_rotary(q, pos, cs), rtol=1e-6, atol=1e-6)
    # MRoPE (tokens sharded; the section dim is not) and rotary_offset (heads sharded)
    qm, km, pm, csm = _inputs(mrope=True)
    _check_all_ops(mesh, qm, km, pm, csm, [S(1)], [S(1)], [S(2)], [S(1)], mrope_section=(4, 6, 6))
    cs16 = rope_ext.RopeCache(16, max_positions=64).cos_sin.to(DEVICE)
    _check_all_ops(mesh, q, k, pos, cs16, [S(2)], [S(2)], [R], [S(2)], rotary_offset=16, interleaved=True)
    # frequencies instead of the table (replicated like it), float positions sharded with the tokens
    freqs = rope_ext.RopeCache(32, max_positions=1).frequencies_on(DEVICE)
    _check_all_ops(mesh, q, k, pos.double() / 3, freqs, [S(1)], [S(1)], [S(1)], [S(1)])
    return True


def _placements_2d(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    mesh = init_device_mesh(DEVICE, (2, world_size // 2))
    q, k, pos, cs = _inputs()
    _check_all_ops(
        mesh,
        q,
        k,
        pos,
        cs,
        [Shard(0), Shard(2)],
        [Shard(0), Shard(2)],
        [Shard(0), Replicate()],
        [Shard(0), Shard(2)],
    )
    _check_all_ops(
        mesh,
        q,
        k,
        pos,
        cs,
        [Shard(1), Shard(2)],
        [Shard(1), Shard(2)],
        [Shard(1), Replicate()],
        [Shard(1), Shard(2)],
    )
    return True


def _compiled(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import rope_ext

    mesh = init_device_mesh(DEVICE, (world_size,))
    q, k, pos, cs = _inputs()

    def f(a, b, p, c):
        return rope_ext.apply_rotary_qk(a, b, p, c)

    args = [distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)])]
    args += [distribute_tensor(pos, mesh, [Replicate()]), distribute_tensor(cs, mesh, [Replicate()])]
    oq, ok = torch.compile(f, fullgraph=True)(*args)
    want = f(q, k, pos, cs)
    return torch.equal(oq.full_tensor(), want[0]) and torch.equal(ok.full_tensor(), want[1])


def _context_parallel(rank, world_size, lengths):
    """TransformerEngine's load-balanced CP: rank r holds chunks r and 2 cp - 1 - r of every sequence."""
    import torch.distributed as dist

    import rope_ext

    cp = world_size
    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEVICE)
    total = cu_list[-1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(total, 3, 32, generator=g).to(DEVICE)
    cs = rope_ext.RopeCache(32, max_positions=256).cos_sin.to(DEVICE)
    full = rope_ext.apply_rotary(x, rope_ext.varlen_positions(cu, total_tokens=total)[:, None], cs)
    # this rank's tokens, in its order: for each sequence, chunk rank then chunk 2 cp - 1 - rank
    idx = []
    for b, n in enumerate(lengths):
        c = n // (2 * cp)
        start = cu_list[b]
        for chunk in (rank, 2 * cp - 1 - rank):
            idx += range(start + chunk * c, start + (chunk + 1) * c)
    idx = torch.tensor(idx, dtype=torch.long, device=DEVICE)
    local_pos = rope_ext.varlen_positions(cu, total_tokens=total // cp, cp_size=cp, cp_rank=rank)
    local = rope_ext.apply_rotary(x[idx], local_pos[:, None], cs)
    gathered = [torch.empty_like(local) for _ in range(cp)]
    idxs = [torch.empty_like(idx) for _ in range(cp)]
    dist.all_gather(gathered, local)
    dist.all_gather(idxs, idx)
    out = torch.empty_like(full)
    for part, where in zip(gathered, idxs, strict=True):
        out[where] = part
    return torch.equal(out, full)


def _serving_ops(rank, world_size):
    """The serving ops on DTensors: QK-norm + rotary sharded on heads or tokens, the KV-cache write on
    heads (caches sharded on their head dim); each equal to the single-device result, placements kept."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import rope_ext
    from rope_ext import reference

    mesh = init_device_mesh(DEVICE, (world_size,))
    R = Replicate()
    g = torch.Generator().manual_seed(2)
    T, Hq, Hk, D = 8, 4, 2, 32
    q = torch.randn(T, Hq, D, generator=g).to(DEVICE)
    k = torch.randn(T, Hk, D, generator=g).to(DEVICE)
    v = torch.randn(T, Hk, D, generator=g).to(DEVICE)
    qw, kw = (torch.randn(D, generator=g).to(DEVICE) for _ in range(2))
    pos = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    cs = reference.cos_sin_table(64, D).float().to(DEVICE)

    def d(t, pl):
        return distribute_tensor(t, mesh, [pl])

    want = rope_ext.apply_qk_norm_rotary(q, k, qw, kw, pos, cs)
    for qk_pl, pos_pl in ((Shard(1), R), (Shard(0), Shard(0)), (R, R)):
        dq, dk = d(q, qk_pl), d(k, qk_pl)
        args = (d(qw, R), d(kw, R), d(pos, pos_pl), d(cs, R))
        oq, ok = rope_ext.apply_qk_norm_rotary(dq, dk, *args)
        assert tuple(oq.placements) == (qk_pl,) and torch.equal(oq.full_tensor(), want[0])
        assert torch.equal(ok.full_tensor(), want[1])
        torch.ops.rope_ext.qk_norm_rotary_(dq, dk, args[0], args[1], args[2].unsqueeze(-1), args[3])
        assert tuple(dq.placements) == (qk_pl,) and torch.equal(dq.full_tensor(), want[0])

    # the packed op (the eager API's call on qkv): tokens sharded with the positions, or all replicated
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(DEVICE)
    want_qkv, qkv0 = qkv.clone(), qkv.clone()  # (a replicated DTensor shares its tensor's memory)
    torch.ops.rope_ext.qk_norm_rotary_packed_(want_qkv, Hq, Hk, Hk, qw, kw, pos, cs)
    for tok in (Shard(0), R):
        dqkv = d(qkv, tok)
        torch.ops.rope_ext.qk_norm_rotary_packed_(dqkv, Hq, Hk, Hk, d(qw, R), d(kw, R), d(pos, tok), d(cs, R))
        assert tuple(dqkv.placements) == (tok,) and torch.equal(dqkv.full_tensor(), want_qkv)
        dqkv = d(qkv0.clone(), tok)
        torch.ops.rope_ext.qk_norm_rotary_packed_.plain(
            dqkv, Hq, Hk, Hk, d(qw, R), d(kw, R), d(pos, tok), d(cs, R)
        )
        assert tuple(dqkv.placements) == (tok,) and torch.equal(dqkv.full_tensor(), want_qkv)

    slots = torch.randperm(4 * 16, generator=g)[:T].to(DEVICE)
    for layout, heads_dim in (("NHD", 2), ("HND", 1)):
        shape = (4, 16, Hk, D) if layout == "NHD" else (4, Hk, 16, D)
        kc, vc = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
        q1, k1, kc1, vc1 = q.clone(), k.clone(), kc.clone(), vc.clone()
        q0, k0 = q.clone(), k.clone()  # q and k as they are before any call of this layout
        rope_ext.apply_rotary_qk_and_cache_(q1, k1, v, pos, cs, kc1, vc1, slots, layout=layout)
        for pl, cache_pl in ((Shard(1), Shard(heads_dim)), (R, R)):
            dq, dk, dv = d(q, pl), d(k, pl), d(v, pl)
            dkc, dvc = d(kc, cache_pl), d(vc, cache_pl)
            rope_ext.apply_rotary_qk_and_cache_(
                dq, dk, dv, d(pos, R), d(cs, R), dkc, dvc, d(slots, R), layout=layout
            )
            assert tuple(dkc.placements) == (cache_pl,)
            assert torch.equal(dq.full_tensor(), q1) and torch.equal(dk.full_tensor(), k1)
            assert torch.equal(dkc.full_tensor(), kc1) and torch.equal(dvc.full_tensor(), vc1)
            if layout != "NHD":
                continue
            # the short overloads of the eager fast path (scales of a cache of q's dtype are ignored)
            ops = torch.ops.rope_ext
            one = d(torch.ones(1, device=DEVICE), R)
            for op, scales in ((ops.rotary_qk_cache_.plain, ()), (ops.rotary_qk_cache_.scaled, (one, one))):
                dq, dk, dv = d(q0.clone(), pl), d(k0.clone(), pl), d(v, pl)
                dkc, dvc = d(torch.zeros_like(kc), cache_pl), d(torch.zeros_like(vc), cache_pl)
                op(dq, dk, dv, d(pos, R), d(cs, R), dkc, dvc, d(slots, R), *scales)
                assert tuple(dkc.placements) == (cache_pl,) and tuple(dq.placements) == (pl,)
                assert torch.equal(dq.full_tensor(), q1) and torch.equal(dk.full_tensor(), k1)
                assert torch.equal(dkc.full_tensor(), kc1) and torch.equal(dvc.full_tensor(), vc1)
    return True


def _mla_cache(rank, world_size):
    """``mla_rotary_cache_`` on DTensors: q (and q_out) sharded on heads with kv_c, k_pe, the latent cache
    and the rest replicated, or everything replicated; each equal to the single-device result, placements
    kept. Plain (cache of q's dtype) and fp8 (q_out and cache with scales)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import rope_ext

    mesh = init_device_mesh(DEVICE, (world_size,))
    R = Replicate()
    g = torch.Generator().manual_seed(4)
    T, H, NOPE, ROPE, LORA = 8, 4, 16, 16, 32
    q = torch.randn(T, H, NOPE + ROPE, generator=g).to(DEVICE)
    kv = torch.randn(T, LORA + ROPE, generator=g).to(DEVICE)
    pos = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    cs = rope_ext.RopeCache(ROPE, max_positions=64).cos_sin.to(DEVICE)
    slots = torch.cat([torch.randperm(3 * 4, generator=g)[: T - 1], torch.tensor([-1])]).to(DEVICE)
    f8 = torch.float8_e4m3fn
    scale = torch.tensor([0.5], device=DEVICE)

    def d(t, pl):  # a clone: a replicated DTensor shares its tensor's memory, and every call mutates
        return distribute_tensor(t.clone(), mesh, [pl])

    for fp8 in (False, True):
        cache_dtype = f8 if fp8 else q.dtype
        kw = dict(rotary_offset=NOPE, interleaved=True)
        want_q, want_kpe = q.clone(), kv[:, LORA:].clone()
        want_cache = torch.zeros(3, 4, LORA + ROPE, device=DEVICE).to(cache_dtype)
        want_qo = torch.zeros(T, H, NOPE + ROPE, device=DEVICE).to(f8) if fp8 else None
        fp8_kw = dict(kv_scale=scale, q_out=want_qo, q_scale=scale) if fp8 else {}
        rope_ext.apply_mla_rotary_and_cache_(
            want_q, kv[:, :LORA], want_kpe, pos, cs, want_cache, slots, **kw, **fp8_kw
        )
        for pl in (Shard(1), R):
            for call in ("api", "op"):
                dq, dkpe = d(q, pl), d(kv[:, LORA:], R)
                dcache = d(torch.zeros_like(want_cache.view(torch.uint8)), R).view(cache_dtype)
                dqo = d(torch.zeros_like(want_qo.view(torch.uint8)), pl).view(f8) if fp8 else None
                extra = dict(kv_scale=d(scale, R), q_out=dqo, q_scale=d(scale, R)) if fp8 else {}
                args = (dq, d(kv[:, :LORA], R), dkpe, d(pos, R), d(cs, R), dcache, d(slots, R))
                if call == "api":
                    rope_ext.apply_mla_rotary_and_cache_(*args, **kw, **extra)
                else:
                    torch.ops.rope_ext.mla_rotary_cache_(*args, **kw, **extra)
                assert tuple(dq.placements) == (pl,) and tuple(dcache.placements) == (R,)
                assert torch.equal(dq.full_tensor(), want_q), (fp8, pl, call)
                assert torch.equal(dkpe.full_tensor(), want_kpe)
                u8 = torch.uint8
                assert torch.equal(dcache.full_tensor().view(u8), want_cache.view(u8)), (fp8, pl, call)
                if fp8:  # this rank's heads (gloo gathers no fp8)
                    assert tuple(dqo.placements) == (pl,)
                    mine = want_qo.view(u8).chunk(world_size, dim=1)[rank] if pl == Shard(1) else want_qo
                    assert torch.equal(dqo.to_local().view(u8), mine.view(u8)), (pl, call)
    return True


def _rerotate(rank, world_size):
    """``rerotate_kv_cache_`` on DTensors: the key cache sharded on its head dim (Shard(2) NHD, Shard(1) HND)
    or replicated, slot_mapping, delta, cos_sin and k_scale replicated; each equal to the single-device
    result, placements kept. Float (one shift per token, some slots -1, half-split) and fp8 (interleaved,
    rotary_offset, k_scale), through the API and the bare op; the API's int delta too."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import rope_ext

    mesh = init_device_mesh(DEVICE, (world_size,))
    R = Replicate()
    g = torch.Generator().manual_seed(5)
    NB, BS, HK, D, T = 3, 4, 4, 32, 8
    cs = rope_ext.RopeCache(16, max_positions=64).cos_sin.to(DEVICE)
    slots = torch.cat([torch.randperm(NB * BS, generator=g)[: T - 2], torch.tensor([-1, -1])]).to(DEVICE)
    delta = torch.randint(-63, 64, (T,), generator=g).to(DEVICE)
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    scale = torch.tensor([0.5], device=DEVICE)

    def d(t, pl):  # a clone: a replicated DTensor shares its tensor's memory, and every call mutates
        return distribute_tensor(t.clone(), mesh, [pl])

    for fp8 in (False, True):
        dtype = f8 if fp8 else torch.float32
        kw = dict(interleaved=True, rotary_offset=8) if fp8 else {}
        for layout, heads in (("NHD", 2), ("HND", 1)):
            shape = (NB, BS, HK, D) if layout == "NHD" else (NB, HK, BS, D)
            cache = (torch.randn(shape, generator=g) * 4).to(DEVICE).to(dtype)
            for shift in (delta, 3):
                want = cache.clone()
                k_scale = scale if fp8 else None
                rope_ext.rerotate_kv_cache_(want, slots, shift, cs, layout=layout, k_scale=k_scale, **kw)
                for pl in (Shard(heads), R):
                    for call in ("api", "op") if shift is delta else ("api",):
                        dc = d(cache.view(u8), pl).view(dtype) if fp8 else d(cache, pl)
                        ds = shift if isinstance(shift, int) else d(shift, R)
                        dk = d(scale, R) if fp8 else None
                        args = (dc, d(slots, R), ds, d(cs, R))
                        if call == "api":
                            rope_ext.rerotate_kv_cache_(*args, layout=layout, k_scale=dk, **kw)
                        else:
                            torch.ops.rope_ext.rerotate_kv_cache_(*args, k_scale=dk, layout=layout, **kw)
                        assert tuple(dc.placements) == (pl,), (fp8, layout, pl, call)
                        if fp8:  # this rank's heads (gloo gathers no fp8)
                            mine = want.chunk(world_size, dim=heads)[rank] if pl != R else want
                            same = torch.equal(dc.to_local().view(u8), mine.view(u8))
                        else:
                            same = torch.equal(dc.full_tensor(), want)
                        assert same, (fp8, layout, pl, call, shift)
    return True


def _page_table_cache(rank, world_size):
    """The cache writes placed by a page table on DTensors: GQA (NHD and HND; q, k, v sharded on heads with
    the caches on their head dim, or everything replicated) and MLA (q sharded on heads or replicated), the
    page table's tensors replicated (int32, then int64 without kv_last_page_len), through the API and the
    bare op; each equal to the single-device result, placements kept. A page table sharded on its one dim
    is redistributed (replicated) first, as a sharded slot_mapping is."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import rope_ext

    mesh = init_device_mesh(DEVICE, (world_size,))
    R = Replicate()
    g = torch.Generator().manual_seed(6)
    T, H, HK, D, NB, BS = 10, 4, 2, 32, 8, 4
    q, k, v = (torch.randn(T, h, D, generator=g).to(DEVICE) for h in (H, HK, HK))
    kv = torch.randn(T, 16 + D, generator=g).to(DEVICE)
    pos = torch.randint(0, 64, (T,), generator=g).to(DEVICE)
    cs = rope_ext.RopeCache(D, max_positions=64).cos_sin.to(DEVICE)
    # two requests: pages [3, 5] holding 6 entries, pages [1, 7, 2] holding 9; a token of request -1
    batch, entries = [0, 0, 0, 0, 1, 1, -1, 1, 1, 1], [2, 3, 4, 5, 3, 4, 0, 6, 7, 8]
    tables = [
        [batch, entries, [3, 5, 1, 7, 2], [0, 2, 5], [2, 1]],
        [batch, entries, [3, 5, 1, 7, 2], [0, 2, 5]],
    ]

    def d(t, pl):  # a clone: a replicated DTensor shares its tensor's memory, and every call mutates
        return distribute_tensor(t.clone(), mesh, [pl])

    for dtype, table in zip((torch.int32, torch.int64), tables, strict=True):
        pt = [torch.tensor(x, dtype=dtype, device=DEVICE) for x in table]
        for layout, heads in (("NHD", 2), ("HND", 1)):
            shape = (NB, BS, HK, D) if layout == "NHD" else (NB, HK, BS, D)
            kc, vc = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
            want = [q.clone(), k.clone(), kc.clone(), vc.clone()]
            rope_ext.apply_rotary_qk_and_cache_(
                *want[:2], v, pos, cs, *want[2:], page_table=pt, layout=layout
            )
            assert want[2].count_nonzero() > 0
            for pl, cache_pl, pt_pl in (
                (Shard(1), Shard(heads), R),
                (R, R, R),
                (Shard(1), Shard(heads), Shard(0)),
            ):
                for call in ("api", "op"):
                    dq, dk, dkc, dvc = d(q, pl), d(k, pl), d(kc, cache_pl), d(vc, cache_pl)
                    args = (dq, dk, d(v, pl), d(pos, R), d(cs, R), dkc, dvc)
                    dpt = [d(t, pt_pl) for t in pt]
                    if call == "api":
                        rope_ext.apply_rotary_qk_and_cache_(*args, page_table=dpt, layout=layout)
                    else:
                        torch.ops.rope_ext.rotary_qk_cache_(*args, None, layout=layout, page_table=dpt)
                    assert tuple(dq.placements) == (pl,) and tuple(dkc.placements) == (cache_pl,)
                    got = [t.full_tensor() for t in (dq, dk, dkc, dvc)]
                    assert all(map(torch.equal, got, want)), (dtype, layout, pl, pt_pl, call)
        # MLA: the latent cache [NB, BS, 16 + D] replicated
        want_q, want_kpe, want_cache = (
            q.clone(),
            kv[:, 16:].clone(),
            torch.zeros(NB, BS, 16 + D, device=DEVICE),
        )
        rope_ext.apply_mla_rotary_and_cache_(want_q, kv[:, :16], want_kpe, pos, cs, want_cache, page_table=pt)
        for pl, pt_pl in ((Shard(1), R), (R, R), (Shard(1), Shard(0))):
            for call in ("api", "op"):
                dq, dkpe, dcache = d(q, pl), d(kv[:, 16:], R), d(torch.zeros_like(want_cache), R)
                args = (dq, d(kv[:, :16], R), dkpe, d(pos, R), d(cs, R), dcache)
                dpt = [d(t, pt_pl) for t in pt]
                if call == "api":
                    rope_ext.apply_mla_rotary_and_cache_(*args, page_table=dpt)
                else:
                    torch.ops.rope_ext.mla_rotary_cache_(*args, None, page_table=dpt)
                assert tuple(dq.placements) == (pl,) and tuple(dcache.placements) == (R,)
                assert torch.equal(dq.full_tensor(), want_q) and torch.equal(dkpe.full_tensor(), want_kpe)
                assert torch.equal(dcache.full_tensor(), want_cache), (dtype, pl, pt_pl, call)
    return True


@pytest.mark.slow
def test_page_table_cache_on_two_ranks():
    assert run_ranks(_page_table_cache, 2, timeout=240) == [True, True]


@pytest.mark.slow
def test_rerotate_on_two_ranks():
    assert run_ranks(_rerotate, 2, timeout=240) == [True, True]


@pytest.mark.slow
def test_mla_cache_on_two_ranks():
    assert run_ranks(_mla_cache, 2, timeout=240) == [True, True]


@pytest.mark.slow
def test_serving_ops_on_two_ranks():
    assert run_ranks(_serving_ops, 2, timeout=240) == [True, True]


@pytest.mark.slow
def test_placements_on_two_ranks():
    assert run_ranks(_placements_1d, 2, timeout=240) == [True, True]


@pytest.mark.slow
def test_placements_on_a_2d_mesh():
    assert run_ranks(_placements_2d, 4, timeout=240) == [True] * 4


@pytest.mark.slow
def test_compiled_dtensor_forward():
    assert run_ranks(_compiled, 2, timeout=240) == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", [[16], [8, 4, 12, 0, 20]], ids=["one-sequence", "packed"])
def test_context_parallel_ranks_gather_to_the_full_rotation(cp, lengths):
    lengths = [n * cp for n in lengths]  # padded lengths: multiples of 2 * cp
    assert run_ranks(_context_parallel, cp, lengths, timeout=240) == [True] * cp


def test_rules_are_registered_on_import():
    from torch.distributed.tensor import DTensor

    import rope_ext  # noqa: F401

    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    for op in (
        "rotary",
        "rotary_qk",
        "rotary_qk_",
        "qk_norm_rotary",
        "qk_norm_rotary_",
        "rotary_qk_cache_",
        "mla_rotary_cache_",
        "rerotate_kv_cache_",
        "qk_norm_rotary_packed_",
    ):
        packet = getattr(torch.ops.rope_ext, op)
        for overload in packet.overloads():  # .plain and .scaled too
            assert getattr(packet, overload) in strategies, (op, overload)


# A fresh process: a DTensor call with q / k sharded on heads on a one-rank gloo group. The rules come from
# the import hook when rope_ext is imported first (it must not import torch.distributed.tensor itself),
# from rope_ext's import when torch.distributed.tensor is already loaded.
_FRESH_DTENSOR_CALL = """
import sys

import torch
import torch.distributed as dist

if sys.argv[1] == "rope_ext_first":
    import rope_ext

    assert "torch.distributed.tensor" not in sys.modules, "import rope_ext imported torch.distributed.tensor"
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
else:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    import rope_ext

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 4, 32, generator=g), torch.randn(2, 8, 2, 32, generator=g)
    pos = torch.randint(0, 64, (2, 8, 1), generator=g)
    cs = rope_ext.RopeCache(32, max_positions=64).cos_sin
    want_q, want_k = rope_ext.apply_rotary_qk(q, k, pos, cs)
    dq, dk = distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(k, mesh, [Shard(2)])
    dp, dc = distribute_tensor(pos, mesh, [Replicate()]), distribute_tensor(cs, mesh, [Replicate()])
    oq, ok = rope_ext.apply_rotary_qk(dq, dk, dp, dc)
    assert tuple(oq.placements) == (Shard(2),), oq.placements
    assert torch.equal(oq.full_tensor(), want_q) and torch.equal(ok.full_tensor(), want_k)
finally:
    dist.destroy_process_group()
print("ok")
"""


@pytest.mark.parametrize("order", ["rope_ext_first", "dtensor_first"])
def test_dtensor_call_in_a_fresh_process(order):
    """The sharding rules are in place for the first DTensor call whichever of rope_ext and
    torch.distributed.tensor is imported first (without them the call raises: no sharding strategy)."""
    import subprocess
    import sys

    from _helpers import child_env  # here, not at the top: the ranks' processes import this file

    done = subprocess.run(
        [sys.executable, "-c", _FRESH_DTENSOR_CALL, order],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_no_communication_code_of_our_own():
    """rope_ext supplies sharding rules and positions; every collective is torch.distributed's own choice."""
    import re
    from pathlib import Path

    calls = re.compile(
        r"\b(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|send|recv|barrier)\s*\("
    )
    root = Path(__file__).resolve().parents[1] / "rope_ext"
    offenders = [str(p) for p in root.rglob("*.py") if calls.search(p.read_text())]
    assert offenders == []

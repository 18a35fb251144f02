"""The ONNX graphs of the rotation, the QK RMSNorm and the KV-cache write, built with ONNX Script ops while
torch's exporter traces a translation (its evaluator records every op called here as a node).

Arguments are the exporter's values (``onnx_ir.Value``: a shape whose dims are ints or symbolic, a dtype)
and Python constants. Every graph is exact in the sense of the kernels' definitions: the same gathers,
selections and roundings, float32 arithmetic (float64 for float64 inputs), one rounding to the output dtype.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript
from onnxscript import opset18 as op
from onnxscript import opset23 as op23

from ..reference import mrope_rows

__all__ = ["ExportError", "cache_write", "page_slots", "rms_norm", "rotate", "target_opset"]

RotaryEmbedding_OPSET = 23
_FLOAT8 = {ir.DataType.FLOAT8E4M3FN: 448.0, ir.DataType.FLOAT8E5M2: 57344.0}


class ExportError(ValueError):
    """A rope_ext call that the ONNX export cannot express; the message names the op and the option."""


def target_opset() -> int:
    """The ai.onnx opset of the model being exported (the version of the tracing evaluator's opset)."""
    opset = getattr(onnxscript.evaluator.default(), "opset", None)
    return int(getattr(opset, "version", 18))


def static_dim(dim, what: str, op_name: str) -> int:
    """``dim`` (of a value's shape) as an int, or :class:`ExportError` when it is dynamic."""
    if not isinstance(dim, int):
        raise ExportError(
            f"rope_ext.onnx: {op_name}: a dynamic {what} cannot be exported (the graph slices and reshapes "
            "by it, and RotaryEmbedding takes it as an attribute); export with a static one"
        )
    return dim


def _const(array: np.ndarray) -> ir.Value:
    return op.Constant(value=ir.tensor(array))


def _i64(values: list[int]) -> ir.Value:
    return _const(np.array(values, dtype=np.int64))


def compute_dtype(dtype: ir.DataType) -> ir.DataType:
    """The kernels' arithmetic: float64 for float64 tensors, float32 for every other dtype."""
    return ir.DataType.DOUBLE if dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT


def cast(x: ir.Value, dtype: ir.DataType) -> ir.Value:
    return x if x.dtype == dtype else op.Cast(x, to=dtype)


def align_positions(positions: ir.Value, n: int, mrope: bool) -> tuple[ir.Value, list]:
    """``positions`` (int64) with the rank ``n`` of ``x.shape[:-1]`` after the leading section dim of MRoPE,
    by the positions rule (README, "Positions"): a lower rank broadcasts from the right (``[T]`` against
    ``[T, H]`` in the token-major ops is ``[T, 1]``). Returns the value and its ``n`` dims (an int, or None
    where dynamic), without the section dim."""
    lead = 1 if mrope else 0
    dims = list(positions.shape)[lead:]
    r = len(dims)
    floating = positions.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)  # frequencies' positions
    p = op.Cast(positions, to=ir.DataType.DOUBLE if floating else ir.DataType.INT64)
    if r < n and not (r == 0 or dims[-1] == 1) and r == n - 1:
        p, dims = op.Unsqueeze(p, [lead + r]), [*dims, 1]  # [T] of the token-major ops: [T, 1]
    elif r < n:
        p, dims = op.Unsqueeze(p, list(range(lead, lead + n - r))), [1] * (n - r) + dims
    return p, [d if isinstance(d, int) else None for d in dims]


def rows_of(cos_sin: ir.Value, p: ir.Value, dtype: ir.DataType) -> ir.Value:
    """The cos/sin rows ``[*p, rotary_dim]`` of positions ``p`` in ``dtype``: gathered from a table, or, for
    frequencies (``cos_sin [rotary_dim]``: each pair's frequency, then its factor), computed in float64
    (``cos(p f) * a``; ONNX Runtime's cos of the rounded product, not the kernels' exact angle)."""
    if len(cos_sin.shape) == 2:
        return op.Gather(cast(cos_sin, dtype), p, axis=0)
    rd = static_dim(cos_sin.shape[-1], "rotary_dim (cos_sin.shape[-1])", "the table-free rows")
    f, a = _split(cast(cos_sin, ir.DataType.DOUBLE), [0, rd // 2, rd])
    angle = op.Mul(op.Unsqueeze(op.Cast(p, to=ir.DataType.DOUBLE), [-1]), f)
    return cast(op.Concat(op.Mul(op.Cos(angle), a), op.Mul(op.Sin(angle), a), axis=-1), dtype)


def _split(x: ir.Value, bounds: list[int]) -> list[ir.Value]:
    """``x[..., a:b]`` for consecutive ``bounds``, made one after the other before any is used: ONNX
    Script's optimizer merges complementary slices into one Split, placed at the last of them."""
    return [op.Slice(x, [a], [b], [-1]) for a, b in zip(bounds, bounds[1:], strict=False)]


def rotate(
    x: ir.Value,
    positions: ir.Value,
    cos_sin: ir.Value,
    *,
    op_name: str,
    shape: list | None = None,
    dtype: ir.DataType | None = None,
    interleaved: bool = False,
    inverse: bool = False,
    rotary_offset: int = 0,
    mrope_section=None,
    mrope_interleaved: bool = False,
) -> ir.Value:
    """The rotation of ``x [..., D]`` (any dtype the ops take) by ``cos_sin[positions]``, in x's dtype.
    ``shape``, ``dtype``: x's, where x is a value the translation made (which has none recorded).

    RotaryEmbedding (opset 23) where it computes the same thing: one position per token, and x not float64
    (its type constraint has no double); the features before ``rotary_offset`` are sliced off and
    concatenated back, the sin table is negated for ``inverse``. MRoPE, float64 and opsets below 23 get
    the decomposition (:func:`_rotate_decomposed`)."""
    shape = list(x.shape) if shape is None else shape
    dtype = x.dtype if dtype is None else dtype
    n = len(shape) - 1
    d = static_dim(shape[-1], "head_dim (x.shape[-1])", op_name)
    rd = static_dim(cos_sin.shape[-1], "rotary_dim (cos_sin.shape[-1])", op_name)
    p, pdims = align_positions(positions, n, mrope_section is not None)
    work = compute_dtype(dtype)
    xc = op.Cast(x, to=work) if dtype != work else x
    use_op = target_opset() >= RotaryEmbedding_OPSET and mrope_section is None and work == ir.DataType.FLOAT
    if use_op:
        y = _rotate_with_op(xc, shape[:-1], p, pdims, cos_sin, d, rd, interleaved, inverse, rotary_offset)
    else:
        y = _rotate_decomposed(
            xc,
            work,
            p,
            cos_sin,
            n,
            d,
            rd,
            interleaved,
            inverse,
            rotary_offset,
            mrope_section,
            mrope_interleaved,
        )
    return op.Cast(y, to=dtype) if dtype != work else y


def _rotate_with_op(x, xs, p, pdims, cos_sin, d, rd, interleaved, inverse, offset) -> ir.Value:
    """RotaryEmbedding on x (float32) in its 3-D form ``[tokens, 1, heads * D]``, with the cos/sin rows of
    each token gathered from the table as its 3-D caches ``[tokens, 1, rd/2]`` (no position_ids).

    The heads are the trailing static dims of x that positions broadcast over, every dim before them a token
    dim (positions expanded over those they broadcast over): any layout without a transpose (``[B, H, S,
    D]`` with positions ``[B, 1, S]`` is ``B * H * S`` tokens of one head). Gathering the rows first makes
    a call cost what its tokens cost, whatever the table's length (the ``[P, rd/2]`` caches with
    position_ids would be sliced from a table that is not constant on every call), and a sequence length
    of 1 keeps clear of ONNX Runtime's limit of a sequence no longer than the cos cache."""
    n = len(pdims)
    pre, xt = _split(x, [0, offset, d]) if offset else (None, x)
    width = d - offset
    k = n
    while k > 0 and pdims[k - 1] == 1 and isinstance(xs[k - 1], int):
        k -= 1
    heads = int(np.prod(xs[k:], dtype=np.int64))
    if any(pdims[i] == 1 and xs[i] != 1 for i in range(k)):
        target = op.Shape(x, start=0, end=k)
        p = op.Expand(p, op.Concat(target, _i64([1] * (n - k)), axis=0) if k < n else target)
    rows = rows_of(cos_sin, op.Reshape(p, [-1]), ir.DataType.FLOAT)  # [tokens, rd]
    cos, sin = _split(rows, [0, rd // 2, rd])
    if inverse:
        sin = op.Neg(sin)
    y = op23.RotaryEmbedding(
        op.Reshape(xt, [-1, 1, heads * width]),
        op.Unsqueeze(cos, [1]),
        op.Unsqueeze(sin, [1]),
        interleaved=int(interleaved),
        rotary_embedding_dim=0 if rd == width else rd,
        num_heads=heads,
    )
    y = op.Reshape(y, op.Shape(xt))
    return op.Concat(pre, y, axis=-1) if offset else y


def _rotate_decomposed(
    x, dtype, p, cos_sin, n, d, rd, interleaved, inverse, offset, mrope_section, mrope_interleaved
):
    """Gather of the cos/sin rows of every position (MRoPE: of the row of each position axis, then each
    pair's axis picked with Where), ``y1 = x1 c - x2 s``, ``y2 = x2 c + x1 s``, the pairs put back with
    Concat."""
    h = rd // 2
    rows = rows_of(cos_sin, p, dtype)  # [*p, rd] (MRoPE: [axes, *p, rd])
    c, s = _split(rows, [0, h, rd])
    if mrope_section is not None:  # rows [axes, *p, rd]: pair j takes the row of its axis
        sec = mrope_rows(h, tuple(mrope_section), mrope_interleaved).numpy()
        axes = [a for a in range(len(mrope_section)) if (sec == a).any()]

        def pick(t):
            out = op.Gather(t, axes[-1], axis=0)
            for a in reversed(axes[:-1]):
                out = op.Where(_const(sec == a), op.Gather(t, a, axis=0), out)
            return out

        c, s = pick(c), pick(s)
    if inverse:
        s = op.Neg(s)
    pieces = _split(x, sorted({0, offset, offset + rd, d}))  # [before offset], rotated, [after]
    rot = pieces[1] if offset else pieces[0]
    if interleaved:
        pairs = op.Reshape(rot, [0] * n + [h, 2])
        x1, x2 = op.Gather(pairs, 0, axis=-1), op.Gather(pairs, 1, axis=-1)
    else:
        x1, x2 = op.Slice(rot, [0], [h], [-1]), op.Slice(rot, [h], [rd], [-1])
    y1 = op.Sub(op.Mul(x1, c), op.Mul(x2, s))
    y2 = op.Add(op.Mul(x2, c), op.Mul(x1, s))
    if interleaved:
        y = op.Reshape(op.Concat(op.Unsqueeze(y1, [-1]), op.Unsqueeze(y2, [-1]), axis=-1), [0] * n + [rd])
    else:
        y = op.Concat(y1, y2, axis=-1)
    parts = [pieces[0], y] if offset else [y]
    if offset + rd < d:
        parts.append(pieces[-1])
    return op.Concat(*parts, axis=-1) if len(parts) > 1 else y


def rms_norm(x: ir.Value, dtype: ir.DataType, weight: ir.Value, eps: float, weight_offset: float) -> ir.Value:
    """``x / sqrt(mean(x^2) + eps) * (weight + weight_offset)`` over the last dim in float32 (float64 for
    float64 x), rounded once to x's ``dtype`` (the QK norm hands the rotation the activation dtype)."""
    work = compute_dtype(dtype)
    xf = op.Cast(x, to=work) if dtype != work else x
    inv = op.Reciprocal(op.Sqrt(op.Add(op.ReduceMean(op.Mul(xf, xf), [-1], keepdims=1), eps)))
    w = cast(weight, work)
    if weight_offset:
        w = op.Add(w, weight_offset)
    y = op.Mul(op.Mul(xf, inv), w)
    return op.Cast(y, to=dtype) if dtype != work else y


def quantize(x: ir.Value, scale: ir.Value | None, dtype: ir.DataType) -> ir.Value:
    """``x`` (of the cache's dtype, or for an fp8 cache of a float dtype) stored in a cache of ``dtype``:
    as it is, or for fp8 ``x / scale`` in float32, clipped to the finite range (NaN kept) and rounded to
    nearest even (rope_ext.reference.quantize_fp8)."""
    if dtype not in _FLOAT8:
        return x
    y = op.Cast(x, to=ir.DataType.FLOAT)
    if scale is not None:
        y = op.Div(y, op.Reshape(cast(scale, ir.DataType.FLOAT), _i64([])))
    m = _FLOAT8[dtype]
    return op23.Cast(op.Clip(y, -m, m), to=dtype, saturate=1)


def cache_write(
    x: ir.Value, cache: ir.Value, slots: ir.Value, scale: ir.Value | None, layout: str
) -> ir.Value:
    """``cache`` with the rows of ``x [T, H, D]`` stored at ``slots [T']`` (vLLM's paged write): the tokens
    ``t < T'`` with ``slots[t] >= 0`` (NonZero, Gather), ScatterND at block ``slot // block_size``, row
    ``slot % block_size``; ``"NHD"`` caches ``[blocks, block_size, H, D]``, ``"HND"`` ``[blocks, H,
    block_size, D]``. fp8 caches are written through float32 (ScatterND has no fp8 types; the conversions
    both ways are exact)."""
    tokens, index = _slot_rows(slots, cache, layout)
    return _scatter(cache, index, quantize(op.Gather(x, tokens, axis=0), scale, cache.dtype))


def page_slots(page_table, cache: ir.Value, layout: str) -> ir.Value:
    """The slots ``[T']`` (int64) of FlashInfer's page table ``(batch_indices, positions, kv_indices,
    kv_indptr[, kv_last_page_len])`` (int32 or int64) in a paged ``cache``, as the kernels find them
    (csrc/rope/serving.h, ``page_slot``): token t of request ``b = batch_indices[t]`` at entry ``e =
    positions[t]`` goes to ``kv_indices[kv_indptr[b] + e // block_size] * block_size + e % block_size``;
    -1 (not written) where ``b`` is -1 and wherever the table cannot place the token (a request outside
    ``kv_indptr``, pages out of order, ``e`` outside the request's pages or at or past ``kv_last_page_len``
    in its last page, a page outside the cache), as the CUDA kernels skip it. Every Gather reads a table
    padded with one entry, which the index of a token that is not placed points at: in range whatever
    the table holds."""
    tables = [op.Cast(t, to=ir.DataType.INT64) for t in page_table]
    batch, entry, indices, indptr = tables[:4]
    shape = op.Shape(cache)
    block_size = op.Gather(shape, 1 if layout == "NHD" else 2, axis=0)
    blocks = op.Gather(shape, 0, axis=0)
    size = op.Size(indptr)
    n_requests, n_indices = op.Sub(size, 1), op.Size(indices)

    def read(table: ir.Value, index: ir.Value, ok: ir.Value, end: ir.Value) -> ir.Value:
        padded = op.Concat(table, _i64([-1]), axis=0)  # entry ``end``: what a token not placed reads
        return op.Gather(padded, op.Where(ok, index, end), axis=0)

    ok = op.And(op.GreaterOrEqual(batch, 0), op.Less(batch, n_requests))
    first = read(indptr, batch, ok, size)
    end = read(indptr, op.Add(batch, 1), ok, size)
    ok = op.And(ok, op.And(op.GreaterOrEqual(first, 0), op.LessOrEqual(first, end)))
    ok = op.And(ok, op.LessOrEqual(end, n_indices))
    safe = op.Max(block_size, _i64([1]))  # a cache of 0 rows per block places nothing (ok below)
    in_page, row = op.Div(entry, safe), op.Mod(entry, safe)
    pages = op.Sub(end, first)
    ok = op.And(ok, op.And(op.GreaterOrEqual(entry, 0), op.Less(in_page, pages)))
    ok = op.And(ok, op.Greater(block_size, 0))
    if len(tables) == 5:
        last = read(tables[4], batch, ok, n_requests)
        in_range = op.And(op.GreaterOrEqual(last, 0), op.LessOrEqual(last, block_size))
        in_last = op.And(op.Equal(in_page, op.Sub(pages, 1)), op.GreaterOrEqual(row, last))
        ok = op.And(ok, op.And(in_range, op.Not(in_last)))
    page = read(indices, op.Add(first, in_page), ok, n_indices)
    ok = op.And(ok, op.And(op.GreaterOrEqual(page, 0), op.Less(page, blocks)))
    return op.Where(ok, op.Add(op.Mul(page, block_size), row), _i64([-1]))


def _slot_rows(slots: ir.Value, cache: ir.Value, layout: str) -> tuple[ir.Value, ir.Value]:
    """The tokens with a slot (``slots[t] >= 0``), and the ScatterND / GatherND index of their rows ``[N,
    H, D]`` in a paged cache: ``[N, 2]`` (NHD), ``[N, H, 3]`` (HND)."""
    slots = op.Cast(slots, to=ir.DataType.INT64)
    tokens = op.Reshape(op.NonZero(op.GreaterOrEqual(slots, 0)), [-1])
    written = op.Gather(slots, tokens, axis=0)
    bs_axis = 1 if layout == "NHD" else 2
    block_size = op.Gather(op.Shape(cache), bs_axis, axis=0)
    block, row = op.Div(written, block_size), op.Mod(written, block_size)
    if layout == "NHD":
        return tokens, op.Concat(op.Unsqueeze(block, [-1]), op.Unsqueeze(row, [-1]), axis=-1)
    heads = op.Gather(op.Shape(cache), 1, axis=0)
    shape = op.Concat(op.Shape(written), op.Reshape(heads, [1]), _i64([1]), axis=0)  # [N, H, 1]
    h = op.Reshape(op.Range(0, heads, 1), [1, -1, 1])
    index = op.Concat(
        op.Expand(op.Reshape(block, [-1, 1, 1]), shape),
        op.Expand(h, shape),
        op.Expand(op.Reshape(row, [-1, 1, 1]), shape),
        axis=-1,
    )
    return tokens, index


def _scatter(cache: ir.Value, index: ir.Value, rows: ir.Value) -> ir.Value:
    """ScatterND of rows of the cache's dtype; fp8 through float32 (ScatterND has no fp8 types; the
    conversions both ways are exact)."""
    if cache.dtype in _FLOAT8:
        full = op.ScatterND(op.Cast(cache, to=ir.DataType.FLOAT), index, op.Cast(rows, to=ir.DataType.FLOAT))
        return op23.Cast(full, to=cache.dtype, saturate=1)
    return op.ScatterND(cache, index, rows)


def rerotate_rows(
    cache: ir.Value, slots: ir.Value, delta: ir.Value, cos_sin: ir.Value, scale: ir.Value | None, *,
    layout: str, interleaved: bool, rotary_offset: int, op_name: str,
) -> ir.Value:  # fmt: skip
    """``cache`` with the rows at ``slots`` rotated by ``delta`` positions (rerotate_kv_cache_): the
    rows gathered (GatherND; fp8 through float32), each token's cos/sin row ``|delta|`` gathered with the
    sin negated for a negative delta, the rotated features computed in float32 (float64 for float64; fp8
    dequantized times ``scale``) and rounded (fp8: quantized) once, the pass-through features kept as
    stored, then scattered back."""
    d = static_dim(cache.shape[-1], "head_dim (key_cache.shape[-1])", op_name)
    rd = static_dim(cos_sin.shape[-1], "rotary_dim (cos_sin.shape[-1])", op_name)
    h, off = rd // 2, rotary_offset
    tokens, index = _slot_rows(slots, cache, layout)
    every = op.Shape(op.Cast(slots, to=ir.DataType.INT64))  # delta: [T], or one for all
    freqs = len(cos_sin.shape) == 1  # frequencies: the rows of the signed shifts, as they are
    shift_type = ir.DataType.DOUBLE if freqs else ir.DataType.INT64
    shift = op.Expand(op.Reshape(op.Cast(delta, to=shift_type), [-1]), every)
    shift = op.Gather(shift, tokens, axis=0)
    fp8 = cache.dtype in _FLOAT8
    work = ir.DataType.FLOAT if fp8 else compute_dtype(cache.dtype)
    rows = op.GatherND(op.Cast(cache, to=ir.DataType.FLOAT) if fp8 else cache, index)  # [N, H, D]
    # the features before, the rotated ones, the features after (the non-empty ones), sliced at once
    bounds = [0, *([off] if off else []), off + rd, *([d] if off + rd < d else [])]
    pieces = _split(rows, bounds)
    x = cast(pieces[1 if off else 0], work)
    if fp8 and scale is not None:
        x = op.Mul(x, op.Reshape(cast(scale, work), _i64([])))
    table = rows_of(cos_sin, shift if freqs else op.Abs(shift), work)  # [N, rd]
    c, s = (op.Unsqueeze(t, [1]) for t in _split(table, [0, h, rd]))  # [N, 1, h]
    if not freqs:
        s = op.Where(op.Reshape(op.Less(shift, 0), [-1, 1, 1]), op.Neg(s), s)
    if interleaved:
        x1, x2 = (op.Squeeze(t, [-1]) for t in _split(op.Reshape(x, [0, 0, h, 2]), [0, 1, 2]))
    else:
        x1, x2 = _split(x, [0, h, rd])
    y1 = op.Sub(op.Mul(x1, c), op.Mul(x2, s))
    y2 = op.Add(op.Mul(x2, c), op.Mul(x1, s))
    if interleaved:
        y = op.Reshape(op.Concat(op.Unsqueeze(y1, [-1]), op.Unsqueeze(y2, [-1]), axis=-1), [0, 0, rd])
    else:
        y = op.Concat(y1, y2, axis=-1)
    # fp8: quantized, then back to float32 (exact) beside the stored features; else rounded to the dtype
    y = op.Cast(quantize(y, scale, cache.dtype), to=ir.DataType.FLOAT) if fp8 else cast(y, cache.dtype)
    parts = [y if i == (1 if off else 0) else piece for i, piece in enumerate(pieces)]
    return _scatter(cache, index, op.Concat(*parts, axis=-1) if len(parts) > 1 else y)

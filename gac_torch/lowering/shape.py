"""gac data-movement ops -> tensor / linalg ops."""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, linalg, scf, tensor

from gac_torch.ir.builder import op_attrs
from gac_torch.ir.types import is_float
from gac_torch.lowering.core import (
    PARALLEL, add_sizes, broadcast_map, compute_type, const, convert, elem, empty, extract_slice, generic,
    identity_map, index, index_type, insert_slice, pad_constant, reshape, shape,
)
from gac_torch.lowering.registry import lowers

I = arith.CmpIPredicate


@lowers("reshape", moves_data_only=True)
def lower_reshape(op, operands):
    return [reshape(operands[0], shape(op.results[0]))]


@lowers("transpose", moves_data_only=True)
def lower_transpose(op, operands):
    (x,) = operands
    perm = op_attrs(op)["perm"]
    return [linalg.transpose(x, outs=[empty(shape(op.results[0]), elem(x))], permutation=perm).results[0]]


@lowers("broadcast", moves_data_only=True)
def lower_broadcast(op, operands):
    x = operands[0]  # (the rest: run-time sizes, already in shape(result))
    out_shape = shape(op.results[0])
    rank = len(out_shape)
    return generic([x], [broadcast_map(shape(x), out_shape)], [empty(out_shape, elem(x))],
                   [identity_map(rank)], [PARALLEL] * rank, lambda v, _o: [v])


@lowers("slice", moves_data_only=True)
def lower_slice(op, operands):
    a = op_attrs(op)
    return [extract_slice(operands[0], a["starts"], shape(op.results[0]), a["strides"])]


@lowers("concat", moves_data_only=True)
def lower_concat(op, operands):
    out_shape = shape(op.results[0])
    dim = op_attrs(op)["dim"] % len(out_shape)
    acc = empty(out_shape, elem(operands[0]))
    offset = 0
    for v in operands:
        offsets = [0] * len(out_shape)
        offsets[dim] = offset
        acc = insert_slice(v, acc, offsets)
        offset = add_sizes(offset, shape(v)[dim])
    return [acc]


def _clamp_index(i, size, mode):
    """Source index for an out-of-range position under reflect / replicate padding."""
    i64 = i.type
    if mode == "replicate":
        return arith.minsi(arith.maxsi(i, const(0, i64)), const(size - 1, i64))
    # reflect (edge not repeated): -k -> k, size-1+k -> size-1-k
    r = arith.select(arith.cmpi(I.slt, i, const(0, i64)), arith.subi(const(0, i64), i), i)
    over = arith.subi(r, const(size - 1, i64))
    return arith.select(arith.cmpi(I.sgt, over, const(0, i64)),
                        arith.subi(const(size - 1, i64), over), r)


@lowers("pad", moves_data_only=True)
def lower_pad(op, operands):
    (x,) = operands
    a = op_attrs(op)
    low, high = list(a["low"]), list(a["high"])
    xs = shape(x)
    if a["mode"] == "replicate":  # out[i] = x[clamp(i - low)], negative low/high included (ATen)
        return [_gather_padded(x, shape(op.results[0]), low, high, "replicate")]
    # Negative padding crops first.
    crop_lo = [max(0, -v) for v in low]
    crop_hi = [max(0, -v) for v in high]
    if any(crop_lo) or any(crop_hi):
        x = extract_slice(x, crop_lo, [s - lo - hi for s, lo, hi in zip(xs, crop_lo, crop_hi)],
                          [1] * len(xs))
        xs = shape(x)
    low, high = [max(0, v) for v in low], [max(0, v) for v in high]
    if a["mode"] == "constant":
        return [pad_constant(x, low, high, a["value"])]
    return [_gather_padded(x, shape(op.results[0]), low, high, a["mode"])]


def _gather_padded(x, out_shape, low, high, mode: str):
    xs = shape(x)
    rank = len(out_shape)

    def body(_out):
        i64 = ir.IntegerType.get_signless(64)
        idx = []
        for d in range(rank):
            i = arith.subi(index(d), const(low[d], i64))
            if low[d] or high[d]:
                i = _clamp_index(i, xs[d], mode)
            idx.append(arith.index_cast(index_type(), i))
        return [tensor.ExtractOp(x, idx).result]

    return generic([], [], [empty(out_shape, elem(x))], [identity_map(rank)], [PARALLEL] * rank, body)[0]


def _wrap(i, size):
    """Negative indices count from the end (as in ATen); `size` an int or a run-time index."""
    n = arith.index_cast(i.type, size) if isinstance(size, ir.Value) else const(size, i.type)
    return arith.select(arith.cmpi(I.slt, i, const(0, i.type)), arith.addi(i, n), i)


@lowers("gather", moves_data_only=True)
def lower_gather(op, operands):
    x, idx = operands
    dim = op_attrs(op)["dim"] % len(shape(x))
    out_shape = shape(op.results[0])
    rank = len(out_shape)
    size = shape(x)[dim]

    def body(j, _out):
        coords = [arith.index_cast(index_type(), _wrap(j, size)) if d == dim
                  else arith.index_cast(index_type(), index(d)) for d in range(rank)]
        return [tensor.ExtractOp(x, coords).result]

    return generic([idx], [identity_map(rank)], [empty(out_shape, elem(x))], [identity_map(rank)],
                   [PARALLEL] * rank, body)


@lowers("index_select", moves_data_only=True)
def lower_index_select(op, operands):
    x, idx = operands
    xs = shape(x)
    dim = op_attrs(op)["dim"] % len(xs)
    out_shape = shape(op.results[0])
    rank = len(out_shape)
    idx_map = ir.AffineMap.get(rank, 0, [ir.AffineDimExpr.get(dim)])

    def body(j, _out):
        coords = [arith.index_cast(index_type(), _wrap(j, xs[dim])) if d == dim
                  else arith.index_cast(index_type(), index(d)) for d in range(rank)]
        return [tensor.ExtractOp(x, coords).result]

    return generic([idx], [idx_map], [empty(out_shape, elem(x))], [identity_map(rank)],
                   [PARALLEL] * rank, body)


def _scatter_combine(kind: str, old: ir.Value, new: ir.Value, logical_bool: bool) -> ir.Value:
    if kind == "none":
        return new
    e = old.type
    if logical_bool:  # 0/1 bytes: add is "or", mul is "and"
        kind = {"add": "max", "mul": "min"}.get(kind, kind)
    ct = compute_type(e)
    a, b = convert(old, ct), convert(new, ct)
    if is_float(ct):
        r = {"add": arith.addf, "mul": arith.mulf, "max": arith.maximumf, "min": arith.minimumf}[kind](a, b)
    else:
        r = {"add": arith.addi, "mul": arith.muli, "max": arith.maxsi, "min": arith.minsi}[kind](a, b)
    return convert(r, e)


@lowers("scatter", moves_data_only=True)
def lower_scatter(op, operands):
    """A loop nest over the index tensor, in order, updating y in place (scf.for over tensors:
    the stores are data-dependent, which no linalg op expresses). Later duplicates win."""
    x, idx, src = operands
    a = op_attrs(op)
    xs, ix = shape(x), shape(idx)
    dim = a["dim"] % len(xs)
    logical_bool = str(elem(op.results[0].type)) == "i1"
    c0, c1 = arith.ConstantOp(index_type(), 0).result, arith.ConstantOp(index_type(), 1).result

    def nest(d: int, coords: list, y: ir.Value) -> ir.Value:
        if d == len(ix):
            j = tensor.ExtractOp(idx, coords).result
            j = arith.index_cast(index_type(), _wrap(j, xs[dim]))
            at = [j if k == dim else c for k, c in enumerate(coords)]
            v = tensor.ExtractOp(src, coords).result
            old = tensor.ExtractOp(y, at).result
            return tensor.InsertOp(_scatter_combine(a["reduce"], old, v, logical_bool), y, at).result
        loop = scf.ForOp(c0, arith.ConstantOp(index_type(), ix[d]).result, c1, [y])
        with ir.InsertionPoint(loop.body):
            scf.YieldOp([nest(d + 1, coords + [loop.induction_variable], loop.inner_iter_args[0])])
        return loop.results[0]

    return [nest(0, [], x)]


@lowers("dim", moves_data_only=True)
def lower_dim(op, operands):
    return [tensor.DimOp(operands[0], const(op_attrs(op)["dim"] % len(shape(operands[0])), index_type())).result]


@lowers("from_size", moves_data_only=True)
def lower_from_size(op, operands):
    i64 = ir.IntegerType.get_signless(64)
    return [tensor.FromElementsOp(ir.RankedTensorType.get([], i64), [arith.index_cast(i64, operands[0])]).result]

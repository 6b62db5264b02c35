"""gac reductions and normalizations -> linalg.generic with reduction iterators."""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith
from mlir.dialects import math as mmath

from gac_torch.ir.builder import op_attrs
from gac_torch.ir.types import is_bool, is_float
from gac_torch.lowering.core import (
    PARALLEL, REDUCTION, accumulator_type, compute_type, const, convert, dim_map,
    elem, elementwise, extract_slice, full, generic, highest, identity_map, index, lowest,
    pad_constant, reshape, shape,
)
from gac_torch.lowering.registry import lowers

F = arith.CmpFPredicate
I = arith.CmpIPredicate


def _combine(kind: str, a: ir.Value, b: ir.Value) -> ir.Value:
    fl = is_float(a.type)
    if kind == "sum":
        return arith.addf(a, b) if fl else (arith.ori(a, b) if is_bool(a.type) else arith.addi(a, b))
    if kind == "prod":
        return arith.mulf(a, b) if fl else (arith.andi(a, b) if is_bool(a.type) else arith.muli(a, b))
    if kind == "max":
        return arith.maximumf(a, b) if fl else (arith.ori(a, b) if is_bool(a.type) else arith.maxsi(a, b))
    if kind == "min":
        return arith.minimumf(a, b) if fl else (arith.andi(a, b) if is_bool(a.type) else arith.minsi(a, b))
    if kind == "any":
        return arith.ori(a, b)
    if kind == "all":
        return arith.andi(a, b)
    raise NotImplementedError(kind)


_INIT = {"sum": lambda e: 0, "prod": lambda e: 1, "max": lowest, "min": highest,
         "any": lambda e: 0, "all": lambda e: 1}


def reduce_dims(x: ir.Value, dims: set[int], kind: str, acc: ir.Type) -> ir.Value:
    """Reduces x over dims (dropped from the result), accumulating in `acc`."""
    in_shape = shape(x)
    rank = len(in_shape)
    kept = [d for d in range(rank) if d not in dims]
    init = full([in_shape[d] for d in kept], _INIT[kind](acc), acc)
    out_map = dim_map(rank, [ir.AffineDimExpr.get(d) for d in kept])
    iters = [REDUCTION if d in dims else PARALLEL for d in range(rank)]
    return generic([x], [identity_map(rank)], [init], [out_map], iters,
                   lambda v, a: [_combine(kind, convert(v, acc), a)])[0]


@lowers("reduce")
def lower_reduce(op, operands):
    (x,) = operands
    attrs = op_attrs(op)
    rank = len(shape(x))
    dims = {d % max(rank, 1) for d in attrs["dims"]} if rank else set()
    kind = attrs["kind"]
    out_t = op.results[0].type
    if kind in ("any", "all") or is_bool(elem(x)):
        # Accumulate 0/1 in i8, the storage type of bools: a reduction's i1 result could not be
        # fused into a later conversion and i1 buffers cannot be stored. On 0/1, any/max/sum
        # (bool or) is max and all/min/prod (bool and) is min; "any"/"all" start from 0/1 (an
        # empty any is False), where an i8 max would start from -128.
        i8 = ir.IntegerType.get_signless(8)
        x8 = _as_bytes(x)
        as_max = kind in ("any", "max", "sum")
        return [reshape(reduce_dims(x8, dims, "any" if as_max else "all", i8), shape(op.results[0]))]
    acc = accumulator_type(elem(x))
    r = reduce_dims(x, dims, kind, acc)
    if str(elem(r)) != str(elem(out_t)):
        r = elementwise([r], shape(r), [elem(out_t)], lambda v: [convert(v, elem(out_t))])[0]
    return [reshape(r, shape(op.results[0]))]


def _as_bytes(x: ir.Value) -> ir.Value:
    """Any tensor as 0/1 bytes (x != 0)."""
    i8, i1 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(1)
    return elementwise([x], shape(x), [i8], lambda v: [convert(convert(v, i1), i8)])[0]


@lowers("arg_reduce")
def lower_arg_reduce(op, operands):
    """First index of the max/min along dim; NaN counts as the extreme (as in ATen)."""
    (x,) = operands
    if not shape(x):  # a 0-d tensor is its own max at index 0
        return [full(shape(op.results[0]), 0, ir.IntegerType.get_signless(64))]
    if is_bool(elem(x)):  # compare bools as unsigned bytes (a signed i1 true is -1)
        x = _as_bytes(x)
    attrs = op_attrs(op)
    in_shape = shape(x)
    rank = len(in_shape)
    dim = attrs["dim"] % max(rank, 1)
    e, i64 = elem(x), ir.IntegerType.get_signless(64)
    kept = [d for d in range(rank) if d != dim]
    kept_shape = [in_shape[d] for d in kept]
    better_max = attrs["kind"] == "max"
    vals = full(kept_shape, lowest(e) if better_max else highest(e), e)
    idxs = full(kept_shape, -1, i64)
    out_map = dim_map(rank, [ir.AffineDimExpr.get(d) for d in kept])

    def body(v, best, best_i):
        i = index(dim)
        if is_float(e):
            strict = arith.cmpf(F.OGT if better_max else F.OLT, v, best)
            nan_new = arith.andi(arith.cmpf(F.UNO, v, v), arith.cmpf(F.ORD, best, best))
            take = arith.ori(arith.ori(strict, nan_new), arith.cmpi(I.slt, best_i, const(0, i64)))
        else:
            strict = arith.cmpi(I.sgt if better_max else I.slt, v, best)
            take = arith.ori(strict, arith.cmpi(I.slt, best_i, const(0, i64)))
        return [arith.select(take, v, best), arith.select(take, i, best_i)]

    iters = [REDUCTION if d == dim else PARALLEL for d in range(rank)]
    _, r = generic([x], [identity_map(rank)], [vals, idxs], [out_map, out_map], iters, body)
    return [reshape(r, shape(op.results[0]))]


def _keep(v: ir.Value, full_shape, dims) -> ir.Value:
    """Reshape a reduced tensor so it broadcasts against full_shape (reduced dims -> 1)."""
    return reshape(v, [1 if d in dims else s for d, s in enumerate(full_shape)])


@lowers("softmax")
def lower_softmax(op, operands):
    (x,) = operands
    attrs = op_attrs(op)
    xs = shape(x)
    rank = len(xs)
    dims = {attrs["dim"] % max(rank, 1)} if rank else set()
    e, acc = elem(x), accumulator_type(elem(x))
    xa = elementwise([x], xs, [acc], lambda v: [convert(v, acc)])[0]
    m = _keep(reduce_dims(xa, dims, "max", acc), xs, dims)
    # A row of -inf has max -inf: subtract 0 there so the result is NaN-free like ATen's.
    z = elementwise([xa, m], xs, [acc], lambda v, mx: [arith.subf(v, arith.select(
        arith.cmpf(F.OEQ, mx, const(float("-inf"), acc)), const(0.0, acc), mx))])[0]
    ex = elementwise([z], xs, [acc], lambda v: [mmath.exp(v)])[0]
    s = _keep(reduce_dims(ex, dims, "sum", acc), xs, dims)
    if attrs["log"]:
        out = elementwise([z, s], xs, [e], lambda v, t: [convert(arith.subf(v, mmath.log(t)), e)])
    else:
        out = elementwise([ex, s], xs, [e], lambda v, t: [convert(arith.divf(v, t), e)])
    return out


@lowers("layer_norm")
def lower_layer_norm(op, operands):
    x, w, b = operands
    attrs = op_attrs(op)
    xs = shape(x)
    rank, k = len(xs), attrs["normalized_rank"]
    dims = set(range(rank - k, rank))
    e, acc = elem(x), accumulator_type(elem(x))
    n = 1
    for d in dims:
        n *= xs[d]
    xa = elementwise([x], xs, [acc], lambda v: [convert(v, acc)])[0]
    # Shifted two-pass statistics: sum x - x0 (x0 the row's first element), so a constant row
    # has mean x0 and variance 0 exactly (a plain sum rounds its mean and y = tiny * rsqrt(eps)).
    first = extract_slice(xa, [0] * rank, [1 if d in dims else s for d, s in enumerate(xs)], [1] * rank)
    shifted = elementwise([xa, first], xs, [acc], lambda v, f: [arith.subf(v, f)])[0]
    delta = _keep(reduce_dims(shifted, dims, "sum", acc), xs, dims)
    delta = elementwise([delta], shape(delta), [acc], lambda s: [arith.divf(s, const(n, acc))])[0]
    mean = elementwise([first, delta], shape(delta), [acc], lambda f, d: [arith.addf(f, d)])[0]
    cent = elementwise([shifted, delta], xs, [acc], lambda v, d: [arith.subf(v, d)])[0]
    sq = elementwise([cent], xs, [acc], lambda c: [arith.mulf(c, c)])[0]
    var = _keep(reduce_dims(sq, dims, "sum", acc), xs, dims)
    eps = attrs["eps"]
    rstd = elementwise([var], shape(var), [acc], lambda s: [mmath.rsqrt(
        arith.addf(arith.divf(s, const(n, acc)), const(eps, acc)))])[0]
    y = elementwise([cent, rstd, w, b], xs, [e], lambda c, r, wv, bv: [convert(arith.addf(
        arith.mulf(arith.mulf(c, r), convert(wv, acc)), convert(bv, acc)), e)])[0]
    stat_e = elem(op.results[1].type)
    cast = (lambda v: elementwise([v], shape(v), [stat_e], lambda s: [convert(s, stat_e)])[0])
    return [y, cast(mean), cast(rstd)]


__all__ = ["reduce_dims"]


_SCAN_IDENTITY = {"sum": lambda e: 0, "prod": lambda e: 1, "max": lowest, "min": highest,
                  "logaddexp": lowest}


def _scan_combine(kind: str, a: ir.Value, b: ir.Value) -> ir.Value:
    return _logaddexp(a, b) if kind == "logaddexp" else _combine(kind, a, b)


def _logaddexp(a: ir.Value, b: ir.Value) -> ir.Value:
    """log(exp(a) + exp(b)) = max + log1p(exp(-|a - b|)); -inf (the identity) stays exact."""
    hi, lo = arith.maximumf(a, b), arith.minimumf(a, b)
    r = arith.addf(hi, mmath.log1p(mmath.exp(arith.subf(lo, hi))))
    return arith.select(arith.cmpf(F.OEQ, lo, const(float("-inf"), a.type)), hi, r)


@lowers("scan")
def lower_scan(op, operands):
    """Hillis-Steele prefix scan: log2(n) steps of y = y (+) shift(y, s), s = 1, 2, 4, ...

    Every step is a parallel slice/pad/elementwise op (no loop-carried dependence), so every
    target can map it like any other elementwise code."""
    (x,) = operands
    attrs = op_attrs(op)
    xs = shape(x)
    if not xs:
        return [x]
    dim, kind = attrs["dim"] % len(xs), attrs["kind"]
    e, acc = elem(x), accumulator_type(elem(x))
    y = x if str(e) == str(acc) else elementwise([x], xs, [acc], lambda v: [convert(v, acc)])[0]
    n, step = xs[dim], 1
    while step < n:
        sizes = list(xs)
        sizes[dim] = n - step
        head = extract_slice(y, [0] * len(xs), sizes, [1] * len(xs))
        low = [0] * len(xs)
        low[dim] = step
        shifted = pad_constant(head, low, [0] * len(xs), _SCAN_IDENTITY[kind](acc))
        y = elementwise([y, shifted], xs, [acc], lambda a, b: [_scan_combine(kind, a, b)])[0]
        step *= 2
    if str(e) != str(acc):
        y = elementwise([y], xs, [e], lambda v: [convert(v, e)])[0]
    return [y]


def _sort_key_before(a: ir.Value, b: ir.Value, ja: ir.Value, jb: ir.Value, descending: bool) -> ir.Value:
    """Does element a (at ja) come before b (at jb) in a stable sort? NaN is the largest value."""
    if descending:
        a_lt_b = _less(b, a)
    else:
        a_lt_b = _less(a, b)
    if is_float(a.type):
        same = arith.ori(arith.cmpf(F.OEQ, a, b),
                         arith.andi(arith.cmpf(F.UNO, a, a), arith.cmpf(F.UNO, b, b)))
    else:
        same = arith.cmpi(I.eq, a, b)
    return arith.ori(a_lt_b, arith.andi(same, arith.cmpi(I.slt, ja, jb)))


def _less(a: ir.Value, b: ir.Value) -> ir.Value:
    if is_float(a.type):
        nan_b = arith.andi(arith.cmpf(F.ORD, a, a), arith.cmpf(F.UNO, b, b))
        return arith.ori(arith.cmpf(F.OLT, a, b), nan_b)
    return arith.cmpi(I.slt, a, b)


@lowers("sort", moves_data_only=True)
def lower_sort(op, operands):
    """Rank sort, O(n^2) per row but fully parallel (two generics, no data-dependent stores):
    rank[i] = #{j : x[j] before x[i]}, then out[k] = x[j] for the j with rank[j] = k."""
    (x,) = operands
    attrs = op_attrs(op)
    xs = shape(x)
    if not xs:
        return [x, full([], 0, ir.IntegerType.get_signless(64))]
    rank_n, dim, k = len(xs), attrs["dim"] % len(xs), attrs["k"]
    desc = bool(attrs["descending"])
    i64 = ir.IntegerType.get_signless(64)
    ct = compute_type(elem(x))
    lead = [ir.AffineDimExpr.get(d) for d in range(rank_n)]
    at_j = dim_map(rank_n + 1, [ir.AffineDimExpr.get(rank_n) if d == dim else ir.AffineDimExpr.get(d)
                                for d in range(rank_n)])
    own = dim_map(rank_n + 1, lead)
    iters = [PARALLEL] * rank_n + [REDUCTION]

    def count(xi, xj, acc):
        before = _sort_key_before(convert(xj, ct), convert(xi, ct), index(rank_n), index(dim), desc)
        return [arith.addi(acc, arith.extui(i64, before))]

    rank = generic([x, x], [own, at_j], [full(xs, 0, i64)], [own], iters, count)[0]
    out_shape = list(xs)
    out_shape[dim] = k

    def place(xj, rj, v, i):
        hit = arith.cmpi(I.eq, rj, index(dim))
        return [arith.select(hit, xj, v), arith.select(hit, index(rank_n), i)]

    values, indices = generic([x, rank], [at_j, at_j], [full(out_shape, 0, elem(x)), full(out_shape, 0, i64)],
                              [own, own], iters, place)
    return [values, indices]

"""gac-split-concat-sum: a sum over the dim two tensors were concatenated along is the sum of
their sums.

    reduce_sum(concat(a, b, k) [* w], [k])  ->  reduce_sum(a [* w[.., :ka]], [k]) + reduce_sum(b [* w[.., ka:]], [k])

Why: multi-scale deformable attention (models/bevformer/attention.py) concatenates the levels'
samples along the point dim, weights them and sums over it. Without the concat each level's
sampling fuses into its own weighted sum (no samples in memory), and on the GPU targets the
added sums become one kernel (backends/gpu/sampling.py). Only when the concat and the product
are used by nothing else; the summation order changes (the levels' partial sums are added).
"""

from __future__ import annotations

from mlir import ir

from gac_torch.ir.builder import GacBuilder, op_attrs
from gac_torch.ir.types import shape_of
from gac_torch.passes.dce import gac_dce


def _op(v: ir.Value) -> ir.Operation | None:
    o = v.owner
    return o.operation if isinstance(o, (ir.Operation, ir.OpView)) else None


def _one_use(v: ir.Value) -> bool:
    return len(list(v.uses)) == 1


def _match(red: ir.Operation):
    """(a, b, k, w, w_first) for reduce_sum(concat(a, b, k) [* w], [k]), else None."""
    attrs = op_attrs(red)
    if attrs["kind"] != "sum" or len(attrs["dims"]) != 1:
        return None
    x = red.operands[0]
    rank = len(shape_of(x))
    if rank == 0:  # a 0-d sum (dims [0] or [-1]) has no concatenated dim
        return None
    k = attrs["dims"][0] % rank
    src, w, w_first = _op(x), None, False
    if src is not None and src.name == "gac.binary" and op_attrs(src)["kind"] == "mul" and _one_use(x):
        lhs, rhs = src.operands
        for cat_side, other, first in ((lhs, rhs, False), (rhs, lhs, True)):
            c = _op(cat_side)
            if c is not None and c.name == "gac.concat" and shape_of(cat_side) == shape_of(x):
                src, w, w_first, x = c, other, first, cat_side
                break
        else:
            return None
    if src is None or src.name != "gac.concat" or not _one_use(x):
        return None
    if op_attrs(src)["dim"] % rank != k:
        return None
    a, b = src.operands
    return a, b, k, w, w_first


def _part(b: GacBuilder, red: ir.Operation, x: ir.Value, k: int, w, w_first: bool, start: int,
          stop: int) -> ir.Value:
    attrs = op_attrs(red)
    if w is not None:
        ws = list(shape_of(w))
        wk = k - (len(shape_of(x)) - len(ws))  # w broadcasts from the right
        if wk >= 0 and ws[wk] != 1:
            starts, limits = [0] * len(ws), list(ws)
            starts[wk], limits[wk] = start, stop
            w = b.slice(w, starts=starts, limits=limits, strides=[1] * len(ws))
        x = b.binary(w, x, kind="mul") if w_first else b.binary(x, w, kind="mul")
    return b.reduce(x, kind="sum", dims=[k], keepdim=attrs["keepdim"])


def split_concat_sum(module: ir.Module) -> ir.Module:
    b = GacBuilder()
    changed = False
    with module.context, ir.Location.unknown():
        for fn in module.body.operations:
            work = [op.operation for op in fn.regions[0].blocks[0].operations
                    if op.operation.name == "gac.reduce"]
            while work:
                red = work.pop()
                m = _match(red)
                if m is None:
                    continue
                a, c, k, w, w_first = m
                ka = shape_of(a)[k]
                with ir.InsertionPoint(red), red.location:
                    left = _part(b, red, a, k, w, w_first, 0, ka)
                    right = _part(b, red, c, k, w, w_first, ka, ka + shape_of(c)[k])
                    total = b.binary(left, right, kind="add")
                chain = [_op(red.operands[0])]
                chain += [_op(v) for v in chain[0].operands] if chain[0].name == "gac.binary" else []
                red.results[0].replace_all_uses_with(total)
                red.erase()
                for o in chain:  # the product and the concat: their operands get one use again
                    if o is not None and o.name in ("gac.binary", "gac.concat") and all(
                            not list(r.uses) for r in o.results):
                        o.erase()
                work += [_op(left), _op(right)]  # nested concats (more than two levels)
                changed = True
    return gac_dce(module) if changed else module

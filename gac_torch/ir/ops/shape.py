"""Data movement: reshape, transpose, broadcast, slice, concat, pad, gathers."""

from __future__ import annotations

import math

from mlir import ir

from gac_torch.ir.dialect import define
from gac_torch.ir.ops._infer import (
    DYN, GacTypeError, broadcast_shapes, check_sizes, dims_match, norm_dim, same_elem, shape_of, tensor,
)


def _check_reshape(types, attrs, results):
    src, dst = shape_of(types[0]), shape_of(results[0])
    check_sizes("reshape", dst, len(types) - 1)
    if DYN not in src + dst and math.prod(src) != math.prod(dst):
        raise GacTypeError(f"gac.reshape: {list(src)} -> {list(dst)} changes the element count")


def _infer_transpose(types, attrs):
    shape = shape_of(types[0])
    perm = list(attrs["perm"])
    if sorted(perm) != list(range(len(shape))):
        raise GacTypeError(f"gac.transpose: {perm} is not a permutation of rank {len(shape)}")
    return [tensor([shape[p] for p in perm], types[0].element_type)]


def _infer_broadcast(types, attrs):
    shape = tuple(attrs["shape"])
    check_sizes("broadcast", shape, len(types) - 1)
    if broadcast_shapes(shape_of(types[0]), shape) != shape:
        raise GacTypeError(f"gac.broadcast: {list(shape_of(types[0]))} cannot expand to {list(shape)}")
    return [tensor(shape, types[0].element_type)]


def _infer_slice(types, attrs):
    shape = shape_of(types[0])
    starts, limits, strides = attrs["starts"], attrs["limits"], attrs["strides"]
    if not len(starts) == len(limits) == len(strides) == len(shape):
        raise GacTypeError("gac.slice: starts/limits/strides need one value per dim")
    out = []
    for s, lo, hi, st in zip(shape, starts, limits, strides):
        if s == DYN or hi == DYN:  # a run-time dim: taken whole, or a fixed in-bounds window
            if s == DYN and hi != DYN and 0 <= lo < hi and st >= 1:
                out.append((hi - lo + st - 1) // st)  # (in bounds: the front-end proved it)
                continue
            if (lo, hi, st) != (0, DYN, 1) or s != DYN:
                raise GacTypeError(f"gac.slice: a run-time dim is taken whole or by a fixed window, got [{lo}:{hi}:{st}]")
            out.append(DYN)
            continue
        if not (0 <= lo <= hi <= s and st >= 1):
            raise GacTypeError(f"gac.slice: [{lo}:{hi}:{st}] invalid for a dim of {s}")
        out.append((hi - lo + st - 1) // st)
    return [tensor(out, types[0].element_type)]


def _infer_concat(types, attrs):
    elem = same_elem(types, "gac.concat")
    shapes = [shape_of(t) for t in types]
    dim = norm_dim(attrs["dim"], len(shapes[0]), "gac.concat")
    for s in shapes:
        if len(s) != len(shapes[0]) or any(not dims_match(a, b) for i, (a, b) in enumerate(zip(s, shapes[0]))
                                           if i != dim):
            raise GacTypeError(f"gac.concat: shapes {list(map(list, shapes))} differ off dim {dim}")
    out = [DYN if any(s[i] == DYN for s in shapes) else d for i, d in enumerate(shapes[0])]
    out[dim] = DYN if any(s[dim] == DYN for s in shapes) else sum(s[dim] for s in shapes)
    return [tensor(out, elem)]


def _infer_pad(types, attrs):
    shape = shape_of(types[0])
    low, high = attrs["low"], attrs["high"]
    if len(low) != len(shape) or len(high) != len(shape):
        raise GacTypeError("gac.pad: low/high need one value per dim")
    out = [s + lo + hi for s, lo, hi in zip(shape, low, high)]
    if min(out, default=1) < 0:
        raise GacTypeError(f"gac.pad: negative size {out}")
    if attrs["mode"] == "reflect" and any(max(lo, hi) >= s for s, lo, hi in zip(shape, low, high) if lo or hi):
        raise GacTypeError("gac.pad: reflect padding must be smaller than the dim")
    return [tensor(out, types[0].element_type)]


def _infer_gather(types, attrs):
    x, idx = types
    if not str(idx.element_type).startswith("i") or str(idx.element_type) == "i1":
        raise GacTypeError("gac.gather: index must be an integer tensor")
    norm_dim(attrs["dim"], len(shape_of(x)), "gac.gather")
    if len(shape_of(idx)) != len(shape_of(x)):
        raise GacTypeError("gac.gather: index rank must equal input rank")
    return [tensor(shape_of(idx), x.element_type)]


def _infer_index_select(types, attrs):
    x, idx = types
    shape = shape_of(x)
    dim = norm_dim(attrs["dim"], len(shape), "gac.index_select")
    if len(shape_of(idx)) != 1:
        raise GacTypeError("gac.index_select: index must be 1-D")
    return [tensor(shape[:dim] + shape_of(idx) + shape[dim + 1:], x.element_type)]


define("reshape", ["x", "sizes*:index"], check=_check_reshape,
       doc="row-major reshape; result type gives the shape, `sizes` its run-time (?) dims in order")
define("transpose", ["x"], attrs={"perm": "ints"}, infer=_infer_transpose,
       doc="y.shape[i] = x.shape[perm[i]]")
define("broadcast", ["x", "sizes*:index"], attrs={"shape": "ints"}, infer=_infer_broadcast,
       doc="expand size-1 / missing leading dims (torch.expand); `sizes` gives the ? dims of shape")


def _infer_dim(types, attrs):
    norm_dim(attrs["dim"], len(shape_of(types[0])), "gac.dim")
    return [ir.IndexType.get()]


define("dim", ["x"], results=("size:index",), attrs={"dim": "int"}, infer=_infer_dim,
       doc="the run-time size of one dim of x (an index)")
define("from_size", ["size:index"], infer=lambda types, attrs: [tensor((), ir.IntegerType.get_signless(64))],
       doc="a run-time size as a 0-d i64 tensor (sizes used as values: means, x * n)")
define("slice", ["x"], attrs={"starts": "ints", "limits": "ints", "strides": "ints"},
       infer=_infer_slice, doc="static strided slice, limits exclusive")
# Two operands, not a variadic list: an IRDL constraint binds one type for every element of a
# variadic operand, and concatenated pieces differ in size. torch.cat of n tensors is a chain.
define("concat", ["lhs", "rhs"], attrs={"dim": "int"}, infer=_infer_concat,
       doc="torch.cat of two tensors")
define("pad", ["x"], attrs={"low": "ints", "high": "ints", "mode": ("constant", "reflect", "replicate"),
                            "value": "float"},
       infer=_infer_pad, doc="pad every dim by low/high; negative values crop")
define("gather", ["x", "index"], attrs={"dim": "int"}, infer=_infer_gather,
       doc="torch.gather: y[i..] = x[i.. with i_dim := index[i..]]")
define("index_select", ["x", "index"], attrs={"dim": "int"}, infer=_infer_index_select,
       doc="torch.index_select: negative indices wrap")


SCATTER_REDUCE = ("none", "add", "mul", "max", "min")


def _infer_scatter(types, attrs):
    x, idx, src = types
    xs, ix, ss = shape_of(x), shape_of(idx), shape_of(src)
    dim = norm_dim(attrs["dim"], len(xs), "gac.scatter")
    if not str(idx.element_type).startswith("i") or str(idx.element_type) == "i1":
        raise GacTypeError("gac.scatter: index must be an integer tensor")
    same_elem([x, src], "gac.scatter")
    if ix != ss or len(ix) != len(xs) or any(i > s for d, (i, s) in enumerate(zip(ix, xs)) if d != dim):
        raise GacTypeError(f"gac.scatter: index {list(ix)} and src {list(ss)} must have one shape, "
                           f"within {list(xs)} off dim {dim}")
    return [x]


define("scatter", ["x", "index", "src"], attrs={"dim": "int", "reduce": SCATTER_REDUCE},
       infer=_infer_scatter,
       doc="y = x, then for every position p of index, in order: y[p with p_dim := index[p]] "
           "reduce= src[p] (torch.scatter / scatter_reduce); indices must be in range")

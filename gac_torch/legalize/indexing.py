"""Indexing and scatters: advanced indexing, index_put, scatter*, *_scatter, flip, roll, diagonal.

Advanced indexing with several index tensors is reduced to one gather/scatter on dim 0: the
indexed dims are moved to the front and merged, and the index tensors combined into one linear
index (negative indices wrapped per dim first, as ATen does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from mlir import ir

from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import aten, lower


def _no_masks(node) -> str | None:
    """boolean-mask indices (data-dependent shape)"""
    for i in node.args[1]:
        if i is not None and meta_val(i).dtype in (torch.bool, torch.uint8):
            return "boolean mask index (data-dependent shape)"
    return None


def _perm_to(cx: Cx, x: ir.Value, perm: list[int]) -> ir.Value:
    return x if perm == list(range(len(perm))) else cx.b.transpose(x, perm=perm)


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


@dataclass
class _Flat:
    """x with its indexed dims moved to the front and merged into one (size P), and the index
    tensors combined into one flat linear index into that dim."""

    x: ir.Value            # [P] + others
    index: ir.Value        # [prod(B)] int64
    perm: list[int]        # how x was transposed
    batch: list[int]       # B, the broadcast shape of the index tensors
    others: list[int]      # sizes of the dims not indexed
    front: int             # where ATen puts B in the result (0 unless the indexed dims are adjacent)


def _flatten_index(cx: Cx, x: ir.Value, indices) -> _Flat:
    shape = cx.shape(x)
    dims = [d for d, i in enumerate(indices) if i is not None]
    rest = [d for d in range(len(shape)) if d not in dims]
    perm = dims + rest
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    batch = list(torch.broadcast_shapes(*[tuple(cx.shape(indices[d])) for d in dims]))
    lin = None
    stride = 1
    for d in reversed(dims):
        i = cx.b.broadcast(cx.to(indices[d], torch.int64), shape=batch) \
            if cx.shape(indices[d]) != batch else cx.to(indices[d], torch.int64)
        size = cx.to(shape[d], torch.int64)
        i = cx.b.select(cx.b.binary(i, cx.to(0, torch.int64), kind="lt"), cx.b.binary(i, size, kind="add"), i)
        term = cx.b.binary(i, cx.to(stride, torch.int64), kind="mul") if stride != 1 else i
        lin = term if lin is None else cx.b.binary(lin, term, kind="add")
        stride *= shape[d]
    others = [shape[d] for d in rest]
    xt = cx.b.reshape(_perm_to(cx, x, perm), [stride] + others)
    flat = cx.b.reshape(lin, [math.prod(batch)])
    return _Flat(xt, flat, perm, batch, others, dims[0] if adjacent else 0)


def _result_perm(f: _Flat) -> list[int]:
    """From B + others to ATen's layout: B goes after the `front` leading non-indexed dims."""
    nb = len(f.batch)
    return ([nb + i for i in range(f.front)] + list(range(nb))
            + [nb + i for i in range(f.front, len(f.others))])


@lower(aten.index.Tensor, aten._unsafe_index.Tensor, check=_no_masks)
def lower_index(cx: Cx, x, indices):
    f = _flatten_index(cx, x, indices)
    rows = cx.b.index_select(f.x, f.index, dim=0)
    return _perm_to(cx, cx.b.reshape(rows, f.batch + f.others), _result_perm(f))


@lower(aten.index_put.default, aten._unsafe_index_put.default, check=_no_masks)
def lower_index_put(cx: Cx, x, indices, values, accumulate=False):
    dt = cx.out_dtype
    f = _flatten_index(cx, cx.to(x, dt), indices)
    res_shape = [f.others[i] for i in range(f.front)] + f.batch + f.others[f.front:]
    v = cx.to(values, dt)
    v = cx.b.broadcast(v, shape=res_shape) if cx.shape(v) != res_shape else v
    v = cx.b.reshape(_perm_to(cx, v, _inverse(_result_perm(f))), [math.prod(f.batch)] + f.others)
    idx = cx.b.reshape(f.index, [math.prod(f.batch)] + [1] * len(f.others))
    idx = cx.b.broadcast(idx, shape=cx.shape(v)) if cx.shape(idx) != cx.shape(v) else idx
    y = cx.b.scatter(f.x, idx, v, dim=0, reduce="add" if accumulate else "none")
    shape = cx.shape(x)
    y = cx.b.reshape(y, [shape[d] for d in f.perm])
    return _perm_to(cx, y, _inverse(f.perm))


# torch.scatter family ------------------------------------------------------------------------

_REDUCE = {"sum": "add", "add": "add", "prod": "mul", "multiply": "mul", "amax": "max", "amin": "min",
           "mean": "add"}


def _identity(reduce: str, dt: torch.dtype):
    if reduce in ("sum", "mean", "add"):
        return 0
    if reduce in ("prod", "multiply"):
        return 1
    info = torch.finfo(dt) if dt.is_floating_point else (None if dt == torch.bool else torch.iinfo(dt))
    if reduce == "amax":
        return -math.inf if dt.is_floating_point else (0 if info is None else info.min)
    return math.inf if dt.is_floating_point else (1 if info is None else info.max)


def _scatter(cx: Cx, x, dim: int, index, src, reduce: str = "none", include_self: bool = True):
    dt = cx.out_dtype
    xv = cx.to(x, dt)
    if math.prod(cx.shape(index)) == 0:
        return xv
    rank0 = not cx.shape(xv)
    if rank0:
        xv, index = cx.b.reshape(xv, [1]), cx.b.reshape(index, [1])
    ishape = cx.shape(index)
    dim %= len(cx.shape(xv))
    if isinstance(src, ir.Value) and cx.shape(src) and cx.shape(src) != ishape:
        src = cx.b.slice(src, starts=[0] * len(ishape), limits=ishape, strides=[1] * len(ishape))
    s = cx.to(src, dt)
    s = cx.b.broadcast(cx.b.reshape(s, [1] * len(ishape)), shape=ishape) if cx.shape(s) != ishape else s
    kind = _REDUCE.get(reduce, "none")
    if kind != "none" and not include_self:
        fill = cx.b.broadcast(cx.to(_identity(reduce, dt), dt), shape=ishape)
        xv = cx.b.scatter(xv, index, fill, dim=dim, reduce="none")
    y = cx.b.scatter(xv, index, s, dim=dim, reduce=kind)
    if reduce == "mean":
        ones = cx.b.broadcast(cx.to(1, dt), shape=ishape)
        count = cx.b.broadcast(cx.to(1 if include_self else 0, dt), shape=cx.shape(xv))
        count = cx.b.scatter(count, index, ones, dim=dim, reduce="add")
        safe = cx.b.binary(count, cx.to(1, dt), kind="maximum")
        mean = cx.b.binary(y, safe, kind="div" if dt.is_floating_point else "floordiv")
        y = cx.b.select(cx.b.binary(count, cx.to(0, dt), kind="eq"), y, mean)
    return cx.b.reshape(y, []) if rank0 else y


@lower(aten.scatter.src, aten.scatter.value)
def lower_scatter(cx: Cx, x, dim, index, src):
    return _scatter(cx, x, dim, index, src)


@lower(aten.scatter.reduce, aten.scatter.value_reduce)
def lower_scatter_reduce_legacy(cx: Cx, x, dim, index, src, *, reduce):
    return _scatter(cx, x, dim, index, src, reduce)


@lower(aten.scatter_add.default)
def lower_scatter_add(cx: Cx, x, dim, index, src):
    return _scatter(cx, x, dim, index, src, "sum")


@lower(aten.scatter_reduce.two)
def lower_scatter_reduce(cx: Cx, x, dim, index, src, reduce, *, include_self=True):
    return _scatter(cx, x, dim, index, src, reduce, bool(include_self))


def _along(cx: Cx, x, dim: int, lo: int, hi: int) -> ir.Value:
    shape = cx.shape(x)
    starts, limits = [0] * len(shape), list(shape)
    starts[dim], limits[dim] = lo, hi
    return cx.b.slice(x, starts=starts, limits=limits, strides=[1] * len(shape))


def _concat(cx: Cx, parts: list[ir.Value], dim: int) -> ir.Value:
    parts = [p for p in parts if cx.shape(p)[dim] > 0]
    out = parts[0]
    for p in parts[1:]:  # gac.concat is binary
        out = cx.b.concat(out, p, dim=dim)
    return out


@lower(aten.select_scatter.default)
def lower_select_scatter(cx: Cx, x, src, dim, index):
    dt = cx.out_dtype
    xv = cx.to(x, dt)
    shape = cx.shape(xv)
    dim %= len(shape)
    index %= shape[dim]
    row = cx.b.reshape(cx.to(src, dt), shape[:dim] + [1] + shape[dim + 1:])
    return _concat(cx, [_along(cx, xv, dim, 0, index), row, _along(cx, xv, dim, index + 1, shape[dim])], dim)


@lower(aten.slice_scatter.default)
def lower_slice_scatter(cx: Cx, x, src, dim=0, start=None, end=None, step=1):
    dt = cx.out_dtype
    xv, sv = cx.to(x, dt), cx.to(src, dt)
    shape = cx.shape(xv)
    dim %= len(shape)
    n = shape[dim]
    lo, hi, _ = slice(start, end, step).indices(n)
    hi = max(hi, lo)
    if step == 1:
        return _concat(cx, [_along(cx, xv, dim, 0, lo), sv, _along(cx, xv, dim, hi, n)], dim)
    # Strided: position p takes src[(p - lo) / step] where it is one of the slice's positions.
    count = cx.shape(sv)[dim]
    if count == 0:
        return xv
    hit = [lo <= p < hi and (p - lo) % step == 0 for p in range(n)]
    table = torch.tensor([min(max((p - lo) // step, 0), count - 1) for p in range(n)])
    picked = cx.b.index_select(sv, cx.b.constant(table, torch.int64, (n,)), dim=dim)
    hits = cx.b.binary(cx.b.constant(torch.tensor(hit, dtype=torch.int64), torch.int64, (n,)), cx.to(0, torch.int64),
                       kind="ne")
    mask = cx.b.reshape(hits, [n] + [1] * (len(shape) - dim - 1))
    return cx.b.select(mask, picked, xv)


@lower(aten.masked_scatter.default)
def lower_masked_scatter(cx: Cx, x, mask, source):
    """The i-th True of the (broadcast) mask, in row-major order, takes source.flatten()[i]:
    i = cumsum(mask) - 1 is a scan."""
    dt, shape = cx.out_dtype, cx.out_shape
    n = math.prod(shape)
    m = cx.to(mask, torch.bool)
    m = cx.b.reshape(cx.b.broadcast(m, shape=shape) if cx.shape(m) != shape else m, [n])
    xv = cx.to(x, dt)
    xv = cx.b.reshape(cx.b.broadcast(xv, shape=shape) if cx.shape(xv) != shape else xv, [n])
    nsrc = math.prod(cx.shape(source))
    if n == 0 or nsrc == 0:
        return cx.b.reshape(xv, shape)
    pos = cx.b.scan(cx.to(m, torch.int64), kind="sum", dim=0)
    pos = cx.b.binary(cx.b.binary(pos, cx.to(1, torch.int64), kind="sub"), cx.to(0, torch.int64), kind="maximum")
    pos = cx.b.binary(pos, cx.to(nsrc - 1, torch.int64), kind="minimum")
    picked = cx.b.index_select(cx.b.reshape(cx.to(source, dt), [nsrc]), pos, dim=0)
    return cx.b.reshape(cx.b.select(m, picked, xv), shape)


# Reorderings ---------------------------------------------------------------------------------

@lower(aten.flip.default)
def lower_flip(cx: Cx, x, dims):
    shape = cx.shape(x)
    if not shape:  # a 0-d tensor (dims [0] or [-1]) is its own flip
        return x
    for d in sorted({d % len(shape) for d in dims}):
        if shape[d] > 1:
            rev = cx.b.constant(torch.arange(shape[d] - 1, -1, -1), torch.int64, (shape[d],))
            x = cx.b.index_select(x, rev, dim=d)
    return x


@lower(aten.roll.default)
def lower_roll(cx: Cx, x, shifts, dims=()):
    shape = cx.shape(x)
    if not dims:  # roll the flattened tensor
        flat = cx.b.reshape(x, [math.prod(shape)])
        return cx.b.reshape(lower_roll(cx, flat, [shifts[0]], [0]), shape)
    for s, d in zip(shifts, dims):
        d %= len(shape)
        n = shape[d]
        s = s % n if n else 0
        if s:
            x = _concat(cx, [_along(cx, x, d, n - s, n), _along(cx, x, d, 0, n - s)], d)
    return x


@lower(aten.diagonal.default)
def lower_diagonal(cx: Cx, x, offset=0, dim1=0, dim2=1):
    """Move dim1, dim2 last, merge them, and pick every (n2 + 1)-th element from the start."""
    shape = cx.shape(x)
    d1, d2 = dim1 % len(shape), dim2 % len(shape)
    n1, n2 = shape[d1], shape[d2]
    rest = [d for d in range(len(shape)) if d not in (d1, d2)]
    length = cx.out_shape[-1]
    y = cx.b.reshape(_perm_to(cx, x, rest + [d1, d2]), [shape[d] for d in rest] + [n1 * n2])
    start = offset if offset >= 0 else -offset * n2
    table = torch.arange(length) * (n2 + 1) + start
    return cx.b.index_select(y, cx.b.constant(table, torch.int64, (length,)), dim=len(rest))


@lower(aten.diagonal_scatter.default)
def lower_diagonal_scatter(cx: Cx, x, src, offset=0, dim1=0, dim2=1):
    """The inverse of diagonal: scatter src into the merged (dim1, dim2) plane."""
    dt = cx.out_dtype
    shape = cx.shape(x)
    d1, d2 = dim1 % len(shape), dim2 % len(shape)
    n1, n2 = shape[d1], shape[d2]
    rest = [d for d in range(len(shape)) if d not in (d1, d2)]
    perm = rest + [d1, d2]
    outer = [shape[d] for d in rest]
    y = cx.b.reshape(_perm_to(cx, cx.to(x, dt), perm), outer + [n1 * n2])
    length = cx.shape(src)[-1]
    if length == 0:
        return cx.to(x, dt)
    start = offset if offset >= 0 else -offset * n2
    table = torch.arange(length) * (n2 + 1) + start
    idx = cx.b.reshape(cx.b.constant(table, torch.int64, (length,)), [1] * len(outer) + [length])
    idx = cx.b.broadcast(idx, shape=outer + [length]) if outer else idx
    y = cx.b.scatter(y, idx, cx.to(src, dt), dim=len(outer), reduce="none")
    return _perm_to(cx, cx.b.reshape(y, outer + [n1, n2]), _inverse(perm))

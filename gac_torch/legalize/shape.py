"""Views and data movement. Views become value-semantics gac ops: graphs here are functional."""

from __future__ import annotations

import math

import torch
from mlir import ir

from gac_torch.ir.types import DYN
from gac_torch.legalize.context import NEEDS_STATIC, Cx, meta_val
from gac_torch.legalize.registry import aten, lower


@lower(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
       aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, dynamic=True)
def lower_view(cx: Cx, x, *_):
    return cx.b.reshape(x, cx.out_shape)


@lower(aten.permute.default, dynamic=True)
def lower_permute(cx: Cx, x, perm):
    rank = len(cx.shape(x))
    return cx.b.transpose(x, perm=[p % max(rank, 1) for p in perm]) if rank else x


@lower(aten.t.default, aten.transpose.int, dynamic=True)
def lower_transpose(cx: Cx, x, d0=0, d1=1):
    rank = len(cx.shape(x))
    if rank < 2:
        return x
    perm = list(range(rank))
    d0, d1 = d0 % rank, d1 % rank
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return cx.b.transpose(x, perm=perm)


@lower(aten.expand.default, dynamic=True)
def lower_expand(cx: Cx, x, size, *, implicit=False):
    return cx.b.broadcast(x, shape=cx.out_shape) if cx.shape(x) != cx.out_shape else x


def _slice_bounds(size: int, start, end, step) -> tuple[int, int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def _whole_dims(cx: Cx, x) -> list[int]:
    """gac.slice limits taking every dim whole (DYN: a run-time size, taken whole)."""
    return [s if isinstance(s, int) else DYN for s in cx.shape(x)]


def _static_slice(node) -> str | None:
    """slicing a dim whose size is known only at run time, or with run-time bounds"""
    x, dim = meta_val(node.args[0]), node.args[1] if len(node.args) > 1 else 0
    bounds = node.args[2:] if node.target is aten.slice.Tensor else node.args[2:3]
    if any(not isinstance(b, (int, type(None))) for b in bounds):
        return f"{NEEDS_STATIC}: a slice with run-time bounds"
    if x.dim() and not isinstance(x.shape[dim % x.dim()], int):
        if node.target is aten.select.int:  # x[i], i >= 0: torch proved i < size for every size
            return None if node.args[2] >= 0 else f"{NEEDS_STATIC}: a negative index into a run-time size"
        given = list(node.args[2:])
        start, end, step = given + [None, None, 1][len(given):]
        whole = start in (None, 0) and step == 1 and (end is None or end >= 2 ** 62)
        # A fixed window (start >= 0, a static result size: torch proved it in bounds) is fine too.
        fixed = (start or 0) >= 0 and isinstance(meta_val(node).shape[dim % x.dim()], int)
        return None if whole or fixed else f"{NEEDS_STATIC}: a slice of a run-time size"
    return None


@lower(aten.slice.Tensor, check=_static_slice, dynamic=True)
def lower_slice(cx: Cx, x, dim=0, start=None, end=None, step=1):
    shape = cx.shape(x)
    dim %= len(shape)
    if not isinstance(shape[dim], int):  # a run-time dim: whole, or a fixed window (_static_slice)
        n = cx.out_shape[dim]
        if not isinstance(n, int):
            return x
        lo, st = start or 0, step or 1
        lo, hi = lo, lo + (n - 1) * st + 1 if n else lo
    else:
        lo, hi, st = _slice_bounds(shape[dim], start, end, step)
    starts, limits, strides = [0] * len(shape), _whole_dims(cx, x), [1] * len(shape)
    starts[dim], limits[dim], strides[dim] = lo, hi, st
    return cx.b.slice(x, starts=starts, limits=limits, strides=strides)


@lower(aten.select.int, check=_static_slice, dynamic=True)
def lower_select(cx: Cx, x, dim, index):
    shape = cx.shape(x)
    dim %= len(shape)
    index = index % shape[dim] if isinstance(shape[dim], int) else index  # (>= 0: _static_slice)
    starts, limits = [0] * len(shape), _whole_dims(cx, x)
    starts[dim], limits[dim] = index, index + 1
    y = cx.b.slice(x, starts=starts, limits=limits, strides=[1] * len(shape))
    return cx.b.reshape(y, cx.out_shape)


@lower(aten.cat.default, dynamic=True)
def lower_cat(cx: Cx, tensors, dim=0):
    dt = cx.out_dtype
    d = dim % len(cx.out_shape)
    # Pieces with nothing along dim add nothing (legacy 1-D empties may even have another rank).
    parts = [cx.to(t, dt) for t in tensors
             if len(cx.shape(t)) == len(cx.out_shape) and not (isinstance(cx.shape(t)[d], int) and cx.shape(t)[d] == 0)]
    if not parts:
        return cx.b.broadcast(cx.b.constant(0, dt), shape=cx.out_shape)
    out = parts[0]
    for part in parts[1:]:
        out = cx.b.concat(out, part, dim=d)
    return out


@lower(aten.split_with_sizes.default, aten.split.Tensor)
def lower_split(cx: Cx, x, sizes, dim=0):
    shape = cx.shape(x)
    dim %= len(shape)
    if isinstance(sizes, int):
        # torch gives one (empty) chunk of a 0-size dim
        sizes = [min(sizes, shape[dim] - i) for i in range(0, shape[dim], sizes)] or [0]
    outs, off = [], 0
    for s in sizes:
        starts, limits = [0] * len(shape), list(shape)
        starts[dim], limits[dim] = off, off + s
        chunk = [n if d != dim else s for d, n in enumerate(shape)]
        if any(isinstance(n, int) and n == 0 for n in chunk):
            # an empty chunk is no slice: MLIR refuses offset 0 into a 0-size dim (fuzz seed 1937)
            outs.append(cx.b.broadcast(cx.b.constant(0, cx.dtype_of(x)), shape=chunk))
        else:
            outs.append(cx.b.slice(x, starts=starts, limits=limits, strides=[1] * len(shape)))
        off += s
    return tuple(outs)


@lower(aten.constant_pad_nd.default)
def lower_constant_pad(cx: Cx, x, pad, value=0):
    rank = len(cx.shape(x))
    low, high = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):  # pad pairs start from the last dim
        low[rank - 1 - i], high[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    return cx.b.pad(x, low=low, high=high, mode="constant", value=float(value))


def _numel(cx: Cx, node_arg) -> int | object:
    """A tensor argument's element count (an index Value when known only at run time)."""
    return cx.size(math.prod(meta_val(node_arg).shape))


@lower(aten.embedding.default, dynamic=True)
def lower_embedding(cx: Cx, weight, indices, padding_idx=-1, scale_grad=False, sparse=False):
    flat = cx.b.reshape(indices, [_numel(cx, cx.node.args[1])])
    rows = cx.b.index_select(weight, flat, dim=0)
    return cx.b.reshape(rows, cx.out_shape)


def _static_source_dim(node) -> str | None:
    """indexing along a dim whose size is known only at run time"""
    x = meta_val(node.args[0])
    d = node.args[1] if len(node.args) > 1 else 0
    if x.dim() and not isinstance(x.shape[d % x.dim()], int):
        return f"{NEEDS_STATIC}: indexing along a run-time size"
    return None


@lower(aten.index_select.default, check=_static_source_dim, dynamic=True)
def lower_index_select(cx: Cx, x, dim, index):
    if not cx.shape(x):  # a 0-d tensor: the only valid index is 0
        return x
    flat = cx.b.reshape(index, [_numel(cx, cx.node.args[2])]) if len(cx.shape(index)) != 1 else index
    return cx.b.reshape(cx.b.index_select(x, flat, dim=dim % len(cx.shape(x))), cx.out_shape)


@lower(aten.gather.default, check=_static_source_dim, dynamic=True)
def lower_gather(cx: Cx, x, dim, index, *, sparse_grad=False):
    if not cx.shape(x) or not cx.shape(index):  # 0-d operands: a 1-D gather on dim 0
        flat_x = cx.b.reshape(x, [max(1, math.prod(cx.shape(x)))])
        flat_i = cx.b.reshape(index, [math.prod(cx.shape(index))])
        return cx.b.reshape(cx.b.gather(flat_x, flat_i, dim=0), cx.out_shape)
    return cx.b.gather(x, index, dim=dim % len(cx.shape(x)))


# Constructors: values that only depend on static shapes.
@lower(aten.full.default, aten.scalar_tensor.default, dynamic=True)
def lower_full(cx: Cx, size_or_value, fill_value=None, **kwargs):
    value = size_or_value if fill_value is None else fill_value
    c = cx.b.constant(value, cx.out_dtype)
    return cx.b.broadcast(c, shape=cx.out_shape) if cx.out_shape else c


@lower(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, dynamic=True)
def lower_full_like(cx: Cx, x, fill_value=None, **kwargs):
    value = {aten.zeros_like.default: 0, aten.ones_like.default: 1}.get(cx.node.target, fill_value)
    c = cx.b.constant(value, cx.out_dtype)
    return cx.b.broadcast(c, shape=cx.out_shape) if cx.out_shape else c


@lower(aten.eye.default, aten.eye.m)
def lower_eye(cx: Cx, n, *args, **kwargs):
    rows, cols = cx.out_shape
    i = cx.b.iota([rows, cols], 0, torch.int64)
    return cx.to(cx.b.binary(i, cx.b.iota([rows, cols], 1, torch.int64), kind="eq"), cx.out_dtype)


@lower(aten.arange.start_step, aten.arange.default, aten.arange.start, dynamic=True)
def lower_arange(cx: Cx, *args, **kwargs):
    nums = [a for a in args if isinstance(a, (int, float, ir.Value))]  # (Values: run-time sizes)
    start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
    dt = cx.out_dtype
    n = cx.out_shape[0]
    compute = torch.float64 if dt.is_floating_point else torch.int64
    i = cx.b.iota([n], 0, compute)
    y = cx.b.binary(cx.b.binary(i, cx.to(step, compute), kind="mul"), cx.to(start, compute), kind="add")
    return cx.to(y, dt)


@lower(aten.empty.memory_format, aten.empty_strided.default, aten.empty_permuted.default, aten.zeros.default,
       aten.ones.default, dynamic=True)
def lower_filled(cx: Cx, size, *_args, **kwargs):
    # empty: any content is valid; zeros keeps results deterministic.
    value = 1 if cx.node.target is aten.ones.default else 0
    c = cx.b.constant(value, cx.out_dtype)
    return cx.b.broadcast(c, shape=cx.out_shape) if cx.out_shape else c


__all__ = ["meta_val"]


@lower(aten.repeat.default)
def lower_repeat(cx: Cx, x, repeats):
    """x.repeat(r) = broadcast x over new interleaved axes, then merge: (r0, s0, r1, s1, ...)."""
    shape = [1] * (len(repeats) - len(cx.shape(x))) + cx.shape(x)
    y = cx.b.reshape(x, [d for s in shape for d in (1, s)])
    y = cx.b.broadcast(y, shape=[d for r, s in zip(repeats, shape) for d in (r, s)])
    return cx.b.reshape(y, cx.out_shape)


def _pad_nd(mode: str):
    def fn(cx: Cx, x, padding):
        rank = len(cx.shape(x))
        low, high = [0] * rank, [0] * rank
        for i in range(len(padding) // 2):  # pairs start from the last dim
            low[rank - 1 - i], high[rank - 1 - i] = padding[2 * i], padding[2 * i + 1]
        return cx.b.pad(x, low=low, high=high, mode=mode, value=0.0)
    fn.__name__ = f"lower_{mode}_pad"
    return fn


lower(aten.reflection_pad1d.default, aten.reflection_pad2d.default,
      aten.reflection_pad3d.default)(_pad_nd("reflect"))
lower(aten.replication_pad1d.default, aten.replication_pad2d.default,
      aten.replication_pad3d.default)(_pad_nd("replicate"))


@lower(aten.stack.default)
def lower_stack(cx: Cx, tensors, dim=0):
    rank = len(cx.out_shape)
    d = dim % rank
    parts = [cx.b.reshape(cx.to(t, cx.out_dtype), cx.shape(t)[:d] + [1] + cx.shape(t)[d:]) for t in tensors]
    out = parts[0]
    for p in parts[1:]:
        out = cx.b.concat(out, p, dim=d)
    return out


@lower(aten.unfold.default)
def lower_unfold(cx: Cx, x, dim, size, step):
    """Windows [i*step, i*step + size) along dim, as a new last dim."""
    shape = cx.shape(x)
    if not shape:
        return cx.b.reshape(x, cx.out_shape)
    d = dim % len(shape)
    count = cx.out_shape[d]
    table = torch.tensor([i * step + k for i in range(count) for k in range(size)], dtype=torch.int64)
    y = cx.b.index_select(x, cx.b.constant(table, torch.int64, (table.numel(),)), dim=d)
    y = cx.b.reshape(y, shape[:d] + [count, size] + shape[d + 1:])
    perm = list(range(d + 1)) + list(range(d + 2, len(shape) + 1)) + [d + 1]
    return cx.b.transpose(y, perm=perm)

"""Reductions, softmax and normalizations."""

from __future__ import annotations

import math

import torch

from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import FLOATS, aten, lower


def _dims(cx: Cx, x, dims) -> list[int]:
    rank = len(cx.shape(x))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % max(rank, 1) for d in dims]


def _count(cx: Cx, x, dims: list[int]):
    """How many elements a reduction over dims combines (1 for a 0-d tensor): an int, or an
    index Value when a reduced size is known only at run time."""
    shape = cx.shape(x)
    if not shape:
        return 1
    if all(isinstance(shape[d], int) for d in dims):
        return math.prod(shape[d] for d in dims)
    x_node = cx.node.args[0]
    return cx.size(math.prod(meta_val(x_node).shape[d] for d in dims))


def _divisor(cx: Cx, x, dims: list[int], minus: int = 0):
    """max(count - minus, 0) of a reduction over dims, as what cx.to takes: a float, or an index
    Value when a reduced size is known only at run time."""
    n = _count(cx, x, dims)
    if isinstance(n, int):
        return float(max(n - minus, 0))
    if not minus:
        return n
    count = math.prod(meta_val(cx.node.args[0]).shape[d] for d in dims)
    return cx.size(torch.sym_max(count - minus, 0))


def _reduce(kind: str, *overloads):
    @lower(*overloads, dynamic=True)
    def fn(cx: Cx, x, dims=None, keepdim=False, *, dtype=None):
        dt = cx.out_dtype
        src = cx.to(x, dt) if kind in ("sum", "prod") else x
        r = cx.b.reduce(src, kind=kind, dims=_dims(cx, x, dims), keepdim=bool(keepdim))
        return cx.to(r, dt)
    fn.__name__ = f"lower_{kind}"


_reduce("sum", aten.sum.dim_IntList)
_reduce("max", aten.amax.default)
_reduce("min", aten.amin.default)
_reduce("any", aten.any.dim, aten.any.dims)
_reduce("all", aten.all.dim)


@lower(aten.sum.default, aten.prod.default)
def lower_full_reduce(cx: Cx, x, *, dtype=None):
    kind = "sum" if cx.node.target is aten.sum.default else "prod"
    return cx.b.reduce(cx.to(x, cx.out_dtype), kind=kind, dims=_dims(cx, x, None), keepdim=False)


@lower(aten.any.default, aten.all.default, aten.max.default, aten.min.default)
def lower_full_bool_reduce(cx: Cx, x):
    kind = {aten.any.default: "any", aten.all.default: "all",
            aten.max.default: "max", aten.min.default: "min"}[cx.node.target]
    return cx.b.reduce(x, kind=kind, dims=_dims(cx, x, None), keepdim=False)


@lower(aten.prod.dim_int)
def lower_prod_dim(cx: Cx, x, dim, keepdim=False, *, dtype=None):
    return cx.b.reduce(cx.to(x, cx.out_dtype), kind="prod", dims=_dims(cx, x, dim), keepdim=bool(keepdim))


@lower(aten.mean.dim, aten.mean.default, dynamic=True)
def lower_mean(cx: Cx, x, dims=None, keepdim=False, *, dtype=None):
    dt = cx.out_dtype
    ct = cx.compute_dtype(dt)  # sum and divide before the one rounding to f16/bf16
    ds = _dims(cx, x, dims)
    s = cx.b.reduce(cx.to(x, ct), kind="sum", dims=ds, keepdim=bool(keepdim))
    return cx.to(cx.b.binary(s, cx.to(_divisor(cx, x, ds), ct), kind="div"), dt)


@lower(aten.var.dim, aten.std.dim, dynamic=True)
def lower_var_dim(cx: Cx, x, dims=None, unbiased=True, keepdim=False):
    return lower_var(cx, x, dims, correction=1 if unbiased else 0, keepdim=keepdim)


def _var(cx: Cx, x, ds: list[int], dt: torch.dtype, correction, keepdim) -> tuple:
    """(variance, mean keeping dims), two-pass in dt."""
    xf = cx.to(x, dt)
    mean = cx.b.binary(cx.b.reduce(xf, kind="sum", dims=ds, keepdim=True), cx.to(_divisor(cx, x, ds), dt),
                       kind="div")
    cent = cx.b.binary(xf, mean, kind="sub")
    ss = cx.b.reduce(cx.b.binary(cent, cent, kind="mul"), kind="sum", dims=ds, keepdim=bool(keepdim))
    corr = 1 if correction is None else correction
    return cx.b.binary(ss, cx.to(_divisor(cx, x, ds, corr), dt), kind="div"), mean


@lower(aten.var.correction, aten.std.correction, dynamic=True)
def lower_var(cx: Cx, x, dims=None, *, correction=None, keepdim=False):
    out = cx.out_dtype
    var, _ = _var(cx, x, _dims(cx, x, dims), cx.compute_dtype(out), correction, keepdim)
    std = cx.node.target in (aten.std.correction, aten.std.dim)
    return cx.to(cx.b.unary(var, kind="sqrt") if std else var, out)


@lower(aten.argmax.default, aten.argmin.default)
def lower_argmax(cx: Cx, x, dim=None, keepdim=False):
    kind = "max" if cx.node.target is aten.argmax.default else "min"
    if dim is None:  # over the flattened tensor
        flat = cx.b.reshape(x, [math.prod(cx.shape(x))])
        return cx.b.reshape(cx.b.arg_reduce(flat, kind=kind, dim=0, keepdim=False), cx.out_shape)
    return cx.b.arg_reduce(x, kind=kind, dim=dim, keepdim=bool(keepdim))


@lower(aten._softmax.default, aten._log_softmax.default, dynamic=True)
def lower_softmax(cx: Cx, x, dim, half_to_float=False):
    log = cx.node.target is aten._log_softmax.default
    return cx.b.softmax(cx.to(x, cx.out_dtype), dim=dim, log=int(log))


@lower(aten.max.dim, aten.min.dim, dynamic=True)
def lower_max_dim(cx: Cx, x, dim, keepdim=False):
    kind = "max" if cx.node.target is aten.max.dim else "min"
    d = _dims(cx, x, dim)
    values = cx.b.reduce(x, kind=kind, dims=d, keepdim=bool(keepdim))
    return values, cx.b.arg_reduce(x, kind=kind, dim=d[0], keepdim=bool(keepdim))


@lower(aten.var_mean.correction, dynamic=True)
def lower_var_mean(cx: Cx, x, dims=None, *, correction=None, keepdim=False):
    out = meta_val(cx.node)[0].dtype
    var, mean_k = _var(cx, x, _dims(cx, x, dims), cx.compute_dtype(out), correction, keepdim)
    return cx.to(var, out), cx.to(cx.b.reshape(mean_k, cx.dims(meta_val(cx.node)[1].shape)), out)


@lower(aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default)
def lower_cumsum(cx: Cx, x, dim, *, dtype=None):
    kind = {aten.cumsum.default: "sum", aten.cumprod.default: "prod"}.get(cx.node.target, "logaddexp")
    xv = cx.to(x, cx.out_dtype)
    if not cx.shape(xv):
        return xv
    return cx.b.scan(xv, kind=kind, dim=dim % len(cx.shape(xv)))


def _sort_dim(cx: Cx, x, dim: int) -> int:
    return dim % max(len(cx.shape(x)), 1)


@lower(aten.sort.default)
def lower_sort(cx: Cx, x, dim=-1, descending=False):
    d = _sort_dim(cx, x, dim)
    k = cx.shape(x)[d] if cx.shape(x) else 1
    return cx.b.sort(x, dim=d, descending=int(descending), k=k)


@lower(aten.sort.stable)
def lower_sort_stable(cx: Cx, x, *, stable=None, dim=-1, descending=False):
    return lower_sort(cx, x, dim, descending)  # gac.sort is always stable


@lower(aten.topk.default)
def lower_topk(cx: Cx, x, k, dim=-1, largest=True, sorted=True):
    # sorted=False lets any order through; the sorted order is one of them.
    return cx.b.sort(x, dim=_sort_dim(cx, x, dim), descending=int(largest), k=k)


@lower(aten.linalg_vector_norm.default, dtypes=FLOATS)
def lower_vector_norm(cx: Cx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """sum(|x|^p)^(1/p) in f32 or wider (p = 0: the nonzero count, +-inf: max/min of |x|)."""
    dt = cx.out_dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    a = cx.b.unary(cx.to(x, acc), kind="abs")
    ds, kd = _dims(cx, x, dim), bool(keepdim)
    if ord in (math.inf, -math.inf):
        r = cx.b.reduce(a, kind="max" if ord > 0 else "min", dims=ds, keepdim=kd)
    elif ord == 0:
        r = cx.b.reduce(cx.to(cx.b.binary(a, cx.to(0.0, acc), kind="ne"), acc), kind="sum", dims=ds, keepdim=kd)
    elif ord == 1:
        r = cx.b.reduce(a, kind="sum", dims=ds, keepdim=kd)
    elif ord == 2:
        r = cx.b.unary(cx.b.reduce(cx.b.binary(a, a, kind="mul"), kind="sum", dims=ds, keepdim=kd), kind="sqrt")
    else:
        p = cx.to(float(ord), acc)
        s = cx.b.reduce(cx.b.binary(a, p, kind="pow"), kind="sum", dims=ds, keepdim=kd)
        r = cx.b.binary(s, cx.to(1.0 / float(ord), acc), kind="pow")
    return cx.to(r, dt)


def _distances(cx: Cx, a, b, p: float, acc: torch.dtype):
    """||a_i - b_j||_p for a (.., P, M), b (.., R, M): (.., P, R), from explicit differences
    (more accurate than the |a|^2 + |b|^2 - 2ab matmul form)."""
    sa, sb = cx.shape(a), cx.shape(b)
    d = cx.b.binary(cx.b.reshape(cx.to(a, acc), sa[:-1] + [1, sa[-1]]),
                    cx.b.reshape(cx.to(b, acc), sb[:-2] + [1] + sb[-2:]), kind="sub")
    d = cx.b.unary(d, kind="abs")
    last = len(cx.shape(d)) - 1
    if p == math.inf:
        return cx.b.reduce(d, kind="max", dims=[last], keepdim=False)
    if p == 0:
        return cx.b.reduce(cx.to(cx.b.binary(d, cx.to(0.0, acc), kind="ne"), acc), kind="sum", dims=[last],
                           keepdim=False)
    if p == 1:
        return cx.b.reduce(d, kind="sum", dims=[last], keepdim=False)
    if p == 2:
        return cx.b.unary(cx.b.reduce(cx.b.binary(d, d, kind="mul"), kind="sum", dims=[last], keepdim=False),
                          kind="sqrt")
    s = cx.b.reduce(cx.b.binary(d, cx.to(float(p), acc), kind="pow"), kind="sum", dims=[last], keepdim=False)
    return cx.b.binary(s, cx.to(1.0 / float(p), acc), kind="pow")


def _acc(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


@lower(aten._cdist_forward.default, dtypes=FLOATS)
def lower_cdist(cx: Cx, x1, x2, p, compute_mode=None):
    return cx.to(_distances(cx, x1, x2, float(p), _acc(cx.out_dtype)), cx.out_dtype)


@lower(aten._pdist_forward.default, dtypes=FLOATS)
def lower_pdist(cx: Cx, x, p=2.0):
    """The upper triangle (i < j, row-major) of the all-pairs distance matrix."""
    n = cx.shape(x)[0]
    full = cx.b.reshape(_distances(cx, x, x, float(p), _acc(cx.out_dtype)), [n * n])
    pairs = torch.tensor([i * n + j for i in range(n) for j in range(i + 1, n)], dtype=torch.int64)
    return cx.to(cx.b.index_select(full, cx.b.constant(pairs, torch.int64, (pairs.numel(),)), dim=0),
                 cx.out_dtype)


@lower(aten.dist.default, dtypes=FLOATS)
def lower_dist(cx: Cx, a, b, p=2):
    """||a - b||_p over every element (the operands broadcast)."""
    acc = _acc(cx.out_dtype)
    d = cx.b.binary(cx.to(a, acc), cx.to(b, acc), kind="sub")
    n = math.prod(cx.shape(d))
    flat = cx.b.reshape(d, [1, n])
    zero = cx.b.broadcast(cx.to(0.0, acc), shape=[1, n])
    return cx.to(cx.b.reshape(_distances(cx, flat, zero, float(p), acc), []), cx.out_dtype)

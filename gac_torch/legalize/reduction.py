"""Reductions, softmax and normalizations."""

from __future__ import annotations

import torch

from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import aten, lower


def _dims(cx: Cx, x, dims) -> list[int]:
    rank = len(cx.shape(x))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d % max(rank, 1) for d in dims]


def _reduce(kind: str, *overloads):
    @lower(*overloads)
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


@lower(aten.mean.dim, aten.mean.default)
def lower_mean(cx: Cx, x, dims=None, keepdim=False, *, dtype=None):
    dt = cx.out_dtype
    ds = _dims(cx, x, dims)
    count = 1
    for d in ds:
        count *= cx.shape(x)[d]
    s = cx.b.reduce(cx.to(x, dt), kind="sum", dims=ds, keepdim=bool(keepdim))
    return cx.b.binary(s, cx.to(float(count), dt), kind="div")


@lower(aten.var.correction, aten.std.correction)
def lower_var(cx: Cx, x, dims=None, *, correction=None, keepdim=False):
    dt = cx.out_dtype
    xf = cx.to(x, dt)
    ds = _dims(cx, x, dims)
    n = 1
    for d in ds:
        n *= cx.shape(x)[d]
    corr = 1 if correction is None else correction
    mean = cx.b.binary(cx.b.reduce(xf, kind="sum", dims=ds, keepdim=True), cx.to(float(n), dt), kind="div")
    cent = cx.b.binary(xf, mean, kind="sub")
    ss = cx.b.reduce(cx.b.binary(cent, cent, kind="mul"), kind="sum", dims=ds, keepdim=bool(keepdim))
    var = cx.b.binary(ss, cx.to(float(max(n - corr, 0)), dt), kind="div")
    return cx.b.unary(var, kind="sqrt") if cx.node.target is aten.std.correction else var


@lower(aten.argmax.default, aten.argmin.default,
       check=lambda n: None if len(n.args) > 1 and n.args[1] is not None else "argmax over all dims")
def lower_argmax(cx: Cx, x, dim=None, keepdim=False):
    kind = "max" if cx.node.target is aten.argmax.default else "min"
    return cx.b.arg_reduce(x, kind=kind, dim=dim, keepdim=bool(keepdim))


@lower(aten._softmax.default, aten._log_softmax.default)
def lower_softmax(cx: Cx, x, dim, half_to_float=False):
    log = cx.node.target is aten._log_softmax.default
    return cx.b.softmax(cx.to(x, cx.out_dtype), dim=dim, log=int(log))


@lower(aten.max.dim, aten.min.dim)
def lower_max_dim(cx: Cx, x, dim, keepdim=False):
    kind = "max" if cx.node.target is aten.max.dim else "min"
    d = _dims(cx, x, dim)
    values = cx.b.reduce(x, kind=kind, dims=d, keepdim=bool(keepdim))
    return values, cx.b.arg_reduce(x, kind=kind, dim=d[0], keepdim=bool(keepdim))


@lower(aten.var_mean.correction)
def lower_var_mean(cx: Cx, x, dims=None, *, correction=None, keepdim=False):
    dt = meta_val(cx.node)[0].dtype
    ds = _dims(cx, x, dims)
    n = 1
    for d in ds:
        n *= cx.shape(x)[d]
    xf = cx.to(x, dt)
    mean_k = cx.b.binary(cx.b.reduce(xf, kind="sum", dims=ds, keepdim=True), cx.to(float(n), dt), kind="div")
    cent = cx.b.binary(xf, mean_k, kind="sub")
    ss = cx.b.reduce(cx.b.binary(cent, cent, kind="mul"), kind="sum", dims=ds, keepdim=bool(keepdim))
    corr = 1 if correction is None else correction
    var = cx.b.binary(ss, cx.to(float(max(n - corr, 0)), dt), kind="div")
    return var, cx.b.reshape(mean_k, list(meta_val(cx.node)[1].shape))


@lower(aten.cumsum.default, aten.cumprod.default)
def lower_cumsum(cx: Cx, x, dim, *, dtype=None):
    kind = "sum" if cx.node.target is aten.cumsum.default else "prod"
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

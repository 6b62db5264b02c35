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


@lower(aten.native_layer_norm.default)
def lower_native_layer_norm(cx: Cx, x, normalized_shape, weight, bias, eps):
    dt = meta_val(cx.node)[0].dtype
    shape = list(normalized_shape)
    w = cx.to(weight if weight is not None else 1.0, dt)
    b = cx.to(bias if bias is not None else 0.0, dt)
    w = cx.b.broadcast(w, shape=shape) if cx.shape(w) != shape else w
    b = cx.b.broadcast(b, shape=shape) if cx.shape(b) != shape else b
    return cx.b.layer_norm(x, w, b, normalized_rank=len(shape), eps=float(eps))


def _bn_shape(cx: Cx, x) -> list[int]:
    rank = len(cx.shape(x))
    return [cx.shape(x)[1]] + [1] * (rank - 2)


@lower(aten._native_batch_norm_legit_no_training.default)
def lower_batch_norm_inference(cx: Cx, x, weight, bias, running_mean, running_var, momentum, eps):
    """y = (x - mean) * rsqrt(var + eps) * w + b, with per-channel vectors broadcast over C."""
    dt = meta_val(cx.node)[0].dtype
    stat_dt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
    ch = _bn_shape(cx, x)
    mean = cx.b.reshape(cx.to(running_mean, stat_dt), ch)
    var = cx.b.reshape(cx.to(running_var, stat_dt), ch)
    scale = cx.b.unary(cx.b.binary(var, cx.to(float(eps), stat_dt), kind="add"), kind="rsqrt")
    if weight is not None:
        scale = cx.b.binary(scale, cx.b.reshape(cx.to(weight, stat_dt), ch), kind="mul")
    y = cx.b.binary(cx.b.binary(cx.to(x, stat_dt), mean, kind="sub"), scale, kind="mul")
    if bias is not None:
        y = cx.b.binary(y, cx.b.reshape(cx.to(bias, stat_dt), ch), kind="add")
    empty = cx.b.constant(0.0, dt, (0,))
    return cx.to(y, dt), empty, empty


@lower(aten.max.dim, aten.min.dim)
def lower_max_dim(cx: Cx, x, dim, keepdim=False):
    kind = "max" if cx.node.target is aten.max.dim else "min"
    d = _dims(cx, x, dim)
    values = cx.b.reduce(x, kind=kind, dims=d, keepdim=bool(keepdim))
    return values, cx.b.arg_reduce(x, kind=kind, dim=d[0], keepdim=bool(keepdim))

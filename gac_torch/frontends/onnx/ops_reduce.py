"""Reductions: Reduce* (axes as an attribute, or as an input since opset 13 for ReduceSum and 18
for the others — both forms accepted), ArgMax/ArgMin, Softmax/LogSoftmax, CumSum."""

from __future__ import annotations

import torch

from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.registry import OnnxNode, Unsupported, onnx_op

aten = torch.ops.aten


def _axes(g: GraphBuilder, n: OnnxNode, x: Value, axes: Value | None) -> list[int] | None:
    """Normalized axes; None means 'no reduction' (noop_with_empty_axes with empty axes)."""
    given = n.attr("axes")
    if given is None:
        given = g.ints(axes, f"{n.op_type} axes")
    rank = g.rank(x)
    if not given:
        return None if n.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in given) if rank else []


def _sum(g: GraphBuilder, x: Value, dims: list[int], keep: bool) -> Value:
    return g.call(aten.sum.dim_IntList, x, dims, keep)


def _reduce(g: GraphBuilder, n: OnnxNode, x: Value, dims: list[int], keep: bool) -> Value:
    op = n.op_type
    if op == "ReduceSum":
        return _sum(g, x, dims, keep)
    if op == "ReduceMean":
        return g.call(aten.mean.dim, x, dims, keep)
    if op == "ReduceMax":
        return g.call(aten.amax.default, x, dims, keep)
    if op == "ReduceMin":
        return g.call(aten.amin.default, x, dims, keep)
    if op == "ReduceProd":
        for d in sorted(dims, reverse=True):  # prod takes one dim at a time
            x = g.call(aten.prod.dim_int, x, d, keep)
        return x
    if op == "ReduceL1":
        return _sum(g, g.call(aten.abs.default, x), dims, keep)
    if op == "ReduceSumSquare":
        return _sum(g, g.call(aten.mul.Tensor, x, x), dims, keep)
    if op == "ReduceL2":
        return g.call(aten.sqrt.default, _sum(g, g.call(aten.mul.Tensor, x, x), dims, keep))
    if op == "ReduceLogSum":
        return g.call(aten.log.default, _sum(g, x, dims, keep))
    # ReduceLogSumExp, stabilized: m + log(sum(exp(x - m)))
    m = g.call(aten.amax.default, x, dims, True)
    s = _sum(g, g.call(aten.exp.default, g.call(aten.sub.Tensor, x, m)), dims, keep)
    m = m if keep else g.call(aten.squeeze.dims, m, dims)
    return g.call(aten.add.Tensor, g.call(aten.log.default, s), m)


@onnx_op(
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
)
def reduce(g: GraphBuilder, n: OnnxNode, x: Value, axes: Value | None = None) -> Value:
    dims = _axes(g, n, x, axes)
    if dims is None:
        return x
    if g.rank(x) == 0:
        return x
    return _reduce(g, n, x, dims, bool(n.attr("keepdims", 1)))


@onnx_op("ArgMax", "ArgMin")
def arg_reduce(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    if n.attr("select_last_index", 0):
        raise Unsupported("select_last_index=1")
    op = aten.argmax.default if n.op_type == "ArgMax" else aten.argmin.default
    return g.call(op, x, n.attr("axis", 0) % max(g.rank(x), 1), bool(n.attr("keepdims", 1)))


@onnx_op("Softmax", "LogSoftmax")
def softmax(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    # Opset >= 13: one axis (default -1). Older opsets flatten from `axis` (default 1).
    op = aten._softmax.default if n.op_type == "Softmax" else aten._log_softmax.default
    return g.call(op, x, n.attr("axis", -1) % max(g.rank(x), 1), False)


@onnx_op("CumSum")
def cumsum(g: GraphBuilder, n: OnnxNode, x: Value, axis: Value) -> Value:
    dim = int(g.scalar(axis, "CumSum axis")) % g.rank(x)
    rev = torch.arange(g.shape(x)[dim] - 1, -1, -1)  # reverse=1: flip by static indices
    if n.attr("reverse", 0):
        x = g.call(aten.index_select.default, x, dim, rev)
    y = g.call(aten.cumsum.default, x, dim)
    if n.attr("exclusive", 0):
        y = g.call(aten.sub.Tensor, y, x)
    if n.attr("reverse", 0):
        y = g.call(aten.index_select.default, y, dim, rev)
    return y

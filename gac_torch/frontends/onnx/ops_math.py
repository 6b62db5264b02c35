"""Matrix ONNX ops: MatMul, Gemm, Einsum (make_fx turns aten.matmul into mm/bmm + views)."""

from __future__ import annotations

import torch

from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.registry import OnnxNode, onnx_op

aten = torch.ops.aten


@onnx_op("MatMul")
def matmul(g: GraphBuilder, n: OnnxNode, a: Value, b: Value) -> Value:
    # numpy rules for 1-D operands, spelled out: ATen's matmul would use an in-place squeeze_.
    va, vb = g.rank(a) == 1, g.rank(b) == 1
    if va:
        a = g.call(aten.unsqueeze.default, a, 0)
    if vb:
        b = g.call(aten.unsqueeze.default, b, 1)
    y = g.call(aten.matmul.default, a, b)
    if va or vb:
        y = g.call(aten.squeeze.dims, y, ([-2] if va else []) + ([-1] if vb else []))
    return y


@onnx_op("Gemm")
def gemm(g: GraphBuilder, n: OnnxNode, a: Value, b: Value, c: Value | None = None) -> Value:
    """Y = alpha * A' @ B' + beta * C, with A' = A^T if transA (B likewise); C broadcasts."""
    if n.attr("transA", 0):
        a = g.call(aten.t.default, a)
    if n.attr("transB", 0):
        b = g.call(aten.t.default, b)
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    y = g.call(aten.mm.default, a, b)
    if alpha != 1.0:
        y = g.call(aten.mul.Scalar, y, alpha)
    if c is None or beta == 0.0:
        return y
    if beta != 1.0:
        c = g.call(aten.mul.Scalar, c, beta)
    return g.call(aten.add.Tensor, y, c)


@onnx_op("Einsum")
def einsum(g: GraphBuilder, n: OnnxNode, *xs: Value) -> Value:
    return g.call(aten.einsum.default, n.attr("equation").replace(" ", ""), list(xs))

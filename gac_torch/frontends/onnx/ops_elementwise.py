"""Elementwise ONNX ops: arithmetic, activations, comparisons, logic, Where, Cast, Clip.

ONNX requires matching operand types, so no promotion rules are needed beyond what ATen does.
"""

from __future__ import annotations

import math

import torch

from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.load import torch_dtype
from gac_torch.frontends.onnx.registry import OnnxNode, Unsupported, onnx_op

aten = torch.ops.aten

_UNARY = {
    "Relu": aten.relu.default,
    "Sigmoid": aten.sigmoid.default,
    "Tanh": aten.tanh.default,
    "Erf": aten.erf.default,
    "Exp": aten.exp.default,
    "Log": aten.log.default,
    "Sqrt": aten.sqrt.default,
    "Neg": aten.neg.default,
    "Abs": aten.abs.default,
    "Reciprocal": aten.reciprocal.default,
    "Floor": aten.floor.default,
    "Ceil": aten.ceil.default,
    "Round": aten.round.default,
    "Sin": aten.sin.default,
    "Cos": aten.cos.default,
    "Tan": aten.tan.default,
    "Asin": aten.asin.default,
    "Acos": aten.acos.default,
    "Atan": aten.atan.default,
    "Sinh": aten.sinh.default,
    "Cosh": aten.cosh.default,
    "Asinh": aten.asinh.default,
    "Acosh": aten.acosh.default,
    "Atanh": aten.atanh.default,
    "Sign": aten.sign.default,
    "Not": aten.logical_not.default,
    "IsNaN": aten.isnan.default,
    "BitwiseNot": aten.bitwise_not.default,
    "Softsign": None,
    "Mish": aten.mish.default,
}
_BINARY = {
    "Add": aten.add.Tensor,
    "Sub": aten.sub.Tensor,
    "Mul": aten.mul.Tensor,
    "Equal": aten.eq.Tensor,
    "Less": aten.lt.Tensor,
    "LessOrEqual": aten.le.Tensor,
    "Greater": aten.gt.Tensor,
    "GreaterOrEqual": aten.ge.Tensor,
    "And": aten.logical_and.default,
    "Or": aten.logical_or.default,
    "Xor": aten.logical_xor.default,
    "BitwiseAnd": aten.bitwise_and.Tensor,
    "BitwiseOr": aten.bitwise_or.Tensor,
    "BitwiseXor": aten.bitwise_xor.Tensor,
}


@onnx_op(*_UNARY)
def unary(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    if n.op_type == "Softsign":  # x / (1 + |x|)
        return g.call(aten.div.Tensor, x, g.call(aten.add.Scalar, g.call(aten.abs.default, x), 1))
    return g.call(_UNARY[n.op_type], x)


@onnx_op(*_BINARY)
def binary(g: GraphBuilder, n: OnnxNode, a: Value, b: Value) -> Value:
    return g.call(_BINARY[n.op_type], a, b)


@onnx_op("Div")
def div(g: GraphBuilder, n: OnnxNode, a: Value, b: Value) -> Value:
    if g.dtype(a).is_floating_point:
        return g.call(aten.div.Tensor, a, b)
    return g.call(aten.div.Tensor_mode, a, b, rounding_mode="trunc")  # integer Div truncates


@onnx_op("Mod")
def mod(g: GraphBuilder, n: OnnxNode, a: Value, b: Value) -> Value:
    if n.attr("fmod", 0) or g.dtype(a).is_floating_point:
        return g.call(aten.fmod.Tensor, a, b)  # sign of the dividend (C fmod)
    return g.call(aten.remainder.Tensor, a, b)  # sign of the divisor


@onnx_op("Pow")
def pow_(g: GraphBuilder, n: OnnxNode, a: Value, b: Value) -> Value:
    # The result has the base's type; the exponent may be of another type.
    if g.is_const(b) and b.numel() == 1 and g.dtype(a).is_floating_point:
        e = b.item()
        if e == 2:
            return g.call(aten.mul.Tensor, a, a)
        if e == 0.5:
            return g.call(aten.sqrt.default, a)
        return g.call(aten.pow.Tensor_Scalar, a, e)
    return g.cast(g.call(aten.pow.Tensor_Tensor, a, b), g.dtype(a))


def _variadic(g: GraphBuilder, op, xs: tuple[Value, ...]) -> Value:
    acc = xs[0]
    for x in xs[1:]:
        acc = g.call(op, acc, x)
    return acc


@onnx_op("Max")
def max_(g: GraphBuilder, n: OnnxNode, *xs: Value) -> Value:
    return _variadic(g, aten.maximum.default, xs)


@onnx_op("Min")
def min_(g: GraphBuilder, n: OnnxNode, *xs: Value) -> Value:
    return _variadic(g, aten.minimum.default, xs)


@onnx_op("Sum")
def sum_(g: GraphBuilder, n: OnnxNode, *xs: Value) -> Value:
    return _variadic(g, aten.add.Tensor, xs)


@onnx_op("Mean")
def mean(g: GraphBuilder, n: OnnxNode, *xs: Value) -> Value:
    return g.call(aten.div.Scalar, _variadic(g, aten.add.Tensor, xs), len(xs))


@onnx_op("Where")
def where(g: GraphBuilder, n: OnnxNode, cond: Value, a: Value, b: Value) -> Value:
    return g.call(aten.where.self, cond, a, b)


@onnx_op("IsInf")
def isinf(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    pos, neg = n.attr("detect_positive", 1), n.attr("detect_negative", 1)
    if pos and neg:
        return g.call(aten.isinf.default, x)
    if not pos and not neg:
        return g.call(aten.full_like.default, x, False, dtype=torch.bool)
    return g.call(aten.eq.Scalar, x, math.inf if pos else -math.inf)


@onnx_op("Clip")
def clip(
    g: GraphBuilder, n: OnnxNode, x: Value, lo: Value | None = None, hi: Value | None = None
) -> Value:
    if (lo is None or g.is_const(lo)) and (hi is None or g.is_const(hi)):
        lo_s = None if lo is None else g.scalar(lo, "Clip min")
        hi_s = None if hi is None else g.scalar(hi, "Clip max")
        if lo_s is None and hi_s is None:
            return x
        return g.call(aten.clamp.default, x, lo_s, hi_s)
    return g.call(aten.clamp.Tensor, x, lo, hi)


@onnx_op("Cast")
def cast(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return g.cast(x, torch_dtype(n.attr("to")))


@onnx_op("CastLike")
def cast_like(g: GraphBuilder, n: OnnxNode, x: Value, like: Value) -> Value:
    return g.cast(x, g.dtype(like))


@onnx_op("Identity")
def identity(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return x


@onnx_op("Dropout")
def dropout(
    g: GraphBuilder,
    n: OnnxNode,
    x: Value,
    ratio: Value | None = None,
    training: Value | None = None,
) -> tuple[Value, Value]:
    if training is not None and g.scalar(training, "Dropout training_mode"):
        raise Unsupported("training_mode=True")
    return x, g.call(aten.full.default, g.shape(x), True, dtype=torch.bool)  # inference: identity


# --- activations with attributes --------------------------------------------------------------


def _relu_plus(g: GraphBuilder, x: Value, neg_part) -> Value:
    """relu(x) + neg_part(min(x, 0)): piecewise activations without a bool mask (exact, since
    each side adds a zero)."""
    return g.call(
        aten.add.Tensor,
        g.call(aten.relu.default, x),
        neg_part(g.call(aten.clamp.default, x, None, 0.0)),
    )


@onnx_op("LeakyRelu")
def leaky_relu(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return _relu_plus(g, x, lambda m: g.call(aten.mul.Scalar, m, n.attr("alpha", 0.01)))


@onnx_op("Elu", "Selu")
def elu(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    """Elu: x > 0 ? x : alpha * (exp(x) - 1); Selu scales both sides by gamma."""
    selu = n.op_type == "Selu"
    alpha = n.attr("alpha", 1.67326319217681884765625 if selu else 1.0)
    y = _relu_plus(g, x, lambda m: g.call(aten.mul.Scalar, g.call(aten.expm1.default, m), alpha))
    return g.call(aten.mul.Scalar, y, n.attr("gamma", 1.05070102214813232421875)) if selu else y


@onnx_op("Celu")
def celu(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return g.call(aten.celu.default, x, n.attr("alpha", 1.0))


@onnx_op("HardSigmoid")
def hard_sigmoid(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    y = g.call(
        aten.add.Scalar, g.call(aten.mul.Scalar, x, n.attr("alpha", 0.2)), n.attr("beta", 0.5)
    )
    return g.call(aten.clamp.default, y, 0.0, 1.0)


@onnx_op("HardSwish")
def hard_swish(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return g.call(aten.hardswish.default, x)


@onnx_op("Softplus")
def softplus(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return g.call(aten.softplus.default, x)


@onnx_op("ThresholdedRelu")
def thresholded_relu(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    keep = g.call(aten.gt.Scalar, x, n.attr("alpha", 1.0))
    return g.call(aten.where.self, keep, x, g.call(aten.zeros_like.default, x))


@onnx_op("PRelu")
def prelu(g: GraphBuilder, n: OnnxNode, x: Value, slope: Value) -> Value:
    # ONNX broadcasts slope unidirectionally (numpy rules), unlike aten.prelu's channel axis.
    return _relu_plus(g, x, lambda m: g.call(aten.mul.Tensor, m, slope))


@onnx_op("Gelu")
def gelu(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return g.call(
        aten.gelu.default, x, approximate=n.only("approximate", "none", "tanh", default="none")
    )

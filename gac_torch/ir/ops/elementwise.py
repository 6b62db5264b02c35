"""Pointwise ops: unary/binary with a kind, select, cast, constant, iota."""

from __future__ import annotations

from mlir import ir

from gac_torch.ir.dialect import define
from gac_torch.ir.ops._infer import GacTypeError, broadcast_shapes, check_sizes, same_elem, shape_of, tensor

UNARY_KINDS = (
    "neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
    "reciprocal", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh",
    "acosh", "atanh", "erf", "erfc", "erfinv", "sigmoid", "relu", "gelu", "gelu_tanh", "silu", "floor",
    "ceil", "round", "trunc", "sign", "logical_not", "bitwise_not", "isnan", "isinf", "square",
    "signbit",
)
# Kinds whose result is i1 whatever the operand type.
UNARY_PREDICATES = ("logical_not", "isnan", "isinf", "signbit")

BINARY_KINDS = (
    "add", "sub", "mul", "div", "floordiv", "truncdiv", "remainder", "fmod", "pow", "atan2",
    "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "shl", "shr", "copysign", "hypot",
)
BINARY_PREDICATES = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor")


def _i1() -> ir.Type:
    return ir.IntegerType.get_signless(1)


def _infer_unary(types, attrs):
    (x,) = types
    elem = _i1() if attrs["kind"] in UNARY_PREDICATES else ir.RankedTensorType(x).element_type
    return [tensor(shape_of(x), elem)]


def _infer_binary(types, attrs):
    elem = same_elem(types, f"gac.binary {attrs['kind']}")
    shape = broadcast_shapes(*map(shape_of, types))
    return [tensor(shape, _i1() if attrs["kind"] in BINARY_PREDICATES else elem)]


def _infer_select(types, attrs):
    cond, a, b = types
    if str(ir.RankedTensorType(cond).element_type) != "i1":
        raise GacTypeError("gac.select: condition must be i1")
    elem = same_elem([a, b], "gac.select")
    return [tensor(broadcast_shapes(*map(shape_of, types)), elem)]


def _check_cast(types, attrs, results):
    if shape_of(results[0]) != shape_of(types[0]):
        raise GacTypeError("gac.cast: result shape must equal operand shape")


def _check_constant(types, attrs, results):
    if attrs["value"].type != results[0]:
        raise GacTypeError(f"gac.constant: value type {attrs['value'].type} != result {results[0]}")


define("unary", ["x"], attrs={"kind": UNARY_KINDS}, infer=_infer_unary,
       doc="y = kind(x), elementwise; predicate kinds give i1")
define("binary", ["lhs", "rhs"], attrs={"kind": BINARY_KINDS}, infer=_infer_binary,
       doc="y = lhs kind rhs with numpy broadcasting; operands share one element type")
define("select", ["cond", "on_true", "on_false"], infer=_infer_select,
       doc="y = cond ? on_true : on_false, broadcast")
define("cast", ["x"], check=_check_cast, doc="element type conversion with torch semantics (float->int truncates)")
define("constant", [], attrs={"value": "any"}, check=_check_constant,
       doc="a small dense constant (scalars, tiny tables); weights are function arguments")
define("iota", ["sizes*:index"], attrs={"dim": "int"},
       check=lambda types, attrs, results: check_sizes("iota", shape_of(results[0]), len(types)),
       doc="y[i...] = i_dim, in the result element type; `sizes` gives the ? dims of the result")

"""Pointwise ATen ops -> gac.unary / gac.binary / gac.select / gac.cast.

Every lowering here is shape-agnostic (gac's pointwise ops broadcast by their operand types), so
all of them take run-time sizes (`dynamic=True`)."""

from __future__ import annotations

import functools

import torch

from gac_torch.legalize import registry
from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import ALL_DTYPES, FLOATS, aten

lower = functools.partial(registry.lower, dynamic=True)


def promoted(cx: Cx, *positions: int) -> torch.dtype:
    """torch's type promotion over the node's args at `positions` (0-d tensors count as scalars)."""
    probes = []
    for i in positions:
        a = cx.node.args[i] if i < len(cx.node.args) else None
        v = meta_val(a)
        if isinstance(v, torch.Tensor):
            probes.append(torch.empty((1,) * min(v.dim(), 1), dtype=v.dtype))
        elif a is not None:
            probes.append(a)
    out = probes[0] if isinstance(probes[0], torch.Tensor) else torch.tensor(probes[0])
    for p in probes[1:]:
        out = torch.empty((1,) * min(out.dim(), 1), dtype=torch.result_type(out, p))
    return out.dtype


# Kinds that are the identity on bools (and whose integer form would misread an i1 as -1).
_BOOL_IDENTITY = ("sign", "abs", "floor", "ceil", "round", "trunc")


def _unary(kind: str, *overloads):
    @lower(*overloads)
    def fn(cx: Cx, x, *_):
        if cx.dtype_of(x) == torch.bool and cx.out_dtype == torch.bool and kind in _BOOL_IDENTITY:
            return x
        return cx.b.unary(cx.to(x, cx.out_dtype), kind=kind)
    fn.__name__ = f"lower_{kind}"
    return fn


for _kind, _ops in {
    "neg": [aten.neg.default], "abs": [aten.abs.default], "exp": [aten.exp.default],
    "exp2": [aten.exp2.default], "expm1": [aten.expm1.default], "log": [aten.log.default],
    "log2": [aten.log2.default], "log10": [aten.log10.default], "log1p": [aten.log1p.default],
    "sqrt": [aten.sqrt.default], "rsqrt": [aten.rsqrt.default],
    "reciprocal": [aten.reciprocal.default], "sin": [aten.sin.default], "cos": [aten.cos.default],
    "tan": [aten.tan.default], "asin": [aten.asin.default], "acos": [aten.acos.default],
    "atan": [aten.atan.default], "sinh": [aten.sinh.default], "cosh": [aten.cosh.default],
    "tanh": [aten.tanh.default], "asinh": [aten.asinh.default], "acosh": [aten.acosh.default],
    "atanh": [aten.atanh.default], "erf": [aten.erf.default], "sigmoid": [aten.sigmoid.default],
    "relu": [aten.relu.default], "silu": [aten.silu.default], "floor": [aten.floor.default],
    "ceil": [aten.ceil.default], "round": [aten.round.default], "trunc": [aten.trunc.default],
    "sign": [aten.sign.default, aten.sgn.default], "bitwise_not": [aten.bitwise_not.default],
    "erfc": [aten.erfc.default], "erfinv": [aten.erfinv.default],
}.items():
    _unary(_kind, *_ops)


@lower(aten.gelu.default)
def lower_gelu(cx: Cx, x, approximate: str = "none"):
    return cx.b.unary(cx.to(x, cx.out_dtype), kind="gelu_tanh" if approximate == "tanh" else "gelu")


def _predicate(kind: str, *overloads):
    @lower(*overloads)
    def fn(cx: Cx, x):
        return cx.b.unary(x, kind=kind)
    fn.__name__ = f"lower_{kind}"


_predicate("isnan", aten.isnan.default)
_predicate("isinf", aten.isinf.default)
_predicate("logical_not", aten.logical_not.default)


@lower(aten.signbit.default)
def lower_signbit(cx: Cx, x):
    # An i1 reads as -1 when signed: give bools a wider integer first (their sign bit is 0).
    return cx.b.unary(cx.to(x, torch.int8) if cx.dtype_of(x) == torch.bool else x, kind="signbit")


def float_result(node) -> str | None:
    """integer results"""
    return None if meta_val(node).dtype.is_floating_point else "integer result"


# Ops whose Python-scalar operand stays in f32 next to an f16/bf16 tensor (see _scaled).
_SCALAR_IN_F32 = frozenset({"add", "sub", "mul", "div", "pow"})


def _is_python_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scaled(cx: Cx, kind: str, a, b, alpha):
    """a kind (alpha * b) in the result dtype. With an alpha, f16/bf16 compute in f32 and round
    once, as ATen's add/sub kernels do (rounding alpha * b first loses digits to cancellation).
    A Python scalar next to an f16/bf16 tensor stays an f32 constant and the result is rounded
    once, on every target: CUDA eager does so for all of these ops (its scalar is an opmath f32),
    CPU eager for mul/div/pow but not add/sub, which round the scalar to the tensor's dtype
    first (1 ulp apart on ~5 % of bf16 elements for x + 0.1)."""
    dt = cx.out_dtype
    scalar = kind in _SCALAR_IN_F32 and (_is_python_number(a) or _is_python_number(b))
    ct = cx.compute_dtype(dt) if alpha != 1 or scalar else dt
    rhs = cx.to(b, ct)
    if alpha != 1:
        rhs = cx.b.binary(rhs, cx.to(alpha, ct), kind="mul")
    return cx.to(cx.b.binary(cx.to(a, ct), rhs, kind=kind), dt)


def _arith(kind: str, *overloads, check=None, dtypes=ALL_DTYPES):
    """a kind b computed in the result dtype; `alpha` scales b (add/sub)."""
    @lower(*overloads, check=check, dtypes=dtypes)
    def fn(cx: Cx, a, b, alpha=1):
        return _scaled(cx, kind, a, b, alpha)
    fn.__name__ = f"lower_{kind}"


_arith("add", aten.add.Tensor, aten.add.Scalar)
_arith("sub", aten.sub.Tensor, aten.sub.Scalar)
_arith("mul", aten.mul.Tensor, aten.mul.Scalar)
_arith("div", aten.div.Tensor, aten.div.Scalar)
_arith("pow", aten.pow.Tensor_Tensor, aten.pow.Scalar)

# ATen's float kernel computes these exponents as sqrt / rsqrt, not pow: (-inf) ** 0.5 is NaN
# and (-0.0) ** 0.5 is -0.0 (C's pow gives inf and 0.0).
_POW_AS_UNARY = {0.5: "sqrt", -0.5: "rsqrt"}


@lower(aten.pow.Tensor_Scalar)
def lower_pow_scalar(cx: Cx, x, exponent):
    if cx.out_dtype.is_floating_point and exponent in _POW_AS_UNARY:
        return cx.b.unary(cx.to(x, cx.out_dtype), kind=_POW_AS_UNARY[exponent])
    if cx.out_dtype.is_floating_point and exponent == 2:  # ATen squares (x ** 2 in RMSNorm):
        xt = cx.to(x, cx.out_dtype)  # exact, and no pow expansion per element on the GPU
        return cx.b.binary(xt, xt, kind="mul")
    return _scaled(cx, "pow", x, exponent, 1)
_arith("atan2", aten.atan2.default, check=float_result)
_arith("maximum", aten.maximum.default)
_arith("minimum", aten.minimum.default)
_arith("remainder", aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
_arith("fmod", aten.fmod.Tensor, aten.fmod.Scalar)
_arith("bitwise_and", aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor)
_arith("bitwise_or", aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor)
_arith("bitwise_xor", aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor)
_arith("shl", aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
       aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)
_arith("shr", aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
       aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)
_arith("hypot", aten.hypot.default, check=float_result)
_arith("copysign", aten.copysign.Tensor, aten.copysign.Scalar, check=float_result)


@lower(aten.rsub.Scalar, aten.rsub.Tensor)
def lower_rsub(cx: Cx, a, b, alpha=1):
    return _scaled(cx, "sub", b, a, alpha)


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def lower_div_mode(cx: Cx, a, b, rounding_mode=None):
    dt = cx.out_dtype
    if rounding_mode == "trunc" and dt.is_floating_point:
        return cx.b.unary(cx.b.binary(cx.to(a, dt), cx.to(b, dt), kind="div"), kind="trunc")
    kind = {None: "div", "trunc": "truncdiv", "floor": "floordiv"}[rounding_mode]
    return cx.b.binary(cx.to(a, dt), cx.to(b, dt), kind=kind)


def _compare(kind: str, *overloads):
    @lower(*overloads)
    def fn(cx: Cx, a, b):
        dt = promoted(cx, 0, 1)
        return cx.b.binary(cx.to(a, dt), cx.to(b, dt), kind=kind)
    fn.__name__ = f"lower_{kind}"


for _kind in ("eq", "ne", "lt", "le", "gt", "ge"):
    _compare(_kind, getattr(aten, _kind).Tensor, getattr(aten, _kind).Scalar)
_compare("logical_and", aten.logical_and.default)
_compare("logical_or", aten.logical_or.default)
_compare("logical_xor", aten.logical_xor.default)


@lower(aten.where.self)
def lower_where(cx: Cx, cond, a, b):
    dt = cx.out_dtype
    return cx.b.select(cx.to(cond, torch.bool), cx.to(a, dt), cx.to(b, dt))


@lower(aten.clamp.default, aten.clamp.Tensor)
def lower_clamp(cx: Cx, x, lo=None, hi=None):
    dt = cx.out_dtype
    y = cx.to(x, dt)
    # min/max with NaN-propagation, like ATen's clamp.
    if lo is not None:
        y = cx.b.binary(y, cx.to(lo, dt), kind="maximum")
    if hi is not None:
        y = cx.b.binary(y, cx.to(hi, dt), kind="minimum")
    return y


@lower(aten.lerp.Scalar, aten.lerp.Tensor)
def lower_lerp(cx: Cx, start, end, weight):
    """ATen's form, in f32 for f16/bf16: |w| < 0.5 ? s + w * (e - s) : e - (e - s) * (1 - w)."""
    dt = cx.out_dtype
    ct = cx.compute_dtype(dt)
    s, e, w = cx.to(start, ct), cx.to(end, ct), cx.to(weight, ct)
    diff = cx.b.binary(e, s, kind="sub")
    low = cx.b.binary(s, cx.b.binary(w, diff, kind="mul"), kind="add")
    high = cx.b.binary(e, cx.b.binary(diff, cx.b.binary(cx.to(1.0, ct), w, kind="sub"), kind="mul"), kind="sub")
    small = cx.b.binary(cx.b.unary(w, kind="abs"), cx.to(0.5, ct), kind="lt")
    return cx.to(cx.b.select(small, low, high), dt)


def _same_device(node) -> str | None:
    """device transfers"""
    src, out = meta_val(node.args[0]), meta_val(node)
    return None if src.device == out.device else "device transfer"


@lower(aten._to_copy.default, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default,
       torch.ops.prims.convert_element_type.default, check=_same_device)
def lower_copy(cx: Cx, x, *_args, **kwargs):
    # A copy in a functional graph is the value itself (memory format does not matter here:
    # gac tensors are dense, row-major).
    return cx.to(x, cx.out_dtype)


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def lower_masked_fill(cx: Cx, x, mask, value):
    dt = cx.out_dtype
    return cx.b.select(cx.to(mask, torch.bool), cx.to(value, dt), cx.to(x, dt))


# Activations core ATen keeps as ops (the rest decompose into the ops above; see buckets.py).
@lower(aten.hardtanh.default)
def lower_hardtanh(cx: Cx, x, min_val=-1.0, max_val=1.0):
    dt = cx.out_dtype
    lo = cx.b.binary(cx.to(x, dt), cx.to(min_val, dt), kind="maximum")
    return cx.b.binary(lo, cx.to(max_val, dt), kind="minimum")


@lower(aten.leaky_relu.default)
def lower_leaky_relu(cx: Cx, x, negative_slope=0.01):
    dt = cx.out_dtype
    xv = cx.to(x, dt)
    pos = cx.b.binary(xv, cx.to(0, dt), kind="gt")
    return cx.b.select(pos, xv, cx.b.binary(xv, cx.to(negative_slope, dt), kind="mul"))


@lower(aten.elu.default)
def lower_elu(cx: Cx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    """x > 0 ? scale * x : scale * alpha * expm1(input_scale * x)."""
    dt = cx.out_dtype
    ct = cx.compute_dtype(dt)
    xv = cx.to(x, ct)
    neg = cx.b.unary(cx.b.binary(xv, cx.to(float(input_scale), ct), kind="mul"), kind="expm1")
    neg = cx.b.binary(neg, cx.to(float(alpha) * float(scale), ct), kind="mul")
    pos = cx.b.binary(xv, cx.to(float(scale), ct), kind="mul")
    return cx.to(cx.b.select(cx.b.binary(xv, cx.to(0, ct), kind="gt"), pos, neg), dt)


@lower(aten.fill.Scalar, aten.fill.Tensor)
def lower_fill(cx: Cx, x, value):
    v = cx.to(value, cx.out_dtype)
    return cx.b.broadcast(v, shape=cx.out_shape) if cx.shape(v) != cx.out_shape else v


@lower(aten.copy.default)
def lower_copy_into(cx: Cx, dst, src, non_blocking=False):
    """The functional copy: src, broadcast to dst's shape and cast to dst's dtype."""
    v = cx.to(src, cx.out_dtype)
    return cx.b.broadcast(v, shape=cx.out_shape) if cx.shape(v) != cx.out_shape else v


@lower(aten.round.decimals, dtypes=FLOATS)
def lower_round_decimals(cx: Cx, x, *, decimals=0):
    dt = cx.out_dtype
    ct = cx.compute_dtype(dt)
    xv, scale = cx.to(x, ct), cx.to(10.0 ** abs(decimals), ct)
    if decimals >= 0:
        y = cx.b.binary(cx.b.unary(cx.b.binary(xv, scale, kind="mul"), kind="round"), scale, kind="div")
    else:
        y = cx.b.binary(cx.b.unary(cx.b.binary(xv, scale, kind="div"), kind="round"), scale, kind="mul")
    return cx.to(y, dt)


@lower(aten.fmax.default, aten.fmin.default)
def lower_fmax(cx: Cx, a, b):
    """maximum/minimum that ignore a NaN operand."""
    dt = cx.out_dtype
    av, bv = cx.to(a, dt), cx.to(b, dt)
    kind = "maximum" if cx.node.target is aten.fmax.default else "minimum"
    m = cx.b.binary(av, bv, kind=kind)
    if not dt.is_floating_point:
        return m
    m = cx.b.select(cx.b.unary(av, kind="isnan"), bv, m)
    return cx.b.select(cx.b.unary(bv, kind="isnan"), av, m)


def _deterministic_dropout(node) -> str | None:
    """random masks (training with 0 < p < 1)"""
    p, train = node.args[1], node.args[2]
    return None if not train or p in (0, 0.0, 1, 1.0) else "random dropout mask (training)"


@lower(aten.native_dropout.default, check=_deterministic_dropout)
def lower_native_dropout(cx: Cx, x, p, train):
    """Without training (or p = 0 / 1) dropout is the identity (or zero) with a constant mask."""
    dt = cx.out_dtype
    keep = not train or p == 0
    y = cx.to(x, dt) if keep else cx.b.broadcast(cx.to(0, dt), shape=cx.out_shape)
    mask = cx.b.broadcast(cx.b.constant(keep, torch.bool), shape=cx.out_shape)
    return y, mask

"""gac pointwise ops -> linalg.generic with arith/math bodies, following ATen's semantics."""

from __future__ import annotations

import math

from mlir import ir
from mlir.dialects import arith, linalg
from mlir.dialects import math as mmath

from gac_torch.ir.builder import op_attrs
from gac_torch.ir.types import is_bool, is_float
from gac_torch.lowering.core import (
    PARALLEL, compute_type, const, convert, elem, elementwise, empty, generic, identity_map, index,
    shape,
)
from gac_torch.lowering.registry import lowers

F = arith.CmpFPredicate
I = arith.CmpIPredicate


def _sigmoid(x):
    one = const(1.0, x.type)
    return arith.divf(one, arith.addf(one, mmath.exp(arith.negf(x))))


def _gelu_tanh(x):
    t = x.type
    inner = arith.mulf(const(math.sqrt(2.0 / math.pi), t),
                       arith.addf(x, arith.mulf(const(0.044715, t), arith.mulf(x, arith.mulf(x, x)))))
    return arith.mulf(arith.mulf(const(0.5, t), x), arith.addf(const(1.0, t), mmath.tanh(inner)))


def _sign_f(x):
    """(x > 0) - (x < 0), as ATen computes it: sign(NaN) is 0, sign(-0.0) is 0."""
    t = x.type
    pos = arith.uitofp(t, arith.cmpf(F.OGT, x, const(0.0, t)))
    neg = arith.uitofp(t, arith.cmpf(F.OLT, x, const(0.0, t)))
    return arith.subf(pos, neg)


def _erfinv(x):
    """Giles' single-precision approximation, then two Newton steps on erf(y) = x (enough for
    f64 too: each step doubles the correct digits). |x| = 1 gives +-inf, |x| > 1 NaN."""
    t = x.type
    c = (lambda v: const(v, t))
    w = arith.negf(mmath.log(arith.mulf(arith.subf(c(1.0), x), arith.addf(c(1.0), x))))
    central = arith.subf(w, c(2.5))
    tail = arith.subf(mmath.sqrt(w), c(3.0))
    p_c = [2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
           -0.00125372503, -0.00417768164, 0.246640727, 1.50140941]
    p_t = [-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
           -0.0076224613, 0.00943887047, 1.00167406, 2.83297682]

    def horner(coeffs, v):
        acc = c(coeffs[0])
        for k in coeffs[1:]:
            acc = arith.addf(c(k), arith.mulf(acc, v))
        return acc

    y = arith.mulf(arith.select(arith.cmpf(F.OLT, w, c(5.0)), horner(p_c, central), horner(p_t, tail)), x)
    for _ in range(2):
        deriv = arith.mulf(c(2.0 / math.sqrt(math.pi)), mmath.exp(arith.negf(arith.mulf(y, y))))
        y = arith.subf(y, arith.divf(arith.subf(mmath.erf(y), x), deriv))
    ax = mmath.absf(x)
    edge = mmath.copysign(c(math.inf), x)
    y = arith.select(arith.cmpf(F.OEQ, ax, c(1.0)), edge, y)
    return arith.select(arith.cmpf(F.OGT, ax, c(1.0)), c(math.nan), y)


def _signbit_f(x):
    bits = ir.IntegerType.get_signless(64 if str(x.type) == "f64" else 32)
    return arith.cmpi(I.slt, arith.bitcast(bits, x), const(0, bits))


def _hypot(a, b):
    """sqrt(a^2 + b^2) without overflow: m * sqrt(1 + (n/m)^2), m = max(|a|, |b|)."""
    t = a.type
    x, y = mmath.absf(a), mmath.absf(b)
    m, n = arith.maximumf(x, y), arith.minimumf(x, y)
    q = arith.divf(n, m)
    r = arith.mulf(m, mmath.sqrt(arith.addf(const(1.0, t), arith.mulf(q, q))))
    r = arith.select(arith.cmpf(F.OEQ, m, const(0.0, t)), const(0.0, t), r)
    inf = arith.ori(arith.cmpf(F.OEQ, x, const(math.inf, t)), arith.cmpf(F.OEQ, y, const(math.inf, t)))
    return arith.select(inf, const(math.inf, t), r)


def _shift(left: bool):
    """torch semantics for shifts by >= the bit width (or negative): 0 to the left, the sign to
    the right (arith leaves them undefined)."""
    def build(a, b):
        t = a.type
        width = const(ir.IntegerType(t).width, t)
        bad = arith.ori(arith.cmpi(I.sge, b, width), arith.cmpi(I.slt, b, const(0, t)))
        if left:
            return arith.select(bad, const(0, t), arith.shli(a, b))
        return arith.select(bad, arith.shrsi(a, arith.subi(width, const(1, t))), arith.shrsi(a, b))
    return build


def _ipow(a, b):
    """Integer power by squaring over every exponent bit (wrapping like ATen); a negative
    exponent gives 1 for a = 1, +-1 for a = -1 and 0 otherwise, as ATen does."""
    t = a.type
    one, zero = const(1, t), const(0, t)
    result, base = one, a
    for k in range(ir.IntegerType(t).width - 1):
        bit = arith.andi(arith.shrsi(b, const(k, t)), one)
        result = arith.select(arith.cmpi(I.ne, bit, zero), arith.muli(result, base), result)
        base = arith.muli(base, base)
    odd = arith.cmpi(I.ne, arith.andi(b, one), zero)
    minus_one = arith.select(odd, const(-1, t), one)
    negative = arith.select(arith.cmpi(I.eq, a, one), one,
                            arith.select(arith.cmpi(I.eq, a, const(-1, t)), minus_one, zero))
    return arith.select(arith.cmpi(I.slt, b, zero), negative, result)


FLOAT_UNARY = {
    "neg": arith.negf, "abs": mmath.absf, "exp": mmath.exp, "exp2": mmath.exp2,
    "expm1": mmath.expm1, "log": mmath.log, "log2": mmath.log2, "log10": mmath.log10,
    "log1p": mmath.log1p, "sqrt": mmath.sqrt, "rsqrt": mmath.rsqrt,
    "reciprocal": lambda x: arith.divf(const(1.0, x.type), x),
    "sin": mmath.sin, "cos": mmath.cos, "tan": mmath.tan, "asin": mmath.asin, "acos": mmath.acos,
    "atan": mmath.atan, "sinh": mmath.sinh, "cosh": mmath.cosh, "tanh": mmath.tanh,
    "asinh": mmath.asinh, "acosh": mmath.acosh, "atanh": mmath.atanh, "erf": mmath.erf,
    "erfc": mmath.erfc, "erfinv": _erfinv, "signbit": _signbit_f, "sigmoid": _sigmoid,
    "relu": lambda x: arith.select(arith.cmpf(F.OGT, x, const(0.0, x.type)), x,
                                   arith.select(arith.cmpf(F.UNO, x, x), x, const(0.0, x.type))),
    "gelu": lambda x: arith.mulf(arith.mulf(const(0.5, x.type), x), arith.addf(
        const(1.0, x.type), mmath.erf(arith.mulf(x, const(1 / math.sqrt(2.0), x.type))))),
    "gelu_tanh": _gelu_tanh,
    "silu": lambda x: arith.mulf(x, _sigmoid(x)),
    "floor": mmath.floor, "ceil": mmath.ceil, "round": mmath.roundeven, "trunc": mmath.trunc,
    "sign": _sign_f, "square": lambda x: arith.mulf(x, x),
    "isnan": lambda x: arith.cmpf(F.UNO, x, x),
    "isinf": lambda x: arith.cmpf(F.OEQ, mmath.absf(x), const(math.inf, x.type)),
    "logical_not": lambda x: arith.cmpf(F.OEQ, x, const(0.0, x.type)),
}

INT_UNARY = {
    "neg": lambda x: arith.subi(const(0, x.type), x), "abs": mmath.absi,
    "relu": lambda x: arith.maxsi(x, const(0, x.type)),
    "sign": lambda x: arith.subi(arith.extui(x.type, arith.cmpi(I.sgt, x, const(0, x.type))),
                                 arith.extui(x.type, arith.cmpi(I.slt, x, const(0, x.type)))),
    "bitwise_not": lambda x: arith.xori(x, const(-1 if not is_bool(x.type) else 1, x.type)),
    "logical_not": lambda x: arith.cmpi(I.eq, x, const(0, x.type)),
    "square": lambda x: arith.muli(x, x),
    "signbit": lambda x: arith.cmpi(I.slt, x, const(0, x.type)),
    "floor": lambda x: x, "ceil": lambda x: x, "round": lambda x: x, "trunc": lambda x: x,
    "isnan": lambda x: const(0, ir.IntegerType.get_signless(1)),
    "isinf": lambda x: const(0, ir.IntegerType.get_signless(1)),
}


def _floordiv_f(a, b):
    """ATen's div_floor_floating: floor of the exact quotient, from fmod (floor(a / b) can be
    one off when a / b rounds up to an integer)."""
    t = a.type
    zero, one = const(0.0, t), const(1.0, t)
    mod = arith.remf(a, b)
    div = arith.divf(arith.subf(a, mod), b)
    fix = arith.andi(arith.cmpf(F.UNE, mod, zero),
                     arith.xori(arith.cmpf(F.OLT, b, zero), arith.cmpf(F.OLT, mod, zero)))
    div = arith.select(fix, arith.subf(div, one), div)
    fl = mmath.floor(div)
    fl = arith.select(arith.cmpf(F.OGT, arith.subf(div, fl), const(0.5, t)), arith.addf(fl, one), fl)
    fl = arith.select(arith.cmpf(F.OEQ, div, zero), mmath.copysign(zero, arith.divf(a, b)), fl)
    return arith.select(arith.cmpf(F.OEQ, b, zero), arith.divf(a, b), fl)


def _atan2_f(y, x):
    """atan2 with both zeros picked out: MLIR's math.atan2 folder returns NaN for two constant
    zeros (eager: +-0 for x = +0, +-pi for x = -0, the sign of y), fuzz seed 1463."""
    t = y.type
    zero, one = const(0.0, t), const(1.0, t)
    both = arith.andi(arith.cmpf(F.OEQ, y, zero), arith.cmpf(F.OEQ, x, zero))
    x_neg = arith.cmpf(F.OLT, mmath.copysign(one, x), zero)
    at_zero = mmath.copysign(arith.select(x_neg, const(math.pi, t), zero), y)
    return arith.select(both, at_zero, mmath.atan2(y, x))


def _remainder_f(a, b):
    # Python-style modulo: the result takes the divisor's sign.
    r = arith.remf(a, b)
    zero = const(0.0, a.type)
    fix = arith.andi(arith.cmpf(F.ONE, r, zero),
                     arith.xori(arith.cmpf(F.OLT, r, zero), arith.cmpf(F.OLT, b, zero)))
    return arith.select(fix, arith.addf(r, b), r)


def _remainder_i(a, b):
    r = arith.remsi(a, b)
    zero = const(0, a.type)
    fix = arith.andi(arith.cmpi(I.ne, r, zero),
                     arith.xori(arith.cmpi(I.slt, r, zero), arith.cmpi(I.slt, b, zero)))
    return arith.select(fix, arith.addi(r, b), r)


def _logical(fn):
    def build(a, b):
        zero = const(0.0, a.type) if is_float(a.type) else const(0, a.type)
        pa = arith.cmpf(F.UNE, a, zero) if is_float(a.type) else arith.cmpi(I.ne, a, zero)
        pb = arith.cmpf(F.UNE, b, zero) if is_float(b.type) else arith.cmpi(I.ne, b, zero)
        return fn(pa, pb)
    return build


FLOAT_BINARY = {
    "add": arith.addf, "sub": arith.subf, "mul": arith.mulf, "div": arith.divf,
    "floordiv": _floordiv_f, "truncdiv": lambda a, b: mmath.trunc(arith.divf(a, b)),
    "remainder": _remainder_f, "fmod": arith.remf, "pow": mmath.powf, "atan2": _atan2_f,
    "maximum": arith.maximumf, "minimum": arith.minimumf, "copysign": mmath.copysign,
    "hypot": _hypot,
    "eq": lambda a, b: arith.cmpf(F.OEQ, a, b), "ne": lambda a, b: arith.cmpf(F.UNE, a, b),
    "lt": lambda a, b: arith.cmpf(F.OLT, a, b), "le": lambda a, b: arith.cmpf(F.OLE, a, b),
    "gt": lambda a, b: arith.cmpf(F.OGT, a, b), "ge": lambda a, b: arith.cmpf(F.OGE, a, b),
}

INT_BINARY = {
    "add": arith.addi, "sub": arith.subi, "mul": arith.muli, "truncdiv": arith.divsi,
    "floordiv": arith.floordivsi, "remainder": _remainder_i, "fmod": arith.remsi, "pow": _ipow,
    "maximum": arith.maxsi, "minimum": arith.minsi,
    "bitwise_and": arith.andi, "bitwise_or": arith.ori, "bitwise_xor": arith.xori,
    "shl": _shift(True), "shr": _shift(False),
    "eq": lambda a, b: arith.cmpi(I.eq, a, b), "ne": lambda a, b: arith.cmpi(I.ne, a, b),
    "lt": lambda a, b: arith.cmpi(I.slt, a, b), "le": lambda a, b: arith.cmpi(I.sle, a, b),
    "gt": lambda a, b: arith.cmpi(I.sgt, a, b), "ge": lambda a, b: arith.cmpi(I.sge, a, b),
}
BOOL_BINARY = {"add": arith.ori, "mul": arith.andi, "maximum": arith.ori, "minimum": arith.andi,
               "bitwise_and": arith.andi, "bitwise_or": arith.ori, "bitwise_xor": arith.xori,
               "eq": lambda a, b: arith.cmpi(I.eq, a, b), "ne": lambda a, b: arith.cmpi(I.ne, a, b),
               "lt": lambda a, b: arith.cmpi(I.ult, a, b), "le": lambda a, b: arith.cmpi(I.ule, a, b),
               "gt": lambda a, b: arith.cmpi(I.ugt, a, b), "ge": lambda a, b: arith.cmpi(I.uge, a, b)}
for _kind, _fn in (("logical_and", arith.andi), ("logical_or", arith.ori), ("logical_xor", arith.xori)):
    FLOAT_BINARY[_kind] = INT_BINARY[_kind] = BOOL_BINARY[_kind] = _logical(_fn)


def _table(e: ir.Type, f, i, b=None):
    return f if is_float(e) else (b if b is not None and is_bool(e) else i)


def scalar_unary(kind: str, x: ir.Value) -> ir.Value:
    """kind(x) for one element, computed in the compute type and converted back."""
    e = x.type
    fn = _table(e, FLOAT_UNARY, INT_UNARY).get(kind)
    if fn is None:
        raise NotImplementedError(f"gac.unary {kind} on {e}")
    r = fn(convert(x, compute_type(e)))
    return r if is_bool(r.type) else convert(r, e)


def scalar_binary(kind: str, a: ir.Value, b: ir.Value) -> ir.Value:
    e = a.type
    fn = _table(e, FLOAT_BINARY, INT_BINARY, BOOL_BINARY).get(kind)
    if fn is None:
        raise NotImplementedError(f"gac.binary {kind} on {e}")
    ct = compute_type(e)
    r = fn(convert(a, ct), convert(b, ct))
    return r if str(r.type) == "i1" else convert(r, e)


@lowers("unary")
def lower_unary(op, operands):
    kind = op_attrs(op)["kind"]
    out = op.results[0].type
    return elementwise(operands, shape(op.results[0]), [elem(out)],
                       lambda x: [scalar_unary(kind, x)])


@lowers("binary")
def lower_binary(op, operands):
    kind = op_attrs(op)["kind"]
    return elementwise(operands, shape(op.results[0]), [elem(op.results[0].type)],
                       lambda a, b: [scalar_binary(kind, a, b)])


@lowers("select")
def lower_select(op, operands):
    return elementwise(operands, shape(op.results[0]), [elem(op.results[0].type)],
                       lambda c, a, b: [arith.select(c, a, b)])


@lowers("cast")
def lower_cast(op, operands):
    to = elem(op.results[0].type)
    return elementwise(operands, shape(op.results[0]), [to], lambda x: [convert(x, to)])


@lowers("constant")
def lower_constant(op, operands):
    return [arith.ConstantOp(op.results[0].type, op.attributes["value"]).result]


@lowers("iota")
def lower_iota(op, operands):
    out_shape, e = shape(op.results[0]), elem(op.results[0].type)
    dim = op_attrs(op)["dim"]
    rank = len(out_shape)
    return generic([], [], [empty(out_shape, e)], [identity_map(rank)], [PARALLEL] * rank,
                   lambda _out: [convert(index(dim), e)])


# Kept for families that build bodies from these scalar helpers (reductions, norms).
__all__ = ["scalar_unary", "scalar_binary", "linalg"]

"""f32 transcendental functions as straight-line arith (no libm on the device, no branches).

The device has no libm: compiler_rt's few functions branch on their data (the toolchain runs
them one lane at a time) and the rest (tanhf, atanf, erff, ...) do not exist. Upstream's
`math-polynomial-approximation` is not exposed by the Python bindings, so this file expands
the math ops our lowering emits into polynomials, in place, every special case a `select`:

- exp, exp2:   x = k ln2 + r (Cody-Waite), e^r by a degree-7 Taylor polynomial, 2^k in two
               exponent-field steps (so k in [-150, 128] reaches denormals and infinity)
- log (log2, log10, log1p): x = 2^e m, m in [sqrt(1/2), sqrt(2)), fdlibm's logf kernel in
               s = (m-1)/(m+1); log1p corrects 1+x's rounding error
- expm1:       Kahan's (u-1) x / log(u), u = e^x
- sin, cos:    quadrant k = round(2x/pi), three-part pi/2 reduction, Cephes' sinf/cosf kernels
- atan, atan2, asin, acos: Cephes' atanf / asinf reductions and polynomials
- erf, erfc:   Taylor series for |x| < 1/2, Numerical Recipes' erfcc (rel. error < 1.2e-7) else
- asinh:       log1p(a + a^2 / (1 + sqrt(1 + a^2)))
tanh, sinh, cosh, tan, acosh, atanh, powf, fpowi, rsqrt, roundeven go through upstream's
`math-expand-ops` first (into exp/log/sqrt/round); sqrt, abs, floor, fma... map to instructions
or the toolchain's branch-free rewrites. Accuracy: a few ulp for normal arguments; sin/cos lose
precision beyond |x| ~ 1e4 (no Payne-Hanek reduction). Math on f64 is evaluated in f32
(demote_f64_math): the device has no double-precision unit or libm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Union

from mlir import ir
from mlir.dialects import arith
from mlir.dialects import math as mmath

UPSTREAM_EXPANDED = "tanh,sinh,cosh,tan,acosh,atanh,powf,fpowi,rsqrt,roundeven"
Num = Union["F", float]


class F:
    """An f32 SSA value with arithmetic operators (emits arith ops at the insertion point)."""

    def __init__(self, v: ir.Value) -> None:
        self.v = v

    @staticmethod
    def of(x: Num) -> F:
        return x if isinstance(x, F) else F(arith.constant(ir.F32Type.get(), float(x)))

    def __add__(self, o: Num) -> F:
        return F(arith.addf(self.v, F.of(o).v))

    def __radd__(self, o: Num) -> F:
        return F.of(o) + self

    def __sub__(self, o: Num) -> F:
        return F(arith.subf(self.v, F.of(o).v))

    def __rsub__(self, o: Num) -> F:
        return F.of(o) - self

    def __mul__(self, o: Num) -> F:
        return F(arith.mulf(self.v, F.of(o).v))

    def __rmul__(self, o: Num) -> F:
        return F.of(o) * self

    def __truediv__(self, o: Num) -> F:
        return F(arith.divf(self.v, F.of(o).v))

    def __rtruediv__(self, o: Num) -> F:
        return F.of(o) / self

    def __neg__(self) -> F:
        return F(arith.negf(self.v))

    def cmp(self, pred: str, o: Num) -> ir.Value:
        return arith.cmpf(getattr(arith.CmpFPredicate, pred.upper()), self.v, F.of(o).v)

    def bits(self) -> ir.Value:
        return arith.bitcast(_i32(), self.v)


def _i32() -> ir.Type:
    return ir.IntegerType.get_signless(32)


def _ic(v: int) -> ir.Value:
    return arith.constant(_i32(), v)


def sel(c: ir.Value, a: Num, b: Num) -> F:
    return F(arith.select(c, F.of(a).v, F.of(b).v))


def fabs(x: F) -> F:
    return F(mmath.absf(x.v))


def copysign(x: Num, s: F) -> F:
    return F(mmath.copysign(F.of(x).v, s.v))


def sqrt(x: F) -> F:
    return F(mmath.sqrt(x.v))


def fma(a: Num, b: Num, c: Num) -> F:
    return F(mmath.fma(F.of(a).v, F.of(b).v, F.of(c).v))


def horner(x: F, coeffs: Sequence[float]) -> F:
    """c0 + x (c1 + x (c2 + ...)), highest coefficient last."""
    acc = F.of(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = fma(acc, x, c)
    return acc


def _round_int(t: F) -> ir.Value:
    """Nearest integer (halves away from zero) as i32; t must be finite and small."""
    return arith.fptosi(_i32(), (t + copysign(0.5, t)).v)


def _isnan(x: F) -> ir.Value:
    return x.cmp("uno", x)


def _pow2(k: ir.Value) -> F:
    """2^k for k in [-126, 127] from the exponent field."""
    return F(arith.bitcast(ir.F32Type.get(), arith.shli(arith.addi(k, _ic(127)), _ic(23))))


# --- exponentials and logarithms -------------------------------------------------------------
LN2_HI, LN2_LO = 0.693145751953125, 1.428606765330187e-06
EXP_TAYLOR = [1.0 / math.factorial(n) for n in range(8)]


def exp(x: F, base2: bool = False) -> F:
    nan = _isnan(x)
    lo, hi = (-151.0, 128.5) if base2 else (-104.5, 88.8)
    xc = sel(nan, 0.0, sel(x.cmp("olt", lo), lo, sel(x.cmp("ogt", hi), hi, x)))
    k = _round_int(xc if base2 else xc * (1 / math.log(2)))
    kf = F(arith.sitofp(ir.F32Type.get(), k))
    r = (xc - kf) * math.log(2) if base2 else fma(-kf, LN2_LO, fma(-kf, LN2_HI, xc))
    p = horner(r, EXP_TAYLOR)
    k1 = arith.shrsi(k, _ic(1))
    return sel(nan, x, p * _pow2(k1) * _pow2(arith.subi(k, k1)))


LOGF_LG = (0.66666662693, 0.40000972152, 0.28498786688, 0.24279078841)
LN2F_HI, LN2F_LO = 6.9313812256e-01, 9.0580006145e-06


def log(x: F) -> F:
    small = x.cmp("olt", 1.17549435e-38)                  # denormal (or <= 0: fixed below)
    xs = sel(small, x * 8388608.0, x)
    bits = xs.bits()
    e = arith.subi(arith.shrui(bits, _ic(23)), arith.select(small, _ic(150), _ic(127)))
    m = F(arith.bitcast(ir.F32Type.get(),
                        arith.ori(arith.andi(bits, _ic(0x7FFFFF)), _ic(0x3F800000))))
    big = m.cmp("ogt", math.sqrt(2))
    m = sel(big, m * 0.5, m)
    e = arith.addi(e, arith.extui(_i32(), big))
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    r = z * fma(w, LOGF_LG[2], LOGF_LG[0]) + w * fma(w, LOGF_LG[3], LOGF_LG[1])
    hfsq = 0.5 * f * f
    dk = F(arith.sitofp(ir.F32Type.get(), e))
    res = dk * LN2F_HI - ((hfsq - (s * (hfsq + r) + dk * LN2F_LO)) - f)
    res = sel(x.cmp("oeq", math.inf), math.inf, res)
    res = sel(x.cmp("olt", 0.0), math.nan, res)
    return sel(x.cmp("oeq", 0.0), -math.inf, sel(_isnan(x), x, res))


def log1p(x: F) -> F:
    u = x + 1.0
    res = log(u) - ((u - 1.0) - x) / u                   # log(u) corrected for u's rounding
    return sel(u.cmp("oeq", 0.0), -math.inf, sel(u.cmp("oeq", math.inf), u, res))


def expm1(x: F) -> F:
    u = exp(x)
    um1 = u - 1.0
    res = sel(u.cmp("oeq", math.inf), u, um1 * (x / log(u)))
    return sel(u.cmp("oeq", 1.0), x, sel(um1.cmp("oeq", -1.0), -1.0, res))


def asinh(x: F) -> F:
    a = fabs(x)
    a2 = a * a
    small = log1p(a + a2 / (sqrt(a2 + 1.0) + 1.0))
    return copysign(sel(a.cmp("ogt", 1e18), log(a) + math.log(2), small), x)


# --- trigonometry ---------------------------------------------------------------------------
PIO2 = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)
SIN_P = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
COS_P = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)


def sincos(x: F, cos: bool) -> F:
    finite = fabs(x).cmp("olt", math.inf)
    xr = sel(finite, x, 0.0)
    k = _round_int(xr * (2 / math.pi))
    kf = F(arith.sitofp(ir.F32Type.get(), k))
    r = fma(-kf, PIO2[2], fma(-kf, PIO2[1], fma(-kf, PIO2[0], xr)))
    z = r * r
    s = fma(horner(z, SIN_P) * z, r, r)
    c = fma(z * z, horner(z, COS_P), fma(z, -0.5, 1.0))
    q = arith.addi(k, _ic(1)) if cos else k                # cos x = sin(x + pi/2)
    odd = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(q, _ic(1)), _ic(0))
    neg = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(q, _ic(2)), _ic(0))
    res = sel(odd, c, s)
    return sel(finite, sel(neg, -res, res), math.nan)


ATAN_P = (-3.33329491539e-1, 1.99777106478e-1, -1.38776856032e-1, 8.05374449538e-2)


def atan(x: F) -> F:
    a = fabs(x)
    big, mid = a.cmp("ogt", 2.414213562373095), a.cmp("ogt", 0.4142135623730950)
    y0 = sel(big, math.pi / 2, sel(mid, math.pi / 4, 0.0))
    xr = sel(big, -1.0 / a, sel(mid, (a - 1.0) / (a + 1.0), a))
    z = xr * xr
    return copysign(y0 + fma(horner(z, ATAN_P) * z, xr, xr), x)


def atan2(y: F, x: F) -> F:
    r = atan(y / x)
    r = sel(x.cmp("olt", 0.0), r + copysign(math.pi, y), r)
    x0, y0 = x.cmp("oeq", 0.0), y.cmp("oeq", 0.0)
    x_neg = arith.cmpi(arith.CmpIPredicate.slt, x.bits(), _ic(0))   # -0.0 included
    both0 = sel(x_neg, copysign(math.pi, y), copysign(0.0, y))
    return sel(arith.andi(x0, y0), both0, sel(x0, copysign(math.pi / 2, y), r))


ASIN_P = (1.6666752422e-1, 7.4953002686e-2, 4.5470025998e-2, 2.4181311049e-2, 4.2163199048e-2)


def _asin_reduced(x: F) -> tuple[ir.Value, F]:
    """(|x| > 1/2, asin(s)) where s = sqrt((1-|x|)/2) if |x| > 1/2 else x."""
    a = fabs(x)
    big = a.cmp("ogt", 0.5)
    z = sel(big, (1.0 - a) * 0.5, x * x)
    s = sel(big, sqrt(z), x)
    return big, fma(horner(z, ASIN_P) * z, s, s)


def asin(x: F) -> F:
    big, p = _asin_reduced(x)
    return sel(big, copysign(math.pi / 2 - 2.0 * p, x), p)


def acos(x: F) -> F:
    big, p = _asin_reduced(x)
    far = sel(x.cmp("olt", 0.0), math.pi - 2.0 * p, 2.0 * p)
    return sel(big, far, math.pi / 2 - p)


# --- error function ---------------------------------------------------------------------------
ERF_TAYLOR = [2 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(8)]
ERFC_NR = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
           -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erfc_abs(a: F) -> F:
    """erfc(a) for a >= 0 (Numerical Recipes' erfcc)."""
    t = 1.0 / fma(a, 0.5, 1.0)
    return t * exp(horner(t, ERFC_NR) - a * a)


def erf(x: F) -> F:
    a = fabs(x)
    taylor = x * horner(x * x, ERF_TAYLOR)
    return sel(a.cmp("olt", 0.5), taylor, copysign(1.0 - _erfc_abs(a), x))


def erfc(x: F) -> F:
    a = fabs(x)
    tail = _erfc_abs(a)
    far = sel(x.cmp("olt", 0.0), 2.0 - tail, tail)
    return sel(a.cmp("olt", 0.5), 1.0 - x * horner(x * x, ERF_TAYLOR), far)


# --- the rewrite ------------------------------------------------------------------------------
EXPANSIONS: dict[str, Callable[..., F]] = {
    "math.exp": exp, "math.exp2": lambda x: exp(x, base2=True), "math.expm1": expm1,
    "math.log": log, "math.log2": lambda x: log(x) * (1 / math.log(2)),
    "math.log10": lambda x: log(x) * (1 / math.log(10)), "math.log1p": log1p,
    "math.sin": lambda x: sincos(x, False), "math.cos": lambda x: sincos(x, True),
    "math.atan": atan, "math.atan2": atan2, "math.asin": asin, "math.acos": acos,
    "math.erf": erf, "math.erfc": erfc, "math.asinh": asinh,
}


# f64 math has no instructions either (soft double): evaluated in f32, exact ones excepted.
F64_EXACT = ("math.absf", "math.copysign")


def demote_f64_math(root: ir.Operation) -> int:
    """math ops on f64 -> the same op on f32 between truncf/extf (f32 precision, documented in
    the vortex README); returns how many."""
    f32, f64 = ir.F32Type.get(), ir.F64Type.get()
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if (op.name.startswith("math.") and op.name not in F64_EXACT and len(op.results) == 1
                and op.results[0].type == f64):
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    for op in found:
        with ir.InsertionPoint(op), op.location:
            args = [arith.truncf(f32, v) if v.type == f64 else v for v in op.operands]
            narrow = ir.Operation.create(op.name, results=[f32], operands=args,
                                         attributes={k: op.attributes[k] for k in op.attributes})
            op.results[0].replace_all_uses_with(arith.extf(f64, narrow.results[0]))
        op.erase()
    return len(found)


def expand_math(root: ir.Operation) -> int:
    """Replace the f32 math ops of EXPANSIONS under `root` in place; returns how many."""
    demote_f64_math(root)
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in EXPANSIONS:
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    f32 = ir.F32Type.get()
    for op in found:
        if op.results[0].type != f32:
            raise NotImplementedError(f"vortex: {op.name} on {op.results[0].type} (only f32 is expanded)")
        with ir.InsertionPoint(op), op.location:
            res = EXPANSIONS[op.name](*[F(v) for v in op.operands])
        op.results[0].replace_all_uses_with(res.v)
        op.erase()
    return len(found)

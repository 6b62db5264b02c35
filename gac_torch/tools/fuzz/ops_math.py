"""Fuzz ops: pointwise math, binary ops and reductions (see table.py)."""

from __future__ import annotations

import torch

from gac_torch.tools.fuzz.table import (
    ANY,
    BOOL,
    FLOAT,
    INT,
    NUM,
    _amax,
    _dim,
    _domain,
    kind,
    op,
)

# --- pointwise, float ------------------------------------------------------------------------
_SIMPLE = {  # name: (aten names, source template)
    "sin": ("sin", "torch.sin({a})"), "cos": ("cos", "torch.cos({a})"),
    "tanh": ("tanh", "torch.tanh({a})"), "sigmoid": ("sigmoid", "torch.sigmoid({a})"),
    "erf": ("erf", "torch.erf({a})"), "erfc": ("erfc", "torch.erfc({a})"),
    "atan": ("atan", "torch.atan({a})"), "asinh": ("asinh", "torch.asinh({a})"),
    "gelu": ("gelu", "F.gelu({a})"), "gelu_tanh": ("gelu", "F.gelu({a}, approximate='tanh')"),
    "silu": ("silu", "F.silu({a})"), "elu": ("elu", "F.elu({a})"),
    "leaky_relu": ("leaky_relu", "F.leaky_relu({a}, 0.1)"),
}
for _n, (_aten, _tpl) in _SIMPLE.items():
    op(_n, _aten)(lambda g, a, _tpl=_tpl: _tpl.format(a=a.name))

_EXACT_UNARY = {
    "neg": ("neg", "-{a}", NUM), "abs": ("abs", "torch.abs({a})", NUM),
    "relu": ("relu", "torch.relu({a})", NUM),
    "hardtanh": ("hardtanh", "F.hardtanh({a}, -0.5, 0.5)", FLOAT),
    "clone": ("clone", "{a}.clone()", ANY),
}
for _n, (_aten, _tpl, _k) in _EXACT_UNARY.items():
    op(_n, _aten, _k, exact=True)(lambda g, a, _tpl=_tpl: _tpl.format(a=a.name))

_DISC_UNARY = {
    "floor": ("floor", "torch.floor({a})", FLOAT), "ceil": ("ceil", "torch.ceil({a})", FLOAT),
    "round": ("round", "torch.round({a})", FLOAT), "trunc": ("trunc", "torch.trunc({a})", FLOAT),
    "sign": ("sign", "torch.sign({a})", NUM), "signbit": ("signbit", "torch.signbit({a})", NUM),
    "isnan": ("isnan", "torch.isnan({a})", FLOAT), "isinf": ("isinf", "torch.isinf({a})", FLOAT),
    "logical_not": ("logical_not", "torch.logical_not({a})", ANY),
    "bitwise_not": ("bitwise_not", "torch.bitwise_not({a})", INT + BOOL),
}
for _n, (_aten, _tpl, _k) in _DISC_UNARY.items():
    op(_n, _aten, _k, exact=True, disc=True)(lambda g, a, _tpl=_tpl: _tpl.format(a=a.name))


@op("exp", "exp")
def _exp(g, a):
    return f"torch.exp({a.name})" if _amax(a.t) < 8 or g.nonfinite else f"torch.exp(torch.tanh({a.name}))"


@op("expm1", "expm1")
def _expm1(g, a):
    return f"torch.expm1({a.name})" if _amax(a.t) < 8 or g.nonfinite else None


@op("exp2", "exp2")
def _exp2(g, a):
    return f"torch.exp2({a.name})" if _amax(a.t) < 10 or g.nonfinite else None


@op("cosh", "cosh")
def _cosh(g, a):
    return f"torch.cosh({a.name})" if _amax(a.t) < 8 else None


@op("log", "log")
def _log(g, a):
    return _domain(g, a, 1e-3, float("inf"), f"torch.log({a.name})", f"torch.log({a.name}.abs() + 0.5)")


@op("log2", "log2")
def _log2(g, a):
    return _domain(g, a, 1e-3, float("inf"), f"torch.log2({a.name})", f"torch.log2({a.name}.abs() + 0.5)")


@op("log1p", "log1p")
def _log1p(g, a):
    return _domain(g, a, -0.9, float("inf"), f"torch.log1p({a.name})", f"torch.log1p({a.name}.abs())")


@op("sqrt", "sqrt")
def _sqrt(g, a):
    return _domain(g, a, 0.0, float("inf"), f"torch.sqrt({a.name})", f"torch.sqrt({a.name}.abs())")


@op("rsqrt", "rsqrt")
def _rsqrt(g, a):
    return _domain(g, a, 1e-2, float("inf"), f"torch.rsqrt({a.name})", f"torch.rsqrt({a.name}.abs() + 0.5)")


@op("reciprocal", "reciprocal")
def _reciprocal(g, a):
    if g.nonfinite or (a.t.numel() and float(a.t.double().abs().min()) > 0.1):
        return f"torch.reciprocal({a.name})"
    return f"torch.reciprocal({a.name}.abs() + 0.5)"


@op("asin", "asin")
def _asin(g, a):
    return _domain(g, a, -1, 1, f"torch.asin({a.name})", f"torch.asin(torch.tanh({a.name}))")


@op("atanh", "atanh")
def _atanh(g, a):
    return _domain(g, a, -0.9, 0.9, f"torch.atanh({a.name})", f"torch.atanh(0.5 * torch.tanh({a.name}))")


@op("acosh", "acosh")
def _acosh(g, a):
    return _domain(g, a, 1.0, float("inf"), f"torch.acosh({a.name})", f"torch.acosh({a.name}.abs() + 1)")


# --- pointwise with a scalar -------------------------------------------------------------------
@op("add_scalar", "add", NUM)
def _add_scalar(g, a):
    return f"{a.name} + {g.rng.choice(['0.5', '-1.25', '2'])}"


@op("mul_scalar", "mul", ANY, exact=True)
def _mul_scalar(g, a):
    return f"{a.name} * {g.rng.choice(['2', '-0.5', '0.25'])}"  # powers of two: exact


@op("div_scalar", "div", NUM)
def _div_scalar(g, a):
    return f"{a.name} / {g.rng.choice(['3', '-7.0', '0.1'])}"


@op("rsub_scalar", "rsub sub", NUM)
def _rsub(g, a):
    return f"1.5 - {a.name}"


@op("pow_scalar", "pow", FLOAT)
def _pow_scalar(g, a):
    e = g.rng.choice(["2", "3", "0.5", "-1"])
    if e in ("0.5", "-1") and not g.nonfinite:
        return f"{a.name}.abs().add(0.5) ** {e}"
    return f"{a.name} ** {e}" if _amax(a.t) < 30 or g.nonfinite else None


@op("scalar_pow", "pow", FLOAT)
def _scalar_pow(g, a):
    return f"torch.pow(2.0, {a.name})" if _amax(a.t) < 10 or g.nonfinite else None


@op("clamp", "clamp", NUM, exact=True)
def _clamp(g, a):
    return f"torch.clamp({a.name}, {g.rng.choice(['-1', 'None'])}, {g.rng.choice(['1', '2'])})"


@op("int_ops", "bitwise_and bitwise_xor __rshift__", INT, exact=True)
def _int_scalar(g, a):
    return g.rng.choice([f"{a.name} & 6", f"{a.name} ^ 3", f"{a.name} >> 1"])


# --- binary ------------------------------------------------------------------------------------
def _bin(tpl: str):
    return lambda g, a, b: tpl.format(a=a.name, b=b.name)


for _n, _aten, _tpl, _k, _flags in [
    ("add", "add", "{a} + {b}", NUM, {}),
    ("sub", "sub", "{a} - {b}", NUM, {}),
    ("mul", "mul", "{a} * {b}", NUM, {}),
    ("maximum", "maximum", "torch.maximum({a}, {b})", NUM, {"exact": True}),
    ("minimum", "minimum", "torch.minimum({a}, {b})", NUM, {"exact": True}),
    ("fmax", "fmax", "torch.fmax({a}, {b})", FLOAT, {"exact": True}),
    ("fmin", "fmin", "torch.fmin({a}, {b})", FLOAT, {"exact": True}),
    ("atan2", "atan2", "torch.atan2({a}, {b})", FLOAT, {}),
    ("hypot", "hypot", "torch.hypot({a}, {b})", FLOAT, {}),
    ("copysign", "copysign", "torch.copysign({a}, {b})", FLOAT, {"exact": True, "disc": True}),
    ("lerp", "lerp", "torch.lerp({a}, {b}, 0.3)", FLOAT, {}),
    ("add_alpha", "add", "torch.add({a}, {b}, alpha=2)", NUM, {}),
    ("lt", "lt", "{a} < {b}", NUM, {"exact": True, "disc": True}),
    ("ge", "ge", "{a} >= {b}", NUM, {"exact": True, "disc": True}),
    ("eq", "eq", "{a} == {b}", ANY, {"exact": True, "disc": True}),
    ("ne", "ne", "{a} != {b}", ANY, {"exact": True, "disc": True}),
    ("logical_and", "logical_and", "torch.logical_and({a}, {b})", ANY, {"exact": True, "disc": True}),
    ("logical_or", "logical_or", "torch.logical_or({a}, {b})", ANY, {"exact": True, "disc": True}),
    ("logical_xor", "logical_xor", "torch.logical_xor({a}, {b})", ANY, {"exact": True, "disc": True}),
    ("bitwise_or", "bitwise_or", "{a} | {b}", INT + BOOL, {"exact": True}),
    ("bitwise_and", "bitwise_and", "{a} & {b}", INT + BOOL, {"exact": True}),
]:
    op(_n, _aten, (_k, _k), **_flags)(_bin(_tpl))


@op("div", "div", (NUM, NUM))
def _div(g, a, b):
    if g.nonfinite or (b.t.numel() and float(b.t.double().abs().min()) > 0.1):
        return f"{a.name} / {b.name}"
    return f"{a.name} / ({b.name}.abs() + 0.5)"


@op("div_floor", "div", (NUM, NUM), exact=True, disc=True)
def _div_floor(g, a, b):
    mode = g.rng.choice(["floor", "trunc"])
    if b.t.numel() and (b.t == 0).any() and (kind(b.t) == INT or not g.nonfinite):
        return None  # integer division by zero raises in eager
    return f"torch.div({a.name}, {b.name}, rounding_mode={mode!r})"


@op("remainder", "remainder fmod", (NUM, NUM), exact=True, disc=True)
def _remainder(g, a, b):
    if b.t.numel() and (b.t == 0).any() and (kind(b.t) == INT or not g.nonfinite):
        return None
    fn = g.rng.choice(["remainder", "fmod"])
    return f"torch.{fn}({a.name}, {b.name})"


@op("pow", "pow", (FLOAT, FLOAT))
def _pow(g, a, b):
    if _amax(b.t) > 4 and not g.nonfinite:
        return None
    return f"torch.pow({a.name}.abs() + 0.5, {b.name})" if not g.nonfinite else f"torch.pow({a.name}, {b.name})"


@op("where", "where gt", (ANY, ANY, ANY), exact=True)
def _where(g, c, a, b):
    cond = c.name if c.t.dtype == torch.bool else f"{c.name} > 0"
    if not c.exact and c.t.dtype != torch.bool:
        return None  # a rounding difference in c would pick the other branch
    return f"torch.where({cond}, {a.name}, {b.name})"


@op("where_scalar", "where", (BOOL, ANY), exact=True)
def _where_scalar(g, c, a):
    return f"torch.where({c.name}, {a.name}, 0)"


@op("masked_fill", "masked_fill", (ANY, BOOL), exact=True)
def _masked_fill(g, a, m):
    v = {FLOAT: "-1.5", INT: "7", BOOL: "True"}[kind(a.t)]
    return f"{a.name}.masked_fill({m.name}, {v})"


# --- reductions --------------------------------------------------------------------------------
def _red_args(g, a, keepdim: bool = True) -> str:
    """dim=..., keepdim=... for a reduction over a (no dim at all sometimes)."""
    dim = _dim(g, a.t)
    kd = f", keepdim={g.rng.random() < 0.4}" if keepdim else ""
    return f"{dim}{kd}"


@op("sum", "sum", ANY, reduction=True)
def _sum(g, a):
    return g.rng.choice([f"{a.name}.sum()", f"{a.name}.sum({_red_args(g, a)})"])


@op("mean", "mean", FLOAT, reduction=True)
def _mean(g, a):
    return g.rng.choice([f"{a.name}.mean()", f"{a.name}.mean({_red_args(g, a)})"])


@op("amax", "amax amin", NUM, reduction=True, exact=True)
def _amax_op(g, a):
    return f"{a.name}.{g.rng.choice(['amax', 'amin'])}({_red_args(g, a)})"


@op("max_dim", "max min", NUM, reduction=True, exact=True)
def _max_dim(g, a):
    return f"{a.name}.{g.rng.choice(['max', 'min'])}({_red_args(g, a)})[0]"


@op("max_all", "max min", NUM, reduction=True, exact=True)
def _max_all(g, a):
    return f"{a.name}.{g.rng.choice(['max', 'min'])}()" if a.t.numel() else None


@op("argmax", "argmax argmin", NUM, reduction=True, exact=True, disc=True)
def _argmax(g, a):
    return f"{a.name}.{g.rng.choice(['argmax', 'argmin'])}({_red_args(g, a)})"


@op("prod", "prod", NUM, reduction=True)
def _prod(g, a):
    if _amax(a.t) > 3 and not g.nonfinite:
        return None
    return f"{a.name}.prod({_red_args(g, a)})"


@op("var", "var std", FLOAT, reduction=True)
def _var(g, a):
    fn = g.rng.choice(["var", "std"])
    return f"{a.name}.{fn}({_red_args(g, a)}, correction={g.rng.choice([0, 1])})"


@op("logsumexp", "amax exp sum log", FLOAT, reduction=True)  # decomposed into these
def _logsumexp(g, a):
    return f"torch.logsumexp({a.name}, {_red_args(g, a)})"


@op("softmax", "_softmax _log_softmax", FLOAT, reduction=True)
def _softmax(g, a):
    fn = g.rng.choice(["softmax", "log_softmax"])
    return f"torch.{fn}({a.name}, {_dim(g, a.t)})"


@op("cumsum", "cumsum", NUM, reduction=True)
def _cumsum(g, a):
    return f"torch.cumsum({a.name}, {_dim(g, a.t)})"


@op("cumprod", "cumprod", FLOAT, reduction=True)
def _cumprod(g, a):
    return f"torch.cumprod({a.name}, {_dim(g, a.t)})" if _amax(a.t) < 3 else None


@op("logcumsumexp", "logcumsumexp", FLOAT, reduction=True)
def _logcumsumexp(g, a):
    return f"torch.logcumsumexp({a.name}, {_dim(g, a.t)})"


@op("any", "any all", BOOL, reduction=True, exact=True)
def _any(g, a):
    return f"{a.name}.{g.rng.choice(['any', 'all'])}({_red_args(g, a)})"


@op("norm", "linalg_vector_norm", FLOAT, reduction=True)
def _norm(g, a):
    return f"torch.linalg.vector_norm({a.name}, {g.rng.choice([2, 1])}, dim={_dim(g, a.t)})"


# --- more pointwise and constructors -----------------------------------------------------------
op("tan", "tan")(lambda g, a: f"torch.tan(torch.tanh({a.name}))")  # |x| < 1: far from the poles
op("sinh", "sinh")(lambda g, a: f"torch.sinh({a.name})" if _amax(a.t) < 8 else None)
op("erfinv", "erfinv")(lambda g, a: f"torch.erfinv(0.9 * torch.tanh({a.name}))")
op("acos", "acos")(
    lambda g, a: _domain(g, a, -1, 1, f"torch.acos({a.name})", f"torch.acos(torch.tanh({a.name}))"))
op("sgn", "sgn", NUM, exact=True, disc=True)(lambda g, a: f"torch.sgn({a.name})")
op("round_decimals", "round", FLOAT)(lambda g, a: f"torch.round({a.name}, decimals=1)" if a.exact else None)
op("zeros_like", "zeros_like", ANY, exact=True)(lambda g, a: f"torch.zeros_like({a.name})")
op("full_like", "full_like", NUM, exact=True)(lambda g, a: f"torch.full_like({a.name}, 2)")
op("ones_like", "ones_like", ANY, exact=True)(lambda g, a: f"torch.ones_like({a.name}) + {a.name}")
op("arange", "arange add", NUM, exact=True)(
    lambda g, a: f"{a.name} + torch.arange({a.t.shape[-1]}, device={a.name}.device).to({a.dt})"
    if a.t.dim() else None)
op("shift", "bitwise_left_shift bitwise_right_shift", (INT, INT), exact=True)(
    lambda g, a, b: f"{a.name} << ({b.name} & 3)" if g.rng.random() < 0.5 else f"{a.name} >> ({b.name} & 3)")
op("clamp_tensor", "clamp", (FLOAT, FLOAT, FLOAT), exact=True)(
    lambda g, a, lo, hi: f"torch.clamp({a.name}, {lo.name}, {hi.name})")
op("where_scalar_other", "where", (BOOL, FLOAT), exact=True)(
    lambda g, c, a: f"torch.where({c.name}, {a.name}, -2.5)")
op("xor_bool", "bitwise_xor", (BOOL, BOOL), exact=True)(lambda g, a, b: f"{a.name} ^ {b.name}")
op("remainder_scalar", "remainder", NUM, exact=True, disc=True)(lambda g, a: f"{a.name} % 3")

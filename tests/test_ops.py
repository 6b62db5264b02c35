"""Op parity vs eager for every ATen op the foundation lowers, several shapes each, strict mode
(a fallback fails the test). Float references are computed in fp64 (see parity.TOL)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import TARGETS
from parity import check_op

G = torch.Generator().manual_seed(1234)


def r(*shape, dtype=torch.float32, lo=-2.0, hi=2.0):
    return (torch.rand(shape, generator=G) * (hi - lo) + lo).to(dtype)


def pos(*shape, dtype=torch.float32):
    return r(*shape, dtype=dtype, lo=0.1, hi=3.0)


def ints(*shape, lo=-5, hi=6, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=G, dtype=dtype)


def bools(*shape):
    return torch.rand(shape, generator=G) > 0.5


SHAPES = [(7,), (3, 5), (2, 3, 4)]

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
    "sin": torch.sin, "cos": torch.cos, "tan": lambda x: torch.tan(x * 0.5), "atan": torch.atan,
    "sinh": torch.sinh, "cosh": torch.cosh, "tanh": torch.tanh, "asinh": torch.asinh,
    "erf": torch.erf, "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "sign": torch.sign,
    "asin": lambda x: torch.asin(x * 0.45), "acos": lambda x: torch.acos(x * 0.45),
    "atanh": lambda x: torch.atanh(x * 0.45), "isnan": torch.isnan, "isinf": torch.isinf,
    "logical_not": torch.logical_not,
}
POSITIVE_UNARY = {
    "log": torch.log, "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
    "acosh": lambda x: torch.acosh(x + 1),
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=0.5), "rsub": lambda a, b: 3.0 - a + b * 0,
    "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
    "eq": lambda a, b: a == b.round(), "ne": torch.ne, "lt": torch.lt, "le": torch.le,
    "gt": torch.gt, "ge": torch.ge, "where": lambda a, b: torch.where(a > b, a, b),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "remainder": torch.remainder, "fmod": torch.fmod, "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
    "scalar_ops": lambda a, b: (a * 2.5 + 1) / 4 - b, "masked_fill": lambda a, b: a.masked_fill(b > 0, -1.5),
}
INT_BINARY = {
    "add": torch.add, "mul": torch.mul, "sub": torch.sub, "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "truediv": torch.div, "remainder": torch.remainder, "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor, "maximum": torch.maximum,
    "lt": torch.lt, "eq": torch.eq,
}


def _nonzero(t):
    return torch.where(t == 0, torch.ones_like(t), t)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, target):
    for shape in SHAPES:
        check_op(UNARY[name], [r(*shape)], target, f"{name}{shape}")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(POSITIVE_UNARY))
def test_unary_positive(name, target):
    for shape in SHAPES:
        check_op(POSITIVE_UNARY[name], [pos(*shape)], target, f"{name}{shape}")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast(name, target):
    for sa, sb in [((3, 5), (3, 5)), ((2, 3, 4), (4,)), ((4, 1), (1, 6)), ((5,), ())]:
        check_op(BINARY[name], [r(*sa), _nonzero(r(*sb))], target, f"{name}{sa}{sb}")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(INT_BINARY))
def test_int_binary(name, target):
    for sa, sb in [((3, 5), (3, 5)), ((2, 4), (4,))]:
        check_op(INT_BINARY[name], [ints(*sa), _nonzero(ints(*sb))], target, f"int {name}{sa}{sb}")


@pytest.mark.parametrize("target", TARGETS)
def test_pow_clamp(target):
    check_op(lambda x: x.pow(2) + x.pow(0.5), [pos(4, 5)], target)
    check_op(lambda x, y: torch.pow(x, y), [pos(4, 5), r(4, 5)], target)
    check_op(lambda x: x.clamp(-0.5, 0.7), [r(6, 3)], target)
    check_op(lambda x: x.clamp(min=0.1), [r(6, 3)], target)
    check_op(lambda x, lo, hi: torch.clamp(x, lo, hi), [r(6, 3), r(6, 3) - 1, r(6, 3) + 1], target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_casts(dtype, target):
    check_op(lambda x: x.to(dtype), [r(4, 6) * 10], target)
    check_op(lambda x: x.to(torch.float32) * 2, [(r(4, 6) * 10).to(dtype)], target)
    check_op(lambda x: (x > 0).to(dtype), [r(5)], target)
    check_op(lambda x: x.to(torch.bool), [r(5).to(dtype)], target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_math(dtype, target):
    check_op(lambda x, y: torch.sigmoid(x) * y + x.exp(), [r(4, 8, dtype=dtype), r(8, dtype=dtype)], target)
    check_op(lambda x: x.sum(-1), [r(4, 64, dtype=dtype)], target)
    check_op(lambda a, b: a @ b, [r(8, 32, dtype=dtype), r(32, 16, dtype=dtype)], target)


REDUCTIONS = {
    "sum": lambda x: x.sum(), "sum_dim": lambda x: x.sum(-1), "sum_keep": lambda x: x.sum((0, -1), keepdim=True),
    "mean": lambda x: x.mean(0), "mean_all": lambda x: x.mean(), "amax": lambda x: x.amax(-1),
    "amin": lambda x: x.amin(0, keepdim=True), "prod": lambda x: x.prod(-1), "var": lambda x: x.var(-1),
    "var_unbiased0": lambda x: x.var(0, unbiased=False), "std": lambda x: x.std(-1),
    "argmax": lambda x: x.argmax(-1), "argmin": lambda x: x.argmin(0), "max_dim": lambda x: x.max(-1).values,
    "any": lambda x: (x > 1.5).any(-1), "all": lambda x: (x > -1.9).all(0), "max_all": lambda x: x.max(),
    "softmax": lambda x: x.softmax(-1), "softmax0": lambda x: x.softmax(0),
    "log_softmax": lambda x: F.log_softmax(x, -1), "logsumexp": lambda x: x.logsumexp(-1),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions(name, target):
    for shape in [(5, 7), (2, 3, 6)]:
        check_op(REDUCTIONS[name], [r(*shape)], target, f"{name}{shape}")


@pytest.mark.parametrize("target", TARGETS)
def test_softmax_neg_inf_row(target):
    x = r(3, 5)
    x[1] = float("-inf")
    x[2, :2] = float("-inf")
    check_op(lambda t: t.softmax(-1), [x], target)


@pytest.mark.parametrize("target", TARGETS)
def test_norms(target):
    check_op(lambda x, w, b: F.layer_norm(x, (16,), w, b, 1e-5), [r(2, 5, 16), r(16), r(16)], target)
    check_op(lambda x: F.layer_norm(x, (4, 6)), [r(3, 4, 6)], target)
    bn = lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)  # noqa: E731
    check_op(bn, [r(2, 6, 5, 5), r(6), pos(6), r(6), r(6)], target)
    check_op(lambda x, rm, rv: F.batch_norm(x, rm, rv, None, None, False), [r(3, 6, 4), r(6), pos(6)], target)


@pytest.mark.parametrize("target", TARGETS)
def test_matmuls(target):
    check_op(lambda a, b: a @ b, [r(5, 7), r(7, 3)], target)
    check_op(lambda a, b: torch.bmm(a, b), [r(2, 5, 7), r(2, 7, 3)], target)
    check_op(lambda a, b: a @ b, [r(2, 3, 5, 7), r(2, 3, 7, 4)], target)
    check_op(lambda a, b: a @ b, [r(2, 3, 5, 7), r(7, 4)], target)
    check_op(lambda a, b, c: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [r(4, 6), r(6, 3), r(3)], target)
    check_op(lambda a, b, c: torch.baddbmm(c, a, b), [r(2, 4, 6), r(2, 6, 3), r(2, 4, 3)], target)
    check_op(lambda x, w, b: F.linear(x, w, b), [r(2, 5, 8), r(3, 8), r(3)], target)
    check_op(lambda a, b: a @ b, [ints(3, 4), ints(4, 2)], target)


CONVS = [
    dict(x=(2, 4, 9, 9), w=(6, 4, 3, 3), stride=1, padding=1, dilation=1, groups=1),
    dict(x=(1, 4, 10, 8), w=(8, 2, 3, 3), stride=2, padding=(1, 0), dilation=1, groups=2),
    dict(x=(1, 6, 9, 9), w=(6, 1, 3, 3), stride=1, padding=2, dilation=2, groups=6),
    dict(x=(2, 3, 7, 7), w=(4, 3, 1, 1), stride=1, padding=0, dilation=1, groups=1),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("i", range(len(CONVS)))
def test_conv2d(i, target):
    c = CONVS[i]
    fn = lambda x, w, b: F.conv2d(x, w, b, c["stride"], c["padding"], c["dilation"], c["groups"])  # noqa: E731
    check_op(fn, [r(*c["x"]), r(*c["w"]) * 0.3, r(c["w"][0])], target, str(c))


@pytest.mark.parametrize("target", TARGETS)
def test_conv1d(target):
    check_op(lambda x, w: F.conv1d(x, w, None, 2, 1), [r(2, 3, 11), r(5, 3, 3)], target)


POOLS = {
    "max3s2p1": lambda x: F.max_pool2d(x, 3, 2, 1), "max2": lambda x: F.max_pool2d(x, 2),
    "max_ceil": lambda x: F.max_pool2d(x, 3, 2, 0, ceil_mode=True),
    "max_dil": lambda x: F.max_pool2d(x, 2, 1, 0, dilation=2),
    "avg3s2p1": lambda x: F.avg_pool2d(x, 3, 2, 1), "avg_nopad": lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    "avg_ceil": lambda x: F.avg_pool2d(x, 2, 2, 0, ceil_mode=True), "avg_div": lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    "adaptive1": lambda x: F.adaptive_avg_pool2d(x, 1), "adaptive_even": lambda x: F.adaptive_avg_pool2d(x, (3, 3)),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(POOLS))
def test_pool(name, target):
    for shape in [(2, 3, 9, 9), (1, 2, 6, 12)]:
        if name == "adaptive_even" and shape[-1] % 3:
            continue
        check_op(POOLS[name], [r(*shape)], target, f"{name}{shape}")


SHAPE_OPS = {
    "view": lambda x: x.view(6, -1) * 1, "permute": lambda x: x.permute(2, 0, 1) + 0,
    "transpose": lambda x: x.transpose(0, 2) * 2, "expand": lambda x: x[:, :1].expand(3, 4, 5) + 0,
    "unsqueeze": lambda x: x.unsqueeze(1) * 1, "squeeze": lambda x: x[:1].squeeze(0) + 1,
    "slice": lambda x: x[1:, ::2, 1:-1] * 1, "select": lambda x: x[:, 2] + x[-1, 0],
    "cat": lambda x: torch.cat([x, x * 2], 1), "stack": lambda x: torch.stack([x, -x], 0),
    "split": lambda x: tuple(t * 1 for t in x.split(2, -1)), "chunk": lambda x: x.chunk(2, 0)[1] + 0,
    "flatten": lambda x: x.flatten(1) + 0, "pad": lambda x: F.pad(x, (1, 2, 0, 1), value=0.5),
    "pad_neg": lambda x: F.pad(x, (-1, 1)), "repeat": lambda x: x.repeat(1, 2, 1),
    "t": lambda x: x[0].t() + 0, "contiguous": lambda x: x.transpose(0, 1).contiguous() * 1,
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(SHAPE_OPS))
def test_shape_ops(name, target):
    check_op(SHAPE_OPS[name], [r(3, 4, 5)], target, name)


@pytest.mark.parametrize("target", TARGETS)
def test_gathers(target):
    check_op(lambda i, emb: F.embedding(i, emb), [ints(2, 3, lo=0, hi=10), r(10, 4)], target)
    check_op(lambda x, i: torch.index_select(x, 1, i), [r(3, 6), ints(4, lo=0, hi=6)], target)
    check_op(lambda x, i: torch.gather(x, 1, i), [r(3, 6), ints(3, 4, lo=0, hi=6)], target)
    check_op(lambda x, i: x[i], [r(6, 3), ints(4, lo=-6, hi=6)], target)


@pytest.mark.parametrize("target", TARGETS)
def test_constructors(target):
    check_op(lambda x: x + torch.arange(5, dtype=torch.float32, device=x.device), [r(3, 5)], target)
    check_op(lambda x: x * torch.arange(2, 12, 2, device=x.device), [ints(5)], target)
    check_op(lambda x: x + torch.full((3, 5), 2.5, device=x.device) + torch.ones(5, device=x.device)
             - torch.zeros_like(x), [r(3, 5)], target)
    check_op(lambda x: torch.where(x > 0, x, torch.tensor(0.25, device=x.device)), [r(3, 5)], target)

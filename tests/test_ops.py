"""Op parity vs eager for every ATen op the foundation lowers, several shapes each, strict mode
(a fallback fails the test). Float references are computed in fp64 (see parity.TOL)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import gac_torch
from conftest import TARGETS
from parity import Fn, assert_close, check_op, device_of, reference

G = torch.Generator().manual_seed(1234)  # import-time inputs; each test gets its own (below)


def _seed(test_name: str) -> int:
    return zlib.crc32(test_name.encode())


@pytest.fixture(autouse=True)
def _generator_per_test(request):
    """Each test draws from its own generator, seeded from its id: its inputs do not depend on
    which tests ran before it (-k, xdist, a new test earlier in the file)."""
    global G
    G = torch.Generator().manual_seed(_seed(request.node.name))


def r(*shape, dtype=torch.float32, lo=-2.0, hi=2.0):
    return (torch.rand(shape, generator=G) * (hi - lo) + lo).to(dtype)


def pos(*shape, dtype=torch.float32):
    return r(*shape, dtype=dtype, lo=0.1, hi=3.0)


def ints(*shape, lo=-5, hi=6, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=G, dtype=dtype)


def bools(*shape):
    return torch.rand(shape, generator=G) > 0.5


# Values where comparisons, logical ops and NaN/inf tests are not constant: ties, signed zeros,
# zeros (false), NaN (unequal to itself, truthy) and both infinities.
SPECIAL = torch.tensor([0.0, -0.0, 1.0, -1.5, 2.0, float("inf"), float("-inf"), float("nan")])


def mixed(*shape):
    return SPECIAL[torch.randint(0, len(SPECIAL), shape, generator=G)]


def not_constant(ref: torch.Tensor, what: str) -> None:
    """The test's inputs must make a bool answer vary, or a compiler returning a constant passes."""
    assert ref.dtype == torch.bool and bool(ref.any()) and not bool(ref.all()), f"{what}: constant answer {ref}"


SHAPES = [(7,), (3, 5), (2, 3, 4)]

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
    "sin": torch.sin, "cos": torch.cos, "tan": lambda x: torch.tan(x * 0.5), "atan": torch.atan,
    "sinh": torch.sinh, "cosh": torch.cosh, "tanh": torch.tanh, "asinh": torch.asinh,
    "erf": torch.erf, "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "sign": torch.sign,
    "asin": lambda x: torch.asin(x * 0.45), "acos": lambda x: torch.acos(x * 0.45),
    "atanh": lambda x: torch.atanh(x * 0.45),
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
    "lt": torch.lt, "le": torch.le,
    "gt": torch.gt, "ge": torch.ge, "where": lambda a, b: torch.where(a > b, a, b),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "remainder": torch.remainder, "fmod": torch.fmod, "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "scalar_ops": lambda a, b: (a * 2.5 + 1) / 4 - b, "masked_fill": lambda a, b: a.masked_fill(b > 0, -1.5),
}
# Bool-valued ops: run on mixed() inputs (ties, zeros, NaN, inf), which make the answer vary.
PREDICATES = {"isnan": torch.isnan, "isinf": torch.isinf, "logical_not": torch.logical_not,
              "isfinite": torch.isfinite, "eq_scalar": lambda x: x == 1.0, "ne_scalar": lambda x: x != 0.0}
COMPARISONS = {
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
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
@pytest.mark.parametrize("name", sorted(PREDICATES))
def test_predicates(name, target):
    for shape in [(9,), (3, 5), (2, 3, 4)]:
        x = mixed(*shape)
        x.view(-1)[:4] = SPECIAL[torch.tensor([0, 2, 5, 7])]  # 0, 1, inf, nan: every answer occurs
        not_constant(PREDICATES[name](x), f"{name}{shape}")
        check_op(PREDICATES[name], [x], target, f"{name}{shape}")


def _pairs():
    """(a, b, whether every op's answer varies) with equal and unequal elements under
    broadcasting, float, integer and bool."""
    a = mixed(3, 5)
    yield a, torch.where(bools(3, 5), a, mixed(3, 5)), True  # same shape, about half tied
    row = mixed(5)
    a = torch.where(bools(3, 5), row, mixed(3, 5))
    row[:2], a[0, :2] = torch.tensor([0.0, 1.0]), 0.0  # (0, 0) and (0, 1): every op's answer varies
    yield a, row, True  # (3, 5) against a row
    # every pair of special values (clones: two views of one storage are issue 12's item 3)
    yield SPECIAL.view(8, 1).clone(), SPECIAL.view(1, 8).clone(), True
    x = mixed(6)
    x[:4] = torch.tensor([1.0, 2.0, -1.5, 0.0])
    yield x, x[0].clone(), False  # against a 0-d 1.0: comparisons vary; logical_or is all true
    # ints and bools: the first four columns hold (0,1) (1,1) (1,0) (0,0), every truth table row
    i = torch.randint(-1, 2, (4, 6), generator=G)
    j = torch.where(bools(4, 6), i, torch.randint(-1, 2, (4, 6), generator=G))
    i[0, :4], j[0, :4] = torch.tensor([0, 1, 1, 0]), torch.tensor([1, 1, 0, 0])
    yield i, j, True
    a, b = bools(4, 6), bools(6)
    a[0, :4], b[:4] = torch.tensor([0, 1, 1, 0]).bool(), torch.tensor([1, 1, 0, 0]).bool()
    yield a, b, True


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_comparisons_and_logical(name, target):
    fn = COMPARISONS[name]
    for k, (a, b, varies) in enumerate(_pairs()):
        what = f"{name} pair {k} {a.dtype}{list(a.shape)} {list(b.shape)}"
        if varies or not name.startswith("logical"):
            not_constant(fn(a, b), what)
        check_op(fn, [a, b], target, what)


def test_inputs_depend_only_on_the_test_id(request):
    """The autouse fixture reseeds per test: this test's first draw is fixed by its name."""
    want = torch.rand((4,), generator=torch.Generator().manual_seed(_seed(request.node.name)))
    assert torch.equal(torch.rand((4,), generator=G), want)


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
    # zeros, NaN and inf (floats) or zeros (ints) among the values: the answer varies
    x = ints(9, lo=-2, hi=3, dtype=dtype) if not dtype.is_floating_point else mixed(9).to(dtype)
    x[:2] = torch.tensor([0, 1])
    not_constant(x.to(torch.bool), f"{dtype} to bool")
    check_op(lambda x: x.to(torch.bool), [x], target)


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
    # padded max pools read x at clamped indices (lowering/structured.py's _max_pool_clamped)
    "max_ceil_pad": lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True), "max2p1": lambda x: F.max_pool2d(x, 2, 2, 1),
    "max_rect": lambda x: F.max_pool2d(x, (3, 2), (1, 2), (1, 1)),
    "max_dil_pad": lambda x: F.max_pool2d(x, 3, 1, 1, dilation=2),
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


# --- ops added with the OpInfo sweep: the cases OpInfo samples do not reach -----------------

def _vs_eager(fn, inputs, target, what=""):
    """Strict compile, compared with eager in the same dtype (no fp64 reference): for ops whose
    edge-case semantics (non-finite coordinates, index tables) are defined by eager's kernel."""
    dev = device_of(target)
    inputs = [t.to(dev) for t in inputs]
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target=target, options={"fallback": False})
    out, ref = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5, equal_nan=True, msg=what or None)
    return compiled


def _grid_with_extremes(device_defined_only: bool = False, padding: str = "zeros"):
    """Sampling grid with in-range, out-of-range, huge (BEVFormer's ~1e9 for points behind a
    camera), infinite and NaN coordinates, and exact corners.

    PyTorch's CUDA and CPU grid_sampler kernels disagree on non-finite coordinates (NaN weights)
    and on huge ones under reflection (fmod vs. the vectorized reflection); gac follows the CPU
    kernel. `device_defined_only` keeps the extremes both kernels agree on (huge finite values
    with zeros/border padding), for comparing with CUDA eager."""
    g = r(2, 5, 6, 2, lo=-1.3, hi=1.3)
    if not device_defined_only:
        g[0, 0, 0] = float("nan")
        g[0, 0, 1, 0], g[0, 0, 2, 1] = float("inf"), -float("inf")
    if not (device_defined_only and padding == "reflection"):
        g[0, 1, 0], g[0, 1, 1], g[0, 1, 2, 0] = 1e9, -1e9, 3e9
    g[1, 2, 3], g[1, 3, 3] = torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])
    return g


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample(mode, padding, align, target):
    fn = lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)  # noqa: E731
    grid = _grid_with_extremes(device_defined_only=target == "cuda", padding=padding)
    _vs_eager(fn, [r(2, 3, 5, 7), grid], target, f"{mode} {padding} {align}")


@pytest.mark.parametrize("target", TARGETS)
def test_grid_sample_far_points_are_zero(target):
    """Zero padding: every coordinate far outside the image (or non-finite) samples nothing."""
    g = torch.full((1, 2, 3, 2), 1e9)
    g[0, 1] = torch.tensor([[-1e9, 0.5], [0.5, 3e9], [-4e9, -4e9]])
    c = _vs_eager(lambda x, g: F.grid_sample(x, g, align_corners=False), [r(1, 2, 4, 4), g], target)
    dev = device_of(target)
    assert torch.count_nonzero(c(r(1, 2, 4, 4).to(dev), g.to(dev))) == 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cudnn_grid_sampler(dtype, target):
    """aten.cudnn_grid_sampler, what grid_sampler becomes in a CUDA graph for bilinear, zero
    padding and align_corners=True when cuDNN takes the input, samples like grid_sample with
    those options (a graph holding it is built by hand: the op has no CPU or meta kernel)."""
    import torch.fx as fx

    from gac_torch.frontends.fx import compile_graph
    from gac_torch.options import resolve

    dev = device_of(target)
    x, g = r(2, 3, 5, 7, dtype=dtype).to(dev), r(2, 4, 6, 2, lo=-1.2, hi=1.2, dtype=dtype).to(dev)
    g[0, 0, 0], g[1, 3, 5] = torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])  # exact corners
    graph = fx.Graph()
    px, pg = graph.placeholder("x"), graph.placeholder("g")
    px.meta["val"], pg.meta["val"] = x, g
    y = graph.call_function(torch.ops.aten.cudnn_grid_sampler.default, (px, pg))
    y.meta["val"] = torch.empty(2, 3, 4, 6, dtype=dtype, device=dev)
    graph.output((y,))
    compiled = compile_graph(fx.GraphModule(torch.nn.Module(), graph), resolve({"fallback": False}, target=target))
    want = F.grid_sample(x.float(), g.float(), mode="bilinear", padding_mode="zeros", align_corners=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(compiled(x, g)[0].float().cpu(), want.to(dtype).float().cpu(), rtol=tol, atol=tol)

UPSAMPLE = {
    "nearest_x2": lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
    "nearest_size": lambda x: F.interpolate(x, size=(7, 5), mode="nearest"),
    "nearest_frac": lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest"),
    "bilinear_size": lambda x: F.interpolate(x, size=(11, 9), mode="bilinear", align_corners=False),
    "bilinear_align": lambda x: F.interpolate(x, size=(11, 9), mode="bilinear", align_corners=True),
    "bilinear_scale": lambda x: F.interpolate(x, scale_factor=(1.5, 2.25), mode="bilinear"),
    "bilinear_down": lambda x: F.interpolate(x, size=(3, 2), mode="bilinear"),
    "nearest_default": lambda x: torch.ops.aten.upsample_nearest2d.default(x, [9, 4]),
    "nearest_default_scales": lambda x: torch.ops.aten.upsample_nearest2d.default(x, [9, 14], 1.9, 2.9),
    "bilinear_default": lambda x: torch.ops.aten.upsample_bilinear2d.default(x, [8, 10], False),
    "bilinear_default_scales": lambda x: torch.ops.aten.upsample_bilinear2d.default(x, [9, 14], True, 1.9, 2.9),
}


def _check_fx(fn, inputs, target, what=""):
    """Strict compile of fn's plain ATen graph (make_fx, no decomposition): how a default
    upsample overload reaches gac (export and AOTAutograd expand it through its Autograd kernel)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from gac_torch.frontends.fx import compile_graph
    from gac_torch.options import resolve

    inputs = [t.to(device_of(target)) for t in inputs]
    gm = make_fx(fn)(*inputs)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    compiled = compile_graph(gm, resolve({"fallback": False}, target=target))
    assert_close(compiled(*inputs), reference(fn, inputs), what)
    return targets


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(UPSAMPLE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_upsample(name, dtype, target):
    x = r(2, 3, 5, 6, dtype=dtype)
    op = f"aten.upsample_{'nearest' if 'nearest' in name else 'bilinear'}2d"
    if "default" in name:
        assert f"{op}.default" in _check_fx(UPSAMPLE[name], [x], target, name)
        return
    check_op(UPSAMPLE[name], [x], target, name)
    if dtype == torch.float32:  # the overload under test is what gac compiled
        from gac_torch.legalize import decompositions

        graph = torch.export.export(Fn(UPSAMPLE[name]), (x,)).run_decompositions(decompositions()).graph
        assert f"{op.removeprefix('aten.')}.vec" in str(graph), f"{op}.vec must reach gac"


NEW_OPS = {
    "cumsum": (lambda x: x.cumsum(1), [r(3, 37)]),
    "cumsum_int": (lambda x: x.cumsum(0), [ints(9, 4)]),
    "cumprod": (lambda x: x.cumprod(-1), [r(2, 3, 9, lo=0.5, hi=1.5)]),
    "logcumsumexp": (lambda x: x.logcumsumexp(0), [r(17, 3) * 30]),
    "sort": (lambda x: torch.sort(x, -1), [r(4, 33)]),
    "sort_desc": (lambda x: torch.sort(x, 0, descending=True), [r(19, 3)]),
    "topk": (lambda x: torch.topk(x, 5, dim=1), [r(3, 40)]),
    "topk_smallest": (lambda x: torch.topk(x, 3, dim=0, largest=False), [r(12, 4)]),
    "flip": (lambda x: x.flip(0, 2), [r(3, 4, 5)]),
    "roll": (lambda x: x.roll((2, -1), (0, 2)), [r(3, 4, 5)]),
    "diagonal": (lambda x: x.diagonal(1, 1, 2) * 2, [r(2, 4, 5)]),
    "scatter": (lambda x, i, s: x.scatter(1, i, s), [r(3, 6), torch.stack([torch.randperm(6, generator=G)[:4] for _ in range(3)]), r(3, 4)]),
    "scatter_add": (lambda x, i, s: x.scatter_add(0, i, s), [r(4, 3), ints(6, 3, lo=0, hi=4), r(6, 3)]),
    "scatter_reduce_amax": (lambda x, i, s: x.scatter_reduce(0, i, s, "amax", include_self=False),
                            [r(4, 3), ints(6, 3, lo=0, hi=4), r(6, 3)]),
    "index_put_acc": (lambda x, i, v: x.index_put((i,), v, accumulate=True), [r(5, 3), ints(7, lo=-5, hi=5), r(7, 3)]),
    "index_two": (lambda x, i, j: x[i, :, j], [r(4, 3, 5), ints(2, 6, lo=0, hi=4), ints(6, lo=-5, hi=5)]),
    "index_adjacent": (lambda x, i, j: x[:, i, j], [r(2, 4, 5), ints(3, lo=0, hi=4), ints(3, lo=0, hi=5)]),
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 1, 2), [r(3, 4, 2), r(3, 2)]),
    "slice_scatter_step": (lambda x, s: torch.slice_scatter(x, s, 1, 1, 7, 3), [r(3, 8), r(3, 2)]),
    "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s), [r(3, 5), bools(3, 5), r(15)]),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
                         [r(1, 4, 5, 5), r(4, 3, 3, 3)]),
    "conv_transpose2d_groups": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 1), padding=(0, 2),
                                                                   dilation=2, groups=2),
                                [r(2, 4, 4, 6), r(4, 3, 2, 3), r(6)]),
    "conv_transpose1d": (lambda x, w: F.conv_transpose1d(x, w, stride=3), [r(2, 3, 7), r(3, 2, 4)]),
    "adaptive_avg_uneven": (lambda x: F.adaptive_avg_pool2d(x, (3, 4)), [r(2, 3, 7, 10)]),
    "adaptive_max_uneven": (lambda x: F.adaptive_max_pool2d(x, (5, 3)), [r(2, 3, 7, 10)]),
    "max_pool_indices": (lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), [r(2, 3, 9, 8)]),
    "reflection_pad": (lambda x: F.pad(x, (2, 1, 1, 3), mode="reflect"), [r(2, 3, 5, 6)]),
    "replication_pad": (lambda x: F.pad(x, (2, 1, 1, 3), mode="replicate"), [r(2, 3, 5, 6)]),
    "group_norm": (lambda x, w, b: F.group_norm(x, 3, w, b), [r(2, 6, 4, 5), r(6), r(6)]),
    "batch_norm_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, True), [r(4, 3, 5, 5), r(3), r(3)]),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 1.2), [r(5, 7)]),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), [r(5, 7)]),
    "elu": (lambda x: F.elu(x, 1.3), [r(5, 7)]),
    "erfinv": (lambda x: torch.erfinv(x), [r(5, 7, lo=-0.999, hi=0.999)]),
    "hardswish_decomposed": (lambda x: F.hardswish(x), [r(5, 7) * 4]),
    "cdist": (lambda a, b: torch.cdist(a, b), [r(2, 5, 3), r(2, 4, 3)]),
    "vector_norm": (lambda x: torch.linalg.vector_norm(x, 3, dim=1), [r(4, 6)]),
    "var_mean": (lambda x: torch.var_mean(x, 1), [r(4, 6)]),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(NEW_OPS))
def test_new_ops(name, target):
    fn, inputs = NEW_OPS[name]
    check_op(fn, inputs, target, name)


# --- precision: f16/bf16 storage, f32 math and accumulation ----------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_reductions_accumulate_in_f32(dtype):
    """A 4096-term sum and a K=4096 matmul: accumulating in the storage type would be off by
    hundreds of ulps; f32 accumulation stays within one ulp of the fp64 result."""
    x = r(2, 4096, dtype=dtype, lo=0.5, hi=1.5)
    a, b = r(4, 4096, dtype=dtype, lo=0.0, hi=1.0), r(4096, 3, dtype=dtype, lo=0.0, hi=1.0)
    for fn, args in [(lambda t: t.sum(-1), [x]), (lambda p, q: p @ q, [a, b]),
                     (lambda t: t.mean(-1), [x]), (lambda t: t.cumsum(-1)[:, -1], [x])]:
        c = gac_torch.compile(Fn(fn), tuple(args), options={"fallback": False})
        out = c(*args).double()
        ref = fn(*[t.double() for t in args])
        ulp = torch.finfo(dtype).eps * ref.abs()
        assert bool(((out - ref).abs() <= ulp).all()), (fn, (out - ref).abs().max())


def test_half_math_runs_in_f32():
    """Elementwise f16 math is one f32 computation rounded once: within one f16 ulp of fp64
    everywhere (f16 arithmetic through gelu's expansion would be several ulps off), and the
    linalg stage shows the widening; matmuls accumulate into an f32 tensor."""
    x = torch.linspace(-8, 8, 4001, dtype=torch.float16)
    fn = lambda t: F.gelu(t) + torch.sigmoid(t)  # noqa: E731
    c = gac_torch.compile(Fn(F.gelu), (x,), options={"fallback": False})
    ref = F.gelu(x.double())
    assert bool(((c(x).double() - ref).abs() <= torch.finfo(torch.float16).eps * ref.abs() + 1e-7).all())
    text = gac_torch.compile(Fn(fn), (x,)).ir("linalg")
    assert "arith.extf" in text and "f16 to f32" in text
    mm = gac_torch.compile(Fn(lambda a, b: a @ b), (r(4, 8, dtype=torch.bfloat16), r(8, 2, dtype=torch.bfloat16)))
    assert "outs(" in mm.ir("linalg") and "tensor<4x2xf32>" in mm.ir("linalg")


def test_tf32_follows_torch_flags():
    from gac_torch.options import resolve

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert resolve(None, target="cuda")["allow_tf32"] is False
        assert resolve({"allow_tf32": True}, target="cuda")["allow_tf32"] is False  # cannot override torch
        torch.set_float32_matmul_precision("high")
        assert resolve(None, target="cuda")["allow_tf32"] is True
        assert resolve({"allow_tf32": False}, target="cuda")["allow_tf32"] is False
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_f64_to_half_rounds_like_aten(dtype):
    """f64 -> f16/bf16 goes through f32 exactly as ATen's cast does (double rounding included):
    bit-identical on halfway cases."""
    halfway = torch.arange(-2**15, 2**15 - 1).to(torch.int16).view(torch.float16).double() + 1e-12
    x = torch.cat([torch.linspace(-7e4, 7e4, 20001, dtype=torch.float64), halfway])
    c = gac_torch.compile(Fn(lambda t: t.to(dtype)), (x,), options={"fallback": False})
    torch.testing.assert_close(c(x), x.to(dtype), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_addmm_rounds_once(dtype):
    """bias + a @ b where the bias nearly cancels the product: rounding the product to the
    storage type first would be off by half an ulp of the product, far more than the result's."""
    a, b = r(6, 64, dtype=dtype, lo=0.0, hi=1.0), r(64, 5, dtype=dtype, lo=0.0, hi=1.0)
    bias = (-(a.double() @ b.double()) + r(6, 5, dtype=torch.float64, lo=-0.01, hi=0.01)).to(dtype)
    fn = lambda c, p, q: torch.addmm(c, p, q)  # noqa: E731
    out = gac_torch.compile(Fn(fn), (bias, a, b), options={"fallback": False})(bias, a, b).double()
    ref = fn(bias.double(), a.double(), b.double())
    ulp = torch.finfo(dtype).eps * ref.abs() + torch.finfo(dtype).eps * 1e-2
    assert bool(((out - ref).abs() <= ulp).all()), (out - ref).abs().max()

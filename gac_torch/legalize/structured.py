"""Matrix products, convolution and pooling."""

from __future__ import annotations

from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import aten, lower


@lower(aten.mm.default, aten.bmm.default)
def lower_mm(cx: Cx, a, b):
    return cx.b.matmul(a, b)


@lower(aten.addmm.default, aten.baddbmm.default)
def lower_addmm(cx: Cx, bias, a, b, *, beta=1, alpha=1):
    dt = cx.out_dtype
    y = cx.b.matmul(a, b)
    if alpha != 1:
        y = cx.b.binary(y, cx.to(alpha, dt), kind="mul")
    if beta == 0:
        return y
    bias = cx.to(bias, dt)
    if beta != 1:
        bias = cx.b.binary(bias, cx.to(beta, dt), kind="mul")
    return cx.b.binary(y, bias, kind="add")


def _conv_check(node) -> str | None:
    x = meta_val(node.args[0])
    transposed = node.args[6]
    if transposed:
        return "transposed convolution"
    if x.dim() not in (3, 4):
        return f"{x.dim() - 2}-d convolution"
    return None


@lower(aten.convolution.default, check=_conv_check)
def lower_convolution(cx: Cx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nsp = len(cx.shape(x)) - 2
    rep = (lambda v: list(v) * nsp if len(v) == 1 else list(v))
    y = cx.b.conv(x, w, stride=rep(stride), padding=rep(padding), dilation=rep(dilation), groups=groups)
    if bias is not None:
        y = cx.b.binary(y, cx.b.reshape(cx.to(bias, cx.out_dtype), [cx.shape(w)[0]] + [1] * nsp), kind="add")
    return y


def _pool_args(kernel, stride, padding, dilation=(1,)):
    n = len(kernel)
    rep = (lambda v: list(v) * n if len(v) == 1 else list(v))
    return list(kernel), rep(stride or kernel), rep(padding), rep(dilation)


def _indices_unused(node) -> str | None:
    users = [u for u in node.users if not (u.target.__name__ == "getitem" and u.args[1] == 0)]
    return "pooling indices are used" if users else None


@lower(aten.max_pool2d_with_indices.default, check=_indices_unused)
def lower_max_pool2d(cx: Cx, x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    k, s, p, d = _pool_args(kernel, stride, padding, dilation)
    y = cx.b.pool(x, kind="max", kernel=k, stride=s, padding=p, dilation=d,
                  ceil_mode=int(ceil_mode), count_include_pad=1, divisor=0)
    return y, None


@lower(aten.avg_pool2d.default)
def lower_avg_pool2d(cx: Cx, x, kernel, stride=(), padding=(0,), ceil_mode=False,
                     count_include_pad=True, divisor_override=None):
    k, s, p, d = _pool_args(kernel, stride, padding)
    return cx.b.pool(x, kind="avg", kernel=k, stride=s, padding=p, dilation=d, ceil_mode=int(ceil_mode),
                     count_include_pad=int(count_include_pad), divisor=int(divisor_override or 0))


def _adaptive_check(node) -> str | None:
    x, out = meta_val(node.args[0]), node.args[1]
    if any(i % o for i, o in zip(x.shape[-2:], out)):
        return "adaptive pool with uneven windows"
    return None


@lower(aten._adaptive_avg_pool2d.default, check=_adaptive_check)
def lower_adaptive_avg_pool2d(cx: Cx, x, output_size):
    """Evenly dividing windows only: then it is a plain average pool."""
    h, w = cx.shape(x)[-2:]
    k = [h // output_size[0], w // output_size[1]]
    return cx.b.pool(x, kind="avg", kernel=k, stride=k, padding=[0, 0], dilation=[1, 1],
                     ceil_mode=0, count_include_pad=1, divisor=0)

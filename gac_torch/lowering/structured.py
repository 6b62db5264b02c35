"""gac.matmul / gac.conv / gac.pool -> linalg named ops (so targets can match and tile them)."""

from __future__ import annotations

import os

from mlir import ir
from mlir.dialects import arith, linalg, tensor

from gac_torch.ir.builder import op_attrs
from gac_torch.lowering.core import (
    PARALLEL, REDUCTION, accumulator_type, const, convert, elem, elementwise, empty, full, generic,
    identity_map, index, index_type, lowest, pad_constant, prod, reshape, shape, tensor_t,
)
from gac_torch.ir.types import is_float
from gac_torch.lowering.registry import lowers

# a convolution lowered as a plain contraction (`_conv1x1_nhwc`): the GPU strategies give it the
# convolutions' TF32 permission (torch.backends.cudnn.allow_tf32), not the matmul flags'
CONV_CONTRACTION = "gac.conv"


def _narrow(v: ir.Value, e: ir.Type) -> ir.Value:
    if str(elem(v)) == str(e):
        return v
    return elementwise([v], shape(v), [e], lambda s: [convert(s, e)])[0]


@lowers("matmul")
def lower_matmul(op, operands):
    a, b = operands
    sa, sb = shape(a), shape(b)
    e = elem(a)
    acc = accumulator_type(e)
    batch = sa[:-2]
    m, k, n = sa[-2], sa[-1], sb[-1]
    nb = prod(batch)
    if not batch:
        out = linalg.matmul(a, b, outs=[full([m, n], 0, acc)])
    else:
        a3, b3 = reshape(a, [nb, m, k]), reshape(b, [nb, k, n])
        out = reshape(linalg.batch_matmul(a3, b3, outs=[full([nb, m, n], 0, acc)]), batch + [m, n])
    return [_narrow(out, elem(op.results[0].type))]


@lowers("conv")
def lower_conv(op, operands):
    """N-d conv as a grouped 2-D conv (1-D gets a unit height): pad, then conv_2d_ngchw_gfchw."""
    x, w = operands
    attrs = op_attrs(op)
    xs, ws = shape(x), shape(w)
    nsp = len(xs) - 2
    if nsp not in (1, 2):
        raise NotImplementedError(f"gac.conv with {nsp} spatial dims")
    stride, padding, dilation = (list(attrs[k]) for k in ("stride", "padding", "dilation"))
    if nsp == 1:
        x, w = reshape(x, xs[:2] + [1, xs[2]]), reshape(w, ws[:2] + [1, ws[2]])
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
        xs, ws = shape(x), shape(w)
    g = attrs["groups"]
    e = elem(x)
    acc = accumulator_type(e)
    if attrs["channels_last"]:
        return [_narrow(_conv_nhwc(x, w, g, stride, padding, dilation, shape(op.results[0]), acc),
                        elem(op.results[0].type))]
    x = pad_constant(x, [0, 0] + padding, [0, 0] + padding, 0)
    n, c, h, wd = shape(x)
    f = ws[0]
    x5 = reshape(x, [n, g, c // g, h, wd])
    w5 = reshape(w, [g, f // g] + ws[1:])
    out_shape = shape(op.results[0])
    ho, wo = out_shape[-2] if nsp == 2 else 1, out_shape[-1]
    init = full([n, g, f // g, ho, wo], 0, acc)
    y = linalg.conv_2d_ngchw_gfchw(
        x5, w5, outs=[init],
        strides=_i64_elements(stride),
        dilations=_i64_elements(dilation))
    return [_narrow(reshape(y, out_shape), elem(op.results[0].type))]


def _conv_nhwc(x, w, g: int, stride, padding, dilation, out_shape, acc) -> ir.Value:
    """2-D conv on N H W C activations (torch's F C KH KW weights) as one generic over
    (n, oh, ow, g, f, c, kh, kw): the channels are the input's unit-stride dim, which the GPU's
    implicit GEMM reads in 16-byte vectors (K ordered kh, kw, c)."""
    if (g == 1 and shape(w)[2:] == [1, 1] and list(stride) == [1, 1] and not any(padding)
            and os.environ.get("GAC_CONV1X1_WGMMA") != "0"):
        return _conv1x1_nhwc(x, w, acc)
    x = pad_constant(x, [0] + padding + [0], [0] + padding + [0], 0)
    n, h, wd, c = shape(x)
    f = shape(w)[0]
    x5 = reshape(x, [n, h, wd, g, c // g])
    w5 = reshape(w, [g, f // g] + shape(w)[1:])
    ho, wo = out_shape[1], out_shape[2]
    d = [ir.AffineDimExpr.get(i) for i in range(8)]  # n, oh, ow, g, f, c, kh, kw
    maps = [ir.AffineMap.get(8, 0, [d[0], d[1] * stride[0] + d[6] * dilation[0],
                                    d[2] * stride[1] + d[7] * dilation[1], d[3], d[5]]),
            ir.AffineMap.get(8, 0, [d[3], d[4], d[5], d[6], d[7]]),
            ir.AffineMap.get(8, 0, [d[0], d[1], d[2], d[3], d[4]])]
    init = full([n, ho, wo, g, f // g], 0, acc)
    y = generic([x5, w5], maps[:2], [init], maps[2:], [PARALLEL] * 5 + [REDUCTION] * 3,
                lambda a, b, o: [arith.addf(o, arith.mulf(convert(a, acc), convert(b, acc)))])[0]
    return reshape(y, out_shape)


def _conv1x1_nhwc(x, w, acc) -> ir.Value:
    """A 1x1, stride-1, unpadded, ungrouped conv on N H W C: the GEMM out[nhw, f] = x[nhw, c] @
    w[f, c]^T as a generic over (n, h, w, f, c), both operands K-major, which sm_90's wgmma GEMM
    takes (its M: the run n, h, w; strategies/merged_rows.py). Marked CONV_CONTRACTION for the
    precision flag. GAC_CONV1X1_WGMMA=0: the implicit-GEMM generic instead (A/B)."""
    n, h, wd, c = shape(x)
    f = shape(w)[0]
    d = [ir.AffineDimExpr.get(i) for i in range(5)]  # n, h, w, f, c
    maps = [ir.AffineMap.get(5, 0, [d[0], d[1], d[2], d[4]]), ir.AffineMap.get(5, 0, [d[3], d[4]]),
            ir.AffineMap.get(5, 0, [d[0], d[1], d[2], d[3]])]
    # w[:, :, 0, 0] as a rank-reducing slice, not a reshape: fusion would propagate a reshape
    # by giving the generic two unit K dims (and the GEMM strategies take one K dim)
    w2 = tensor.ExtractSliceOp(tensor_t([f, c], elem(w)), w, [], [], [], [0] * 4, [f, c, 1, 1], [1] * 4).result
    y = generic([x, w2], maps[:2], [full([n, h, wd, f], 0, acc)], maps[2:],
                [PARALLEL] * 4 + [REDUCTION],
                lambda a, b, o: [arith.addf(o, arith.mulf(convert(a, acc), convert(b, acc)))])[0]
    y.owner.attributes[CONV_CONTRACTION] = ir.UnitAttr.get()
    return y


def _i64_elements(values) -> list[int]:
    # opdsl builds the named op's i64 elements attribute from a plain list
    return [int(v) for v in values]


@lowers("pool")
def lower_pool(op, operands):
    (x,) = operands
    a = op_attrs(op)
    kernel, stride, padding, dilation = (list(a[k]) for k in ("kernel", "stride", "padding", "dilation"))
    nsp = len(kernel)
    xs = shape(x)
    out_shape = shape(op.results[0])
    lead = xs[: len(xs) - nsp]
    e = elem(x)
    if a["channels_last"]:
        return [_pool_nhwc(x, a, kernel, stride, padding, dilation, out_shape)]
    # Normalise to (N, C, H, W).
    if nsp == 1:
        kernel, stride, padding, dilation = [1] + kernel, [1] + stride, [0] + padding, [1] + dilation
    nc = [prod(lead[:-1]) if len(lead) > 1 else 1, lead[-1] if lead else 1]
    x4 = reshape(x, nc + xs[len(xs) - nsp:] if nsp == 2 else nc + [1, xs[-1]])
    h, w = shape(x4)[2:]
    ho, wo = (out_shape[-2], out_shape[-1]) if nsp == 2 else (1, out_shape[-1])
    # Extra high padding so ceil_mode windows that run off the end stay in bounds.
    hi = [max(0, (o - 1) * s + d * (k - 1) + 1 - (size + p))
          for o, s, d, k, size, p in zip((ho, wo), stride, dilation, kernel, (h, w), padding)]
    window = empty(kernel, e)
    kw = dict(strides=_i64_elements(stride), dilations=_i64_elements(dilation))
    if a["kind"] == "max":
        y = _max_pool_clamped(x4, (2, 3), kernel, stride, padding, dilation, hi, nc + [ho, wo])
        if y is not None:
            return [reshape(y, out_shape)]
        xp = pad_constant(x4, [0, 0] + padding, [0, 0] + [p + q for p, q in zip(padding, hi)], lowest(e))
        y = linalg.pooling_nchw_max(xp, window, outs=[full(nc + [ho, wo], lowest(e), e)], **kw)
        return [reshape(y, out_shape)]
    acc = accumulator_type(e)
    xa = _widen(x4, acc)
    xp = pad_constant(xa, [0, 0] + padding, [0, 0] + [p + q for p, q in zip(padding, hi)], 0)
    s = linalg.pooling_nchw_sum(xp, empty(kernel, acc), outs=[full(nc + [ho, wo], 0, acc)], **kw)
    y = generic([s], [identity_map(4)], [empty(nc + [ho, wo], e)], [identity_map(4)], [PARALLEL] * 4,
                lambda v, _out: [_average(v, a, kernel, stride, padding, (h, w), 2, acc, e)])[0]
    return [reshape(y, out_shape)]


def _pool_nhwc(x, a, kernel, stride, padding, dilation, out_shape) -> ir.Value:
    """2-D max/avg pooling of N H W C (passes/channels_last.py): as the NCHW path, over dims 1, 2."""
    e = elem(x)
    n, h, w, c = shape(x)
    ho, wo = out_shape[1], out_shape[2]
    hi = [max(0, (o - 1) * s + d * (k - 1) + 1 - (size + p))  # ceil_mode windows past the end
          for o, s, d, k, size, p in zip((ho, wo), stride, dilation, kernel, (h, w), padding)]
    low, high = [0] + padding + [0], [0] + [p + q for p, q in zip(padding, hi)] + [0]
    kw = dict(strides=_i64_elements(stride), dilations=_i64_elements(dilation))
    if a["kind"] == "max":
        y = _max_pool_clamped(x, (1, 2), kernel, stride, padding, dilation, hi, out_shape)
        if y is not None:
            return y
        xp = pad_constant(x, low, high, lowest(e))
        return linalg.pooling_nhwc_max(xp, empty(kernel, e), outs=[full(out_shape, lowest(e), e)], **kw)
    acc = accumulator_type(e)
    xp = pad_constant(_widen(x, acc), low, high, 0)
    s = linalg.pooling_nhwc_sum(xp, empty(kernel, acc), outs=[full(out_shape, 0, acc)], **kw)
    return generic([s], [identity_map(4)], [empty(out_shape, e)], [identity_map(4)], [PARALLEL] * 4,
                   lambda v, _out: [_average(v, a, kernel, stride, padding, (h, w), 1, acc, e)])[0]


MAX_CLAMPED_WINDOW = 16  # window elements a clamped max pool unrolls (larger: the padded one)


def _max_pool_clamped(x, spatial, kernel, stride, padding, dilation, hi, out_shape):
    """A padded 4-d max pool (window dims `spatial` of x) as one generic over the output that
    reads each window element at its index clamped into [0, size): with dilation 1 every window
    is a run that holds an element of x (torch drops windows starting in the high padding), so a
    clamped index repeats an element of the same window and the max is the padded one's. The
    lowest-valued padded copy of x (a fill and a copy, each a kernel over the whole tensor:
    0.13 ms of ResNet-50's stem on the H200) is never made. None where that does not hold (then
    the padded pool); GAC_POOL_CLAMP=0: always None."""
    xs, e = shape(x), elem(x)
    if (os.environ.get("GAC_POOL_CLAMP") == "0" or not is_float(e) or any(d != 1 for d in dilation)
            or not (any(padding) or any(hi)) or prod(kernel) > MAX_CLAMPED_WINDOW
            or any(isinstance(s, ir.Value) for s in xs)):
        return None
    outs = [out_shape[d] for d in spatial]
    sizes = [xs[d] for d in spatial]
    if any(k - 1 - p < 0 or (o - 1) * s - p > n - 1
           for k, p, o, s, n in zip(kernel, padding, outs, stride, sizes)):
        return None

    def at(d: int, j: int, off: int):
        """The window's element `off` along spatial dim j, clamped where it can leave x."""
        p, o, s, n = padding[j], outs[j], stride[j], sizes[j]
        i = arith.addi(arith.muli(_at_dim(d), const(s, index_type())), const(off - p, index_type()))
        if off - p < 0:
            i = arith.maxsi(i, const(0, index_type()))
        if (o - 1) * s + off - p > n - 1:
            i = arith.minsi(i, const(n - 1, index_type()))
        return i

    def body(_out):
        ids = [_at_dim(d) for d in range(4)]
        y = None
        for kh in range(kernel[0]):
            for kw in range(kernel[1]):
                idx = list(ids)
                idx[spatial[0]], idx[spatial[1]] = at(spatial[0], 0, kh), at(spatial[1], 1, kw)
                v = tensor.ExtractOp(x, idx).result
                y = v if y is None else arith.maximumf(y, v)
        return [y]

    return generic([], [], [empty(out_shape, e)], [identity_map(4)], [PARALLEL] * 4, body)[0]


def _at_dim(d: int) -> ir.Value:
    return linalg.IndexOp(ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d)).result


def _average(v, a, kernel, stride, padding, size_hw, first: int, acc, e):
    """One pooled sum divided as torch does: by the divisor, else by the window's element count
    (padding counted or not); the window dims are `first`, `first` + 1 of the iteration."""
    if a["divisor"]:
        return convert(arith.divf(v, const(a["divisor"], acc)), e)
    counts = []
    for d, (size, k, st, p) in enumerate(zip(size_hw, kernel, stride, padding)):
        i64 = ir.IntegerType.get_signless(64)
        start = arith.subi(arith.muli(index(first + d), const(st, i64)), const(p, i64))
        end = arith.minsi(arith.addi(start, const(k, i64)), const(size + p, i64))
        if not a["count_include_pad"]:
            start = arith.maxsi(start, const(0, i64))
            end = arith.minsi(end, const(size, i64))
        counts.append(arith.subi(end, start))
    cnt = arith.sitofp(acc, arith.muli(counts[0], counts[1]))
    return convert(arith.divf(v, cnt), e)


def _widen(v, acc):
    return v if str(elem(v)) == str(acc) else elementwise([v], shape(v), [acc], lambda s: [convert(s, acc)])[0]



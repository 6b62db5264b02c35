"""Matrix products, convolution and pooling."""

from __future__ import annotations

import math

import torch

from gac_torch.ir.types import tensor_type
from gac_torch.legalize.context import NEEDS_STATIC, Cx, meta_val
from gac_torch.legalize.registry import FLOATS, NUMERIC, aten, lower


@lower(aten.mm.default, aten.bmm.default, dynamic=True)
def lower_mm(cx: Cx, a, b):
    return cx.matmul(a, b)


@lower(aten.addmv.default)
def lower_addmv(cx: Cx, bias, mat, vec, *, beta=1, alpha=1):
    col = cx.b.reshape(vec, [cx.shape(vec)[0], 1])
    return lower_addmm(cx, bias, mat, col, beta=beta, alpha=alpha, out_shape=cx.out_shape)


@lower(aten.addbmm.default)
def lower_addbmm(cx: Cx, bias, a, b, *, beta=1, alpha=1):
    """sum_i a_i @ b_i is one (n, B*k) @ (B*k, m) product."""
    nb, n, k = cx.shape(a)
    m = cx.shape(b)[-1]
    a2 = cx.b.reshape(cx.b.transpose(a, perm=[1, 0, 2]), [n, nb * k])
    return lower_addmm(cx, bias, a2, cx.b.reshape(b, [nb * k, m]), beta=beta, alpha=alpha)


@lower(aten.addmm.default, aten.baddbmm.default, dynamic=True)
def lower_addmm(cx: Cx, bias, a, b, *, beta=1, alpha=1, out_shape=None):
    """beta * bias + alpha * (a @ b), from the unrounded f32 product for f16/bf16 (one rounding,
    as ATen's kernels do)."""
    dt = cx.out_dtype
    ct = cx.compute_dtype(dt)
    y = cx.matmul(a, b, wide=True)
    if out_shape is not None:
        y = cx.b.reshape(y, out_shape)
    if alpha != 1:
        y = cx.b.binary(y, cx.to(alpha, ct), kind="mul")
    if beta != 0:
        bias = cx.to(bias, ct)
        if beta != 1:
            bias = cx.b.binary(bias, cx.to(beta, ct), kind="mul")
        y = cx.b.binary(y, bias, kind="add")
    return cx.to(y, dt)


def run_time_batch_only(node) -> str | None:
    """channel or spatial sizes known only at run time (a run-time batch size is fine)"""
    x = meta_val(node.args[0])
    if any(not isinstance(s, int) for s in x.shape[1:]):
        return f"{NEEDS_STATIC}: a window op over channel or spatial sizes known only at run time"
    return None


def _conv_check(node) -> str | None:
    """3-d convolution; empty tensors; run-time channel/spatial sizes"""
    x = meta_val(node.args[0])
    if x.dim() not in (3, 4):
        return f"{x.dim() - 2}-d convolution"
    dynamic = run_time_batch_only(node)
    if dynamic or (node.args[6] and not isinstance(x.shape[0], int)):
        return dynamic or f"{NEEDS_STATIC}: a transposed convolution with a run-time batch size"
    if isinstance(x.shape[0], int) and (meta_val(node).numel() == 0 or x.numel() == 0):
        return "empty convolution"
    return None


@lower(aten.convolution.default, check=_conv_check, dtypes=NUMERIC, dynamic=True)
def lower_convolution(cx: Cx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nsp = len(cx.shape(x)) - 2
    rep = (lambda v: list(v) * nsp if len(v) == 1 else list(v))
    if transposed:
        x, w = _as_direct_conv(cx, x, w, rep(stride), rep(padding), rep(dilation), rep(output_padding), groups)
        stride, padding = [1] * nsp, [0] * nsp
    # With a bias, f16/bf16 keep the f32 accumulator until after the add: one rounding, as ATen's
    # CPU kernel does, on every target. CUDA eager (cuDNN) rounds the convolution and then the
    # bias add, up to 1 ulp apart; gac keeps the more exact single rounding and the cuda parity
    # tests compare with a float64 reference at the f16 tolerance (tests/parity.py TOL).
    dt = cx.out_dtype
    ct = cx.compute_dtype(dt) if bias is not None else dt
    y = cx.b.conv(x, w, stride=rep(stride), padding=rep(padding), dilation=rep(dilation), groups=groups,
                  channels_last=0, result_type=tensor_type(cx.out_shape, ct))
    if bias is not None:
        y = cx.b.binary(y, cx.b.reshape(cx.to(bias, ct), [cx.out_shape[1]] + [1] * nsp), kind="add")
    return cx.to(y, dt)


def _as_direct_conv(cx: Cx, x, w, stride, padding, dilation, output_padding, groups):
    """A transposed conv is a direct conv of the stride-dilated, re-padded input with the
    spatially flipped weight, its in/out channels swapped per group."""
    xs, ws = cx.shape(x), cx.shape(w)
    nsp = len(xs) - 2
    # 1. insert stride-1 zeros between input elements: (.., H, 1, W, 1) padded to (.., H, s, W, s)
    inter = xs[:2] + [d for size in xs[2:] for d in (size, 1)]
    high = [0, 0] + [d for s in stride for d in (0, s - 1)]
    z = cx.b.pad(cx.b.reshape(x, inter), low=[0] * len(inter), high=high, mode="constant", value=0.0)
    z = cx.b.reshape(z, xs[:2] + [size * s for size, s in zip(xs[2:], stride)])
    # 2. pad by d*(k-1)-p (plus output_padding at the end); drops the trailing s-1 zeros too
    low = [0, 0] + [d * (k - 1) - p for d, k, p in zip(dilation, ws[2:], padding)]
    high = [0, 0] + [d * (k - 1) - p + op - (s - 1) for d, k, p, op, s in
                     zip(dilation, ws[2:], padding, output_padding, stride)]
    z = cx.b.pad(z, low=low, high=high, mode="constant", value=0.0)
    # 3. weight (Cin, Cout/g, k..) -> (Cout, Cin/g, k..), flipped in space
    cin, cout_g = ws[0], ws[1]
    wt = cx.b.reshape(w, [groups, cin // groups, cout_g] + ws[2:])
    wt = cx.b.transpose(wt, perm=[0, 2, 1] + list(range(3, 3 + nsp)))
    wt = cx.b.reshape(wt, [groups * cout_g, cin // groups] + ws[2:])
    for d in range(2, 2 + nsp):
        if ws[d] > 1:
            rev = cx.b.constant(torch.arange(ws[d] - 1, -1, -1), torch.int64, (ws[d],))
            wt = cx.b.index_select(wt, rev, dim=d)
    return z, wt


def _pool_args(kernel, stride, padding, dilation=(1,)):
    n = len(kernel)
    rep = (lambda v: list(v) * n if len(v) == 1 else list(v))
    return list(kernel), rep(stride or kernel), rep(padding), rep(dilation)


def _indices_unused(node) -> str | None:
    users = [u for u in node.users if not (u.target.__name__ == "getitem" and u.args[1] == 0)]
    return "pooling indices are used" if users else None


def _max_pool_check(node) -> str | None:
    """run-time channel/spatial sizes; indices with a run-time batch size"""
    x = meta_val(node.args[0])
    if not isinstance(x.shape[0], int) and _indices_unused(node):
        return f"{NEEDS_STATIC}: max pooling indices with a run-time batch size"
    return run_time_batch_only(node)


@lower(aten.max_pool2d_with_indices.default, check=_max_pool_check, dtypes=NUMERIC, dynamic=True)
def lower_max_pool2d(cx: Cx, x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    k, s, p, d = _pool_args(kernel, stride, padding, dilation)
    if _indices_unused(cx.node) is None:
        y = cx.b.pool(x, kind="max", kernel=k, stride=s, padding=p, dilation=d,
                      ceil_mode=int(ceil_mode), count_include_pad=1, divisor=0, channels_last=0)
        return y, None
    return _max_pool_with_indices(cx, x, k, s, p, d)


def _max_pool_with_indices(cx: Cx, x, k, s, p, d):
    """Pad with the lowest value, then take each window's max and argmax (see _window_max)."""
    shape = cx.shape(x)
    h, w = shape[-2:]
    oh, ow = cx.out_shape[-2:]
    lead = shape[:-2]
    need = [(o - 1) * st + (kk - 1) * dd + 1 for o, st, kk, dd in zip((oh, ow), s, k, d)]
    high = [max(0, n - (size + pp)) for n, size, pp in zip(need, (h, w), p)]
    lowest = -math.inf if cx.out_dtype.is_floating_point else torch.iinfo(cx.out_dtype).min
    xp = cx.b.pad(x, low=[0] * len(lead) + p, high=[0] * len(lead) + [pp + hh for pp, hh in zip(p, high)],
                  mode="constant", value=float(lowest))
    rows = torch.tensor([[o * s[0] + i * d[0] for i in range(k[0])] for o in range(oh)])
    cols = torch.tensor([[o * s[1] + j * d[1] for j in range(k[1])] for o in range(ow)])
    return _window_max(cx, xp, rows, cols, rows - p[0], cols - p[1], w)


def _window_max(cx: Cx, x, rows: torch.Tensor, cols: torch.Tensor, flat_rows: torch.Tensor,
                flat_cols: torch.Tensor, width: int):
    """Max and argmax over windows given as static tables: window (o, q) covers rows[o, :] x
    cols[q, :] of x's last two dims. The argmax becomes flat_rows * width + flat_cols (a flat
    index into the unpadded H x W plane, like ATen's)."""
    lead = cx.shape(x)[:-2]
    (oh, kh), (ow, kw) = rows.shape, cols.shape
    n = len(lead)
    g = cx.b.index_select(x, cx.b.constant(rows.flatten(), torch.int64, (oh * kh,)), dim=n)
    g = cx.b.index_select(g, cx.b.constant(cols.flatten(), torch.int64, (ow * kw,)), dim=n + 1)
    g = cx.b.transpose(cx.b.reshape(g, lead + [oh, kh, ow, kw]), perm=list(range(n)) + [n, n + 2, n + 1, n + 3])
    g = cx.b.reshape(g, lead + [oh, ow, kh * kw])
    values = cx.b.reduce(g, kind="max", dims=[n + 2], keepdim=False)
    arg = cx.b.reshape(cx.b.arg_reduce(g, kind="max", dim=n + 2, keepdim=False), lead + [oh, ow, 1])
    i64 = torch.int64

    def pick(table: torch.Tensor, which, shape3: list[int]):
        t = cx.b.broadcast(cx.b.constant(table.flatten(), i64, tuple(shape3)), shape=lead + [oh, ow, shape3[-1]])
        return cx.b.gather(t, which, dim=n + 2)

    r = pick(flat_rows, cx.b.binary(arg, cx.to(kw, i64), kind="floordiv"), [oh, 1, kh])
    c = pick(flat_cols, cx.b.binary(arg, cx.to(kw, i64), kind="remainder"), [1, ow, kw])
    index = cx.b.binary(cx.b.binary(r, cx.to(width, i64), kind="mul"), c, kind="add")
    return values, cx.b.reshape(index, lead + [oh, ow])


@lower(aten.avg_pool2d.default, check=run_time_batch_only, dtypes=FLOATS, dynamic=True)
def lower_avg_pool2d(cx: Cx, x, kernel, stride=(), padding=(0,), ceil_mode=False,
                     count_include_pad=True, divisor_override=None):
    k, s, p, d = _pool_args(kernel, stride, padding)
    return cx.b.pool(x, kind="avg", kernel=k, stride=s, padding=p, dilation=d, ceil_mode=int(ceil_mode),
                     count_include_pad=int(count_include_pad), divisor=int(divisor_override or 0), channels_last=0)


def _windows(size: int, out: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Adaptive pooling windows [floor(i*size/out), ceil((i+1)*size/out)) as an index table
    (out, kmax) — short windows repeat their last element — and a 0/1 validity table."""
    start = [(i * size) // out for i in range(out)]
    end = [((i + 1) * size + out - 1) // out for i in range(out)]
    kmax = max(e - s for s, e in zip(start, end))
    idx = torch.tensor([[min(s + k, e - 1) for k in range(kmax)] for s, e in zip(start, end)])
    valid = torch.tensor([[k < e - s for k in range(kmax)] for s, e in zip(start, end)])
    return idx, valid, kmax


def _adaptive(cx: Cx, x, output_size, kind: str):
    """Uneven adaptive pooling, one spatial dim at a time (max and mean are separable): gather
    each window's elements into a new axis, then reduce it."""
    rank = len(cx.shape(x))
    for axis, out in zip((rank - 2, rank - 1), output_size):
        shape = cx.shape(x)
        idx, valid, kmax = _windows(shape[axis], out)
        g = cx.b.index_select(x, cx.b.constant(idx.flatten(), torch.int64, (out * kmax,)), dim=axis)
        g = cx.b.reshape(g, shape[:axis] + [out, kmax] + shape[axis + 1:])
        tail = [1] * (rank - 1 - axis)
        if kind == "max":
            x = cx.b.reduce(g, kind="max", dims=[axis + 1], keepdim=False)
            continue
        dt = cx.dtype_of(g)
        w = valid.to(torch.float64) / valid.sum(1, keepdim=True)
        w = cx.b.reshape(cx.b.constant(w.flatten(), dt, (out * kmax,)), [out, kmax] + tail)
        x = cx.b.reduce(cx.b.binary(g, w, kind="mul"), kind="sum", dims=[axis + 1], keepdim=False)
    return x


@lower(aten._adaptive_avg_pool2d.default, check=run_time_batch_only, dtypes=FLOATS, dynamic=True)
def lower_adaptive_avg_pool2d(cx: Cx, x, output_size):
    h, w = cx.shape(x)[-2:]
    if h % output_size[0] == 0 and w % output_size[1] == 0:  # even windows: a plain average pool
        k = [h // output_size[0], w // output_size[1]]
        return cx.b.pool(x, kind="avg", kernel=k, stride=k, padding=[0, 0], dilation=[1, 1],
                         ceil_mode=0, count_include_pad=1, divisor=0, channels_last=0)
    acc = torch.float64 if cx.out_dtype == torch.float64 else torch.float32
    return cx.to(_adaptive(cx, cx.to(x, acc), output_size, "avg"), cx.out_dtype)


@lower(aten.adaptive_max_pool2d.default, dtypes=NUMERIC)
def lower_adaptive_max_pool2d(cx: Cx, x, output_size):
    if _indices_unused(cx.node) is None:
        return _adaptive(cx, x, output_size, "max"), None
    h, w = cx.shape(x)[-2:]
    rows, _, _ = _windows(h, output_size[0])
    cols, _, _ = _windows(w, output_size[1])
    return _window_max(cx, x, rows, cols, rows, cols, w)

"""Resampling: upsample_nearest2d / upsample_bilinear2d and grid_sampler_2d.

Upsampling reads only static positions: its source indices and weights are computed here, with
ATen's own float32 arithmetic (UpSample.h), and become small constant tables; the op itself is
then index_select + elementwise math. grid_sampler_2d reads data-dependent positions: it is
elementwise math on the grid, a gather, and selects that zero the out-of-range corners (a
select, not a multiply, so NaN/inf/1e9 coordinates give exactly what ATen's CPU kernel gives).
"""

from __future__ import annotations

import numpy as np
import torch
from mlir import ir

from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import FLOATS, aten, lower

_F32 = np.float32


def _scale(in_size: int, out_size: int, scale: float | None, align_corners: bool | None, wide: bool):
    """area_pixel_compute_scale / compute_scales_value, in ATen's opmath precision."""
    f = np.float64 if wide else _F32
    if align_corners:
        return f(in_size - 1) / f(out_size - 1) if out_size > 1 else f(0)
    if scale is not None and scale > 0:
        return f(1.0 / scale)
    return f(in_size) / f(out_size)


def _nearest_table(in_size: int, out_size: int, scale: float | None) -> torch.Tensor:
    if out_size == in_size:
        return torch.arange(out_size)
    if out_size == 2 * in_size:
        return torch.arange(out_size) // 2
    s = _scale(in_size, out_size, scale, None, False)
    return torch.tensor([min(int(np.floor(_F32(i) * s)), in_size - 1) for i in range(out_size)])


def _linear_tables(in_size: int, out_size: int, scale: float | None, align: bool, wide: bool):
    """(index0, index1, lambda0, lambda1) as in ATen's compute_source_index_and_lambda."""
    if out_size == in_size:
        i = torch.arange(out_size)
        return i, i, torch.ones(out_size, dtype=torch.float64), torch.zeros(out_size, dtype=torch.float64)
    f = np.float64 if wide else _F32
    ratio = _scale(in_size, out_size, scale, align, wide)
    i0, i1, l0, l1 = [], [], [], []
    for o in range(out_size):
        real = ratio * f(o) if align else max(ratio * (f(o) + f(0.5)) - f(0.5), f(0))
        lo = min(int(np.floor(real)), in_size - 1)
        lam = min(max(real - f(lo), f(0)), f(1))
        i0.append(lo)
        i1.append(lo + (1 if lo < in_size - 1 else 0))
        l1.append(float(lam))
        l0.append(float(f(1) - lam))
    return (torch.tensor(i0), torch.tensor(i1), torch.tensor(l0, dtype=torch.float64),
            torch.tensor(l1, dtype=torch.float64))


def _pick(cx: Cx, x, table: torch.Tensor, dim: int):
    n = table.numel()
    if n == cx.shape(x)[dim] and torch.equal(table, torch.arange(n)):
        return x
    return cx.b.index_select(x, cx.b.constant(table, torch.int64, (n,)), dim=dim)


def _nonempty(node) -> str | None:
    """empty tensors"""
    return "empty tensor" if meta_val(node.args[0]).numel() == 0 or meta_val(node).numel() == 0 else None


@lower(aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec, check=_nonempty)
def lower_upsample_nearest2d(cx: Cx, x, output_size=None, *rest):
    if cx.node.target is aten.upsample_nearest2d.vec:
        scales = list(rest[0]) if rest and rest[0] else [None, None]
    else:
        scales = [rest[0] if len(rest) > 0 else None, rest[1] if len(rest) > 1 else None]
    (h, w), (oh, ow) = cx.shape(x)[-2:], cx.out_shape[-2:]
    rank = len(cx.shape(x))
    y = _pick(cx, x, _nearest_table(h, oh, scales[0]), rank - 2)
    return _pick(cx, y, _nearest_table(w, ow, scales[1]), rank - 1)


@lower(aten.upsample_bilinear2d.default, aten.upsample_bilinear2d.vec, check=_nonempty, dtypes=FLOATS)
def lower_upsample_bilinear2d(cx: Cx, x, output_size, align_corners, *rest):
    if cx.node.target is aten.upsample_bilinear2d.vec:
        scales = list(rest[0]) if rest and rest[0] else [None, None]
    else:
        scales = [rest[0] if len(rest) > 0 else None, rest[1] if len(rest) > 1 else None]
    dt = cx.out_dtype
    wide = dt == torch.float64
    acc = torch.float64 if wide else torch.float32
    xf = cx.to(x, acc)
    rank = len(cx.shape(x))
    (h, w), (oh, ow) = cx.shape(x)[-2:], cx.out_shape[-2:]
    h0, h1, lh0, lh1 = _linear_tables(h, oh, scales[0], bool(align_corners), wide)
    w0, w1, lw0, lw1 = _linear_tables(w, ow, scales[1], bool(align_corners), wide)

    def weight(t: torch.Tensor, trailing: int) -> ir.Value:
        return cx.b.reshape(cx.b.constant(t, acc, (t.numel(),)), [t.numel()] + [1] * trailing)

    def along_w(rows):  # rows[.., w0] * lw0 + rows[.., w1] * lw1, ATen's order
        a = cx.b.binary(_pick(cx, rows, w0, rank - 1), weight(lw0, 0), kind="mul")
        b = cx.b.binary(_pick(cx, rows, w1, rank - 1), weight(lw1, 0), kind="mul")
        return cx.b.binary(a, b, kind="add")

    top = cx.b.binary(along_w(_pick(cx, xf, h0, rank - 2)), weight(lh0, 1), kind="mul")
    bottom = cx.b.binary(along_w(_pick(cx, xf, h1, rank - 2)), weight(lh1, 1), kind="mul")
    return cx.to(cx.b.binary(top, bottom, kind="add"), dt)


# grid_sampler_2d ---------------------------------------------------------------------------

def _grid_check(node) -> str | None:
    """bicubic mode; empty tensors"""
    mode = node.args[2]
    if mode not in (0, 1):
        return "bicubic grid sampling"
    return _nonempty(node)


class _Math:
    """Elementwise helpers over gac values in one float type."""

    def __init__(self, cx: Cx, dt: torch.dtype):
        self.cx, self.b, self.dt = cx, cx.b, dt

    def c(self, v) -> ir.Value:
        return self.cx.to(float(v), self.dt)

    def __call__(self, kind: str, a, b=None) -> ir.Value:
        a = a if isinstance(a, ir.Value) else self.c(a)
        if b is None:
            return self.b.unary(a, kind=kind)
        return self.b.binary(a, b if isinstance(b, ir.Value) else self.c(b), kind=kind)


def _clip(m: _Math, v, size: int):
    """ATen's clip_coordinates: NaN becomes 0 (the vectorized kernel clamps NaN to zero)."""
    v = m.b.select(m("isnan", v), m.c(0), v)
    return m("minimum", m("maximum", v, 0), size - 1)


def _reflect(m: _Math, v, size: int, align: bool):
    twice_span = 2 * (size - 1) if align else 2 * size
    if twice_span <= 0:
        return m.b.broadcast(m.c(0), shape=m.cx.shape(v))
    low = 0.0 if align else -0.5
    a = m("abs", m("sub", v, low))
    flips = m("trunc", m("div", a, twice_span))
    extra = m("sub", a, m("mul", flips, twice_span))
    return m("add", m("minimum", extra, m("sub", m.c(twice_span), extra)), low)


def _source(m: _Math, g, size: int, padding: int, align: bool):
    """grid value -> source pixel coordinate (GridSamplerKernel.cpp, ComputeLocation)."""
    if align:
        v = m("mul", m("add", g, 1), (size - 1) / 2)
    else:
        v = m("sub", m("mul", m("add", g, 1), size / 2), 0.5)
    if padding == 1:
        v = _clip(m, v, size)
    elif padding == 2:
        v = _clip(m, _reflect(m, v, size, align), size)
    return v


@lower(aten.grid_sampler_2d.default, check=_grid_check, dtypes=FLOATS)
def lower_grid_sampler_2d(cx: Cx, x, grid, mode, padding, align_corners):
    dt = cx.out_dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    m = _Math(cx, acc)
    n, c, h, w = cx.shape(x)
    oh, ow = cx.shape(grid)[1:3]
    g = cx.to(grid, acc)

    def coord(k: int):
        s = cx.b.slice(g, starts=[0, 0, 0, k], limits=[n, oh, ow, k + 1], strides=[1, 1, 1, 1])
        return cx.b.reshape(s, [n, 1, oh * ow])

    ix = _source(m, coord(0), w, padding, bool(align_corners))
    iy = _source(m, coord(1), h, padding, bool(align_corners))
    flat = cx.b.reshape(cx.to(x, acc), [n, c, h * w])

    def tap(xi, yi):
        """x[.., yi, xi], zero outside the image; xi, yi hold integral floats (or NaN/inf)."""
        ok = m("logical_and", m("logical_and", m("gt", xi, -1), m("lt", xi, w)),
               m("logical_and", m("gt", yi, -1), m("lt", yi, h)))
        lin = m("add", m("mul", m.b.select(ok, yi, m.c(0)), w), m.b.select(ok, xi, m.c(0)))
        lin = cx.b.broadcast(cx.to(lin, torch.int64), shape=[n, c, oh * ow])
        return m.b.select(ok, cx.b.gather(flat, lin, dim=2), m.c(0))

    if mode == 1:  # nearest: round half to even, like the vectorized kernel
        y = tap(m("round", ix), m("round", iy))
    else:
        x_w, y_n = m("floor", ix), m("floor", iy)
        x_e, y_s = m("add", x_w, 1), m("add", y_n, 1)
        we = m("sub", ix, x_w)
        ww = m("sub", m.c(1), we)
        ns = m("sub", iy, y_n)
        nn_ = m("sub", m.c(1), ns)
        # (value * weight) summed in ATen's order: nw, ne, sw, se
        y = m("mul", tap(x_w, y_n), m("mul", nn_, ww))
        y = m("add", y, m("mul", tap(x_e, y_n), m("mul", nn_, we)))
        y = m("add", y, m("mul", tap(x_w, y_s), m("mul", ns, ww)))
        y = m("add", y, m("mul", tap(x_e, y_s), m("mul", ns, we)))
    return cx.to(cx.b.reshape(y, [n, c, oh, ow]), dt)


@lower(aten.cudnn_grid_sampler.default, check=_nonempty, dtypes=FLOATS)
def lower_cudnn_grid_sampler(cx: Cx, x, grid):
    """What aten.grid_sampler becomes on CUDA when cuDNN takes the input (bilinear, zero padding,
    align_corners=True): the same sampling as grid_sampler_2d with those options."""
    return lower_grid_sampler_2d(cx, x, grid, 0, 0, True)

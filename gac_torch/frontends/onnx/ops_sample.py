"""Resampling ONNX ops: Resize and GridSample, written with ATen ops the gac registry lowers
(index_select / gather, arithmetic) rather than aten.upsample_* / grid_sampler_*, which it lacks.

Resize is separable and its sample positions depend only on static shapes, so each resized axis
becomes a few static taps: y = sum_k index_select(x, axis, idx_k) * w_k, with idx/w computed at
import by ONNX's own coordinate formulas (every coordinate_transformation_mode and nearest_mode).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.registry import OnnxNode, Unsupported, onnx_op

aten = torch.ops.aten
Taps = list[tuple[np.ndarray, np.ndarray | None]]  # (source indices, weights or None) per tap


def _source_coords(n: OnnxNode, out: int, size: int, scale: float) -> np.ndarray:
    """ONNX's x_original for every output position, in float32 like onnxruntime."""
    x, s = np.arange(out, dtype=np.float32), np.float32(scale)
    mode = n.attr("coordinate_transformation_mode", "half_pixel")
    if mode == "half_pixel" or (mode == "pytorch_half_pixel" and out > 1):
        return (x + 0.5) / s - 0.5
    if mode == "pytorch_half_pixel":
        return np.zeros_like(x)
    if mode == "align_corners":
        return x * np.float32((size - 1) / (out - 1)) if out > 1 else np.zeros_like(x)
    if mode == "asymmetric":
        return x / s
    if mode == "half_pixel_symmetric":
        adjust = np.float32(out / (scale * size))
        return np.float32(size / 2) * (1 - adjust) + (x + 0.5) / s - 0.5
    raise Unsupported(f"coordinate_transformation_mode={mode!r}")


def _cubic_weights(t: np.ndarray, a: float) -> list[np.ndarray]:
    """Keys' cubic convolution weights for the taps at floor(x) - 1 .. floor(x) + 2."""

    def near(d):  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


_ROUNDING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "round_prefer_floor": lambda v: np.ceil(v - 0.5),  # ties go down
    "round_prefer_ceil": lambda v: np.floor(v + 0.5),  # ties go up
    "floor": np.floor,
    "ceil": np.ceil,
}


def _taps(n: OnnxNode, out: int, size: int, scale: float) -> Taps:
    xo = _source_coords(n, out, size, scale)
    mode = n.attr("mode", "nearest")
    if mode == "nearest":
        rounding = n.only("nearest_mode", *_ROUNDING, default="round_prefer_floor")
        return [(np.clip(_ROUNDING[rounding](xo), 0, size - 1).astype(np.int64), None)]
    if mode == "linear":
        xo = np.clip(xo, 0, size - 1)
        i0 = np.floor(xo)
        w1 = (xo - i0).astype(np.float32)
        return [(i0.astype(np.int64), 1 - w1), (np.minimum(i0 + 1, size - 1).astype(np.int64), w1)]
    if mode == "cubic":
        base = np.floor(xo)
        ws = _cubic_weights((xo - base).astype(np.float32), n.attr("cubic_coeff_a", -0.75))
        idx = [base + k for k in (-1, 0, 1, 2)]
        if n.attr("exclude_outside", 0):  # outside taps get no weight; the rest renormalize
            ws = [np.where((i >= 0) & (i < size), w, 0) for i, w in zip(idx, ws)]
            total = sum(ws)
            ws = [w / total for w in ws]
        return [
            (np.clip(i, 0, size - 1).astype(np.int64), w.astype(np.float32))
            for i, w in zip(idx, ws)
        ]
    raise Unsupported(f"mode={mode!r}")


def _is_identity(taps: Taps, out: int, size: int) -> bool:
    m = np.zeros((out, size))
    for idx, w in taps:
        np.add.at(m, (np.arange(out), idx), 1.0 if w is None else w)
    return out == size and np.array_equal(m, np.eye(size))


def _resize_axis(g: GraphBuilder, x: Value, axis: int, taps: Taps) -> Value:
    rank, dtype = g.rank(x), g.dtype(x)
    acc: Value | None = None
    for idx, w in taps:
        t = g.call(aten.index_select.default, x, axis, torch.from_numpy(idx))
        if w is not None:
            weight = torch.from_numpy(w).to(dtype).reshape([-1] + [1] * (rank - 1 - axis))
            t = g.call(aten.mul.Tensor, t, weight)
        acc = t if acc is None else g.call(aten.add.Tensor, acc, t)
    assert acc is not None
    return acc


@onnx_op("Resize")
def resize(
    g: GraphBuilder,
    n: OnnxNode,
    x: Value,
    roi: Value | None = None,
    scales: Value | None = None,
    sizes: Value | None = None,
) -> Value:
    if n.attr("antialias", 0):
        raise Unsupported("antialias=1")
    if n.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise Unsupported("keep_aspect_ratio_policy")
    shape = g.shape(x)
    axes = [a % len(shape) for a in n.attr("axes") or range(len(shape))]  # opset 18: per-axis
    sc = (
        g.floats(scales, "Resize scales") if scales is not None and g.shape(scales) != [0] else None
    )
    if sc:
        plan = [(a, math.floor(shape[a] * s), s) for a, s in zip(axes, sc)]
    else:
        sz = g.ints(sizes, "Resize sizes") or []
        plan = [(a, o, o / shape[a]) for a, o in zip(axes, sz)]
    for axis, out, scale in plan:
        taps = _taps(n, out, shape[axis], scale)
        if not _is_identity(taps, out, shape[axis]):
            x = _resize_axis(g, x, axis, taps)
    return x


# --- GridSample -------------------------------------------------------------------------------

# Opset 20 renamed bilinear/bicubic to linear/cubic; both spellings are accepted.
_GRID_MODES = {"bilinear": 0, "linear": 0, "nearest": 1, "bicubic": 2, "cubic": 2}
_GRID_PADDING = {"zeros": 0, "border": 1, "reflection": 2}


def _unnormalize(g: GraphBuilder, c: Value, size: int, align: bool, padding: str) -> Value:
    """Grid coordinate in [-1, 1] -> pixel coordinate, with border/reflection applied."""
    if align:  # -1 and 1 are the centers of the corner pixels
        c = g.call(aten.mul.Scalar, g.call(aten.add.Scalar, c, 1), (size - 1) / 2)
    else:  # -1 and 1 are the outer edges of the corner pixels
        c = g.call(
            aten.div.Scalar,
            g.call(
                aten.sub.Scalar, g.call(aten.mul.Scalar, g.call(aten.add.Scalar, c, 1), size), 1
            ),
            2,
        )
    if padding == "reflection":
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        span = hi - lo
        if span <= 0:
            return g.call(aten.mul.Scalar, c, 0)
        d = g.call(aten.abs.default, g.call(aten.sub.Scalar, c, lo))
        flips = g.call(aten.floor.default, g.call(aten.div.Scalar, d, span))
        extra = g.call(aten.fmod.Scalar, d, span)
        odd = g.call(aten.remainder.Scalar, flips, 2)  # 0 or 1: odd flips mirror the remainder
        c = g.call(
            aten.add.Tensor,
            g.call(aten.add.Scalar, extra, lo),
            g.call(
                aten.mul.Tensor,
                odd,
                g.call(aten.rsub.Scalar, g.call(aten.mul.Scalar, extra, 2), span),
            ),
        )
    if padding != "zeros":
        c = g.call(aten.clamp.default, c, 0, size - 1)
    return c


def _inside(g: GraphBuilder, c: Value, size: int) -> Value:
    """1.0 where the integer-valued coordinate c lies in [0, size - 1], else 0.0 — arithmetic,
    not a bool mask, so the four corners may share it freely."""
    outside = g.call(
        aten.abs.default, g.call(aten.sub.Tensor, c, g.call(aten.clamp.default, c, 0, size - 1))
    )
    return g.call(aten.rsub.Scalar, g.call(aten.clamp.default, outside, None, 1.0), 1)


def _corner(
    g: GraphBuilder,
    flat: Value,
    xi: Value,
    yi: Value,
    w: Value,
    hw: tuple[int, int],
    shape_ncq: list[int],
) -> Value:
    """flat[n, c, yi * W + xi] * w, zero where (xi, yi) is outside the image."""
    h, wd = hw
    w = g.call(aten.mul.Tensor, w, g.call(aten.mul.Tensor, _inside(g, xi, wd), _inside(g, yi, h)))
    xc, yc = g.call(aten.clamp.default, xi, 0, wd - 1), g.call(aten.clamp.default, yi, 0, h - 1)
    lin = g.cast(g.call(aten.add.Tensor, g.call(aten.mul.Scalar, yc, wd), xc), torch.int64)
    n_, c_, q = shape_ncq
    idx = g.call(aten.expand.default, g.call(aten.reshape.default, lin, [n_, 1, q]), [n_, c_, q])
    val = g.call(aten.gather.default, flat, 2, idx)
    return g.call(aten.mul.Tensor, val, g.call(aten.reshape.default, w, [n_, 1, q]))


@onnx_op("GridSample")
def grid_sample(g: GraphBuilder, n: OnnxNode, x: Value, grid: Value) -> Value:
    mode = n.only("mode", *_GRID_MODES, default="linear" if n.opset >= 20 else "bilinear")
    padding = n.only("padding_mode", *_GRID_PADDING, default="zeros")
    align = bool(n.attr("align_corners", 0))
    rank = g.rank(x)
    if rank != 4 or _GRID_MODES[mode] == 2:  # bicubic and 3-D volumes: ATen's op (eager)
        op = aten.grid_sampler_2d.default if rank == 4 else aten.grid_sampler_3d.default
        if rank not in (4, 5) or (rank == 5 and _GRID_MODES[mode] == 2):
            raise Unsupported(f"rank-{rank} input with mode {mode!r}")
        return g.call(op, x, grid, _GRID_MODES[mode], _GRID_PADDING[padding], align)
    nb, ch, h, wd = g.shape(x)
    _, ho, wo, _ = g.shape(grid)
    flat = g.call(aten.reshape.default, x, [nb, ch, h * wd])
    ix = _unnormalize(g, g.call(aten.select.int, grid, 3, 0), wd, align, padding)
    iy = _unnormalize(g, g.call(aten.select.int, grid, 3, 1), h, align, padding)
    ncq = [nb, ch, ho * wo]
    if _GRID_MODES[mode] == 1:  # nearest: round half to even, like ATen and onnxruntime
        ones = g.call(aten.ones_like.default, ix)
        y = _corner(
            g,
            flat,
            g.call(aten.round.default, ix),
            g.call(aten.round.default, iy),
            ones,
            (h, wd),
            ncq,
        )
    else:
        x0, y0 = g.call(aten.floor.default, ix), g.call(aten.floor.default, iy)
        x1, y1 = g.call(aten.add.Scalar, x0, 1), g.call(aten.add.Scalar, y0, 1)
        wx1, wy1 = g.call(aten.sub.Tensor, ix, x0), g.call(aten.sub.Tensor, iy, y0)
        wx0, wy0 = g.call(aten.rsub.Scalar, wx1, 1), g.call(aten.rsub.Scalar, wy1, 1)
        y = None
        for xi, yi, wa, wb in (
            (x0, y0, wx0, wy0),
            (x1, y0, wx1, wy0),
            (x0, y1, wx0, wy1),
            (x1, y1, wx1, wy1),
        ):
            term = _corner(g, flat, xi, yi, g.call(aten.mul.Tensor, wa, wb), (h, wd), ncq)
            y = term if y is None else g.call(aten.add.Tensor, y, term)
    return g.call(aten.reshape.default, y, [nb, ch, ho, wo])

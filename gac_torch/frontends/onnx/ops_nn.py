"""Neural-network ONNX ops: Conv/ConvTranspose, normalizations, pooling, Pad."""

from __future__ import annotations

import math

import numpy as np
import torch

from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.registry import OnnxNode, Unsupported, onnx_op

aten = torch.ops.aten


def _pads(
    n: OnnxNode, spatial: list[int], kernel: list[int], strides: list[int], dilations: list[int]
) -> tuple[list[int], list[int]]:
    """(begins, ends) per spatial dim, from `pads` or `auto_pad` (SAME_*: out = ceil(in/stride))."""
    k = len(spatial)
    auto = n.attr("auto_pad", "NOTSET")
    if auto == "NOTSET":
        p = list(n.attr("pads") or [0] * 2 * k)
        return p[:k], p[k:]
    if auto == "VALID":
        return [0] * k, [0] * k
    begins, ends = [], []
    for size, kk, st, d in zip(spatial, kernel, strides, dilations):
        total = max((-(-size // st) - 1) * st + (kk - 1) * d + 1 - size, 0)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return begins, ends


def _torch_pad(begins: list[int], ends: list[int]) -> list[int]:
    """ONNX (begins..., ends...) -> torch's pad list, last dim first."""
    return [p for b, e in zip(reversed(begins), reversed(ends)) for p in (b, e)]


def _window(n: OnnxNode, x: Value, g: GraphBuilder, kernel: list[int]):
    k = len(kernel)
    strides = list(n.attr("strides") or [1] * k)
    dilations = list(n.attr("dilations") or [1] * k)
    begins, ends = _pads(n, g.shape(x)[2:], kernel, strides, dilations)
    return strides, dilations, begins, ends


@onnx_op("Conv")
def conv(g: GraphBuilder, n: OnnxNode, x: Value, w: Value, b: Value | None = None) -> Value:
    kernel = g.shape(w)[2:]
    strides, dilations, begins, ends = _window(n, x, g, kernel)
    if begins != ends:  # asymmetric: pad explicitly, then convolve unpadded
        x = g.call(aten.constant_pad_nd.default, x, _torch_pad(begins, ends), 0.0)
        begins = [0] * len(kernel)
    return g.call(
        aten.convolution.default,
        x,
        w,
        b,
        strides,
        begins,
        dilations,
        False,
        [0] * len(kernel),
        n.attr("group", 1),
    )


@onnx_op("ConvTranspose")
def conv_transpose(
    g: GraphBuilder, n: OnnxNode, x: Value, w: Value, b: Value | None = None
) -> Value:
    kernel = g.shape(w)[2:]
    k = len(kernel)
    if n.attr("output_shape") is not None or n.attr("auto_pad", "NOTSET") != "NOTSET":
        raise Unsupported("output_shape / auto_pad")
    pads = list(n.attr("pads") or [0] * 2 * k)
    if pads[:k] != pads[k:]:
        raise Unsupported("asymmetric pads")
    return g.call(
        aten.convolution.default,
        x,
        w,
        b,
        list(n.attr("strides") or [1] * k),
        pads[:k],
        list(n.attr("dilations") or [1] * k),
        True,
        list(n.attr("output_padding") or [0] * k),
        n.attr("group", 1),
    )


# --- normalizations ---------------------------------------------------------------------------


@onnx_op("BatchNormalization")
def batch_norm(
    g: GraphBuilder, n: OnnxNode, x: Value, scale: Value, bias: Value, mean: Value, var: Value
) -> Value:
    if n.attr("training_mode", 0):
        raise Unsupported("training_mode=1")
    out = g.call(
        aten._native_batch_norm_legit_no_training.default,
        x,
        scale,
        bias,
        mean,
        var,
        n.attr("momentum", 0.9),
        n.attr("epsilon", 1e-5),
    )
    return out[0]


def _channel(g: GraphBuilder, v: Value, rank: int) -> Value:
    """A per-channel (C,) vector shaped to broadcast against (N, C, ...)."""
    return g.call(aten.reshape.default, v, [-1] + [1] * (rank - 2))


def _normalize(g: GraphBuilder, x: Value, dims: list[int], eps: float) -> Value:
    mean = g.call(aten.mean.dim, x, dims, True)
    var = g.call(aten.var.correction, x, dims, correction=0, keepdim=True)
    return g.call(
        aten.mul.Tensor,
        g.call(aten.sub.Tensor, x, mean),
        g.call(aten.rsqrt.default, g.call(aten.add.Scalar, var, eps)),
    )


@onnx_op("InstanceNormalization")
def instance_norm(g: GraphBuilder, n: OnnxNode, x: Value, scale: Value, bias: Value) -> Value:
    r = g.rank(x)
    y = _normalize(g, x, list(range(2, r)), n.attr("epsilon", 1e-5))
    return g.call(
        aten.add.Tensor, g.call(aten.mul.Tensor, y, _channel(g, scale, r)), _channel(g, bias, r)
    )


@onnx_op("GroupNormalization")
def group_norm(g: GraphBuilder, n: OnnxNode, x: Value, scale: Value, bias: Value) -> Value:
    shape, groups = g.shape(x), n.attr("num_groups")
    y = g.call(aten.reshape.default, x, [shape[0], groups, -1])
    y = g.call(aten.reshape.default, _normalize(g, y, [2], n.attr("epsilon", 1e-5)), shape)
    if n.opset < 21:  # opset 18: scale and bias are per group, not per channel
        per = shape[1] // groups
        scale, bias = (
            g.call(
                aten.reshape.default,
                g.call(
                    aten.expand.default, g.call(aten.reshape.default, v, [groups, 1]), [groups, per]
                ),
                [shape[1]],
            )
            for v in (scale, bias)
        )
    r = len(shape)
    return g.call(
        aten.add.Tensor, g.call(aten.mul.Tensor, y, _channel(g, scale, r)), _channel(g, bias, r)
    )


@onnx_op("LayerNormalization")
def layer_norm(
    g: GraphBuilder, n: OnnxNode, x: Value, scale: Value, bias: Value | None = None
) -> list[Value]:
    shape = g.shape(x)
    axis = n.attr("axis", -1) % len(shape)
    norm = shape[axis:]
    if g.shape(scale) != norm:  # ONNX allows a broadcastable scale/bias; ATen wants norm's shape
        scale = g.call(aten.expand.default, scale, norm)
    if bias is not None and g.shape(bias) != norm:
        bias = g.call(aten.expand.default, bias, norm)
    return list(
        g.call(aten.native_layer_norm.default, x, norm, scale, bias, n.attr("epsilon", 1e-5))
    )


# --- pooling ----------------------------------------------------------------------------------


def _pool_args(n: OnnxNode, g: GraphBuilder, x: Value, pad_value: float | None):
    kernel = list(n.attr("kernel_shape"))
    strides, dilations, begins, ends = _window(n, x, g, kernel)
    too_big = any(2 * p > k for p, k in zip(begins, kernel))  # ATen pools limit pad to k/2
    if begins != ends or too_big:
        if pad_value is None:
            raise Unsupported("asymmetric or large pads with count_include_pad=0")
        x = g.call(aten.constant_pad_nd.default, x, _torch_pad(begins, ends), pad_value)
        begins = [0] * len(kernel)
    if len(kernel) > 2:
        raise Unsupported(f"{len(kernel)}-D pooling")
    squeeze = len(kernel) == 1  # 1-D pooling runs as 2-D over (1, L)
    if squeeze:
        x = g.call(aten.unsqueeze.default, x, 2)
        kernel, strides, dilations, begins = ([1] + v for v in (kernel, strides, dilations, begins))
    return x, squeeze, kernel, strides, dilations, begins


@onnx_op("MaxPool")
def max_pool(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    if n.attr("storage_order", 0):
        raise Unsupported("storage_order=1")
    x, squeeze, k, s, d, p = _pool_args(n, g, x, -math.inf)
    y = g.call(aten.max_pool2d_with_indices.default, x, k, s, p, d, bool(n.attr("ceil_mode", 0)))[0]
    return g.call(aten.squeeze.dim, y, 2) if squeeze else y


@onnx_op("AveragePool")
def avg_pool(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    if any(d != 1 for d in n.attr("dilations") or []):
        raise Unsupported("dilations")
    include = bool(n.attr("count_include_pad", 0))
    x, squeeze, k, s, _, p = _pool_args(n, g, x, 0.0 if include else None)
    y = g.call(aten.avg_pool2d.default, x, k, s, p, bool(n.attr("ceil_mode", 0)), include)
    return g.call(aten.squeeze.dim, y, 2) if squeeze else y


@onnx_op("GlobalAveragePool", "GlobalMaxPool")
def global_pool(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    dims = list(range(2, g.rank(x)))
    op = aten.mean.dim if n.op_type == "GlobalAveragePool" else aten.amax.default
    return g.call(op, x, dims, True)


# --- padding ----------------------------------------------------------------------------------


def _pad_indices(mode: str, size: int, begin: int, end: int) -> np.ndarray:
    """Source index of every output position along one axis, for the non-constant modes."""
    i = np.arange(-begin, size + end)
    if mode == "edge":
        return np.clip(i, 0, size - 1)
    if mode == "wrap":
        return np.mod(i, size)
    period = max(2 * (size - 1), 1)  # reflect: mirror about the first and last elements
    m = np.mod(i, period)
    return np.where(m >= size, period - m, m)


@onnx_op("Pad")
def pad(
    g: GraphBuilder,
    n: OnnxNode,
    x: Value,
    pads: Value,
    value: Value | None = None,
    axes: Value | None = None,
) -> Value:
    rank = g.rank(x)
    p = g.ints(pads, "Pad pads") or []
    ax = (
        [a % rank for a in g.ints(axes, "Pad axes") or []]
        if axes is not None
        else list(range(rank))
    )
    begins, ends = [0] * rank, [0] * rank
    for i, a in enumerate(ax):
        begins[a], ends[a] = p[i], p[i + len(ax)]
    mode = n.only("mode", "constant", "reflect", "edge", "wrap", default="constant")
    if mode == "constant":
        fill = 0 if value is None else g.scalar(value, "Pad constant_value")
        return g.call(aten.constant_pad_nd.default, x, _torch_pad(begins, ends), fill)
    for a in range(rank):  # other modes gather static indices, one axis at a time
        if begins[a] or ends[a]:
            idx = _pad_indices(mode, g.shape(x)[a], begins[a], ends[a])
            x = g.call(aten.index_select.default, x, a, torch.from_numpy(idx))
    return x

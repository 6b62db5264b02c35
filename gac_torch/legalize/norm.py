"""Normalizations: layer, group and batch norm (inference and training statistics).

Statistics are computed in f32 for f16/bf16 inputs (f64 for f64), and the affine transform is
applied before the single rounding to the output dtype, as ATen's CPU kernels do.
"""

from __future__ import annotations

import math
import operator

import torch
from mlir import ir

from gac_torch.legalize.context import Cx, meta_val
from gac_torch.legalize.registry import FLOATS, aten, lower


def _outs(cx: Cx) -> list[torch.Tensor]:
    return list(meta_val(cx.node))


def _acc(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


def _shaped(cx: Cx, v: ir.Value, meta: torch.Tensor) -> ir.Value:
    """v reshaped and cast to what ATen returns for this output (may be an empty tensor)."""
    if all(isinstance(s, int) for s in meta.shape) and meta.numel() == 0:
        return cx.b.constant(0, meta.dtype, tuple(meta.shape))
    return cx.to(cx.b.reshape(v, cx.dims(meta.shape)), meta.dtype)


_REDUCED = (torch.float16, torch.bfloat16)


def eager_layer_norm_stat_dtypes(gm: torch.fx.GraphModule) -> None:
    """ATen's CPU layer norm of an f16/bf16 input with f32 weight or bias (autocast: a bf16
    Linear into an f32 LayerNorm) returns f32 mean/rstd, and its backward requires them; torch's
    fake kernel says the input dtype. Set the node's metadata to eager's dtypes, which the
    lowering then produces (a compiled forward's bf16 statistics crashed the eager backward)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target != aten.native_layer_norm.default:
            continue
        x, w, b = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in n.args[:1] + n.args[2:4])
        outs = n.meta.get("val")
        if (not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype not in _REDUCED
                or not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in (w, b))
                or not isinstance(outs, (tuple, list)) or outs[1].dtype == torch.float32):
            continue
        stats = [t.new_empty(t.shape, dtype=torch.float32) for t in outs[1:]]
        n.meta["val"] = (outs[0], *stats)
        for u in n.users:
            if u.target is operator.getitem and u.args[1] in (1, 2):
                u.meta["val"] = stats[u.args[1] - 1]


@lower(aten.native_layer_norm.default, dtypes=FLOATS, dynamic=True)
def lower_native_layer_norm(cx: Cx, x, normalized_shape, weight, bias, eps):
    outs = _outs(cx)
    dt = outs[0].dtype
    # gac.layer_norm types its statistics like x; ATen's CUDA kernel returns f32 ones for f16/bf16
    # input (its CPU kernel the input dtype): then normalize in f32 so they are not rounded first.
    ct = outs[1].dtype if outs[1].dtype.itemsize > dt.itemsize else dt
    shape = list(normalized_shape)
    w = cx.to(weight if weight is not None else 1.0, ct)
    b = cx.to(bias if bias is not None else 0.0, ct)
    w = cx.b.broadcast(w, shape=shape) if cx.shape(w) != shape else w
    b = cx.b.broadcast(b, shape=shape) if cx.shape(b) != shape else b
    y, mean, rstd = cx.b.layer_norm(cx.to(x, ct), w, b, normalized_rank=len(shape), eps=float(eps))
    return cx.to(y, dt), _shaped(cx, mean, outs[1]), _shaped(cx, rstd, outs[2])


@lower(aten.native_group_norm.default, dtypes=FLOATS)
def lower_native_group_norm(cx: Cx, x, weight, bias, n, c, hw, group, eps):
    """Normalize (N, G, C/G * HxW) over its last dim, then the per-channel affine."""
    outs = _outs(cx)
    dt, acc = outs[0].dtype, _acc(outs[0].dtype)
    shape = cx.shape(x)
    d = (c // group) * hw
    xg = cx.b.reshape(cx.to(x, acc), [n, group, d])
    ones, zeros = (cx.b.broadcast(cx.to(v, acc), shape=[d]) for v in (1.0, 0.0))
    y, mean, rstd = cx.b.layer_norm(xg, ones, zeros, normalized_rank=1, eps=float(eps))
    y = _affine(cx, cx.b.reshape(y, shape), weight, bias, acc)
    return cx.to(y, dt), _shaped(cx, mean, outs[1]), _shaped(cx, rstd, outs[2])


def _channel(cx: Cx, v, acc, rank: int) -> ir.Value:
    """A per-channel (C,) vector shaped to broadcast over (N, C, *spatial)."""
    v = cx.to(v, acc)
    return cx.b.reshape(v, [cx.shape(v)[0]] + [1] * (rank - 2))


def _affine(cx: Cx, y, weight, bias, acc):
    rank = len(cx.shape(y))
    if weight is not None:
        y = cx.b.binary(y, _channel(cx, weight, acc, rank), kind="mul")
    if bias is not None:
        y = cx.b.binary(y, _channel(cx, bias, acc, rank), kind="add")
    return y


def _normalize(cx: Cx, x, mean, rstd, weight, bias, acc) -> ir.Value:
    """(x - mean) * rstd * w + b with (C,) statistics."""
    rank = len(cx.shape(x))
    y = cx.b.binary(cx.b.binary(cx.to(x, acc), _channel(cx, mean, acc, rank), kind="sub"),
                    _channel(cx, rstd, acc, rank), kind="mul")
    return _affine(cx, y, weight, bias, acc)


def _batch_stats(cx: Cx, x, acc) -> tuple[ir.Value, ir.Value, int]:
    """Per-channel mean and biased variance over (N, *spatial), and the count."""
    shape = cx.shape(x)
    dims = [0] + list(range(2, len(shape)))
    count = math.prod(shape[d] for d in dims)
    xf = cx.to(x, acc)
    mean = cx.b.binary(cx.b.reduce(xf, kind="sum", dims=dims, keepdim=True), cx.to(float(count), acc), kind="div")
    cent = cx.b.binary(xf, mean, kind="sub")
    var = cx.b.binary(cx.b.reduce(cx.b.binary(cent, cent, kind="mul"), kind="sum", dims=dims, keepdim=False),
                      cx.to(float(count), acc), kind="div")
    return cx.b.reshape(mean, [shape[1]]), var, count


def _rstd(cx: Cx, var, eps, acc) -> ir.Value:
    return cx.b.unary(cx.b.binary(var, cx.to(float(eps), acc), kind="add"), kind="rsqrt")


def _train(cx: Cx, x, weight, bias, eps):
    outs = _outs(cx)
    acc = _acc(outs[0].dtype)
    mean, var, count = _batch_stats(cx, x, acc)
    rstd = _rstd(cx, var, eps, acc)
    y = cx.to(_normalize(cx, x, mean, rstd, weight, bias, acc), outs[0].dtype)
    return y, mean, var, rstd, count, outs


def _infer(cx: Cx, x, weight, bias, running_mean, running_var, eps):
    outs = _outs(cx)
    acc = _acc(outs[0].dtype)
    rstd = _rstd(cx, cx.to(running_var, acc), eps, acc)
    y = cx.to(_normalize(cx, x, running_mean, rstd, weight, bias, acc), outs[0].dtype)
    return y, outs


def _eval_stats(cx: Cx, running_mean, running_var, eps, outs):
    """The saved mean / inverse std of an eval-mode batch norm: empty on the CPU, the running
    statistics (C,) on CUDA; never the normalized output."""
    acc = _acc(outs[0].dtype)
    rstd = _rstd(cx, cx.to(running_var, acc), eps, acc)
    return _shaped(cx, cx.to(running_mean, acc), outs[1]), _shaped(cx, rstd, outs[2])


def _mutates_stats(training_pos: int, stats_pos: int):
    """The non-functional overloads update running stats in place when training: a functional
    graph never contains those (functionalization rewrites them), so refuse them."""
    def check(node) -> str | None:
        """running statistics updated in place (training)"""
        training = node.args[training_pos] if len(node.args) > training_pos else False
        if training and node.args[stats_pos] is not None:
            return "batch norm updating running statistics in place"
        return None
    return check


@lower(aten._native_batch_norm_legit_no_training.default, dtypes=FLOATS, dynamic=True)
def lower_batch_norm_inference(cx: Cx, x, weight, bias, running_mean, running_var, momentum, eps):
    y, outs = _infer(cx, x, weight, bias, running_mean, running_var, eps)
    return y, *_eval_stats(cx, running_mean, running_var, eps, outs)


@lower(aten.native_batch_norm.default, check=_mutates_stats(5, 3), dtypes=FLOATS)
def lower_native_batch_norm(cx: Cx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        y, outs = _infer(cx, x, weight, bias, running_mean, running_var, eps)
        return y, *_eval_stats(cx, running_mean, running_var, eps, outs)
    y, mean, _, rstd, _, outs = _train(cx, x, weight, bias, eps)
    return y, _shaped(cx, mean, outs[1]), _shaped(cx, rstd, outs[2])


@lower(aten._native_batch_norm_legit.no_stats, dtypes=FLOATS)
def lower_batch_norm_no_stats(cx: Cx, x, weight, bias, training, momentum, eps):
    y, mean, _, rstd, _, outs = _train(cx, x, weight, bias, eps)
    return y, _shaped(cx, mean, outs[1]), _shaped(cx, rstd, outs[2])


@lower(aten._native_batch_norm_legit.default, check=_mutates_stats(5, 3), dtypes=FLOATS)
def lower_batch_norm_legit(cx: Cx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        return lower_batch_norm_no_stats(cx, x, weight, bias, training, momentum, eps)
    y, outs = _infer(cx, x, weight, bias, running_mean, running_var, eps)
    return y, *_eval_stats(cx, running_mean, running_var, eps, outs)


@lower(aten._native_batch_norm_legit_functional.default, dtypes=FLOATS)
def lower_batch_norm_functional(cx: Cx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Also returns the updated running stats: (1 - m) * old + m * batch (unbiased variance)."""
    if not training:
        y, outs = _infer(cx, x, weight, bias, running_mean, running_var, eps)
        return (y, *_eval_stats(cx, running_mean, running_var, eps, outs),
                cx.to(running_mean, outs[3].dtype), cx.to(running_var, outs[4].dtype))
    y, mean, var, rstd, count, outs = _train(cx, x, weight, bias, eps)
    acc = _acc(outs[0].dtype)

    def blend(old, new, dtype):
        keep = cx.b.binary(cx.to(old, acc), cx.to(1.0 - float(momentum), acc), kind="mul")
        return cx.to(cx.b.binary(keep, cx.b.binary(new, cx.to(float(momentum), acc), kind="mul"), kind="add"),
                     dtype)

    unbiased = cx.b.binary(var, cx.to(count / max(count - 1, 1), acc), kind="mul")
    return (y, _shaped(cx, mean, outs[1]), _shaped(cx, rstd, outs[2]),
            blend(running_mean, mean, outs[3].dtype), blend(running_var, unbiased, outs[4].dtype))

"""Reductions and normalizations over dims."""

from __future__ import annotations

from mlir import ir

from gac_torch.ir.dialect import define
from gac_torch.ir.ops._infer import GacTypeError, norm_dim, shape_of, tensor

REDUCE_KINDS = ("sum", "prod", "max", "min", "any", "all")


def _reduced_shape(shape, dims, keepdim):
    return tuple(1 if i in dims else s for i, s in enumerate(shape) if keepdim or i not in dims)


def _infer_reduce(types, attrs):
    (x,) = types
    shape = shape_of(x)
    dims = {norm_dim(d, len(shape), "gac.reduce") for d in attrs["dims"]}
    elem = ir.RankedTensorType(x).element_type
    if attrs["kind"] in ("any", "all"):
        elem = ir.IntegerType.get_signless(1)
    return [tensor(_reduced_shape(shape, dims, attrs["keepdim"]), elem)]


def _infer_arg_reduce(types, attrs):
    (x,) = types
    shape = shape_of(x)
    dim = norm_dim(attrs["dim"], len(shape), "gac.arg_reduce")
    return [tensor(_reduced_shape(shape, {dim}, attrs["keepdim"]), ir.IntegerType.get_signless(64))]


def _infer_softmax(types, attrs):
    (x,) = types
    norm_dim(attrs["dim"], len(shape_of(x)), "gac.softmax")
    return [x]


def _infer_layer_norm(types, attrs):
    x, w, b = types
    shape = shape_of(x)
    k = attrs["normalized_rank"]
    if not 0 < k <= len(shape) or shape_of(w) != shape[len(shape) - k:] or shape_of(b) != shape_of(w):
        raise GacTypeError(f"gac.layer_norm: weight/bias {shape_of(w)}, {shape_of(b)} do not match "
                           f"the last {k} dims of {shape}")
    stat = tensor(shape[: len(shape) - k] + (1,) * k, ir.RankedTensorType(x).element_type)
    return [x, stat, stat]


define("reduce", ["x"], attrs={"kind": REDUCE_KINDS, "dims": "ints", "keepdim": "int"},
       infer=_infer_reduce, doc="reduce over dims; floats accumulate in f32 or wider")
define("arg_reduce", ["x"], attrs={"kind": ("max", "min"), "dim": "int", "keepdim": "int"},
       infer=_infer_arg_reduce, doc="index (i64) of the first max/min along dim")
define("softmax", ["x"], attrs={"dim": "int", "log": "int"}, infer=_infer_softmax,
       doc="softmax or log_softmax along dim, computed stably (max subtracted)")
define("layer_norm", ["x", "weight", "bias"], results=("y", "mean", "rstd"),
       attrs={"normalized_rank": "int", "eps": "float"}, infer=_infer_layer_norm,
       doc="normalize over the last normalized_rank dims; mean/rstd keep dims")


SCAN_KINDS = ("sum", "prod", "max", "min", "logaddexp")


def _infer_scan(types, attrs):
    (x,) = types
    norm_dim(attrs["dim"], len(shape_of(x)), "gac.scan")
    return [x]


def _infer_sort(types, attrs):
    (x,) = types
    shape = list(shape_of(x))
    dim = norm_dim(attrs["dim"], len(shape), "gac.sort")
    k = attrs["k"]
    if shape and not 0 <= k <= shape[dim]:
        raise GacTypeError(f"gac.sort: k={k} out of range for a dim of {shape[dim]}")
    if shape:
        shape[dim] = k
    return [tensor(shape, ir.RankedTensorType(x).element_type),
            tensor(shape, ir.IntegerType.get_signless(64))]


define("scan", ["x"], attrs={"kind": SCAN_KINDS, "dim": "int"}, infer=_infer_scan,
       doc="inclusive prefix reduction along dim (cumsum, cumprod, ...); floats accumulate in f32 "
           "or wider")
define("sort", ["x"], results=("values", "indices"),
       attrs={"dim": "int", "descending": "int", "k": "int"}, infer=_infer_sort,
       doc="the first k elements of a stable sort along dim, and their source indices; NaN sorts "
           "as the largest value (torch.sort / torch.topk)")

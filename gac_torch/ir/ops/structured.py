"""Contractions and windowed ops: matmul, conv, pool."""

from __future__ import annotations

from mlir import ir

from gac_torch.ir.dialect import define
from gac_torch.ir.ops._infer import GacTypeError, dims_match, same_elem, shape_of, tensor


def _check_matmul(types, attrs, results):
    """The result is (..., M, N) in the operands' element type, or f32 for f16/bf16 operands
    (the unrounded accumulator, for epilogues that must round once)."""
    a, b = map(shape_of, types)
    elem = same_elem(types, "gac.matmul")
    if len(a) < 2 or len(a) != len(b) or not all(map(dims_match, a[:-2] + a[-1:], b[:-2] + b[-2:-1])):
        raise GacTypeError(f"gac.matmul: cannot multiply {list(a)} by {list(b)} "
                           "(needs (..., M, K) x (..., K, N) with equal batch dims)")
    out = results[0]
    if not all(map(dims_match, shape_of(out), a[:-1] + (b[-1],))) or len(shape_of(out)) != len(a):
        raise GacTypeError(f"gac.matmul: result shape {list(shape_of(out))} != {list(a[:-1] + (b[-1],))}")
    if not _wide_ok(elem, out):
        raise GacTypeError(f"gac.matmul: result element type {ir.RankedTensorType(out).element_type} "
                           f"for {elem} operands")


def window_out(size, k, s, p_lo, p_hi, d, ceil_mode=False) -> int:
    span = size + p_lo + p_hi - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    # torch: with ceil_mode the last window must start inside the input or the left padding
    if ceil_mode and (out - 1) * s >= size + p_lo:
        out -= 1
    return out


def _wide_ok(elem, out) -> bool:
    """A contraction's result element type: the operands', or f32 for f16/bf16 operands."""
    res = str(ir.RankedTensorType(out).element_type)
    return res == str(elem) or (str(elem) in ("f16", "bf16") and res == "f32")


def _check_conv(types, attrs, results):
    inferred = _infer_conv(types, attrs)[0]
    if shape_of(results[0]) != shape_of(inferred) or not _wide_ok(inferred.element_type, results[0]):
        raise GacTypeError(f"gac.conv: result {results[0]} for operands {[str(t) for t in types]}")


def _infer_conv(types, attrs):
    x, w = map(shape_of, types)
    elem = same_elem(types, "gac.conv")
    nsp = len(x) - 2
    last = bool(attrs["channels_last"])
    if last:  # N<spatial>C: checked as NC<spatial>
        x = (x[0], x[-1], *x[1:-1])
    g = attrs["groups"]
    if len(w) != len(x) or nsp < 1 or x[1] != w[1] * g or w[0] % g:
        raise GacTypeError(f"gac.conv: input {list(x)} and weight {list(w)} do not match (groups={g})")
    for key in ("stride", "padding", "dilation"):
        if len(attrs[key]) != nsp:
            raise GacTypeError(f"gac.conv: {key} needs {nsp} values")
    spatial = [window_out(x[2 + i], w[2 + i], attrs["stride"][i], attrs["padding"][i],
                          attrs["padding"][i], attrs["dilation"][i]) for i in range(nsp)]
    if min(spatial) < 1:
        raise GacTypeError(f"gac.conv: empty output {spatial}")
    return [tensor((x[0], *spatial, w[0]) if last else (x[0], w[0], *spatial), elem)]


def _infer_pool(types, attrs):
    (x,) = types
    shape = shape_of(x)
    nsp = len(attrs["kernel"])
    last = int(bool(attrs["channels_last"]))  # the window dims end one before the last
    if len(shape) < nsp + 1 + last:
        raise GacTypeError(f"gac.pool: rank {len(shape)} too small for a {nsp}-d window")
    at = len(shape) - nsp - last
    spatial = [window_out(shape[at + i], attrs["kernel"][i], attrs["stride"][i],
                          attrs["padding"][i], attrs["padding"][i], attrs["dilation"][i],
                          bool(attrs["ceil_mode"])) for i in range(nsp)]
    return [tensor(shape[:at] + tuple(spatial) + shape[at + nsp:], types[0].element_type)]


define("matmul", ["lhs", "rhs"], check=_check_matmul,
       doc="(..., M, K) @ (..., K, N); floats accumulate in f32 or wider; the result is in the "
           "operand type, or the f32 accumulator itself for f16/bf16")
define("conv", ["x", "weight"],
       attrs={"stride": "ints", "padding": "ints", "dilation": "ints", "groups": "int",
              "channels_last": "int"},
       check=_check_conv,
       doc="N-d cross-correlation, NC<spatial> x FC<spatial> (channels_last: N<spatial>C x "
           "FC<spatial> -> N<spatial>F), symmetric padding; the result is in the operand type, or "
           "the f32 accumulator itself for f16/bf16")
define("pool", ["x"],
       attrs={"kind": ("max", "avg"), "kernel": "ints", "stride": "ints", "padding": "ints",
              "dilation": "ints", "ceil_mode": "int", "count_include_pad": "int", "divisor": "int",
              "channels_last": "int"},
       infer=_infer_pool,
       doc="window max/avg over the trailing len(kernel) dims (channels_last: the len(kernel) "
           "dims before the last); divisor 0 = by window count")

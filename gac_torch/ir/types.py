"""torch dtype <-> MLIR element type, and tensor type helpers.

Integers are signless in MLIR; gac treats every integer type as signed (as ATen does for
int8..int64). uint8 has no signed reading and is therefore not supported (it falls back).
"""

from __future__ import annotations

import torch
from mlir import ir
from gac_torch.errors import GacUnsupportedError

_FLOATS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
_INTS = {torch.bool: 1, torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}
SUPPORTED_DTYPES = frozenset(_FLOATS) | frozenset(_INTS)


class UnsupportedDtype(GacUnsupportedError, TypeError):
    pass


def element_type(dtype: torch.dtype) -> ir.Type:
    """MLIR element type for a torch dtype (needs an active context)."""
    if dtype in _FLOATS:
        return {
            "f32": ir.F32Type.get, "f16": ir.F16Type.get,
            "bf16": ir.BF16Type.get, "f64": ir.F64Type.get,
        }[_FLOATS[dtype]]()
    if dtype in _INTS:
        return ir.IntegerType.get_signless(_INTS[dtype])
    raise UnsupportedDtype(f"dtype {dtype} is not supported by gac")


def torch_dtype(t: ir.Type) -> torch.dtype:
    s = str(t)
    for dt, name in _FLOATS.items():
        if s == name:
            return dt
    for dt, width in _INTS.items():
        if s == f"i{width}":
            return dt
    raise UnsupportedDtype(f"MLIR element type {s} has no torch dtype")


# A size known only at run time: `?` in a tensor type. Shape tuples read back from types hold it
# as this int; shapes handed to the builder may hold anything non-int (an SSA index value, a
# torch.SymInt) in its place.
DYN = -9223372036854775808  # == ir.ShapedType.get_dynamic_size()


def static_dim(s) -> int:
    """The type-level size: the int itself, DYN for a size known only at run time."""
    if isinstance(s, bool):
        return int(s)
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        return int(expr) if expr.is_number else DYN
    return DYN


def tensor_type(shape, dtype: torch.dtype | ir.Type) -> ir.RankedTensorType:
    elem = dtype if isinstance(dtype, ir.Type) else element_type(dtype)
    return ir.RankedTensorType.get([static_dim(s) for s in shape], elem)


def shape_of(v: ir.Value | ir.Type) -> tuple[int, ...]:
    t = v.type if isinstance(v, ir.Value) else v
    return tuple(ir.RankedTensorType(t).shape)


def elem_of(v: ir.Value | ir.Type) -> ir.Type:
    t = v.type if isinstance(v, ir.Value) else v
    return ir.RankedTensorType(t).element_type


def is_float(t: ir.Type) -> bool:
    if isinstance(t, (ir.F32Type, ir.F16Type, ir.BF16Type, ir.F64Type)):
        return True
    return not isinstance(t, (ir.IntegerType, ir.IndexType)) and str(t) in ("f32", "f16", "bf16", "f64")


def is_bool(t: ir.Type) -> bool:
    if isinstance(t, ir.IntegerType):  # (the usual case: no printing)
        return t.width == 1 and t.is_signless
    return not isinstance(t, (ir.FloatType, ir.IndexType)) and str(t) == "i1"

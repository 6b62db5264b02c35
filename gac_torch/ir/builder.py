"""Emitting gac ops from Python: attributes encoded, result types inferred and checked."""

from __future__ import annotations

from typing import Sequence

import numpy as np

import torch
from mlir import ir

from gac_torch.ir.dialect import OPS
from gac_torch.ir.ops._infer import GacTypeError
from gac_torch.ir.types import DYN, element_type, tensor_type


def split_sizes(shape: Sequence) -> tuple[list[int], list[ir.Value]]:
    """A shape of ints and run-time sizes (index Values) -> the type-level shape (DYN for each
    Value) and the Values in order: what reshape/broadcast take as attribute/type and operands."""
    static, dynamic = [], []
    for s in shape:
        if isinstance(s, ir.Value):
            static.append(DYN)
            dynamic.append(s)
        else:
            static.append(int(s))
    return static, dynamic


def encode_attr(value) -> ir.Attribute:
    if isinstance(value, ir.Attribute):
        return value
    if isinstance(value, str):
        return ir.StringAttr.get(value)
    if isinstance(value, bool):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), int(value))
    if isinstance(value, int):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
    if isinstance(value, float):
        return ir.FloatAttr.get(ir.F64Type.get(), value)
    if isinstance(value, (list, tuple)):
        return ir.DenseI64ArrayAttr.get([int(v) for v in value])
    raise TypeError(f"cannot encode {value!r} as a gac attribute")


def decode_attr(attr: ir.Attribute):
    if isinstance(attr, (ir.StringAttr, ir.IntegerAttr, ir.FloatAttr)):
        return attr.value
    if isinstance(attr, ir.DenseI64ArrayAttr):
        return [int(v) for v in attr]
    return attr  # constants keep their DenseElementsAttr


def op_attrs(op: ir.Operation | ir.OpView) -> dict:
    op = op.operation
    attrs = op.attributes
    return {name: decode_attr(attrs[name]) for name in attrs}


def infer_result_types(name: str, operand_types: list[ir.Type], attrs: dict,
                       given: Sequence[ir.Type] | None) -> list[ir.Type]:
    d = OPS[name]
    if d.infer is not None:
        inferred = d.infer(operand_types, attrs)
        # (types are uniqued in their context: equal exactly when printed alike; none printed)
        if given is not None and (len(given) != len(inferred) or any(a != b for a, b in zip(given, inferred))):
            raise GacTypeError(f"gac.{name}: result types {[str(t) for t in given]} != "
                               f"inferred {[str(t) for t in inferred]}")
        return inferred
    if given is None:
        raise GacTypeError(f"gac.{name} needs its result types")
    if d.check is not None:
        d.check(operand_types, attrs, list(given))
    return list(given)


class GacBuilder:
    """Emits gac ops at the current insertion point. `b.binary("add", x, y)` returns a Value."""

    def emit(self, name: str, operands: Sequence[ir.Value], attrs: dict | None = None,
             result_types: Sequence[ir.Type] | None = None) -> ir.Operation:
        attrs = dict(attrs or {})
        d = OPS[name]
        missing = set(d.attrs) - set(attrs)
        if missing:
            raise GacTypeError(f"gac.{name}: missing attributes {sorted(missing)}")
        types = [v.type for v in operands]
        py_attrs = {k: decode_attr(encode_attr(v)) for k, v in attrs.items()}
        results = infer_result_types(name, types, py_attrs, result_types)
        return ir.Operation.create(f"gac.{name}", results=results, operands=list(operands),
                                   attributes={k: encode_attr(v) for k, v in attrs.items()})

    def __getattr__(self, name: str):
        if name not in OPS:
            raise AttributeError(name)

        def build(*operands, result_type=None, **attrs):
            op = self.emit(name, operands, attrs, None if result_type is None else [result_type])
            return op.results[0] if len(op.results) == 1 else tuple(op.results)

        return build

    # Conveniences whose result type is not inferable from operands.
    def cast(self, x: ir.Value, dtype: torch.dtype | ir.Type) -> ir.Value:
        elem = dtype if isinstance(dtype, ir.Type) else element_type(dtype)
        if str(ir.RankedTensorType(x.type).element_type) == str(elem):
            return x
        t = ir.RankedTensorType.get(list(ir.RankedTensorType(x.type).shape), elem)
        return self.emit("cast", [x], {}, [t]).results[0]

    def reshape(self, x: ir.Value, shape: Sequence) -> ir.Value:
        """Row-major reshape; `shape` may hold run-time sizes (index Values)."""
        t = ir.RankedTensorType(x.type)
        static, sizes = split_sizes(shape)
        if not sizes and list(t.shape) == static:
            return x
        return self.emit("reshape", [x, *sizes], {}, [ir.RankedTensorType.get(static, t.element_type)]).results[0]

    def broadcast(self, x: ir.Value, shape: Sequence) -> ir.Value:
        """torch.expand; `shape` may hold run-time sizes (index Values)."""
        static, sizes = split_sizes(shape)
        return self.emit("broadcast", [x, *sizes], {"shape": static}).results[0]

    def dim(self, x: ir.Value, dim: int) -> ir.Value:
        return self.emit("dim", [x], {"dim": dim}).results[0]

    def constant(self, value, dtype: torch.dtype, shape: Sequence[int] = ()) -> ir.Value:
        """A splat constant (python scalar) or a small tensor of values."""
        t = tensor_type(shape, dtype)
        if isinstance(value, torch.Tensor):
            # numpy has no bfloat16: build those in f32 and cast.
            if dtype == torch.bfloat16:
                return self.cast(self.constant(value.float(), torch.float32, shape), dtype)
            arr = np.ascontiguousarray(value.detach().cpu().to(dtype).reshape(list(shape)).numpy())
            attr = ir.DenseElementsAttr.get(arr, type=t.element_type)
        else:
            elem = t.element_type
            if dtype.is_floating_point:
                scalar = ir.FloatAttr.get(elem, float(value))
            elif dtype == torch.bool:
                scalar = ir.IntegerAttr.get(elem, int(bool(value)))
            else:
                scalar = ir.IntegerAttr.get(elem, int(value))
            attr = ir.DenseElementsAttr.get_splat(t, scalar)
        return self.emit("constant", [], {"value": attr}, [t]).results[0]

    def iota(self, shape: Sequence, dim: int, dtype: torch.dtype) -> ir.Value:
        static, sizes = split_sizes(shape)
        return self.emit("iota", sizes, {"dim": dim}, [tensor_type(static, dtype)]).results[0]

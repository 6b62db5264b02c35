"""The ONNX op table: ONNX op type -> one small function that emits ATen calls.

This is an *import* table, not a second gac op table: every function below only calls ATen ops
through the GraphBuilder, and the ATen registry (gac_torch.legalize) decides what gac compiles.

    @onnx_op("Relu")
    def relu(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
        return g.call(aten.relu.default, x)

A function receives the node's inputs in order (None for an omitted optional input) and returns
one value or a tuple (one per ONNX output). It raises Unsupported for attribute combinations it
does not map; the importer then treats the node like an unknown op (onnxruntime fallback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import helper, numpy_helper
from gac_torch.errors import GacUnsupportedError

OpFn = Callable[..., Any]
OPS: dict[str, OpFn] = {}  # op type in the default ONNX domain -> function
DEFAULT_DOMAINS = ("", "ai.onnx")


class Unsupported(GacUnsupportedError):
    """This node (op, attributes or non-static input) has no ATen mapping; the message says why."""


def onnx_op(*op_types: str) -> Callable[[OpFn], OpFn]:
    def register(fn: OpFn) -> OpFn:
        for t in op_types:
            if t in OPS:
                raise ValueError(f"ONNX op {t} is registered twice")
            OPS[t] = fn
        return fn

    return register


def lookup(op_type: str, domain: str) -> OpFn | None:
    return OPS.get(op_type) if domain in DEFAULT_DOMAINS else None


def supported_ops() -> list[str]:
    return sorted(OPS)


@dataclass
class OnnxNode:
    """A NodeProto with decoded attributes and the model's opset for its domain."""

    proto: onnx.NodeProto
    opset: int
    attrs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, proto: onnx.NodeProto, opset: int) -> OnnxNode:
        attrs = {}
        for a in proto.attribute:
            v = helper.get_attribute_value(a)
            if a.type == onnx.AttributeProto.TENSOR:
                v = numpy_helper.to_array(v)
            elif isinstance(v, bytes):
                v = v.decode()
            elif a.type == onnx.AttributeProto.STRINGS:
                v = [s.decode() for s in v]
            attrs[a.name] = v
        return cls(proto, opset, attrs)

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    @property
    def domain(self) -> str:
        return self.proto.domain or ""

    @property
    def key(self) -> str:
        """The op's name in reports: `Op` in the default domain, `domain.Op` otherwise."""
        return self.op_type if self.domain in DEFAULT_DOMAINS else f"{self.domain}.{self.op_type}"

    @property
    def label(self) -> str:
        return (
            f"{self.op_type} node {self.proto.name!r}"
            if self.proto.name
            else f"{self.op_type} node"
        )

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def only(self, name: str, *allowed: Any, default: Any = None) -> Any:
        """The attribute's value, which must be one of `allowed` (else Unsupported)."""
        v = self.attrs.get(name, default)
        if v not in allowed:
            raise Unsupported(f"{name}={v!r} (supported: {', '.join(map(repr, allowed))})")
        return v

"""Loading an ONNX model: safe external data, onnx.checker, shape inference, opset range, dtypes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import onnx
import torch
from onnx import external_data_helper, numpy_helper

from gac_torch.errors import OnnxLoadError

MIN_OPSET, MAX_OPSET = 13, 21

DTYPES: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}
ELEM_TYPES = {v: k for k, v in DTYPES.items()}


def torch_dtype(elem_type: int) -> torch.dtype:
    if elem_type not in DTYPES:
        raise OnnxLoadError(
            f"ONNX element type {onnx.TensorProto.DataType.Name(elem_type)} "
            f"is not supported (supported: {sorted(str(d) for d in DTYPES.values())})"
        )
    return DTYPES[elem_type]


def to_torch(t: onnx.TensorProto) -> torch.Tensor:
    arr = numpy_helper.to_array(t)
    if t.data_type == onnx.TensorProto.BFLOAT16:  # numpy has no bfloat16 (ml_dtypes does)
        arr = arr.astype(np.float32)
    return torch.from_numpy(np.array(arr, copy=True)).to(torch_dtype(t.data_type))


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of a graph: initializers and tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
            yield from a.tensors
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _tensors(a.g)
            for g in a.graphs:
                yield from _tensors(g)


def _load_external_data(model: onnx.ModelProto, base_dir: str) -> None:
    """onnx's own loader, after checking that every location stays inside the model's folder."""
    root = os.path.realpath(base_dir)
    for t in _tensors(model.graph):
        if not external_data_helper.uses_external_data(t):
            continue
        location = external_data_helper.ExternalDataInfo(t).location
        path = os.path.realpath(os.path.join(root, location))
        if os.path.isabs(location) or os.path.commonpath([root, path]) != root:
            raise OnnxLoadError(
                f"tensor {t.name!r}: external data location {location!r} resolves outside the "
                f"model's folder {root!r}; refusing to read it"
            )
        if not os.path.isfile(path):
            raise OnnxLoadError(f"tensor {t.name!r}: external data file {location!r} not found in {root!r}")
    external_data_helper.load_external_data_for_model(model, root)


def load_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """Reads (a path) or copies (a ModelProto), then checks it and infers shapes."""
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        if any(external_data_helper.uses_external_data(t) for t in _tensors(proto.graph)):
            raise OnnxLoadError(
                "this ModelProto refers to external data; pass the model's path "
                "so the data can be read from the model's folder"
            )
    else:
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise OnnxLoadError(f"no ONNX model at {path!r}")
        if os.path.getsize(path) == 0:
            raise OnnxLoadError(f"{path!r} is an empty file (0 bytes), not an ONNX model")
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as e:  # protobuf's DecodeError and friends: truncated, text, corrupt
            raise OnnxLoadError(f"{path!r} is not a readable ONNX model (corrupt or truncated?): "
                                f"{type(e).__name__}: {e}") from e
        _load_external_data(proto, os.path.dirname(os.path.abspath(path)))
    check_opset(proto)
    try:
        onnx.checker.check_model(proto)
        # data_prop: static shape arithmetic (Shape -> Gather -> Concat) also gives output shapes.
        return onnx.shape_inference.infer_shapes(proto, check_type=True, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise OnnxLoadError(f"invalid ONNX model: {e}") from e


def default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise OnnxLoadError("the model imports no default-domain (ai.onnx) opset")


def check_opset(model: onnx.ModelProto) -> None:
    v = default_opset(model)
    if not MIN_OPSET <= v <= MAX_OPSET:
        raise OnnxLoadError(
            f"opset {v} is outside the supported range {MIN_OPSET}-{MAX_OPSET}; "
            f"convert it with onnx.version_converter.convert_version(model, 17)"
        )


def value_types(model: onnx.ModelProto) -> dict[str, tuple[list[int | None] | None, int]]:
    """name -> (shape with None for unknown dims, or None if the rank is unknown; elem type)."""
    out: dict[str, tuple[list[int | None] | None, int]] = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        shape = None
        if tt.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        out[vi.name] = (shape, tt.elem_type)
    return out

"""The ONNX front-end: ONNX -> FX graph of ATen ops -> the same compile_graph as torch models.

    compiled = gac_torch.compile("model.onnx", target="cpu")
    y = compiled(x)                      # torch tensors or numpy arrays
    compiled.onnx_report                 # ONNX nodes mapped / folded / run by onnxruntime
    compiled.report                      # ATen nodes compiled by gac / left eager

Each ONNX op is one function in ops_*.py that emits ATen calls; there is no ONNX-level gac op
table, so the ATen registry, partitioning, fallback, lowering and targets are shared.
"""

from gac_torch.frontends.onnx.importer import (
    ImportedGraph,
    OnnxReport,
    OnnxUnsupportedError,
    import_model,
)
from gac_torch.frontends.onnx.load import (
    MAX_OPSET,
    MIN_OPSET,
    OnnxLoadError,
    load_model,
)
from gac_torch.frontends.onnx.ort_fallback import OrtUnavailable
from gac_torch.frontends.onnx.program import CompiledOnnx, compile_onnx
from gac_torch.frontends.onnx.registry import supported_ops

__all__ = [
    "CompiledOnnx",
    "ImportedGraph",
    "MAX_OPSET",
    "MIN_OPSET",
    "OnnxLoadError",
    "OnnxReport",
    "OnnxUnsupportedError",
    "OrtUnavailable",
    "compile_onnx",
    "import_model",
    "load_model",
    "supported_ops",
]

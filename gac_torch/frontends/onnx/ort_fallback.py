"""Unsupported ONNX nodes run through onnxruntime, one single-node model per node.

In the FX graph such a node is a call to the custom op `gac_onnx::ort_node(key, inputs)`: opaque to
make_fx (its fake implementation gives the output shapes found at import), unknown to the ATen
registry, so the partitioner leaves it eager like any other fallback node. Without onnxruntime the
graph still imports; the call raises OrtUnavailable, naming the op and the fix.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from onnx import helper

from gac_torch.frontends.onnx.load import ELEM_TYPES, torch_dtype
from gac_torch.errors import TargetUnavailable

# key -> node, weakly: the imported graph that calls a node holds it (ImportedGraph.ort_nodes),
# so a dropped program frees its onnxruntime sessions and models (a plain dict grew forever)
_NODES: weakref.WeakValueDictionary[str, OrtNode] = weakref.WeakValueDictionary()
_ids = itertools.count()


class OrtUnavailable(TargetUnavailable):
    """An unsupported ONNX node needs onnxruntime, which is not installed."""


def have_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class OrtNode:
    """One ONNX node as a standalone model; inputs are the node's non-constant inputs."""

    op: str
    model: onnx.ModelProto
    input_names: list[str]
    out_specs: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    _session: Any = None

    def session(self) -> Any:
        if self._session is None:
            if not have_onnxruntime():
                raise OrtUnavailable(
                    f"ONNX op {self.op} has no gac mapping and runs through onnxruntime, which is "
                    f"not installed: pip install onnxruntime (or 'gac-torch[onnx]')"
                )
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            self._session = ort.InferenceSession(
                self.model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
            )
        return self._session

    def run_numpy(self, arrays: Sequence[Any]) -> list[Any]:
        return self.session().run(None, dict(zip(self.input_names, arrays)))

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        device = inputs[0].device if inputs else torch.device("cpu")
        outs = self.run_numpy([t.detach().cpu().numpy() for t in inputs])
        return [torch.from_numpy(o.copy()).to(device) for o in outs]


@torch.library.custom_op("gac_onnx::ort_node", mutates_args=())
def ort_node(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return _NODES[key].run(inputs)


@ort_node.register_fake
def _ort_node_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    device = inputs[0].device if inputs else torch.device("cpu")
    return [torch.empty(s, dtype=d, device=device) for s, d in _NODES[key].out_specs]


def make_node_model(
    node: onnx.NodeProto, model: onnx.ModelProto, inputs: Sequence[tuple[str, torch.Tensor, bool]]
) -> tuple[onnx.ModelProto, list[str]]:
    """The node alone: (name, value or its fake, is_constant) per present input; constants
    become initializers. Returns the model and its graph-input names."""
    graph_inputs, inits, names = [], [], []
    for name, val, is_const in inputs:
        if is_const:
            inits.append(onnx.numpy_helper.from_array(val.cpu().numpy(), name))
        else:
            graph_inputs.append(
                helper.make_tensor_value_info(name, ELEM_TYPES[val.dtype], list(val.shape))
            )
            names.append(name)
    outputs = [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o]
    graph = helper.make_graph([node], f"gac_fallback_{node.op_type}", graph_inputs, outputs, inits)
    single = helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )
    return single, names


def register(
    node: onnx.NodeProto,
    op: str,
    model: onnx.ModelProto,
    inputs: Sequence[tuple[str, torch.Tensor, bool]],
    known: dict[str, tuple[list[int | None] | None, int]],
) -> tuple[str, OrtNode]:
    """Builds the node's model and finds its output specs: from shape inference when static,
    else by running it once on zeros (needs onnxruntime)."""
    single, names = make_node_model(node, model, inputs)
    entry = OrtNode(node.op_type, single, names)
    outs = [o for o in node.output if o]
    specs = [known.get(o) for o in outs]
    if all(s is not None and s[0] is not None and None not in s[0] for s in specs):
        entry.out_specs = [(tuple(s[0]), torch_dtype(s[1])) for s in specs]  # type: ignore
    else:
        zeros = [torch.zeros(v.shape, dtype=v.dtype).numpy() for _, v, c in inputs if not c]
        entry.out_specs = [
            (tuple(o.shape), torch.from_numpy(o).dtype) for o in entry.run_numpy(zeros)
        ]
    key = f"{node.op_type}_{next(_ids)}"
    _NODES[key] = entry
    return key, entry

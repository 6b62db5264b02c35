"""Helpers for the ONNX front-end tests: seeded inputs, models built with onnx.helper and run by
onnxruntime for their reference outputs, and the gac-vs-onnxruntime comparison.

Tolerance: gac and onnxruntime are both float32 implementations (neither is a float64 reference),
so fp32 outputs compare at rtol 1e-4 / atol 1e-5 unless a case states otherwise (exported models:
atol 1e-4, over deep graphs); integer and bool outputs must match exactly.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import gac_torch
from parity import device_of

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(20240607)


def rand(*shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def pos(*shape: int) -> np.ndarray:
    return rand(*shape, lo=0.2, hi=3.0)


def ints(*shape: int, lo: int = -6, hi: int = 7, dtype=np.int64) -> np.ndarray:
    return RNG.integers(lo, hi, shape).astype(dtype)


def nonzero(a: np.ndarray) -> np.ndarray:
    return np.where(a == 0, 1, a).astype(a.dtype)


def make(nodes: list, inputs: dict[str, np.ndarray], inits: dict[str, np.ndarray] | None = None,
         outputs: tuple[str, ...] = ("y",), opset: int = 17
         ) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """The graph as a checked model (output types from onnxruntime's run), and those outputs."""
    def vi(name: str, a: np.ndarray):
        elem = helper.np_dtype_to_tensor_dtype(a.dtype)
        return helper.make_tensor_value_info(name, elem, a.shape)

    init_protos = [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    untyped = [helper.make_value_info(o, onnx.TypeProto()) for o in outputs]
    graph = helper.make_graph(nodes, "case", [vi(k, v) for k, v in inputs.items()], untyped,
                              init_protos)
    # IR version 10 (opset 21's): newer onnx writes 11+, which older onnxruntime builds refuse.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    refs = ort.InferenceSession(model.SerializeToString()).run(None, inputs)
    model.graph.ClearField("output")
    model.graph.output.extend(vi(o, r) for o, r in zip(outputs, refs, strict=True))
    return model, refs


def check(model: onnx.ModelProto, inputs: dict[str, np.ndarray], refs: list[np.ndarray],
          target: str, *, strict: bool = True, rtol: float = 1e-4, atol: float = 1e-5):
    """Compiles (strict: every ATen node must compile) and compares with onnxruntime."""
    c = gac_torch.compile(model, target=target, options={"fallback": not strict})
    assert not c.onnx_report.unsupported, c.onnx_report.summary()
    dev = device_of(target)
    outs = c(*[torch.from_numpy(v).to(dev) for v in inputs.values()])
    outs = outs if isinstance(outs, tuple) else (outs,)
    for vi, o, r in zip(model.graph.output, outs, refs, strict=True):
        name = vi.name
        assert o.dtype == torch.from_numpy(r).dtype, f"{name}: {o.dtype} vs {r.dtype}"
        exact = not np.issubdtype(r.dtype, np.floating)
        torch.testing.assert_close(o.cpu(), torch.from_numpy(r), rtol=0 if exact else rtol,
                                   atol=0 if exact else atol,
                                   msg=lambda m, name=name: f"output {name}: {m}")
    return c


N = helper.make_node


def op(spec: str, **attrs) -> onnx.NodeProto:
    """op("Conv x w b -> y", pads=[...]): a node from 'Type inputs -> outputs'; '_' is an omitted
    optional input."""
    lhs, _, rhs = spec.partition("->")
    kind, *ins = lhs.split()
    return helper.make_node(kind, ["" if i == "_" else i for i in ins], rhs.split(), **attrs)


def outputs_of(nodes: list) -> tuple[str, ...]:
    """The capitalized output names: the ones a test compares (lower-case ones are internal)."""
    return tuple(o for n in nodes for o in n.output if o[:1].isupper())


def export(module: torch.nn.Module, args: tuple, path: str, **kw) -> str:
    """torch.onnx.export with the TorchScript exporter (no onnxscript needed), opset 17."""
    module.eval()
    torch.onnx.export(module, args, path, dynamo=False, opset_version=17, **kw)
    return path


def check_exported(path: str, module: torch.nn.Module, args: tuple, target: str, *,
                   strict: bool = True, rtol: float = 1e-4, atol: float = 1e-4):
    """gac vs onnxruntime and vs eager PyTorch (deep graphs: atol 1e-4)."""
    sess = ort.InferenceSession(path)
    refs = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args, strict=True)})
    c = gac_torch.compile(path, target=target, options={"fallback": not strict})
    assert not c.onnx_report.unsupported, c.onnx_report.summary()
    outs = c(*[a.to(device_of(target)) for a in args])
    outs = outs if isinstance(outs, tuple) else (outs,)
    with torch.no_grad():
        eager = module(*args)
    eager = eager if isinstance(eager, tuple) else (eager,)
    for o, r, e in zip(outs, refs, eager, strict=True):
        torch.testing.assert_close(o.cpu(), torch.from_numpy(r), rtol=rtol, atol=atol)
        torch.testing.assert_close(o.cpu(), e, rtol=rtol, atol=atol)
    return c


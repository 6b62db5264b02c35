"""Rough edges a new user met (issue 16, point 5): missing extras are errors naming them, static
dims print as numbers, explain() counts partitions as compile does, partitions are numbered in
execution order, errors under torch.compile name the user's arguments, unsupported modes warn."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import gac_torch
from gac_torch.errors import MissingDependency
from gac_torch.frontends import dynamo
from gac_torch.runtime.compiled import GacInputError
from test_artifact import WithFallback, _inputs


def test_missing_vortex_extra_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ziglang" else real(name, *a))
    with pytest.raises(MissingDependency, match=r"ziglang: pip install 'gac-torch\[vortex\]'"):
        gac_torch.compile(torch.nn.ReLU(), (torch.randn(4),), target="vortex")


def test_missing_onnx_extra_is_named(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "onnx" or m.startswith(("onnx.", "gac_torch.frontends.onnx"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'gac-torch\[onnx\]'"):
        gac_torch.compile(str(tmp_path / "m.onnx"))


def test_symbolic_dims_message_shows_static_dims():
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from gac_torch.frontends.onnx import OnnxLoadError

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    with pytest.raises(OnnxLoadError) as err:
        gac_torch.compile(onnx.ModelProto.FromString(model.SerializeToString()))
    assert "['N', 8]" in str(err.value) and "'?'" not in str(err.value)


def test_explain_counts_partitions_like_compile_and_numbers_them_in_order():
    model, inputs = WithFallback(), _inputs()
    report = gac_torch.explain(model, *inputs)
    compiled = gac_torch.compile(model, inputs, target="cpu", options={"cache": False})
    assert report.partitions == compiled.report.partitions == 2
    parts = compiled.compiled.partitions
    assert list(parts) == ["fused_0", "fused_1"]
    assert "gelu" in parts["fused_0"].fx_graph and "softmax" in parts["fused_1"].fx_graph
    calls = [n.target for n in compiled.compiled.gm.graph.nodes if n.op == "call_module"]
    assert calls == ["fused_0", "fused_1"]


def test_errors_under_torch_compile_name_the_users_arguments():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, bias):
            return self.lin(x).relu() + bias

    dynamo.compiled_graphs.clear()
    torch.compiler.reset()
    m = M()
    with torch.no_grad():
        torch.compile(m, backend="gac", options={"cache": False})(torch.randn(2, 4), torch.randn(4))
    (cg,) = dynamo.compiled_graphs[-1].partitions.values()
    assert cg.input_names == ["lin_weight", "lin_bias", "x", "bias"]
    with pytest.raises(GacInputError, match=r"\(x\): expected dtype torch.float32"):
        cg(m.lin.weight, m.lin.bias, torch.ones(2, 4, dtype=torch.float64), torch.randn(4))


def test_modes_map_to_options_and_unknown_mode_fails():
    torch.compiler.reset()
    dynamo._modes_warned.clear()
    with pytest.warns(UserWarning, match="mode='reduce-overhead' changes nothing"):
        out = torch.compile(torch.nn.ReLU(), backend="gac", mode="reduce-overhead")(torch.randn(3))
    assert out.shape == (3,)
    assert dynamo._check_mode("max-autotune") == {"autotune": True}
    x = torch.randn(3)
    torch.testing.assert_close(torch.compile(torch.nn.ReLU(), backend="gac", mode="max-autotune")(x), x.relu())
    with pytest.raises(gac_torch.OptionError, match="unknown torch.compile mode"):
        dynamo._check_mode("fastest")

"""ONNX front-end on models exported by torch.onnx.export (MLP, CNN with BatchNorm,
nn.TransformerEncoderLayer, BEVFormer test_tiny), and the loading rules: external data, opsets,
symbolic dims, strict mode's list of unknown ops, the onnxruntime fallback. Tolerances: see
tests/onnx_parity.py. The TorchScript exporter (dynamo=False) needs no onnxscript; it warns that
it is deprecated, hence the filterwarnings marks.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper

import gac_torch
from conftest import TARGETS
from gac_torch.frontends.onnx import OnnxLoadError, OnnxUnsupportedError, OrtUnavailable, ort_fallback
from onnx_parity import check_exported, export, make, op, ort, rand
from parity import device_of


class EncoderLayer(torch.nn.Module):
    """nn.TransformerEncoderLayer behind a plain forward(x): the exporter would otherwise turn
    the `is_causal` default into a graph input."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _cnn() -> torch.nn.Module:
    nn = torch.nn
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    for bn in (m for m in cnn.modules() if isinstance(m, nn.BatchNorm2d)):  # non-trivial statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return cnn


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("target", TARGETS)
def test_exported_models(target, tmp_path):
    torch.manual_seed(0)
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))
    x = torch.randn(4, 16)
    check_exported(export(mlp, (x,), str(tmp_path / "mlp.onnx")), mlp, (x,), target)
    cnn, img = _cnn(), torch.randn(2, 3, 16, 16)
    # No exporter constant folding, so BatchNormalization stays a node instead of merging into Conv.
    path = export(cnn, (img,), str(tmp_path / "cnn.onnx"), do_constant_folding=False)
    c = check_exported(path, cnn, (img,), target)
    assert c.onnx_report.ops["BatchNormalization"] == 2
    enc, seq = EncoderLayer(), torch.randn(2, 7, 32)
    # Exported with grad enabled: under no_grad, eval mode takes the fused fast path, which the
    # exporter cannot export (aten::_transformer_encoder_layer_fwd).
    c = check_exported(export(enc, (seq,), str(tmp_path / "enc.onnx")), enc, (seq,), target)
    assert c.onnx_report.folded > 0  # the attention's shape arithmetic folded away


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("target", TARGETS)
def test_bevformer_tiny(target, tmp_path):
    """The BEVFormer test-size model, exported by torch.onnx.export (about 1,000 ONNX nodes)."""
    from gac_torch.models.bevformer import build_bevformer, make_test_inputs

    model = build_bevformer("test_tiny", seed=0)
    args = make_test_inputs(model.cfg, frame=1, seed=0)
    with torch.no_grad():
        path = export(model, args, str(tmp_path / "bevformer.onnx"))
    c = check_exported(path, model, args, target)
    assert c.onnx_report.ops["GridSample"] > 0 and c.report.percent > 99


# --- loading, strict mode, onnxruntime fallback -------------------------------------------------

def _weights_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    inputs = {"x": rand(3, 64)}
    model, refs = make([op("MatMul x w -> y")], inputs, {"w": rand(64, 8)})
    return model, inputs, refs


def test_external_data_inside_folder(tmp_path):
    model, inputs, refs = _weights_model()
    path = str(tmp_path / "m.onnx")
    onnx.save_model(model, path, save_as_external_data=True, location="w.bin", size_threshold=0)
    assert os.path.exists(tmp_path / "w.bin")
    out = gac_torch.compile(path)(inputs["x"])  # numpy in -> numpy out
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, refs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("location", ["../w.bin", "ABS", "link/w.bin"])
def test_external_data_escape_refused(tmp_path, location):
    model, _, _ = _weights_model()
    (tmp_path / "model").mkdir()
    (tmp_path / "w.bin").write_bytes(rand(64, 8).tobytes())
    os.symlink(tmp_path, tmp_path / "model" / "link")  # a link inside that points outside
    location = str(tmp_path / "w.bin") if location == "ABS" else location
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.ClearField("float_data")
    w.data_location = T.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(64 * 8 * 4))):
        w.external_data.add(key=k, value=v)
    path = str(tmp_path / "model" / "m.onnx")
    onnx.save_model(model, path)
    with pytest.raises(OnnxLoadError, match="outside the model's folder"):
        gac_torch.compile(path)


def _unknown_ops_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    inputs = {"x": rand(1, 4, 5, 5)}
    nodes = [op("LRN x -> a", size=3), op("Relu a -> b"), op("Hardmax b -> c"), op("LpNormalization c -> d"),
             op("LRN d -> e", size=3), op("Mul e x -> y")]
    return make(nodes, inputs)[0], inputs


def test_strict_mode_lists_every_unknown_op():
    model, _ = _unknown_ops_model()
    with pytest.raises(OnnxUnsupportedError) as err:
        gac_torch.compile(model, options={"fallback": False})
    msg = str(err.value)
    for listed in ("LRN: 2 node(s)", "Hardmax: 1 node(s)", "LpNormalization: 1 node(s)"):
        assert listed in msg, msg


@pytest.mark.parametrize("target", TARGETS)
def test_unsupported_ops_run_through_onnxruntime(target):
    model, inputs = _unknown_ops_model()
    refs = ort.InferenceSession(model.SerializeToString()).run(None, inputs)
    c = gac_torch.compile(model, target=target)
    assert sum(c.onnx_report.unsupported.values()) == 4 and c.onnx_report.mapped == 2
    assert c.report.compiled > 0  # Relu and Mul still compile
    out = c(torch.from_numpy(inputs["x"]).to(device_of(target)))
    torch.testing.assert_close(out.cpu(), torch.from_numpy(refs[0]), rtol=1e-4, atol=1e-5)


def test_without_onnxruntime_fails_at_call_time(monkeypatch):
    model, inputs = _unknown_ops_model()
    monkeypatch.setattr(ort_fallback, "have_onnxruntime", lambda: False)
    c = gac_torch.compile(model)  # shapes come from ONNX shape inference: import still works
    with pytest.raises(OrtUnavailable, match="LRN has no gac mapping .* pip install onnxruntime"):
        c(inputs["x"])


@pytest.mark.parametrize("opset", [12, 22])
def test_opset_out_of_range_refused(opset):
    x, y = (helper.make_tensor_value_info(name, T.FLOAT, [2]) for name in "xy")
    graph = helper.make_graph([op("Relu x -> y")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    with pytest.raises(OnnxLoadError, match="outside the supported range 13-21"):
        gac_torch.compile(model)


@pytest.mark.filterwarnings("ignore")
def test_symbolic_dims_need_example_inputs(tmp_path):
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
    path = export(mlp, (torch.randn(2, 8),), str(tmp_path / "dyn.onnx"),
                  input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    with pytest.raises(OnnxLoadError, match="symbolic dims.*example_inputs"):
        gac_torch.compile(path)
    x = torch.randn(5, 8)
    c = gac_torch.compile(path, (x,))
    with torch.no_grad():
        torch.testing.assert_close(c(x=x), mlp(x), rtol=1e-4, atol=1e-5)


def test_onnxruntime_nodes_are_freed_with_the_program():
    """ort_fallback kept every fallback node (its model and onnxruntime session) in a module
    dict forever: a leak per compile. A dropped program now leaves nothing behind."""
    import gc
    import weakref

    model, inputs = _unknown_ops_model()
    before = set(ort_fallback._NODES)
    c = gac_torch.compile(model)
    keys = set(ort_fallback._NODES) - before
    assert len(keys) == 4  # LRN x2, Hardmax, LpNormalization, called from the graph
    c(torch.from_numpy(inputs["x"]))  # sessions built
    nodes = [weakref.ref(ort_fallback._NODES[k]) for k in keys]
    del c
    gc.collect()
    assert not keys & set(ort_fallback._NODES)
    assert all(r() is None for r in nodes)

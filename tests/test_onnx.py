"""ONNX front-end: parity against onnxruntime per op family (hand-built graphs, one model per
family so each compiles once) and on models exported by torch.onnx.export; loading rules
(external data, opsets, symbolic dims); strict mode and the onnxruntime fallback.

Tolerance: gac and onnxruntime are both float32 implementations (neither is a float64 reference),
so fp32 outputs compare at rtol 1e-4 / atol 1e-5 unless a case states otherwise; integer and bool
outputs must match exactly.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import gac_torch
from conftest import TARGETS
from gac_torch.frontends.onnx import OnnxLoadError, OnnxUnsupportedError, OrtUnavailable, ort_fallback
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
         outputs: tuple[str, ...] = ("y",), opset: int = 17) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """The graph as a checked model (output types from onnxruntime's run), and those outputs."""
    def vi(name: str, a: np.ndarray):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)

    init_protos = [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    untyped = [helper.make_value_info(o, onnx.TypeProto()) for o in outputs]
    graph = helper.make_graph(nodes, "case", [vi(k, v) for k, v in inputs.items()], untyped, init_protos)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    refs = ort.InferenceSession(model.SerializeToString()).run(None, inputs)
    model.graph.ClearField("output")
    model.graph.output.extend(vi(o, r) for o, r in zip(outputs, refs))
    return model, refs


def check(model: onnx.ModelProto, inputs: dict[str, np.ndarray], refs: list[np.ndarray], target: str,
          *, strict: bool = True, rtol: float = 1e-4, atol: float = 1e-5):
    """Compiles (strict: every ATen node must compile) and compares with onnxruntime."""
    c = gac_torch.compile(model, target=target, options={"fallback": not strict})
    assert not c.onnx_report.unsupported, c.onnx_report.summary()
    dev = device_of(target)
    outs = c(*[torch.from_numpy(v).to(dev) for v in inputs.values()])
    outs = outs if isinstance(outs, tuple) else (outs,)
    for name, o, r in zip(model.graph.output, outs, refs):
        assert o.dtype == torch.from_numpy(r).dtype, f"{name.name}: {o.dtype} vs {r.dtype}"
        exact = not np.issubdtype(r.dtype, np.floating)
        torch.testing.assert_close(o.cpu(), torch.from_numpy(r), rtol=0 if exact else rtol,
                                   atol=0 if exact else atol, msg=lambda m: f"output {name.name}: {m}")
    return c


N = helper.make_node


def unary_nodes(ops: list[str], src: str = "x") -> list:
    return [N(op, [src], [op]) for op in ops]


# --- op families (hand-built graphs) -----------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_elementwise_float(target):
    ops = ["Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Neg", "Abs", "Floor", "Ceil", "Round", "Sin", "Cos",
           "Atan", "Sign", "Softsign", "Softplus", "HardSwish", "HardSigmoid", "LeakyRelu", "Elu", "Selu",
           "Celu", "Gelu", "Mish"]
    nodes = unary_nodes(ops) + unary_nodes(["Log", "Sqrt", "Reciprocal"], "p")
    nodes += [N("Add", ["x", "b"], ["Add"]), N("Sub", ["x", "b"], ["Sub"]), N("Mul", ["x", "b"], ["Mul"]),
              N("Div", ["x", "p"], ["Div"]), N("Pow", ["p", "b"], ["Pow"]), N("Pow", ["x", "two"], ["Pow2"]),
              N("Clip", ["x", "lo", "hi"], ["Clip"]), N("Clip", ["x", "", "hi"], ["ClipHi"]),
              N("Min", ["x", "b", "p"], ["Min"]), N("Max", ["x", "b"], ["Max"]), N("Sum", ["x", "b", "p"], ["Sum"]),
              N("Mean", ["x", "p"], ["Mean"]), N("PRelu", ["x", "slope"], ["PRelu"]),
              N("Where", ["cond", "x", "b"], ["Where"]), N("Mod", ["x", "p"], ["Mod"], fmod=1)]
    outs = tuple(n.output[0] for n in nodes)
    inputs = {"x": rand(2, 3, 4), "b": rand(3, 4), "p": pos(2, 3, 4), "cond": rand(2, 1, 4) > 0}
    inits = {"two": np.array(2.0, np.float32), "lo": np.array(-0.5, np.float32),
             "hi": np.array(0.7, np.float32), "slope": rand(3, 1)}
    model, refs = make(nodes, inputs, inits, outs, opset=20)
    check(model, inputs, refs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_logic_int_cast(target):
    # Each bool result feeds at most one other node: a bool shared by two fused outputs trips
    # the lowering's i1-buffer check (reported; see the module docstring of tests/test_onnx.py).
    nodes = [N("Less", ["x", "z"], ["Less"]), N("Not", ["Less"], ["Not"]),
             N("Greater", ["x", "z"], ["Greater"]), N("Equal", ["i", "j"], ["Equal"]),
             N("Xor", ["Greater", "Equal"], ["Xor"]), N("LessOrEqual", ["i", "j"], ["LessOrEqual"]),
             N("GreaterOrEqual", ["x", "z"], ["GreaterOrEqual"]), N("And", ["LessOrEqual", "GreaterOrEqual"], ["And"]),
             N("IsNaN", ["x"], ["IsNaN"]), N("IsInf", ["x"], ["IsInf"]), N("Or", ["IsNaN", "IsInf"], ["Or"]),
             N("Div", ["i", "j"], ["IntDiv"]), N("Mod", ["i", "j"], ["Mod"]), N("Mod", ["i", "j"], ["FMod"], fmod=1),
             N("Cast", ["x"], ["ToInt"], to=T.INT32), N("Cast", ["i"], ["ToFloat"], to=T.FLOAT),
             N("Cast", ["x"], ["ToBool"], to=T.BOOL), N("Where", ["c", "i", "j"], ["Where"]),
             N("BitwiseAnd", ["i", "j"], ["BitwiseAnd"]), N("Abs", ["i"], ["IntAbs"])]
    inputs = {"x": rand(3, 5) * 5, "z": rand(3, 5) * 5, "i": ints(3, 5), "j": nonzero(ints(5)),
              "c": rand(3, 1) > 0}
    model, refs = make(nodes, inputs, outputs=tuple(n.output[0] for n in nodes), opset=18)
    check(model, inputs, refs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_matmul_gemm_einsum(target):
    nodes = [N("MatMul", ["a", "w"], ["MatMul"]), N("MatMul", ["a", "bt"], ["BatchedMatMul"]),
             N("MatMul", ["v6", "bt"], ["VecMat"]), N("MatMul", ["a", "v6"], ["MatVec"]),
             N("Gemm", ["m", "w2", "c"], ["Gemm"], transB=1, alpha=0.5, beta=2.0),
             N("Gemm", ["mt", "w2t"], ["GemmT"], transA=1),
             N("Einsum", ["a", "bt"], ["Einsum"], equation="bij,bjk->bik")]
    inputs = {"a": rand(2, 5, 6), "bt": rand(2, 6, 3), "m": rand(4, 6), "mt": rand(6, 4), "v6": rand(6)}
    inits = {"w": rand(6, 7), "w2": rand(5, 6), "c": rand(5), "w2t": rand(6, 5)}
    model, refs = make(nodes, inputs, inits, tuple(n.output[0] for n in nodes))
    c = check(model, inputs, refs, target)
    assert len(c.imported.params) == 4  # initializers are parameters, bound at call time ...
    assert "dense<[" not in c.ir("gac")  # ... not constants in the IR


@pytest.mark.parametrize("target", TARGETS)
def test_conv_bn_pool(target):
    nodes = [N("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1], strides=[2, 2]),
             N("BatchNormalization", ["conv", "s", "bb", "mu", "var"], ["bn"], epsilon=1e-3),
             N("Relu", ["bn"], ["relu"]),
             N("MaxPool", ["relu"], ["MaxPool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             N("Conv", ["x", "wg"], ["ConvGroupAsym"], pads=[0, 1, 1, 0], group=3, dilations=[2, 1]),
             N("Conv", ["x", "w"], ["ConvSame"], auto_pad="SAME_UPPER", strides=[2, 2]),
             N("AveragePool", ["x"], ["AvgPool"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             N("AveragePool", ["x"], ["AvgPoolInc"], kernel_shape=[2, 3], strides=[2, 1], pads=[1, 1, 1, 1],
               count_include_pad=1),
             N("MaxPool", ["x"], ["MaxPoolSame"], kernel_shape=[2, 2], auto_pad="SAME_LOWER"),
             N("GlobalAveragePool", ["relu"], ["GAP"]), N("GlobalMaxPool", ["x"], ["GMP"]),
             N("Conv", ["x1d", "w1d"], ["Conv1d"], pads=[2, 1])]
    inputs = {"x": rand(2, 3, 9, 8), "x1d": rand(2, 3, 10)}
    inits = {"w": rand(4, 3, 3, 3), "b": rand(4), "s": pos(4), "bb": rand(4), "mu": rand(4), "var": pos(4),
             "wg": rand(3, 1, 3, 3), "w1d": rand(5, 3, 4)}
    model, refs = make(nodes, inputs, inits, tuple(n.output[0] for n in nodes))
    check(model, inputs, refs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_norms_softmax(target):
    nodes = [N("LayerNormalization", ["x", "g", "b"], ["LayerNorm", "Mean", "InvStd"], epsilon=1e-5),
             N("LayerNormalization", ["x", "g2"], ["LayerNorm2"], axis=1),
             N("Softmax", ["x"], ["Softmax"], axis=1), N("LogSoftmax", ["x"], ["LogSoftmax"]),
             N("InstanceNormalization", ["x4", "c", "cb"], ["InstanceNorm"]),
             N("GroupNormalization", ["x4", "gs", "gb"], ["GroupNorm"], num_groups=2)]
    inputs = {"x": rand(2, 5, 8), "x4": rand(2, 4, 3, 5)}
    inits = {"g": rand(8), "b": rand(8), "g2": rand(5, 8), "c": rand(4), "cb": rand(4), "gs": rand(4), "gb": rand(4)}
    model, refs = make(nodes, inputs, inits, tuple(o for n in nodes for o in n.output), opset=21)
    check(model, inputs, refs, target)


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("opset", [13, 18])
def test_reductions(opset, target):
    """Opset 13: axes are attributes (ReduceSum: an input); opset 18: an input for every Reduce*."""
    def node(op: str, out: str, axes: list[int], **kw):
        if opset >= 18 or op == "ReduceSum":
            return N(op, ["p", f"axes_{out}"], [out], **kw), {f"axes_{out}": np.array(axes, np.int64)}
        return N(op, ["p"], [out], axes=axes, **kw), {}
    nodes, inits = [], {}
    for op in REDUCE_OPS:
        for out, axes, kw in ((op, [1, -1], {}), (f"{op}_flat", [0], {"keepdims": 0})):
            nd, extra = node(op, out, axes, **kw)
            nodes.append(nd)
            inits.update(extra)
    nodes += [N("ReduceMean", ["p"], ["MeanAll"], keepdims=0), N("ArgMax", ["p"], ["ArgMax"], axis=2),
              N("ArgMin", ["p"], ["ArgMin"], axis=0, keepdims=0)]
    inputs = {"p": pos(3, 4, 5)}
    model, refs = make(nodes, inputs, inits, tuple(n.output[0] for n in nodes), opset=opset)
    check(model, inputs, refs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_shape_ops_and_folding(target):
    """Data movement, plus a Shape -> Gather -> Concat -> Reshape chain that must fold away."""
    nodes = [N("Shape", ["x"], ["shp"]), N("Gather", ["shp", "zero"], ["d0"], axis=0),
             N("Concat", ["d0", "minus1"], ["newshape"], axis=0), N("Reshape", ["x", "newshape"], ["Reshape"]),
             N("Reshape", ["x", "shape0"], ["ReshapeZero"]), N("Transpose", ["x"], ["Transpose"], perm=[2, 0, 1]),
             N("Concat", ["x", "x"], ["Concat"], axis=-1), N("Expand", ["col", "eshape"], ["Expand"]),
             N("Slice", ["x", "st", "en", "ax", "step"], ["Slice"]), N("Gather", ["x", "gidx"], ["Gather"], axis=1),
             N("Gather", ["x", "idx"], ["GatherDyn"], axis=2), N("GatherElements", ["x", "eidx"], ["GatherEl"], axis=2),
             N("GatherND", ["x", "ndidx"], ["GatherND"]), N("Unsqueeze", ["x", "uax"], ["Unsqueeze"]),
             N("Squeeze", ["Unsqueeze", "uax"], ["Squeeze"]), N("Flatten", ["x"], ["Flatten"], axis=2),
             N("Split", ["x", "splits"], ["SplitA", "SplitB"], axis=2), N("Tile", ["x", "reps"], ["Tile"]),
             N("Pad", ["x", "pads", "padv"], ["Pad"]), N("Pad", ["x", "pads"], ["PadReflect"], mode="reflect"),
             N("Trilu", ["x"], ["Trilu"], upper=0), N("DepthToSpace", ["x4"], ["DepthToSpace"], blocksize=2),
             N("ConstantOfShape", ["eshape"], ["zeros"], value=helper.make_tensor("v", T.FLOAT, [1], [1.5])),
             N("Add", ["Expand", "zeros"], ["CoS"]), N("Range", ["r0", "r1", "r2"], ["rng"]),
             N("Cast", ["rng"], ["rngf"], to=T.FLOAT), N("Add", ["x", "rngf"], ["RangeAdd"]),
             N("Constant", [], ["k"], value_floats=[1.0, -2.0, 3.0, 0.5]), N("Mul", ["x", "k"], ["ConstMul"])]
    inputs = {"x": rand(3, 5, 4), "col": rand(5, 1), "idx": ints(2, 3, lo=-4, hi=4), "eidx": ints(3, 5, 2, lo=-4, hi=4),
              "ndidx": ints(2, 2, lo=0, hi=3), "x4": rand(1, 8, 2, 3)}
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    inits = {"zero": i64(0), "minus1": i64(-1), "shape0": i64(0, 0, 2, 2), "eshape": i64(2, 5, 3),
             "st": i64(-1, 0), "en": i64(-100, 4), "ax": i64(1, 2), "step": i64(-2, 2), "gidx": np.array(-1),
             "uax": i64(0, -1), "splits": i64(1, 3), "reps": i64(1, 2, 1), "pads": i64(0, 1, 2, 0, 2, 1),
             "padv": np.array(0.5, np.float32), "r0": np.array(0), "r1": np.array(4), "r2": np.array(1)}
    outs = tuple(o for o in [n.output[0] for n in nodes] + ["SplitB"] if o[0].isupper())
    model, refs = make(nodes, inputs, inits, outs, opset=18)
    c = check(model, inputs, refs, target)
    assert c.onnx_report.folded >= 5  # Shape, Gather, Concat, ConstantOfShape, Range, Cast, Constant
    assert "shape" not in str(c.imported.gm.graph).lower()


@pytest.mark.parametrize("target", TARGETS)
def test_split_opsets(target):
    """Split: `split` as an input (13) and `num_outputs` with a smaller last part (18)."""
    inputs = {"x": rand(7, 3)}
    m13, r13 = make([N("Split", ["x", "s"], ["a", "b"])], inputs, {"s": np.array([3, 4])}, ("a", "b"), 13)
    check(m13, inputs, r13, target)
    m18, r18 = make([N("Split", ["x"], ["a", "b", "c"], num_outputs=3)], inputs, None, ("a", "b", "c"), 18)
    check(m18, inputs, r18, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("opset", [16, 20])
def test_grid_sample(opset, target):
    linear = "bilinear" if opset < 20 else "linear"
    nodes = [N("GridSample", ["x", "grid"], ["Bilinear"], mode=linear),
             N("GridSample", ["x", "grid"], ["NearestBorder"], mode="nearest", padding_mode="border",
               align_corners=1),
             N("GridSample", ["x", "grid"], ["Reflection"], mode=linear, padding_mode="reflection")]
    inputs = {"x": rand(2, 3, 5, 7), "grid": rand(2, 4, 6, 2, lo=-1.3, hi=1.3)}
    model, refs = make(nodes, inputs, None, tuple(n.output[0] for n in nodes), opset)
    check(model, inputs, refs, target)


@pytest.mark.parametrize("target", TARGETS)
def test_resize(target):
    sc = lambda *v: np.array(v, np.float32)  # noqa: E731
    nodes = [N("Resize", ["x", "", "s2"], ["Linear"], mode="linear"),
             N("Resize", ["x", "", "s2"], ["NearestFloor"], mode="nearest",
               coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             N("Resize", ["x", "", "s_down"], ["NearestDefault"], mode="nearest"),
             N("Resize", ["x", "", "", "size"], ["CubicAlign"], mode="cubic",
               coordinate_transformation_mode="align_corners"),
             N("Resize", ["x", "", "s_down"], ["LinearPytorch"], mode="linear",
               coordinate_transformation_mode="pytorch_half_pixel"),
             N("Resize", ["x", "", "", "size_hw"], ["CubicExclude"], mode="cubic", axes=[2, 3], exclude_outside=1,
               cubic_coeff_a=-0.5)]
    inputs = {"x": rand(1, 2, 5, 6)}
    inits = {"s2": sc(1, 1, 2, 1.5), "s_down": sc(1, 1, 0.6, 0.5), "size": np.array([1, 2, 7, 4]),
             "size_hw": np.array([8, 3])}
    model, refs = make(nodes, inputs, inits, tuple(n.output[0] for n in nodes), opset=19)
    check(model, inputs, refs, target)


# --- models exported by torch.onnx.export ------------------------------------------------------
# The TorchScript exporter (dynamo=False) needs no onnxscript; it warns that it is deprecated.

def export(module: torch.nn.Module, args: tuple, path: str, **kw) -> str:
    module.eval()
    torch.onnx.export(module, args, path, dynamo=False, opset_version=17, **kw)
    return path


def check_exported(path: str, module: torch.nn.Module, args: tuple, target: str, *, strict: bool = True,
                   rtol: float = 1e-4, atol: float = 1e-4):
    """gac vs onnxruntime and vs eager PyTorch (deep graphs: atol 1e-4)."""
    sess = ort.InferenceSession(path)
    refs = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})
    c = gac_torch.compile(path, target=target, options={"fallback": not strict})
    assert not c.onnx_report.unsupported, c.onnx_report.summary()
    outs = c(*[a.to(device_of(target)) for a in args])
    outs = outs if isinstance(outs, tuple) else (outs,)
    with torch.no_grad():
        eager = module(*args)
    eager = eager if isinstance(eager, tuple) else (eager,)
    for o, r, e in zip(outs, refs, eager):
        torch.testing.assert_close(o.cpu(), torch.from_numpy(r), rtol=rtol, atol=atol)
        torch.testing.assert_close(o.cpu(), e, rtol=rtol, atol=atol)
    return c


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
    model, refs = make([N("MatMul", ["x", "w"], ["y"])], inputs, {"w": rand(64, 8)})
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
    nodes = [N("LRN", ["x"], ["a"], size=3), N("Relu", ["a"], ["b"]), N("Hardmax", ["b"], ["c"]),
             N("LpNormalization", ["c"], ["d"]), N("LRN", ["d"], ["e"], size=3), N("Mul", ["e", "x"], ["y"])]
    return make(nodes, inputs)[0], inputs


def test_strict_mode_lists_every_unknown_op():
    model, _ = _unknown_ops_model()
    with pytest.raises(OnnxUnsupportedError) as err:
        gac_torch.compile(model, options={"fallback": False})
    msg = str(err.value)
    for op in ("LRN: 2 node(s)", "Hardmax", "LpNormalization"):
        assert op in msg, msg


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
    x = helper.make_tensor_value_info("x", T.FLOAT, [2])
    graph = helper.make_graph([N("Relu", ["x"], ["y"])], "g", [x], [helper.make_tensor_value_info("y", T.FLOAT, [2])])
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

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
             N("Gemm", ["m", "w2", "c"], ["Gemm"], transB=1, alpha=0.5, beta=2.0),
             N("Gemm", ["mt", "w2t"], ["GemmT"], transA=1),
             N("Einsum", ["a", "bt"], ["Einsum"], equation="bij,bjk->bik")]
    inputs = {"a": rand(2, 5, 6), "bt": rand(2, 6, 3), "m": rand(4, 6), "mt": rand(6, 4)}
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

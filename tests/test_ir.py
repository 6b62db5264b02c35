"""The gac dialect itself: IRDL registration, builders' type inference, the gac-verify pass."""

from __future__ import annotations

import pytest
import torch
from mlir import ir, passmanager
from mlir.dialects import func

from gac_torch.ir.builder import GacBuilder
from gac_torch.ir.dialect import OPS, make_context
from gac_torch.ir.ops._infer import GacTypeError
from gac_torch.ir.types import tensor_type
from gac_torch.ir.verifier import add_verify_pass, verify_gac

pytestmark = pytest.mark.unit  # the fast tier: pure Python, no model compile

GOOD = """
func.func @main(%a: tensor<2x3xf32>, %b: tensor<3xf32>) -> tensor<3x2xf32> {
  %0 = "gac.binary"(%a, %b) {kind = "add"} : (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x3xf32>
  %1 = "gac.transpose"(%0) {perm = array<i64: 1, 0>} : (tensor<2x3xf32>) -> tensor<3x2xf32>
  return %1 : tensor<3x2xf32>
}
"""


def test_round_trip_and_registered_ops():
    ctx = make_context()
    with ctx:
        m = ir.Module.parse(GOOD)
        assert m.operation.verify()
        again = ir.Module.parse(str(m))
        assert str(again) == str(m)
    assert {"unary", "binary", "matmul", "conv", "reduce", "softmax", "layer_norm", "constant",
            "cast", "reshape", "transpose", "concat"} <= set(OPS)


def test_wrapping_gac_ops_imports_nothing(monkeypatch):
    # the bindings import the dialect's Python module (mlir.dialects.gac) each time they wrap an
    # op until one import succeeds: a failed search per gac op cost 1-4 s per BEVFormer compile
    import sys

    searched = []

    class Spy:
        def find_spec(self, name, path=None, target=None):
            searched.append(name)

    monkeypatch.setattr(sys, "meta_path", [Spy(), *sys.meta_path])
    with make_context():
        m = ir.Module.parse(GOOD)
        body = m.body.operations[0].regions[0].blocks[0]
        names = [op.name for _ in range(3) for op in body.operations]
    assert names.count("gac.binary") == 3 and not searched


@pytest.mark.parametrize("bad, message", [
    (GOOD.replace('kind = "add"', 'kind = "plus"'), "does not satisfy the constraint"),
    (GOOD.replace('"gac.binary"(%a, %b)', '"gac.binary"(%a)').replace("(tensor<2x3xf32>, tensor<3xf32>) ->", "(tensor<2x3xf32>) ->"), "operands"),
    (GOOD.replace(' {perm = array<i64: 1, 0>}', ''), "perm"),
])
def test_irdl_rejects_malformed_ops(bad, message):
    with make_context():
        with pytest.raises(Exception, match=message):
            ir.Module.parse(bad)


def test_verifier_catches_shape_rules_irdl_cannot():
    wrong = GOOD.replace("-> tensor<3x2xf32>\n  return", "-> tensor<2x3xf32>\n  return").replace(
        "(tensor<2x3xf32>) -> tensor<3x2xf32>", "(tensor<2x3xf32>) -> tensor<2x3xf32>").replace(
        "-> tensor<3x2xf32> {", "-> tensor<2x3xf32> {").replace("return %1 : tensor<3x2xf32>", "return %1 : tensor<2x3xf32>")
    with make_context(), ir.Location.unknown():
        m = ir.Module.parse(wrong)  # IRDL accepts it
        assert m.operation.verify()
        with pytest.raises(GacTypeError, match="gac.transpose"):
            verify_gac(m)
        pm = passmanager.PassManager()
        add_verify_pass(pm)
        with pytest.raises(Exception, match="gac.transpose"):
            pm.run(m.operation)


def test_builder_infers_and_rejects():
    with make_context(), ir.Location.unknown():
        m = ir.Module.create()
        with ir.InsertionPoint(m.body):
            f = func.FuncOp("main", ir.FunctionType.get(
                [tensor_type((4, 1, 5), torch.float32), tensor_type((3, 1), torch.float32),
                 tensor_type((5, 2), torch.float16)], []))
            block = f.add_entry_block()
        with ir.InsertionPoint(block):
            b = GacBuilder()
            x, y, h = block.arguments
            s = b.binary(x, y, kind="mul")
            assert list(ir.RankedTensorType(s.type).shape) == [4, 3, 5]
            c = b.binary(x, y, kind="lt")
            assert str(ir.RankedTensorType(c.type).element_type) == "i1"
            r = b.reduce(s, kind="sum", dims=[1], keepdim=True)
            assert list(ir.RankedTensorType(r.type).shape) == [4, 1, 5]
            with pytest.raises(GacTypeError, match="share one element type"):
                b.binary(x, h, kind="add")
            with pytest.raises(GacTypeError, match="do not broadcast"):
                b.binary(x, b.cast(b.reshape(h, [10]), torch.float32), kind="add")
            with pytest.raises(GacTypeError, match="cannot multiply"):
                flat = b.reshape(x, [4, 5])
                b.matmul(flat, flat, result_type=tensor_type((4, 5), torch.float32))
            func.ReturnOp([])


DYNAMIC = """
func.func @main(%x: tensor<?x64xf32>, %n: index) -> tensor<?x4x16xf32> {
  %d = "gac.dim"(%x) {dim = 0} : (tensor<?x64xf32>) -> index
  %0 = "gac.reshape"(%x, %d) : (tensor<?x64xf32>, index) -> tensor<?x4x16xf32>
  %b = "gac.binary"(%0, %0) {kind = "add"} : (tensor<?x4x16xf32>, tensor<?x4x16xf32>) -> tensor<?x4x16xf32>
  return %b : tensor<?x4x16xf32>
}
"""


def test_run_time_sizes_verify():
    """`?` dims: gac.dim reads a size, reshape/broadcast take one index operand per `?`."""
    with make_context(), ir.Location.unknown():
        m = ir.Module.parse(DYNAMIC)
        assert m.operation.verify()
        verify_gac(m)
        missing = ir.Module.parse(DYNAMIC.replace('"gac.reshape"(%x, %d) : (tensor<?x64xf32>, index)',
                                                  '"gac.reshape"(%x) : (tensor<?x64xf32>)'))
        with pytest.raises(GacTypeError, match="0 size operand.*1 run-time size"):
            verify_gac(missing)
        with pytest.raises(Exception, match="index"):  # IRDL: sizes are index values
            ir.Module.parse(DYNAMIC.replace("%x: tensor<?x64xf32>, %n: index", "%x: tensor<?x64xf32>, %n: i64")
                            .replace('"gac.reshape"(%x, %d) : (tensor<?x64xf32>, index)',
                                     '"gac.reshape"(%x, %n) : (tensor<?x64xf32>, i64)'))


def test_run_time_sizes_in_shape_rules():
    from gac_torch.ir.ops._infer import broadcast_shapes
    from gac_torch.ir.types import DYN

    assert broadcast_shapes((DYN, 1), (DYN, 64)) == (DYN, 64)
    assert broadcast_shapes((DYN, 3), (3,)) == (DYN, 3)
    assert broadcast_shapes((DYN,), (5,)) == (5,)  # a static size pins a run-time one
    with pytest.raises(GacTypeError):
        broadcast_shapes((4, DYN), (5, DYN))
    with make_context(), ir.Location.unknown():
        m = ir.Module.create()
        with ir.InsertionPoint(m.body):
            fn = func.FuncOp("f", ir.FunctionType.get([tensor_type([DYN, 8], torch.float32)], []))
            block = fn.add_entry_block()
        with ir.InsertionPoint(block):
            b = GacBuilder()
            x = block.arguments[0]
            whole = b.slice(x, starts=[0, 2], limits=[DYN, 6], strides=[1, 1])
            assert ir.RankedTensorType(whole.type).shape == [DYN, 4]
            with pytest.raises(GacTypeError, match="taken whole or by a fixed window"):
                b.slice(x, starts=[1, 0], limits=[DYN, 8], strides=[1, 1])
            window = b.slice(x, starts=[1, 0], limits=[3, 8], strides=[1, 1])
            assert ir.RankedTensorType(window.type).shape == [2, 8]

"""User-facing behaviour: input checks, strict mode, options, dumps, explain, IR stages."""

from __future__ import annotations

import math
import os

import pytest
import torch

import gac_torch
from gac_torch.errors import GacUnsupportedError
from gac_torch.errors import GacInputError
from models import build


@pytest.fixture(scope="module")
def mlp_compiled():
    model, inputs = build("mlp")
    return model, inputs, gac_torch.compile(model, inputs)


def test_wrong_dtype_is_a_clear_error(mlp_compiled):
    _, (x,), f = mlp_compiled
    with pytest.raises(GacInputError, match="expected dtype torch.float32, got torch.float64"):
        f(x.double())


def test_wrong_shape_is_a_clear_error(mlp_compiled):
    _, (x,), f = mlp_compiled
    with pytest.raises(GacInputError, match=r"expected shape \[8, 32\], got \[4, 32\]"):
        f(x[:4])


def test_wrong_device_is_a_clear_error(mlp_compiled):
    _, (x,), f = mlp_compiled
    with pytest.raises(GacInputError, match="compiled for cpu tensors, got one on meta"):
        f(x.to("meta"))


def test_wrong_input_count(mlp_compiled):
    _, (x,), f = mlp_compiled
    with pytest.raises(GacInputError, match="expected 1 inputs, got 2"):
        f(x, x)


def test_non_contiguous_input(mlp_compiled):
    model, (x,), f = mlp_compiled
    xt = x.t().contiguous().t()  # same values, column-major strides
    assert not xt.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(f(xt), model(x), rtol=1e-4, atol=1e-4)


def test_cuda_target_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model, inputs = build("mlp")
    with pytest.raises(Exception, match="(?i)gpu|cuda"):
        gac_torch.compile(model, inputs, target="cuda")(*inputs)


def test_strict_mode_lists_every_unsupported_op_once():
    class TwoUnsupported(torch.nn.Module):
        def forward(self, x):
            return torch.special.i0(x) + torch.special.i0(x * 2) + torch.digamma(x.abs() + 1)

    x = torch.rand(4, 4) + 0.5
    with pytest.raises(GacUnsupportedError) as err:
        gac_torch.compile(TwoUnsupported(), (x,), options={"fallback": False})
    msg = str(err.value)
    assert "aten.i0.default: 2 node(s)" in msg and "aten.digamma.default: 1 node(s)" in msg
    # default: the same model runs, with those ops in eager
    f = gac_torch.compile(TwoUnsupported(), (x,))
    torch.testing.assert_close(f(x), TwoUnsupported()(x), rtol=1e-5, atol=1e-5)
    assert f.report.compiled > 0 and len(f.report.unsupported) == 2


def test_strict_mode_through_torch_compile():
    torch._dynamo.reset()
    model, inputs = build("unsupported")
    cm = torch.compile(model, backend="gac", options={"fallback": False})
    with pytest.raises(Exception, match="i0"):
        with torch.no_grad():
            cm(*inputs)


def test_unknown_option_lists_valid_ones():
    model, inputs = build("mlp")
    with pytest.raises(gac_torch.OptionError, match=r"unknown gac option\(s\) \['falback'\]; valid options: .*fallback"):
        gac_torch.compile(model, inputs, options={"falback": False})
    torch._dynamo.reset()
    with pytest.raises(Exception, match="falback"):
        torch.compile(model, backend="gac", options={"falback": False})(*inputs)


def test_dump_dir_writes_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_DUMP_DIR", str(tmp_path))
    model, inputs = build("mlp")
    gac_torch.compile(model, inputs)
    (graph_dir,) = list(tmp_path.iterdir())
    files = sorted(os.listdir(graph_dir))
    assert "fx_graph.txt" in files
    for stage in ("gac", "linalg", "llvm"):
        assert f"fused_0.{stage}" in files
    assert '"gac.matmul"' in (graph_dir / "fused_0.gac").read_text()
    assert "linalg.matmul" in (graph_dir / "fused_0.linalg").read_text()
    assert "llvm.func" in (graph_dir / "fused_0.llvm").read_text()


def test_ir_stages(mlp_compiled):
    _, _, f = mlp_compiled
    assert f.stages == ["gac", "linalg", "llvm"]
    assert "gac.matmul" in f.ir("gac") and "dense<" not in f.ir("gac").split("gac.matmul")[0][-400:]
    with pytest.raises(KeyError, match="no stage 'ptx'"):
        f.ir("ptx")


def test_weights_are_arguments_not_attributes():
    model, inputs = build("cnn")
    f = gac_torch.compile(model, inputs)
    text = f.ir("gac")
    # weights come in as function arguments; every constant in the module is tiny
    signature = text.split("func.func @main")[1].split("{")[0]
    assert "tensor<16x3x3x3xf32>" in signature and "tensor<32x8x3x3xf32>" in signature
    for line in text.splitlines():
        if "gac.constant" in line:
            dims = line.rsplit("tensor<", 1)[1].split("x")[:-1]
            assert math.prod(int(d) for d in dims) <= 16, line


def test_explain_reports_support_and_reasons():
    model, inputs = build("unsupported")
    report = gac_torch.explain(model, *inputs)
    assert 0 < report.compiled < report.total
    assert any("i0" in op and why == "no lowering" for op, why in report.unsupported)
    assert "ATen nodes compiled" in str(report)


def test_compile_rejects_bad_program():
    with pytest.raises(TypeError, match="ExportedProgram, an nn.Module"):
        gac_torch.compile(42)
    with pytest.raises(TypeError, match="needs example_inputs"):
        gac_torch.compile(torch.nn.Linear(2, 2))


def test_multiple_outputs_and_scalar_input():
    class M(torch.nn.Module):
        def forward(self, x, s):
            return x * s, (x + s).sum(-1), {"max": x.amax(0)}

    x, s = torch.randn(3, 5), torch.tensor(2.5)
    f = gac_torch.compile(M(), (x, s))
    got, want = f(x, s), M()(x, s)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2]["max"], want[2]["max"])


def test_host_scalar_tensor_moves_to_the_target_device():
    """Eager lets a 0-d CPU tensor stand next to device tensors (as a scalar); a compiled graph
    takes it too, moved to its device (shown with the meta device: no GPU needed). Other
    tensors on the wrong device are still refused."""
    from gac_torch.backends.base import Signature, TensorSpec
    from gac_torch.errors import GacInputError
    from gac_torch.runtime.compiled import CompiledGraph

    seen = []

    class Recorder:
        def run(self, inputs, outputs):
            seen.extend(t.device.type for t in inputs)

    sig = Signature((TensorSpec((3,), torch.float32), TensorSpec((), torch.float32)),
                    (TensorSpec((3,), torch.float32),))
    cg = CompiledGraph("g", Recorder(), sig, "meta", {}, ["x", "s"], tuple_output=False)
    out = cg(torch.empty(3, device="meta"), torch.tensor(2.0))
    assert seen == ["meta", "meta"] and out.device.type == "meta"
    with pytest.raises(GacInputError, match="compiled for meta tensors"):
        cg(torch.empty(3), torch.tensor(2.0))


@pytest.mark.cuda
def test_cpu_scalar_tensor_next_to_cuda_tensors():
    torch._dynamo.reset()

    def f(x, s):
        return (x - s).masked_fill(x > 0, 0.5) * s

    x, s = torch.randn(5, 7, device="cuda"), torch.tensor(1.5)
    torch.testing.assert_close(torch.compile(f, backend="gac")(x, s), f(x, s))


def test_compile_graph_generates_the_graph_code_once(monkeypatch):
    """compile_graph edits the graph several times (asserts dropped, dead code, partitions fused)
    and regenerates its Python code in partition() only (each recompile of a BEVFormer-sized
    graph costs ~0.1 s): none before it, none after it, and the code is current."""
    import gac_torch.frontends.fx as fx_frontend
    from gac_torch.legalize import decompositions
    from gac_torch.options import resolve

    model, inputs = build("mlp")
    gm = torch.export.export(model, inputs).run_decompositions(decompositions()).graph_module
    recompiled, seen = [], {}
    recompile, partition = torch.fx.GraphModule.recompile, fx_frontend.partition
    monkeypatch.setattr(torch.fx.GraphModule, "recompile",
                        lambda self: (recompiled.append(self), recompile(self))[1])

    def counted_partition(g, *args):
        seen["before"] = sum(m is gm for m in recompiled)
        out = partition(g, *args)
        seen["in"] = sum(m is gm for m in recompiled) - seen["before"]
        return out
    monkeypatch.setattr(fx_frontend, "partition", counted_partition)
    compiled = fx_frontend.compile_graph(gm, resolve({}, target="cpu"))
    assert compiled.partitions and seen["before"] == 0 and seen["in"] >= 1
    assert sum(m is gm for m in recompiled) == seen["in"]  # nothing after partition()
    assert compiled.gm.code == compiled.gm.graph.python_code(root_module="self").src

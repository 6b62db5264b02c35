"""The gac-torch command line: `report` (coverage before compiling) and `compile` (IR stages per
partition, written without loading: cuda compiles to PTX on a machine without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from gac_torch.cli import main

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """MatMul -> Add -> Relu -> LRN (no gac mapping) -> Mul, opset 17."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "x"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Reshape", ["r", "s4"], ["r4"]),
             helper.make_node("LRN", ["r4"], ["l"], size=3), helper.make_node("Mul", ["l", "l"], ["y"])]
    s4 = numpy_helper.from_array(np.array([1, 2, 4, 8], np.int64), "s4")
    graph = helper.make_graph(nodes, "cli", [helper.make_tensor_value_info("x", T.FLOAT, [8, 8])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 2, 4, 8])], [w, s4])
    path = str(tmp_path_factory.mktemp("cli") / "model.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path


def test_report(model_path, capsys):
    assert main(["report", model_path]) == 0
    out = capsys.readouterr().out
    assert "5/6 ONNX nodes supported (83.3%)" in out
    assert "LRN" in out and "x1" in out and "no ONNX -> ATen mapping" in out
    assert "ATen:" in out and "before compiling" in out


def test_compile_cpu(model_path, tmp_path, capsys):
    out_dir = str(tmp_path / "out")
    assert main(["compile", model_path, "--target", "cpu", "-o", out_dir]) == 0
    files = set(os.listdir(out_dir))
    for stage in ("gac", "linalg", "llvm"):
        assert f"fused_0.{stage}" in files, files
    assert {"graph.fx.txt", "report.txt"} <= files
    gac = "".join(open(os.path.join(out_dir, f)).read() for f in files if f.endswith(".gac"))
    assert '"gac.matmul"' in gac and "fused_1.gac" in files  # two partitions, around the LRN
    assert "llvm.func" in open(os.path.join(out_dir, "fused_0.llvm")).read()
    assert "LRN" in open(os.path.join(out_dir, "report.txt")).read()


def test_compile_cuda_ptx_without_gpu(model_path, tmp_path):
    out_dir = str(tmp_path / "cuda")
    assert main(["compile", model_path, "--target", "cuda", "--arch", "sm_90", "-o", out_dir]) == 0
    ptx = open(os.path.join(out_dir, "fused_0.ptx")).read()
    assert ".target sm_90" in ptx and ".entry" in ptx
    assert {"fused_0.gac", "fused_0.linalg", "fused_0.llvm"} <= set(os.listdir(out_dir))


def test_compile_strict_fails_on_fallback(model_path, tmp_path, capsys):
    assert main(["compile", model_path, "--strict", "-o", str(tmp_path / "strict")]) == 1
    err = capsys.readouterr().err
    assert "LRN" in err and "Traceback" not in err
    with pytest.raises(Exception, match="LRN"):  # --traceback: the exception itself
        main(["--traceback", "compile", model_path, "--strict", "-o", str(tmp_path / "strict")])


def test_compile_torch_export_archive(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Sigmoid())
    ep = torch.export.export(model, (torch.randn(2, 4),))
    path = str(tmp_path / "m.pt2")
    torch.export.save(ep, path)
    assert main(["compile", path, "-o", str(tmp_path / "pt2")]) == 0
    assert os.path.exists(tmp_path / "pt2" / "fused_0.llvm")


def test_console_script(model_path):
    """The installed entry point (python -m runs the same main when the script is not on PATH)."""
    proc = subprocess.run([sys.executable, "-m", "gac_torch.cli", "report", model_path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ONNX nodes supported" in proc.stdout


def test_ordinary_mistakes_are_one_line_without_traceback(model_path, tmp_path, capsys):
    """Missing file, corrupt file, a bad or unknown --shape: exit status 2 (usage) or 1, one
    line on stderr, no Python traceback; `python -m gac_torch --version` works."""
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07not a protobuf at all" * 3)
    cases = [(["report", str(tmp_path / "missing.onnx")], 2, "no such file"),
             (["report", model_path, "--shape", "x=8xQ"], 2, "--shape expects"),
             (["report", model_path, "--shape", "nope=8x8"], 2, "no input named"),
             (["compile", str(corrupt), "-o", str(tmp_path / "o")], 1, "error")]
    for argv, status, message in cases:
        assert main(argv) == status, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    p = subprocess.run([sys.executable, "-m", "gac_torch", "report", str(tmp_path / "missing.onnx")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("gac-torch: error: no such file"), p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "gac_torch", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("gac-torch ")


def test_compile_vortex_writes_the_binary(model_path, tmp_path):
    pytest.importorskip("ziglang")
    pytest.importorskip("elftools")
    from gac_torch.backends.vortex.vxbin import read_vxbin

    out_dir = tmp_path / "vx"
    assert main(["compile", model_path, "--target", "vortex", "-o", str(out_dir)]) == 0
    data = (out_dir / "fused_0.vxbin").read_bytes()
    assert read_vxbin(data).kernels  # a real .vxbin with kernels, not the text listing


def test_shape_is_honoured_for_pt2(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    ep = torch.export.export(M(), (torch.randn(5, 4),), dynamic_shapes=({0: torch.export.Dim("n")},))
    path = str(tmp_path / "dyn.pt2")
    torch.export.save(ep, path)
    assert main(["compile", path, "-o", str(tmp_path / "dyn")]) == 0
    assert "?x4" in (tmp_path / "dyn" / "fused_0.gac").read_text()  # run-time size without --shape
    assert main(["compile", path, "--shape", "x=3x4", "-o", str(tmp_path / "st")]) == 0
    gac = (tmp_path / "st" / "fused_0.gac").read_text()
    assert "3x4" in gac and "?x4" not in gac

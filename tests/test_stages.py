"""The stage contract: every target stage declares its kind, and a compile resumes from a dumped
(possibly edited) stage file: `gac_torch.compile_stage_file` and `gac-torch compile fused_0.linalg`."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import gac_torch
from gac_torch.backends import STAGE_KINDS, Signature, TensorSpec, get_target, stages_only
from gac_torch.cli import main as cli
from gac_torch.frontends.fx import compile_graph
from gac_torch.legalize import decompositions
from gac_torch.options import resolve


class _AddOne(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x) + 1.0


def _dump(target: str, tmp_path) -> tuple[str, object]:
    """Compile _AddOne for `target` (stages only) with every stage dumped; the dump folder and
    the partition."""
    ep = torch.export.export(_AddOne(), (torch.randn(4, 5),))
    gm = ep.run_decompositions(decompositions()).graph_module
    options = resolve({"fallback": False, "dump_dir": str(tmp_path / "dump")}, target=target)
    compiled = compile_graph(gm, options, target=stages_only(get_target(target)))
    (folder,) = glob.glob(str(tmp_path / "dump" / "graph_*"))
    (part,) = compiled.partitions.values()
    return folder, part


@pytest.mark.parametrize("target", ["cpu", "cuda", "vortex"], ids=["on-cpu", "on-cuda", "on-vortex"])
def test_every_stage_declares_a_kind(target) -> None:
    # (ids: a parameter named "cuda" would mark the test as needing a GPU)
    stages = get_target(target).stages(resolve({}, target=target))
    assert stages and all(st.kind in STAGE_KINDS for st in stages)
    assert [st.name for st in stages if st.kind == "bytes"] == (["vxbin"] if target == "vortex" else [])


def test_an_edited_linalg_file_compiles_and_runs_on_cpu(tmp_path) -> None:
    from gac_torch.backends.cpu.target import CpuExecutable

    folder, _ = _dump("cpu", tmp_path)
    path = os.path.join(folder, "fused_0.linalg")
    text = open(path).read()
    assert text.count("1.000000e+00 : f32") == 1, text
    edited = tmp_path / "fused_0.linalg"
    edited.write_text(text.replace("1.000000e+00 : f32", "2.500000e+00 : f32"))
    stages, module = gac_torch.compile_stage_file(edited, target="cpu")
    assert list(stages) == ["linalg", "llvm"]
    spec = TensorSpec((4, 5), torch.float32)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    out = torch.full((4, 5), float("nan"))
    CpuExecutable(module, Signature((spec,), (spec,))).run([x], [out])
    torch.testing.assert_close(out, torch.tanh(x) + 2.5)


def test_cuda_resumes_from_linalg_and_gpu_to_the_same_ptx(tmp_path) -> None:
    folder, part = _dump("cuda", tmp_path)
    ptx = part.executable.ptx
    assert ptx
    for stage in ("linalg", "gpu"):
        stages, program = gac_torch.compile_stage_file(os.path.join(folder, f"fused_0.{stage}"), target="cuda")
        assert list(stages)[-1] == "ptx" and program.ptx == ptx, stage
        assert [k.kernel for k in program.launches] == [k.kernel for k in part.executable.launches]
    with pytest.raises(ValueError, match="can from: gac, linalg, gpu"):
        gac_torch.compile_stage_file(os.path.join(folder, "fused_0.ptx"), target="cuda")


def test_gac_file_resumes_for_vortex(tmp_path) -> None:
    folder, part = _dump("vortex", tmp_path)
    stages, _ = gac_torch.compile_stage_file(os.path.join(folder, "fused_0.gac"), target="vortex",
                                             options={})
    assert stages["llvm"] == part.stages["llvm"]


def test_cli_compiles_a_dumped_stage(tmp_path, capsys) -> None:
    folder, part = _dump("cuda", tmp_path)
    out = tmp_path / "out"
    assert cli(["compile", os.path.join(folder, "fused_0.linalg"), "--target", "cuda", "--arch", "sm_90",
                "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["fused_0.gpu", "fused_0.llvm", "fused_0.ptx"]
    assert (out / "fused_0.ptx").read_text() == part.stages["ptx"]


@pytest.mark.parametrize("target", ["cuda", "vortex"], ids=["on-cuda", "on-vortex"])
def test_gpu_stages_rewrite_the_module_in_place(target) -> None:
    """No print-and-parse between stages (on a whole model it cost more than a stage): the linalg
    module the driver hands over is the one the gpu stage schedules and the llvm stage lowers
    (cuda: a copy of its kernels, the module is printed and freed while they compile)."""
    import dataclasses

    from mlir import ir

    seen = []
    base = stages_only(get_target(target))

    def stages(options):
        def spy(st):
            def run(artifact):
                result = st.run(artifact)
                seen.append((artifact, getattr(result, "module", result)))  # (as the stage returned it)
                return result
            return dataclasses.replace(st, run=run)
        return [spy(st) for st in base.stages(options) if st.name != "vxbin"]  # vxbin: the toolchain

    ep = torch.export.export(_AddOne(), (torch.randn(4, 5),))
    gm = ep.run_decompositions(decompositions()).graph_module
    compiled = compile_graph(gm, resolve({"fallback": False}, target=target),
                             target=dataclasses.replace(base, stages=stages))
    (linalg, gpu), (_, llvm) = seen[:2]
    assert isinstance(linalg, ir.Module) and gpu is linalg
    if target == "cuda":  # the kernels are lowered one by one from it (backends/cuda/kernel_jobs.py)
        assert llvm.kernels and "llvm.func" in llvm.text and "gpu.launch_func" not in llvm.text
    (part,) = compiled.partitions.values()
    assert "gpu.launch_func" in part.stages["gpu"] and "linalg.generic" in part.stages["linalg"]

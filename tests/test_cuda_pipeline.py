"""CUDA target, compile side (CPU, CI): every case in cuda_cases.py compiles for sm_80 and sm_90,
ptxas accepts the PTX, the expected strategies are chosen, the launch list's dataflow holds
(a clobbered output is caught, an unsafe bufferization refused), the stage texts."""

from __future__ import annotations

import pytest

from gac_torch.backends.cuda import ptxas
from gac_torch.backends.cuda.target import TARGET, compile_options
from gac_torch.backends.gpu.program import ArgSpec, BufferRef, GpuProgram, KernelLaunch, TempBuffer
from gac_torch.passes.memory_plan import BufferUse, MemoryPlan, check_plan, plan_memory
from cuda_cases import CASES, compile_case, reduce_middle

# ------------------------------------------------------------------------------------------------
# CPU: compile + ptxas


_PTXAS = ptxas.find_ptxas()


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_and_ptxas_accepts(name: str) -> None:
    case = CASES[name]
    for arch in ("sm_80", "sm_90"):
        program = compile_case(case, arch)
        assert program.ptx.startswith("//") and f".target {arch}" in program.ptx
        kinds = {k.strategy for k in program.launches}
        if "wgmma" in kinds:  # sm_90's tensor-core GEMM for large aligned matmuls (else mma)
            kinds.add("mma")
        if "combo" in kinds:  # loops kernels reading only inputs, one launch (gpu/combine.py)
            kinds.add("loops")
        assert case.strategies <= kinds, (case.strategies, program.describe())
        assert all(len(k.access) == len(k.args) for k in program.launches)
        assert program.dataflow_errors(len(case.inputs)) == [], program.describe()
        assert {k.kernel for k in program.launches} <= {
            line.split("(")[0].split()[-1] for line in program.ptx.splitlines() if ".entry" in line}
        # a dev dependency CI installs: missing is a broken setup, never a skip
        assert _PTXAS is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
        target = "sm_90a" if ".target sm_90a" in program.ptx else arch  # (wgmma kernels)
        result = ptxas.assemble(program.ptx, target, _PTXAS)
        assert result.ok, result.log
        assert "spill" not in result.log or " 0 bytes spill stores" in result.log


def test_column_sums_are_two_kernels_of_a_thread_per_column() -> None:
    # a sum over the outer dim (a bias gradient: dy.sum(0)): kernel 1 has a thread per column and
    # chunk of 64 rows (consecutive threads, consecutive addresses), kernel 2 adds up the
    # chunks; before, a block per column read it a 4-byte sector at a time. Rows of the inner
    # dim keep a warp or a block per output
    program = compile_case(CASES["reduce_middle_1x1000x300"], "sm_90")
    red = [k for k in program.launches if k.strategy == "reduce"]
    assert [(k.grid, k.block) for k in red] == [((-(-300 * 16 // 256), 1, 1), (256, 1, 1)),
                                                 ((2, 1, 1), (256, 1, 1))], program.describe()
    program = compile_case(CASES["reduce_middle_8x500x33"], "sm_90")
    assert [k.grid for k in program.launches if k.strategy == "reduce"] == [(-(-8 * 33 * 8 // 256), 1, 1), (2, 1, 1)]
    program = compile_case(CASES["reduce_last_sum_300x1000_f32"], "sm_90")
    assert [k.grid for k in program.launches if k.strategy == "reduce"] == [(-(-300 // 8), 1, 1)]
    # past 8192 rows (a thread's chain of loads would grow): a block per column, as before
    program = compile_case(reduce_middle(1, 9000, 40), "sm_90")
    assert [k.grid for k in program.launches if k.strategy == "reduce"] == [(40, 1, 1)]


def test_stage_texts_and_options() -> None:
    case = CASES["mlp_softmax_graph"]
    artifact = case.mlir()
    texts = {}
    for stage in TARGET.stages({"arch": "sm_80"}):
        artifact = stage.run(artifact)
        texts[stage.name] = artifact.text
    assert list(texts) == ["gpu", "llvm", "ptx"]
    assert "gpu.launch_func" in texts["gpu"] and "gpu.module @gac_kernels" in texts["gpu"]
    assert "llvm.func" in texts["llvm"] and "nvvm" in texts["llvm"]
    assert ".target sm_80" in texts["ptx"] and "launch gac_k0_" in texts["ptx"]
    with pytest.raises(ValueError, match="unknown cuda arch"):
        compile_options({"arch": "sm_11"})
    assert TARGET.name == "cuda" and TARGET.device_type == "cuda"


def test_memory_plan_reuses_intermediates(monkeypatch: pytest.MonkeyPatch) -> None:
    from gac_torch.backends.gpu import schedule

    # the softmax as separate kernels (not one row kernel): more intermediates to plan
    monkeypatch.setattr(schedule, "map_rows", lambda *args: None)
    program = compile_case(CASES["mlp_softmax_graph"], "sm_90")
    assert len(program.temps) >= 3
    assert program.plan.workspace_size < program.plan.unplanned_size
    # Buffer lifetimes from the launch list; the plan must keep live buffers apart.
    steps: dict[int, list[int]] = {}
    for i, k in enumerate(program.launches):
        for a in k.args:
            if getattr(a, "kind", None) == "temp":
                steps.setdefault(a.index, []).append(i)
    uses = [BufferUse(t.name, t.nbytes, min(steps[i]), max(steps[i])) for i, t in enumerate(program.temps)]
    check_plan(uses, program.plan)


def _writers(program: GpuProgram, arg: int) -> list[int]:
    return [i for i, k in enumerate(program.launches)
            for a, m in zip(k.args, k.access) if a == BufferRef("arg", arg) and "w" in m.lower()]


def test_two_reductions_of_one_input_write_their_own_outputs() -> None:
    # Regression: CSE merged the zero fills of x.sum(2) and (x*x).sum(2); bufferization then
    # computed the second sum in output 1's buffer and copied it to output 2 after output 1's
    # own copy had overwritten it (output 2 returned output 1). Each output must now be written
    # by one kernel that reads only the input.
    for r in (50, 300):
        case = CASES[f"multi_two_reductions_shared_fill_r{r}"]
        program = compile_case(case, "sm_90")
        assert not program.temps, program.describe()
        for out in (1, 2):
            (w,) = _writers(program, out)
            k = program.launches[w]
            reads = {a for a, m in zip(k.args, k.access) if "r" in m and a != BufferRef("arg", out)}
            assert reads == {BufferRef("arg", 0)}, program.describe()
        assert _writers(program, 1) != _writers(program, 2)


def test_dataflow_checker_flags_a_clobbered_output() -> None:
    # The launch list the bug produced (fill; copy; two sums; copy temp -> out1; copy out1 -> out2).
    def k(i: int, *args: tuple[str, int, str]) -> KernelLaunch:
        return KernelLaunch(f"k{i}", (1, 1, 1), (32, 1, 1), 0,
                            tuple(BufferRef(kind, n) for kind, n, _ in args), "loops",  # type: ignore[arg-type]
                            tuple(m for _, _, m in args))

    plan = plan_memory([BufferUse("t0", 48, 1, 4)])
    args = [ArgSpec((3, 4, 50), "f32"), ArgSpec((3, 4), "f32"), ArgSpec((3, 4), "f32")]
    bad = GpuProgram("sm_90", "", [
        k(0, ("arg", 1, "W")), k(1, ("arg", 1, "r"), ("temp", 0, "W")),
        k(2, ("arg", 0, "r"), ("temp", 0, "rW")), k(3, ("arg", 0, "r"), ("arg", 1, "rW")),
        k(4, ("temp", 0, "r"), ("arg", 1, "W")), k(5, ("arg", 1, "r"), ("arg", 2, "W"))],
        [TempBuffer("t0", 48)], plan, args)
    errors = bad.dataflow_errors(1)
    assert any("overwrites arg1" in e and "launch 3" in e for e in errors), errors
    good = GpuProgram("sm_90", "", [k(0, ("arg", 0, "r"), ("arg", 1, "W")),
                                     k(1, ("arg", 0, "r"), ("arg", 2, "W"))], [], plan_memory([]), args)
    assert good.dataflow_errors(1) == []
    # inputs written, outputs never written, reads of unwritten temps, temps sharing bytes
    odd = GpuProgram("sm_90", "", [k(0, ("temp", 0, "r"), ("arg", 0, "W")), k(1, ("temp", 1, "W")),
                                    k(2, ("temp", 0, "W"), ("temp", 1, "r"), ("arg", 1, "W"))],
                      [TempBuffer("a", 64), TempBuffer("b", 64)],
                      MemoryPlan({"a": 0, "b": 0}, 256, 512), args)
    text = "\n".join(odd.dataflow_errors(1))
    for what in ("writes input arg0", "reads temp0 before any write", "output arg2 is never written",
                 "share workspace bytes"):
        assert what in text, text


def test_unsafe_bufferization_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the fix (memref destinations + eliminate-empty-tensors on shared fills) the
    # compile must fail loudly instead of returning a wrong program.
    from gac_torch.backends.gpu import bufferize

    monkeypatch.setattr(bufferize, "_tensor_destinations", lambda fn: None)
    monkeypatch.setattr(bufferize, "_unshare_fills", lambda fn: None)
    with pytest.raises(RuntimeError, match="dataflow invariants"):
        compile_case(CASES["multi_two_reductions_shared_fill_r50"], "sm_90")

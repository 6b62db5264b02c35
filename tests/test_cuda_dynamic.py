"""The cuda target with run-time sizes: one compilation whose kernels take the sizes as
arguments; the host program (grids, kernel scalars, temp sizes) is evaluated per call.

CPU tests check the host-side arithmetic, the per-shape binding against a static compilation of
the same shape, and the launch path against a fake driver; the cuda-marked test runs the
transformer block on the GPU for every (batch, sequence) of the issue's range with one
compilation.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from gac_torch.backends import get_target, stages_only
from gac_torch.backends.gpu.program import GpuProgram, Dyn, HostOp, ScalarArg, evaluate_host_ops
from gac_torch.frontends.fx import compile_graph
from gac_torch.legalize import decompositions
from gac_torch.options import resolve
from gac_torch.runtime.compiled import _evaluate
from models import MODEL_TOL, build
from test_cuda_runtime import _FakeDriver
from test_dynamic import _no_size_one_specialization

SHAPES = [(1, 7), (2, 9), (64, 130), (5, 33), (17, 64), (64, 7), (1, 130), (33, 100)]


def test_host_ops_evaluate_like_the_device():
    ops = [HostOp("size", (0,)), HostOp("dim", (1, 2)), HostOp("const", (-7,)), HostOp("const", (2,)),
           HostOp("ceildivui", (0, 3)), HostOp("divsi", (2, 3)), HostOp("remsi", (2, 3)),
           HostOp("floordivsi", (2, 3)), HostOp("cmpi", (2, 3), "ult"), HostOp("cmpi", (2, 3), "slt"),
           HostOp("muli", (0, 1)), HostOp("sitofp", (10,), type="f32"), HostOp("divf", (3, 11), type="f32"),
           HostOp("select", (9, 0, 1)), HostOp("trunci", (2,), type="i8"), HostOp("sitofp", (0,), type="bf16")]
    v = evaluate_host_ops(ops, [257, (3, 4, 11)])
    assert v[:4] == [257, 11, -7, 2]
    assert v[4:8] == [129, -3, -1, -4]  # ceil, trunc toward zero, its remainder, floor
    assert v[8:10] == [0, 1]  # -7 as unsigned is huge; signed it is less
    assert v[10] == 257 * 11 and v[11] == 2827.0
    assert v[12] == struct.unpack("<f", struct.pack("<f", 2 / 2827))[0]  # rounded to f32
    assert v[13] == 257 and v[14] == -7 and v[15] == 256.0  # 257 in bf16 (8 bits of mantissa)


@pytest.fixture(scope="module")
def attention():
    """The transformer block exported with batch/sequence Dims, compiled for cuda (stages only:
    CI has no GPU), and its program."""
    model, (x0,) = build("attention")
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=7, max=130)
    ep = torch.export.export(model, (x0,), dynamic_shapes=({0: batch, 1: seq},))
    gm = ep.run_decompositions(decompositions()).graph_module
    compiled = compile_graph(gm, resolve({"fallback": False}, target="cuda"), target=stages_only(get_target("cuda")))
    assert compiled.dynamic and len(compiled.partitions) == 1
    (cg,) = compiled.partitions.values()
    return model, cg


def _values(cg, b: int, t: int) -> list:
    """Per program argument: the shape (a tensor) or the int (a size) for input (b, t, 64)."""
    first = cg.signature.inputs[0]
    sizes = {first.shape[0]: b, first.shape[1]: t}
    return [tuple(_evaluate(d, sizes) for d in s.shape) if hasattr(s, "dtype") else _evaluate(s.expr, sizes)
            for s in (*cg.signature.inputs, *cg.signature.outputs)]


def test_attention_compiles_once_with_sizes_as_kernel_arguments(attention):
    _, cg = attention
    program: GpuProgram = cg.executable
    assert program.dynamic and program.host_ops and program.ptx
    assert any(isinstance(a, ScalarArg) and isinstance(a.value, Dyn) for k in program.launches for a in k.args)
    assert any(isinstance(g, Dyn) for k in program.launches for g in k.grid)
    assert "?" in program.describe() and ".param .u64" in program.ptx
    n_in = len(cg.signature.inputs)
    for b, t in SHAPES:
        bound = program.bind(_values(cg, b, t))
        assert not bound.dynamic and not bound.dataflow_errors(n_in)  # incl. no live temps overlap
        rows = b * t
        matmuls = [k for k in bound.launches if k.strategy == "matmul"]
        # the QKV projection: rows x 192 in 64x64 tiles
        assert matmuls[0].grid == (3, math.ceil(rows / 64), 1)
        assert max(t.nbytes for t in bound.temps) >= rows * 192 * 4
        assert bound.plan.workspace_size >= max(t.nbytes for t in bound.temps)


def test_attention_temps_scale_with_the_sizes(attention):
    """Each intermediate is a weight-sized constant, or scales with batch x sequence (activations)
    or batch x sequence^2 (attention scores): bound at two shapes, the sizes say which. (The
    transposed weights are read in place by the GEMMs, so no constant-size one need occur.)"""
    _, cg = attention
    small, large = cg.executable.bind(_values(cg, 2, 9)), cg.executable.bind(_values(cg, 5, 33))
    ratios = {1, (5 * 33) / (2 * 9), (5 * 33 * 33) / (2 * 9 * 9)}
    kinds = [next(r for r in ratios if math.isclose(b.nbytes / a.nbytes, r))
             for a, b in zip(small.temps, large.temps)]
    assert set(kinds) >= {(5 * 33) / (2 * 9), (5 * 33 * 33) / (2 * 9 * 9)}  # both scaling kinds occur


def test_dynamic_launch_path_without_gpu(attention, monkeypatch: pytest.MonkeyPatch):
    """Per call: the program is bound for the call's sizes (cached), launched with the bound
    grids and size arguments; the workspace grows to the largest plan."""
    from gac_torch.backends.cuda import runtime

    _, cg = attention
    program: GpuProgram = cg.executable
    fake = _FakeDriver(program)
    monkeypatch.setattr(runtime, "_driver", fake)
    monkeypatch.setattr(runtime, "check_available", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})())
    monkeypatch.setattr(runtime, "_raw_stream", lambda index: 7)  # the stream handle the launches use
    monkeypatch.setattr(runtime, "_capturing", lambda: False)
    exe = runtime.CudaExecutable(program, cg.signature)
    exe.use_graphs = False
    ptrs = [0x10000 * (i + 1) for i in range(len(program.args))]
    workspace = 0
    for b, t in [(2, 9), (64, 130), (2, 9), (2, 9)]:
        bound = exe.bind(_values(cg, b, t))
        fake.launched.clear()
        exe._launch_all(torch.device("cpu"), ptrs, bound)
        assert [x[1] for x in fake.launched] == [k.grid for k in bound.program.launches]
        for (_, _, _, _, params, _), k in zip(fake.launched, bound.program.launches):
            for a, raw in zip(k.args, params):
                if isinstance(a, ScalarArg):
                    assert struct.unpack("<q", raw)[0] == a.value and isinstance(a.value, int)
                elif a.kind == "arg":
                    assert struct.unpack("<Q", raw)[0] == ptrs[a.index]
        workspace = max(workspace, bound.program.plan.workspace_size)
        state = next(iter(exe._contexts.values()))
        assert state.workspaces[7].numel() == workspace
    # bound once per shape; argument tables: one per shape, plus one for (2, 9) again after the
    # workspace grew (new address); the last call reuses it
    assert len(exe._bound) == 2 and exe.stats["tables_built"] == 3
    assert fake.calls.count("load") == 1  # one PTX module for every size


@pytest.mark.cuda
def test_cuda_attention_compiles_once_for_every_batch_and_sequence(monkeypatch):
    """The issue's range on the GPU: batch 1..64 x sequence 7..130, one gac compilation
    through torch.compile(dynamic=True) and one through export Dims; results = eager (cuda)."""
    import gac_torch
    import gac_torch.frontends.dynamo as gac_dynamo
    import gac_torch.frontends.fx as gac_fx

    partitions = []
    orig = gac_fx.compile_partition
    monkeypatch.setattr(gac_fx, "compile_partition", lambda *a, **k: partitions.append(1) or orig(*a, **k))
    torch._dynamo.reset()
    model, (x0,) = build("attention")
    model = model.cuda()
    compiled = torch.compile(model, backend="gac", dynamic=True)
    gac_dynamo.compiled_graphs.clear()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad(), _no_size_one_specialization():
        for b, t in SHAPES:
            x = torch.randn(b, t, 64, generator=g).cuda()
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
    assert len(gac_dynamo.compiled_graphs) == 1 and len(partitions) == 1
    (graph,) = gac_dynamo.compiled_graphs
    assert graph.dynamic and graph.target == "cuda" and graph.report.compiled == graph.report.total
    (part,) = graph.partitions.values()
    assert part.executable.program.dynamic and len(part.executable._bound) == min(len(SHAPES), 16)

    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=7, max=130)
    ep = torch.export.export(model, (x0.cuda(),), dynamic_shapes=({0: batch, 1: seq},))
    prog = gac_torch.compile(ep, target="cuda")
    assert prog.dynamic and len(partitions) == 2
    with torch.no_grad():
        for b, t in SHAPES:
            x = torch.randn(b, t, 64, generator=g).cuda()
            torch.testing.assert_close(prog(x), model(x), **MODEL_TOL)
    assert len(partitions) == 2


def test_what_the_cuda_mapping_cannot_size_at_run_time_is_compiled_per_shape(monkeypatch):
    """A graph the cuda mapping can only handle for static shapes (here: forced) is compiled per
    shape, with the mapping's reason, instead of falling back to eager."""
    import gac_torch
    from gac_torch.backends.gpu import schedule

    def refuse(fn):
        raise gac_torch.GacUnsupportedError("forced by the test")

    monkeypatch.setattr(schedule, "dynamic_memrefs_as_metadata", refuse)
    model, (x0,) = build("attention")
    ep = torch.export.export(model, (x0,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    compiled = gac_torch.compile(ep, target="cuda")
    assert not compiled.dynamic and "cuda mapping: forced by the test" in compiled.compiled.reason

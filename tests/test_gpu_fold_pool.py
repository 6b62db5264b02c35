"""Kernel templates folded in worker processes while the gpu stage goes on (backends/gpu/
fold_pool.py, GAC_GPU_STAGE_WORKERS): the same module as folding them in-process, and a
worker that fails is a CompileError, not a hang."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from mlir import ir

import gac_torch
from gac_torch.backends.gpu import aside, fold_pool, fold_worker, strategy
from gac_torch.backends.gpu.irutil import block_ops, erase_if_unused, func_block, run_passes, users
from gac_torch.backends.gpu.strategy import deferred_splices, splice_template, template_cache
from gac_torch.errors import CompileError
from gac_torch.ir.dialect import make_context

from test_gpu_stage_reuse import HOST, TEMPLATE


def _spliced(monkeypatch, workers: int, ask_users: bool = False) -> tuple[str, int]:
    """HOST with TEMPLATE spliced twice (a repeat of a text still being folded) and a second
    text once; (the module's text, how many templates went to a worker)."""
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", str(workers))
    other = TEMPLATE.replace("%c3 = arith.constant 3", "%c3 = arith.constant 5")
    submitted = []
    real = fold_pool.FoldPool.submit
    monkeypatch.setattr(fold_pool.FoldPool, "submit", lambda self, t: submitted.append(t) or real(self, t))
    module = ir.Module.parse(HOST, make_context())
    with module.context, ir.Location.unknown():
        fn = module.body.operations[0].operation
        ops, args = block_ops(func_block(fn)), list(func_block(fn).arguments)
        with template_cache(), deferred_splices(1):
            splice_template(TEMPLATE, ops[1], [args[0]], args[2], "f32", "gac_k0_t")
            splice_template(TEMPLATE, ops[2], [args[1]], ops[0].results[0], "f32", "gac_k1_t")
            if ask_users:  # (an analysis asking who uses %b: its kernel is put in place first)
                assert {u.name for u in users(args[1])} == {"memref.store"}
            splice_template(other, ops[2], [args[0]], None, "f32", "gac_k2_t")
            if workers:
                assert strategy._cache.pending  # (not folded yet, or not put in place yet)
        assert module.operation.verify()
        return str(module), len(set(submitted))


@pytest.mark.unit
def test_templates_folded_by_workers_give_the_same_module(monkeypatch):
    serial, none = _spliced(monkeypatch, 0)
    parallel, sent = _spliced(monkeypatch, 2)
    asked, _ = _spliced(monkeypatch, 1, ask_users=True)
    assert none == 0 and sent == 2  # two distinct texts, each folded once
    assert parallel == serial == asked
    assert "__gac_pending_template" not in parallel and "gac_k2_t" in parallel


HOST_BUF = """func.func @main(%a: memref<7xf32>, %x: f32) {
  %buf = memref.alloc() : memref<7xf32>
  %0 = arith.addf %x, %x : f32
  memref.dealloc %buf : memref<7xf32>
  return
}"""


def _unused_arg(monkeypatch, workers: int, template: str) -> str:
    """A template given %buf as an argument it does not use; then the scheduler's question
    'is %buf still used?' (erase_if_unused) while the template may still be folded."""
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", str(workers))
    module = ir.Module.parse(HOST_BUF, make_context())
    with module.context, ir.Location.unknown():
        fn = module.body.operations[0].operation
        ops, args = block_ops(func_block(fn)), list(func_block(fn).arguments)
        with template_cache(), deferred_splices(1):
            splice_template(template, ops[1], [args[0], ops[0].results[0]], args[1], "f32", "gac_k0_t")
            erase_if_unused(ops[0].results[0])
        assert module.operation.verify()
        return str(module)


UNUSED_B = TEMPLATE.replace("(%A: memref<7xf32>, %init: f32)", "(%A: memref<7xf32>, %B: memref<7xf32>, %init: f32)")


@pytest.mark.unit
def test_an_argument_the_template_never_names_is_unused_meanwhile(monkeypatch):
    serial = _unused_arg(monkeypatch, 0, UNUSED_B)
    assert "memref.alloc" not in serial  # (the kernel does not use %buf: dropped)
    assert _unused_arg(monkeypatch, 1, UNUSED_B) == serial


@pytest.mark.unit
def test_an_argument_named_only_by_dead_code_is_reported(monkeypatch):
    dead = UNUSED_B.replace("    memref.store %v, %A[%k]", "    %dead = memref.load %B[%k] : memref<7xf32>\n    memref.store %v, %A[%k]")
    monkeypatch.setenv("GAC_STRICT_INTERNAL", "1")
    with pytest.raises(CompileError, match="unlike its text"):
        _unused_arg(monkeypatch, 1, dead)
    # (in-process, the dead load is folded away before the question: %buf is dropped, which the
    # stand-in, using %buf, did not let happen; hence the report)
    assert "memref.alloc" not in _unused_arg(monkeypatch, 0, dead)


@pytest.mark.unit
def test_worker_folds_as_the_scheduler_does():
    ctx = make_context()
    folded = ir.Module.parse(fold_worker.fold(TEMPLATE, ir.Context()), ctx)
    assert str(folded) == str(strategy._parse(TEMPLATE, ctx))


def _in_thread(fn, timeout: float = 120):
    """fn's exception (None if it returned); fails if it is still running after `timeout`."""
    out: list = []

    def run():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    return out[0]


@pytest.mark.unit
def test_a_worker_that_dies_is_a_compile_error(monkeypatch):
    monkeypatch.setattr(fold_pool, "_command", lambda: [sys.executable, "-c", "import sys; sys.exit(3)"])
    err = _in_thread(lambda: _spliced(monkeypatch, 1))
    assert isinstance(err, CompileError) and "exited with code 3" in str(err)
    assert "GAC_GPU_STAGE_WORKERS=0" in str(err)


@pytest.mark.unit
def test_a_template_a_worker_cannot_fold_is_a_compile_error():
    pool = fold_pool.FoldPool(1)
    try:
        bad = pool.submit("func.func @tmpl( {")
        good = pool.submit(TEMPLATE)
        assert pool.submit(TEMPLATE) is good  # (one job per distinct text)
        with pytest.raises(CompileError, match="folding a kernel template failed"):
            bad.result(timeout=120)
        assert good.result(timeout=120)  # the worker goes on
    finally:
        pool.close()


@pytest.mark.unit
def test_worker_count(monkeypatch):
    monkeypatch.delenv("GAC_GPU_STAGE_WORKERS", raising=False)
    assert fold_pool.worker_count(fold_pool.MIN_GENERICS - 1) == 0  # a small program: in-process
    assert fold_pool.worker_count(10_000) <= fold_pool.MAX_WORKERS
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", "0")
    assert fold_pool.worker_count(10_000) == 0
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", "3")
    assert fold_pool.worker_count(1) == 3
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", "many")
    with pytest.raises(ValueError, match="GAC_GPU_STAGE_WORKERS"):
        fold_pool.worker_count(1)


HOST_VIEW = """func.func @main(%a: memref<2x7xf32>, %x: f32) {
  %v = memref.subview %a[0, 0] [1, 7] [1, 1] : memref<2x7xf32> to memref<7xf32, strided<[1]>>
  %0 = arith.addf %x, %x : f32
  return
}"""

# a kernel whose view of its argument folds with a host view (reinterpret_cast of a subview at 0)
VIEWING = TEMPLATE.replace("(%A: memref<7xf32>, %init: f32)", "(%A: memref<7xf32, strided<[1]>>, %init: f32)").replace(
    "    memref.store %v, %A[%k] : memref<7xf32>",
    "    %r = memref.reinterpret_cast %A to offset: [0], sizes: [7], strides: [1] : memref<7xf32, strided<[1]>> to memref<7xf32>\n"
    "    memref.store %v, %r[%k] : memref<7xf32>")


def _host_pipeline(monkeypatch, aside_on: bool, template: str, host: str, constant_init: bool = False) -> str:
    """A template spliced into the host (its init: the host's %x, or a constant), then the host
    function's pipeline and outlining (schedule.py), with the folded template kernels aside or in."""
    monkeypatch.setenv("GAC_GPU_KERNELS_ASIDE", "1" if aside_on else "0")
    module = ir.Module.parse(host, make_context())
    with module.context, ir.Location.unknown():
        fn = module.body.operations[0].operation
        block = func_block(fn)
        ops, args = block_ops(block), list(block.arguments)
        arg = ops[0].results[0] if host is HOST_VIEW else args[0]
        with template_cache():
            splice_template(template, ops[-2], [arg], None if constant_init else args[-1], "f32", "gac_k0_t")
        with aside.kernels_aside(module, block):  # (then on as schedule.map_to_gpu goes)
            run_passes(module, "func.func(convert-linalg-to-parallel-loops), canonicalize, cse")
        run_passes(module, "gpu-launch-sink-index-computations")
        run_passes(module, "gpu-kernel-outlining, func.func(canonicalize, cse), gpu.module(gpu.func(canonicalize, cse))")
        assert module.operation.verify()
        return str(module)


@pytest.mark.unit
def test_kernels_aside_give_the_same_module(monkeypatch):
    set_aside = []
    real = aside._meets_host
    monkeypatch.setattr(aside, "_meets_host", lambda *a: set_aside.append(not real(*a)) or not set_aside[-1])
    for template, host in ((TEMPLATE, HOST), (VIEWING, HOST_VIEW)):
        assert _host_pipeline(monkeypatch, True, template, host) == _host_pipeline(monkeypatch, False, template, host)
    assert set_aside == [True, False]  # the plain kernel went aside; the one viewing a host view stayed
    assert aside.FOLDED not in _host_pipeline(monkeypatch, True, TEMPLATE, HOST)


@pytest.mark.unit
def test_a_kernel_viewing_a_host_view_must_stay_in(monkeypatch):
    """(what _meets_host guards: put aside, the kernel's reinterpret_cast keeps the subview)"""
    inside = _host_pipeline(monkeypatch, False, VIEWING, HOST_VIEW)
    assert "strides: [1] : memref<2x7xf32> to" in inside  # (the kernel's cast folded through the subview)
    monkeypatch.setattr(aside, "_meets_host", lambda *a: False)
    assert _host_pipeline(monkeypatch, True, VIEWING, HOST_VIEW) != inside


def _vortex_gpu_stage(monkeypatch, kernels_aside: str) -> str:
    import dataclasses

    from gac_torch.backends import get_target, stages_only
    from gac_torch.frontends.fx import compile_graph
    from gac_torch.legalize import decompositions
    from gac_torch.options import resolve
    from models import build

    monkeypatch.setenv("GAC_GPU_KERNELS_ASIDE", kernels_aside)
    t = stages_only(get_target("vortex"))  # (up to the LLVM IR: no Vortex toolchain needed)
    t = dataclasses.replace(t, stages=lambda o, s=t.stages: [x for x in s(o) if x.name != "vxbin"])
    model, args = build("mlp")
    with torch.no_grad():
        gm = torch.export.export(model, args).run_decompositions(decompositions()).graph_module
        compiled = compile_graph(gm, resolve({"fallback": True, "cache": False}, target="vortex"), target=t)
    return "".join(p.stages["gpu"] for p in compiled.partitions.values())


def test_a_kernel_folding_with_a_constant_argument_stays_in(monkeypatch):
    """(what aside.inert_args guards: the vortex MLP's GEMM template adds its constant init to
    itself, which canonicalize folds into a new constant, hoisted in the host's order; set
    aside, its kernel lists its constants in another order)"""
    inside = _vortex_gpu_stage(monkeypatch, "0")
    assert _vortex_gpu_stage(monkeypatch, "1") == inside
    monkeypatch.setattr(aside, "inert_args", lambda *a: True)
    assert _vortex_gpu_stage(monkeypatch, "1") != inside


class Net(torch.nn.Module):
    """Repeated conv and linear blocks: implicit-GEMM templates, several of one text."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(40, 40) for _ in range(3))

    def forward(self, x, y):
        for c in self.convs:
            x = torch.relu(c(x)) + x
        for f in self.fcs:
            y = torch.nn.functional.gelu(f(y)) + y
        return x.sum(), torch.softmax(y, -1)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_model_kernels_are_identical_with_fold_workers(monkeypatch, arch):
    torch.manual_seed(0)
    model, args = Net().eval(), (torch.randn(2, 8, 12, 12), torch.randn(33, 40))
    submitted = []
    real = fold_pool.FoldPool.submit
    monkeypatch.setattr(fold_pool.FoldPool, "submit", lambda self, t: submitted.append(t) or real(self, t))
    stages = {}
    for workers, kernels_aside in ((0, "0"), (2, "0"), (2, "1")):  # (aside.py: opt-in)
        monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", str(workers))
        monkeypatch.setenv("GAC_GPU_KERNELS_ASIDE", kernels_aside)
        with torch.no_grad():
            f = gac_torch.compile(model, args, target="cuda", options={"arch": arch, "cache": False})
        assert f.report.compiled == f.report.total
        stages[workers, kernels_aside] = {s: f.ir(s) for s in ("gpu", "llvm", "ptx")}
    assert submitted  # the later compiles' templates went to the workers
    for s in ("gpu", "llvm", "ptx"):
        assert stages[2, "0"][s] == stages[0, "0"][s] == stages[2, "1"][s], s


@pytest.mark.cuda
def test_model_runs_on_the_gpu_with_fold_workers(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", "2")
    torch.manual_seed(0)
    model = Net().cuda().eval()
    args = (torch.randn(2, 8, 12, 12, device="cuda"), torch.randn(33, 40, device="cuda"))
    with torch.no_grad():
        f = gac_torch.compile(model, args, target="cuda", options={"cache": False})
        got, want = f(*args), model(*args)
    assert f.report.compiled == f.report.total
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)

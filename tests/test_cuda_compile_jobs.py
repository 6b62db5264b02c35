"""cuda kernels compiled one by one (backends/cuda/kernel_jobs.py), without a GPU: each distinct
kernel once, in worker processes or in-process, kept in the on-disk cache; the joined PTX is the
whole-module compile's kernel for kernel, and ptxas accepts it."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import gac_torch
from gac_torch.backends.cuda import kernel_jobs, ptx_worker, ptxas
from gac_torch.errors import CompileError, GacUnsupportedError
from gac_torch.runtime import cache


class Blocks(torch.nn.Module):
    """Three blocks of one shape (their kernels differ only in name) and a tail of others."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.GELU(),
                                                              torch.nn.LayerNorm(24)) for _ in range(3))
        self.head = torch.nn.Linear(24, 7)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return torch.softmax(self.head(x), -1).erf()


def _ptx(monkeypatch, workers: int, jobs: list | None = None, whole: bool = False) -> str:
    monkeypatch.setenv("GAC_COMPILE_WORKERS", str(workers))
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)  # the pool even for a small program
    real_run, real_split = kernel_jobs.run_jobs, kernel_jobs.split_bytecode

    def run_jobs(texts, *a, **k):
        if jobs is not None:
            jobs.append(len(texts))
        return real_run(texts, *a, **k)

    def split(*a, **k):
        if whole:
            raise kernel_jobs.NotSplittable("the test asks for the whole-module compile")
        return real_split(*a, **k)

    monkeypatch.setattr(kernel_jobs, "run_jobs", run_jobs)
    monkeypatch.setattr(kernel_jobs, "split_bytecode", split)
    torch.manual_seed(0)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ep = torch.export.export(Blocks().eval(), (x,))
    return gac_torch.compile(ep, target="cuda", options={"arch": "sm_90", "cache": False}).ir("ptx")


def _entries(ptx: str) -> dict[str, str]:
    """Per module-level PTX item (kernels by name) without comments and blank lines; block
    labels are numbered per function (LLVM counts functions in the module)."""
    _, items = kernel_jobs._items(ptx)
    code = ["\n".join(x for x in i.splitlines() if x.strip() and not x.strip().startswith("//")) for i in items]
    return {kernel_jobs._symbol(c) or c: re.sub(r"\$L__BB\d+_", "$L__BB_", c) for c in code}


def test_pool_dedupes_and_matches_the_whole_module_compile(monkeypatch, caplog):
    jobs: list[int] = []
    with caplog.at_level(logging.DEBUG, logger="gac_torch"):
        pooled = _ptx(monkeypatch, workers=2, jobs=jobs)
    kernels = re.findall(r"\.entry (\w+)\(", pooled)
    assert len(kernels) == len(set(kernels)) >= 8
    assert len(jobs) == 1 and jobs[0] < len(kernels)  # the repeated blocks compiled once
    assert f"stage llvm: {jobs[0]} of {jobs[0]} distinct kernels compiled" in caplog.text  # progress
    assert _ptx(monkeypatch, workers=1) == pooled  # in-process: the same text
    whole = _ptx(monkeypatch, workers=1, whole=True)
    assert _entries(whole) == _entries(pooled)
    exe = ptxas.find_ptxas()
    assert exe is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    result = ptxas.assemble(pooled, "sm_90", exe)
    assert result.ok, result.log


def test_gpu_stage_kernels_are_printed_by_workers(tmp_path, monkeypatch):
    # the "llvm" stage writes each kernel once (bytecode), for its worker, before any kernel is
    # rewritten for ptxas (the workers do that: kernel_prep.py), and other workers print the
    # distinct kernels for the "gpu" stage: the same texts as printing each stage right after it
    # ran (compile_stage_file does); this process prints no kernel
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)

    def print_kernels(datas):
        raise AssertionError("the gpu stage's kernels printed in the compiling process")

    monkeypatch.setattr(ptx_worker, "print_kernels", print_kernels)
    monkeypatch.setattr(kernel_jobs, "kernel_text", print_kernels)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    options = {"arch": "sm_90", "cache": False}
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(Blocks().eval(), (x,)), target="cuda", options=options)
    assert "nvvm.minctasm" not in compiled.ir("gpu") and "nvvm.minctasm" in compiled.ir("llvm")
    monkeypatch.undo()
    path = tmp_path / "fused_0.linalg"
    path.write_text(compiled.ir("linalg"))
    stages, _ = gac_torch.compile_stage_file(path, target="cuda", options=options)
    assert "func.func @main" in stages["gpu"] and "gpu.module @gac_kernels" in stages["gpu"]
    assert {s: compiled.ir(s) for s in ("gpu", "llvm", "ptx")} == {s: stages[s] for s in ("gpu", "llvm", "ptx")}


def test_workers_started_ahead_are_the_pools(monkeypatch):
    # a program of many kernels starts its workers before it splits its module (one more: the
    # "gpu" stage's printer); run_jobs takes them (no further process started) and none is
    # left running afterwards
    monkeypatch.setattr(kernel_jobs, "PRESTART_KERNELS", 0)
    started = []
    real = kernel_jobs._worker
    monkeypatch.setattr(kernel_jobs, "_worker", lambda: started.append(real()) or started[-1])
    jobs: list[int] = []
    pooled = _ptx(monkeypatch, workers=2, jobs=jobs)
    assert len(jobs) == 1 and jobs[0] >= 2 and len(started) == 2 + kernel_jobs.PRINTERS  # pool + printers
    assert not kernel_jobs._spare and all(p.poll() is not None for p in started)
    assert _ptx(monkeypatch, workers=1) == pooled
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    with kernel_jobs.started_workers(100):  # not taken (e.g. a module compiled whole): ended
        assert len(kernel_jobs._spare) == 2 + kernel_jobs.PRINTERS
    assert not kernel_jobs._spare and len(started) == 2 * (2 + kernel_jobs.PRINTERS)
    assert all(p.wait(timeout=30) == 0 for p in started[2 + kernel_jobs.PRINTERS:])  # told to end (reaped in a thread)


def test_kernel_cache_skips_compiled_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_CACHE_DIR", str(tmp_path))
    texts = {"k_a": _kernel_text(1.0), "k_b": _kernel_text(1.0), "k_c": _kernel_text(2.0)}
    lower, binary = LOWER, BINARY
    ran: list[int] = []
    real = kernel_jobs.run_jobs
    monkeypatch.setattr(kernel_jobs, "run_jobs", lambda t, *a, **k: ran.append(len(t)) or real(t, *a, **k))
    first = kernel_jobs.compile_kernels(texts, lower, binary, use_cache=True)
    assert ran == [2] and [r.names for r in first] == [["k_a", "k_b"], ["k_c"]]
    again = kernel_jobs.compile_kernels(texts, lower, binary, use_cache=True)
    assert ran == [2, 0] and [(r.llvm, r.ptx) for r in again] == [(r.llvm, r.ptx) for r in first]
    ptx = kernel_jobs.join_ptx(again, list(texts))
    assert re.findall(r"\.entry (\w+)\(", ptx) == ["k_a", "k_b", "k_c"]
    assert "// kernel k_a (also: k_b)" in kernel_jobs.llvm_text(again)
    assert cache.clear() == 2
    monkeypatch.setenv("GAC_CACHE_SIZE_MB", "0.000001")  # the bound holds after the batch
    kernel_jobs.compile_kernels(texts, lower, binary, use_cache=True)
    assert cache.clear() == 0


LOWER = "nvvm-attach-target{chip=sm_90}, gpu.module(convert-gpu-to-nvvm), reconcile-unrealized-casts"
BINARY = "gpu-module-to-binary{format=isa}"


def _kernel_text(scale: float) -> str:
    body = f"""
    gpu.func @{kernel_jobs.PLACEHOLDER}(%a: memref<4xf32>) kernel {{
      %i = gpu.thread_id x
      %v = memref.load %a[%i] : memref<4xf32>
      %c = arith.constant {scale} : f32
      %w = arith.mulf %v, %c : f32
      memref.store %w, %a[%i] : memref<4xf32>
      gpu.return
    }}"""
    return "module attributes {gpu.container_module} {\n  gpu.module @gac_kernels {" + body + "\n  }\n}\n"


def test_pool_results_are_taken_as_they_arrive(tmp_path, monkeypatch):
    # while the workers compile the rest, the calling thread stores each finished kernel in the
    # cache and cuts its PTX for the join: the join after the pool is the same as from scratch
    monkeypatch.setenv("GAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)
    texts = {"k_a": _kernel_text(1.0), "k_b": _kernel_text(2.0), "k_c": _kernel_text(1.0)}
    arrived = []
    real = kernel_jobs.run_jobs

    def run_jobs(texts, lower, binary, on_progress, ptxas, names, on_result, **k):
        return real(texts, lower, binary, on_progress, ptxas, names,
                    lambda i, r: arrived.append(i) or on_result(i, r), **k)

    monkeypatch.setattr(kernel_jobs, "run_jobs", run_jobs)
    results = kernel_jobs.compile_kernels(texts, LOWER, BINARY, True)
    assert sorted(arrived) == [0, 1] and all(r.cut is not None for r in results)
    assert len(list(tmp_path.glob("*/*"))) == 2  # each stored as it came
    fresh = [kernel_jobs.KernelResult(r.names, r.llvm, r.ptx) for r in results]
    assert kernel_jobs.join_ptx(results, list(texts)) == kernel_jobs.join_ptx(fresh, list(texts))


def test_join_dedupes_declarations_and_refuses_a_clash():
    head = "//\n.version 7.8\n.target sm_90\n.address_size 64\n\n"
    shared = ".extern .shared .align 16 .b8 smem[];"

    def ptx(glob: str) -> str:
        return (head + f"{shared}\n{glob}\n\n.visible .entry {kernel_jobs.PLACEHOLDER}(\n"
                f"\t.param .u64 {kernel_jobs.PLACEHOLDER}_param_0\n)\n.maxntid 32, 1, 1\n{{\n\tret;\n}}\n")

    same = [kernel_jobs.KernelResult([n], "", ptx(".global .align 4 .b8 g[4] = {1, 2, 3, 4};")) for n in "ab"]
    joined = kernel_jobs.join_ptx(same, ["a", "b"])
    assert joined.count(shared) == 1 and joined.count(".global") == 1
    assert "a_param_0" in joined and "b_param_0" in joined and kernel_jobs.PLACEHOLDER not in joined
    clash = [same[0], kernel_jobs.KernelResult(["b"], "", ptx(".global .align 4 .b8 g[4] = {0, 0, 0, 0};"))]
    with pytest.raises(kernel_jobs.NotSplittable, match="symbol g"):
        kernel_jobs.join_ptx(clash, ["a", "b"])


def test_a_failing_kernel_is_a_compile_error_from_the_pool(monkeypatch):
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)
    good = _kernel_text(1.0)
    with pytest.raises(CompileError, match="cuda kernel lowering failed"):
        kernel_jobs.run_jobs([good, good.replace("memref.load", "memref.lod")], LOWER, BINARY)
    assert len(kernel_jobs.run_jobs([good, good], LOWER, BINARY)) == 2  # (the pool itself works)


def blocks_on_gpu(monkeypatch):
    """(compiled, its output, the float64 eager reference, the cuda input) of Blocks compiled
    through the pool of 2 workers and run once on the GPU."""
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)
    torch.manual_seed(0)
    model = Blocks().eval().double()
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = model(x).float()
    model, x = model.float().cuda(), x.float().cuda()
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(model, (x,)), target="cuda", options={"cache": False})
        return compiled, compiled(x), ref, x


@pytest.mark.cuda
def test_pooled_kernels_run_like_eager(monkeypatch):
    """On a GPU: the joined PTX of a pooled compile loads and computes eager's results."""
    monkeypatch.setenv("GAC_CUBIN", "0")  # (the PTX; tests/test_cuda_cubin.py runs the cubins)
    _, got, ref, _ = blocks_on_gpu(monkeypatch)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_partitions_push_nvtx_ranges(monkeypatch):
    """On a GPU, with an NVTX tool attached (nsys/ncu set NVTX_INJECTION64_PATH): each call of a
    cuda partition is an NVTX range named after it (issue 16)."""
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nonexistent/libtool.so")  # (read at compile time)
    pushed: list[str] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1)).cuda()
    model = Blocks().eval().cuda()
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(model, (x,)), target="cuda", options={"cache": False})
        compiled(x)
    assert pushed and all(p.startswith("gac:fused_") for p in pushed)


def test_no_worker_process_falls_back_in_process(monkeypatch, caplog):
    """A worker that cannot start (no python executable) means in-process, with one warning;
    a GAC_COMPILE_WORKERS that is no number is a clear error."""
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)
    monkeypatch.setattr(kernel_jobs, "_no_pool", [])
    monkeypatch.setattr(kernel_jobs.sys, "executable", "/nonexistent/python")
    good = _kernel_text(1.0)
    with caplog.at_level(logging.WARNING, logger="gac_torch"):
        out = kernel_jobs.run_jobs([good, _kernel_text(2.0)], LOWER, BINARY)
    assert len(out) == 2 and ".entry" in out[0][1] and "in-process" in caplog.text
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="GAC_COMPILE_WORKERS"):
        kernel_jobs.worker_count()


def _i1_kernel_text(use: str) -> str:
    """A kernel storing through an i1 buffer: a load/store (bytes then) or `use` (a subview:
    what the byte rewrite does not handle)."""
    view = ("%s = memref.subview %a[0] [2] [1] : memref<4xi1> to memref<2xi1, strided<[1]>>\n      "
            .replace("%s", "%sv") if use == "subview" else "")
    body = f"""
    gpu.func @{kernel_jobs.PLACEHOLDER}(%a: memref<4xi1>) kernel {{
      %i = gpu.thread_id x
      {view}%v = memref.load %a[%i] : memref<4xi1>
      %t = arith.constant true
      %w = arith.xori %v, %t : i1
      memref.store %w, %a[%i] : memref<4xi1>
      gpu.return
    }}"""
    return "module attributes {gpu.container_module} {\n  gpu.module @gac_kernels {" + body + "\n  }\n}\n"


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_prepare_i1_kernels_or_refuse_them(workers, monkeypatch):
    # the worker (or the process itself, with one) rewrites i1 buffers as bytes before lowering
    # (kernel_prep.py); a use it cannot rewrite is GacUnsupportedError, as in-process, not a
    # lowering failure
    monkeypatch.setenv("GAC_COMPILE_WORKERS", str(workers))
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)
    prep = {"kind": "loops", "sgemm_blocks": 2, "early_loads": True}
    texts = [_i1_kernel_text("load"), _i1_kernel_text("load").replace("true", "false")]
    results = kernel_jobs.run_jobs(texts, LOWER, BINARY, preps=[prep, prep])
    assert all("ld.global.b8" in r[1] and "st.global.b8" in r[1] for r in results)  # (bytes)
    with pytest.raises(GacUnsupportedError, match="i1 buffer used by memref.subview"):
        kernel_jobs.run_jobs([_i1_kernel_text("subview"), texts[0]], LOWER, BINARY, preps=[prep, prep])

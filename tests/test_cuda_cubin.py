"""cuda kernels assembled ahead of time (ptxas -> cubin, per distinct kernel, in the compile pool):
the cubins' cache key, the program carrying them (as cache blobs, not JSON), PTX as the fallback
without a ptxas, and on a GPU: loaded as SASS, or as PTX when the cubins do not load."""

from __future__ import annotations

import json
import logging
import stat

import pytest
import torch

import gac_torch
from gac_torch.backends import get_target
from gac_torch.backends.cuda import kernel_jobs, ptx_worker, ptxas, runtime
from gac_torch.backends.cuda import target as cuda_target

from test_cuda_compile_jobs import BINARY, LOWER, Blocks, _kernel_text, blocks_on_gpu


@pytest.fixture(autouse=True)
def _cubins_without_a_gpu(monkeypatch):
    monkeypatch.setenv("GAC_CUBIN", "1")  # (by default only where a GPU is visible)


def _assembler() -> ptxas.Assembler:
    a = ptxas.for_cubins()
    assert a is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    return a


def _program(monkeypatch, **env):
    """The GpuProgram of Blocks compiled offline for sm_90 (pool of 2 workers, no cache)."""
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(kernel_jobs, "MIN_POOL_BYTES", 0)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ep = torch.export.export(Blocks().eval(), (x,))
    compiled = gac_torch.compile(ep, target="cuda", options={"arch": "sm_90", "cache": False})
    (cg,) = compiled.compiled.partitions.values()
    return cg.saved[2]  # (the executable is unavailable without a GPU; the program is kept)


def test_ptxas_assembles_a_cubin_for_sm_90():
    llvm, ptx, cubin, why = ptx_worker.compile_kernel(_kernel_text(3.0), LOWER, BINARY, _assembler().exe)
    assert why == "" and ptx_worker.ptx_arch(ptx) == "sm_90"
    assert cubin is not None and cubin[:4] == b"\x7fELF"
    assert kernel_jobs.PLACEHOLDER.encode() in cubin  # the kernel keeps its placeholder name
    _, _, none, why = ptx_worker.compile_kernel(_kernel_text(3.0), LOWER, BINARY, None)
    assert none is None and why == ""


def test_named_cubins_of_one_length_are_ptxas_own(monkeypatch):
    # one ptxas run per name length: the other names' cubins are its bytes renamed, exactly what
    # ptxas makes of the renamed PTX (names of another length get their own run)
    a = _assembler()
    _, ptx, _, _ = ptx_worker.compile_kernel(_kernel_text(3.0), LOWER, BINARY)
    names = ["gac_k7_loops", "gac_k9_loops", "gac_k12_loops", "gac_k31_loops"]
    runs = []
    real = ptx_worker.assemble

    def assemble(text, exe):
        runs.append(text)
        return real(text, exe)

    monkeypatch.setattr(ptx_worker, "assemble", assemble)
    named = ptx_worker.assemble_named(ptx, a.exe, names, kernel_jobs.PLACEHOLDER)
    assert len(runs) == 2  # gac_k7_loops and gac_k12_loops
    for name in names:
        own, why = real(ptx.replace(kernel_jobs.PLACEHOLDER, name), a.exe)
        assert why == "" and named[name] == [own, ""]


def test_cubin_cache_key_has_ptxas_version_and_arch(monkeypatch):
    text = _kernel_text(1.0)
    a = _assembler()
    keys = {kernel_jobs.job_key(text, LOWER, BINARY, a),
            kernel_jobs.job_key(text, LOWER, BINARY, ptxas.Assembler(a.exe, "0.0.1")),
            kernel_jobs.job_key(text, LOWER, BINARY, None),
            kernel_jobs.job_key(text, LOWER.replace("sm_90", "sm_80"), BINARY, a)}
    assert len(keys) == 4
    with monkeypatch.context() as m:
        m.setattr(ptxas, "for_cubins", lambda: ptxas.Assembler(a.exe, "99.1.2"))
        assert get_target("cuda").cache_key({"arch": "sm_90"})["ptxas"] == "99.1.2"
    assert get_target("cuda").cache_key({"arch": "sm_90"})["ptxas"] == a.version
    monkeypatch.setenv("GAC_CUBIN", "0")
    assert ptxas.for_cubins() is None and get_target("cuda").cache_key({"arch": "sm_90"})["ptxas"] is None


def test_kernel_cache_keeps_cubins(tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_CACHE_DIR", str(tmp_path))
    texts = {"k_a": _kernel_text(1.0), "k_b": _kernel_text(1.0), "k_c": _kernel_text(2.0)}
    ran: list[int] = []
    real = kernel_jobs.run_jobs
    monkeypatch.setattr(kernel_jobs, "run_jobs", lambda t, *a, **k: ran.append(len(t)) or real(t, *a, **k))
    a = _assembler()
    first = kernel_jobs.compile_kernels(texts, LOWER, BINARY, True, ptxas=a)
    assert ran == [2] and all(r.cubin and r.cubin[:4] == b"\x7fELF" for r in first)
    again = kernel_jobs.compile_kernels(texts, LOWER, BINARY, True, ptxas=a)
    assert ran == [2, 0] and [r.cubin for r in again] == [r.cubin for r in first]
    kernel_jobs.compile_kernels(texts, LOWER, BINARY, True, ptxas=ptxas.Assembler(a.exe, "0.0.1"))
    assert ran == [2, 0, 2]  # another ptxas: assembled again


def test_program_carries_cubins_as_cache_blobs(monkeypatch):
    program = _program(monkeypatch)
    kernels = {k.kernel for k in program.launches}
    assert program.cubins and {n for c in program.cubins for n in c.kernels} == kernels
    # one per kernel, under its own name (profilers and the autotuner tell kernels by it)
    assert len(program.cubins) == len(kernels) and all(len(c.kernels) == 1 for c in program.cubins)
    assert all(c.arch == "sm_90" and c.entry is None for c in program.cubins)
    assert all(c.kernels[0].encode() in c.data and kernel_jobs.PLACEHOLDER.encode() not in c.data
               for c in program.cubins)
    meta, blobs = cuda_target._pack(program, {})
    assert sorted(blobs) == sorted(["ptx", *(f"cubin:{i}" for i in range(len(program.cubins)))])
    assert '"bytes"' not in json.dumps(meta)  # SASS as raw blobs, not base64 in the JSON header
    assert ".entry" not in json.dumps(meta)  # nor the PTX (a blob: 7 MB for BEVFormer-tiny)
    monkeypatch.setattr(runtime, "check_available", lambda: None)  # (no GPU is touched before a call)
    exe = cuda_target._unpack(json.loads(json.dumps(meta)), blobs, _signature(program), {})
    assert exe.program.cubins == program.cubins and exe.program.ptx == program.ptx


def test_pool_assembles_each_kernels_cubins_as_the_threads_would(monkeypatch):
    # the pool's workers assemble every kernel's cubins under its names right after its PTX
    # (ptxas beside the other kernels' LLVM); pipeline.cubins' threads did it after the pool
    named = []
    real = kernel_jobs.compile_kernels

    def compile_kernels(*a, **k):
        results = real(*a, **k)
        named.extend(n for r in results for n in (r.named or {}))
        return results

    monkeypatch.setattr(kernel_jobs, "compile_kernels", compile_kernels)
    pooled = _program(monkeypatch)
    kernels = {k.kernel for k in pooled.launches}
    assert sorted(named) == sorted(kernels) and len(pooled.cubins) == len(kernels)
    named.clear()
    threaded = _program(monkeypatch, GAC_COMPILE_WORKERS="1")  # in-process: no pool
    assert named == [] and threaded.cubins == pooled.cubins and threaded.ptx == pooled.ptx


def _signature(program):
    from gac_torch.backends.base import Signature, TensorSpec

    dtypes = {"f32": torch.float32}
    specs = [TensorSpec(tuple(a.shape), dtypes[a.elem]) for a in program.args]
    return Signature(tuple(specs[:-1]), tuple(specs[-1:]))  # (Blocks has one output)


def test_without_ptxas_the_program_is_ptx_only(monkeypatch, tmp_path, caplog):
    assert _program(monkeypatch, GAC_CUBIN="0").cubins == []
    if not torch.cuda.is_available():
        monkeypatch.delenv("GAC_CUBIN")
        assert ptxas.for_cubins() is None  # no GPU: nothing would load a cubin
    fake = tmp_path / "ptxas"  # a ptxas that tells its version but rejects every PTX
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Cuda compilation tools, V1.2.3'; exit 0; fi\n"
                    "echo 'ptxas fatal: Unsupported .version' >&2; exit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("GAC_CUBIN", "1")
    monkeypatch.setattr(ptxas, "find_ptxas", lambda: str(fake))
    with caplog.at_level(logging.INFO, logger="gac_torch"):
        program = _program(monkeypatch)
    assert program.cubins == [] and ".entry" in program.ptx
    assert "without a cubin" in caplog.text and "Unsupported .version" in caplog.text


@pytest.mark.unit
def test_cubin_fits_only_its_own_compute_capability():
    assert runtime.cubin_fits("sm_90", (9, 0)) and runtime.cubin_fits("sm_90a", (9, 0))
    assert not runtime.cubin_fits("sm_90", (8, 0)) and not runtime.cubin_fits("sm_80", (8, 6))
    assert not runtime.cubin_fits("compute_90", (9, 0))


@pytest.mark.cuda
def test_cubins_load_as_sass_and_run_like_eager(monkeypatch, caplog):
    """On a GPU: the program loads its cubins (no PTX JIT) and computes eager's result; cubins
    the driver refuses fall back to the PTX with one warning, with the same result."""
    compiled, got, ref, x = blocks_on_gpu(monkeypatch)
    (cg,) = compiled.compiled.partitions.values()
    assert cg.executable.loaded_from == "cubin"
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    from dataclasses import replace

    program = cg.executable.program
    broken = replace(program, cubins=[replace(c, data=b"neither a cubin nor PTX\0") for c in program.cubins])
    exe = cg.executable = runtime.CudaExecutable(broken, cg.executable.signature)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="gac_torch"):
        out = compiled(x)
    assert exe.loaded_from == "ptx" and "JIT-compiling its PTX" in caplog.text
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


class _LoaderDriver:
    """The module calls of cuda.bindings.driver, recorded: images (cubin or PTX), functions by
    (module, name); `refuse` makes the n-th cubin load fail as a driver would (invalid image)."""

    def __init__(self, refuse: int | None = None):
        self.loaded: list[str] = []
        self.unloaded: list[int] = []
        self.refuse = refuse

    def cuModuleLoadData(self, image):  # noqa: N802
        kind = "cubin" if bytes(image[:4]) == b"\x7fELF" else "ptx"
        if kind == "cubin" and self.refuse is not None and self.loaded.count("cubin") == self.refuse:
            return (200, None)
        self.loaded.append(kind)
        return (0, len(self.loaded))

    def cuModuleGetFunction(self, module, name):  # noqa: N802
        return (0, (module, name.decode()))

    def cuModuleUnload(self, module):  # noqa: N802
        self.unloaded.append(module)
        return (0,)

    def cuGetErrorName(self, err):  # noqa: N802
        return (0, b"CUDA_ERROR_INVALID_IMAGE")

    def cuGetErrorString(self, err):  # noqa: N802
        return (0, b"device kernel image is invalid")


def test_loader_takes_cubins_for_their_gpu_else_the_ptx(monkeypatch, caplog):
    """Offline, against a recording driver: one module per cubin, every launch's kernel found
    under the cubin's entry name; another compute capability, or a cubin the driver refuses
    (then the modules loaded so far are unloaded, with one warning), loads the PTX instead."""
    program = _program(monkeypatch)
    monkeypatch.setattr(runtime, "check_available", lambda: None)
    exe = runtime.CudaExecutable(program, _signature(program))
    dev = torch.device("cuda", 0)
    for capability, refuse, want in (((9, 0), None, "cubin"), ((8, 0), None, "ptx"), ((9, 0), 1, "ptx")):
        fake = _LoaderDriver(refuse)
        monkeypatch.setattr(runtime, "_driver", fake)
        monkeypatch.setattr(runtime, "_capability", lambda device, c=capability: c)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gac_torch"):
            modules, by_name = exe._load_kernels(dev)
        assert exe.loaded_from == want and set(by_name) == {k.kernel for k in program.launches}
        if want == "cubin":
            assert fake.loaded == ["cubin"] * len(program.cubins) and len(modules) == len(program.cubins)
            assert all(f[1] == n for n, f in by_name.items())  # each kernel under its own name
        else:
            assert fake.loaded[-1] == "ptx" and len(modules) == 1 and all(f[1] == n for n, f in by_name.items())
        assert ("JIT-compiling its PTX" in caplog.text) == (refuse is not None)
        assert fake.unloaded == ([1] if refuse is not None else [])

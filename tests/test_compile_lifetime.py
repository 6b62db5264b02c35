"""What a compiled program leaves behind once it is dropped (issue 12 items 7 and 10): nothing gac
made stays reachable (from torch's globals, gac's own, ctypes' caches), and repeated compile
cycles do not grow the Python heap. benchmarks/compile_memory.py measures RSS over 1,000 cycles."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gac_torch


def small_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                                torch.nn.LayerNorm(8)).eval()
    return model, torch.randn(4, 16, generator=torch.Generator().manual_seed(seed + 1))


def one_cycle(frontend: str, model, x, watch: list) -> None:
    """Compiles (export path, or torch.compile / `frontend` as a dynamo backend between two
    torch._dynamo.reset()), runs once against eager, drops it; weakrefs to what gac made go to
    `watch`."""
    from gac_torch.frontends import dynamo

    if frontend == "export":
        compiled = gac_torch.compile(torch.export.export(model, (x,)), target="cpu")
        with torch.no_grad():
            out = compiled(x)
        parts = list(compiled.compiled.partitions.values())
        watch += [weakref.ref(compiled), weakref.ref(compiled.compiled.gm)]
    else:
        torch._dynamo.reset()
        gac = frontend == "dynamo"
        fn = torch.compile(model, backend="gac", options={"target": "cpu"}) if gac else \
            torch.compile(model, backend=frontend)
        with torch.no_grad():
            out = fn(x)
        graphs = list(dynamo.compiled_graphs) if gac else []
        parts = [p for g in graphs for p in g.partitions.values()] if gac else [fn]
        watch += [weakref.ref(g) for g in graphs]
        del graphs
        torch._dynamo.reset()
    assert parts, "nothing compiled"
    watch += [weakref.ref(p) for p in parts]
    watch += [weakref.ref(p.executable) for p in parts if hasattr(p, "executable")]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def _alive(watch: list) -> int:
    gc.collect()
    return sum(r() is not None for r in watch)


def test_dropped_export_program_is_freed():
    """torch's proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT kept the last decomposed graph,
    which gac rewrites into the compiled program (issue 12 item 10)."""
    model, x = small_model()
    watch: list = []
    one_cycle("export", model, x, watch)
    assert len(watch) >= 4
    assert _alive(watch) == 0


@pytest.mark.cuda
def test_dropped_cuda_program_frees_its_device_memory():
    """The compiled program's workspace and parameters on the GPU go when the program goes."""
    model, x = small_model()
    model, x = model.cuda(), x.cuda()
    with torch.no_grad():
        ref = model(x)  # (first: eager's cuBLAS workspace, 32 MiB on Hopper, stays for the process)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    compiled = gac_torch.compile(torch.export.export(model, (x,)), target="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref, rtol=1e-4, atol=1e-4)
    watch = [weakref.ref(compiled)] + [weakref.ref(p) for p in compiled.compiled.partitions.values()]
    del compiled
    assert _alive(watch) == 0
    torch.cuda.synchronize()
    # nothing the compile allocated stays (seen on the H200: below `before`, as export's copies go too)
    assert torch.cuda.memory_allocated() <= before


def test_torch_compile_graphs_are_freed_by_dynamo_reset():
    """dynamo.compiled_graphs kept the last 64 compiled graphs (issue 12 item 7)."""
    model, x = small_model()
    watch: list = []
    one_cycle("dynamo", model, x, watch)
    assert len(watch) >= 3
    assert _alive(watch) == 0


def test_dropped_training_program_is_freed():
    """Forward and backward graphs of a training step, and the export path's autograd."""
    model, x = small_model()
    model.train()
    ep = torch.export.export(model, (x,))
    compiled = gac_torch.compile(ep, target="cpu")
    compiled(x.clone().requires_grad_()).sum().backward()
    watch = [weakref.ref(compiled)] + [weakref.ref(p) for p in compiled.compiled.partitions.values()]
    torch._dynamo.reset()
    fn = torch.compile(model, backend="gac", options={"target": "cpu"})
    fn(x).sum().backward()
    from gac_torch.frontends import dynamo

    watch += [weakref.ref(p) for g in dynamo.compiled_graphs for p in g.partitions.values()]
    del compiled, fn, ep
    torch._dynamo.reset()
    assert len(watch) >= 4
    assert _alive(watch) == 0


def _process_caches() -> dict[str, int]:
    """Process-wide caches a compile used to add to for good: torch.fx's generated source (one
    entry per GraphModule.recompile()), ctypes' pointer types (one per descriptor class) and
    dynamo's guard callbacks on long-lived objects (~16 per compile, ~100 KB)."""
    import ctypes
    import linecache

    from torch.fx import graph_module

    return {"fx sources": len(graph_module._loader.eval_cache),
            "linecache": sum(str(k).startswith("<eval_with_key>") for k in linecache.cache),
            "ctypes pointer types": len(ctypes._pointer_type_cache),
            "finalizers": len(weakref.finalize._registry)}


@pytest.mark.parametrize("frontend", ["export", "dynamo"])
def test_compile_cycles_leave_process_caches_bounded(frontend):
    model, x = small_model()
    watch: list = []
    for _ in range(2):  # first-use state
        one_cycle(frontend, model, x, watch)
    gc.collect()
    one_cycle(frontend, model, x, watch)
    gc.collect()
    before = _process_caches()
    for _ in range(3):
        one_cycle(frontend, model, x, watch)
        gc.collect()
    assert _process_caches() == before
    assert _alive(watch) == 0

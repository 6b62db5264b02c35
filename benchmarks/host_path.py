"""Host time per call of torch.compile(backend="gac") on the cuda target, step by step.

Without a GPU (default) the cuda driver is a stub whose calls return at once and CPU tensors
stand in for device tensors (tests/cuda_stub.py), so what is timed is the Python on the per-call
path: dynamo's guards, AOTAutograd's wrappers, the partitioned graph, CompiledGraph and
CudaExecutable; numbers are relative (this machine's CPU, not the H200's host). With `--device
cuda` the same runs on the GPU with the real driver (small shapes: the device time is
negligible next to the host time).

    PYTHONPATH=$PWD python benchmarks/host_path.py [--only NAMES] [--profile NAME] [--calls 2000]
    PYTHONPATH=$PWD python benchmarks/host_path.py --breakdown [--device cuda] [--only gemm,sdpa]

`--breakdown` lists, per one-partition workload, the microseconds per call of each level of the
path, outermost first, each including the ones below it: the module eagerly, torch.compile with
a backend that returns at once (dynamo's floor) and with AOTAutograd around it (dynamo + AOT
floor), each also with torch._dynamo.config.record_runtime_overhead off (the profiler hooks
dynamo's code calls around every graph otherwise: torch's, not gac's), gac's whole call, the function dynamo calls (AOTAutograd's wrapper, where it does anything,
and gac), CompiledGraph.boxed,
CudaExecutable.call, and the executable's parts (lane, output pool or fresh outputs, table lookup
+ launch or the lane's launch block: backends/cuda/launch_block.py, GAC_LAUNCH_BLOCK).
`grid_sample_fresh` and `grid_sample_msda` (the bench row's shapes: an 82 MB output, so with
`--device cuda` only) take fresh outputs (over runtime.POOL_BYTES).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import os
import functools
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from gac_torch.backends.cuda import runtime

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cuda_stub import stub_cuda  # noqa: E402


class Chain(torch.nn.Module):
    """launch_bound_200's shape of graph, shorter (several kernels after fusion? one: the chain
    fuses; the sum adds a second)."""

    def forward(self, x, a, b):
        for _ in range(10):
            x = torch.tanh(x * a + b) * 0.5
        return x, x.sum(0)


class GridSample(torch.nn.Module):
    def forward(self, value, grid):
        return torch.nn.functional.grid_sample(value, grid, align_corners=False)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.net(x), target)


class Gemm(torch.nn.Module):
    """gemm_fp32_2048_tf32on's graph (one kernel), small."""

    def forward(self, a, b):
        return a @ b


class Sdpa(torch.nn.Module):
    """sdpa_bf16_8x8x2500x32's graph (one flash kernel), small."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def workloads(device: str = "cpu"):
    """(name, model, input sets, training?, pool_bytes): launch-bound inference, one kernel into
    pooled outputs, one kernel into fresh outputs (grid_sample_msda's 82 MB output is over
    POOL_BYTES), a training step (AOTAutograd forward + backward), and the one-kernel GEMM and
    attention of the bench's host-bound rows."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    pooled = runtime.POOL_BYTES
    yield "gemm", Gemm(), [(r(64, 64), r(64, 64)) for _ in range(4)], False, pooled
    yield "sdpa", Sdpa(), [tuple(r(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3)) for _ in range(4)], \
        False, pooled
    yield "chain", Chain(), [(r(64, 64), r(64, 64), r(64, 64)) for _ in range(4)], False, pooled
    grids = [(r(2, 8, 15, 25), torch.rand(2, 50, 32, 2, generator=g, device=device) * 2.2 - 1.1)
             for _ in range(4)]
    yield "grid_sample", GridSample(), grids, False, pooled
    yield "grid_sample_fresh", GridSample(), grids, False, 0
    if device == "cuda":  # (bench_h200's grid_sample_msda: 82 MB fresh outputs)
        yield "grid_sample_msda", GridSample(), [(r(8, 32, 15, 25), torch.rand(
            8, 2500, 32, 2, generator=g, device=device) * 2.2 - 1.1) for _ in range(2)], False, pooled
    yield "train_mlp", Mlp().to(device), [(r(64, 64), r(64, 64)) for _ in range(4)], True, pooled
    from bench_h200 import TrainStep  # (the bench's training step, on a small MLP)

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    yield "train_step", TrainStep(net), [(r(64, 64), r(64, 64)) for _ in range(4)], False, pooled


def measure(name, model, sets, train, pool_bytes: int, calls: int, profile: bool) -> float:
    torch._dynamo.reset()
    runtime.POOL_BYTES = pool_bytes
    fn = torch.compile(model, backend="gac", options={"target": "cuda"})

    def step(x):
        if train:
            fn(*x).backward()
        else:
            return fn(*x)

    with contextlib.nullcontext() if train else torch.no_grad():
        for _ in range(3):
            keep = [step(x) for x in sets]  # compile, build tables, capture graphs
        del keep
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            for _ in range(calls // len(sets)):
                keep = [step(x) for x in sets]  # the bench's pattern: a round's outputs held
            best = min(best, (time.thread_time() - t) / (calls // len(sets) * len(sets)))
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                keep = [step(x) for x in sets]
            prof.disable()
            del keep
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return best * 1e6


def _per_call_us(fn, n: int, sync) -> float:
    """Median over 7 repeats of the thread's CPU time per call of `fn` (n calls a repeat)."""
    times = []
    for _ in range(7):
        sync()
        t = time.thread_time()
        for _ in range(n):
            fn()
        times.append((time.thread_time() - t) / n * 1e6)
    sync()
    return statistics.median(times)


def _noop_backends():
    """Backends that return at once (precomputed outputs): what dynamo alone, and dynamo with
    AOTAutograd, cost per call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def once(gm):
        outs = []

        def call(*args):
            if not outs:
                outs.append(gm(*args))
            return outs[0]
        return call

    return {"dynamo floor (noop backend)": lambda gm, ex: once(gm),
            "dynamo+AOT floor (noop)": aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(once(gm)))}


def breakdown(name, model, x, device: str, n: int, pool_bytes: int = runtime.POOL_BYTES) -> list[str]:
    """Microseconds per call at each level of the path (see the module's docstring)."""
    from gac_torch.frontends.dynamo import _whole_partition, compiled_graphs

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = list(x)
    lines = [f"  {'eager module':<52} {_per_call_us(lambda: model(*x), n, sync):7.2f} us"]
    for label, backend in _noop_backends().items():  # (each timed before the next reset)
        for record in (True, False):  # torch's profiler hooks around each graph call, or not
            torch._dynamo.reset()
            with torch._dynamo.config.patch(record_runtime_overhead=record):
                floor = torch.compile(model, backend=backend)
                floor(*x)
            label += "" if record else ", no runtime-overhead records"
            lines.append(f"  {label:<52} {_per_call_us(lambda floor=floor: floor(*x), n, sync):7.2f} us")
    torch._dynamo.reset()
    rows = []
    where = type(model).forward.__globals__
    before, graphs_before = set(where), {id(c) for c in compiled_graphs}
    limit, runtime.POOL_BYTES = runtime.POOL_BYTES, pool_bytes  # (read as executables are made)
    try:
        fn = torch.compile(model, backend="gac", options={"target": "cuda"})
        for _ in range(3):
            fn(*x)
    finally:
        runtime.POOL_BYTES = limit
    rows.append(("gac: torch.compile call", lambda: fn(*x)))
    inner = [where[k] for k in set(where) - before if k.startswith("__compiled_fn")]
    if len(inner) == 1:  # what dynamo's code calls: AOTAutograd's wrapper (or not), then gac
        core = inner[0]
        while hasattr(core, "_torchdynamo_orig_callable"):
            core = core._torchdynamo_orig_callable
        aot = "gac directly" if isinstance(core, functools.partial) else "AOTAutograd + gac"
        rows.append((f"  dynamo's compiled fn ({aot})", lambda: inner[0](*x)))
    new = [c for c in compiled_graphs if id(c) not in graphs_before]
    parts = [cg for c in new for cg in c.partitions.values()]
    whole = _whole_partition(new[0].gm) if len(new) == 1 else None
    if whole is not None:  # (else the partition's arguments are not the module's)
        cg = whole
        exe = cg.executable
        if cg._guarded is not None and cg._guarded(x) is not None:  # (what the direct call takes)
            rows.append(("    CompiledGraph.call_guarded", lambda: cg.call_guarded(*x)))
            rows.append(("      CudaExecutable.call_guarded", lambda: exe.call_guarded(x)))
        rows.append(("    CompiledGraph.boxed", lambda: cg.boxed(x)))
        if cg._call is not None and cg._call(x) is not None:
            rows.append(("      CudaExecutable.call", lambda: exe.call(x)))
            dev = runtime._current_device()
            handle = runtime._raw_stream(dev)
            lane = exe._lane(dev, handle)
            rows.append(("        stream, device, capture status",
                         lambda: (runtime._current_device(), runtime._raw_stream(dev), runtime._capturing())))
            rows.append(("        lane", lambda: exe._lane(dev, handle)))
            if lane.pool is not None:
                rows.append(("        output pool acquire", lambda: lane.pool.acquire()))
            else:
                if lane.protos is not None:
                    rows.append(("        fresh outputs (empty_like of prototypes)", lambda: [
                        runtime._empty_like(p, memory_format=runtime._DENSE) for p in lane.protos]))
                rows.append(("        fresh outputs (torch.empty)", lambda: [
                    torch.empty(s, dtype=d, device=lane.device) for s, d in exe._out_specs]))
            got = lane.pool.acquire() if lane.pool is not None else None
            outs = got[1] if got else [torch.empty(s, dtype=d, device=lane.device) for s, d in exe._out_specs]
            ptrs = [t.data_ptr() for t in x] + [o.data_ptr() for o in outs]
            key = (None, *ptrs, lane.ws_ptr)
            if lane.block is not None:
                def fill_launch(block=lane.block):
                    block.fill(ptrs)
                    runtime._driver.cuLaunchKernel(*block.args)
                rows.append(("        launch block fill + launch", fill_launch))
                rows.append(("        cuLaunchKernel alone", lambda args=lane.block.args: runtime._driver.cuLaunchKernel(*args)))
            else:
                rows.append(("        table lookup + launch", lambda: exe._issue(lane, exe._static, key, ptrs, False)))
            del got
    lines.insert(0, f"{name} ({device}): {len(new)} graph(s), {len(parts)} partition(s)"
                    f"{' (the whole graph)' if whole is not None else ''}, "
                    f"{sum(len(getattr(getattr(p.executable, 'program', None), 'launches', ())) for p in parts)}"
                    f" launch(es), GAC_LAUNCH_BLOCK={os.environ.get('GAC_LAUNCH_BLOCK', '1')}"
                    f" GAC_DYNAMO_RECORDS={os.environ.get('GAC_DYNAMO_RECORDS', '0')}")
    for label, f in rows:
        lines.append(f"  {label:<52} {_per_call_us(f, n, sync):7.2f} us")
    if parts:
        lines.append(f"  stats: {getattr(parts[0].executable, 'stats', {})}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", default="")
    ap.add_argument("--only", default="")
    ap.add_argument("--breakdown", action="store_true", help="microseconds per level of the path "
                    "(one-partition inference workloads: gemm, sdpa, grid_sample)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: the stub driver on CPU tensors; cuda: the GPU and its driver")
    args = ap.parse_args()
    only = args.only.split(",") if args.only else (["gemm", "sdpa"] if args.breakdown else [])
    stub = stub_cuda() if args.device == "cpu" else contextlib.nullcontext()
    if args.device == "cpu":  # (the optimizer step's in-place partition takes the checked path,
        os.environ["GAC_IN_PLACE"] = "0"  # which refuses the stub's CPU tensors as cuda inputs)
    with stub:
        limit = runtime.POOL_BYTES
        for name, model, sets, train, pool_bytes in workloads(args.device):
            if only and name not in only:
                continue
            if args.breakdown:
                if not train:
                    with torch.no_grad():
                        print("\n".join(breakdown(name, model, sets[0], args.device, args.calls // 4, pool_bytes)),
                              flush=True)
                continue
            us = measure(name, model, sets, train, pool_bytes, args.calls, name == args.profile)
            runtime.POOL_BYTES = limit
            print(f"{name}: {us:.1f} us host per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

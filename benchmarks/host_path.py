"""Host time per call of torch.compile(backend="gac") on the cuda target, without a GPU.

The cuda driver is replaced by a stub whose calls return at once (launches and graph replays do
nothing) and CPU tensors stand in for device tensors, so what is timed is the Python on the
per-call path: dynamo's guards, AOTAutograd's wrappers, the partitioned graph, CompiledGraph and
CudaExecutable. Numbers are relative (this machine's CPU, not the H200's host).

    PYTHONPATH=$PWD python benchmarks/host_path.py [--profile NAME] [--calls 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import pstats
import sys
import time
from pathlib import Path

import torch

from gac_torch.backends.cuda import runtime
from gac_torch.backends.cuda.target import TARGET
from gac_torch.runtime import compiled as compiled_mod

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_cuda_runtime import _FakeDriver  # noqa: E402


class StubDriver(_FakeDriver):
    """The tests' fake driver without its records: launches and graph replays return at once."""

    class CUfunction_attribute:  # noqa: N801
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self):
        super().__init__(program=None)

    def cuLaunchKernel(self, *args):  # noqa: N802
        return (0,)

    def cuGraphLaunch(self, exe, stream):  # noqa: N802
        return (0,)

    def cuModuleLoadData(self, ptx):  # noqa: N802
        return (0, "module")

    def cuFuncSetAttribute(self, *args):  # noqa: N802
        return (0,)


@contextlib.contextmanager
def stub_cuda():
    """The cuda target's runtime on CPU tensors with a no-op driver (device index -1: what a
    CPU tensor's get_device() says)."""
    saved = [(runtime, "_driver"), (runtime, "check_available"), (runtime, "_raw_stream"),
             (runtime, "_capturing"), (runtime, "_current_device"), (torch.cuda.nvtx, "range_push"),
             (torch.cuda.nvtx, "range_pop"), (torch.cuda, "current_device")]
    saved = [(m, n, getattr(m, n, None)) for m, n in saved]
    check = runtime.check_available
    runtime._driver = StubDriver()
    runtime.check_available = lambda: None
    runtime._raw_stream = lambda index: 7
    runtime._capturing = lambda: False
    runtime._current_device = lambda: -1
    torch.cuda.nvtx.range_push = lambda name: 0
    torch.cuda.nvtx.range_pop = lambda: 0
    torch.cuda.current_device = lambda: -1
    init, cg_init = runtime.CudaExecutable.__init__, compiled_mod.CompiledGraph.__init__

    def cg_on_cpu(self, *a, **kw):
        cg_init(self, *a, **kw)
        if self._on_device == "is_cuda":  # CPU tensors stand in for the device's
            self._on_device = "is_cpu"

    def init_on_cpu(self, *a, **kw):
        init(self, *a, **kw)
        self._devices[-1] = torch.device("cpu")

    runtime.CudaExecutable.__init__ = init_on_cpu
    compiled_mod.CompiledGraph.__init__ = cg_on_cpu
    object.__setattr__(TARGET, "check_available", lambda: None)  # (a frozen dataclass)
    try:
        yield
    finally:
        object.__setattr__(TARGET, "check_available", check)
        runtime.CudaExecutable.__init__ = init
        compiled_mod.CompiledGraph.__init__ = cg_init
        for m, n, v in saved:
            setattr(m, n, v)


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


def workloads():
    """(name, model, input sets, training?, pool_bytes): launch-bound inference, one kernel into
    pooled outputs, one kernel into fresh outputs (grid_sample_msda's 82 MB output is over
    POOL_BYTES), and a training step (AOTAutograd forward + backward)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    pooled = runtime.POOL_BYTES
    yield "chain", Chain(), [(r(64, 64), r(64, 64), r(64, 64)) for _ in range(4)], False, pooled
    grids = [(r(2, 8, 15, 25), torch.rand(2, 50, 32, 2, generator=g) * 2.2 - 1.1) for _ in range(4)]
    yield "grid_sample", GridSample(), grids, False, pooled
    yield "grid_sample_fresh", GridSample(), grids, False, 0
    yield "train_mlp", Mlp(), [(r(64, 64), r(64, 64)) for _ in range(4)], True, pooled
    from bench_h200 import TrainStep  # (the bench's training step, on a small MLP)

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", default="")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    with stub_cuda():
        limit = runtime.POOL_BYTES
        for name, model, sets, train, pool_bytes in workloads():
            if args.only and name not in args.only.split(","):
                continue
            us = measure(name, model, sets, train, pool_bytes, args.calls, name == args.profile)
            runtime.POOL_BYTES = limit
            print(f"{name}: {us:.1f} us host per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

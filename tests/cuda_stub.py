"""The cuda target's runtime on CPU tensors with a driver whose calls return at once: what the
host-path tests and benchmarks/host_path.py time and check without a GPU (CPU tensors stand in
for device tensors; device index -1 is what a CPU tensor's get_device() says)."""

from __future__ import annotations

import contextlib

import torch

from gac_torch.backends.cuda import runtime
from gac_torch.backends.cuda.target import TARGET
from test_cuda_runtime import _FakeDriver


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
    init = runtime.CudaExecutable.__init__

    def init_on_cpu(self, *a, **kw):
        init(self, *a, **kw)
        self._devices[-1] = torch.device("cpu")

    runtime.CudaExecutable.__init__ = init_on_cpu
    object.__setattr__(TARGET, "check_available", lambda: None)  # (a frozen dataclass)
    try:
        yield
    finally:
        object.__setattr__(TARGET, "check_available", check)
        runtime.CudaExecutable.__init__ = init
        for m, n, v in saved:
            setattr(m, n, v)

"""Run a CudaProgram: PTX loaded through the CUDA driver API (cuda-python), kernels launched on
torch's current stream, buffers from torch's caching allocator.

- Tensors arrive through DLPack (`__dlpack__`), so any producer works; torch tensors pass as is.
- The PTX module is loaded once per CUDA context (torch uses the device's primary context).
- Intermediates live in one workspace sized by the static memory plan, allocated per run from
  torch's caching allocator on the launch stream (so reuse across runs is stream-ordered).
- Every driver call is checked; errors name the kernel and the call.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from gac_torch.backends.base import Signature, TargetUnavailable
from gac_torch.backends.cuda.program import BufferRef, CudaProgram, KernelLaunch

try:  # cuda-python >= 12.6 layout, then the older one
    from cuda.bindings import driver as _driver
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    try:
        from cuda import cuda as _driver  # type: ignore[no-redef]
    except ImportError:
        _driver = None


def check_available() -> None:
    if _driver is None:
        raise TargetUnavailable("target 'cuda' needs cuda-python: pip install 'gac-torch[cuda]'")
    if not torch.cuda.is_available():
        raise TargetUnavailable(
            "target 'cuda' needs an NVIDIA GPU and a CUDA build of torch "
            f"(torch {torch.__version__} sees none); compiling to PTX works without one")


class CudaError(RuntimeError):
    pass


# GAC_CUDA_SYNC=1: synchronize after every launch so a fault names its kernel (slow).
SYNC_AFTER_LAUNCH = os.environ.get("GAC_CUDA_SYNC", "0") not in ("", "0")


def _check(result: Any, what: str) -> Any:
    """cuda-python returns (CUresult, *values); raise with the error's name on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = _driver.cuGetErrorName(err)
        _, desc = _driver.cuGetErrorString(err)
        raise CudaError(f"{what}: {name.decode() if name else int(err)} ({desc.decode() if desc else ''})")
    return values[0] if len(values) == 1 else values


_SCALAR_PACK = {"i8": "b", "i16": "h", "i32": "i", "i64": "q", "f32": "f", "f64": "d"}


def _pack_scalar(ctype: str, value: Any) -> bytes:
    if ctype == "f16":
        return struct.pack("<e", value)
    if ctype == "bf16":
        return struct.pack("<I", struct.unpack("<I", struct.pack("<f", value))[0])[2:]
    return struct.pack("<" + _SCALAR_PACK[ctype], value)


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__dlpack__"):
        return torch.from_dlpack(x)
    raise TypeError(f"expected a tensor or a DLPack producer, got {type(x).__name__}")


class CudaExecutable:
    """Replays the program's launches. One instance may serve several devices/contexts."""

    def __init__(self, program: CudaProgram, signature: Signature):
        check_available()
        specs = list(signature.inputs) + list(signature.outputs)
        if len(specs) != len(program.args):
            raise ValueError(f"program has {len(program.args)} buffers, signature {len(specs)}")
        for i, (s, a) in enumerate(zip(specs, program.args)):
            if tuple(s.shape) != a.shape or s.dtype.itemsize != a.itemsize:
                raise ValueError(f"buffer {i}: signature {s} does not match compiled {a.elem}{list(a.shape)}")
        self.program = program
        self.signature = signature
        self.n_inputs = len(signature.inputs)
        self._modules: dict[int, dict[str, Any]] = {}  # context handle -> kernel name -> CUfunction
        self._lock = threading.Lock()
        self._ptx = program.ptx.encode() + b"\0"

    def _functions(self, device: torch.device) -> dict[str, Any]:
        ctx = _check(_driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:  # this thread made no runtime call yet: use torch's primary context
            dev = _check(_driver.cuDeviceGet(device.index), "cuDeviceGet")
            ctx = _check(_driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check(_driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        key = int(ctx)
        with self._lock:
            funcs = self._modules.get(key)
            if funcs is None:
                module = _check(_driver.cuModuleLoadData(self._ptx), "cuModuleLoadData (PTX JIT)")
                funcs = {}
                for k in self.program.launches:
                    if k.kernel not in funcs:
                        funcs[k.kernel] = _check(_driver.cuModuleGetFunction(module, k.kernel.encode()),
                                                 f"cuModuleGetFunction({k.kernel})")
                funcs["__module__"] = module
                self._modules[key] = funcs
        return funcs

    def run(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        ins = [_as_tensor(x) for x in inputs]
        outs = [_as_tensor(x) for x in outputs]
        tensors = ins + outs
        if len(tensors) != len(self.program.args):
            raise ValueError(f"expected {self.n_inputs} inputs and "
                             f"{len(self.program.args) - self.n_inputs} outputs")
        if not self.program.launches:
            return  # nothing to compute (all outputs empty)
        device = next((t.device for t in tensors if t.device.type == "cuda"),
                      torch.device("cuda", torch.cuda.current_device()))
        bufs: list[torch.Tensor] = []
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (t, spec) in enumerate(zip(tensors, self.program.args)):
            if t.device != device:
                raise ValueError(f"buffer {i} is on {t.device}, expected {device}")
            if tuple(t.shape) != spec.shape or t.element_size() != spec.itemsize:
                raise ValueError(f"buffer {i}: got {t.dtype}{list(t.shape)}, compiled for {spec.elem}{list(spec.shape)}")
            if not t.is_contiguous():
                c = t.contiguous()
                if i >= self.n_inputs:
                    copy_back.append((t, c))
                t = c
            bufs.append(t)
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            funcs = self._functions(device)
            plan = self.program.plan
            ws = (torch.empty(plan.workspace_size, dtype=torch.uint8, device=device)
                  if plan.workspace_size else None)
            arg_ptrs = [b.data_ptr() for b in bufs]
            temp_ptrs = [ws.data_ptr() + plan.offsets[t.name] for t in self.program.temps] if ws is not None else []
            handle = _driver.CUstream(stream.cuda_stream)
            for k in self.program.launches:
                self._launch(funcs[k.kernel], k, arg_ptrs, temp_ptrs, handle)
                if SYNC_AFTER_LAUNCH:  # debugging: pin asynchronous faults on their kernel
                    _check(_driver.cuStreamSynchronize(handle), f"kernel {k.kernel}")
        for dst, src in copy_back:
            dst.copy_(src)

    @staticmethod
    def _launch(func: Any, k: KernelLaunch, arg_ptrs: list[int], temp_ptrs: list[int], stream: Any) -> None:
        # kernelParams is a void** array; each entry points at the argument's bytes.
        storage = []
        for a in k.args:
            if isinstance(a, BufferRef):
                ptr = arg_ptrs[a.index] if a.kind == "arg" else temp_ptrs[a.index]
                storage.append(ctypes.c_uint64(ptr))
            else:
                raw = _pack_scalar(a.ctype, a.value)
                storage.append(ctypes.create_string_buffer(raw, len(raw)))
        argv = (ctypes.c_void_p * max(1, len(storage)))(*[ctypes.addressof(s) for s in storage])
        _check(_driver.cuLaunchKernel(func, *k.grid, *k.block, k.shared_mem, stream,
                                      ctypes.addressof(argv), 0),
               f"cuLaunchKernel({k.kernel}, grid={k.grid}, block={k.block})")

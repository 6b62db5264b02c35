"""Run a GpuProgram: its kernels loaded through the CUDA driver API (cuda-python), launched on
torch's current stream, buffers from torch's caching allocator.

- Tensors arrive through DLPack (`__dlpack__`), so any producer works; torch tensors pass as is.
- The kernels are loaded once per CUDA context (torch uses the device's primary context): from
  the program's cubins (one module each, SASS assembled ahead of time by ptxas) when they were
  assembled for this GPU's compute capability, else from the PTX module, which the driver
  JIT-compiles (seconds for a whole model; its own cache, ~/.nv/ComputeCache, keeps the result).
  A cubin the driver refuses (e.g. from a ptxas newer than the driver) falls back to the PTX.
- Intermediates live in one workspace sized by the static memory plan: one allocation per
  (device, stream), kept with the executable and reused by every call on that stream (calls on
  one stream are ordered, so reuse is safe; another stream gets its own workspace).
- Per distinct set of buffer pointers (inputs, outputs, workspace) the kernels' argument arrays
  (`void **kernelParams`) are built once (LRU of TABLE_ENTRIES): a call with pointers seen before
  only issues the launches. A set seen GRAPH_AFTER times is captured once into a CUDA graph (on a
  private stream) and replayed by one cuGraphLaunch; a failure while building it falls back to
  plain launches. Graphs are on by default (option `cuda_graphs`, GAC_CUDA_GRAPHS=0: off).
- `call` (what CompiledGraph uses) makes the pointer sets repeat: a program with static shapes
  and outputs of at most POOL_BYTES writes into output buffers the executable owns (pool.py: a
  few sets per stream, at most POOL_TOTAL bytes, kept until the executable is freed; a set is
  reused only once the caller dropped every alias of it), so
  inputs at stable addresses (parameters, a rotation of batches) replay one graph per call
  whatever the number of kernels. Larger outputs, GAC_CUDA_SYNC=1, graphs off and a pool whose
  every set is held get fresh outputs (the caching allocator mostly hands back the same
  addresses, so their tables and graphs repeat too). `call` checks each argument's dtype,
  shape and device as it reads its pointer; `call_guarded` (inputs whose dtype, shape, strides
  and device dynamo's guards hold) reads only pointers. Both decline dynamic shapes,
  misaligned inputs, another current device and a caller's capture, which CompiledGraph then
  checks and hands to `run`. What a call would look up each time (context, CUstream, pool,
  workspace, fresh outputs' prototypes) is in a `_Lane` (launch_state.py); a one-kernel
  program without TMA arguments launches through its lane's one argument array, rewritten per
  call, and makes fresh outputs by empty_like of one-element prototypes (launch_block.py,
  GAC_LAUNCH_BLOCK=1 default; =0: tables and torch.empty as before).
- Run-time sizes: the program is bound to each distinct set of argument shapes once (LRU of
  CACHE_ENTRIES; GpuProgram.bind: grids, size arguments, temp sizes and memory plan), and the
  per-stream workspace grows to the largest plan; one PTX module serves every size.
- Every driver call is checked; errors name the kernel and the call.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from gac_torch.backends.base import Signature, SizeSpec
from gac_torch.backends.cuda.launch_args import ArgTable
from gac_torch.backends.cuda.launch_block import LaunchBlock, block_for, prototypes, takes_block
from gac_torch.backends.cuda.launch_state import _Bound, _Context, _Entry, _Lane
from gac_torch.backends.cuda import tensor_maps
from gac_torch.backends.cuda.pool import OutputPool
from gac_torch.errors import GacError, TargetUnavailable
from gac_torch.backends.gpu.program import GpuProgram

try:  # cuda-python >= 12.6 layout, then the older one
    from cuda.bindings import driver as _driver
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    try:
        from cuda import cuda as _driver  # type: ignore[no-redef]
    except ImportError:
        _driver = None

log = logging.getLogger("gac_torch")


def check_available() -> None:
    if _driver is None:
        raise TargetUnavailable("target 'cuda' needs cuda-python: pip install 'gac-torch[cuda]'")
    if not torch.cuda.is_available():
        raise TargetUnavailable(
            "target 'cuda' needs an NVIDIA GPU and a CUDA build of torch "
            f"(torch {torch.__version__} sees none); compiling to PTX works without one")


class CudaError(GacError, RuntimeError):
    pass


# GAC_CUDA_SYNC=1: synchronize after every launch so a fault names its kernel (slow).
SYNC_AFTER_LAUNCH = os.environ.get("GAC_CUDA_SYNC", "0") not in ("", "0")
GRAPH_AFTER = 2  # calls with one pointer set before it is captured
# past GRAPH_FREE captures with under two graph launches each (churning pointer sets, e.g. from
# fresh allocations), a set is captured only from its GRAPH_AFTER_CHURN-th call
GRAPH_FREE = GRAPH_AFTER_CHURN = 8
GRAPH_MIN_LAUNCHES = 2  # one kernel launches as fast directly as in a graph
POOL_SETS = 8  # output sets per (device, stream) an executable keeps for graph replays
POOL_BYTES = 64 << 20  # larger outputs: fresh buffers (such a program is device-bound anyway)
POOL_TOTAL = 256 << 20  # at most this many bytes of sets per pool (but always 2 sets)
_empty_like, _DENSE = torch.empty_like, torch.contiguous_format
BUFFER_ALIGN = 16  # bytes; buffers that are not are staged through an aligned copy
CACHE_ENTRIES = 16  # argument shapes (run-time sizes) bound per executable
TABLE_ENTRIES = 64  # pointer sets (tables, graphs) per context: input sets x output sets
STATIC_SHARED_LIMIT = 48 * 1024  # a launch asking for more dynamic shared memory opts in


def graphs_enabled(option: bool | None) -> bool:
    """The `cuda_graphs` option; None: on unless GAC_CUDA_GRAPHS=0 (read per compile)."""
    if option is not None:
        return bool(option)
    return os.environ.get("GAC_CUDA_GRAPHS", "1") not in ("", "0")


def launch_block_enabled() -> bool:
    """GAC_LAUNCH_BLOCK (read per executable): "1" (default) launch_block.py's path (one-kernel
    programs without TMA arguments through a per-lane argument array, fresh outputs by
    empty_like of prototypes); "0": tables and torch.empty, as before."""
    return os.environ.get("GAC_LAUNCH_BLOCK", "1").strip() not in ("", "0")


def cubin_fits(arch: str, capability: tuple[int, int]) -> bool:
    """A cubin for `arch` ("sm_90", "sm_90a") runs on a GPU of this compute capability: the
    same one (SASS of another minor version may run too, but the PTX JIT tunes for it)."""
    m = re.fullmatch(r"sm_(\d+)[af]?", arch)
    return m is not None and int(m.group(1)) == capability[0] * 10 + capability[1]


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _raw_stream(device_index: int) -> int:
    """torch's current stream on that device as a CUstream handle (no Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _current_device() -> int:
    """torch's current CUDA device (no lazy-init check: a call has CUDA tensors already)."""
    return torch._C._cuda_getDevice()


def _capturing() -> bool:
    """The caller is capturing its own CUDA graph on the current stream: gac then neither pools
    outputs nor captures graphs (the caller's graph records plain launches into its buffers)."""
    return torch._C._cuda_isCurrentStreamCapturing()


# (the per-call path calls torch's C functions themselves where this build has them: no frame)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream)
_current_device = getattr(torch._C, "_cuda_getDevice", _current_device)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", _capturing)


def _check(result: Any, what: str) -> Any:
    """cuda-python returns (CUresult, *values); raise with the error's name on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(f"{what}: {_error_text(err)}")
    return values[0] if len(values) == 1 else (values or None)


def _error_text(err: Any) -> str:
    try:
        _, name = _driver.cuGetErrorName(err)
        _, desc = _driver.cuGetErrorString(err)
        return f"{name.decode() if name else int(err)} ({desc.decode() if desc else ''})"
    except Exception:  # noqa: BLE001  # pragma: no cover - error while reporting an error
        return str(int(err))


def _launched(err: Any, bound: _Bound, i: int, stream: Any) -> None:
    """After launch i of `bound`: raise on an error, naming the kernel; with GAC_CUDA_SYNC=1,
    wait for it, so that an asynchronous fault names its kernel too."""
    k = bound.program.launches[i]
    if err:
        raise CudaError(f"cuLaunchKernel({k.kernel}, grid={k.grid}, block={k.block}): {_error_text(err)}")
    _check(_driver.cuStreamSynchronize(stream), f"kernel {k.kernel}")


def _launch(launches: list[tuple], bound: _Bound, stream: Any) -> None:
    """cuLaunchKernel over each of `launches` (its full arguments), checked as `_launched` says."""
    launch = _driver.cuLaunchKernel
    for i, args in enumerate(launches):
        err = launch(*args)[0]
        if err or SYNC_AFTER_LAUNCH:
            _launched(err, bound, i, stream)


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__dlpack__"):
        return torch.from_dlpack(x)
    raise TypeError(f"expected a tensor or a DLPack producer, got {type(x).__name__}")


# --------------------------------------------------------------------------------------------
class CudaExecutable:
    """Replays the program's launches. One instance may serve several devices/contexts."""

    def __init__(self, program: GpuProgram, signature: Signature, graphs: bool | None = None):
        check_available()
        specs = list(signature.inputs) + list(signature.outputs)
        if len(specs) != len(program.args):
            raise ValueError(f"program has {len(program.args)} arguments, signature {len(specs)}")
        for i, (s, a) in enumerate(zip(specs, program.args)):
            if isinstance(s, SizeSpec) != (a.elem == "index") or (
                    not isinstance(s, SizeSpec) and (not a.matches([n if isinstance(n, int) else -1 for n in s.shape])
                                                     or s.dtype.itemsize != a.itemsize)):
                raise ValueError(f"argument {i}: signature {s} does not match compiled {a.elem}{list(a.shape)}")
        self.program = program
        self.signature = signature
        self.n_inputs = len(signature.inputs)
        self._static = None if program.dynamic else _Bound.of(None, program)
        self._bound: OrderedDict = OrderedDict()  # sizes -> _Bound (run-time sizes)
        self._contexts: dict[int, _Context] = {}  # CUcontext handle -> state
        self._ready = threading.local()  # per thread: device index -> _Context
        self._lock = threading.Lock()
        self._ptx = program.ptx.encode() + b"\0"
        self.loaded_from = ""  # "cubin" or "ptx" once loaded (tests, benchmarks)
        self.use_graphs = graphs_enabled(graphs)
        self._blocks = launch_block_enabled()  # (`call`'s fresh outputs from prototypes)
        self._one = self._blocks and takes_block(program)  # (`call` through the lane's LaunchBlock)
        self._devices: dict[int, torch.device] = {}
        self._out_specs = [(tuple(s.shape), s.dtype) for s in signature.outputs]
        # what `call` checks per argument: (dtype, torch.Size); None: run-time sizes (never fast)
        self._arg_specs = None if program.dynamic or signature.dynamic else [
            (s.dtype, torch.Size(s.shape)) for s in signature.inputs]
        out_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in signature.outputs
                        if not isinstance(s, SizeSpec) and all(isinstance(n, int) for n in s.shape))
        # outputs in a pool (stable addresses for graphs): static shapes, not empty, not too big
        self._poolable = (not program.dynamic and bool(program.launches) and 0 < out_bytes <= POOL_BYTES
                          and len(signature.outputs) == len(program.args) - self.n_inputs)
        # (a pool's memory stays with the executable until it is freed, e.g. torch._dynamo.reset())
        self._pool_sets = max(2, min(POOL_SETS, POOL_TOTAL // max(out_bytes, 1)))
        # calls launched kernel by kernel / as one graph; argument tables and graphs built;
        # calls that found every pooled output set held by the caller
        self.stats = {"direct_calls": 0, "graph_calls": 0, "tables_built": 0, "graphs_built": 0,
                      "pool_misses": 0}

    # -- per context ----------------------------------------------------------------------------

    def _context(self, device: torch.device) -> _Context:
        ready = getattr(self._ready, "by_device", None)
        if ready is None:
            ready = self._ready.by_device = {}
        ctx_state = ready.get(device.index)
        if ctx_state is not None:
            return ctx_state
        # First call on this thread for this device: make sure a context is current (torch
        # uses the primary context), load the module once per context.
        ctx = _check(_driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:
            dev = _check(_driver.cuDeviceGet(device.index), "cuDeviceGet")
            ctx = _check(_driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check(_driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        with self._lock:
            ctx_state = self._contexts.get(int(ctx))
            if ctx_state is None:
                modules, by_name = self._load_kernels(device)
                for k in self.program.launches:
                    if k.shared_mem > STATIC_SHARED_LIMIT:  # dynamic shared memory past 48 KiB: opt in
                        _check(_driver.cuFuncSetAttribute(
                            by_name[k.kernel],
                            _driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            k.shared_mem), f"cuFuncSetAttribute({k.kernel}, shared memory {k.shared_mem})")
                ctx_state = _Context(by_name, modules)
                self._contexts[int(ctx)] = ctx_state
        ready[device.index] = ctx_state
        return ctx_state

    def _load_kernels(self, device: torch.device) -> tuple[list[Any], dict[str, Any]]:
        """(modules, kernel name -> CUfunction): from the cubins when they fit this GPU, else
        from the PTX. `self.loaded_from` says which ("cubin" or "ptx")."""
        names = {k.kernel for k in self.program.launches}
        cubins = self.program.cubins
        capability = _capability(device) if cubins else None
        if capability and all(cubin_fits(c.arch, capability) for c in cubins) \
                and names <= {n for c in cubins for n in c.kernels}:
            modules: list[Any] = []
            try:
                by_name: dict[str, Any] = {}
                for c in cubins:
                    module = _check(_driver.cuModuleLoadData(c.data), f"cuModuleLoadData (cubin {c.arch})")
                    modules.append(module)
                    for name in c.kernels:
                        by_name[name] = _check(_driver.cuModuleGetFunction(module, (c.entry or name).encode()),
                                               f"cuModuleGetFunction({name})")
                self.loaded_from = "cubin"
                return modules, by_name
            except CudaError as e:
                log.warning("cuda: the program's cubins do not load (%s); JIT-compiling its PTX", e)
                for m in modules:
                    _driver.cuModuleUnload(m)
        module = _check(_driver.cuModuleLoadData(self._ptx), "cuModuleLoadData (PTX JIT)")
        by_name = {n: _check(_driver.cuModuleGetFunction(module, n.encode()), f"cuModuleGetFunction({n})")
                   for n in sorted(names)}
        self.loaded_from = "ptx"
        return [module], by_name

    # -- per call -------------------------------------------------------------------------------

    def bind(self, values: Sequence) -> _Bound:
        """The launch plan for these argument shapes / sizes (cached)."""
        if self._static is not None:
            return self._static
        key = tuple(values)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = _Bound.of(key, self.program.bind(values))
            if len(self._bound) > CACHE_ENTRIES:
                self._bound.popitem(last=False)
        else:
            self._bound.move_to_end(key)
        return bound

    def call(self, args: Sequence) -> list[torch.Tensor] | None:
        """CompiledGraph's per-call path: runs on the partition's arguments and returns its
        outputs, or None to decline (CompiledGraph then checks the arguments, naming what is
        wrong, and goes through `run`): run-time sizes, an argument that is not a tensor of its
        compiled dtype and shape on the current device at a 16-byte aligned address, a call
        inside the caller's own CUDA graph capture. A strided input is made dense (a copy).
        Outputs: pooled buffers where graphs can replay into them, else fresh ones. Per call:
        one pass over the arguments (metadata and pointer reads), one lane and one table
        lookup, one launch (a graph, or a one-kernel program's prebuilt launch) or one per
        kernel; nothing that scales with the number of kernels."""
        specs = self._arg_specs
        if specs is None or len(args) != len(specs) or _capturing():  # (run: plainly into it)
            return None
        dev = _current_device()
        ptrs = []
        dense = []  # copies of strided inputs, alive until their launches are issued
        try:
            for a, (dtype, shape) in zip(args, specs):
                if a.dtype is not dtype or a.shape != shape or a.get_device() != dev:
                    return None
                if not a.is_contiguous():
                    a = a.contiguous()
                    dense.append(a)
                p = a.data_ptr()
                if p % BUFFER_ALIGN:
                    return None  # (run stages it through an aligned copy)
                ptrs.append(p)
        except (AttributeError, RuntimeError):  # not a tensor; not strided (no data pointer)
            return None
        return self._launch_into(dev, ptrs)

    def call_guarded(self, args: Sequence) -> list[torch.Tensor] | None:
        """`call` for arguments whose dtypes, shapes, dense strides and device torch's guards
        guarantee (dynamo's, for a graph whose compile-time inputs were dense and on one device:
        frontends/dynamo.py): only their pointers are read. Still declines an input at a
        misaligned address (a view's offset), a current device other than theirs, a capture."""
        if self._arg_specs is None or _capturing():
            return None
        dev = _current_device()
        if args and args[0].get_device() != dev:
            return None
        ptrs = [a.data_ptr() for a in args]
        for p in ptrs:
            if p % BUFFER_ALIGN:
                return None
        return self._launch_into(dev, ptrs)

    def _launch_into(self, dev: int, ptrs: list[int]) -> list[torch.Tensor]:
        """Launches over input pointers `ptrs` on `dev` (the current device) into pooled or
        fresh outputs, which it returns."""
        handle = _raw_stream(dev)
        lanes = getattr(self._ready, "lanes", None)  # (_lane's lookup, inlined: every call)
        lane = lanes.get((dev, handle)) if lanes is not None else None
        if lane is None:
            lane = self._lane(dev, handle)
        got = lane.pool.acquire() if lane.pool is not None else None
        if got is None:
            if lane.pool is not None:
                self.stats["pool_misses"] += 1
            protos = lane.protos
            if protos is None and self._blocks:  # (made here: `call` never runs in a caller's capture)
                protos = lane.protos = prototypes(self._out_specs, lane.device)
            if protos is not None:  # (empty_like: less argument parsing than torch.empty)
                outs = [_empty_like(p, memory_format=_DENSE) for p in protos]
            else:
                outs = [torch.empty(shape, dtype=dtype, device=lane.device) for shape, dtype in self._out_specs]
            ptrs += [o.data_ptr() for o in outs]
        else:
            out_set, outs = got
            ptrs += out_set.ptrs
        block = lane.block
        if block is not None:
            slots = block.slots  # (LaunchBlock.fill, inlined)
            for j, i in block.ptrs:
                slots[j] = ptrs[i]
            err = _driver.cuLaunchKernel(*block.args)[0]
            if err or SYNC_AFTER_LAUNCH:
                _launched(err, self._static, 0, lane.stream)
            self.stats["direct_calls"] += 1
            return outs
        self._issue(lane, self._static, (None, *ptrs, lane.ws_ptr), ptrs, False)
        return outs

    def _lane(self, dev: int, handle: int) -> _Lane:
        """What calls on (device, stream) from this thread look up once: the context, the
        CUstream, the output pool (static shapes, graphs on) and a static plan's workspace."""
        lanes = getattr(self._ready, "lanes", None)
        if lanes is None:
            lanes = self._ready.lanes = {}
        lane = lanes.get((dev, handle))
        if lane is not None:
            return lane
        device = self._devices.get(dev)
        if device is None:
            device = self._devices[dev] = torch.device("cuda", dev)
        state = self._context(device)
        stream = state.streams.get(handle)
        if stream is None:
            stream = state.streams[handle] = _driver.CUstream(handle)
        pool = None
        if self.use_graphs and self._poolable and not SYNC_AFTER_LAUNCH:
            with self._lock:
                pool = state.pools.get(handle)
                if pool is None:
                    pool = state.pools[handle] = OutputPool(self._out_specs, device, self._pool_sets)
        ws_ptr = 0
        if self._static is not None and self._static.program.plan.workspace_size:
            ws_ptr = self._workspace(state, handle, device, self._static.program.plan.workspace_size)
        block = self._block(state, stream, ws_ptr) if self._one else None
        lane = lanes[(dev, handle)] = _Lane(device, state, handle, stream, pool, ws_ptr, None, block)
        return lane

    def _block(self, state: _Context, stream: Any, ws_ptr: int) -> LaunchBlock:
        """The lane's argument array for the one launch (host memory: building it inside a
        caller's capture records nothing)."""
        return block_for(self._static.program, self._heads(state, self._static)[0], stream, ws_ptr)

    def run(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        args = [x if isinstance(x, (torch.Tensor, int)) else _as_tensor(x) for x in (*inputs, *outputs)]
        if len(args) != len(self.program.args):
            raise ValueError(f"expected {self.n_inputs} inputs and "
                             f"{len(self.program.args) - self.n_inputs} outputs")
        if not self.program.launches:
            return  # nothing to compute (all outputs empty)
        device = None
        for t in args:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                device = t.device
                break
        if device is None:
            device = torch.device("cuda", _current_device())
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        ptrs = []
        for i, t in enumerate(args):
            spec = self.program.args[i]
            if isinstance(t, int) or spec.elem == "index":
                if not isinstance(t, int) or spec.elem != "index":
                    raise ValueError(f"argument {i}: got {type(t).__name__}, compiled for {spec.elem}")
                ptrs.append(0)  # a size: no pointer (its value reaches kernels through bind)
                continue
            if t.device != device:
                raise ValueError(f"buffer {i} is on {t.device}, expected {device}")
            if not spec.matches(t.shape) or t.element_size() != spec.itemsize:
                raise ValueError(f"buffer {i}: got {t.dtype}{list(t.shape)}, compiled for "
                                 f"{spec.elem}{['?' if n == -1 else n for n in spec.shape]}")
            ptr = t.data_ptr()
            if ptr % BUFFER_ALIGN or not t.is_contiguous():
                # kernels load 16-byte vectors from buffer bases (a view's offset can break that)
                c = torch.empty(t.shape, dtype=t.dtype, device=device)
                if i >= self.n_inputs:
                    copy_back.append((t, c))
                else:
                    c.copy_(t)
                args[i] = c  # keep it alive until the launches are issued
                ptr = c.data_ptr()
            ptrs.append(ptr)
        bound = self._static or self.bind([tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args])
        if device.index != _current_device():
            with torch.cuda.device(device):
                self._launch_all(device, ptrs, bound)
        else:
            self._launch_all(device, ptrs, bound)
        for dst, src in copy_back:
            dst.copy_(src)

    def _launch_all(self, device: torch.device, ptrs: list[int], bound: _Bound | None = None,
                    handle: int | None = None) -> None:
        bound = bound or self._static  # (None: a program without run-time sizes)
        if handle is None:
            handle = _raw_stream(device.index)
        self._devices.setdefault(device.index, device)
        lane = self._lane(device.index, handle)
        size = bound.program.plan.workspace_size
        ws_ptr = self._workspace(lane.state, handle, device, size) if size else 0
        self._issue(lane, bound, (bound.key, *ptrs, ws_ptr), ptrs, _capturing(), ws_ptr)

    def _workspace(self, state: _Context, handle: int, device: torch.device, size: int) -> int:
        ws = state.workspaces.get(handle)
        if ws is None or ws.numel() < size:
            # allocated on this stream; later calls on it reuse it in order (run-time sizes:
            # grown to the largest plan seen; a table built for an older workspace is only
            # found again if the new one has the same address, where it is still valid)
            ws = state.workspaces[handle] = torch.empty(size, dtype=torch.uint8, device=device)
        return ws.data_ptr()

    def _issue(self, lane: _Lane, bound: _Bound, key: tuple, ptrs: list[int], capturing: bool,
               ws_ptr: int | None = None) -> None:
        """Launches `bound` over the buffers `ptrs` (+ the workspace) on the lane's stream:
        the argument table of that pointer set (built on its first call), replayed as one
        graph from its GRAPH_AFTER-th call where graphs are on."""
        state = lane.state
        entry = state.tables.get(key)
        if entry is None:
            entry = self._new_entry(state, key, bound, ptrs, lane.ws_ptr if ws_ptr is None else ws_ptr,
                                    lane.device)
        else:
            state.tables.move_to_end(key)
        entry.hits += 1
        if self.use_graphs and len(bound.launches) >= GRAPH_MIN_LAUNCHES and not SYNC_AFTER_LAUNCH \
                and not capturing:
            if entry.graph is None and entry.hits >= GRAPH_AFTER and (
                    entry.hits >= GRAPH_AFTER_CHURN or self._graphs_pay()):
                self._capture(state, entry, bound)
            if entry.graph is not None:
                err = _driver.cuGraphLaunch(entry.graph[1], lane.stream)[0]
                if err:
                    raise CudaError(f"cuGraphLaunch: {_error_text(err)}")
                self.stats["graph_calls"] += 1
                return
        direct = entry.direct  # (the launch arguments are built once per stream)
        if direct is None or direct[0] != lane.handle:
            direct = entry.direct = (lane.handle, self._launch_args(state, entry.table, lane.stream, bound))
        _launch(direct[1], bound, lane.stream)
        self.stats["direct_calls"] += 1

    def _graphs_pay(self) -> bool:
        built = self.stats["graphs_built"]
        return built < GRAPH_FREE or self.stats["graph_calls"] >= 2 * built

    def _new_entry(self, state: _Context, key: tuple, bound: _Bound, ptrs: list[int], ws_ptr: int,
                   device: torch.device) -> _Entry:
        program = bound.program
        offsets = program.plan.offsets
        temp_ptrs = [ws_ptr + offsets[t.name] for t in program.temps]
        maps, where = tensor_maps.upload(_driver, _check, program.launches, ptrs, temp_ptrs, device)
        table = ArgTable(program.launches, ptrs, temp_ptrs, where)
        entry = state.tables[key] = _Entry(table, tensor_maps=maps)
        self.stats["tables_built"] += 1
        if len(state.tables) > TABLE_ENTRIES:
            _, old = state.tables.popitem(last=False)
            self._drop_graph(old)
        return entry

    @staticmethod
    def _heads(state: _Context, bound: _Bound) -> list[tuple]:
        """(function, grid, block, shared memory) per launch: cuLaunchKernel's first 8 arguments."""
        heads = bound.funcs.get(id(state))
        if heads is None:
            heads = bound.funcs[id(state)] = [
                (state.by_name[k.kernel], *grid, *block, smem)
                for k, (grid, block, smem) in zip(bound.program.launches, bound.launches)]
        return heads

    def _launch_args(self, state: _Context, table: ArgTable, stream: Any, bound: _Bound) -> list[tuple]:
        """cuLaunchKernel's arguments per launch of `bound` over `table` on `stream`."""
        return [(*head, stream, argv, 0) for head, argv in zip(self._heads(state, bound), table.argv)]

    def _capture(self, state: _Context, entry: _Entry, bound: _Bound) -> None:
        """Record the launch sequence for this pointer set as a CUDA graph (captured on a
        private stream: nothing runs while capturing)."""
        side = None
        graph = None
        try:
            side = _check(_driver.cuStreamCreate(_driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
                          "cuStreamCreate")
            _check(_driver.cuStreamBeginCapture(
                side, _driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture")
            try:
                _launch(self._launch_args(state, entry.table, side, bound), bound, side)
            finally:
                graph = _check(_driver.cuStreamEndCapture(side), "cuStreamEndCapture")
            exe = _check(_driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            entry.graph = (graph, exe)
            self.stats["graphs_built"] += 1
        except (CudaError, RuntimeError, TypeError) as e:
            log.warning("cuda: CUDA graph capture failed (%s); launching kernels one by one", e)
            self.use_graphs = False
            if graph is not None:
                _driver.cuGraphDestroy(graph)
        finally:
            if side is not None:
                _check(_driver.cuStreamDestroy(side), "cuStreamDestroy")

    @staticmethod
    def _drop_graph(entry: _Entry) -> None:
        if entry.graph is not None and _driver is not None:
            graph, exe = entry.graph
            entry.graph = None
            _driver.cuGraphExecDestroy(exe)
            _driver.cuGraphDestroy(graph)

    def __del__(self) -> None:
        try:
            for state in self._contexts.values():
                for entry in state.tables.values():
                    self._drop_graph(entry)
        except Exception:  # noqa: BLE001, S110  # pragma: no cover - interpreter shutdown
            pass

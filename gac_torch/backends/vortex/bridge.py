"""One device API, two implementations: the real Vortex runtime on SimX, and our functional
simulator. Both run the same .vxbin bytes with the same argument blobs.

    dev = FunctionalDevice()            # or SimxDevice(): needs VORTEX_HOME (see find_vortex)
    a = dev.upload(np.arange(16, dtype=np.float32))
    out = dev.alloc(64)
    mod = dev.load_module(program.vxbin)
    counters = dev.launch(mod, "vecadd", pack_args(("ptr", "ptr", "i32"), [a.address, out.address, 16]),
                          grid=(1,), block=(16,))
    result = dev.download(out, np.float32)
    counters -> {"instructions": warp-instructions, "cycles": int (SimX) | None (functional), ...}
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import tempfile
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .funcsim import HEAP_BASE, FunctionalSimulator
from .target import DEFAULT_CONFIG, ISA_EXT_TCU, VortexConfig
from .vxbin import read_vxbin
from gac_torch.errors import GacError, TargetUnavailable

__all__ = ["DeviceBuffer", "VortexDevice", "FunctionalDevice", "SimxDevice", "SimxError",
           "SimxTimeout", "SimxWorkerDied", "SimxRuntimeError", "VortexApiMismatch",
           "VortexNotFound", "VORTEX_API", "RUNTIME_SYMBOLS", "find_vortex", "is_retryable",
           "launch_timeout", "simx_available"]

Dims = Sequence[int] | int


@dataclass(frozen=True)
class DeviceBuffer:
    handle: int
    address: int          # device address: what goes into kernel argument blobs
    size: int


class VortexDevice(ABC):
    """`alloc` returns a buffer whose device memory is released when the DeviceBuffer object dies
    (or at `free`). The release is deferred to the device's next request, since a finalizer may
    run in the middle of another request to the SimX worker."""

    kind: str = ""
    config: VortexConfig
    allocated_bytes: int = 0          # live device buffers, in bytes

    def alloc(self, size: int) -> DeviceBuffer:
        self._flush_released()
        handle, address = self._alloc(size)
        buf = DeviceBuffer(handle, address, size)
        self.__dict__.setdefault("_finalizers", {})[handle] = weakref.finalize(
            buf, _defer_release, weakref.ref(self), handle, size)
        self.allocated_bytes += size
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        fin = self.__dict__.get("_finalizers", {}).get(buf.handle)
        if fin is not None:
            fin()                    # runs once: queues the release
        self._flush_released()

    def _flush_released(self) -> None:
        pending = self.__dict__.get("_released")
        if pending:
            self.__dict__["_released"] = []
            self._release(pending)

    @abstractmethod
    def _alloc(self, size: int) -> tuple[int, int]:
        """(handle, device address) of a new buffer."""

    @abstractmethod
    def _release(self, handles: list[int]) -> None: ...

    @abstractmethod
    def write(self, buf: DeviceBuffer, data: bytes, offset: int = 0) -> None: ...

    @abstractmethod
    def read(self, buf: DeviceBuffer, size: int | None = None, offset: int = 0) -> bytes: ...

    @abstractmethod
    def load_module(self, vxbin: bytes) -> int: ...

    @abstractmethod
    def launch(self, module: int, kernel: str, args: bytes, grid: Dims, block: Dims,
               lmem_size: int = 0) -> dict[str, Any]: ...

    def close(self) -> None:
        pass

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        data = _as_bytes(np.asarray(array))
        buf = self.alloc(max(len(data), 4))
        self.write(buf, data)
        return buf

    def download(self, buf: DeviceBuffer, dtype: Any, shape: Sequence[int] | None = None) -> np.ndarray:
        out = np.frombuffer(self.read(buf), dtype=dtype)
        return out.reshape(shape) if shape is not None else out

    def __enter__(self) -> "VortexDevice":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _defer_release(dev_ref: "weakref.ref[VortexDevice]", handle: int, size: int) -> None:
    dev = dev_ref()
    if dev is not None:
        dev.__dict__.setdefault("_released", []).append(handle)
        dev.__dict__["_finalizers"].pop(handle, None)
        dev.allocated_bytes -= size


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).tobytes()
    return bytes(data)


def _dims3(d: Dims) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, int) else tuple(d)
    return tuple(int(v) for v in t) + (1,) * (3 - len(t))  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
class FunctionalDevice(VortexDevice):
    """Our Python interpreter (funcsim). `strict=True`: divergent branches raise."""

    kind = "functional"

    def __init__(self, config: VortexConfig = DEFAULT_CONFIG, strict: bool = False, **sim_kw: Any) -> None:
        self.config, self.strict = config, strict
        self.sim = FunctionalSimulator(config, **sim_kw)
        self._loaded: int | None = None
        self._module_count = 0
        self._blocks: dict[int, tuple[int, int]] = {}     # handle -> (address, rounded size)
        self._free_blocks: dict[int, list[int]] = {}      # rounded size -> addresses
        self._buffer_count = 0

    def _alloc(self, size: int) -> tuple[int, int]:
        # freed blocks are reused by size class (64-byte multiples), else the bump allocator grows
        rounded = max(64, (size + 63) // 64 * 64)
        free = self._free_blocks.get(rounded)
        if free:
            addr = free.pop()
            # zeroed like fresh memory: results must not depend on what ran before
            self.sim.write(addr, bytes(rounded))
        else:
            addr = self.sim.alloc(rounded)
        self._buffer_count += 1
        self._blocks[self._buffer_count] = (addr, rounded)
        return self._buffer_count, addr

    def _release(self, handles: list[int]) -> None:
        for h in handles:
            addr, rounded = self._blocks.pop(h)
            self._free_blocks.setdefault(rounded, []).append(addr)

    @property
    def heap_bytes(self) -> int:
        """Device memory the allocator has ever handed out (its high-water mark)."""
        return self.sim._brk - HEAP_BASE

    def write(self, buf: DeviceBuffer, data: bytes, offset: int = 0) -> None:
        data = _as_bytes(data)
        if offset + len(data) > buf.size:
            raise ValueError("write past the end of the buffer")
        self.sim.write(buf.address + offset, data)

    def read(self, buf: DeviceBuffer, size: int | None = None, offset: int = 0) -> bytes:
        size = buf.size - offset if size is None else size
        return self.sim.read(buf.address + offset, size)

    def load_module(self, vxbin: bytes) -> int:
        """Like SimX: one resident module (every image is linked at 0x80000000)."""
        self._module_count += 1
        self._loaded = self._module_count
        self.sim.load(vxbin)
        return self._loaded

    def launch(self, module: int, kernel: str, args: bytes, grid: Dims, block: Dims,
               lmem_size: int = 0) -> dict[str, Any]:
        if self._loaded != module:
            raise ValueError(f"module {module} is not loaded (loading a module unloads the previous one)")
        return self.sim.launch(kernel, args, _dims3(grid), _dims3(block), lmem_size, strict=self.strict)


# ----------------------------------------------------------------------------------------------
class VortexNotFound(TargetUnavailable):
    pass


# The runtime API the bridge (simx_worker.py) calls, checked symbol by symbol at device open.
VORTEX_API = "Vortex 3.0 (vortex2.h API; checked against vortexgpgpu/vortex d76b7f24e, v3.0)"
RUNTIME_SYMBOLS = (
    "vx_device_open", "vx_device_release", "vx_device_query", "vx_device_mpm_query",
    "vx_queue_create", "vx_queue_release", "vx_queue_finish",
    "vx_buffer_create", "vx_buffer_address", "vx_buffer_release",
    "vx_enqueue_write", "vx_enqueue_read", "vx_enqueue_launch",
    "vx_module_load_bytes", "vx_module_get_kernel", "vx_module_release", "vx_kernel_release",
    "vx_result_string",
)


class VortexApiMismatch(VortexNotFound):
    """libvortex.so lacks functions the bridge calls: a build from another Vortex tree."""


class SimxError(GacError, RuntimeError):
    """A SimX request failed. `retryable`: whether a fresh SimX may succeed (see is_retryable)."""

    retryable = False


class SimxTimeout(SimxError):
    retryable = True


class SimxWorkerDied(SimxError):
    retryable = True


class SimxRuntimeError(SimxError):
    """The Vortex runtime returned an error, or the request was bad: deterministic."""


def is_retryable(exc: BaseException) -> bool:
    """The one place that decides whether rerunning on a fresh SimX can help: only a timeout
    (SimX here now and then never reports a finished launch) or a dead worker. An error the
    runtime returned, a missing symbol or a bad argument fails the same way every time."""
    return isinstance(exc, SimxError) and exc.retryable


# Launch timeout = base + estimated work / a pessimistic SimX speed, capped. Work: the measured
# warp-instruction count of the same launch (kernel, grid, block) when seen before, else
# ceil(threads / lanes) warps x the image's instruction words (a loop-free guess, x LOOP_GUESS).
TIMEOUT_BASE_S = 60.0
TIMEOUT_MAX_S = 3600.0
SIMX_SLOW_RATE = 5_000.0      # warp-instructions / s; SimX runs 40-100 k/s on the 2-core machine
LOOP_GUESS = 8


def launch_timeout(threads: int, lanes: int, code_words: int, known_instructions: int | None = None,
                   base: float = TIMEOUT_BASE_S, rate: float = SIMX_SLOW_RATE,
                   cap: float = TIMEOUT_MAX_S) -> float:
    if known_instructions is not None:
        work = float(known_instructions)
    else:
        work = math.ceil(threads / max(lanes, 1)) * float(code_words) * LOOP_GUESS
    return min(cap, base + work / rate)


_LIB_DIRS = ("runtime/lib", "sw/runtime", "build/sw/runtime", "lib", ".")


def find_vortex(vortex_home: str | os.PathLike | None = None, driver: str | None = None) -> Path:
    """The directory holding libvortex.so and libvortex-<driver>.so under VORTEX_HOME.

    VORTEX_HOME may be a Vortex install prefix (runtime/lib/), a build directory (sw/runtime/)
    or the library directory itself."""
    home = vortex_home or os.environ.get("VORTEX_HOME")
    driver = driver or os.environ.get("VORTEX_DRIVER", "simx")
    if not home:
        raise VortexNotFound("SimX needs a Vortex build: set VORTEX_HOME to its install prefix "
                             "(with runtime/lib/libvortex.so) or build directory, and "
                             "VORTEX_DRIVER=simx (the default)")
    for sub in _LIB_DIRS:
        d = Path(home) / sub
        if (d / "libvortex.so").exists() and (d / f"libvortex-{driver}.so").exists():
            return d.resolve()
    raise VortexNotFound(f"no libvortex.so + libvortex-{driver}.so under VORTEX_HOME={home} "
                         f"(looked in {', '.join(_LIB_DIRS)}); set VORTEX_HOME to a Vortex install "
                         "prefix or build directory, and VORTEX_DRIVER=simx")


def simx_available() -> bool:
    try:
        find_vortex()
        return True
    except VortexNotFound:
        return False


class SimxDevice(VortexDevice):
    """The real Vortex runtime (vortex2.h) with the SimX driver, in a killable worker process."""

    kind = "simx"

    def __init__(self, vortex_home: str | os.PathLike | None = None, timeout: float | None = None,
                 driver: str | None = None) -> None:
        """timeout: seconds for every request (fixed); None: TIMEOUT_BASE_S for host requests and
        launch_timeout(...) for launches."""
        driver = driver or os.environ.get("VORTEX_DRIVER", "simx")
        libdir = find_vortex(vortex_home, driver)
        self.timeout = timeout
        self._code_words = 0
        self._known: dict[tuple, int] = {}       # (kernel, grid, block) -> warp-instructions
        self._log = tempfile.NamedTemporaryFile(prefix="gac-simx-", suffix=".log", delete=False)
        parent, child = socket.socketpair()
        env = dict(os.environ, VORTEX_DRIVER=driver,
                   LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(libdir), os.environ.get("LD_LIBRARY_PATH")])))
        self._proc = subprocess.Popen(
            # run as a plain script: the worker needs only ctypes, not gac_torch (or torch)
            [sys.executable, str(Path(__file__).with_name("simx_worker.py")), str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            env=env, cwd=tempfile.gettempdir())
        child.close()
        self._conn = Connection(parent.detach())
        lib = libdir / "libvortex.so"
        try:
            missing = self._call("check", str(lib), RUNTIME_SYMBOLS)
            if missing:
                raise VortexApiMismatch(
                    f"{lib} lacks {', '.join(missing)}: the bridge needs {VORTEX_API}; point "
                    "VORTEX_HOME at a build of that tree")
            caps = self._call("open", str(lib))
        except BaseException:
            self.close()
            raise
        self.config = VortexConfig(cores=caps["cores"], warps=caps["warps"], threads=caps["threads"],
                                   tcu=bool(caps.get("isa_flags", 0) & ISA_EXT_TCU))
        self.caps = caps

    def _log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        if self._proc.poll() is not None:
            raise SimxWorkerDied(f"the SimX worker is gone (exit {self._proc.returncode}); "
                                 "open a new device")
        if op not in ("check", "open", "close", "free"):
            self._flush_released()
        wait = self.timeout if self.timeout is not None else (timeout or TIMEOUT_BASE_S)
        try:
            self._conn.send((op, *args))
            if not self._conn.poll(wait):
                self._proc.kill()
                raise SimxTimeout(f"SimX did not finish `{op}` within {wait:.0f} s (hang?); "
                                  f"worker killed.\n{self._log_tail()}")
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            self._proc.wait(timeout=10)
            raise SimxWorkerDied(f"SimX worker died during `{op}` (exit {self._proc.returncode}):\n"
                                 f"{self._log_tail()}") from e
        if status != "ok":
            raise SimxRuntimeError(f"{op}: {value}\n{self._log_tail(1000)}")
        return value

    def _alloc(self, size: int) -> tuple[int, int]:
        h, addr = self._call("alloc", size)
        # zeroed, as on the functional device: a released block may come back with old data
        self._call("write", h, 0, bytes(size))
        return h, addr

    def _release(self, handles: list[int]) -> None:
        if self._proc.poll() is None:
            self._call("free", handles)

    def write(self, buf: DeviceBuffer, data: bytes, offset: int = 0) -> None:
        self._call("write", buf.handle, offset, _as_bytes(data))

    def read(self, buf: DeviceBuffer, size: int | None = None, offset: int = 0) -> bytes:
        return self._call("read", buf.handle, offset, buf.size - offset if size is None else size)

    def load_module(self, vxbin: bytes) -> int:
        self._code_words = len(read_vxbin(bytes(vxbin)).image) // 4
        self._known.clear()
        return self._call("load", bytes(vxbin))

    def launch_timeout(self, kernel: str, grid: Dims, block: Dims) -> float:
        g, b = _dims3(grid), _dims3(block)
        threads = math.prod(g) * math.prod(b)
        return launch_timeout(threads, self.config.threads, self._code_words,
                              self._known.get((kernel, g, b)))

    def launch(self, module: int, kernel: str, args: bytes, grid: Dims, block: Dims,
               lmem_size: int = 0) -> dict[str, Any]:
        g, b = _dims3(grid), _dims3(block)
        out = self._call("launch", module, kernel, bytes(args), g, b, lmem_size,
                         timeout=self.launch_timeout(kernel, g, b))
        self._known[(kernel, g, b)] = int(out["instructions"])
        return out

    def close(self) -> None:
        self.__dict__["_released"] = []       # the worker releases everything at close
        if self._proc.poll() is None:
            try:
                self._conn.send(("close",))
                self._conn.poll(30) and self._conn.recv()
            except (EOFError, OSError):
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._conn.close()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __del__(self) -> None:
        try:
            if self._proc.poll() is None:
                self._proc.kill()
        except Exception:  # noqa: BLE001
            pass

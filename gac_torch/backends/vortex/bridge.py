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

import os
import socket
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .funcsim import FunctionalSimulator
from .target import DEFAULT_CONFIG, VortexConfig
from gac_torch.errors import GacError, TargetUnavailable

__all__ = ["DeviceBuffer", "VortexDevice", "FunctionalDevice", "SimxDevice", "SimxError",
           "VortexNotFound", "find_vortex", "simx_available"]

Dims = Sequence[int] | int


@dataclass(frozen=True)
class DeviceBuffer:
    handle: int
    address: int          # device address: what goes into kernel argument blobs
    size: int


class VortexDevice(ABC):
    kind: str = ""
    config: VortexConfig

    @abstractmethod
    def alloc(self, size: int) -> DeviceBuffer: ...

    @abstractmethod
    def free(self, buf: DeviceBuffer) -> None: ...

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
        self._buffers: dict[int, DeviceBuffer] = {}
        self._buffer_count = 0

    def alloc(self, size: int) -> DeviceBuffer:
        self._buffer_count += 1
        buf = DeviceBuffer(self._buffer_count, self.sim.alloc(size), size)
        self._buffers[buf.handle] = buf
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        self._buffers.pop(buf.handle, None)       # bump allocator: memory is not reused

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


class SimxError(GacError, RuntimeError):
    pass


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

    def __init__(self, vortex_home: str | os.PathLike | None = None, timeout: float = 300.0,
                 driver: str | None = None) -> None:
        driver = driver or os.environ.get("VORTEX_DRIVER", "simx")
        libdir = find_vortex(vortex_home, driver)
        self.timeout = timeout
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
        caps = self._call("open", str(libdir / "libvortex.so"))
        self.config = VortexConfig(cores=caps["cores"], warps=caps["warps"], threads=caps["threads"])
        self.caps = caps

    def _log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _call(self, op: str, *args: Any) -> Any:
        if self._proc.poll() is not None:
            raise SimxError(f"the SimX worker is gone (exit {self._proc.returncode}); open a new device")
        try:
            self._conn.send((op, *args))
            if not self._conn.poll(self.timeout):
                self._proc.kill()
                raise SimxError(f"SimX did not finish `{op}` within {self.timeout:.0f} s (hang?); "
                                f"worker killed.\n{self._log_tail()}")
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            self._proc.wait(timeout=10)
            raise SimxError(f"SimX worker died during `{op}` (exit {self._proc.returncode}):\n"
                            f"{self._log_tail()}") from e
        if status != "ok":
            raise SimxError(f"{op}: {value}\n{self._log_tail(1000)}")
        return value

    def alloc(self, size: int) -> DeviceBuffer:
        h, addr = self._call("alloc", size)
        return DeviceBuffer(h, addr, size)

    def free(self, buf: DeviceBuffer) -> None:
        self._call("free", buf.handle)

    def write(self, buf: DeviceBuffer, data: bytes, offset: int = 0) -> None:
        self._call("write", buf.handle, offset, _as_bytes(data))

    def read(self, buf: DeviceBuffer, size: int | None = None, offset: int = 0) -> bytes:
        return self._call("read", buf.handle, offset, buf.size - offset if size is None else size)

    def load_module(self, vxbin: bytes) -> int:
        return self._call("load", bytes(vxbin))

    def launch(self, module: int, kernel: str, args: bytes, grid: Dims, block: Dims,
               lmem_size: int = 0) -> dict[str, Any]:
        return self._call("launch", module, kernel, bytes(args), _dims3(grid), _dims3(block), lmem_size)

    def close(self) -> None:
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

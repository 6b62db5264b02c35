"""Child process that drives the real Vortex runtime (libvortex.so, vortex2.h API) via ctypes.

Run by bridge.SimxDevice as `python simx_worker.py <fd>` (a plain script, no package imports) with
LD_LIBRARY_PATH and VORTEX_DRIVER set (the runtime dlopens libvortex-<driver>.so by name, which
only LD_LIBRARY_PATH at process start can steer). SimX aborts the process on some illegal states
and hangs on others, and its state is process-global: hence a separate, killable process.
Requests are (op, *args) tuples over a multiprocessing Connection; replies ("ok", value) or
("err", message). stdout/stderr go to a log file the parent reads when something fails.
"""

from __future__ import annotations

import ctypes as C
import os
import sys
from multiprocessing.connection import Connection

VX_TIMEOUT_INFINITE = 2**64 - 1
CAPS = {"threads": 1, "warps": 2, "cores": 3, "global_mem_size": 5, "local_mem_size": 6, "isa_flags": 7}
MCYCLE, MINSTRET = 0xB00, 0xB02


class _QueueInfo(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("next", C.c_void_p), ("priority", C.c_int),
                ("flags", C.c_uint32)]


class _LaunchInfo(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("next", C.c_void_p), ("kernel", C.c_void_p),
                ("args_host", C.c_void_p), ("args_size", C.c_size_t), ("ndim", C.c_uint32),
                ("grid_dim", C.c_uint32 * 3), ("block_dim", C.c_uint32 * 3),
                ("lmem_size", C.c_uint32), ("cluster_dim", C.c_uint32 * 3)]


def missing_symbols(libvortex: str, names: list[str]) -> list[str]:
    """The functions of `names` that libvortex.so does not export (looked up, not called)."""
    lib = C.CDLL(libvortex)
    return [n for n in names if not hasattr(lib, n)]


class Runtime:
    def __init__(self, libvortex: str) -> None:
        self.lib = lib = C.CDLL(libvortex)
        lib.vx_result_string.restype = C.c_char_p
        self.dev, self.q = C.c_void_p(), C.c_void_p()
        self._check(lib.vx_device_open(0, C.byref(self.dev)), "vx_device_open")
        qi = _QueueInfo(C.sizeof(_QueueInfo), None, 1, 0)
        self._check(lib.vx_queue_create(self.dev, C.byref(qi), C.byref(self.q)), "vx_queue_create")
        self.buffers: dict[int, C.c_void_p] = {}
        self.modules: dict[int, C.c_void_p] = {}
        self._next = 1

    def _check(self, r: int, what: str) -> None:
        if r != 0:
            msg = self.lib.vx_result_string(r)
            raise RuntimeError(f"{what}: {msg.decode() if msg else r}")

    def _finish(self) -> None:
        self._check(self.lib.vx_queue_finish(self.q, C.c_uint64(VX_TIMEOUT_INFINITE)), "vx_queue_finish")

    def query(self, cap: str) -> int:
        v = C.c_uint64()
        self._check(self.lib.vx_device_query(self.dev, CAPS[cap], C.byref(v)), "vx_device_query")
        return v.value

    def alloc(self, size: int) -> tuple[int, int]:
        buf, addr = C.c_void_p(), C.c_uint64()
        self._check(self.lib.vx_buffer_create(self.dev, C.c_uint64(size), 3, C.byref(buf)), "vx_buffer_create")
        self._check(self.lib.vx_buffer_address(buf, C.byref(addr)), "vx_buffer_address")
        h, self._next = self._next, self._next + 1
        self.buffers[h] = buf
        return h, addr.value

    def free(self, handles: list[int]) -> None:
        for h in handles:
            self._check(self.lib.vx_buffer_release(self.buffers.pop(h)), "vx_buffer_release")

    def write(self, h: int, off: int, data: bytes) -> None:
        src = C.create_string_buffer(data, len(data))
        self._check(self.lib.vx_enqueue_write(self.q, self.buffers[h], C.c_uint64(off), src,
                                              C.c_uint64(len(data)), 0, None, None), "vx_enqueue_write")
        self._finish()

    def read(self, h: int, off: int, size: int) -> bytes:
        dst = C.create_string_buffer(size)
        self._check(self.lib.vx_enqueue_read(self.q, dst, self.buffers[h], C.c_uint64(off),
                                             C.c_uint64(size), 0, None, None), "vx_enqueue_read")
        self._finish()
        return dst.raw

    def load(self, vxbin: bytes) -> int:
        # every image is linked at STARTUP_ADDR: only one module can be resident at a time
        for m in self.modules.values():
            self.lib.vx_module_release(m)
        self.modules.clear()
        mod = C.c_void_p()
        self._check(self.lib.vx_module_load_bytes(self.dev, vxbin, C.c_size_t(len(vxbin)),
                                                  C.byref(mod)), "vx_module_load_bytes")
        h, self._next = self._next, self._next + 1
        self.modules[h] = mod
        return h

    def _perf(self) -> tuple[int, int]:
        cycles = instrs = 0
        for core in range(self.query("cores")):
            c, i = C.c_uint64(), C.c_uint64()
            self._check(self.lib.vx_device_mpm_query(self.dev, 0, MCYCLE, core, C.byref(c)), "mpm_query")
            self._check(self.lib.vx_device_mpm_query(self.dev, 0, MINSTRET, core, C.byref(i)), "mpm_query")
            cycles, instrs = max(cycles, c.value), instrs + i.value
        return cycles, instrs

    def launch(self, mod: int, kernel: str, args: bytes, grid: tuple, block: tuple,
               lmem: int) -> dict:
        if mod not in self.modules:
            raise RuntimeError(f"module {mod} is not loaded (loading a module unloads the previous one)")
        k = C.c_void_p()
        self._check(self.lib.vx_module_get_kernel(self.modules[mod], kernel.encode(), C.byref(k)),
                    f"vx_module_get_kernel({kernel!r})")
        blob = C.create_string_buffer(args, max(len(args), 1))
        li = _LaunchInfo(C.sizeof(_LaunchInfo), None, k, C.cast(blob, C.c_void_p), len(args), 3,
                         (C.c_uint32 * 3)(*grid), (C.c_uint32 * 3)(*block), lmem,
                         (C.c_uint32 * 3)(1, 1, 1))
        self._check(self.lib.vx_enqueue_launch(self.q, C.byref(li), 0, None, None), "vx_enqueue_launch")
        self._finish()
        cycles, instrs = self._perf()       # SimX resets its core counters at every launch
        self.lib.vx_kernel_release(k)
        return {"instructions": instrs, "cycles": cycles}

    def close(self) -> None:
        for b in self.buffers.values():
            self.lib.vx_buffer_release(b)
        for m in self.modules.values():
            self.lib.vx_module_release(m)
        self.lib.vx_queue_release(self.q)
        self.lib.vx_device_release(self.dev)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    rt: Runtime | None = None
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:
            return
        try:
            if op == "check":
                value = missing_symbols(*args)
            elif op == "open":
                rt = Runtime(args[0])
                value = {k: rt.query(k) for k in CAPS}
            elif op == "close":
                if rt is not None:
                    rt.close()
                conn.send(("ok", None))
                return
            else:
                assert rt is not None, "device not open"
                value = getattr(rt, op)(*args)
            conn.send(("ok", value))
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            conn.send(("err", f"{type(e).__name__}: {e}"))
        sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("VORTEX_DRIVER", "simx")
    main()

"""Kernel argument arrays for cuLaunchKernel, built once per pointer set (pure ctypes: testable
without a GPU; runtime.py caches and launches them)."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

from gac_torch.backends.gpu.program import BufferRef, KernelLaunch, TensorMapArg

_SCALAR_PACK = {"i8": "b", "i16": "h", "i32": "i", "i64": "q", "f32": "f", "f64": "d"}


def pack_scalar(ctype: str, value: Any) -> bytes:
    if ctype == "f16":
        return struct.pack("<e", value)
    if ctype == "bf16":
        return struct.pack("<I", struct.unpack("<I", struct.pack("<f", value))[0])[2:]
    return struct.pack("<" + _SCALAR_PACK[ctype], value)





class ArgTable:
    """The `void **kernelParams` of every launch for one set of buffer pointers.

    One contiguous block of 8-byte slots holds every pointer and scalar argument of every
    launch (scalars are packed once, little-endian, into their slot's first bytes); each launch
    has a `void *[n]` array pointing at its slots. `argv[i]` is the address to pass to
    cuLaunchKernel for launch i. Building costs a few microseconds per launch, once per
    distinct pointer set."""

    def __init__(self, launches: Sequence[KernelLaunch], arg_ptrs: Sequence[int],
                 temp_ptrs: Sequence[int], tensor_maps: dict[tuple[int, int], int] | None = None):
        """`tensor_maps`: (launch, argument) -> device address of that TMA descriptor."""
        n_slots = sum(len(k.args) for k in launches)
        self.slots = (ctypes.c_uint64 * max(1, n_slots))()
        base = ctypes.addressof(self.slots)
        self.arrays = []
        self.argv: list[int] = []
        s = 0
        for i, k in enumerate(launches):
            arr = (ctypes.c_void_p * max(1, len(k.args)))()
            for j, a in enumerate(k.args):
                if isinstance(a, TensorMapArg):
                    self.slots[s] = (tensor_maps or {})[(i, j)]
                elif isinstance(a, BufferRef):
                    self.slots[s] = arg_ptrs[a.index] if a.kind == "arg" else temp_ptrs[a.index]
                else:
                    raw = pack_scalar(a.ctype, a.value)
                    ctypes.memmove(base + 8 * s, raw, len(raw))
                arr[j] = base + 8 * s
                s += 1
            self.arrays.append(arr)
            self.argv.append(ctypes.addressof(arr))

    def param(self, launch: int, arg: int) -> bytes:
        """The 8 bytes launch `launch`'s argument `arg` points at (for tests)."""
        addr = ctypes.cast(self.arrays[launch], ctypes.POINTER(ctypes.c_void_p))[arg]
        return ctypes.string_at(addr, 8)

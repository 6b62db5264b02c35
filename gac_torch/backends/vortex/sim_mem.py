"""Memory of the functional simulator: flat regions (global memory, program image, stacks, one
local memory per core) accessed by all active lanes of a warp at once."""

from __future__ import annotations

from typing import Any

import numpy as np
from gac_torch.errors import GacError

U32 = np.uint32


class SimError(GacError, RuntimeError):
    """The kernel did something SimX would abort, hang or fault on (or we do not model)."""


class Region:
    def __init__(self, name: str, base: int, size: int) -> None:
        size = (size + 3) & ~3
        self.name, self.base, self.end = name, base, base + size
        self.u8 = np.zeros(size, np.uint8)
        self.u16, self.u32 = self.u8.view(np.uint16), self.u8.view(np.uint32)

    def __contains__(self, addr: int) -> bool:
        return self.base <= addr < self.end


_DT = {(1, False): np.uint8, (1, True): np.int8, (2, False): np.uint16, (2, True): np.int16}


def region_load(r: Region, off: np.ndarray, size: int, signed: bool) -> np.ndarray:
    if size == 4:
        return r.u32[off >> U32(2)]
    view = r.u8 if size == 1 else r.u16
    v = view[off >> U32(size >> 1)] if size == 2 else view[off]
    return v.view(_DT[(size, True)]).astype(np.int32) if signed else v.astype(U32)


def region_store(r: Region, off: np.ndarray, val: np.ndarray, size: int) -> None:
    if size == 4:
        r.u32[off >> U32(2)] = val
    elif size == 2:
        r.u16[off >> U32(1)] = val.astype(np.uint16)
    else:
        r.u8[off] = val.astype(np.uint8)


class MemoryPort:
    """Loads/stores as a core sees them: its own local memory, then the shared regions.
    Needs `self.lmem` and `self.sim.regions`."""

    lmem: Region
    sim: Any                 # funcsim.FunctionalSimulator (has .regions)

    def region(self, addr: int) -> Region:
        if addr in self.lmem:
            return self.lmem
        for r in self.sim.regions:
            if addr in r:
                return r
        raise SimError(f"access to unmapped address {addr:#010x}")

    def load(self, a: np.ndarray, size: int, signed: bool) -> np.ndarray:
        r = self.region(int(a[0]))
        off = a - U32(r.base)
        try:
            if not (int(np.bitwise_or.reduce(off)) & (size - 1)):
                return region_load(r, off, size, signed)
        except IndexError:
            pass
        return self._lanewise(a, size, signed, None)

    def store(self, a: np.ndarray, v: np.ndarray, size: int) -> None:
        r = self.region(int(a[0]))
        off = a - U32(r.base)
        try:
            if not (int(np.bitwise_or.reduce(off)) & (size - 1)):
                region_store(r, off, v, size)
                return
        except IndexError:
            pass
        self._lanewise(a, size, False, v)

    def _lanewise(self, a: np.ndarray, size: int, signed: bool, v: np.ndarray | None):
        """Slow path: lanes in different regions, misaligned, or out of range."""
        out = np.zeros(len(a), np.int64)
        for i, addr in enumerate(a.tolist()):
            r = self.region(addr)
            if addr + size > r.end:
                raise SimError(f"access to unmapped address {addr:#010x} (+{size})")
            o = addr - r.base
            if v is None:
                out[i] = int.from_bytes(r.u8[o:o + size].tobytes(), "little", signed=signed)
            else:
                r.u8[o:o + size] = np.frombuffer((int(v[i]) & ((1 << 8 * size) - 1)).to_bytes(
                    size, "little"), np.uint8)
        return out.astype(np.int32 if signed else np.uint32) if v is None else None

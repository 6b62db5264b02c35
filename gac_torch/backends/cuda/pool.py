"""Output buffers an executable owns, so that a CUDA graph can write its outputs at stable
addresses without ever overwriting a tensor the caller still holds.

A captured graph writes each output at a fixed address. The executable keeps a few sets of
output buffers per (device, stream); each call takes a set no caller holds and hands out
fresh aliases of its buffers (`detach`: same storage, no autograd link to the buffer). A set
is free again once every alias (and every view of one) is gone: the storage's use count is
back to the pool's own reference. This is the rule torch's cudagraph trees follow (they check
that a previous replay's outputs are dead before a replay overwrites them), applied per set
instead of raising. When every set is still held, `acquire` returns None and the caller gets
plain fresh buffers; the number of sets is bounded, so memory does not grow with calls.

A set whose storage the caller moved (`resize_` on an alias reallocates the shared storage)
is never reused: its graphs would write to the old address.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_use_count = torch._C._storage_Use_Count  # strong references to a StorageImpl
_detach = torch.Tensor.detach  # an alias of the buffer: same storage, no autograd link


class OutputSet:
    """One buffer per output; `ptrs` are the addresses a graph captured over this set uses."""

    __slots__ = ("bufs", "ptrs", "_checks")

    def __init__(self, bufs: Sequence[torch.Tensor]):
        self.bufs = list(bufs)
        self.ptrs = [b.data_ptr() for b in self.bufs]
        # per buffer: its storage, the pool's own references to it, its address
        cdata = [b.untyped_storage()._cdata for b in self.bufs]
        self._checks = [(b, c, _use_count(c), p) for b, c, p in zip(self.bufs, cdata, self.ptrs)]

    def free(self) -> bool:
        for b, c, n, p in self._checks:
            if _use_count(c) != n or b.data_ptr() != p:
                return False
        return True


class OutputPool:
    """At most `max_sets` output sets of fixed shapes and dtypes on one device."""

    def __init__(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                 max_sets: int):
        self.specs = list(specs)
        self.device = device
        self.max_sets = max_sets
        self.sets: list[OutputSet] = []
        self._lock = threading.Lock()  # two threads on one stream must not take the same set

    def acquire(self) -> tuple[OutputSet, list[torch.Tensor]] | None:
        """A set no caller holds and the caller's aliases of it (which mark it taken), or None
        when all `max_sets` are held."""
        with self._lock:
            for s in self.sets:
                for b, c, n, p in s._checks:  # (OutputSet.free, inlined: it runs every call)
                    if _use_count(c) != n or b.data_ptr() != p:
                        break
                else:
                    return s, list(map(_detach, s.bufs))
            if len(self.sets) >= self.max_sets:
                return None
            s = OutputSet([torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.specs])
            self.sets.append(s)
            return s, list(map(_detach, s.bufs))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self.sets for b in s.bufs)

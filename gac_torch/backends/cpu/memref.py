"""The C layout of an MLIR memref descriptor, shared by the JIT and the native-code loaders."""

from __future__ import annotations

import ctypes

import torch

_DESC_TYPES: dict[int, type] = {}


def descriptor_type(rank: int) -> type:
    """One class per rank: ctypes caches the pointer type of every class it sees, forever."""
    if rank not in _DESC_TYPES:
        class Desc(ctypes.Structure):
            _fields_ = [("allocated", ctypes.c_void_p), ("aligned", ctypes.c_void_p),
                        ("offset", ctypes.c_longlong)] + (
                [("shape", ctypes.c_longlong * rank), ("strides", ctypes.c_longlong * rank)] if rank else [])
        _DESC_TYPES[rank] = Desc
    return _DESC_TYPES[rank]


def descriptor(t: torch.Tensor, desc_type: type) -> ctypes.Structure:
    """A descriptor pointing at `t`'s storage (sizes known only at run time travel in it)."""
    d = desc_type()
    d.allocated = d.aligned = t.data_ptr()
    d.offset = 0
    if t.dim():
        d.shape[:] = list(t.shape)
        d.strides[:] = list(t.stride())
    return d

"""A one-kernel program's launch without a table per pointer set, and fresh outputs without
torch.empty's argument parsing (GAC_LAUNCH_BLOCK, default on; issue 15's per-call host path).

runtime.py builds the kernel's argument array (`void **kernelParams`) once per (thread, stream)
lane: a `LaunchBlock`. A call writes its buffer pointers into their 8-byte slots and launches;
cuLaunchKernel copies the parameter values when it is called, so the next call may rewrite the
same slots. A one-kernel program is never captured into a CUDA graph (runtime.GRAPH_MIN_LAUNCHES),
so nothing else reads the block later. Per call this replaces the table lookup by pointer set
(a tuple of every pointer hashed, an LRU move, a hit count, the graph checks) with one slot
write per buffer argument, and a new pointer set (a fresh output at a new address: outputs over
runtime.POOL_BYTES, such as grid_sample_msda's 82 MB) costs nothing more than a seen one.

Programs with TMA arguments keep the tables (their descriptors hold buffer addresses and are
uploaded per pointer set: branch host2 caches them in device memory; not ported, as it changes
how descriptors reach the kernels and was never measured on a GPU).

`prototypes`: per output one element expanded to its shape; `empty_like(p,
memory_format=torch.contiguous_format)` is then a fresh dense output (what torch.empty(shape,
dtype=, device=) makes, with less argument parsing: no shape list, dtype or device to convert).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from gac_torch.backends.cuda.launch_args import ArgTable
from gac_torch.backends.gpu.program import BufferRef, GpuProgram, KernelLaunch, TensorMapArg


def takes_block(program: GpuProgram) -> bool:
    """A program launched through a LaunchBlock: static sizes, one launch, no TMA argument."""
    return (not program.dynamic and len(program.launches) == 1
            and not any(isinstance(a, TensorMapArg) for a in program.launches[0].args))


class LaunchBlock:
    """The argument array of a program's one launch on one lane, rewritten per call.

    `args` are cuLaunchKernel's arguments: function, grid, block, shared memory, stream, the
    array, no extra. Scalars and workspace pointers are written once; per call `fill` writes the
    buffer arguments' pointers."""

    def __init__(self, launch: KernelLaunch, head: tuple, stream: Any, temp_ptrs: Sequence[int]):
        assert not any(isinstance(a, TensorMapArg) for a in launch.args)
        n_args = 1 + max((a.index for a in launch.args if isinstance(a, BufferRef) and a.kind == "arg"), default=0)
        self.table = ArgTable([launch], [0] * n_args, temp_ptrs)  # buffer slots: 0 until a call
        self.slots = self.table.slots
        self.ptrs = [(j, a.index) for j, a in enumerate(launch.args) if isinstance(a, BufferRef) and a.kind == "arg"]
        self.args = (*head, stream, self.table.argv[0], 0)

    def fill(self, ptrs: Sequence[int]) -> None:
        slots = self.slots
        for j, i in self.ptrs:
            slots[j] = ptrs[i]

    def param(self, arg: int) -> bytes:
        """The 8 bytes argument `arg` points at (tests)."""
        return ctypes.string_at(ctypes.addressof(self.slots) + 8 * arg, 8)


def block_for(program: GpuProgram, head: tuple, stream: Any, ws_ptr: int) -> LaunchBlock:
    """The LaunchBlock of a one-launch program on a lane (stream, workspace at `ws_ptr`);
    `head`: cuLaunchKernel's function, grid, block and shared memory."""
    (launch,) = program.launches
    return LaunchBlock(launch, head, stream, [ws_ptr + program.plan.offsets[t.name] for t in program.temps])


def prototypes(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Per output (shape, dtype): one element on `device` expanded to the shape (a scalar: a
    0-d tensor), so that empty_like(it, memory_format=torch.contiguous_format) is a fresh dense
    output."""
    return [torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(shape) for shape, dtype in specs]

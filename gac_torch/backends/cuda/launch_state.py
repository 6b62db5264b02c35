"""What a CudaExecutable keeps between calls (runtime.py): per CUDA context its loaded kernels,
workspaces, output pools and argument tables; per pointer set its table, graph and prebuilt
launches; per thread and stream the lane a call takes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from gac_torch.backends.cuda.launch_args import ArgTable
from gac_torch.backends.cuda.pool import OutputPool
from gac_torch.backends.gpu.program import GpuProgram


@dataclass
class _Entry:
    table: ArgTable
    hits: int = 0
    graph: Any = None  # (CUgraph, CUgraphExec) once captured
    tensor_maps: torch.Tensor | None = None  # the table's TMA descriptors (device memory)
    # (stream handle, cuLaunchKernel's arguments per launch on that stream): built on the first
    # direct launch there, so a later one only passes them on (one attribute: a thread on
    # another stream replaces it whole, never half)
    direct: tuple[int, list[tuple]] | None = None


@dataclass
class _Context:
    """What one CUDA context (device) needs: the loaded functions, per-stream workspaces and
    the argument tables by (sizes, pointer set)."""

    by_name: dict[str, Any]  # kernel name -> CUfunction
    modules: list[Any]  # the CUmodules they live in
    workspaces: dict[int, torch.Tensor] = field(default_factory=dict)  # stream handle -> buffer
    pools: dict[int, OutputPool] = field(default_factory=dict)  # stream handle -> outputs
    tables: OrderedDict = field(default_factory=OrderedDict)  # (sizes, pointers) -> _Entry
    streams: dict[int, Any] = field(default_factory=dict)  # stream handle -> CUstream


@dataclass
class _Bound:
    """The program for one call's sizes (the program itself when it has no run-time sizes)."""

    key: tuple | None  # the sizes it was bound for
    program: GpuProgram
    launches: list[tuple]  # (grid, block, shared memory) per launch
    funcs: dict[int, list[Any]] = field(default_factory=dict)  # context -> CUfunction per launch

    @classmethod
    def of(cls, key: tuple | None, program: GpuProgram) -> _Bound:
        return cls(key, program, [(k.grid, k.block, k.shared_mem) for k in program.launches])


@dataclass
class _Lane:
    """A thread's calls on one (device, stream): what each of them would otherwise look up."""

    device: torch.device
    state: _Context
    handle: int  # the stream's raw handle
    stream: Any  # CUstream
    pool: OutputPool | None  # pooled outputs (static shapes, graphs on), else fresh ones
    ws_ptr: int  # the static plan's workspace on this stream (0: none)
    # per output: 1 element expanded (fresh outputs: empty_like), made at the lane's first fresh one
    protos: list[torch.Tensor] | None = None
    block: Any = None  # a one-kernel program's LaunchBlock (launch_block.py), built with the lane

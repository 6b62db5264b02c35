"""The compiled CUDA artifact: PTX text plus a host program that is pure data.

The host side of a compiled graph is a straight line of kernel launches over a fixed set of
buffers, so instead of compiling host code we record it: which kernels to launch in order, with
which grid/block, and which buffers or scalars each argument is. The runtime (runtime.py) replays
it with the CUDA driver API. This module imports neither MLIR nor CUDA, so an artifact can be
built on a machine without a GPU and loaded on one without MLIR.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from gac_torch.passes.memory_plan import MemoryPlan


@dataclass(frozen=True)
class BufferRef:
    """A kernel argument that is a device pointer.

    kind "arg": index into the function's buffers (inputs then outputs, as in the signature);
    kind "temp": index into CudaProgram.temps (an intermediate placed in the workspace).
    The kernel receives the buffer's base pointer (bare-pointer calling convention): a view's
    static offset and strides are compiled into the kernel.
    """

    kind: Literal["arg", "temp"]
    index: int


@dataclass(frozen=True)
class ScalarArg:
    ctype: Literal["i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64"]
    value: Union[int, float]


KernelArg = Union[BufferRef, ScalarArg]


@dataclass(frozen=True)
class KernelLaunch:
    kernel: str  # entry name in the PTX
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic shared memory bytes (static shared memory is declared in the PTX)
    args: tuple[KernelArg, ...]
    strategy: str = ""  # how the op was mapped (for dumps and tests)


@dataclass(frozen=True)
class TempBuffer:
    name: str
    nbytes: int


@dataclass(frozen=True)
class ArgSpec:
    """One buffer of the function signature as compiled (checked against tensors at run time)."""

    shape: tuple[int, ...]
    elem: str  # MLIR element type: f32, f16, bf16, f64, i1, i8, i32, i64

    @property
    def itemsize(self) -> int:
        return {"i1": 1, "i8": 1, "f16": 2, "bf16": 2, "i16": 2, "f32": 4, "i32": 4}.get(self.elem, 8)


@dataclass
class CudaProgram:
    arch: str  # e.g. "sm_90"
    ptx: str
    launches: list[KernelLaunch]
    temps: list[TempBuffer]
    plan: MemoryPlan  # temp name -> workspace offset
    args: list[ArgSpec] = field(default_factory=list)  # inputs then outputs

    @property
    def text(self) -> str:  # the "ptx" stage dump: host program as PTX comments, then the PTX
        return "\n".join("// " + line for line in self.describe().splitlines()) + "\n" + self.ptx

    def __str__(self) -> str:
        return self.text

    def describe(self) -> str:
        """Human-readable host program (for dumps and debugging)."""

        def arg(a: KernelArg) -> str:
            if isinstance(a, BufferRef):
                return f"{a.kind}{a.index}"
            return f"{a.ctype}({a.value})"

        lines = [f"arch {self.arch}; workspace {self.plan.workspace_size} B "
                 f"(unplanned {self.plan.unplanned_size} B)"]
        for i, t in enumerate(self.temps):
            lines.append(f"temp{i} {t.name}: {t.nbytes} B at +{self.plan.offsets[t.name]}")
        for i, a in enumerate(self.args):
            lines.append(f"arg{i}: {a.elem}{list(a.shape)}")
        for k in self.launches:
            lines.append(f"launch {k.kernel} grid={k.grid} block={k.block} smem={k.shared_mem} "
                         f"[{k.strategy}] ({', '.join(arg(a) for a in k.args)})")
        return "\n".join(lines)

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
    value: int | float


KernelArg = Union[BufferRef, ScalarArg]


@dataclass(frozen=True)
class KernelLaunch:
    kernel: str  # entry name in the PTX
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic shared memory bytes (static shared memory is declared in the PTX)
    args: tuple[KernelArg, ...]
    strategy: str = ""  # how the op was mapped (for dumps and tests)
    # Per argument, how the kernel touches the buffer (from its body): "" (scalar or unused),
    # "r" reads, "w" writes some elements, "W" writes every element of the whole buffer, or a
    # read letter followed by a write letter ("rw", "rW"). Empty tuple: unknown.
    access: tuple[str, ...] = ()


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
            acc = k.access or ("",) * len(k.args)
            lines.append(f"launch {k.kernel} grid={k.grid} block={k.block} smem={k.shared_mem} "
                         f"[{k.strategy}] ({', '.join(arg(a) + (':' + m if m else '') for a, m in zip(k.args, acc))})")
        return "\n".join(lines)

    def dataflow_errors(self, n_inputs: int) -> list[str]:
        """Check the launch list's buffer dataflow (needs `access`); returns what is wrong.

        Invariants of a correct straight-line program over the function's buffers and temps:
        - inputs (the first `n_inputs` args) are never written;
        - every output is written, and nothing reads a buffer before anything wrote it;
        - no write is lost: a kernel that overwrites a whole buffer ("W" without "r") may only
          do so once every earlier write into that buffer has been read, unless the buffer is a
          temp no one reads (a value computed and then discarded is a bug in the copy/aliasing
          logic, e.g. an output's final value clobbered by another output's copy);
        - a temp's last write is read (values are computed for a reason);
        - temps sharing workspace bytes are never live in the same step.
        """
        errs: list[str] = []
        unread: dict[tuple[str, int], int] = {}  # buffer -> earliest unread write (launch index)
        written: set[tuple[str, int]] = set()
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        n_args = len(self.args)

        def side_output(step: int) -> bool:
            # A kernel writing several buffers (a multi-result op, e.g. max + argmax) may leave
            # one of them unused; only a kernel whose single result is lost is an error.
            k = self.launches[step]
            return sum("w" in m.lower() for a, m in zip(k.args, k.access)
                       if isinstance(a, BufferRef)) > 1

        for step, k in enumerate(self.launches):
            if len(k.access) != len(k.args):
                errs.append(f"launch {step} {k.kernel}: no access information")
                continue
            bufs = [(a, m) for a, m in zip(k.args, k.access) if isinstance(a, BufferRef)]
            for a, m in bufs:  # reads happen before this kernel's writes
                key = (a.kind, a.index)
                if a.kind == "temp":
                    first.setdefault(a.index, step)
                    last[a.index] = step
                if "r" in m:
                    # (a kernel that also writes the buffer may initialize it itself: absorbed fill)
                    if key not in written and "w" not in m.lower() and not (
                            a.kind == "arg" and a.index < n_inputs):
                        errs.append(f"launch {step} {k.kernel} reads {a.kind}{a.index} before any write")
                    unread.pop(key, None)
            for a, m in bufs:
                key = (a.kind, a.index)
                if "w" not in m.lower():
                    continue
                if a.kind == "arg" and a.index < n_inputs:
                    errs.append(f"launch {step} {k.kernel} writes input arg{a.index}")
                if "W" in m and "r" not in m:
                    if key in unread and not side_output(unread[key]):
                        errs.append(f"launch {step} {k.kernel} overwrites {a.kind}{a.index} whose "
                                    f"value from launch {unread[key]} was never read")
                    unread[key] = step
                else:
                    unread.setdefault(key, step)
                written.add(key)
        for i in range(n_inputs, n_args):
            if ("arg", i) not in written:
                errs.append(f"output arg{i} is never written")
        for (kind, i), step in unread.items():
            if kind == "temp" and not side_output(step):
                errs.append(f"temp{i} written by launch {step} is never read")
        names = [t.name for t in self.temps]
        for i, fi in first.items():
            for j, fj in first.items():
                if i < j and fi <= last[j] and fj <= last[i]:
                    oi, oj = self.plan.offsets[names[i]], self.plan.offsets[names[j]]
                    if oi < oj + self.temps[j].nbytes and oj < oi + self.temps[i].nbytes:
                        errs.append(f"temps {i} and {j} share workspace bytes while both live")
        return errs

"""The compiled GPU artifact: device code (PTX for cuda) plus a host program that is pure data.

The host side of a compiled graph is a straight line of kernel launches over a fixed set of
buffers, so instead of compiling host code we record it: which kernels to launch in order, with
which grid/block, and which buffers or scalars each argument is. A target's runtime replays
it (cuda: with the CUDA driver API). This module imports neither MLIR nor CUDA, so an artifact can be
built on a machine without a GPU and loaded on one without MLIR.

With sizes known only at run time, grids, kernel scalars and temp sizes are `Dyn` references
into a short list of host operations (the index math the mapping left on the host); `bind`
evaluates them for one call's shapes into a static program (same PTX, its own memory plan).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Union

from gac_torch.passes.memory_plan import BufferUse, MemoryPlan, plan_memory


@dataclass(frozen=True)
class Dyn:
    """A number known only per call (a size, a grid extent, a byte count): the value of entry
    `ref` of the program's `host_ops`."""

    ref: int

    def __str__(self) -> str:
        return f"%{self.ref}"


@dataclass(frozen=True)
class HostOp:
    """One step of the host's index arithmetic over run-time sizes, evaluated per call.

    op "const": args = (value,); "size": the function's index argument args[0]; "dim": size
    args[1] of buffer argument args[0]; any other op (the arith dialect's index ops: add, sub,
    mul, divui, ceildivui, remui, maxsi, select, cmpi, ...) applies to the values of the earlier
    entries args (`pred`: cmpi's predicate)."""

    op: str
    args: tuple[int, ...]
    pred: str = ""
    type: str = "index"  # the result's MLIR type: index, iN, f16, bf16, f32, f64


_MASK = (1 << 64) - 1  # index is 64-bit: unsigned ops see the two's complement bits


def _round(x, ty: str):
    """x as the device holds a value of type `ty` (each float op rounds, as the kernels would)."""
    if ty == "f32":
        return struct.unpack("<f", struct.pack("<f", x))[0]
    if ty == "f16":
        return struct.unpack("<e", struct.pack("<e", x))[0]
    if ty == "bf16":  # round to nearest even on the top 16 bits of the f32
        bits = struct.unpack("<I", struct.pack("<f", x))[0]
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]
    if ty == "f64":
        return float(x)
    width = 64 if ty == "index" else int(ty[1:])
    x = int(x) & ((1 << width) - 1)
    return x - (1 << width) if width > 1 and x >> (width - 1) else x


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_ARITH = {
    "addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
    "divui": lambda a, b: (a & _MASK) // (b & _MASK), "remui": lambda a, b: (a & _MASK) % (b & _MASK),
    "ceildivui": lambda a, b: -(-(a & _MASK) // (b & _MASK)),
    "divsi": _trunc_div, "remsi": lambda a, b: a - b * _trunc_div(a, b),
    "ceildivsi": lambda a, b: -((-a) // b), "floordivsi": lambda a, b: a // b,
    "maxsi": max, "minsi": min, "maxui": lambda a, b: max(a & _MASK, b & _MASK),
    "minui": lambda a, b: min(a & _MASK, b & _MASK),
    "andi": lambda a, b: a & b, "ori": lambda a, b: a | b, "xori": lambda a, b: a ^ b,
    "index_cast": lambda a: a, "index_castui": lambda a: a, "extsi": lambda a: a,
    "extui": lambda a: a & _MASK, "trunci": lambda a: a,
    "select": lambda c, a, b: a if c else b,
    "sitofp": float, "uitofp": lambda a: float(a & _MASK), "extf": float, "truncf": float,
    "fptosi": lambda a: int(a), "fptoui": lambda a: int(a),
    "addf": lambda a, b: a + b, "subf": lambda a, b: a - b, "mulf": lambda a, b: a * b,
    "divf": lambda a, b: a / b if b else math.copysign(math.inf, a) * math.copysign(1, b) if a else math.nan,
    "negf": lambda a: -a, "maximumf": max, "minimumf": min, "maxnumf": max, "minnumf": min,
}
HOST_OPS = {"const", "size", "dim", "cmpi", *_ARITH}  # what evaluate_host_ops computes
_CMP = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "slt": lambda a, b: a < b,
    "sle": lambda a, b: a <= b, "sgt": lambda a, b: a > b, "sge": lambda a, b: a >= b,
    "ult": lambda a, b: a & _MASK < b & _MASK, "ule": lambda a, b: a & _MASK <= b & _MASK,
    "ugt": lambda a, b: a & _MASK > b & _MASK, "uge": lambda a, b: a & _MASK >= b & _MASK,
}


def evaluate_host_ops(ops: Sequence[HostOp], values: Sequence) -> list[int]:
    """The value of every entry, given per function argument its shape (a buffer) or an int
    (an index argument)."""
    out: list[int] = []
    for h in ops:
        if h.op == "const":
            out.append(h.args[0])
        elif h.op == "size":
            out.append(int(values[h.args[0]]))
        elif h.op == "dim":
            out.append(int(values[h.args[0]][h.args[1]]))
        elif h.op == "cmpi":
            out.append(int(_CMP[h.pred](*(out[a] for a in h.args))))
        else:
            out.append(_round(_ARITH[h.op](*(out[a] for a in h.args)), h.type))
    return out


@dataclass(frozen=True)
class BufferRef:
    """A kernel argument that is a device pointer.

    kind "arg": index into the function's buffers (inputs then outputs, as in the signature);
    kind "temp": index into GpuProgram.temps (an intermediate placed in the workspace).
    The kernel receives the buffer's base pointer (bare-pointer calling convention): a view's
    static offset and strides are compiled into the kernel.
    """

    kind: Literal["arg", "temp"]
    index: int


@dataclass(frozen=True)
class ScalarArg:
    ctype: Literal["i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64"]
    value: int | float | Dyn


@dataclass(frozen=True)
class TensorMapArg:
    """A kernel argument that is the device address of a TMA descriptor (CUtensorMap, 128
    bytes) of `buffer` viewed as `dims` (innermost first, elements) with byte `strides` (of
    dims[1:]), starting `offset` elements into it, read in boxes of `box` elements with a
    `swizzle`-byte swizzle (0, 32, 64, 128); out-of-range elements read as zero. The runtime
    encodes it once per buffer address (the kernel reads the buffer through it, access "r", or
    writes it by bulk tensor stores, "w": host._uses_of_tensor_map)."""

    buffer: BufferRef
    elem: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    box: tuple[int, ...]
    swizzle: int


KernelArg = Union[BufferRef, ScalarArg, TensorMapArg]


def arg_buffer(a: KernelArg) -> BufferRef | None:
    """The buffer a kernel argument gives access to (a tensor map's too), or None."""
    return a if isinstance(a, BufferRef) else a.buffer if isinstance(a, TensorMapArg) else None


@dataclass(frozen=True)
class KernelLaunch:
    kernel: str  # entry name in the PTX
    grid: tuple[int | Dyn, int | Dyn, int | Dyn]
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
    nbytes: int | Dyn


@dataclass(frozen=True)
class ArgSpec:
    """One argument of the function signature as compiled (checked against tensors at run
    time): a buffer, or a size (elem "index", shape ())."""

    shape: tuple[int, ...]  # -1: a size known at run time
    elem: str  # MLIR element type: f32, f16, bf16, f64, i1, i8, i32, i64; "index" for a size

    @property
    def itemsize(self) -> int:
        return {"i1": 1, "i8": 1, "f16": 2, "bf16": 2, "i16": 2, "f32": 4, "i32": 4}.get(self.elem, 8)

    def matches(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(s in (-1, n) for s, n in zip(self.shape, shape))


@dataclass(frozen=True)
class Cubin:
    """SASS for kernels of the program, assembled ahead of time (cuda: ptxas); the PTX stays
    the fallback (another GPU, a driver that refuses the cubin)."""

    arch: str  # what it was assembled for ("sm_90a"): it loads on that compute capability only
    data: bytes
    kernels: tuple[str, ...]  # the launches' kernel names it serves
    entry: str | None = None  # the function's name inside it (None: each kernel's own name)


@dataclass
class GpuProgram:
    arch: str  # e.g. "sm_90"
    ptx: str
    launches: list[KernelLaunch]
    temps: list[TempBuffer]
    plan: MemoryPlan  # temp name -> workspace offset (dynamic: planned by `bind`)
    args: list[ArgSpec] = field(default_factory=list)  # inputs then outputs
    # Run-time sizes: grids, scalar arguments and temp sizes may be `Dyn`s over `host_ops`;
    # `bind` evaluates them for one call's shapes into a static program (same PTX).
    dynamic: bool = False
    host_ops: list[HostOp] = field(default_factory=list)
    temp_live: list[tuple[int, int]] = field(default_factory=list)  # per temp: first, last launch
    cubins: list[Cubin] = field(default_factory=list)  # empty: the driver JIT-compiles the PTX
    # (input arg, output arg) pairs the output may share the input's buffer (gpu/in_place.py)
    in_place: tuple[tuple[int, int], ...] = ()

    def bind(self, values: Sequence) -> GpuProgram:
        """This program for one call: `values` holds per function argument its shape (a
        buffer) or its int (a size). Launches with an empty grid are dropped."""
        v = evaluate_host_ops(self.host_ops, values)

        def num(x):
            return v[x.ref] if isinstance(x, Dyn) else x

        launches = []
        for k in self.launches:
            grid = tuple(num(g) for g in k.grid)
            if 0 in grid:
                continue  # nothing to compute at these sizes
            args = tuple(replace(a, value=num(a.value)) if isinstance(a, ScalarArg) else a for a in k.args)
            launches.append(replace(k, grid=grid, args=args))
        temps = [TempBuffer(t.name, num(t.nbytes)) for t in self.temps]
        plan = plan_memory([BufferUse(t.name, t.nbytes, first, last)
                            for t, (first, last) in zip(temps, self.temp_live)])
        args = [ArgSpec(tuple(x) if a.elem != "index" else (), a.elem) for a, x in zip(self.args, values)]
        return GpuProgram(self.arch, self.ptx, launches, temps, plan, args, in_place=self.in_place)

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
            if isinstance(a, TensorMapArg):
                return f"tma({a.buffer.kind}{a.buffer.index} box={'x'.join(map(str, a.box))})"
            return f"{a.ctype}({a.value})"

        if self.dynamic:
            lines = [f"arch {self.arch}; sizes known at run time; workspace planned per call"]
            lines += [f"%{i} = {h.op}{' ' + h.pred if h.pred else ''} {', '.join(map(str, h.args))}"
                      for i, h in enumerate(self.host_ops)]
        else:
            lines = [f"arch {self.arch}; workspace {self.plan.workspace_size} B "
                     f"(unplanned {self.plan.unplanned_size} B)"]
        for i, t in enumerate(self.temps):
            at = f" at +{self.plan.offsets[t.name]}" if t.name in self.plan.offsets else ""
            lines.append(f"temp{i} {t.name}: {t.nbytes} B{at}")
        for i, a in enumerate(self.args):
            lines.append(f"arg{i}: {a.elem}{['?' if n == -1 else n for n in a.shape]}")
        for k in self.launches:
            acc = k.access or ("",) * len(k.args)
            lines.append(f"launch {k.kernel} grid=({', '.join(map(str, k.grid))}) block={k.block} smem={k.shared_mem} "
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
            if k.strategy == "combo":  # members writing one buffer each (backends/gpu/combine.py)
                return False
            return sum("w" in m.lower() for a, m in zip(k.args, k.access)
                       if arg_buffer(a) is not None) > 1

        for step, k in enumerate(self.launches):
            if len(k.access) != len(k.args):
                errs.append(f"launch {step} {k.kernel}: no access information")
                continue
            merged: dict[tuple[str, int], tuple[BufferRef, str]] = {}
            for a, m in zip(k.args, k.access):  # one buffer may come in through several views
                a = arg_buffer(a)  # type: ignore[assignment]
                if a is not None:
                    prev = merged.get((a.kind, a.index))
                    merged[(a.kind, a.index)] = (a, (prev[1] if prev else "") + m)
            bufs = list(merged.values())
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
                if i < j and fi <= last[j] and fj <= last[i] and not self.dynamic:
                    oi, oj = self.plan.offsets[names[i]], self.plan.offsets[names[j]]
                    if oi < oj + self.temps[j].nbytes and oj < oi + self.temps[i].nbytes:
                        errs.append(f"temps {i} and {j} share workspace bytes while both live")
        return errs


# -- plain data (the on-disk cache and saved artifacts: runtime/cache.py) --------------------------
PLAIN_TYPES = (GpuProgram, KernelLaunch, BufferRef, ScalarArg, TensorMapArg, Dyn, TempBuffer, ArgSpec, HostOp,
               MemoryPlan, Cubin)


def to_json(program: GpuProgram) -> dict:
    """The whole program as JSON-able data (PTX included); `from_json` rebuilds it."""
    from gac_torch.runtime.plain import encode

    return encode(program)


def from_json(data: dict) -> GpuProgram:
    from gac_torch.runtime.plain import decode

    program = decode(data, PLAIN_TYPES)
    if not isinstance(program, GpuProgram):
        raise ValueError(f"not a GpuProgram: {type(program).__name__}")
    return program

"""Functional simulator of the rv32imf + Zicond + Vortex subset we emit, running .vxbin bytes.

Warps execute one instruction for all their active threads at a time (numpy rows), with SimX's
SIMT semantics (see sim_core). It is not cycle-accurate; `cycles` is None. Besides results it
reports counters, among them `divergent_branches`: conditional branches on which the active
threads disagreed. SimX then follows the last active thread (as we do), so a non-zero count
means a missing SPLIT/JOIN or a select lowered to a branch; `strict=True` makes it an error.

    sim = FunctionalSimulator()                      # 1 core x 4 warps x 4 threads
    prog = sim.load(vxbin_bytes)
    a = sim.alloc(4096); sim.write(a, data)
    counters = sim.launch("vecadd", args_blob, grid=(16,), block=(16,))
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from .sim_core import Core, Cta, Region, SimError
from .sim_isa import IllegalInstruction, decode
from .target import DEFAULT_CONFIG, STACK_BASE_ADDR, STACK_LOG2_SIZE, VortexConfig
from .vxbin import VxBin, read_vxbin

__all__ = ["FunctionalSimulator", "SimError", "HEAP_BASE", "disassemble"]

HEAP_BASE = 0x1000_0000          # where alloc() hands out device buffers (our choice)


def _dims(d: Sequence[int] | int) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(d) <= 3 or any(int(v) < 1 for v in d):
        raise ValueError(f"bad launch dimensions {d}")
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))  # type: ignore[return-value]


class _Kmu:
    """CTAs in KMU order (x fastest), handed to cores as they have room."""

    def __init__(self, ctas: list[Cta]) -> None:
        self._q = collections.deque(ctas)

    def peek(self) -> Cta | None:
        return self._q[0] if self._q else None

    def take(self) -> Cta:
        return self._q.popleft()

    def __bool__(self) -> bool:
        return bool(self._q)


class FunctionalSimulator:
    def __init__(self, config: VortexConfig = DEFAULT_CONFIG, mem_size: int = 256 << 20,
                 quantum: int = 20000, max_instructions: int = 200_000_000) -> None:
        self.config = config
        self.quantum, self.max_instructions = quantum, max_instructions
        self.heap = Region("global memory", HEAP_BASE, mem_size)
        nharts = config.cores * config.warps * config.threads
        stack_size = nharts << STACK_LOG2_SIZE
        self.stack = Region("stacks", STACK_BASE_ADDR - stack_size, stack_size)
        self.image: Region | None = None
        self.regions: list[Region] = [self.heap, self.stack]
        self.cores = [Core(self, c) for c in range(config.cores)]
        self.counters: collections.Counter = collections.Counter()
        self._brk = HEAP_BASE
        self._icache: dict[int, object] = {}
        self._text: dict[int, str] = {}
        self.program: VxBin | None = None
        self.startup_pc = 0
        self.strict = False

    # -- host side -------------------------------------------------------------------------
    def load(self, vxbin: bytes) -> VxBin:
        """Install a .vxbin image (replacing the previous one, like reloading the module)."""
        prog = read_vxbin(vxbin)
        img = Region("program image", prog.min_vma, prog.max_vma - prog.min_vma)
        img.u8[:len(prog.image)] = np.frombuffer(prog.image, np.uint8)
        self.regions = [r for r in self.regions if r is not self.image] + [img]
        self.image, self.program, self.startup_pc = img, prog, prog.min_vma
        self._icache.clear()
        self._text.clear()
        return prog

    def alloc(self, size: int, align: int = 64) -> int:
        addr = (self._brk + align - 1) // align * align
        if addr + size > self.heap.end:
            raise MemoryError(f"functional device memory exhausted ({self.heap.end - HEAP_BASE} bytes)")
        self._brk = addr + max(size, 1)
        return addr

    def _span(self, addr: int, size: int) -> tuple[Region, int]:
        r = self.cores[0].region(addr)
        if addr + size > r.end:
            raise SimError(f"host access [{addr:#x}, +{size}) crosses the end of {r.name}")
        return r, addr - r.base

    def write(self, addr: int, data: bytes | np.ndarray) -> None:
        raw = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        r, off = self._span(addr, len(raw))
        r.u8[off:off + len(raw)] = raw

    def read(self, addr: int, size: int) -> bytes:
        r, off = self._span(addr, size)
        return r.u8[off:off + size].tobytes()

    # -- launch ---------------------------------------------------------------------------
    def launch(self, kernel: str, args: bytes, grid: Sequence[int] | int, block: Sequence[int] | int,
               lmem_size: int = 0, *, strict: bool = False) -> dict[str, int | None]:
        if self.program is None:
            raise SimError("no program loaded")
        if kernel not in self.program.kernels:
            raise SimError(f"kernel {kernel!r} not in the module (has {sorted(self.program.kernels)})")
        g, b = _dims(grid), _dims(block)
        t = self.config.threads
        block_size = b[0] * b[1] * b[2]
        # the runtime's per-warp thread-index step (sw/runtime/common/queue.cpp)
        step = (t % b[0], (t // b[0]) % b[1], (t // (b[0] * b[1])) % b[2])
        argp = self.alloc(max(len(args), 8), 64)
        self.write(argp, args)
        entry = self.program.kernels[kernel]
        ctas = [Cta(entry, argp, (x, y, z), b, g, step, block_size, lmem_size)
                for z in range(g[2]) for y in range(g[1]) for x in range(g[0])]
        kmu = _Kmu(ctas)
        self.counters = collections.Counter()
        self.strict = strict
        for c in self.cores:
            c.reset()
        try:
            with np.errstate(all="ignore"):
                self._schedule(kmu)
        finally:
            self._brk = argp          # the args slot is reused by the next launch
        out: dict[str, int | None] = dict(self.counters)
        out.setdefault("divergent_branches", 0)
        out["cycles"] = None
        return out

    def _schedule(self, kmu: _Kmu) -> None:
        while True:
            # dispatch round-robin, one warp per core per step, as SimX does per cycle: which
            # warp slots a CTA gets decides whether it runs the start-up prologue (fresh slot)
            while sum(core.step(kmu) for core in self.cores):
                pass
            ran = False
            for core in self.cores:
                for w in core.warps:
                    if w.active and not w.waiting:
                        self._run(w)
                        ran = True
            if ran:
                if self.counters["instructions"] > self.max_instructions:
                    raise SimError(f"more than {self.max_instructions} instructions: does the kernel hang?")
                continue
            waiting = [(c.cid, w.wid, w.pc) for c in self.cores for w in c.warps if w.waiting]
            if waiting:
                raise SimError(f"deadlock: warps (core, warp, pc) {waiting} wait at barriers that "
                               "cannot complete (barrier inside divergent code, or wrong count?)")
            if kmu or any(c.cta is not None for c in self.cores):
                raise SimError("CTAs left that no core can take")
            return

    def _run(self, w) -> None:
        cache, pc, n, nthr = self._icache, w.pc, 0, 0
        budget = self.quantum
        w.yielding = False
        try:
            while n < budget:
                op = cache.get(pc)
                if op is None:
                    op = self._decode(pc)
                nthr += w.nactive
                pc = op(w)
                n += 1
                if w.yielding:
                    break
        except (SimError, IllegalInstruction, IndexError) as e:
            raise SimError(f"{e}\n  at pc={pc:#x} `{self._text.get(pc, '?')}` core {w.core.cid} "
                           f"warp {w.wid} tmask={w.tmask:#x}") from e
        w.pc = pc
        self.counters["instructions"] += n
        self.counters["thread_instructions"] += nthr

    def _decode(self, pc: int):
        img = self.image
        if img is None or pc not in img or pc & 3:
            raise SimError(f"instruction fetch from {pc:#x}, outside the program image")
        word = int(img.u32[(pc - img.base) >> 2])
        op, text = decode(word, pc)
        self._icache[pc], self._text[pc] = op, text
        return op

    def note_divergent_branch(self, w, pc: int) -> None:
        self.counters["divergent_branches"] += 1
        if self.strict:
            raise SimError(f"divergent branch at {pc:#x} (threads disagree, no SPLIT): SimX would "
                           f"follow thread {w.last} only")


def disassemble(vxbin: bytes) -> str:
    """A listing of the program image (there is no RISC-V objdump in our toolchain)."""
    prog = read_vxbin(vxbin)
    names = {pc: n for n, pc in prog.kernels.items()}
    lines = []
    for off in range(0, len(prog.image) - 3, 4):
        pc = prog.min_vma + off
        word = int.from_bytes(prog.image[off:off + 4], "little")
        if pc in names:
            lines.append(f"<__vx_kentry_{names[pc]}>:")
        try:
            text = decode(word, pc)[1]
        except IllegalInstruction:
            text = f".word {word:#010x}"
        lines.append(f"  {pc:08x}: {word:08x}  {text}")
    return "\n".join(lines)

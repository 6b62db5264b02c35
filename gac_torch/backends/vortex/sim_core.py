"""Machine state of the functional simulator: warps, cores, barriers and the
KMU/CTA dispatcher, with SimX's warp semantics (sim/simx/{wctl_unit,cta_dispatcher,
barrier_unit,scheduler}.cpp): thread masks, the IPDOM stack of SPLIT/JOIN, PRED, BAR per CTA,
warp slots reused by later CTAs (PC rewound 20 bytes into the dispatch window, registers kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .sim_isa import U32, write_x
from .sim_mem import MemoryPort, Region, SimError
from .target import CSR, KMU_REWIND_BYTES, LMEM_BASE_ADDR, MEM_BLOCK_SIZE

__all__ = ["Core", "Cta", "Warp", "Barrier", "Region", "SimError"]

if TYPE_CHECKING:
    from .funcsim import FunctionalSimulator


@dataclass
class Barrier:
    count: int = 0
    phase: int = 0
    waiters: list = field(default_factory=list)


@dataclass
class Cta:
    entry: int
    mscratch: int
    block_idx: tuple[int, int, int]
    block_dim: tuple[int, int, int]
    grid_dim: tuple[int, int, int]
    warp_step: tuple[int, int, int]
    block_size: int
    lmem_size: int


class Warp:
    def __init__(self, core: "Core", wid: int) -> None:
        t = core.threads
        self.core, self.wid = core, wid
        self.x = np.zeros((32, t), U32)
        self.xs = self.x.view(np.int32)
        self.f = np.zeros((32, t), U32)
        self.ff = self.f.view(np.float32)
        self.pc = 0
        self.active = self.waiting = self.yielding = False
        self.ipdom: list[list] = []          # [original mask, else PC, fallthrough]
        self.frm = self.fflags = 0
        self.mscratch = 0
        self.csr_scalar: dict[int, int] = {}
        self.csr_lane: dict[int, np.ndarray] = {}
        self.apply_mask(0)

    # -- thread mask ------------------------------------------------------------------------
    def apply_mask(self, mask: int) -> None:
        core = self.core
        self.tmask = mask
        self.lanes = core.lanes_of(mask)
        self.nactive = len(self.lanes)
        self.full = mask == core.full_mask
        self.last = int(self.lanes[-1]) if self.nactive else 0

    def set_tmask(self, mask: int) -> None:
        mask &= self.core.full_mask
        self.apply_mask(mask)
        if not mask:
            self.retire()

    def retire(self) -> None:
        self.active, self.yielding = False, True
        self.core.warp_done(self)

    def _mask_of(self, row: np.ndarray, negate: bool) -> int:
        cond = ((row & U32(1)) != 0) ^ negate
        return int(np.dot(cond, self.core.lane_weights)) & self.tmask

    # -- Vortex warp control (wctl_unit.cpp) ------------------------------------------------
    def vx_split(self, row: np.ndarray, negate: bool, else_pc: int, rd: int) -> None:
        then_m = self._mask_of(row, negate)
        else_m = self.tmask & ~then_m
        token = len(self.ipdom)
        write_x(self, rd, token)                 # written under the pre-split mask
        if then_m and else_m:
            if token >= self.core.sim.config.ipdom_depth:
                raise SimError(f"IPDOM stack is full (size={token}); SimX aborts here")
            first = then_m if bin(then_m).count("1") <= bin(else_m).count("1") else else_m
            self.ipdom.append([self.tmask, else_pc, False])
            self.core.sim.counters["divergent_splits"] += 1
            self.apply_mask(first)

    def vx_join(self, token: int, nxt: int) -> int:
        if token == len(self.ipdom):
            return nxt
        if not self.ipdom:
            raise SimError("IPDOM stack is empty at JOIN; SimX aborts here")
        top = self.ipdom[-1]
        if top[2]:
            self.ipdom.pop()
            self.set_tmask(top[0])
            return nxt
        top[2] = True
        self.set_tmask(~self.tmask & top[0])
        return top[1]

    def vx_pred(self, row: np.ndarray, negate: bool, restore: int) -> None:
        pred = self._mask_of(row, negate)
        self.set_tmask(pred if pred else restore)

    def vx_vote(self, kind: str, rs1: int) -> int:
        ballot = self._mask_of(self.x[rs1], False)
        return {"all": ballot == self.tmask, "any": ballot != 0,
                "uni": ballot in (0, self.tmask), "ballot": ballot}[kind]

    def vx_shfl(self, kind: str, rs1: int, rs2: int) -> np.ndarray:
        src, out = self.x[rs1], self.x[rs1].copy()
        for t in self.lanes.tolist():
            bc = int(self.x[rs2, t])
            b, c, m = bc & 0x3F, (bc >> 6) & 0x3F, (bc >> 12) & 0x3F
            hi, lo = (t & m) | (c & ~m), t & m
            lane, ok = {"up": (t - b, t - b >= lo), "down": (t + b, t + b <= hi),
                        "bfly": (t ^ b, (t ^ b) <= hi), "idx": (lo | (b & ~m), (lo | (b & ~m)) <= hi)}[kind]
            lane = lane if ok else t
            out[t] = src[lane] if lane < self.core.threads else src[t]
        return out

    # -- CSRs --------------------------------------------------------------------------------
    def read_csr(self, csr: int):
        v = self.csr_lane.get(csr)
        if v is not None:
            return v
        v = self.csr_scalar.get(csr)
        if v is not None:
            return v
        sim = self.core.sim
        dynamic = {CSR["mscratch"]: self.mscratch, CSR["frm"]: self.frm, CSR["fflags"]: self.fflags,
                   CSR["fcsr"]: (self.frm << 5) | self.fflags, CSR["active_threads"]: self.tmask,
                   CSR["active_warps"]: self.core.active_warp_mask(),
                   CSR["mcycle"]: sim.counters["instructions"] & 0xFFFFFFFF,
                   CSR["minstret"]: sim.counters["instructions"] & 0xFFFFFFFF,
                   CSR["mcycle_h"]: sim.counters["instructions"] >> 32,
                   CSR["minstret_h"]: sim.counters["instructions"] >> 32}
        if csr in dynamic:
            return dynamic[csr]
        raise SimError(f"read of unmodelled CSR {csr:#x}")

    def write_csr(self, csr: int, value) -> None:
        v = int(value[self.last]) if isinstance(value, np.ndarray) else int(value)
        if csr == CSR["frm"]:
            self.frm = v & 7
        elif csr == CSR["fflags"]:
            self.fflags = v & 31
        elif csr == CSR["fcsr"]:
            self.frm, self.fflags = (v >> 5) & 7, v & 31
        elif csr == CSR["mscratch"]:
            self.mscratch = v
        else:
            raise SimError(f"write to read-only or unmodelled CSR {csr:#x}")

    # -- CTA activation (scheduler.cpp activate_warp) ---------------------------------------
    def activate(self, cta: Cta, rank: int, cta_size: int, slot: int, lmem_addr: int,
                 thread_idx: tuple[int, int, int], mask: int, do_init: bool, start_pc: int) -> None:
        core, t = self.core, self.core.threads
        self.pc = start_pc if do_init else (self.pc - KMU_REWIND_BYTES) & 0xFFFFFFFF
        self.mscratch = cta.mscratch
        self.ipdom.clear()
        bx, by, _ = cta.block_dim
        lane = np.arange(t, dtype=np.int64)
        x = thread_idx[0] + lane
        y = thread_idx[1] + x // bx
        z = thread_idx[2] + y // by
        hart = (core.cid * core.sim.config.warps + self.wid) * t + lane
        self.csr_lane = {CSR["thread_id_x"]: (x % bx).astype(U32), CSR["thread_id_y"]: (y % by).astype(U32),
                         CSR["thread_id_z"]: z.astype(U32), CSR["mhartid"]: hart.astype(U32),
                         CSR["thread_id"]: lane.astype(U32)}
        cfg = core.sim.config
        self.csr_scalar = {
            CSR["cta_id"]: slot, CSR["cta_rank"]: rank, CSR["cta_size"]: cta_size,
            CSR["block_id_x"]: cta.block_idx[0], CSR["block_id_y"]: cta.block_idx[1],
            CSR["block_id_z"]: cta.block_idx[2], CSR["block_dim_x"]: bx, CSR["block_dim_y"]: by,
            CSR["block_dim_z"]: cta.block_dim[2], CSR["grid_dim_x"]: cta.grid_dim[0],
            CSR["grid_dim_y"]: cta.grid_dim[1], CSR["grid_dim_z"]: cta.grid_dim[2],
            CSR["cta_entry"]: cta.entry, CSR["cta_lmem_addr"]: lmem_addr, CSR["cluster_size"]: 1,
            CSR["warp_id"]: self.wid, CSR["core_id"]: core.cid, CSR["num_threads"]: t,
            CSR["num_warps"]: cfg.warps, CSR["num_cores"]: cfg.cores,
            CSR["local_mem_base"]: LMEM_BASE_ADDR, CSR["num_barriers"]: cfg.barriers}
        self.active, self.waiting = True, False
        self.apply_mask(mask)


class Core(MemoryPort):
    def __init__(self, sim: "FunctionalSimulator", cid: int) -> None:
        cfg = sim.config
        self.sim, self.cid, self.threads = sim, cid, cfg.threads
        self.full_mask = (1 << cfg.threads) - 1
        self.lane_weights = (1 << np.arange(cfg.threads, dtype=np.int64))
        self._lanes: dict[int, np.ndarray] = {}
        self.lmem = Region(f"local memory (core {cid})", LMEM_BASE_ADDR, cfg.lmem_size)
        self.warps = [Warp(self, w) for w in range(cfg.warps)]
        self.reset()

    def lanes_of(self, mask: int) -> np.ndarray:
        v = self._lanes.get(mask)
        if v is None:
            v = self._lanes[mask] = np.array([t for t in range(self.threads) if mask >> t & 1],
                                             dtype=np.intp)
        return v

    def reset(self) -> None:
        """Per launch: SimX resets the dispatcher (first use of each warp slot runs start-up)."""
        n = len(self.warps)
        self.slot_rem = [0] * n
        self.warp_slot = [-1] * n
        self.warp_init = [False] * n
        self.tail_slot = 0
        self.cta: Cta | None = None
        self.barriers: dict[int, Barrier] = {}
        for w in self.warps:
            w.active = w.waiting = False
            w.x[:] = 0
            w.f[:] = 0

    def active_warp_mask(self) -> int:
        return sum(1 << w.wid for w in self.warps if w.active)

    # -- CTA dispatch (cta_dispatcher.cpp step / next_warp) ---------------------------------
    def step(self, kmu) -> bool:
        """Dispatch at most one warp, like one cycle of SimX's CtaDispatcher::step: take the
        next CTA (even before a warp is free) once its local-memory slot is free, then give one
        warp of it the lowest free warp slot. Returns whether a warp was activated."""
        if self.cta is None:
            nxt = kmu.peek()
            if nxt is None:
                return False
            capacity = self.lmem.end - self.lmem.base
            if nxt.lmem_size > capacity:
                raise SimError(f"lmem_size {nxt.lmem_size} exceeds local memory ({capacity} bytes per core)")
            stride = (nxt.lmem_size + MEM_BLOCK_SIZE - 1) // MEM_BLOCK_SIZE * MEM_BLOCK_SIZE
            slots = len(self.warps) if stride == 0 else max(1, min(len(self.warps), capacity // stride))
            if self.tail_slot >= slots:
                self.tail_slot = 0
            if self.slot_rem[self.tail_slot]:
                return False
            self.cta = kmu.take()
            self.cta_slot = self.tail_slot
            self.cta_size = -(-self.cta.block_size // self.threads)
            self.rank, self.rem, self.tidx = 0, self.cta.block_size, [0, 0, 0]
            self.lmem_addr = LMEM_BASE_ADDR + self.cta_slot * stride
            self.slot_rem[self.cta_slot] = self.cta_size
            self.tail_slot = (self.tail_slot + 1) % slots
            self.sim.counters["ctas"] += 1
        free = next((w for w in self.warps if not w.active), None)
        if free is None:
            return False
        self._next_warp(free)
        return True

    def _next_warp(self, w: Warp) -> None:
        cta = self.cta
        assert cta is not None
        n = min(self.rem, self.threads)
        w.activate(cta, self.rank, self.cta_size, self.cta_slot, self.lmem_addr, tuple(self.tidx),
                   (1 << n) - 1, not self.warp_init[w.wid], self.sim.startup_pc)
        self.warp_init[w.wid] = True
        self.warp_slot[w.wid] = self.cta_slot
        bx, by, _ = cta.block_dim
        sx, sy, sz = cta.warp_step
        nx = self.tidx[0] + sx
        wx = nx >= bx
        self.tidx[0] = nx - bx if wx else nx
        ny = self.tidx[1] + sy + wx
        wy = ny >= by
        self.tidx[1] = ny - by if wy else ny
        self.tidx[2] += sz + wy
        self.rem -= n
        self.rank += 1
        if self.rank >= self.cta_size:
            self.cta = None

    def warp_done(self, w: Warp) -> None:
        slot = self.warp_slot[w.wid]
        if slot >= 0:
            self.warp_slot[w.wid] = -1
            self.slot_rem[slot] -= 1

    def wspawn(self, w: Warp, num_warps: int, pc: int) -> None:
        for other in self.warps[1:min(num_warps, len(self.warps))]:
            if not other.active:
                other.pc, other.mscratch, other.active = pc, w.mscratch, True
                other.csr_scalar, other.csr_lane = dict(w.csr_scalar), dict(w.csr_lane)
                other.apply_mask(1)

    # -- barriers (barrier_unit.cpp) ---------------------------------------------------------
    def _barrier(self, raw: int) -> Barrier:
        if raw >> 31:
            raise SimError("global (cross-core) barriers are not modelled")
        idx = (raw & 0xFF) * self.sim.config.barriers + ((raw >> 8) & 0x7FFFFF)
        return self.barriers.setdefault(idx, Barrier())

    def barrier_phase(self, raw: int) -> int:
        return self._barrier(raw).phase

    def barrier_arrive(self, w: Warp, raw: int, count: int, sync: bool) -> None:
        if count == 0:
            raise SimError(f"barrier arrive with count=0 (bar_id={raw:#x}); SimX aborts here")
        b = self._barrier(raw)
        self.sim.counters["barriers"] += sync
        if sync:
            b.waiters.append(w)
            w.waiting = w.yielding = True
        if b.count + 1 == count:
            for o in b.waiters:
                o.waiting = False
            b.waiters.clear()
            b.phase += 1
        b.count = (b.count + 1) % count

    def barrier_wait(self, w: Warp, raw: int, phase: int) -> None:
        b = self._barrier(raw)
        if b.phase == phase:
            b.waiters.append(w)
            w.waiting = w.yielding = True

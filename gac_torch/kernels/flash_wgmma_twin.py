"""The numpy twin of kernels/flash_wgmma.py: the same `kernel` body on the CPU, one CTA at a
time, each warpgroup a Python thread whose 128 lanes run in lockstep (values are arrays over
the lanes; the float verbs are flash_attention_twin's). Shared memory is a byte array: TMA
writes a box there with the swizzle (`flash_wgmma.swizzle`; rows past the tensor read as zeros)
and counts its bytes on an mbarrier; mbarriers keep phases and pending arrivals / bytes, and a
wait blocks its warpgroup's thread until the phase of the other parity completed (a deadlock
times out). wgmma decodes its descriptors (start, LBO, SBO, swizzle mode) and reads the
operands back from the bytes; it runs when a wait_group retires its group, not when issued, so
a TMA write into bytes a pending wgmma still reads raises RaceError, and an accumulator read
before its wait is NaN. Reading bytes never written raises AssertionError."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from gac_torch.kernels.builder import RaceError, round_to
from gac_torch.kernels.flash_attention import Spec
from gac_torch.kernels.flash_attention_twin import FlashNumpy
from gac_torch.kernels.flash_wgmma import EXP2_MAGIC, EXP2_POLY, WG, Plan, kernel, layout, swizzle

TIMEOUT_S = 30.0


class _Mbar:
    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _step(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


class _Cta:
    """What a CTA's warpgroups share: shared-memory bytes, mbarriers, the wgmma reads in flight."""

    def __init__(self, spec: Spec, p: Plan, arrays: dict[str, np.ndarray], block: tuple[int, int, int]):
        self.spec, self.p, self.arr, self.block = spec, p, arrays, block
        n = layout(spec, p).total
        self.smem = np.zeros(n, dtype=np.uint8)
        self.written = np.zeros(n, dtype=bool)
        self.bars: dict[int, _Mbar] = {}
        self.inflight: list[tuple[int, int]] = []  # byte ranges pending wgmma groups read
        self.named: dict[int, list[int]] = {}  # named barrier -> [threads arrived, generation]
        self.cv = threading.Condition()
        self.sync = threading.Barrier(1 + p.wgs, timeout=TIMEOUT_S)
        self.failed = False


def _u16(x: np.ndarray, elem: str) -> np.ndarray:
    x = round_to(x, elem)
    return x.astype(np.float16).view(np.uint16) if elem == "f16" else (x.view(np.uint32) >> 16).astype(np.uint16)


def _f32(u: np.ndarray, elem: str) -> np.ndarray:
    return u.view(np.float16).astype(np.float32) if elem == "f16" else (u.astype(np.uint32) << 16).view(np.float32)


class _WgTwin(FlashNumpy):
    def __init__(self, cta: _Cta, wg: int):  # (no FlashNumpy.__init__: no padded smem buffers)
        self.cta, self.wg = cta, wg
        self.spec, self.p, self.arr, self.block = cta.spec, cta.p, cta.arr, cta.block
        self.T = WG
        self.mask = np.ones(WG, dtype=bool)
        self.groups: list[list[tuple]] = []  # committed wgmma groups, oldest first
        self.open: list[tuple] = []
        self.done: dict[int, tuple] = {}  # placeholder id -> (it, the accumulator it stands for)

    def tid(self) -> np.ndarray:
        return np.arange(WG, dtype=np.int64) + WG * self.wg

    eq = staticmethod(lambda x, y: x == y)

    def i32(self, x: int) -> np.ndarray:
        return self.const(x)

    add_i32 = staticmethod(lambda x, y: x + y)
    mul_i32 = staticmethod(lambda x, k: x * k)

    def smem_base(self) -> np.ndarray:
        return self.const(0)

    def smem_addr(self, base, off: int, s=None, stride: int = 0):
        return base + off + (0 if s is None else s * stride)

    @staticmethod
    def _one(x: np.ndarray) -> int:
        assert (x == x[0]).all(), "a value that must be uniform differs across lanes"
        return int(x[0])

    def _lanes(self) -> int:
        return int(self.mask.sum())

    # control flow
    def when(self, cond: np.ndarray, then: Callable[[], None]) -> None:
        saved = self.mask
        self.mask = saved & cond
        try:
            if self.mask.any():
                then()
        finally:
            self.mask = saved

    def role(self, cond: np.ndarray, then: Callable[[], None], other: Callable[[], None]) -> None:
        (then if self._one(cond) else other)()

    def loop0(self, lo, hi, body: Callable[[Any], None]) -> None:
        for i in range(self._one(lo), self._one(hi)):
            body(self.const(i))

    def barrier(self) -> None:
        self.cta.sync.wait()

    def _named(self, bar, count: int, wait: bool) -> None:
        cta = self.cta
        with cta.cv:
            st = cta.named.setdefault(self._one(bar), [0, 0])
            gen = st[1]
            st[0] += WG
            assert st[0] <= count, "more threads at a named barrier than its count"
            if st[0] == count:
                st[0], st[1] = 0, gen + 1
                cta.cv.notify_all()
            if wait and not cta.cv.wait_for(lambda: st[1] != gen or cta.failed, TIMEOUT_S):
                raise AssertionError(f"warpgroup {self.wg}: named barrier never completes (deadlock)")

    def bar_sync(self, bar, count: int) -> None:
        self._named(bar, count, True)

    def bar_arrive(self, bar, count: int) -> None:
        self._named(bar, count, False)

    def setmaxnreg(self, inc: bool, n: int) -> None:
        pass

    def fill_ones(self, addrs, nbytes: int) -> None:
        one = _u16(np.ones(1, np.float32), self.spec.elem).view(np.uint8)
        with self.cta.cv:
            for a in addrs:
                at = self._one(a)
                self.cta.smem[at:at + nbytes] = np.tile(one, nbytes // 2)
                self.cta.written[at:at + nbytes] = True

    # mbarriers
    def mbar_init(self, bar, count: int) -> None:
        with self.cta.cv:
            self.cta.bars[self._one(bar[self.mask])] = _Mbar(count)

    def mbar_fence_init(self) -> None:
        pass

    def _bar(self, bar) -> _Mbar:
        return self.cta.bars[self._one(bar)]

    def mbar_expect(self, bar, nbytes: int) -> None:
        with self.cta.cv:
            m = self._bar(bar)
            m.pending -= self._lanes()
            m.tx += nbytes
            m._step()
            self.cta.cv.notify_all()

    def mbar_arrive(self, bar) -> None:
        with self.cta.cv:
            m = self._bar(bar[self.mask])
            m.pending -= self._lanes()
            assert m.pending >= 0, "more arrivals than the barrier expects"
            m._step()
            self.cta.cv.notify_all()

    def mbar_wait(self, bar, parity) -> None:
        par = self._one(parity)
        with self.cta.cv:
            m = self._bar(bar)
            if not self.cta.cv.wait_for(lambda: m.phase % 2 != par or self.cta.failed, TIMEOUT_S):
                raise AssertionError(f"warpgroup {self.wg}: mbarrier wait never completes (deadlock)")
            if self.cta.failed:
                raise AssertionError("another warpgroup failed")

    # TMA
    def tma_load(self, which: str, dst, coords: list, bar) -> None:
        assert self._lanes() == 1, "one thread issues a TMA load"
        spec, p, cta = self.spec, self.p, self.cta
        rows = p.bm if which == "Q" else p.bn
        sw = p.sw_v if which == "V" else p.sw_qk
        c = [self._one(x) for x in coords]  # innermost first: col, row, batch (reversed)
        src = self.arr[which]
        bidx = tuple(c[2:][::-1])
        box = np.zeros((rows, sw // 2), dtype=np.float32)
        r_hi, c_hi = min(src.shape[-2], c[1] + rows), min(src.shape[-1], c[0] + sw // 2)
        if r_hi > c[1] and c_hi > c[0]:
            box[:r_hi - c[1], :c_hi - c[0]] = src[bidx + (slice(c[1], r_hi), slice(c[0], c_hi))]
        at = self._one(dst)
        assert at % 1024 == 0 or (at % (8 * sw) == 0 and sw < 128), "a swizzled box must start aligned"
        raw = _u16(box, spec.elem).view(np.uint8).reshape(-1)
        offs = np.array([swizzle(o, sw) for o in range(0, raw.size, 16)])
        with cta.cv:
            lo, hi = at, at + raw.size
            if any(a < hi and lo < b for a, b in cta.inflight):
                raise RaceError(f"TMA of {which} overwrites shared memory a pending wgmma reads")
            for i, o in enumerate(offs):
                cta.smem[at + o:at + o + 16] = raw[16 * i:16 * i + 16]
                cta.written[at + o:at + o + 16] = True
            m = self._bar(bar)
            m.tx -= raw.size
            m._step()
            cta.cv.notify_all()

    # wgmma
    def descriptor(self, addr, lbo: int, sbo: int, sw: int) -> tuple[int, int, int, int]:
        return (self._one(addr), lbo, sbo, sw)

    def desc_add(self, d, off: int, s=None, stride: int = 0, lbo_step: int = 0):
        k = 0 if s is None else self._one(s)
        return (d[0] + off + k * stride, d[1] - k * lbo_step) + tuple(d[2:])

    def _read(self, d, rows: int, cols: int, k_major: bool) -> np.ndarray:
        """The rows x cols operand (K-major: [M/N][K]; N-major: [K][N]) a descriptor reads."""
        start, lbo, sbo, sw = d
        assert start % 16 == 0 and lbo % 16 == 0 and sbo % 16 == 0
        r, cidx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        if k_major:  # r: M/N, c: K
            addr = start + (r // 8) * sbo + (r % 8) * sw + cidx * 2
        else:  # r: K, c: N, in chunks of sw bytes LBO apart
            per = sw // 2
            addr = start + (cidx // per) * lbo + (r // 8) * sbo + (r % 8) * sw + (cidx % per) * 2
        addr = addr ^ (((addr >> 7) & (sw // 16 - 1)) << 4)
        cta = self.cta
        assert cta.written[addr].all() and cta.written[addr + 1].all(), "wgmma reads bytes never written"
        u = cta.smem[addr].astype(np.uint16) | (cta.smem[addr + 1].astype(np.uint16) << 8)
        return _f32(u, self.spec.elem)

    def _span(self, d, rows: int, cols: int, k_major: bool) -> list[tuple[int, int]]:
        """The byte ranges an operand reads: one, or (N-major) one per chunk of sw bytes."""
        start, lbo, sbo, sw = d
        base = start - start % 1024
        if k_major:
            return [(base, base + (rows // 8) * sbo)]
        return [(base + j * lbo, base + j * lbo + (rows // 8) * sbo) for j in range(-(-cols * 2 // sw))]

    def _issue(self, acc, a, db, n: int, k_major_b: bool) -> list[np.ndarray]:
        out = [np.full(WG, np.nan, dtype=np.float32) for _ in range(n // 2)]
        spans = self._span(db, n, 16, True) if k_major_b else self._span(db, 16, n, False)
        if not isinstance(a, list):
            spans += self._span(a, 64, 16, True)
        with self.cta.cv:
            self.cta.inflight += spans
        self.open.append((acc, a, db, n, k_major_b, out, spans))
        return out

    def wgmma_ss(self, acc, da, db, n: int) -> list[np.ndarray]:
        return self._issue(acc, da, db, n, True)

    def wgmma_rs(self, acc, a: list[np.ndarray], db, n: int) -> list[np.ndarray]:
        return self._issue(acc, a, db, n, False)

    def wgmma_fence(self) -> None:
        pass

    def wgmma_commit(self) -> None:
        self.groups.append(self.open)
        self.open = []

    def _val(self, x: np.ndarray) -> np.ndarray:
        hit = self.done.get(id(x))  # (the placeholder stays referenced: its id is not reused)
        return hit[1] if hit is not None and hit[0] is x else x

    def _run(self, op: tuple) -> None:
        acc, a, db, n, k_major_b, out, spans = op
        lane = np.arange(WG)
        warp, g, t = lane // 32, (lane % 32) // 4, lane % 4
        if isinstance(a, list):  # register A: FA2's A fragment per warp (rows 16w + g (+8), k 2t (+8))
            A = np.zeros((64, 16))
            for r, x in enumerate(a):
                for e in range(2):
                    A[16 * warp + g + 8 * (r % 2), 2 * t + 8 * (r // 2) + e] = x[:, e]
        else:
            A = self._read(a, 64, 16, True)
        B = self._read(db, n, 16, True).T if k_major_b else self._read(db, 16, n, False)
        D = A.astype(np.float64) @ B.astype(np.float64)
        if acc is not None:
            for i, x in enumerate(acc):
                D[16 * warp + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2] += self._val(x)
        for i, x in enumerate(out):
            self.done[id(x)] = x, D[16 * warp + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2].astype(np.float32)
        with self.cta.cv:
            for s in spans:
                self.cta.inflight.remove(s)

    def wgmma_wait(self, n: int, vals: list[np.ndarray], ivals: list[np.ndarray] = ()) -> list[np.ndarray]:
        while len(self.groups) > n:
            for op in self.groups.pop(0):
                self._run(op)
        return [self._val(x) for x in vals] + list(ivals)

    @staticmethod
    def fexp2_poly(x: np.ndarray) -> np.ndarray:
        """The text builder's steps in f32 (one rounding per fma)."""
        f32 = np.float32
        xc = np.maximum(x.astype(f32), f32(-120.0))
        t = (xc + f32(EXP2_MAGIC)).astype(f32)
        f = (xc - (t - f32(EXP2_MAGIC)).astype(f32)).astype(f32)
        p = np.full_like(f, EXP2_POLY[3])
        for k in (2, 1, 0):
            p = (f.astype(np.float64) * p + EXP2_POLY[k]).astype(f32)
        bits = p.view(np.int32) + np.left_shift(t.view(np.int32), 23)
        return bits.astype(np.int32).view(f32)

    def izero(self) -> np.ndarray:
        return np.zeros((WG, 2), dtype=np.float32)

    def loop(self, n, init, body, types=None):
        return super().loop(n, init, body)

    def pack_i32(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return self.pack_f32(lo, hi)

    def store_pair(self, idx: list[np.ndarray], vals: list[np.ndarray], ok: np.ndarray) -> None:
        o = self.arr["O"]
        for e, v in enumerate(vals):
            at = tuple(x[ok] for x in idx[:-1]) + (idx[-1][ok] + e,)
            assert all((x < s).all() for x, s in zip(at, o.shape)), "O store out of bounds"
            assert np.isnan(o[at]).all(), "an O element stored twice"
            o[at] = round_to(v[ok], self.spec.o.elem)


def emulate(spec: Spec, p: Plan, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Run the kernel on the CPU (arrays shaped like the memrefs). Returns O as f32 holding
    values rounded to O's type; NaN marks an element the kernel did not write."""
    e = spec.elem
    arrays = {"Q": round_to(q, e), "K": round_to(k, e), "V": round_to(v, e),
              "O": np.full(spec.o.shape, np.nan, dtype=np.float32)}
    for bz in range(p.grid[2]):
        for bx in range(p.grid[0]):
            cta = _Cta(spec, p, arrays, (bx, 0, bz))
            errors: list[BaseException] = []

            def run(wg: int) -> None:
                try:
                    kernel(_WgTwin(cta, wg), spec, p)  # noqa: B023
                except BaseException as ex:  # (re-raised below; the others stop waiting)
                    errors.append(ex)
                    with cta.cv:  # noqa: B023
                        cta.failed = True
                        cta.cv.notify_all()
                    cta.sync.abort()  # noqa: B023

            threads = [threading.Thread(target=run, args=(w,)) for w in range(1 + p.wgs)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if any(st[0] for st in cta.named.values()):
                errors.append(AssertionError("a named barrier left with arrivals pending"))
            if errors:
                raise next((x for x in errors if not isinstance(x, threading.BrokenBarrierError)), errors[0])
            if cta.inflight:
                raise AssertionError("a wgmma group was never waited for")
    return arrays["O"]

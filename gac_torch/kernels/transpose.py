"""Tiled transpose: D[b..., c, r] = S[...] where S's dim `perm[-2]` (c) is its unit-stride dim
and `perm[-1]` (r) another one; the other dims (`perm[:-2]`, batch) keep their order. One
launch: a block of 256 threads moves a T x T (T = 64) tile through shared memory padded to
T + 1 columns, so both global sides are coalesced (a warp reads 32 consecutive elements of a
row of S, and writes 32 consecutive elements of a row of D) and both shared-memory sides are
conflict-free (the column read at stride T + 1 hits 32 banks).

  1. locate  block (bx, by, bz) -> tile origin (r0 = bx*T, c0 = by*T), batch index from bz;
             thread -> (ty, tx) = (tid / T, tid % T)
  2. load    for i < T/4: S[r0 + ty + 4i][c0 + tx] (0 outside S) -> Ts[ty + 4i][tx]; all the
             loads first, then the stores (T/4 loads in flight per thread)
  3. barrier
  4. store   for i < T/4: D[c0 + ty + 4i][r0 + tx] = Ts[tx][ty + 4i], inside D only
Bounds checks are emitted only along a dim whose extent is not a multiple of T.

Used by strategies/sgemm_relayout.py (exact-f32 GEMM operands moved to the K-outer layout).
Written once (`_kernel`) against gac_torch.kernels.builder: `template` emits the MLIR
(`func.func @tmpl(%S, %D, %init)` holding one gpu.launch), `emulate` runs it with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels.builder import WORKGROUP, Numpy, Smem, Text

T, ROWS = 64, 4  # a T x T tile; 256 threads = ROWS x T
THREADS = T * ROWS


@dataclass(frozen=True)
class Spec:
    src: str  # memref type text of S (any strides; perm[-2] its unit-stride dim)
    dst: str  # memref type text of D: dense, shape[perm]
    elem: str
    shape: tuple[int, ...]  # S's (static) shape
    perm: tuple[int, ...]  # D's dim p is S's dim perm[p]

    @property
    def rows(self) -> int:  # R: D's inner extent
        return self.shape[self.perm[-1]]

    @property
    def cols(self) -> int:  # C: S's inner extent
        return self.shape[self.perm[-2]]

    @property
    def batch(self) -> list[int]:
        return [self.shape[p] for p in self.perm[:-2]]

    @property
    def grid(self) -> tuple[int, int, int]:
        return -(-self.rows // T), -(-self.cols // T), math.prod(self.batch)


def dense_type(shape: tuple[int, ...], elem: str) -> str:
    return "memref<" + "".join(f"{n}x" for n in shape) + f"{elem}>"


def spec(src: str, elem: str, shape: tuple[int, ...], perm: tuple[int, ...]) -> Spec:
    return Spec(src, dense_type(tuple(shape[p] for p in perm), elem), elem, tuple(shape), tuple(perm))


def fits(s: Spec, max_grid: tuple[int, int, int]) -> bool:
    return all(0 < g <= lim for g, lim in zip(s.grid, max_grid))


def _kernel(b: Any, s: Spec) -> None:
    R, C = s.rows, s.cols
    # 1. locate
    tid, bx, by, bz = b.tid(), b.bid(0), b.bid(1), b.bid(2)
    ty, tx = tid // T, tid % T
    r0, c0 = bx * T, by * T
    bidx: list[Any] = []
    rest = bz
    for j in range(len(s.batch) - 1, -1, -1):  # batch index, last fastest
        bidx.insert(0, rest if j == 0 else rest % s.batch[j])
        rest = rest // s.batch[j] if j else rest

    def src_at(r: Any, c: Any) -> list[Any]:
        at = dict(zip(s.perm[:-2], bidx))
        at[s.perm[-2]], at[s.perm[-1]] = c, r
        return [at[d] for d in range(len(s.shape))]

    def inside(r: Any, c: Any) -> Any:  # None: always (the extents are whole tiles)
        conds = ([r < R] if R % T else []) + ([c < C] if C % T else [])
        return conds[0] & conds[1] if len(conds) == 2 else conds[0] if conds else None

    # 2. load (all loads, then all shared-memory stores)
    zero = b.const(0.0, s.elem)
    c = c0 + tx
    vals = []
    for i in range(T // ROWS):
        r = r0 + (ty + ROWS * i)
        ok = inside(r, c)
        vals.append(b.get("S", src_at(r, c)) if ok is None else
                    b.if_(ok, s.elem, lambda r=r: b.get("S", src_at(r, c)), lambda: zero))
    for i, v in enumerate(vals):
        b.put("Ts", [ty + ROWS * i, tx], v)
    b.barrier()  # 3
    # 4. store
    r = r0 + tx
    for i in range(T // ROWS):
        cl = ty + ROWS * i
        v = b.get("Ts", [tx, cl])
        at = [*bidx, c0 + cl, r]
        ok = inside(r, c0 + cl)
        if ok is None:
            b.put("D", at, v)
        else:
            b.when(ok, lambda at=at, v=v: b.put("D", at, v))


# --------------------------------------------------------------------------------------------
# builder 1: MLIR text


def template(s: Spec) -> str:
    """`func.func @tmpl(%S, %D, %init)` (init unused) holding the launch."""
    b = Text()
    b.types = {"S": s.src, "D": s.dst, "Ts": f"memref<{T}x{T + 1}x{s.elem}, {WORKGROUP}>"}
    b.w(f"func.func @tmpl(%S: {s.src}, %D: {s.dst}, %init: {s.elem}) {{")
    gx, gy, gz = (b.const(g) for g in s.grid)
    one, nt = b.const(1), b.const(THREADS)
    b.w(f"gpu.launch blocks(%bx, %by, %bz) in (%sgx = {gx}, %sgy = {gy}, %sgz = {gz}) "
        f"threads(%tid, %tyy, %tzz) in (%stx = {nt}, %sty = {one}, %stz = {one}) "
        f"workgroup(%Ts : {b.types['Ts']}) {{")
    b.consts = {}  # the kernel defines its own constants
    _kernel(b, s)
    b.w("gpu.terminator\n}\nreturn\n}")
    return "\n".join(b.lines)


# --------------------------------------------------------------------------------------------
# builder 2: numpy, one block at a time, threads in lockstep


class _Numpy(Numpy):
    def __init__(self, s: Spec, bufs: dict[str, np.ndarray], block: tuple[int, int, int]):
        super().__init__(THREADS, block)
        self.bufs = bufs
        self.S = {"Ts": Smem("Ts", (T, T + 1), bufs["S"].dtype)}


def emulate(s: Spec, src: np.ndarray) -> np.ndarray:
    """Run the kernel on the CPU on `src` (shaped like S); returns D. Raises RaceError on a
    shared-memory race; fails on an out-of-bounds access."""
    src = np.asarray(src)
    assert src.shape == s.shape
    dst = np.full([s.shape[p] for p in s.perm], np.nan, dtype=src.dtype)
    bufs = {"S": src, "D": dst}
    gx, gy, gz = s.grid
    for bz in range(gz):
        for by in range(gy):
            for bx in range(gx):
                _kernel(_Numpy(s, bufs, (bx, by, bz)), s)
    return dst

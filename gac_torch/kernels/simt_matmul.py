"""SIMT matmul for the cuda target: C[b, m, n] = init + sum_k cast(A[b, m, k]) * cast(B[b, k, n]),
any layout (each operand's dims are given by its indexing map), accumulated in f32 for f16/bf16
outputs (as torch does) and in the element type otherwise (ints wrap the same in any width).

A 16x16-thread block computes a (16*TM) x (16*TN) tile of C; thread (tr, tc) owns the TM x TN
accumulators at rows tr + 16 i, cols tc + 16 j (conflict-free shared-memory reads, coalesced
stores). K is staged through shared memory BK = 16 deep, stored k-major.

  1. locate   block (bx, by, bz) -> tile origin (m0 = by*BM, n0 = bx*BN), batch index from bz;
              thread -> (tr, tc); each accumulator's row/col and whether it is inside C
  2. init     accumulators = the fused fill's value, or C (0 outside the matrix)
  3. for each K slice k0 (BK deep):
     3a. stage   every thread loads (BM + BN) * BK / 256 elements of A and B (consecutive
                 threads along the operand's contiguous dim: coalesced), casts them to the
                 accumulator type, stores them k-major into shared memory (0 outside)
     3b. barrier
     3c. fma     for kk in 0..BK: acc[i][j] += As[kk][tr + 16 i] * Bs[kk][tc + 16 j]
     3d. barrier the next slice overwrites the tiles
  4. store    each accumulator to C, converted to C's type, inside the matrix only

Run-time extents (None in `ranges`) are read on the host (memref.dim of the operand named in
`sources`) and the grid computed there; the kernel takes them as values.

Written once (`_kernel`) against gac_torch.kernels.builder: `template` emits the MLIR
(`func.func @tmpl(%A, %B, %C, %init)` holding one gpu.launch, the form
backends/gpu/strategy.splice_template splices into a graph), `emulate` runs it with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels.builder import WORKGROUP, Numpy, Smem, Text, as_type

TT, BK = 16, 16  # a 16x16 thread block; K staged 16 deep
_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "i32": 4, "f64": 8, "i64": 8}
_FLOAT = ("f16", "bf16", "f32", "f64")


@dataclass(frozen=True)
class Operand:
    type: str  # memref type text
    elem: str
    dims: tuple[int, ...]  # the iteration dim of each memref dim (outermost first)
    casts: tuple[tuple[str, str], ...] = ()  # (op, result type) applied to a loaded element


@dataclass(frozen=True)
class Spec:
    m: int  # iteration dims
    n: int
    k: int
    batch: tuple[int, ...]
    ranges: tuple[int | None, ...]  # every iteration dim's extent; None: known at run time
    sources: tuple[tuple[str, int], ...]  # per iteration dim: ("A" | "B" | "C", memref dim)
    a: Operand
    b: Operand
    c: Operand
    is_float: bool
    fill: bool  # accumulators start from %init (a fused fill) instead of C

    @property
    def acc(self) -> str:
        return "f32" if self.is_float and self.c.elem in ("f16", "bf16") else self.c.elem

    @property
    def dynamic(self) -> bool:
        return None in self.ranges


@dataclass(frozen=True)
class Tiling:
    tm: int  # accumulators per thread: tm x tn
    tn: int

    @property
    def bm(self) -> int:
        return TT * self.tm

    @property
    def bn(self) -> int:
        return TT * self.tn


def plan(spec: Spec, max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535),
         smem_limit: int = 48 * 1024, big_tile_min_blocks: int = 256) -> Tiling | None:
    """The tile, or None when the kernel does not apply (grid or shared memory too large).
    Run-time extents take a 64-wide tile; 128x128 once it still makes `big_tile_min_blocks`."""
    M, N, K = spec.ranges[spec.m], spec.ranges[spec.n], spec.ranges[spec.k]
    batch = [spec.ranges[d] for d in spec.batch]
    big = not spec.dynamic and (-(-M // 128) * -(-N // 128) * math.prod(batch)  # type: ignore
                                >= big_tile_min_blocks)
    tm = 8 if big else 4 if M is None or M >= 64 else 2 if M >= 32 else 1
    tn = 8 if big else 4 if N is None or N >= 64 else 2 if N >= 32 else 1
    t = Tiling(tm, tn)
    if not spec.dynamic:
        grid = (-(-N // t.bn), -(-M // t.bm), math.prod(batch))  # type: ignore[operator]
        if any(x > lim for x, lim in zip(grid, max_grid)) or 0 in grid or K == 0:
            return None
    if BK * (t.bm + t.bn) * _BYTES.get(spec.acc, 4) > smem_limit:
        return None
    return t


def _convert(b: Any, x: Any, src: str, dst: str, is_float: bool) -> Any:
    if src == dst:
        return x
    if is_float:
        if {src, dst} == {"f16", "bf16"}:  # no direct cast between the two halves
            return b.cast("arith.truncf", b.cast("arith.extf", x, src, "f32"), "f32", dst)
        widths = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
        return b.cast("arith.extf" if widths[dst] > widths[src] else "arith.truncf", x, src, dst)
    return b.cast("arith.extsi" if int(dst[1:]) > int(src[1:]) else "arith.trunci", x, src, dst)


# --------------------------------------------------------------------------------------------
# the kernel, once, against a builder


def _kernel(b: Any, spec: Spec, t: Tiling, M: Any, N: Any, K: Any, bext: list[Any]) -> None:
    acc, fl = spec.acc, spec.is_float
    zero = b.const(0.0 if fl else 0, acc)
    # 1. locate
    tid, bx, by, bz = b.tid(), b.bid(0), b.bid(1), b.bid(2)
    tr, tc = tid // TT, tid % TT
    m0, n0 = by * t.bm, bx * t.bn
    at: dict[int, Any] = {}
    rest = bz
    for j in range(len(spec.batch) - 1, -1, -1):  # batch index, last fastest
        at[spec.batch[j]] = rest if j == 0 else rest % bext[j]
        if j:
            rest = rest // bext[j]
    rr, cm, mok = [], [], []  # per accumulator row: in the tile, in C, inside C
    for i in range(t.tm):
        rr.append(tr + i * TT)
        cm.append(m0 + rr[i])
        mok.append(cm[i] < M)
    cc, cn, nok = [], [], []  # and per column
    for j in range(t.tn):
        cc.append(tc + j * TT)
        cn.append(n0 + cc[j])
        nok.append(cn[j] < N)

    def c_at(i: int, j: int) -> list[Any]:
        return [{**at, spec.m: cm[i], spec.n: cn[j]}[d] for d in spec.c.dims]

    # 2. init
    init = _convert(b, b.init(), spec.c.elem, acc, fl)
    accs = []
    for i in range(t.tm):
        for j in range(t.tn):
            accs.append(init if spec.fill else b.if_(
                mok[i] & nok[j], acc, lambda i=i, j=j: _convert(b, b.get("C", c_at(i, j)), spec.c.elem, acc, fl),
                lambda: zero))

    # 3a. a rows x BK tile of A (rows = BM) or B (rows = BN), k-major in shared memory
    def stage(which: str, k0: Any) -> None:
        op = spec.a if which == "A" else spec.b
        outer, rows, base, lim = (spec.m, t.bm, m0, M) if which == "A" else (spec.n, t.bn, n0, N)
        k_fast = op.dims[-1] == spec.k
        for l in range(rows * BK // (TT * TT)):
            e = tid + l * TT * TT
            if k_fast:
                r, k = e // BK, e % BK
            else:
                k, r = e // rows, e % rows
            gr, gk = base + r, k0 + k
            idx = [{**at, outer: gr, spec.k: gk}[d] for d in op.dims]

            def load(op: Operand = op, idx: list[Any] = idx) -> Any:
                x, ty = b.get(which, idx), op.elem
                for name, rt in op.casts:
                    x, ty = b.cast(name, x, ty, rt), rt
                return _convert(b, x, ty, acc, fl)

            b.put(which + "s", [k, r], b.if_((gr < lim) & (gk < K), acc, load, lambda: zero))

    def slice_(k0: Any, accs: list[Any]) -> list[Any]:
        stage("A", k0)
        stage("B", k0)
        b.barrier()  # 3b

        def fma(kk: Any, part: list[Any]) -> list[Any]:  # 3c
            a = [b.get("As", [kk, rr[i]]) for i in range(t.tm)]
            w = [b.get("Bs", [kk, cc[j]]) for j in range(t.tn)]
            return [b.mac(a[i], w[j], part[i * t.tn + j], acc) for i in range(t.tm) for j in range(t.tn)]

        part = b.for_(b.const(0), b.const(BK), b.const(1), accs, [acc] * len(accs), fma)
        b.barrier()  # 3d
        return part

    res = b.for_(b.const(0), K, b.const(BK), accs, [acc] * len(accs), slice_)

    # 4. store
    for i in range(t.tm):
        for j in range(t.tn):
            val = res[i * t.tn + j]
            b.when(mok[i] & nok[j], lambda i=i, j=j, val=val: b.put(
                "C", c_at(i, j), _convert(b, val, acc, spec.c.elem, fl)))


# --------------------------------------------------------------------------------------------
# builder 1: MLIR text


class _Text(Text):
    def __init__(self, spec: Spec, t: Tiling):
        super().__init__()
        self.spec = spec
        self.types = {"A": spec.a.type, "B": spec.b.type, "C": spec.c.type,
                      "As": f"memref<{BK}x{t.bm}x{spec.acc}, {WORKGROUP}>",
                      "Bs": f"memref<{BK}x{t.bn}x{spec.acc}, {WORKGROUP}>"}

    def init(self) -> str:
        return self.val("%init")

    def mac(self, x: str, y: str, acc: str, ty: str) -> str:
        fm = " fastmath<contract>" if self.spec.is_float else ""  # lets LLVM form FMAs
        mul, add = ("arith.mulf", "arith.addf") if self.spec.is_float else ("arith.muli", "arith.addi")
        return self.binop(add, acc, self.binop(mul, x, y, ty, fm), ty, fm)


def template(spec: Spec, t: Tiling) -> str:
    """`func.func @tmpl(%A, %B, %C, %init)`: the extents and the grid on the host (run-time ones
    from memref.dim), then the gpu.launch (see the banner)."""
    b = _Text(spec, t)

    def extent(d: int) -> str:  # host side: a constant or the buffer's run-time dim
        if spec.ranges[d] is not None:
            return b.const(spec.ranges[d])
        which, pos = spec.sources[d]
        r = b.fresh()
        b.w(f"{r} = memref.dim %{which}, {b.const(pos)} : {b.types[which]}")
        return r

    b.w(f"func.func @tmpl(%A: {spec.a.type}, %B: {spec.b.type}, %C: {spec.c.type}, %init: {spec.c.elem}) {{")
    one = b.const(1)
    M, N, K = extent(spec.m), extent(spec.n), extent(spec.k)
    bext = [extent(d) for d in spec.batch]
    hbm, hbn = b.const(t.bm), b.const(t.bn)
    gx, gy = b.binop("arith.ceildivui", N, hbn), b.binop("arith.ceildivui", M, hbm)
    gz = one
    for e in bext:
        gz = b.mul(gz, e)
    nt = b.const(TT * TT)
    b.w(f"gpu.launch blocks(%bx, %by, %bz) in (%sgx = {gx}, %sgy = {gy}, %sgz = {gz}) "
        f"threads(%tid, %tyy, %tzz) in (%stx = {nt}, %sty = {one}, %stz = {one}) "
        f"workgroup(%As : {b.types['As']}, %Bs : {b.types['Bs']}) {{")
    b.consts = {}  # the kernel defines its own constants
    _kernel(b, spec, t, M, N, K, bext)
    b.w("gpu.terminator\n}\nreturn\n}")
    return "\n".join(b.lines)


# --------------------------------------------------------------------------------------------
# builder 2: numpy, one block at a time, threads in lockstep


class _Numpy(Numpy):
    def __init__(self, spec: Spec, t: Tiling, bufs: dict[str, np.ndarray], init: float,
                 block: tuple[int, int, int]):
        super().__init__(TT * TT, block)
        self.spec, self.bufs, self.initv = spec, bufs, init
        dt = np.float32 if spec.acc == "f32" else np.float64  # (ints exact; unwritten: NaN)
        self.S = {"As": Smem("As", (BK, t.bm), dt), "Bs": Smem("Bs", (BK, t.bn), dt)}

    def init(self) -> np.ndarray:
        return as_type(self.const(self.initv, self.spec.c.elem), self.spec.c.elem)

    def mac(self, x: np.ndarray, y: np.ndarray, acc: np.ndarray, ty: str) -> np.ndarray:
        return as_type(acc + as_type(x * y, ty), ty)


def emulate(spec: Spec, t: Tiling, A: np.ndarray, B: np.ndarray, C: np.ndarray,
            init: float = 0.0) -> np.ndarray:
    """Run the kernel on the CPU. A, B, C are arrays shaped like the memrefs (dense), holding
    values of their element types (floats as f32/f64, ints as int64); run-time extents are
    taken from them. Returns the new C. Raises RaceError on a shared-memory race."""
    bufs = {"A": np.asarray(A), "B": np.asarray(B), "C": np.array(C)}
    ext = [r if r is not None else bufs[w].shape[p] for r, (w, p) in zip(spec.ranges, spec.sources)]
    M, N, K = ext[spec.m], ext[spec.n], ext[spec.k]
    bext = [ext[d] for d in spec.batch]
    grid = (-(-N // t.bn), -(-M // t.bm), math.prod(bext))
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                _kernel(_Numpy(spec, t, bufs, init, (bx, by, bz)), spec, t, M, N, K, bext)
    return bufs["C"]

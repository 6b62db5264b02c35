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

With a prologue (`Prologue`, GAC_TRANSPOSE_PRODUCER): S is not read but computed, element for
element, by the elementwise body of the loops kernel that would have written it (its inputs
loaded at the element, or broadcast along S's dims), step 2 stores the value to S's own buffer
too where something else still reads it (P, S's layout, from the thread that computed it), and
the loops kernel is gone: its output is written once, its transposed copy without reading it
back (the MLP step's dy = 2 (y - t) / n and dy^T, the dh GEMM's A).

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
from gac_torch.kernels.gemm_epilogue import EOp, NumpyMixin, TextMixin

T, ROWS = 64, 4  # a T x T tile; 256 threads = ROWS x T
THREADS = T * ROWS


@dataclass(frozen=True)
class Prologue:
    """S[e] = body(X0[e..], X1[e..], ...): body argument i is input i, a memref of type
    inputs[i][0] indexed by S's dims inputs[i][1] (in that order: () a scalar, all of them the
    element itself); `ops` the body (gemm_epilogue.EOp, refs ("arg", i) / ("op", j) /
    ("const", text, type)), `result` the stored value; `plain`: S also stored (P); `colsum`
    (2-D S only): Q's memref type, Q[bx][c] = the sum of S[r][c] over the tile's rows r (in
    order; Q's other dims unit ones, its dim `colsum[1]` c), the first stage of S.sum(rows)."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    ops: tuple[EOp, ...]
    result: tuple
    plain: bool
    colsum: tuple[str, int] | None = None


@dataclass(frozen=True)
class Spec:
    src: str  # memref type text of S (any strides; perm[-2] its unit-stride dim)
    dst: str  # memref type text of D: dense, shape[perm]
    elem: str
    shape: tuple[int, ...]  # S's (static) shape
    perm: tuple[int, ...]  # D's dim p is S's dim perm[p]
    pro: Prologue | None = None  # S computed, not read (module docstring)

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


def spec(src: str, elem: str, shape: tuple[int, ...], perm: tuple[int, ...], pro: Prologue | None = None) -> Spec:
    return Spec(src, dense_type(tuple(shape[p] for p in perm), elem), elem, tuple(shape), tuple(perm), pro)


def _value(b: Any, s: Spec, at: list[Any]) -> Any:
    """S at index `at`: read, or computed by the prologue (and stored to P where asked)."""
    pro = s.pro
    if pro is None:
        return b.get("S", at)
    args = [b.get(f"X{i}", [at[d] for d in dims]) for i, (_, dims) in enumerate(pro.inputs)]
    results: list[Any] = []

    def ref(r: tuple) -> Any:
        return args[r[1]] if r[0] == "arg" else results[r[1]] if r[0] == "op" else b.econst(r[1], r[2])

    for op in pro.ops:
        results.append(b.eop(op, [ref(r) for r in op.args]))
    v = ref(pro.result)
    if pro.plain:
        b.put("P", at, v)
    return v


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
        vals.append(_value(b, s, src_at(r, c)) if ok is None else
                    b.if_(ok, s.elem, lambda r=r: _value(b, s, src_at(r, c)), lambda: zero))
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
    if s.pro is not None and s.pro.colsum is not None:  # 5. the tile's column sums (its first T threads)
        _colsum(b, s, tid, tx, bx, c0, inside)


_ADD = EOp("arith.addf", (("arg", 0), ("arg", 1)), "", ("f32", "f32"), "f32")


def _colsum(b: Any, s: Spec, tid: Any, tx: Any, bx: Any, c0: Any, inside: Any) -> None:
    """Q[bx][c0 + tx] = sum over i of Ts[i][tx], i = 0..T-1 in order (rows outside S hold
    zeros), by threads tid < T (tx = tid there; a warp reads 32 consecutive words of a row: no
    bank conflict)."""
    qtype, qdim = s.pro.colsum  # type: ignore[union-attr]
    rank = qtype.count("x")

    def body() -> None:
        acc = b.get("Ts", [b.const(0), tx])
        for i in range(1, T):
            acc = b.eop(_ADD, [acc, b.get("Ts", [b.const(i), tx])])
        c = c0 + tx
        at = [bx] + [c if d == qdim else b.const(0) for d in range(1, rank)]
        ok = inside(b.const(0), c) if s.cols % T else None
        if ok is None:
            b.put("Q", at, acc)
        else:
            b.when(ok, lambda: b.put("Q", at, acc))

    b.when(b.lt(tid, b.const(T)), body)


def colsum_rows(s: Spec) -> int:
    """Q's extent along the tiles (its dim 0)."""
    return s.grid[0]


# --------------------------------------------------------------------------------------------
# builder 1: MLIR text


class _Text(Text):
    econst, eop = TextMixin.econst, TextMixin.eop  # (the prologue's body: the GEMM epilogue's verbs)


def arg_names(s: Spec) -> list[str]:
    """The template's buffer arguments in order: S (or the prologue's inputs, then P where
    stored), D."""
    if s.pro is None:
        return ["S", "D"]
    return ([f"X{i}" for i in range(len(s.pro.inputs))] + (["P"] if s.pro.plain else []) + ["D"]
            + (["Q"] if s.pro.colsum is not None else []))


def template(s: Spec) -> str:
    """`func.func @tmpl(<arg_names>, %init)` (init unused) holding the launch."""
    b = _Text()
    b.types = {"S": s.src, "D": s.dst, "P": s.src, "Ts": f"memref<{T}x{T + 1}x{s.elem}, {WORKGROUP}>"}
    if s.pro is not None:
        b.types.update({f"X{i}": t for i, (t, _) in enumerate(s.pro.inputs)})
        if s.pro.colsum is not None:
            b.types["Q"] = s.pro.colsum[0]
    params = ", ".join(f"%{n}: {b.types[n]}" for n in arg_names(s))
    b.w(f"func.func @tmpl({params}, %init: {s.elem}) {{")
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
        self.S = {"Ts": Smem("Ts", (T, T + 1), bufs["D"].dtype)}

    econst, eop = NumpyMixin.econst, NumpyMixin.eop


def emulate(s: Spec, src: np.ndarray | None = None, inputs: tuple = ()) -> Any:
    """Run the kernel on the CPU on `src` (shaped like S), or with a prologue on its `inputs`;
    returns D, or with a prologue (P or None, D, Q or None). Raises RaceError on a shared-memory
    race; fails on an out-of-bounds access."""
    if s.pro is None:
        src = np.asarray(src)
        assert src.shape == s.shape
        bufs = {"S": src}
    else:
        bufs = {f"X{i}": np.asarray(x, np.float32).reshape([s.shape[d] for d in dims])
                for i, (x, (_, dims)) in enumerate(zip(inputs, s.pro.inputs))}
        if s.pro.plain:
            bufs["P"] = np.full(s.shape, np.nan, np.float32)
        if s.pro.colsum is not None:
            qt = s.pro.colsum[0]
            bufs["Q"] = np.full([int(x) for x in qt[qt.index("<") + 1:].split("x")[:-1]], np.nan, np.float32)
    dst = np.full([s.shape[p] for p in s.perm], np.nan, dtype=np.float32 if s.pro else src.dtype)
    bufs["D"] = dst
    gx, gy, gz = s.grid
    for bz in range(gz):
        for by in range(gy):
            for bx in range(gx):
                _kernel(_Numpy(s, bufs, (bx, by, bz)), s)
    if s.pro is None:
        return dst
    return bufs.get("P"), dst, bufs.get("Q")

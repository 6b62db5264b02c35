"""Tiled GEMM for Vortex: C[b, m, n] = init + sum_k A[b, m, k] * B[b, k, n], f32.

One CTA of TY x TX threads (sized to fit one Vortex core, so its barrier can complete) computes a
BM x BN tile of C, BM = TY * RM and BN = TX * RN:

  1. locate     block (bx, by, bz) -> tile origin (m0, n0) and batch index; thread -> (ty, tx)
  2. init       acc[i][j] = init (a fused fill) or C[m0 + ty + TY*i, n0 + tx + TX*j]
  3. for each K stage k0 = 0, BK, 2 BK, ...:
     3a. stage    As[k][m] = A[m0 + m, k0 + k], Bs[k][n] = B[k0 + k, n0 + n] in local memory,
                  every thread loads BM*BK/T and BK*BN/T elements, walking the operand's
                  contiguous dim; outside the matrix it loads 0 (clamped index + select: no branch)
     3b. barrier  the tiles are complete
     3c. multiply for k < BK: a[i] = As[k][ty + TY*i], b[j] = Bs[k][tx + TX*j],
                  acc[i][j] += a[i] * b[j]   (register blocking: RM + RN local loads per RM*RN FMAs)
     3d. barrier  everyone is done reading before the next stage overwrites the tiles
  4. store      C[m0 + ty + TY*i, n0 + tx + TX*j] = acc[i][j] inside the matrix

Thread (ty, tx) owns rows ty + TY*i and columns tx + TX*j: the threads of a warp (same ty,
consecutive tx) read one broadcast A value and consecutive B values, and store consecutive C
values. Bounds checks are emitted only where the static shape overhangs the tile; the store
guard is the only branch (the vortex target brackets it with SPLIT/JOIN).

`gemm_template` returns MLIR text: `func.func @tmpl(%A, %B, %C, %init)` holding one gpu.launch,
the form gac_torch.backends.gpu.strategy.splice_template wires into a graph. `reference` is
the math in numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GemmShape:
    """A contraction as the template sees it; dims are the op's iteration dims. Rows and
    columns may span several dims (x[b, s, :] @ w: rows (b, s), M = b * s), split last-fastest;
    a subscript None is a unit dim (constant 0)."""

    m_dims: tuple[int, ...]          # row dims (in A and C) and their extents
    m_ext: tuple[int, ...]
    n_dims: tuple[int, ...]          # column dims (in B and C)
    n_ext: tuple[int, ...]
    k: int                           # the reduction dim (in A and B)
    K: int
    batch_dims: tuple[int, ...]      # dims in A, B and C (grid z, last fastest)
    batch: tuple[int, ...]
    a_dims: tuple[int | None, ...]   # iteration dim of each subscript (the indexing maps)
    b_dims: tuple[int | None, ...]
    c_dims: tuple[int | None, ...]
    a_type: str                      # memref types, e.g. "memref<16x32xf32>"
    b_type: str
    c_type: str

    @property
    def M(self) -> int:
        return math.prod(self.m_ext)

    @property
    def N(self) -> int:
        return math.prod(self.n_ext)


@dataclass(frozen=True)
class GemmTiling:
    ty: int = 4          # thread rows of a CTA
    tx: int = 4          # thread columns
    rm: int = 4          # accumulator rows per thread
    rn: int = 4          # accumulator columns per thread
    bk: int = 16         # K depth of one local-memory stage

    @property
    def bm(self) -> int:
        return self.ty * self.rm

    @property
    def bn(self) -> int:
        return self.tx * self.rn

    @property
    def threads(self) -> int:
        return self.ty * self.tx

    def lmem_bytes(self) -> int:
        return 4 * self.bk * (self.bm + self.bn)


def choose_tiling(M: int, N: int, K: int, ty: int = 4, tx: int = 4) -> GemmTiling:
    """Register tiles no larger than the matrix needs; K staged at most 16 deep."""
    def reg(extent: int, threads: int) -> int:
        return max(1, min(4, 1 << max(0, math.ceil(math.log2(max(1, -(-extent // threads)))))))
    return GemmTiling(ty, tx, reg(M, ty), reg(N, tx), min(16, 1 << math.ceil(math.log2(max(K, 1)))))


def grid(shape: GemmShape, t: GemmTiling) -> tuple[int, int, int]:
    return (-(-shape.N // t.bn), -(-shape.M // t.bm), math.prod(shape.batch))


def gemm_template(s: GemmShape, t: GemmTiling, fused_fill: bool) -> str:
    """MLIR text of the kernel (numbered steps: module docstring). `fused_fill`: the
    accumulators start at %init instead of C's contents."""
    gx, gy, gz = grid(s, t)
    sa = f"memref<{t.bk}x{t.bm}xf32, #gpu.address_space<workgroup>>"
    sb = f"memref<{t.bk}x{t.bn}xf32, #gpu.address_space<workgroup>>"
    k = _Text()
    w, c = k.line, k.const
    batch = {d: f"%b{j}" for j, d in enumerate(s.batch_dims)}
    rows, cols = range(t.rm), range(t.rn)
    acc = [(i, j) for i in rows for j in cols]
    f32s = ", ".join(["f32"] * len(acc))

    # 1. locate
    w(f"%ty = arith.divui %tid, {c(t.tx)} : index", f"%tx = arith.remui %tid, {c(t.tx)} : index",
      f"%m0 = arith.muli %by, {c(t.bm)} : index", f"%n0 = arith.muli %bx, {c(t.bn)} : index")
    rest = "%bz"
    for j in range(len(s.batch) - 1, 0, -1):          # delinearize the batch index, last fastest
        w(f"%b{j} = arith.remui {rest}, {c(s.batch[j])} : index",
          f"%bq{j} = arith.divui {rest}, {c(s.batch[j])} : index")
        rest = f"%bq{j}"
    if s.batch:
        w(f"%b0 = arith.addi {rest}, {c(0)} : index")
    row_names = []
    for i in rows:
        w(f"%rl{i} = arith.addi %ty, {c(t.ty * i)} : index", f"%row{i} = arith.addi %m0, %rl{i} : index")
        if s.M % t.bm:      # clamped: a safe address where the tile overhangs the matrix
            w(f"%rok{i} = arith.cmpi ult, %row{i}, {c(s.M)} : index",
              f"%rowc{i} = arith.minui %row{i}, {c(s.M - 1)} : index")
        row_names.append(_split(k, s.m_dims, s.m_ext, f"%rowc{i}" if s.M % t.bm else f"%row{i}"))
    col_names = []
    for j in cols:
        w(f"%cl{j} = arith.addi %tx, {c(t.tx * j)} : index", f"%col{j} = arith.addi %n0, %cl{j} : index")
        if s.N % t.bn:
            w(f"%cok{j} = arith.cmpi ult, %col{j}, {c(s.N)} : index",
              f"%colc{j} = arith.minui %col{j}, {c(s.N - 1)} : index")
        col_names.append(_split(k, s.n_dims, s.n_ext, f"%colc{j}" if s.N % t.bn else f"%col{j}"))

    def c_at(i: int, j: int) -> str:       # stores where the tile overhangs are guarded
        return f"%C[{_subscripts(k, s.c_dims, {**batch, **row_names[i], **col_names[j]})}]"

    # 2. init
    for i, j in acc:
        w(f"%init{i}_{j} = arith.addf %init, %zero : f32" if fused_fill else
          f"%init{i}_{j} = memref.load {c_at(i, j)} : {s.c_type}")
    # 3. K stages
    w(f"%res:{len(acc)} = scf.for %k0 = {c(0)} to {c(s.K)} step {c(t.bk)} iter_args("
      + ", ".join(f"%acc{i}_{j} = %init{i}_{j}" for i, j in acc) + f") -> ({f32s}) {{")
    _stage(k, s, t, "A", sa, batch)                                         # 3a
    _stage(k, s, t, "B", sb, batch)
    w("gpu.barrier")                                                        # 3b
    w(f"%part:{len(acc)} = scf.for %kk = {c(0)} to {c(t.bk)} step {c(1)} iter_args("
      + ", ".join(f"%p{i}_{j} = %acc{i}_{j}" for i, j in acc) + f") -> ({f32s}) {{")
    w(*[f"%a{i} = memref.load %As[%kk, %rl{i}] : {sa}" for i in rows])      # 3c
    w(*[f"%bv{j} = memref.load %Bs[%kk, %cl{j}] : {sb}" for j in cols])
    w(*[f"%f{i}_{j} = math.fma %a{i}, %bv{j}, %p{i}_{j} : f32" for i, j in acc])
    w("scf.yield " + ", ".join(f"%f{i}_{j}" for i, j in acc) + f" : {f32s}", "}")
    w("gpu.barrier")                                                        # 3d
    w("scf.yield " + ", ".join(f"%part#{n}" for n in range(len(acc))) + f" : {f32s}", "}")
    # 4. store
    for n, (i, j) in enumerate(acc):
        store = f"memref.store %res#{n}, {c_at(i, j)} : {s.c_type}"
        guards = ([f"%rok{i}"] if s.M % t.bm else []) + ([f"%cok{j}"] if s.N % t.bn else [])
        if len(guards) == 2:
            w(f"%sok{i}_{j} = arith.andi %rok{i}, %cok{j} : i1")
            guards = [f"%sok{i}_{j}"]
        if guards:
            w(f"scf.if {guards[0]} {{", store, "}")
        else:
            w(store)

    head = [f"func.func @tmpl(%A: {s.a_type}, %B: {s.b_type}, %C: {s.c_type}, %init: f32) {{",
            "%one = arith.constant 1 : index", f"%gx = arith.constant {gx} : index",
            f"%gy = arith.constant {gy} : index", f"%gz = arith.constant {gz} : index",
            f"%nt = arith.constant {t.threads} : index",
            ("gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
             "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
             f"workgroup(%As : {sa}, %Bs : {sb}) {{"), "%zero = arith.constant 0.0 : f32"]
    return "\n".join(head + k.constants() + k.lines + ["gpu.terminator", "}", "return", "}"])


class _Text:
    """Kernel lines plus the index constants they use (emitted once, at the top)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._consts: dict[int, str] = {}

    def line(self, *lines: str) -> None:
        self.lines.extend(lines)

    def const(self, v: int) -> str:
        return self._consts.setdefault(v, f"%c{v}")

    def constants(self) -> list[str]:
        return [f"{name} = arith.constant {v} : index" for v, name in self._consts.items()]


def _stage(k: _Text, s: GemmShape, t: GemmTiling, which: str, tile: str,
           batch: dict[int, str]) -> None:
    """3a for one operand: tile[kk][r] = X[base + r, k0 + kk] (0 outside), T threads at a time."""
    w, c = k.line, k.const
    if which == "A":
        dims, ttype, rows, extent, base = s.a_dims, s.a_type, t.bm, s.M, "%m0"
    else:
        dims, ttype, rows, extent, base = s.b_dims, s.b_type, t.bn, s.N, "%n0"
    k_fast = dims[-1] == s.k     # consecutive threads walk the operand's contiguous dim
    size = rows * t.bk
    r_over, k_over = extent % rows != 0, s.K % t.bk != 0
    for l in range(-(-size // t.threads)):
        p = f"%{which}{l}"
        w(f"{p}e0 = arith.addi %tid, {c(l * t.threads)} : index")
        if (l + 1) * t.threads > size:   # the last round overhangs: extra threads redo the last
            w(f"{p}e = arith.minui {p}e0, {c(size - 1)} : index")   # element (same value)
        else:
            w(f"{p}e = arith.addi {p}e0, {c(0)} : index")
        if k_fast:
            w(f"{p}r = arith.divui {p}e, {c(t.bk)} : index", f"{p}k = arith.remui {p}e, {c(t.bk)} : index")
        else:
            w(f"{p}k = arith.divui {p}e, {c(rows)} : index", f"{p}r = arith.remui {p}e, {c(rows)} : index")
        w(f"{p}gr = arith.addi {base}, {p}r : index", f"{p}gk = arith.addi %k0, {p}k : index")
        oks: list[str] = []
        gr, gk = f"{p}gr", f"{p}gk"
        if r_over:
            w(f"{p}okr = arith.cmpi ult, {gr}, {c(extent)} : index",
              f"{p}grc = arith.minui {gr}, {c(extent - 1)} : index")
            oks, gr = oks + [f"{p}okr"], f"{p}grc"
        if k_over:
            w(f"{p}okk = arith.cmpi ult, {gk}, {c(s.K)} : index",
              f"{p}gkc = arith.minui {gk}, {c(s.K - 1)} : index")
            oks, gk = oks + [f"{p}okk"], f"{p}gkc"
        r_names = _split(k, s.m_dims, s.m_ext, gr) if which == "A" else _split(k, s.n_dims, s.n_ext, gr)
        names = {**batch, **r_names, s.k: gk}
        w(f"{p}x = memref.load %{which}[{_subscripts(k, dims, names)}] : {ttype}")
        v = f"{p}x"
        if oks:
            ok = oks[0]
            if len(oks) == 2:
                w(f"{p}ok = arith.andi {oks[0]}, {oks[1]} : i1")
                ok = f"{p}ok"
            w(f"{p}v = arith.select {ok}, {p}x, %zero : f32")
            v = f"{p}v"
        w(f"memref.store {v}, %{which[0]}s[{p}k, {p}r] : {tile}")


def _split(k: _Text, dims: tuple[int, ...], ext: tuple[int, ...], flat: str) -> dict[int, str]:
    """Subscripts of the flat row (or column) index `flat` in `dims` (last fastest)."""
    names, rest = {}, flat
    for d, e in zip(reversed(dims[1:]), reversed(ext[1:])):
        k.line(f"{flat}_d{d} = arith.remui {rest}, {k.const(e)} : index",
               f"{flat}_q{d} = arith.divui {rest}, {k.const(e)} : index")
        names[d], rest = f"{flat}_d{d}", f"{flat}_q{d}"
    names[dims[0]] = rest
    return names


def _subscripts(k: _Text, dims: tuple[int | None, ...], names: dict[int, str]) -> str:
    return ", ".join(k.const(0) if d is None else names[d] for d in dims)


def reference(a: np.ndarray, b: np.ndarray, init: np.ndarray | float = 0.0) -> np.ndarray:
    """The math: C = init + A @ B (batched over leading dims), accumulated in f32."""
    return (np.asarray(init, np.float32) + np.matmul(a.astype(np.float32), b.astype(np.float32))
            ).astype(np.float32)

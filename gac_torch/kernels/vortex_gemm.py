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
  4. store      C[m0 + ty + TY*i, n0 + tx + TX*j] = acc[i][j] inside the matrix; or, with an
                epilogue (gemm_epilogue.py: BatchNorm-eval, ReLU, residual add, ...), the
                elementwise consumers of C run on acc[i][j] and store their output instead

`direct` tilings skip 3a-3d: K runs as nested loops over its dims (a convolution's c, kh, kw)
and each thread reads its RM values of A and RN values of B from global memory per k (the
warp's A value is one broadcast, its B values consecutive). No index decomposition per k and
no barriers: cheaper than staging where a staged element would feed few rows (few channels).

Thread (ty, tx) owns rows ty + TY*i and columns tx + TX*j: the threads of a warp (same ty,
consecutive tx) read one broadcast A value and consecutive B values, and store consecutive C
values. Bounds checks are emitted only where the static shape overhangs the tile; the store
guard is the only branch (the vortex target brackets it with SPLIT/JOIN).

Written once (`_kernel`) against gac_torch.kernels.builder: `gemm_template` returns MLIR text,
`func.func @tmpl(%A, %B, %C, %init)` holding one gpu.launch, the form
gac_torch.backends.gpu.strategy.splice_template wires into a graph; `emulate` runs the same
body with numpy (threads in lockstep, local-memory races checked). `reference` is the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels import gemm_epilogue
from gac_torch.kernels.builder import WORKGROUP, Numpy, Smem, Text, as_type
from gac_torch.kernels.conv_gemm import Operand, _addr
from gac_torch.kernels.conv_gemm import _split as _split_flat
from gac_torch.kernels.gemm_epilogue import Epilogue


# A subscript of an operand: an iteration dim, None (a unit dim: constant 0), or a sum of
# coeff * dim terms (dim None: a constant), e.g. a convolution's input row oh * 2 + kh.
Sub = int | None | tuple[tuple[int | None, int], ...]


@dataclass(frozen=True)
class GemmShape:
    """A contraction as the template sees it; dims are the op's iteration dims. Rows, columns
    and the reduction may span several dims (x[b, s, :] @ w: rows (b, s), M = b * s; a
    convolution: K over (c, kh, kw), columns over (n, oh, ow)), split last-fastest."""

    m_dims: tuple[int, ...]          # row dims (in A and C) and their extents
    m_ext: tuple[int, ...]
    n_dims: tuple[int, ...]          # column dims (in B and C)
    n_ext: tuple[int, ...]
    k_dims: tuple[int, ...]          # reduction dims (in A and B)
    k_ext: tuple[int, ...]
    batch_dims: tuple[int, ...]      # dims in A, B and C (grid z, last fastest)
    batch: tuple[int, ...]
    a_dims: tuple[Sub, ...]          # each subscript of A, B, C (the indexing maps)
    b_dims: tuple[Sub, ...]
    c_dims: tuple[Sub, ...]
    a_type: str                      # memref types, e.g. "memref<16x32xf32>"
    b_type: str
    c_type: str
    # a fused zero padding: (subscript position, extent) of A's / B's subscripts that may fall
    # outside [0, extent) -- such elements read as 0 (clamped index + select, no branch)
    a_guard: tuple[tuple[int, int], ...] = ()
    b_guard: tuple[tuple[int, int], ...] = ()

    @property
    def M(self) -> int:
        return math.prod(self.m_ext)

    @property
    def N(self) -> int:
        return math.prod(self.n_ext)

    @property
    def K(self) -> int:
        return math.prod(self.k_ext)


@dataclass(frozen=True)
class GemmTiling:
    ty: int = 4          # thread rows of a CTA
    tx: int = 4          # thread columns
    rm: int = 4          # accumulator rows per thread
    rn: int = 4          # accumulator columns per thread
    bk: int = 16         # K depth of one local-memory stage
    direct: bool = False  # no staging: K as nested loops over its dims, operands from global memory

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
        return 0 if self.direct else 4 * self.bk * (self.bm + self.bn)


def choose_tiling(M: int, N: int, K: int, ty: int = 4, tx: int = 4, direct: bool = False) -> GemmTiling:
    """Register tiles no larger than the matrix needs; K staged at most 16 deep."""
    def reg(extent: int, threads: int) -> int:
        return max(1, min(4, 1 << max(0, math.ceil(math.log2(max(1, -(-extent // threads)))))))
    return GemmTiling(ty, tx, reg(M, ty), reg(N, tx), min(16, 1 << math.ceil(math.log2(max(K, 1)))), direct)


def grid(shape: GemmShape, t: GemmTiling) -> tuple[int, int, int]:
    return (-(-shape.N // t.bn), -(-shape.M // t.bm), math.prod(shape.batch))


@dataclass(frozen=True)
class Fused:
    """An epilogue (gemm_epilogue.Epilogue) and C's operand (dense: its address is the flat
    index of the element, linear in the iteration dims), as gemm_epilogue.store reads them."""

    epilogue: Epilogue
    c: Operand


def _kernel(b: Any, s: GemmShape, t: GemmTiling, fused_fill: bool, ep: Fused | None = None) -> None:
    c = b.const
    zero = b.zero()
    rows, cols = range(t.rm), range(t.rn)
    acc = [(i, j) for i in rows for j in cols]
    f32s = ["f32"] * len(acc)
    m_over, n_over = s.M % t.bm != 0, s.N % t.bn != 0

    # 1. locate
    tid, bx, by, bz = b.tid(), b.bid(0), b.bid(1), b.bid(2)
    ty, tx = tid // t.tx, tid % t.tx
    m0, n0 = by * t.bm, bx * t.bn
    batch: dict[int, Any] = {}
    rest = bz
    for j in range(len(s.batch) - 1, 0, -1):          # delinearize the batch index, last fastest
        batch[s.batch_dims[j]] = rest % s.batch[j]
        rest = rest // s.batch[j]
    if s.batch:
        batch[s.batch_dims[0]] = rest
    rl, rok, row_names = [], [], []
    for i in rows:
        rl.append(ty + t.ty * i)
        row = m0 + rl[i]
        if m_over:      # clamped: a safe address where the tile overhangs the matrix
            rok.append(row < s.M)
            row = b.min_(row, c(s.M - 1))
        row_names.append(_split(b, s.m_dims, s.m_ext, row))
    cl, cok, col_names = [], [], []
    for j in cols:
        cl.append(tx + t.tx * j)
        col = n0 + cl[j]
        if n_over:
            cok.append(col < s.N)
            col = b.min_(col, c(s.N - 1))
        col_names.append(_split(b, s.n_dims, s.n_ext, col))

    def c_at(i: int, j: int) -> list[Any]:       # stores where the tile overhangs are guarded
        return _subscripts(b, s.c_dims, {**batch, **row_names[i], **col_names[j]})

    # 2. init
    inits = [b.addf(b.init(), zero) if fused_fill else b.get("C", c_at(i, j)) for i, j in acc]

    # 3. K stages
    def stage_k(k0: Any, accs: list[Any]) -> list[Any]:
        _stage(b, s, t, "A", k0, m0, batch, zero)                              # 3a
        _stage(b, s, t, "B", k0, n0, batch, zero)
        b.barrier()                                                             # 3b

        def multiply(kk: Any, part: list[Any]) -> list[Any]:                    # 3c
            a = [b.get("As", [kk, rl[i]]) for i in rows]
            w = [b.get("Bs", [kk, cl[j]]) for j in cols]
            return [b.fma(a[i], w[j], part[n], "f32") for n, (i, j) in enumerate(acc)]

        part = b.for_(c(0), c(t.bk), c(1), accs, f32s, multiply)
        b.barrier()                                                             # 3d
        return part

    # K dims a padding guard reads go outermost: the guards and clamped addresses are then
    # loop-invariant in the inner loops (a conv: (kh, kw) outside, c inside)
    guarded = sub_dims([s.a_dims[p] for p, _ in s.a_guard] + [s.b_dims[p] for p, _ in s.b_guard])
    k_order = sorted(range(len(s.k_dims)), key=lambda l: s.k_dims[l] not in guarded)

    def nest(level: int, k_names: dict[int, Any], accs: list[Any]) -> list[Any]:    # 3' direct
        if level == len(s.k_dims):
            a = [_load(b, "A", _subscripts(b, s.a_dims, {**batch, **a_rows[i], **k_names}), s.a_guard, zero)
                 for i in rows]
            w = [_load(b, "B", _subscripts(b, s.b_dims, {**batch, **b_cols[j], **k_names}), s.b_guard, zero)
                 for j in cols]
            return [b.fma(a[i], w[j], accs[n], "f32") for n, (i, j) in enumerate(acc)]
        at = k_order[level]
        return b.for_(c(0), c(s.k_ext[at]), c(1), accs, f32s,
                      lambda kv, part: nest(level + 1, {**k_names, s.k_dims[at]: kv}, part))

    if t.direct:   # clamped rows/columns: loads stay inside the operands where the tile overhangs
        a_rows, b_cols = row_names, col_names
        res = nest(0, {}, inits)
    else:
        res = b.for_(c(0), c(s.K), c(t.bk), inits, f32s, stage_k)
    # 4. store
    for n, (i, j) in enumerate(acc):
        guards = ([rok[i]] if m_over else []) + ([cok[j]] if n_over else [])
        if len(guards) == 2:
            guards = [guards[0] & guards[1]]
        if ep is not None:   # through the elementwise consumers (gemm_epilogue's steps 1-5)
            names = {**batch, **row_names[i], **col_names[j]}
            dims = tuple(names)
            addr = _addr(b, ep.c, names, dims, c(ep.c.const))
            gemm_epilogue.store(b, ep, addr, res[n], guards[0] if guards else b.true(), _split_flat, _addr,
                                lambda op, names=names, dims=dims: _addr(b, op, names, dims, c(op.const)))
            continue
        store = (lambda i=i, j=j, n=n: b.put("C", c_at(i, j), res[n]))
        if guards:
            b.when(guards[0], store)
        else:
            store()


def _stage(b: Any, s: GemmShape, t: GemmTiling, which: str, k0: Any, base: Any,
           batch: dict[int, Any], zero: Any) -> None:
    """3a for one operand: tile[kk][r] = X[base + r, k0 + kk] (0 outside), T threads at a time."""
    c = b.const
    if which == "A":
        dims, rows, extent = s.a_dims, t.bm, s.M
    else:
        dims, rows, extent = s.b_dims, t.bn, s.N
    k_fast = dims[-1] == s.k_dims[-1]   # consecutive threads walk the operand's contiguous dim
    size = rows * t.bk
    r_over, k_over = extent % rows != 0, s.K % t.bk != 0
    tid = b.tid()
    for l in range(-(-size // t.threads)):
        e = tid + l * t.threads
        if (l + 1) * t.threads > size:   # the last round overhangs: extra threads redo the last
            e = b.min_(e, c(size - 1))   # element (same value)
        if k_fast:
            r, k = e // t.bk, e % t.bk
        else:
            k, r = e // rows, e % rows
        gr, gk = base + r, k0 + k
        oks = []
        if r_over:
            oks.append(gr < extent)
            gr = b.min_(gr, c(extent - 1))
        if k_over:
            oks.append(gk < s.K)
            gk = b.min_(gk, c(s.K - 1))
        r_names = _split(b, s.m_dims, s.m_ext, gr) if which == "A" else _split(b, s.n_dims, s.n_ext, gr)
        k_names = _split(b, s.k_dims, s.k_ext, gk)
        v = _load(b, which, _subscripts(b, dims, {**batch, **r_names, **k_names}),
                  s.a_guard if which == "A" else s.b_guard, zero)
        if oks:
            v = b.select(oks[0] & oks[1] if len(oks) == 2 else oks[0], v, zero, "f32")
        b.put(which + "s", [k, r], v)


def _load(b: Any, which: str, subs: list[Any], guard: tuple[tuple[int, int], ...], zero: Any) -> Any:
    """which[subs]; a guarded subscript outside [0, extent) (unsigned compare: a negative one
    too) reads 0 from a clamped, safe address."""
    ok = None
    for pos, extent in guard:
        p = subs[pos]
        inside = b.lt(p, b.const(extent))
        ok = inside if ok is None else b.and_(ok, inside)
        subs[pos] = b.min_(p, b.const(extent - 1))
    v = b.get(which, subs)
    return v if ok is None else b.zero_unless(ok, v)


def sub_dims(subs: list[Sub]) -> set[int]:
    """The iteration dims some subscript reads."""
    return {d for x in subs if x is not None
            for d in ((x,) if isinstance(x, int) else (dd for dd, _ in x if dd is not None))}


def _split(b: Any, dims: tuple[int, ...], ext: tuple[int, ...], flat: Any) -> dict[int, Any]:
    """Subscripts of the flat row (or column) index `flat` in `dims` (last fastest)."""
    names, rest = {}, flat
    for d, e in zip(reversed(dims[1:]), reversed(ext[1:])):
        names[d], rest = rest % e, rest // e
    names[dims[0]] = rest
    return names


def _subscripts(b: Any, dims: tuple[Sub, ...], names: dict[int, Any]) -> list[Any]:
    def one(d: Sub) -> Any:
        if d is None:
            return b.const(0)
        if isinstance(d, int):
            return names[d]
        v = None
        for dim, coeff in d:
            t = b.const(coeff) if dim is None else names[dim] if coeff == 1 else names[dim] * coeff
            v = t if v is None else v + t
        return v
    return [one(d) for d in dims]


# --------------------------------------------------------------------------------------------
# builder 1: MLIR text (constants hoisted to the top of the kernel)


class _Text(gemm_epilogue.TextMixin, Text):
    def __init__(self, s: GemmShape, t: GemmTiling, ep: Fused | None = None):
        super().__init__(hoist=True)
        self.spec = ep
        self.types = {"A": s.a_type, "B": s.b_type, "C": s.c_type,
                      "As": f"memref<{t.bk}x{t.bm}xf32, {WORKGROUP}>",
                      "Bs": f"memref<{t.bk}x{t.bn}xf32, {WORKGROUP}>"}

    def zero(self) -> str:
        return self.val("%zero")

    def init(self) -> str:
        return self.val("%init")

    def addf(self, x: str, y: str) -> str:
        return self.binop("arith.addf", x, y, "f32")

    def zero_unless(self, ok: str, v: str) -> str:
        """ok ? v : 0.0 on the bits (an integer load and one czero; a float select would
        round-trip through the integer registers)."""
        bits = self.cast("arith.bitcast", v, "f32", "i32")
        return self.cast("arith.bitcast", self.select(ok, bits, self.const(0, "i32"), "i32"), "i32", "f32")


def _extra(ep: Fused | None) -> list[tuple[str, Operand]]:
    """The epilogue's buffers as template arguments: its other inputs E<k>, its output Z."""
    if ep is None:
        return []
    e = ep.epilogue
    return [(f"E{k}", x[0]) for k, x in enumerate(e.inputs) if x is not None] + [("Z", e.out[0])]


def gemm_template(s: GemmShape, t: GemmTiling, fused_fill: bool, ep: Fused | None = None) -> str:
    """MLIR text of the kernel (numbered steps: module docstring). `fused_fill`: the
    accumulators start at %init instead of C's contents. `ep`: C's consumers run in the store
    step; the template then takes their buffers (E<k>..., Z) after %C."""
    b = _Text(s, t, ep)
    _kernel(b, s, t, fused_fill, ep)
    wg = "" if t.direct else f"workgroup(%As : {b.types['As']}, %Bs : {b.types['Bs']}) "
    head = template_head(s, grid(s, t), t.threads, ep, wg) + ["%zero = arith.constant 0.0 : f32"]
    return "\n".join(head + b.const_lines + b.lines + ["gpu.terminator", "}", "return", "}"])


def template_head(s: GemmShape, grid: tuple[int, int, int], threads: int, ep: Fused | None,
                  workgroup: str = "") -> list[str]:
    """`func.func @tmpl(%A, %B, %C, [E<k>..., Z,] %init)` up to the opened gpu.launch of `grid`
    x `threads` (1-D), with the epilogue's buffers' flat views (%E<k>f, %Zf)."""
    extra = _extra(ep)
    flat = [f"%{n}f = memref.reinterpret_cast %{n} to offset: [{op.offset}], sizes: [{op.span}], "
            f"strides: [1] : {op.type} to {op.flat}" for n, op in extra]
    gx, gy, gz = grid
    return [f"func.func @tmpl(%A: {s.a_type}, %B: {s.b_type}, %C: {s.c_type}, "
            + "".join(f"%{n}: {op.type}, " for n, op in extra) + "%init: f32) {",
            "%one = arith.constant 1 : index", f"%gx = arith.constant {gx} : index",
            f"%gy = arith.constant {gy} : index", f"%gz = arith.constant {gz} : index",
            f"%nt = arith.constant {threads} : index",
            "gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
            f"threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) {workgroup}{{", *flat]


# --------------------------------------------------------------------------------------------
# builder 2: numpy, one CTA at a time, threads in lockstep


class _Numpy(gemm_epilogue.NumpyMixin, Numpy):
    def __init__(self, t: GemmTiling, bufs: dict[str, np.ndarray], init: float,
                 block: tuple[int, int, int], ep: Fused | None = None):
        super().__init__(t.threads, block)
        self.bufs, self.initv, self.spec = bufs, init, ep
        self.E = {k: bufs[f"E{k}"].reshape(-1) for k in range(len(ep.epilogue.inputs)) if f"E{k}" in bufs} if ep else {}
        self.Z = bufs["Z"].reshape(-1) if ep else None
        self.S = {"As": Smem("As", (t.bk, t.bm)), "Bs": Smem("Bs", (t.bk, t.bn))}

    def zero(self) -> np.ndarray:
        return self.const(0.0, "f32")

    def init(self) -> np.ndarray:
        return self.const(self.initv, "f32")

    def addf(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return as_type(x + y, "f32")

    def true(self) -> np.ndarray:
        return np.ones(self.T, dtype=bool)

    def zero_unless(self, ok: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.where(ok, v, np.float32(0)).astype(np.float32)

    # index compares and minimums are unsigned, as the text's (a padding's negative subscripts)
    def lt(self, x: Any, y: Any) -> np.ndarray:
        return np.asarray(x).astype(np.uint64) < np.asarray(y).astype(np.uint64)

    def min_(self, x: Any, y: Any) -> np.ndarray:
        return np.minimum(np.asarray(x).astype(np.uint64), np.asarray(y).astype(np.uint64)).astype(np.int64)

    def smem_store(self, s: Smem, idx: list[np.ndarray], val: np.ndarray, vec: int = 1) -> None:
        # The last staging round's extra threads redo the last element with the same value:
        # one writer per element is checked, the copies are dropped.
        flat = np.ravel_multi_index(tuple(np.asarray(x) for x in idx), s.data.shape)
        keep = np.zeros(self.T, dtype=bool)
        keep[np.unique(flat, return_index=True)[1]] = True
        (at,) = self.touch(s, idx, 1, True, lanes=keep)
        s.data[at] = np.asarray(val)[keep]


def emulate(s: GemmShape, t: GemmTiling, A: np.ndarray, B: np.ndarray, C: np.ndarray,
            init: float | None = None, ep: Fused | None = None,
            extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Run the kernel on the CPU (A, B, C shaped like the memrefs, f32); `init`: a fused fill's
    value (else C is accumulated onto). Returns the new C, or with an epilogue `ep` the new Z
    (`extra`: its buffers by template name, E<k> and Z, flat from the operands' offsets).
    Raises RaceError on a local-memory race."""
    bufs = {"A": np.asarray(A, np.float32), "B": np.asarray(B, np.float32), "C": np.array(C, np.float32)}
    bufs.update({k: np.array(v, np.float32) for k, v in (extra or {}).items()})
    gx, gy, gz = grid(s, t)
    for bz in range(gz):
        for by in range(gy):
            for bx in range(gx):
                _kernel(_Numpy(t, bufs, 0.0 if init is None else init, (bx, by, bz), ep), s, t, init is not None, ep)
    return bufs["Z"] if ep is not None else bufs["C"]


def reference(a: np.ndarray, b: np.ndarray, init: np.ndarray | float = 0.0) -> np.ndarray:
    """The math: C = init + A @ B (batched over leading dims), accumulated in f32."""
    return (np.asarray(init, np.float32) + np.matmul(a.astype(np.float32), b.astype(np.float32))
            ).astype(np.float32)

"""Tensor-core GEMM for the cuda target: C[b, m, n] = init + sum_k A[b, m, k] * B[b, k, n] with
warp-level `mma.sync` (sm_80+), f32 accumulation.

  kinds   f16 x f16 and bf16 x bf16: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{..}.f32
          f32 x f32 when TF32 is allowed: operands rounded to tf32 (cvt.rna), m16n8k8 .tf32
  output  f32, f16 or bf16 (rounded once from the f32 accumulators)

One CTA of WARPS_M x WARPS_N warps computes a BM x BN tile of C; warp (wm, wn) owns a
(MT*16) x (NT*8) sub-tile: MT x NT mma tiles, 4 f32 accumulators per lane each.

  1. locate     block (bx, by, bz) -> tile origin (m0 = by*BM, n0 = bx*BN), batch index from bz;
                thread -> warp (wm, wn), lane -> (g = lane / 4, t = lane % 4)
  2. init       accumulators = the fused fill's value, or C at the accumulator's fragment
                coordinates (0 outside the matrix)
  3. prologue   stage K slice 0 of A and B into shared-memory buffer 0 (3a + 3d), barrier
  4. for each K slice kt (BK deep), double-buffered:
     4a. prefetch  global loads of slice kt+1 into registers: every thread loads whole vectors
                   (up to 16 bytes) along the operand's contiguous dim; vectors outside the
                   matrix (M, N or K overhang) are zero and not loaded
     4b. fragments for each k-step (16 deep for f16/bf16, 8 for tf32) and mma tile, the lane's
                   fragment registers are read from buffer kt%2 (FRAG_A / FRAG_B below; a 32-bit
                   load when k is the smem tile's contiguous dim, else two 16-bit loads)
     4c. mma       acc[i][j] = mma.sync(A frag i, B frag j, acc[i][j])
     4d. stage     the prefetched registers go to buffer (kt+1)%2 (tf32: rounded with cvt.rna
                   first), in the operand's own layout: [rows][BK + pad] when k is contiguous,
                   [BK][cols + pad] otherwise; the pads make the fragment loads conflict-free
     4e. barrier   one per slice: buffer (kt+1)%2 is complete, and every warp is done with
                   buffer kt%2 before slice kt+1 overwrites it
  5. store      each accumulator to C at its fragment coordinates (FRAG_C), rounded to C's
                type, inside the matrix only

The kernel body is written once (`kernel`) against a small builder interface with two
implementations: `MmaText` emits the MLIR (`template`, a `func.func @tmpl(%A, %B, %C, %init)`
holding one gpu.launch, the form backends/gpu/strategy.splice_template splices into a graph) and
`MmaNumpy` (cuda_mma_twin.py) executes it on the CPU, all threads of a block in lockstep, emulating mma.sync from the
same fragment tables and checking every shared-memory access against the barriers (a read or
write of an element another thread wrote or read since the last barrier is a race). `emulate`
runs a whole grid that way; the tests compare it with numpy's matmul.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


from gac_torch.kernels.builder import WORKGROUP, Text

# --- fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / mma.m16n8k8") ----------
# Lane l holds g = l // 4 (groupID) and t = l % 4 (threadID_in_group).
# f16/bf16 m16n8k16, A (16x16, row): register e holds the pair (row g + r, cols 2t + c, +1).
FRAG_A16 = ((0, 0), (8, 0), (0, 8), (8, 8))
# B (16x8, col): register e holds the pair (k rows 2t + k, +1; column g).
FRAG_B16 = (0, 8)
# tf32 m16n8k8, A (16x8): register e holds (row g + r, col t + c); B (8x8): (k row t + k, col g).
FRAG_A8 = ((0, 0), (8, 0), (0, 4), (8, 4))
FRAG_B8 = (0, 4)
# f32 accumulator (16x8) of both: value q is at (row g + r, col 2t + c).
FRAG_C = ((0, 0), (0, 1), (8, 0), (8, 1))

KINDS = ("f16", "bf16", "tf32")
_ESIZE = {"f16": 2, "bf16": 2, "f32": 4}
SM_COUNT_HINT = 132  # H200; the big tile is used once it still gives about one wave


@dataclass(frozen=True)
class Operand:
    """A buffer as the kernel sees it: memref type text, element type, the iteration dim of
    each memref dim (outermost first), static shape, strides and offset (elements)."""

    type: str
    elem: str
    dims: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Spec:
    kind: str  # f16 | bf16 | tf32
    m: int  # iteration dims
    n: int
    k: int
    batch: tuple[int, ...]
    ranges: tuple[int, ...]  # every iteration dim's extent
    a: Operand
    b: Operand
    c: Operand
    fill: bool  # accumulators start from %init (a fused fill) instead of C

    @property
    def M(self) -> int:
        return self.ranges[self.m]

    @property
    def N(self) -> int:
        return self.ranges[self.n]

    @property
    def K(self) -> int:
        return self.ranges[self.k]

    @property
    def batch_ext(self) -> tuple[int, ...]:
        return tuple(self.ranges[d] for d in self.batch)


@dataclass(frozen=True)
class Staging:
    """How one operand's BK-deep slice is staged: smem tile [rows][cols + pad] per buffer."""

    k_contig: bool  # k is the operand's contiguous dim (else its m or n dim is)
    rows: int
    cols: int
    pad: int
    vec: int  # elements per global load
    per_thread: int  # vector loads per thread per slice


class WarpTiling:
    """A block of warps_m x warps_n warps over a bm x bn tile of m16n8 mma fragments: the
    threads, and the fragments per warp along M (mt) and N (nt)."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def mt(self) -> int:
        return self.bm // self.warps_m // 16

    @property
    def nt(self) -> int:
        return self.bn // self.warps_n // 8


@dataclass(frozen=True)
class Plan(WarpTiling):
    bm: int
    bn: int
    bk: int
    ks: int  # k per mma
    warps_m: int
    warps_n: int
    a: Staging
    b: Staging
    grid: tuple[int, int, int]



def mma_kind(ea: str, eb: str, ec: str, casts_ok: bool, allow_tf32: bool) -> str | None:
    """The mma flavour for operand/result element types, or None (SIMT path)."""
    if not casts_ok or ec not in ("f32", "f16", "bf16"):
        return None
    if ea == eb and ea in ("f16", "bf16"):
        return ea
    if ea == eb == ec == "f32" and allow_tf32:
        return "tf32"
    return None


def elem_of(spec: Spec) -> str:
    return "f32" if spec.kind == "tf32" else spec.kind


def _staging(op: Operand, outer: int, k: int, tile_outer: int, bk: int, threads: int,
             ext_outer: int, ext_k: int) -> Staging | None:
    if op.strides[-1] != 1:
        return None
    inner = op.dims[-1]
    if inner == k:
        rows, cols, ext_c = tile_outer, bk, ext_k
    elif inner == outer:
        rows, cols, ext_c = bk, tile_outer, ext_outer
    else:
        return None
    es = _ESIZE[op.elem]
    # pads: the fragment loads of 8 groups (k contiguous) or 4 k-rows (outer contiguous) hit
    # distinct banks, and rows stay 16-byte aligned for the staging stores
    if inner == k:
        pad = 8 if es == 2 else 4
    else:
        pad = 8
    vec = 1
    for v in ((8, 4, 2) if es == 2 else (4, 2)):
        if (ext_c % v == 0 and op.offset % v == 0 and all(s % v == 0 for s in op.strides[:-1])
                and cols % v == 0 and (rows * cols // v) % threads == 0):
            vec = v
            break
    if (rows * cols // vec) % threads:
        return None
    return Staging(inner == k, rows, cols, pad, vec, rows * cols // vec // threads)


def plan(spec: Spec, max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535),
         smem_limit: int = 48 * 1024, big: bool | None = None) -> Plan | None:
    """Tiling for `spec`, or None when the template does not apply. `big` forces the
    128x128 (8 warps) or 64x64 (4 warps) block tile; by default the big one is used once it
    still makes about a wave of blocks."""
    if spec.kind not in KINDS or spec.K == 0 or spec.M == 0 or spec.N == 0:
        return None
    if spec.a.elem != elem_of(spec) or spec.b.elem != elem_of(spec):
        return None
    batch = math.prod(spec.batch_ext)
    if big is None:
        big = -(-spec.M // 128) * -(-spec.N // 128) * batch >= SM_COUNT_HINT
    bm, bn, wm, wn = (128, 128, 2, 4) if big else (64, 64, 2, 2)
    bk, ks = (16, 8) if spec.kind == "tf32" else (32, 16)
    threads = 32 * wm * wn
    sa = _staging(spec.a, spec.m, spec.k, bm, bk, threads, spec.M, spec.K)
    sb = _staging(spec.b, spec.n, spec.k, bn, bk, threads, spec.N, spec.K)
    if sa is None or sb is None:
        return None
    grid = (-(-spec.N // bn), -(-spec.M // bm), batch)
    if any(x > lim for x, lim in zip(grid, max_grid)):
        return None
    p = Plan(bm, bn, bk, ks, wm, wn, sa, sb, grid)
    if smem_bytes(p, spec) > smem_limit:
        return None
    return p


def smem_bytes(p: Plan, spec: Spec) -> int:
    es = _ESIZE[elem_of(spec)]
    return sum(2 * s.rows * (s.cols + s.pad) * es for s in (p.a, p.b))


# --------------------------------------------------------------------------------------------
# the kernel, once, against a builder


def kernel(b: Any, spec: Spec, p: Plan) -> None:
    T, BM, BN, BK, KS = p.threads, p.bm, p.bn, p.bk, p.ks
    tf32 = spec.kind == "tf32"
    c = b.const
    # 1. locate
    tid = b.tid()
    bx, by, bz = b.bid(0), b.bid(1), b.bid(2)
    warp, lane = b.div(tid, c(32)), b.rem(tid, c(32))
    g, t = b.div(lane, c(4)), b.rem(lane, c(4))
    wm, wn = b.div(warp, c(p.warps_n)), b.rem(warp, c(p.warps_n))
    m0, n0 = b.mul(by, c(BM)), b.mul(bx, c(BN))
    names: dict[int, Any] = {}
    rest = bz
    for j in range(len(spec.batch) - 1, -1, -1):  # batch index, last fastest
        ext = spec.batch_ext[j]
        names[spec.batch[j]] = rest if j == 0 else b.rem(rest, c(ext))
        if j:
            rest = b.div(rest, c(ext))
    wrow = b.mul(wm, c(p.mt * 16))  # the warp's sub-tile inside the block tile
    wcol = b.mul(wn, c(p.nt * 8))

    def gidx(op: Operand, at: dict[int, Any]) -> list[Any]:
        return [at[d] if d in at else names[d] for d in op.dims]

    # 3a / 4a: a slice's global loads
    def load_slice(which: str, kbase: Any) -> list[Any]:
        op, st = (spec.a, p.a) if which == "A" else (spec.b, p.b)
        outer, o0, ext_o = (spec.m, m0, spec.M) if which == "A" else (spec.n, n0, spec.N)
        vals = []
        per_row = st.cols // st.vec
        for i in range(st.per_thread):
            v = b.add(tid, c(i * T))
            r, col = b.div(v, c(per_row)), b.mul(b.rem(v, c(per_row)), c(st.vec))
            if st.k_contig:
                oi, ki = b.add(o0, r), b.add(kbase, col)
            else:
                ki, oi = b.add(kbase, r), b.add(o0, col)
            ok = b.and_(b.lt(oi, c(ext_o)), b.lt(ki, c(spec.K)))
            vals.append(b.load_global(which, gidx(op, {outer: oi, spec.k: ki}), st.vec, ok))
        return vals

    # 3d / 4d: stage registers into a buffer
    def stage(which: str, buf: Any, vals: list[Any]) -> None:
        st = p.a if which == "A" else p.b
        per_row = st.cols // st.vec
        for i, val in enumerate(vals):
            v = b.add(tid, c(i * T))
            r, col = b.div(v, c(per_row)), b.mul(b.rem(v, c(per_row)), c(st.vec))
            if tf32:
                val = b.round_tf32(val, st.vec)
            b.store_smem(which, [buf, r, col], val, st.vec)

    # 2. init
    if spec.fill:
        init = b.init_f32()
        accs = [init] * (p.mt * p.nt * 4)
    else:
        accs = []
        for i in range(p.mt):
            for j in range(p.nt):
                for rq, cq in FRAG_C:
                    row = b.add(m0, b.add(wrow, b.add(g, c(i * 16 + rq))))
                    col = b.add(n0, b.add(wcol, b.add(b.mul(t, c(2)), c(j * 8 + cq))))
                    ok = b.and_(b.lt(row, c(spec.M)), b.lt(col, c(spec.N)))
                    accs.append(b.load_c(gidx(spec.c, {spec.m: row, spec.n: col}), ok))

    # 3. prologue
    zero = c(0)
    stage("A", zero, load_slice("A", zero))
    stage("B", zero, load_slice("B", zero))
    b.barrier()

    def frag_a(buf: Any, k0: int, i: int) -> list[Any]:
        regs = []
        for r, cc in (FRAG_A8 if tf32 else FRAG_A16):
            row = b.add(wrow, b.add(g, c(i * 16 + r)))
            col = b.add(t, c(k0 + cc)) if tf32 else b.add(b.mul(t, c(2)), c(k0 + cc))
            regs.append(frag_load("A", buf, row, col, not tf32))
        return regs

    def frag_b(buf: Any, k0: int, j: int) -> list[Any]:
        regs = []
        n = b.add(wcol, b.add(g, c(j * 8)))
        for kk in (FRAG_B8 if tf32 else FRAG_B16):
            k = b.add(t, c(k0 + kk)) if tf32 else b.add(b.mul(t, c(2)), c(k0 + kk))
            regs.append(frag_load("B", buf, n, k, not tf32))
        return regs

    def frag_load(which: str, buf: Any, outer: Any, k: Any, pair: bool) -> Any:
        st = p.a if which == "A" else p.b
        if st.k_contig:  # smem [outer][k]
            return b.load_smem(which, [buf, outer, k], 2 if pair else 1)
        if not pair:  # smem [k][outer]
            return b.load_smem(which, [buf, k, outer], 1)
        lo = b.load_smem(which, [buf, k, outer], 1)
        hi = b.load_smem(which, [buf, b.add(k, c(1)), outer], 1)
        return b.pack(lo, hi)

    # 4. K slices
    nk = -(-spec.K // BK)

    def body(kt: Any, accs: list[Any]) -> list[Any]:
        buf = b.rem(kt, c(2))
        nbuf = b.sub(c(1), buf)
        kn = b.mul(b.add(kt, c(1)), c(BK))
        next_a, next_b = load_slice("A", kn), load_slice("B", kn)
        accs = list(accs)
        for s in range(BK // KS):
            fa = [frag_a(buf, s * KS, i) for i in range(p.mt)]
            fb = [frag_b(buf, s * KS, j) for j in range(p.nt)]
            for i in range(p.mt):
                for j in range(p.nt):
                    at = (i * p.nt + j) * 4
                    accs[at:at + 4] = b.mma(spec.kind, fa[i], fb[j], accs[at:at + 4])
        stage("A", nbuf, next_a)
        stage("B", nbuf, next_b)
        b.barrier()
        return accs

    accs = b.loop(nk, accs, body)

    # 5. store
    for i in range(p.mt):
        for j in range(p.nt):
            for q, (rq, cq) in enumerate(FRAG_C):
                row = b.add(m0, b.add(wrow, b.add(g, c(i * 16 + rq))))
                col = b.add(n0, b.add(wcol, b.add(b.mul(t, c(2)), c(j * 8 + cq))))
                ok = b.and_(b.lt(row, c(spec.M)), b.lt(col, c(spec.N)))
                b.store_c(gidx(spec.c, {spec.m: row, spec.n: col}), accs[(i * p.nt + j) * 4 + q], ok)


# --------------------------------------------------------------------------------------------
# builder 1: MLIR text


_WG = WORKGROUP
_MMA_SHAPE = {"f16": (16, 8, 16), "bf16": (16, 8, 16), "tf32": (16, 8, 8)}


class MmaText(Text):
    def __init__(self, spec: Spec, p: Plan):
        super().__init__()
        self.spec, self.p = spec, p
        self.e = elem_of(spec)
        es = {"A": p.a, "B": p.b}
        self.smem = {w: f"memref<2x{s.rows}x{s.cols + s.pad}x{self.e}, {_WG}>" for w, s in es.items()}

    def load_global(self, which: str, idx: list[str], vec: int, ok: str) -> str:
        op = self.spec.a if which == "A" else self.spec.b
        vt = f"vector<{vec}x{op.elem}>"
        r, z = self.fresh(), self.fresh()
        zero = "0.0"
        self.w(f"{r} = scf.if {ok} -> ({vt}) {{")
        self.w(f"  %ld{self.n} = vector.load %{which}[{', '.join(idx)}] {{alignment = {vec * _ESIZE[op.elem]}}}"
               f" : {op.type}, {vt}")
        self.w(f"  scf.yield %ld{self.n} : {vt}\n}} else {{")
        self.w(f"  {z} = arith.constant dense<{zero}> : {vt}\n  scf.yield {z} : {vt}\n}}")
        return r

    # --- shared verb (conv_gemm_text; flash_attention_text has its own copy) ------------------
    def ldmatrix_at(self, buf: str, buf_type: str, byte_off: str, num: int, trans: bool, elem: str) -> list[str]:
        """ldmatrix.sync.aligned.m8n8.x{num}[.trans].b16 with this lane's row at `byte_off`
        bytes into shared buffer `buf`; num registers as vector<2 x elem>."""
        base, a, i, ptr, r = (self.fresh() for _ in range(5))
        self.w(f"{base} = memref.extract_aligned_pointer_as_index {buf} : {buf_type} -> index")
        self.w(f"{a} = arith.addi {base}, {byte_off} : index\n{i} = arith.index_cast {a} : index to i64")
        self.w(f"{ptr} = llvm.inttoptr {i} : i64 to !llvm.ptr<3>")
        rt = "i32" if num == 1 else f"!llvm.struct<({', '.join(['i32'] * num)})>"
        self.w(f"{r} = nvvm.ldmatrix {ptr} {{num = {num} : i32, layout = #nvvm.mma_layout<{'col' if trans else 'row'}>, "
               "shape = #nvvm.ld_st_matrix_shape<m = 8, n = 8>, eltType = #nvvm.ld_st_matrix_elt_type<b16>} "
               f": (!llvm.ptr<3>) -> {rt}")
        out = []
        for h in range(num):
            x, y = self.fresh(), self.fresh()
            self.w(f"{x} = llvm.extractvalue {r}[{h}] : {rt}\n{y} = llvm.bitcast {x} : i32 to vector<2x{elem}>")
            out.append(y)
        return out
    # --------------------------------------------------------------------------------------------

    def round_tf32(self, val: str, vec: int) -> str:
        parts = []
        for i in range(vec):
            x, q, f = self.fresh(), self.fresh(), self.fresh()
            self.w(f"{x} = vector.extract {val}[{i}] : f32 from vector<{vec}xf32>")
            self.w(f"{q} = nvvm.convert.float.to.tf32 {x} {{rnd = #nvvm.fp_rnd_mode<rna>}}")
            self.w(f"{f} = arith.bitcast {q} : i32 to f32")
            parts.append(f)
        r = self.fresh()
        self.w(f"{r} = vector.from_elements {', '.join(parts)} : vector<{vec}xf32>")
        return r

    def store_smem(self, which: str, idx: list[str], val: str, vec: int) -> None:
        self.w(f"vector.store {val}, %S{which}[{', '.join(idx)}] {{alignment = {vec * _ESIZE[self.e]}}}"
               f" : {self.smem[which]}, vector<{vec}x{self.e}>")

    def load_smem(self, which: str, idx: list[str], vec: int) -> str:
        r = self.fresh()
        if vec == 1:
            self.w(f"{r} = memref.load %S{which}[{', '.join(idx)}] : {self.smem[which]}")
        else:
            self.w(f"{r} = vector.load %S{which}[{', '.join(idx)}] {{alignment = {vec * _ESIZE[self.e]}}}"
                   f" : {self.smem[which]}, vector<{vec}x{self.e}>")
        return r

    def pack(self, lo: str, hi: str) -> str:
        r = self.fresh()
        self.w(f"{r} = vector.from_elements {lo}, {hi} : vector<2x{self.e}>")
        return r

    def _operand(self, kind: str, reg: str) -> str:
        if kind == "f16":
            return reg  # vector<2xf16>
        r = self.fresh()
        if kind == "bf16":
            v = self.fresh()
            self.w(f"{v} = vector.bitcast {reg} : vector<2xbf16> to vector<1xi32>")
            self.w(f"{r} = vector.extract {v}[0] : i32 from vector<1xi32>")
        else:
            self.w(f"{r} = arith.bitcast {reg} : f32 to i32")
        return r

    def mma(self, kind: str, a: list[str], bregs: list[str], acc: list[str]) -> list[str]:
        m, n, k = _MMA_SHAPE[kind]
        ao = [self._operand(kind, x) for x in a]
        bo = [self._operand(kind, x) for x in bregs]
        ot = "vector<2xf16>" if kind == "f16" else "i32"
        types = f", multiplicandAPtxType = #nvvm.mma_type<{kind}>, multiplicandBPtxType = #nvvm.mma_type<{kind}>"
        d = self.fresh()
        self.w(f"{d} = nvvm.mma.sync A[{', '.join(ao)}] B[{', '.join(bo)}] C[{', '.join(acc)}] "
               f"{{layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>{types}, "
               f"shape = #nvvm.shape<m = {m}, n = {n}, k = {k}>}} : ({ot}, {ot}, f32) -> "
               "!llvm.struct<(f32, f32, f32, f32)>")
        out = []
        for q in range(4):
            r = self.fresh()
            self.w(f"{r} = llvm.extractvalue {d}[{q}] : !llvm.struct<(f32, f32, f32, f32)>")
            out.append(r)
        return out

    def _to_f32(self, x: str, ty: str) -> str:
        if ty == "f32":
            return x
        r = self.fresh()
        self.w(f"{r} = arith.extf {x} : {ty} to f32")
        return r

    def init_f32(self) -> str:
        return self._to_f32("%init", self.spec.c.elem)

    def load_c(self, idx: list[str], ok: str) -> str:
        return self.load_c_at("%C", ", ".join(idx), self.spec.c.type, ok)

    def store_c(self, idx: list[str], val: str, ok: str) -> None:
        self.store_c_at("%C", ", ".join(idx), self.spec.c.type, val, ok)

    def load_c_at(self, ref: str, index: str, mtype: str, ok: str) -> str:
        """C[index] of memref `ref` as f32 where `ok`, else 0."""
        r, x = self.fresh(), self.fresh()
        self.w(f"{r} = scf.if {ok} -> (f32) {{")
        self.w(f"  {x} = memref.load {ref}[{index}] : {mtype}")
        y = self._to_f32(x, self.spec.c.elem)
        z = self.fresh()
        self.w(f"  scf.yield {y} : f32\n}} else {{\n  {z} = arith.constant 0.0 : f32\n  scf.yield {z} : f32\n}}")
        return r

    def store_c_at(self, ref: str, index: str, mtype: str, val: str, ok: str) -> None:
        """f32 `val` rounded to C's type into `ref`[index] where `ok`."""
        ec = self.spec.c.elem
        self.w(f"scf.if {ok} {{")
        if ec != "f32":
            r = self.fresh()
            self.w(f"  {r} = arith.truncf {val} : f32 to {ec}")
            val = r
        self.w(f"  memref.store {val}, {ref}[{index}] : {mtype}\n}}")

    def loop(self, n: int, accs: list[str], body: Callable[[Any, list[Any]], list[Any]]) -> list[str]:
        return self.for_(self.const(0), self.const(n), self.const(1), accs, ["f32"] * len(accs), body)


def template(spec: Spec, p: Plan) -> str:
    """`func.func @tmpl(%A, %B, %C, %init)` holding the gpu.launch (see the banner)."""
    b = MmaText(spec, p)
    kernel(b, spec, p)
    gx, gy, gz = p.grid
    head = [
        f"func.func @tmpl(%A: {spec.a.type}, %B: {spec.b.type}, %C: {spec.c.type}, %init: {spec.c.elem}) {{",
        f"%one = arith.constant 1 : index\n%gx = arith.constant {gx} : index",
        f"%gy = arith.constant {gy} : index\n%gz = arith.constant {gz} : index",
        f"%nt = arith.constant {p.threads} : index",
        ("gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
         "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
         f"workgroup(%SA : {b.smem['A']}, %SB : {b.smem['B']}) {{"),
    ]
    return "\n".join(head + b.lines + ["gpu.terminator\n}\nreturn\n}"])

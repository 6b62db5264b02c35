"""Implicit-GEMM contraction for the cuda target: convolutions, batched and transposed GEMMs.

    C[p] = init + sum over K of A[map_a(i)] * B[map_b(i)],   i = (batch, M, N, K) dims

where M, N, K and batch are *sets* of iteration dims, linearised in-kernel (last fastest), and
every operand element is addressed through its affine map, flattened to one linear form
`addr = const + sum_d coef[d] * i[d]` over the buffer's flat view. A conv after bufferization
(padding already applied) is one: M = (n, oh, ow), N = (f), K = (c, kh, kw), batch = (g),
A[n, g, c, oh*s + kh*d, ow*s + kw*d] -- im2col happens while staging tiles into shared memory,
never materialised.

  kinds   f16 / bf16: mma.sync m16n8k16, f32 accumulators (cuda_mma's fragment tables)
          tf32: f32 operands rounded with cvt.rna (ties away), mma.sync m16n8k8
          f32:  exact SIMT: 16x16 threads (16x8 at 128), each a TM x TN register tile (FMA), 128-bit
                shared-memory reads

  1. locate     block (bx, by, bz) -> tile origin (n0 = bx*BN, m0 = by*BM), batch dims from bz
  2. init       accumulators = the fused fill's value, or C at the accumulator's coordinates
  3. prologue   cp.async operands: slices 0 .. S-2 issued (3c), one commit group each;
                register operands: slice 0 loaded (3a) and stored to buffer 0 (3d)
  4. per K slice kt (BK deep), S buffers per operand (S = 2 without cp.async):
     4a. prefetch  element (outer o, k) of the tile delinearises o and k into their dims and
                   reads at the operand's linear address; whole vectors (up to 16 bytes) along
                   the operand's unit-stride run of dims (the run's extent, every other
                   coefficient and the offset divisible by the width), else scalars; a thread's
                   vectors after its first are the first + a constant where the layout allows;
                   outside M/N/K or the fused padding: zero, not read.
                   cp.async (4/8/16-byte vectors; simt: runs along outer, or k-runs 4 bytes each, transposed): slice kt+S-1 -> buffer
                   (kt+S-1)%S, zero-filled by a source size of 0; else slice kt+1 -> registers.
                   simt (`Plan.lean`): no bound check the tile sizes prove; past K, the last
                   slice again (its buffer is never computed with)
     4b. compute   mma: fragments from buffer kt%S -> mma.sync (f16/bf16: ldmatrix x4, .trans
                   for [k][outer] tiles; tf32: scalar loads, cp.async'd values rounded here);
                   simt: per k, TM values of A and TN of B (float4 reads) -> TM*TN FMAs
     4c. stage     register operands -> buffer (kt+1)%S (tf32: rounded first); mma keeps the
                   global run's layout ([outer][k] or [k][outer]), simt always [k][outer]
     4d. barrier   cp.async: wait for all but S-2 groups (slice kt landed), then one barrier at
                   the top of the slice (everyone's copies visible, buffer (kt-1)%S free);
                   registers only: one at the end (buffer (kt+1)%2 complete)
  5. store      each accumulator to C at its coordinates, rounded to C's type, inside only; or,
                with an epilogue (gemm_epilogue.py), through the elementwise consumer to its output

Stream-K (exact f32, `Plan.sk_workers`): a 1-d grid whose blocks run segments -- slices [k0, k0 +
nk) of a tile -- in a loop, each steps 1-5 above, the partial sums fixed up before step 5
(conv_gemm_streamk.py).

The tiling (`plan`: tiles, each operand's staging, buffers, split-K, stream-K) is conv_gemm_plan.py.
Buffers past the static 48 KB are dynamic shared memory (`Plan.dynamic`; the runtime opts in).
Written once (`kernel`) against cuda_mma's two builders, extended: `_Text` in conv_gemm_text.py
(MLIR, a `func.func @tmpl(%A, %B, %C, %init)` holding one gpu.launch for
backends/gpu/strategy.splice_template) and `_Numpy` in conv_gemm_twin.py (all threads of a block in lockstep, shared-memory races checked at
the barriers; `emulate`, the tests).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from gac_torch.kernels import cuda_mma as mma
from gac_torch.kernels import gemm_epilogue
from gac_torch.kernels.conv_gemm_plan import EARLY_LOADS, LDMATRIX, Plan, _whole_slices
from gac_torch.kernels.conv_gemm_spec import Operand as Operand
from gac_torch.kernels.conv_gemm_spec import Spec as Spec
from gac_torch.kernels.conv_gemm_spec import operand as operand


# --------------------------------------------------------------------------------------------
# the kernel, once, against a builder


def _split(b: Any, lin: Any, dims: tuple[int, ...], ranges: tuple[int, ...]) -> dict[int, Any]:
    """Row-major indices of linear index `lin` over `dims` (last fastest)."""
    out: dict[int, Any] = {}
    for j in range(len(dims) - 1, -1, -1):
        n = ranges[dims[j]]
        if j == 0:
            out[dims[j]] = lin
        elif n == 1:
            out[dims[j]] = b.const(0)
        else:
            out[dims[j]] = b.rem(lin, b.const(n))
            lin = b.div(lin, b.const(n))
    return out


def _addr(b: Any, op: Operand, ivs: dict[int, Any], dims: tuple[int, ...], base: Any = None) -> Any:
    """base + sum of coef[d] * i[d] over `dims`."""
    acc = base
    for d in dims:
        k = op.coef[d]
        if k == 0:
            continue
        term = ivs[d] if k == 1 else b.mul(ivs[d], b.const(k))
        acc = term if acc is None else b.add(acc, term)
    return b.const(0) if acc is None else acc


def kernel(b: Any, spec: Spec, p: Plan) -> None:
    if p.sk_workers:  # stream-K: the block's segments in a loop (conv_gemm_streamk.py)
        from gac_torch.kernels import conv_gemm_streamk

        conv_gemm_streamk.run(b, spec, p, lambda bx, by, bz, seg: _tile(b, spec, p, bx, by, bz, seg))
    else:
        _tile(b, spec, p, b.bid(0), b.bid(1), b.bid(2), None)


def _tile(b: Any, spec: Spec, p: Plan, bx: Any, by: Any, bz: Any, seg: Any) -> None:
    """One tile; `seg` (stream-K): only its slices [seg.k0, seg.k0 + seg.nk), finished by
    `seg.finish` (the partial sums' fix-up, then the store below once)."""
    T, BM, BN, BK = p.threads, p.bm, p.bn, p.bk
    simt, tf32 = spec.kind == "f32", spec.kind == "tf32"
    c, R = b.const, spec.ranges
    # 1. locate
    tid = b.tid()
    m0, n0 = b.mul(by, c(BM)), b.mul(bx, c(BN))
    split = p.splits > 1
    assert not (split and (spec.fill or spec.epilogue)), "split K adds into C: no fused fill/epilogue"
    kbeg = b.mul(b.rem(bz, c(p.splits)), c(p.kchunk)) if split else None  # this block's K range
    if seg is not None:
        kbeg = b.mul(seg.k0, c(BK))
    bat = _split(b, b.div(bz, c(p.splits)) if split else bz, spec.batch, R) if spec.batch else {}

    def kb(s: Any) -> Any:  # the first k of slice s (an index value)
        return b.mul(s, c(BK)) if kbeg is None else b.add(kbeg, b.mul(s, c(BK)))

    def base(op: Operand) -> Any:  # the batch part of an operand's address
        return _addr(b, op, bat, spec.batch, c(op.const))

    a_base, b_base, c_base = base(spec.a), base(spec.b), base(spec.c)
    # stream-K, one K dim, no K bound checks (`k_exact`): the segment's first k moves A's and
    # B's bases instead, so that the slice loop is the plain kernel's (slices counted from 0)
    if seg is not None and _whole_slices(p, spec):
        kd = spec.ks[0]
        a_base = b.add(a_base, b.mul(kbeg, c(spec.a.coef[kd])))
        b_base = b.add(b_base, b.mul(kbeg, c(spec.b.coef[kd])))
        kbeg = None

    def step(which: str) -> int:
        """mma (simt: lean), T a multiple of a tile row's vectors: vector i of a thread is
        vector 0 moved by i * step rows (along the outer dims if the loads walk k, else along
        k); else 0."""
        st = p.a if which == "A" else p.b
        per = (BK if st.glob_k else (BM if which == "A" else BN)) // st.vec
        return T // per if (not simt or p.lean) and T % per == 0 and not st.scatter else 0

    def scatter_off(which: str, i: int) -> tuple[int, int] | None:
        """scatter: vector i's (outer, k) offset from vector 0's, constants where the T / 8 rows
        a block's threads cover divide the tile (no vector wraps within it); else None."""
        tile_o = BM if which == "A" else BN
        if not (p.a if which == "A" else p.b).scatter or T % 8 or tile_o % (T // 8):
            return None
        e = (T // 8) * i
        return e % tile_o, 8 * (e // tile_o)

    def coords(which: str, i: int) -> tuple[Any, Any]:
        """(outer, k) offsets inside the tile of the i-th vector a thread loads."""
        st = p.a if which == "A" else p.b
        tile_o = BM if which == "A" else BN
        if i and step(which):
            lo, lk = coords(which, 0)
            return (b.add(lo, c(i * step(which))), lk) if st.glob_k else (lo, b.add(lk, c(i * step(which))))
        v = b.add(tid, c(i * T))
        if st.scatter:  # 8 k x 4 rows a warp: k = v % 8 + 8 (v // (8 tile_o)), row = v // 8 % tile_o
            return (b.rem(b.div(v, c(8)), c(tile_o)),
                    b.add(b.rem(v, c(8)), b.mul(b.div(v, c(8 * tile_o)), c(8))))
        if st.glob_k:
            per = BK // st.vec
            return b.div(v, c(per)), b.mul(b.rem(v, c(per)), c(st.vec))
        per = tile_o // st.vec
        return b.mul(b.rem(v, c(per)), c(st.vec)), b.div(v, c(per))

    # 3a / 4a: a slice's global loads. When the innermost K dim's extent is a multiple of BK
    # (a conv's channels, K ordered (kh, kw, c)), only kbase is delinearised, once per slice.
    # lean (simt): also for one K dim (a thread's vectors after its first: constant offsets);
    # no bound check that the tile sizes prove (M or N a multiple of the tile; K of BK, and the
    # slices past K that the pipeline prefetches re-read the last slice: `clamp`)
    uniform = (len(spec.ks) > 1 or p.lean) and R[spec.ks[-1]] % BK == 0
    nk = -(-(p.kchunk or spec.K) // BK)
    k_exact = p.lean and spec.K % BK == 0 and (not split or spec.K % p.kchunk == 0)

    def clamp(s: Any) -> Any:  # a slice to load: past the last one, the last (never computed)
        if seg is not None and k_exact:
            return b.min_(s, b.sub(seg.nk, c(1)))
        return b.min_(s, c(nk - 1)) if k_exact else s

    def both(x: Any, y: Any) -> Any:  # conjunction of bound checks, None: none needed
        return y if x is None else x if y is None else b.and_(x, y)

    def points(which: str, kbase: Any) -> Iterator[tuple[Any, Any]]:
        """(linear address, inside) of each vector the thread loads of the slice at kbase
        (a generator: each vector's index math is emitted right before its load)."""
        op, st = (spec.a, p.a) if which == "A" else (spec.b, p.b)
        outer, o0, ext_o = (spec.ms, m0, spec.M) if which == "A" else (spec.ns, n0, spec.N)
        obase = a_base if which == "A" else b_base
        # vector i = vector 0 + a constant: along k (the last K dim, which no padding guard
        # reads; K a multiple of BK: in range with vector 0), or along a single outer dim
        # (no guards): one address computation, the rest immediate offsets
        # (scatter: along both, vector i = vector 0 + rows and 8 k, `scatter_off`)
        d = spec.ks[-1] if not st.glob_k else next((x for x in outer if R[x] > 1), outer[-1])
        wide = [x for x in outer if R[x] > 1]
        fast = uniform and (step(which) or scatter_off(which, 0) is not None) and (
            (not st.glob_k and all(gc[d] == 0 for gc, _, _ in op.guards))
            or (st.glob_k and not op.guards and len(wide) <= 1))
        o_exact = p.lean and ext_o % (BM if which == "A" else BN) == 0
        true = b.const(1, "i1")
        first = None
        for i in range(st.per_thread):
            if fast and first is not None:
                addr0, ok0, lo0 = first
                do, dk = scatter_off(which, i) or (i * step(which), 0)
                addr = b.add(addr0, c(op.coef[d] * do + op.coef[spec.ks[-1]] * dk))
                if st.glob_k and not o_exact:  # (k in range as vector 0's; the outer index is not)
                    ok0 = both(ok0, b.lt(b.add(b.add(o0, lo0), c(do)), c(ext_o)))
                yield addr, true if ok0 is None else ok0
                continue
            lo, lk = coords(which, i)
            oi, ki = b.add(o0, lo), b.add(kbase, lk)
            ok_k = None if k_exact else b.lt(ki, c(spec.K))
            ok = both(None if o_exact else b.lt(oi, c(ext_o)), ok_k)
            io = _split(b, oi, outer, R)
            if uniform:  # the slice shares every K dim but the last: split kbase, add lk
                ik = dict(_split(b, kbase, spec.ks, R))
                ik[spec.ks[-1]] = b.add(ik[spec.ks[-1]], lk)
            else:
                ik = _split(b, ki, spec.ks, R)
            addr = _addr(b, op, io, outer, obase)  # loop-invariant part
            addr = _addr(b, op, ik, spec.ks, addr)
            for gc, g0, upper in op.guards:  # fused padding: outside reads as 0
                gop = Operand("", "", gc, 0, 0, 0)
                at = _addr(b, gop, {**bat, **io, **ik}, tuple(d for d, k in enumerate(gc) if k), c(g0))
                ok = both(ok, b.inb(at, c(upper)))
            if fast:  # (glob_k: vector 0's inside-ness without its outer bound)
                first = (addr, ok_k if st.glob_k else ok, lo)
            yield addr, true if ok is None else ok

    def load_slice(which: str, kbase: Any) -> list[Any]:
        st = p.a if which == "A" else p.b
        return [b.load_flat(which, addr, st.vec, ok) for addr, ok in points(which, kbase)]

    def smem_at(which: str, buf: Any, i: int) -> list[Any]:
        """Where the i-th vector goes in buffer `buf` (mma: the global run's own layout)."""
        st = p.a if which == "A" else p.b
        lo, lk = coords(which, i)
        return [buf, lo, lk] if st.smem_k else [buf, lk, lo]

    def issue(which: str, buf: Any, kbase: Any) -> None:  # 3c / 4a: cp.async, zero-filled outside
        st = p.a if which == "A" else p.b
        for i, (addr, ok) in enumerate(points(which, kbase)):
            b.cp_async(which, smem_at(which, buf, i), addr, st.vec, ok)


    # 3d / 4c: stage registers into a buffer
    def stage(which: str, buf: Any, vals: list[Any]) -> None:
        st = p.a if which == "A" else p.b
        for i, val in enumerate(vals):
            lo, lk = coords(which, i)
            if tf32:
                val = b.round_tf32(val, st.vec)
            if st.smem_k:
                b.store_smem(which, [buf, lo, lk], val, st.vec)
            elif st.glob_k:  # simt: transpose k-runs into the [k][outer] tile
                for j in range(st.vec):
                    b.store_smem1(which, [buf, b.add(lk, c(j)), lo], b.extract(val, j, st.vec))
            else:
                b.store_smem(which, [buf, lk, lo], val, st.vec)

    # accumulator coordinates (row in M tile, col in N tile) and their order in `accs`
    if simt:
        # lm x ln threads (16 x 16; 16 x 8 at 128 threads), each 4 x 4 quadrants lm*4 / ln*4 apart
        lm, ln = BM // p.tm, BN // p.tn
        m_fast = spec.c.coef[spec.ms[-1]] == 1  # lanes along C's contiguous side
        tr, tc = (b.rem(tid, c(lm)), b.div(tid, c(lm))) if m_fast else (b.div(tid, c(ln)), b.rem(tid, c(ln)))
        rows = [b.add(b.mul(tr, c(4)), c((i % 4) + (i // 4) * 4 * lm)) for i in range(p.tm)]
        cols = [b.add(b.mul(tc, c(4)), c((j % 4) + (j // 4) * 4 * ln)) for j in range(p.tn)]
        places = [(i, j) for i in range(p.tm) for j in range(p.tn)]
    else:
        warp, lane = b.div(tid, c(32)), b.rem(tid, c(32))
        g, t = b.div(lane, c(4)), b.rem(lane, c(4))
        wm, wn = b.div(warp, c(p.warps_n)), b.rem(warp, c(p.warps_n))
        wrow, wcol = b.mul(wm, c(p.mt * 16)), b.mul(wn, c(p.nt * 8))
        rows = [b.add(wrow, b.add(g, c(i * 16 + r))) for i in range(p.mt) for r in (0, 8)]
        cols = [b.add(wcol, b.add(b.mul(t, c(2)), c(j * 8 + q))) for j in range(p.nt) for q in (0, 1)]
        places = [(2 * i + rq // 8, 2 * j + cq) for i in range(p.mt) for j in range(p.nt)
                  for rq, cq in mma.FRAG_C]

    row_iv: dict[int, dict[int, Any]] = {}  # per accumulator row / column: its M / N indices
    col_iv: dict[int, dict[int, Any]] = {}
    col_ok: dict[int, Any] = {}

    def out_points() -> list[tuple[Any, Any]]:
        """(C address, inside) per accumulator."""
        r_at, c_at = {}, {}
        for i, row in enumerate(rows):
            gm = b.add(m0, row)
            row_iv[i] = _split(b, gm, spec.ms, R)
            r_at[i] = (_addr(b, spec.c, row_iv[i], spec.ms, c_base), b.lt(gm, c(spec.M)))
        for j, col in enumerate(cols):
            gn = b.add(n0, col)
            col_iv[j] = _split(b, gn, spec.ns, R)
            c_at[j] = (_addr(b, spec.c, col_iv[j], spec.ns), b.lt(gn, c(spec.N)))
            col_ok[j] = c_at[j][1]
        return [(b.add(r_at[i][0], c_at[j][0]), b.and_(r_at[i][1], c_at[j][1])) for i, j in places]

    def direct(i: int, j: int) -> Any:
        """Address of an epilogue operand given over the contraction's own dims at (i, j)."""
        return lambda op: b.add(_addr(b, op, row_iv[i], spec.ms, _addr(b, op, bat, spec.batch, c(op.const))),
                                _addr(b, op, col_iv[j], spec.ns))

    # 2. init
    # (stream-K: a tile's first segment starts from the init, the others from 0)
    first = b.eq(seg.k0, c(0)) if seg is not None else None
    if spec.fill or split:  # (split: C already holds the init; partial sums start at 0)
        accs = [b.init_f32() if spec.fill else c(0.0, "f32")] * len(places)
        if first is not None:
            accs = [b.select(first, accs[0], c(0.0, "f32"), "f32")] * len(places)
    else:
        accs = [b.load_cflat(addr, ok if first is None else b.and_(ok, first)) for addr, ok in out_points()]

    # 3. prologue
    zero = c(0)
    S = p.stages
    copied = [w for w, st in (("A", p.a), ("B", p.b)) if st.cp]
    held = [w for w, st in (("A", p.a), ("B", p.b)) if not st.cp]  # staged through registers
    for s in range(S - 1 if copied else 0):  # 3c: slices 0 .. S-2 in flight
        for w in copied:
            issue(w, c(s), kb(clamp(c(s)) if seg is not None else c(min(s, nk - 1) if k_exact else s)))
        b.cp_commit()
    for w in held:
        stage(w, zero, load_slice(w, kb(zero)))
    if not copied and not (simt and EARLY_LOADS):  # (early: the loop's first barrier)
        b.barrier()

    def frag_load(which: str, buf: Any, outer: Any, k: Any, pair: bool) -> Any:
        st = p.a if which == "A" else p.b
        if not pair:  # tf32: copied f32 values are rounded here (registers: at 4c)
            x = b.load_smem(which, [buf, outer, k] if st.smem_k else [buf, k, outer], 1)
            return b.round_tf32_1(x) if tf32 and st.cp else x
        if st.smem_k:  # [outer][k]
            return b.load_smem(which, [buf, outer, k], 2)
        return b.pack(b.load_smem(which, [buf, k, outer], 1),
                      b.load_smem(which, [buf, b.add(k, c(1)), outer], 1))

    if not simt and not tf32 and LDMATRIX:  # 16-bit fragments: ldmatrix, 8 rows of 16 bytes
        l8, hi, q = b.rem(lane, c(8)), b.rem(b.div(lane, c(8)), c(2)), b.div(lane, c(16))

    def ld_frags(buf: Any, k0: int) -> tuple[list[Any], list[Any]]:
        """A fragments (4 registers per 16-row tile i) and B (2 per 8-column tile j) by
        ldmatrix x4 (x2 for an odd last B tile): lanes 8j..8j+7 address matrix j's rows;
        .trans where the tile is stored [k][outer] (the fragment wants k pairs)."""
        fa, fb = [], []
        for i in range(p.mt):
            m = b.add(wrow, c(i * 16))
            if p.a.smem_k:  # [m][k]: matrices (m 0-7 | 8-15) x (k 0-7 | 8-15)
                at = [buf, b.add(m, b.add(l8, b.mul(hi, c(8)))), b.add(b.mul(q, c(8)), c(k0))]
            else:  # [k][m]: transposed, same order
                at = [buf, b.add(b.add(l8, b.mul(q, c(8))), c(k0)), b.add(m, b.mul(hi, c(8)))]
            fa.append(b.ldmatrix("A", at, 4, not p.a.smem_k))
        for j in range(0, p.nt, 2):
            num = 4 if j + 1 < p.nt else 2
            n = b.add(wcol, c(j * 8))
            qq = q if num == 4 else c(0)
            if p.b.smem_k:  # [n][k]: (n tile j: k 0-7, 8-15), (tile j+1: ...)
                at = [buf, b.add(n, b.add(l8, b.mul(qq, c(8)))), b.add(b.mul(hi, c(8)), c(k0))]
            else:  # [k][n]
                at = [buf, b.add(b.add(l8, b.mul(hi, c(8))), c(k0)), b.add(n, b.mul(qq, c(8)))]
            regs = b.ldmatrix("B", at, num, not p.b.smem_k)
            fb += [regs[h:h + 2] for h in range(0, num, 2)]
        return fa, fb

    def mma_step(buf: Any, k0: int, accs: list[Any]) -> list[Any]:
        if not tf32 and LDMATRIX:
            fa, fb = ld_frags(buf, k0)
            for i in range(p.mt):
                for j in range(p.nt):
                    at = (i * p.nt + j) * 4
                    accs[at:at + 4] = b.mma(spec.kind, fa[i], fb[j], accs[at:at + 4])
            return accs
        fa, fb = [], []
        for i in range(p.mt):
            regs = []
            for r, cc in (mma.FRAG_A8 if tf32 else mma.FRAG_A16):
                row = b.add(wrow, b.add(g, c(i * 16 + r)))
                col = b.add(t, c(k0 + cc)) if tf32 else b.add(b.mul(t, c(2)), c(k0 + cc))
                regs.append(frag_load("A", buf, row, col, not tf32))
            fa.append(regs)
        for j in range(p.nt):
            n = b.add(wcol, b.add(g, c(j * 8)))
            regs = []
            for kk in (mma.FRAG_B8 if tf32 else mma.FRAG_B16):
                k = b.add(t, c(k0 + kk)) if tf32 else b.add(b.mul(t, c(2)), c(k0 + kk))
                regs.append(frag_load("B", buf, n, k, not tf32))
            fb.append(regs)
        for i in range(p.mt):
            for j in range(p.nt):
                at = (i * p.nt + j) * 4
                accs[at:at + 4] = b.mma(spec.kind, fa[i], fb[j], accs[at:at + 4])
        return accs

    def simt_step(buf: Any, kk: int, accs: list[Any]) -> list[Any]:
        av = [b.load_smem("A", [buf, c(kk), b.add(b.mul(tr, c(4)), c(4 * lm * h))], 4) for h in range(p.tm // 4)]
        bv = [b.load_smem("B", [buf, c(kk), b.add(b.mul(tc, c(4)), c(4 * ln * h))], 4) for h in range(p.tn // 4)]
        xa = [b.extract(av[i // 4], i % 4, 4) for i in range(p.tm)]
        xb = [b.extract(bv[j // 4], j % 4, 4) for j in range(p.tn)]
        # the FMAs column by column, every other column bottom-up (consecutive FMAs share a b, or
        # an a at the turns): ptxas then allocates fewer FMAs whose uncached sources share a
        # register bank (sm_90 SASS, 4096^3: 26 -> 12 % of them; the FMA count is the same).
        # GAC_SGEMM_ORDER=rows: row by row (bisects)
        if os.environ.get("GAC_SGEMM_ORDER") == "rows":
            order = list(range(len(places)))
        else:
            order = [(i if j % 2 == 0 else p.tm - 1 - i) * p.tn + j for j in range(p.tn) for i in range(p.tm)]
        out = list(accs)
        for n in order:
            i, j = places[n]
            out[n] = b.fma(xa[i], xb[j], accs[n])
        return out

    def compute(buf: Any, accs: list[Any]) -> list[Any]:  # 4b
        accs = list(accs)
        if simt:
            for kk in range(BK):
                accs = simt_step(buf, kk, accs)
        else:
            for s in range(BK // p.ks):
                accs = mma_step(buf, s * p.ks, accs)
        return accs

    # 4. K slices. simt (`early`): a slice's register loads come before the barrier, which
    # ptxas does not move global loads past; after it they sank to the end of the FMAs, right
    # before the stores that wait for them (nearly all of their latency exposed each slice)
    early = simt and EARLY_LOADS

    def body(kt: Any, accs: list[Any]) -> list[Any]:
        buf = b.rem(kt, c(2))
        nbuf = b.sub(c(1), buf)
        kn = kb(clamp(b.add(kt, c(1))))
        next_a, next_b = load_slice("A", kn), load_slice("B", kn)  # 4a
        if early:
            b.barrier()  # 4d: slice kt's buffer complete, and every warp done with buffer nbuf
        accs = compute(buf, accs)
        stage("A", nbuf, next_a)  # 4c
        stage("B", nbuf, next_b)
        if not early:
            b.barrier()  # 4d
        return accs

    def body_async(kt: Any, accs: list[Any]) -> list[Any]:
        kn = b.add(kt, c(1))
        nxt = [load_slice(w, kb(clamp(kn))) for w in held] if early else []
        b.cp_wait(S - 2)  # 4d: this thread's copies of slice kt landed; the barrier: everyone's,
        b.barrier()  # and every warp is done with slice kt-1's buffer, which 4a refills
        ahead = b.add(kt, c(S - 1))
        for w in copied:  # 4a
            issue(w, b.rem(ahead, c(S)), kb(clamp(ahead)))
        b.cp_commit()
        if not early:
            nxt = [load_slice(w, kb(clamp(kn))) for w in held]
        accs = compute(b.rem(kt, c(S)), accs)
        for w, vals in zip(held, nxt):  # 4c: buffer (kt+1) % S, read after the next barrier
            stage(w, b.rem(kn, c(S)), vals)
        return accs

    if seg is None:
        accs = b.loop(nk, accs, body_async if copied else body)
    else:
        accs = b.for_(c(0), seg.nk, c(1), accs, ["f32"] * len(accs), body_async if copied else body)
    if copied:
        b.cp_wait(0)  # (the slices past K were zero-fills: none left in flight at exit)

    # 5. store
    def store(accs: list[Any]) -> None:
        if spec.epilogue is not None and os.environ.get("GAC_IGEMM_EPILOGUE_PER_ACC") != "1":
            # (8 accumulators' loads at once where registers allow; 2 where the kernel gets 128 per
            # thread: no register-staged vectors, backends/cuda/pipeline.py gives it 2 blocks per SM)
            two = not simt and all(st.cp or st.vec == 1 for st in (p.a, p.b))
            gemm_epilogue.store_all(b, spec, out_points(), accs, places, col_ok, _split, _addr, direct, 2 if two else 8)
            return
        for (addr, ok), val, (i, j) in zip(out_points(), accs, places):  # (per accumulator: bisects)
            if spec.epilogue is not None:
                gemm_epilogue.store(b, spec, addr, val, ok, _split, _addr, direct(i, j))
            else:
                b.store_cflat(addr, val, ok, add=split)

    if seg is None:
        store(accs)
    else:
        seg.finish(accs, store)

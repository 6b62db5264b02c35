"""Hopper GEMM for the cuda target (sm_90a): C[b, m, n] = init + sum_k A[b, m, k] * B[b, k, n]
with warpgroup `wgmma.mma_async` on operands that TMA (`cp.async.bulk.tensor`) stages into
128-byte-swizzled shared memory, a STAGES-deep ring of buffers handed over with mbarriers,
f32 accumulators, C rounded to its type in the store.

  kinds   f16 x f16, bf16 x bf16 (either operand K- or M/N-major: wgmma's transpose bits);
          f32 x f32 as tf32 when allowed: wgmma reads a tf32 B only K-major from shared memory;
          an M-major A is read from registers instead (4b'); with B N-major and A K-major
          (`a @ b` row-major) the kernel computes C^T = B^T A^T (`orient`): B's tile becomes
          the register operand, C is stored transposed

A persistent CTA of 3 warpgroups computes BM x BN tiles (BM = 128) bid, bid + grid, ...:
warpgroup 0 is the producer, its thread 0 issues the TMA loads; warpgroups 1 and 2 (consumers)
own rows 0-63 / 64-127 of a tile, each one m64nBNk16 wgmma chain per K slice, BN/2 f32
accumulators per thread. Slices are numbered across the CTA's tiles, so the producer runs
ahead into the next tile while the consumers store the last one.

  1. locate    tile number -> tile origin (m0, n0) and batch index (N tiles fastest)
  2. barriers  thread 0 initializes full[s] (1 arrival + the TMA bytes) and empty[s] (one
               arrival per consumer warpgroup) for each stage s; fence, CTA barrier
  3. producer  registers given back (setmaxnreg.dec); thread 0, for each K slice kt:
               3a. wait empty[kt % S] (its previous use consumed; passes at once on a fresh one)
               3b. full[kt % S] expects the slice's bytes; TMA loads A's and B's boxes there
                   (the out-of-range part of a box reads as zero: M, N, K overhang needs no mask)
  3'. (gather, kernels/wgmma_conv.py) instead, all 128 producer threads stage each slice with
               16-byte cp.async into the same swizzled layout; each thread's copies arrive on
               full[s] when they land (cp.async.mbarrier.arrive.noinc; full[s] counts 128)
  4. consumers registers raised (setmaxnreg.inc); accumulators = the fill or C; per slice kt:
               4a. wait full[kt % S] (4a'. gather: fence.proxy.async, cp.async wrote it)
               4b. fence; BK/16 (tf32: BK/8) wgmmas, smem descriptors advanced along K; commit
               4b'. (A from registers) first every K step's A fragment, loaded from the
                   swizzled tile (`a_frag_offset`; rows permuted, `a_pair_row`: one conflict-free
                   8-byte load per k) and rounded to tf32 (cvt.rna); two slices per loop
                   iteration in two sets of registers (an odd count's first slice alone), so
                   a set is reloaded only after the group that read it completed (4c)
               4c. wait until one group at most is in flight: the previous slice's stage is
                   free, one thread per warpgroup arrives on its empty barrier (the tile's last
                   slice: after waiting for all)
  5. store     each accumulator (pairs when C's rows are contiguous and even; 4b': the pairs of
               rows when its columns are) to C, rounded to
               C's type, inside the matrix only; 5b. for f16/bf16 C with 16-byte rows, through
               a padded shared-memory staging buffer per warpgroup (named barrier), then 16-byte
               stores of whole row chunks; 5c. with a fused epilogue (`GemmSpec.epilogue`: bias,
               activation, residual, output cast), per accumulator: its elementwise consumer's
               body on it and the consumer's other operands, stored to the consumer's output
               (C itself is not written); a chunk's operand loads first, then its stores;
               operands contiguous along N two columns per load / store (FRAG_C's pairs);
               with BN <= 128 the loads along M (a residual) of the first PREFETCH
               accumulators are issued before the main loop (its MMAs hide their latency);
               5d. (wgmma_plan.stage_epilogue, where the output and a residual are row-major
               M x N views) the tile goes through one of `ring` tile buffers after the A/B
               stages: the producer TMA-loads the tile's residual there (3c, once the buffer's
               previous tile was read out: rempty/rfull barriers), each consumer thread reads
               its pairs, runs the body with the per-column operands and writes the result
               over them; after a warpgroup barrier, its 64 rows leave as 16-byte row chunks
               (=tma: as TMA stores of [64][128 B] boxes)

Shared memory (dynamic, from a 1024-byte aligned base): A stages, B stages, (5d) the tile
buffers, then the 2*S mbarriers (5d: and 2 per tile buffer). An operand's tile is one or more
TMA boxes whose inner extent is 128 bytes (the swizzle span): K-major, a box [rows][BK] per
tile; MN-major, BM/64 (BN/64) boxes [BK][64]. The
tiling (`plan`, the tile width) and the descriptor math are plain Python on ints in
wgmma_plan.py; the MLIR text builder is wgmma_text.py.

Tuning knobs (not in the compile cache's key: use with GAC_CACHE=0): GAC_WGMMA_BN (64 | 128 | 256),
GAC_WGMMA_NARROW=0, GAC_WGMMA_EPILOGUE_CHUNK, GAC_WGMMA_EPILOGUE_PREFETCH, GAC_WGMMA_EPILOGUE_PAIRS=0,
GAC_WGMMA_STAGES, GAC_WGMMA_EPILOGUE=direct (no staged store), GAC_WGMMA_EPILOGUE_STAGE=0|tma
(5d off | Z by TMA stores), GAC_WGMMA_CLUSTER=2 (CTA pairs
sharing B through TMA multicast: compiled and ptxas-checked, not yet run on a GPU);
benchmarks/wgmma_tiles.py races them.
"""

from __future__ import annotations

import os
from typing import Any

from gac_torch.kernels.cuda_mma import FRAG_C, Operand, Spec
from gac_torch.kernels.wgmma_plan import (BM, ESIZE, SWIZZLE, THREADS, WG, Plan, Side, _elem, a_frag_offset,
                                          a_pair_row, box_origins, desc_layout, epilogue_of, prefetch,
                                          ring_offset)
from gac_torch.kernels.wgmma_text import WgmmaText


# --------------------------------------------------------------------------------------------
# the kernel


def _kernel(b: WgmmaText, spec: Spec, p: Plan, gather: Any = None, conv: Any = None) -> None:
    """`gather` (kernels/wgmma_conv.py): instead of TMA, every producer thread t stages its part
    of slice kt with cp.async, `gather(t, a_stage, b_stage, m0, n0, kt)`, and its copies arrive
    on full[s] when they land (3b'); the consumers order them before wgmma's reads (4a').
    `conv` (wgmma_conv.WindowHooks): TMA boxes at conv.a_coords(m0, kt) / b_coords(n0, kt), and
    tile row r of the tile at m0 stored to C's row conv.rows(m0, r) (3b, 5)."""
    es = ESIZE[_elem(spec)]
    c = b.const
    S = p.stages
    a_base, b_base = 0, S * p.a.stage_bytes
    ring_base = S * (p.a.stage_bytes + p.b.stage_bytes)  # 5d's tile buffers (p.ring of them)
    bar_base = ring_base + p.ring * p.ring_bytes
    tn, tm = -(-spec.N // p.bn), m_tile_count(spec, conv)
    nk = -(-spec.K // p.bk)
    # 1. locate: this CTA's tiles are bid, bid + grid, ...; slice `it` of the CTA's sequence
    # (tile number tl, K slice kt: it = tl*nk + kt) uses stage it % S at phase (it / S) % 2
    # (cluster 2: work unit u = a pair of M-adjacent tiles; CTA rank r of the pair takes the
    # tile 2*pm + r, one past the matrix when M has an odd number of tiles: zeros, not stored)
    cl = p.cluster
    tid = b.tid()
    bid = b.bid(0)
    rank = b.cluster_rank() if cl > 1 else c(0)
    cid, units = b.div(bid, c(cl)), p.grid[0] // cl
    mine = b.div(b.add(b.sub(c(p.tiles), cid), c(units - 1)), c(units))
    smem = b.smem_base()
    tmc = -(-tm // cl)

    def tile(tl: Any) -> tuple[Any, Any, Any]:
        return tile_origin(b, b.add(cid, b.mul(tl, c(units))), tn, tmc, cl, rank, p.bn)

    def bar(base: int, s: Any) -> Any:
        return b.i32_add(smem, b.i32_add(b.i32(base), b.i32_mul(b.to_i32(s), b.i32(8))))

    def stage_phase(it: Any) -> tuple[Any, Any]:
        return b.rem(it, c(S)), b.to_i32(b.rem(b.div(it, c(S)), c(2)))

    def full(s: Any) -> Any:
        return bar(bar_base, s)

    def empty(s: Any) -> Any:
        return bar(bar_base + 8 * S, s)

    def rfull(r: Any) -> Any:  # 5d: tile buffer r holds its tile's residual
        return bar(bar_base + 16 * S, r)

    def rempty(r: Any) -> Any:  # 5d: every consumer thread read its tile out of buffer r
        return bar(bar_base + 16 * S + 8 * p.ring, r)

    def ring_slot(tl: Any) -> tuple[Any, Any, Any]:  # tile tl's buffer: address, index, phase
        r = b.rem(tl, c(p.ring))
        at = b.i32_add(smem, b.i32_add(b.i32(ring_base), b.i32_mul(b.to_i32(r), b.i32(p.ring_bytes))))
        return at, r, b.to_i32(b.rem(b.div(tl, c(p.ring)), c(2)))

    # 2. barriers
    def init() -> None:
        for s in range(S):
            b.mbar_init(full(c(s)), WG if gather else 1)
            b.mbar_init(empty(c(s)), 2 * cl)  # one arrival per consumer warpgroup of the cluster
        for r in range(p.ring if p.res >= 0 else 0):
            b.mbar_init(rfull(c(r)), 1)
            b.mbar_init(rempty(c(r)), 2 if p.tma_store else 2 * WG)  # (TMA store: the leaders)
        b.asm("fence.mbarrier_init.release.cluster;")

    b.when(b.eq(tid, c(0)), init)
    if cl > 1:  # the peer's multicasts and arrivals find initialized barriers
        b.cluster_barrier()
    else:
        b.barrier()
    wg = b.div(tid, c(WG))

    # 3. producer
    def coords(op: Operand, outer: int, o0: Any, k0: Any, bz: Any, shift: int) -> list[Any]:
        at = {spec.k: k0, outer: b.add(o0, c(shift))}
        return [at.get(d, bz) for d in reversed(op.dims)]  # innermost first; the batch: bz

    def stage_at(base: int, side: Side, s: Any) -> Any:
        return b.i32_add(smem, b.i32_add(b.i32(base), b.i32_mul(b.to_i32(s), b.i32(side.stage_bytes))))

    def gathered() -> None:  # 3' (gather): all producer threads, their copies per slice
        def one_tile(tl: Any) -> None:
            m0, n0, _ = tile(tl)

            def body(kt: Any) -> None:
                s, phase = stage_phase(b.add(b.mul(tl, c(nk)), kt))
                b.mbar_wait(empty(s), b.xor1(phase))  # 3a
                gather(tid, stage_at(a_base, p.a, s), stage_at(b_base, p.b, s), m0, n0, kt)
                b.asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", args=[(full(s), "r", "i32")])  # 3b'

            b.loop(c(0), c(nk), body)

        b.loop(c(0), mine, one_tile)
        b.asm("cp.async.wait_all;")  # (no copy outlives its thread)

    def producer() -> None:
        if p.maxnreg:
            b.asm(f"setmaxnreg.dec.sync.aligned.u32 {p.regs[0]};")
        if gather is not None:
            return gathered()

        def one_tile(tl: Any) -> None:
            m0, n0, bz = tile(tl)
            if p.res >= 0:  # 3c (5d): the tile's residual into its buffer, once the tile
                # p.ring before it was read out
                at, r, phase = ring_slot(tl)
                b.mbar_wait(rempty(r), b.xor1(phase))
                b.mbar_expect(rfull(r), p.ring_bytes)
                span = SWIZZLE // p.out_es
                for j in range(p.bn // span):
                    b.tma_load("R", b.i32_add(at, b.i32(j * BM * SWIZZLE)), [b.add(n0, c(j * span)), m0], rfull(r))

            def body(kt: Any) -> None:
                s, phase = stage_phase(b.add(b.mul(tl, c(nk)), kt))
                b.mbar_wait(empty(s), b.xor1(phase), cluster=cl > 1)  # 3a
                b.mbar_expect(full(s), p.a.stage_bytes + p.b.stage_bytes)  # 3b
                if conv is not None:  # one box per operand (wgmma_conv.Window); clustered,
                    # this rank's half of B's rows, to both CTAs of the pair
                    b.tma_load("A", stage_at(a_base, p.a, s), conv.a_coords(m0, kt), full(s))
                    dst, nb = stage_at(b_base, p.b, s), n0
                    if cl > 1:
                        dst = b.i32_add(dst, b.i32_mul(b.to_i32(rank), b.i32(p.bn // cl * SWIZZLE)))
                        nb = b.add(n0, b.mul(rank, c(p.bn // cl)))
                    b.tma_load("B", dst, conv.b_coords(nb, kt), full(s), multicast=(1 << cl) - 1 if cl > 1 else 0)
                    return
                k0 = b.mul(kt, c(p.bk))
                for which, op, side, outer, o0, base in (
                        ("A", spec.a, p.a, spec.m, m0, a_base), ("B", spec.b, p.b, spec.n, n0, b_base)):
                    origins = box_origins(side, es)
                    stage = b.i32_add(smem, b.i32_add(b.i32(base), b.i32_mul(b.to_i32(s), b.i32(side.stage_bytes))))
                    if which == "B" and cl > 1:  # this rank's share of the boxes, to both CTAs
                        share = side.nbox // cl
                        step_off, step_shift = origins[1][0], origins[1][1]
                        for jj in range(share):
                            j = b.add(b.mul(rank, c(share)), c(jj))
                            dst = b.i32_add(stage, b.i32_mul(b.to_i32(j), b.i32(step_off)))
                            at = coords(op, outer, b.add(o0, b.mul(j, c(step_shift))), k0, bz, 0)
                            b.tma_load(which, dst, at, full(s), multicast=(1 << cl) - 1)
                        continue
                    for off, shift in origins:
                        dst = b.i32_add(stage, b.i32(off))
                        b.tma_load(which, dst, coords(op, outer, o0, k0, bz, shift), full(s))

            b.loop(c(0), c(nk), body)

        b.when(b.eq(tid, c(0)), lambda: b.loop(c(0), mine, one_tile))

    def release(s: Any) -> None:  # 4c: a stage is free in this CTA (and, clustered, the peer's)
        if cl == 1:
            b.mbar_arrive(empty(s))
        for r in range(cl if cl > 1 else 0):
            b.mbar_arrive_remote(empty(s), c(r))

    # 4. consumers
    def consumer() -> None:
        if p.maxnreg:
            b.asm(f"setmaxnreg.inc.sync.aligned.u32 {p.regs[1]};")
        t = b.rem(tid, c(WG))
        warp, lane = b.div(t, c(32)), b.rem(t, c(32))
        g, tq = b.div(lane, c(4)), b.rem(lane, c(4))
        cw = b.sub(wg, c(1))  # consumer index: rows cw*64 .. +63 of the tile
        frag = [(i, q) for i in range(p.bn // 8) for q in range(4)]
        if p.a_regs:  # 4b': this thread's A fragment (FRAG_A8: rows g, g + 8; k t, t + 4) is
            # rows pr, pr + 1 of the warpgroup's 64 (a_pair_row), 8 bytes at k t and at t + 4
            pr = a_pair_row(b, warp, g)
            a_offs = [b.to_i32(a_frag_offset(b, p.a, es, b.add(b.mul(cw, c(64)), pr), b.add(tq, c(dk))))
                      for dk in (0, 4)]
            local = b.add(b.mul(cw, c(64)), pr)  # the tile row of FRAG_C's row rq: local + rq / 8
            row_of = (lambda rq: rq // 8)  # noqa: E731
        else:
            a_half = desc_layout(p.a, es, 64, 0)[0]  # bytes from consumer 0's rows of A to 1's
            local = b.add(b.mul(cw, c(64)), b.add(b.mul(warp, c(16)), g))
            row_of = (lambda rq: rq)  # noqa: E731
        leader = b.eq(t, c(0))  # one arrival per consumer warpgroup

        def one_tile(tl: Any) -> None:
            m0, n0, bz = tile(tl)
            b.batch = bz
            rows = b.add(m0, local)
            cols = b.add(n0, b.mul(tq, c(2)))
            placed = {} if conv is None else {  # each of the thread's rows' place in C, once
                r: conv.rows(m0, b.add(local, c(r))) for r in sorted({row_of(rq) for rq, _ in FRAG_C})}

            def at(i: int, q: int) -> tuple[Any, Any]:
                rq, cq = FRAG_C[q]
                row = placed[row_of(rq)] if placed else b.add(rows, c(row_of(rq)))
                return row, b.add(cols, c(8 * i + cq))

            ep_pre = None  # 5c: the epilogue's loads along M, issued before the main loop
            if epilogue_of(spec) is not None and prefetch(p) and not p.ring:
                ep_pre = b.epilogue_prefetch([at(i, q) for i, q in frag[:prefetch(p)]])
            if spec.fill:
                init = b.init_f32()
                accs = [init] * len(frag)
                if os.environ.get("GAC_WGMMA_FILL_COPIES") != "0":  # (bisects) each its own
                    # register, set here: else LLVM sinks a constant fill's copies past
                    # wgmma.fence into a peeled first slice, and ptxas makes the wgmmas wait
                    # (C7519: ResNet-50's 1x1s; C7520, serialized: the conv's producers)
                    accs = [b.opaque_f32(init) for _ in frag]
            else:
                accs = [b.load_c(*at(i, q)) for i, q in frag]
            first = b.mul(tl, c(nk))

            def body(kt: Any, accs: list) -> list:
                it = b.add(first, kt)
                s, phase = stage_phase(it)
                b.mbar_wait(full(s), phase)  # 4a
                if gather is not None:  # 4a': cp.async wrote it (generic proxy), wgmma reads it
                    b.asm("fence.proxy.async.shared::cta;")
                if p.a_regs:  # 4b'
                    a_stage = b.i32_add(smem, b.i32_add(b.i32(a_base), b.i32_mul(b.to_i32(s), b.i32(p.a.stage_bytes))))
                    regs = [[x for off in a_offs
                             for x in b.lds_tf32x2(b.i32_add(a_stage, b.i32_add(off, b.i32(kstep * p.ks * SWIZZLE))))]
                            for kstep in range(p.bk // p.ks)]
                b.asm("wgmma.fence.sync.aligned;")  # 4b
                for kstep in range(p.bk // p.ks):
                    da = regs[kstep] if p.a_regs else b.desc(smem, a_base, p.a, s, desc_layout(p.a, es, 0, kstep), cw, a_half)
                    db = b.desc(smem, b_base, p.b, s, desc_layout(p.b, es, 0, kstep), None, 0)
                    accs = b.wgmma(accs, da, db)
                b.asm("wgmma.commit_group.sync.aligned;")
                # 4c: the previous slice's group is done once at most this one is in flight
                b.asm("wgmma.wait_group.sync.aligned 1;", accs)
                prev = b.rem(b.add(it, c(S - 1)), c(S))
                b.when(b.and_(leader, b.lt(c(0), kt)), lambda: release(prev))
                return accs

            types = ["f32"] * len(accs)
            if p.a_regs:  # 4b': A in registers that a wgmma reads until its group
                # completes (PTX: rewriting them earlier is undefined; 4 % off on the H200): two
                # slices per iteration, so each loads its fragments into its own set of registers
                # while the other's wgmmas run, and a set is rewritten only two slices later,
                # after 4c waited for the group that read it. An odd count's first slice runs
                # alone, before the loop (after it, ptxas serialized every wgmma)
                odd = nk % 2
                if odd:
                    accs = body(c(0), accs)

                def two(j: Any, accs: list) -> list:
                    kt = b.add(b.mul(j, c(2)), c(odd))
                    return body(b.add(kt, c(1)), body(kt, accs))

                accs = b.for_(c(0), c(nk // 2), c(1), accs, types, two)
            else:
                accs = b.for_(c(0), c(nk), c(1), accs, types, body)
            b.asm("wgmma.wait_group.sync.aligned 0;", accs)
            last = b.rem(b.add(first, c(nk - 1)), c(S))
            b.when(leader, lambda: release(last))
            # 5. store (the producer is already loading the next tile)
            if p.ring:  # 5d (also C itself, wgmma_plan.stage_c)
                ring_epilogue(b, p, tl, ring_slot, rfull, rempty, m0, n0, cw, t, local, tq, accs)
                return
            if epilogue_of(spec) is not None:  # 5c
                b.epilogue_store_all([at(i, q) for i, q in frag], accs, ep_pre)
                return
            if p.staged_store:  # 5b: rounded pairs into this warpgroup's staging rows, then
                # 16-byte row chunks to C, consecutive threads on consecutive chunks
                mine_rows = b.i32_add(smem, b.i32_add(b.i32(bar_base + 16 * S),
                                                      b.i32_mul(b.to_i32(cw), b.i32(64 * p.stage_row))))
                b.asm("bar.sync $0, 128;", args=[(b.i32_add(b.to_i32(cw), b.i32(1)), "r", "i32")])
                for j, (i, q) in enumerate(frag):
                    if q % 2 == 0:
                        r_loc = b.add(b.sub(local, b.mul(cw, c(64))), c(row_of(FRAG_C[q][0])))
                        c_loc = b.add(b.mul(tq, c(2)), c(8 * i))
                        at_ = b.i32_add(mine_rows, b.i32_add(b.i32_mul(b.to_i32(r_loc), b.i32(p.stage_row)),
                                                             b.i32_mul(b.to_i32(c_loc), b.i32(p.c_bytes))))
                        b.smem_store_pair(at_, accs[j], accs[j + 1])
                b.asm("bar.sync $0, 128;", args=[(b.i32_add(b.to_i32(cw), b.i32(1)), "r", "i32")])
                per_row = p.bn * p.c_bytes // 16
                for k in range(64 * per_row // WG):
                    idx = b.add(t, c(k * WG))
                    r_loc, ch = b.div(idx, c(per_row)), b.rem(idx, c(per_row))
                    at_ = b.i32_add(mine_rows, b.i32_add(b.i32_mul(b.to_i32(r_loc), b.i32(p.stage_row)),
                                                         b.i32_mul(b.to_i32(ch), b.i32(16))))
                    b.store_chunk(at_, b.add(m0, b.add(b.mul(cw, c(64)), r_loc)),
                                  b.add(n0, b.mul(ch, c(16 // p.c_bytes))))
                return
            for j, (i, q) in enumerate(frag):
                if p.row_pairs:  # (a_regs) rows pr, pr + 1: FRAG_C's q and q + 2
                    if q < 2:
                        b.store_pair(*at(i, q), accs[j], accs[j + 2])
                elif p.pair_store:
                    if q % 2 == 0:
                        b.store_pair(*at(i, q), accs[j], accs[j + 1])
                else:
                    b.store_c(*at(i, q), accs[j])

        b.loop(c(0), mine, one_tile)

    b.if_else(b.eq(wg, c(0)), producer, consumer)
    if cl > 1:  # no CTA leaves while its peer may still multicast into it or arrive on it
        b.cluster_barrier()


def ring_epilogue(b: WgmmaText, p: Plan, tl: Any, ring_slot: Any, rfull: Any, rempty: Any, m0: Any, n0: Any,
                  cw: Any, t: Any, local: Any, tq: Any, accs: list) -> None:
    """5d: the fused epilogue through tile tl's buffer: per accumulator pair, the residual pair
    from the buffer (TMA put it there, 3c), the per-column operands from global memory, the
    body's result written back over the residual; then the warpgroup's 64 rows to Z in 16-byte
    row chunks, consecutive threads on consecutive chunks (whole 32-byte sectors and 128-byte
    lines, where the fragment's pairs wrote 8 rows x 16 bytes per warp instruction). Without an
    epilogue (wgmma_plan.stage_c), C's rounded accumulators go the same way."""
    c, ep = b.const, epilogue_of(b.spec)
    at, r, phase = ring_slot(tl)
    sync = [(b.i32_add(b.to_i32(cw), b.i32(1)), "r", "i32"), (b.i32(WG), "r", "i32")]
    if p.res >= 0:
        b.mbar_wait(rfull(r), phase)
    elif p.ring == 1:  # the previous tile's chunks are out before the buffer is rewritten
        b.asm("bar.sync $0, $1;", args=sync)
    res_elem = ep.inputs[p.res][0].elem if p.res >= 0 else None
    out_elem = ep.out[0].elem if ep is not None else b.spec.c.elem
    inputs = ep.inputs if ep is not None else ()
    n_col = sum(1 for k, x in enumerate(inputs) if x is not None and k != p.res)
    per = max(1, 24 // max(1, n_col))  # columns pairs whose operand loads go together
    cols_i = list(range(p.bn // 8))
    for s0 in range(0, len(cols_i), per):
        part = cols_i[s0:s0 + per]
        pts = [(b.add(m0, local), b.add(n0, b.add(b.mul(tq, c(2)), c(8 * i + cq)))) for i in part for cq in (0, 1)]
        loaded = b.column_loads(pts, p.res) if n_col else [{} for _ in pts]
        # FRAG_C's q = 0, 1 (row g) and 2, 3 (row g + 8): the chunk's residual pairs first (a
        # shared load after a shared store waits for it), then the body and the stores
        where = [(ii, i, rq, b.i32_add(at, b.to_i32(ring_offset(b, b.add(local, c(rq)),
                                                             b.add(b.mul(tq, c(2)), c(8 * i)), p.out_es))))
                 for ii, i in enumerate(part) for rq in (0, 8)]
        rvs = [b.lds_pair(addr, res_elem) if res_elem else (None, None) for *_, addr in where]
        for (ii, i, rq, addr), rv in zip(where, rvs):
            j = 4 * i + (2 if rq else 0)
            ys = []
            for h in (0, 1):
                if ep is None:
                    ys.append(b.round_to(accs[j + h], out_elem))
                    continue
                args = [None if x is None else rv[h] if k == p.res else loaded[2 * ii + h][k]
                        for k, x in enumerate(inputs)]
                ys.append(b.body_value(accs[j + h], args))
            b.sts_pair(addr, ys[0], ys[1], out_elem)
    if p.tma_store:  # the warpgroup's rows of each box, by its first thread, once all wrote
        # them (and made them visible to the async proxy); the buffer is free again once the
        # stores read it (the residual's next tile may come)
        b.asm("fence.proxy.async.shared::cta;")
        b.asm("bar.sync $0, $1;", args=sync)

        def store() -> None:
            for j in range(p.bn * p.out_es // SWIZZLE):
                box = b.i32_add(at, b.i32_add(b.i32(j * BM * SWIZZLE), b.i32_mul(b.to_i32(cw), b.i32(64 * SWIZZLE))))
                b.tma_store("Z", box, [b.add(n0, c(j * SWIZZLE // p.out_es)), b.add(m0, b.mul(cw, c(64)))])
            b.asm("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;")
            if p.res >= 0:
                b.mbar_arrive(rempty(r))

        b.when(b.eq(t, c(0)), store)
        return
    b.asm("bar.sync $0, $1;", args=sync)
    per_row = p.bn * p.out_es // 16
    chunks = []
    for k in range(64 * per_row // WG):  # the thread's chunks out of the buffer, then (the
        # buffer released: its next tile's residual comes by TMA, the async proxy) to Z
        idx = b.add(t, c(k * WG))
        tr, ch = b.add(b.mul(cw, c(64)), b.div(idx, c(per_row))), b.rem(idx, c(per_row))
        tc = b.mul(ch, c(16 // p.out_es))
        addr = b.i32_add(at, b.to_i32(ring_offset(b, tr, tc, p.out_es)))
        chunks.append((b.lds_chunk(addr), b.add(m0, tr), b.add(n0, tc)))
    if p.res >= 0:
        b.asm("fence.proxy.async.shared::cta;")
        b.mbar_arrive(rempty(r))
    for regs, row, col in chunks:
        b.store_z_chunk(regs, row, col)


def _rows_map(name: str, buf: str, op: Any, spec: Spec, rows: int, span: int) -> list[str]:
    """5d: the TMA descriptor %tm<name>d of epilogue operand `op` (memref `buf`) as a row-major
    M x N view, in boxes of [rows][span] (128 bytes)."""
    off = op.offset + op.const
    view = f"memref<{spec.M}x{spec.N}x{op.elem}, strided<[{op.coef[spec.m]}, 1], offset: {off}>>"
    return [f"%v{name} = memref.reinterpret_cast {buf} to offset: [{off}], sizes: [{spec.M}, {spec.N}], "
            f"strides: [{op.coef[spec.m]}, 1] : {op.type} to {view}",
            f"%u{name} = memref.cast %v{name} : {view} to memref<*x{op.elem}>",
            f"%bx{name}0 = arith.constant {rows} : index", f"%bx{name}1 = arith.constant {span} : index",
            f"%tm{name}d = nvgpu.tma.create.descriptor %u{name} box[%bx{name}0, %bx{name}1] : memref<*x{op.elem}> -> "
            + tensor_map_type([rows, span], op.elem)]


def m_tile_count(spec: Spec, conv: Any = None) -> int:
    """M tiles of the kernel: BM rows of M each, or a conv Window's rectangles (more than M / BM
    where they overhang the image: the units past M / BM would otherwise redo the first ones)."""
    return conv.m_tiles if conv is not None else -(-spec.M // BM)


def tile_origin(b: Any, u: Any, tn: int, tmc: int, cl: int, rank: Any, bn: int) -> tuple[Any, Any, Any]:
    """1. Work unit u -> (m0, n0, batch index) of its tile (N tiles fastest, then the tmc
    (pairs of) M tiles, then the batch); cluster rank `rank` of `cl` takes M tile cl*pm + rank."""
    c = b.const
    bz, rest = b.div(u, c(tn * tmc)), b.rem(u, c(tn * tmc))
    mt = b.add(b.mul(b.div(rest, c(tn)), c(cl)), rank)
    return b.mul(mt, c(BM)), b.mul(b.rem(rest, c(tn)), c(bn)), bz


def box_dims(op: Operand, side: Side, spec: Spec) -> list[int]:
    """The TMA box per memref dim (outermost first): the inner extent on the contiguous dim,
    1 on the batch dim, the other extent on the remaining one."""
    return [side.box[0] if i == len(op.dims) - 1 else 1 if d in spec.batch else side.box[1]
            for i, d in enumerate(op.dims)]


def tensor_map_type(box: list[int], elem: str) -> str:
    tile = "x".join(map(str, box)) + f"x{elem}"
    return (f"!nvgpu.tensormap.descriptor<tensor = memref<{tile}, 3>, swizzle = swizzle_128b, "
            "l2promo = l2promo_256b, oob = zero, interleave = none>")


def tensor_map_lines(which: str, src: str, src_type: str, box: list[int], elem: str) -> tuple[list[str], str]:
    """The host lines making %tm<which>d, the TMA descriptor of view `src` with `box` (outermost
    first), and the kernel's line casting it to %tm<which>, the pointer tma_load reads."""
    tm = tensor_map_type(box, elem)
    lines = [f"%u{which} = memref.cast {src} : {src_type} to memref<*x{elem}>"]
    lines += [f"%bx{which}{i} = arith.constant {n} : index" for i, n in enumerate(box)]
    lines.append(f"%tm{which}d = nvgpu.tma.create.descriptor %u{which} box["
                 + ", ".join(f"%bx{which}{i}" for i in range(len(box))) + f"] : memref<*x{elem}> -> {tm}")
    return lines, f"%tm{which} = builtin.unrealized_conversion_cast %tm{which}d : {tm} to !llvm.ptr"


def launch_lines(p: Plan) -> list[str]:
    """The gpu.launch's opening: p.grid CTAs of THREADS, p.smem_bytes of dynamic shared memory."""
    gx, gy, gz = p.grid
    return [f"%one = arith.constant 1 : index\n%gx = arith.constant {gx} : index",
            f"%gy = arith.constant {gy} : index\n%gz = arith.constant {gz} : index",
            f"%nt = arith.constant {THREADS} : index", f"%smem = arith.constant {p.smem_bytes} : i32",
            ("gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
             "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
             "dynamic_shared_memory_size %smem {")]


def template(spec: Spec, p: Plan, init_type: str | None = None) -> str:
    """`func.func @tmpl(%A, %B, %C, [%E.., %Z,] %init)`: the two TMA descriptors created on the host
    (read into the host program as data: built by the runtime once per buffer address), then
    the gpu.launch (see the banner). `init_type`: the fill value's type (default C's; f32 when
    C is the f16/bf16 buffer of a fused rounding)."""
    init_type = init_type or spec.c.elem
    b = WgmmaText(spec, p, init_type)
    _kernel(b, spec, p)
    e = _elem(spec)
    ep = epilogue_of(spec)  # its operands (E<k>, Z) follow C, read through flat views
    extra = [] if ep is None else [(f"E{k}", x[0]) for k, x in enumerate(ep.inputs) if x is not None] + [("Z", ep.out[0])]
    flat = [f"%{n}f = memref.reinterpret_cast %{n} to offset: [{op.offset}], sizes: [{op.span}], strides: [1] "
            f": {op.type} to {op.flat}" for n, op in extra]
    head = [f"func.func @tmpl(%A: {spec.a.type}, %B: {spec.b.type}, %C: {spec.c.type}, "
            + "".join(f"%{n}: {op.type}, " for n, op in extra) + f"%init: {init_type}) {{"]
    maps = [tensor_map_lines(which, f"%{which}", op.type, box_dims(op, side, spec), e)
            for which, op, side in (("A", spec.a, p.a), ("B", spec.b, p.b))]
    head += [x for m in maps for x in m[0]]
    casts = [m[1] for m in maps]
    rows_maps = {}
    if p.res >= 0:  # 5d: the residual as a row-major M x N view, read in [BM][128 bytes] boxes
        op = ep.inputs[p.res][0]
        rows_maps["R"] = tensor_map_type([BM, SWIZZLE // p.out_es], op.elem)
        head += _rows_map("R", f"%E{p.res}", op, spec, BM, SWIZZLE // p.out_es)
    if p.tma_store:  # Z likewise, stored in [64 rows][128 bytes] boxes (a warpgroup's rows)
        rows_maps["Z"] = tensor_map_type([64, SWIZZLE // p.out_es], ep.out[0].elem)
        head += _rows_map("Z", "%Z", ep.out[0], spec, 64, SWIZZLE // p.out_es)
    head += launch_lines(p)
    casts += [f"%tm{w} = builtin.unrealized_conversion_cast %tm{w}d : {t} to !llvm.ptr" for w, t in rows_maps.items()]
    return "\n".join(head + casts + flat + b.const_lines + b.lines + ["gpu.terminator\n}\nreturn\n}"])

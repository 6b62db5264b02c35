"""Flash attention on Hopper (sm_90a) for f16 / bf16: O = softmax(Q Kᵀ · scale) V with
warpgroup `wgmma` (FlashAttention-3's shape: S = Q Kᵀ from shared memory, P V with P as the
register A operand), K and V fed by TMA through an mbarrier ring. What it does not take (f32,
masks, head dims outside {16, 32, 64, 128}, strides TMA cannot read, sm_80) stays with the
mma.sync kernel of flash_attention.py, whose Spec and Buf this kernel shares.

A CTA of 1 + WGS warpgroups computes work tiles of BM = 64·WGS query rows of one batch index
(persistent: bid, bid + grid, ..., K/V tiles numbered across them; the producer loads the next
work tile's Q (after q_empty) and K/V while the consumers finish one): warpgroup 0 is
the producer, its thread 0 issues every TMA load; consumer warpgroup c (1..WGS) owns rows
64(c - 1).. of the tile, and in it warp w rows 16w + g and 16w + g + 8 (lane l: g = l / 4,
t = l % 4; the wgmma accumulator layout, as FRAG_C of cuda_mma per 8 columns).

  1. locate    work tile -> (query tile m0, batch index); the number of key tiles (causal:
               those with a key <= the tile's last row)
  2. barriers  thread 0 initializes q_full (1 arrival + Q's bytes), q_empty, k_full[s] and v_full[s]
               (1 + the tile's bytes), k_empty[s] and v_empty[s] (one arrival per consumer) for
               each stage s: K and V of a stage are freed apart (FA3's two pipelines)
  3. producer  registers given back (setmaxnreg.dec); thread 0: Q's boxes on q_full; then per
               key tile kt (stage s = kt % STAGES): 3a. wait k_empty[s] (a fresh one passes),
               K's boxes on k_full[s]; 3b. wait v_empty[s], V's boxes on v_full[s] (rows past S
               read as zeros: TMA's out-of-range fill)
  4. consumers registers raised (setmaxnreg.inc); wait q_full; S(0) = Q K(0)ᵀ (4a), waited for,
               K(0) freed; then per key tile kt, in FA3's intra-warpgroup order (the last tile
               peeled: it alone masks keys past S):
               4b. mask      keys past S (last tile), causal (key > row; only in tiles that
                   reach past a warp's first row: a warp-uniform branch) -> -inf; scores kept
                   in base 2 (the scale · log2 e folded into one fma per score, as mma.sync's)
               4c. row max   lane values, then the quad (shfl.xor 1, 2); lazy rescale: the max
                   moves (and corr = exp2(m - m_new) != 1) only when a row max of the warp grew
                   by more than RESCALE (flash_attention.RESCALE; a warp-uniform branch)
               4d. P         p = exp2(s·c - m·c) (ex2.approx; optionally some by EXP2_POLY on the
                   FMA pipe), rounded to the operand type in pairs: the
                   accumulators of n-tiles 2kk, 2kk + 1 are the A fragment of k-step kk;
                   4f. l = l·corr + Σp (onesum, the default: none; l is P V's column Dv,
                   V's tile continued by a box of ones). 4b-4d run while P V of tile kt - 1
                   is in flight (as written: ptxas sinks the exponentials below its wait,
                   between S(kt + 1)'s wgmma)
               4g. retire    wait for every group: P V(kt - 1) done (its P fragments held in
                   their registers through the wait), V(kt - 1) freed; O *= corr where it moved
               4a. S(kt + 1) wait k_full; D/16 wgmma m64nBNk16 (both operands K-major in
                   shared memory); commit
               4e. O += P V  wait v_full; BN/16 wgmma m64nNk16 (N = DV, onesum DV + 8), A = P(kt)
                   from registers, B = V's tile N-major (the transpose bit); commit
               then wait for S(kt + 1) only (P V(kt) stays in flight) and free K(kt + 1)
  5. finish    (Q freed once the last S retired) wait for all, V freed; l over the quad; O / l (0 where l == 0), rounded, stored

Shared memory (dynamic, 1024-byte aligned base): Q, then STAGES K tiles, STAGES V tiles (onesum,
V of two boxes: each followed by a box of ones), the box of ones (onesum, V of one box: one for
every stage, each stage's descriptor with its own LBO), then the barriers. A tile is one or more TMA boxes of [rows][SW bytes] (SW: the swizzle span, 128
bytes, or the whole row where it is 32 or 64 bytes), side by side; K-major (Q, K) or N-major (V)
canonical layouts as wgmma_gemm's descriptors, generalized to the 32/64-byte swizzles
(`desc_layout`, tested against a numpy model of TMA's write and wgmma's read).

The body (`kernel`) is written once against a builder: flash_wgmma_text.py emits MLIR;
flash_wgmma_twin.py runs it on the CPU (warpgroups as threads, lanes in lockstep, wgmma and TMA
modelled on a byte array of shared memory).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from gac_torch.kernels.flash_attention import LOG2E, RESCALE, Spec, tree

WG = 128
ALIGN = 1024
SMEM_LIMIT = 227 * 1024
PRODUCER_REGS = 40
HEAD_DIMS = (16, 32, 64, 128)
# 2^f on [-1/2, 1/2] (relative error 7.5e-5, under P's rounding to f16 / bf16): `poly` of every 8
# exponentials of a thread go to the FMA pipe (FA4's split; MUFU does 16 a clock an SM)
EXP2_POLY = (0.9999282805831511, 0.6932609262753326, 0.24260790199986387, 0.05517025007951412)
EXP2_MAGIC = 12582912.0  # 1.5 · 2^23: x + it rounds x to an integer in the low mantissa bits
SM_COUNT_HINT = 132


@dataclass(frozen=True)
class Plan:
    wgs: int  # consumer warpgroups (64 query rows each)
    bn: int  # keys per tile
    stages: int
    sw_qk: int  # swizzle span of Q's and K's rows (bytes)
    sw_v: int
    grid: tuple[int, int, int]  # (CTAs, 1, 1): each takes work tiles bid, bid + CTAs, ...
    units: int  # work tiles: BM query rows of one batch index (query tiles fastest)
    dv: int = 64  # V's head dim
    pingpong: bool = False  # the consumers take turns issuing their wgmma (a ring of named barriers)
    poly: int = 0  # of every 8 exponentials, this many by a polynomial on the FMA pipe
    serial: bool = False  # P V waited for at once (bisects the in-flight overlap)
    onesum: bool = False  # row sums by the tensor cores: P V with 8 more columns of ones in V

    @property
    def bm(self) -> int:
        return 64 * self.wgs

    @property
    def threads(self) -> int:
        return WG * (1 + self.wgs)

    @property
    def producer_regs(self) -> int:  # (3 consumers: FA3's 24, else 160-register consumers spill)
        return 24 if self.wgs >= 3 else PRODUCER_REGS

    @property
    def consumer_regs(self) -> int:  # setmaxnreg: producer + consumers within 64K registers
        return min(240, (65536 - WG * self.producer_regs) // (WG * self.wgs) // 8 * 8)

    @property
    def nv(self) -> int:  # P V's N: Dv, + 8 columns of ones (onesum)
        return self.dv + 8 * self.onesum


@dataclass(frozen=True)
class Layout:
    """Byte offsets from the aligned dynamic shared-memory base."""

    q: int
    k: int
    v: int
    bars: int
    k_stage: int
    v_stage: int  # a V stage: V's boxes (onesum, V of 2 boxes: then a box of ones)
    total: int
    v_bytes: int = 0  # what TMA writes into a V stage
    ones: int = 0  # onesum, V of one box: the box of ones all stages share (after the last)


def swizzle_span(cols: int) -> int:
    """The swizzle span for rows of `cols` 16-bit elements: the whole row up to 128 bytes."""
    return min(128, 2 * cols)


def layout(spec: Spec, p: Plan) -> Layout:
    """onesum: P V's columns Dv..Dv+7 read a box of ones one LBO past V's last box: with V in
    one box, one box after every stage (each stage's descriptor its own LBO), else one a stage."""
    q = p.bm * 2 * spec.D
    ks, vb, box = p.bn * 2 * spec.D, p.bn * 2 * spec.Dv, p.bn * p.sw_v
    shared = p.onesum and vb == box
    vs = vb + box * (p.onesum and not shared)
    ones = q + p.stages * (ks + vs)
    bars = ones + box * shared
    return Layout(0, q, q + p.stages * ks, bars, ks, vs, bars + 8 * (2 + 4 * p.stages) + ALIGN, vb,
                  ones if shared else 0)


def ones_boxes(spec: Spec, p: Plan) -> tuple[list[int], int]:
    """(byte offsets, bytes) of the ones boxes (onesum), every byte pair a 1.0 of the operand
    type (swizzled or not, the same)."""
    lay, box = layout(spec, p), p.bn * p.sw_v
    if lay.ones:
        return [lay.ones], box
    return [lay.v + s * lay.v_stage + lay.v_bytes for s in range(p.stages)], box


def _tma_ok(b) -> bool:
    """TMA reads the buffer: contiguous rows, other strides 16-byte multiples, <= 5 dims."""
    return b.strides[-1] == 1 and all(s * 2 % 16 == 0 for s in b.strides[:-1]) and len(b.shape) <= 5


def plan(spec: Spec, wgs: int | None = None, bn: int | None = None, stages: int | None = None,
         persistent: bool | None = None, pingpong: bool | None = None, onesum: bool | None = None) -> Plan | None:
    """Tiling for `spec`, or None when this kernel does not take it. `persistent`: one CTA an
    SM looping over work tiles (the producer loads the next tile's Q and K while the consumers
    finish one); else a CTA per work tile. `pingpong`: the consumers take turns issuing their
    wgmma (2 or 3: a ring, FA3's warp scheduler barriers). Defaults (and
    GAC_FLASH_WGMMA_{WGS,BN,STAGES,PERSISTENT,PINGPONG} while unmeasured):
    2 consumers (3 where D = Dv = 64, not causal, L >= 768), BN = 128 (Dv = 128: 112, causal
    80), 4 stages (3 or 2 where 4 do not fit),
    persistent, no pingpong, row sums by the tensor cores where Dv <= 64 (GAC_FLASH_WGMMA_ONESUM
    =0 / 1: by BN / 2 fadd a thread and tile / by the tensor cores); GAC_FLASH_WGMMA_POLY=k: k of every 8 exponentials by EXP2_POLY;
    GAC_FLASH_WGMMA_SERIAL=1 (bisecting): P V waited for as soon as issued."""
    if spec.kind not in ("f16", "bf16") or spec.mask is not None or spec.mask_kind != "none":
        return None
    if spec.D not in HEAD_DIMS or spec.Dv not in HEAD_DIMS or min(spec.L, spec.S) < 1:
        return None
    if any(x.elem != spec.elem for x in (spec.q, spec.k, spec.v)) or spec.o.elem not in ("f16", "bf16", "f32"):
        return None
    if not all(_tma_ok(x) for x in (spec.q, spec.k, spec.v)) or spec.o.strides[-1] != 1:
        return None
    # (3 consumers at head dim 64, FA3's 192-row tiles there: a third less K/V read from L2 a
    # query row, 3 warps a scheduler to hide each other's latencies; long non-causal rows only)
    three = spec.D == spec.Dv == 64 and not spec.causal and spec.L >= 4 * 192
    wgs = wgs or int(os.environ.get("GAC_FLASH_WGMMA_WGS", 0)) or (3 if three else 2)
    # (where O takes 64 registers, BN = 128 spilled at 232 registers a thread (ptxas sm_90a):
    # 112, or 80 with the causal mask's branch)
    bn = bn or int(os.environ.get("GAC_FLASH_WGMMA_BN", 0)) or (128 if spec.Dv <= 64 else 80 if spec.causal else 112)
    # (3 stages: V(j + 1) may load from the retirement of P V(j - 1) on, ~1.5 tiles ahead of its
    # use with 2; one CTA an SM either way, so the shared memory costs nothing)
    # 4 stages where they fit: stage and phase of a tile by shifts, not a 64-bit division by 3
    want = stages or int(os.environ.get("GAC_FLASH_WGMMA_STAGES", 0)) or 4
    if persistent is None:
        persistent = os.environ.get("GAC_FLASH_WGMMA_PERSISTENT", "1") != "0"
    if pingpong is None:
        pingpong = os.environ.get("GAC_FLASH_WGMMA_PINGPONG", "0") == "1"
    if onesum is None:  # (by default where V is one box: the ones box shared, no stage lost)
        onesum = os.environ.get("GAC_FLASH_WGMMA_ONESUM", "auto" if spec.Dv <= 64 else "0") != "0"
    units = -(-spec.L // (64 * wgs)) * math.prod(spec.batch)
    if units > 2**31 - 1:
        return None
    grid = (min(units, SM_COUNT_HINT) if persistent else units, 1, 1)
    for st in range(want, 1, -1):
        p = Plan(wgs, bn, st, swizzle_span(spec.D), swizzle_span(spec.Dv), grid, units, spec.Dv,
                 pingpong and wgs >= 2, min(8, int(os.environ.get("GAC_FLASH_WGMMA_POLY", 0))),
                 os.environ.get("GAC_FLASH_WGMMA_SERIAL") == "1", onesum)
        if layout(spec, p).total <= SMEM_LIMIT:
            return p
    return None


# --------------------------------------------------------------------------------------------
# layout math (ints only: the text builder bakes it in, the tests check it against a model)


def desc_layout(rows: int, sw: int, k_major: bool, kstep: int, ks: int = 16, es: int = 2) -> tuple[int, int, int]:
    """(byte offset, leading byte offset, stride byte offset) of the wgmma descriptor for k-step
    `kstep` of a tile stored as boxes [rows][sw bytes] side by side (box j holds columns
    j·sw/es..). K-major (rows are the M/N dim, columns K): the k-step lies in box
    kstep·ks·es // sw, at its byte within the row; 8-row groups SBO = 8·sw apart, LBO unused.
    N-major (rows are K, columns N): a k-step is ks rows down, 8-row K groups SBO = 8·sw apart,
    LBO = one box between N chunks of sw bytes."""
    if k_major:
        byte = kstep * ks * es
        return (byte // sw) * rows * sw + byte % sw, 16, 8 * sw
    return kstep * ks * sw, rows * sw, 8 * sw


def descriptor(addr: int, lbo: int, sbo: int, sw: int) -> int:
    """The 64-bit sm_90 matrix descriptor: start, LBO, SBO in 16-byte units, the swizzle mode in
    bits 62-63 (1: 128 bytes, 2: 64, 3: 32)."""
    mode = {128: 1, 64: 2, 32: 3}[sw]
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (mode << 62)


def swizzle(offset: int, sw: int) -> int:
    """Where a `sw`-byte swizzle puts byte `offset` of an aligned tile: the 16-byte chunk index
    (sw / 16 of them) XOR the row's bits above the 128-byte line (Swizzle<log2(sw/16), 4, 3>)."""
    return offset ^ (((offset >> 7) & (sw // 16 - 1)) << 4)


def boxes(rows: int, cols: int, sw: int) -> list[tuple[int, int]]:
    """Per TMA box of a [rows][cols] 16-bit tile: (byte offset in the tile, first column)."""
    per = sw // 2
    return [(j * rows * sw, j * per) for j in range(-(-cols // per))]


# --------------------------------------------------------------------------------------------
# the kernel, once, against a builder


def kernel(b: Any, spec: Spec, p: Plan) -> None:
    c = b.const
    lay = layout(spec, p)
    BM, BN, D, DV, S = p.bm, p.bn, spec.D, spec.Dv, p.stages
    NT, NO, NA = BN // 8, DV // 8, p.nv // 8  # (NA: P V's accumulator column groups)
    neg = -math.inf
    # 1. locate: the CTA's work tiles are bid, bid + G, ... (G = the grid; one each unless
    # persistent); K/V tiles are numbered across them (`it`: stage it % S, phase (it / S) % 2)
    tid = b.tid()
    G, units = p.grid[0], p.units
    bid = b.bid(0)
    mine = b.div(b.add(b.sub(c(units), bid), c(G - 1)), c(G))
    tm = -(-spec.L // BM)
    nkt = -(-spec.S // BN)

    def locate(i: Any) -> tuple[Any, list[Any], Any]:
        """Work tile i of this CTA: (first query row, batch indices, key tiles)."""
        w = b.add(bid, b.mul(i, c(G)))
        m0, rest = b.mul(b.rem(w, c(tm)), c(BM)), b.div(w, c(tm))
        bidx = []
        for j in range(len(spec.batch) - 1, -1, -1):
            bidx.insert(0, rest if j == 0 else b.rem(rest, c(spec.batch[j])))
            if j:
                rest = b.div(rest, c(spec.batch[j]))
        nt = b.min(c(nkt), b.div(b.add(m0, c(BM + BN - 1)), c(BN))) if spec.causal else c(nkt)
        return m0, bidx, nt

    smem = b.smem_base()

    def at(off: int, s: Any = None, stride: int = 0) -> Any:  # i32 shared address
        return b.smem_addr(smem, off, s, stride)

    q_full, q_empty = at(lay.bars), at(lay.bars + 8)
    k_full = lambda s: at(lay.bars + 16, s, 8)  # noqa: E731
    v_full = lambda s: at(lay.bars + 16 + 8 * S, s, 8)  # noqa: E731
    k_empty = lambda s: at(lay.bars + 16 + 16 * S, s, 8)  # noqa: E731
    v_empty = lambda s: at(lay.bars + 16 + 24 * S, s, 8)  # noqa: E731

    def stage(it: Any) -> tuple[Any, Any]:
        return b.rem(it, c(S)), b.rem(b.div(it, c(S)), c(2))

    # 2. barriers
    def init() -> None:
        b.mbar_init(q_full, 1)
        b.mbar_init(q_empty, p.wgs)
        for s in range(S):
            b.mbar_init(k_full(c(s)), 1)
            b.mbar_init(v_full(c(s)), 1)
            b.mbar_init(k_empty(c(s)), p.wgs)
            b.mbar_init(v_empty(c(s)), p.wgs)
        b.mbar_fence_init()

    b.when(b.eq(tid, c(0)), init)
    if p.onesum:  # the ones boxes, once (TMA never writes there)
        offs, nbytes = ones_boxes(spec, p)
        b.fill_ones([at(o) for o in offs], nbytes)
    b.barrier()
    wg = b.div(tid, c(WG))

    def load(which: str, dst: int, s: Any, stride: int, rows: int, cols: int, sw: int, r0: Any,
             bidx: list[Any], bar: Any) -> None:
        for off, col in boxes(rows, cols, sw):
            b.tma_load(which, at(dst + off, s, stride), [c(col), r0] + bidx[::-1], bar)

    # 3. producer
    def producer() -> None:
        b.setmaxnreg(False, p.producer_regs)

        def work(i: Any, carried: list[Any]) -> list[Any]:
            base = carried[0]
            m0, bidx, nt = locate(i)
            b.mbar_wait(q_empty, b.sub(c(1), b.rem(i, c(2))))  # (the consumers are done with Q)
            b.mbar_expect(q_full, BM * 2 * D)
            load("Q", lay.q, None, 0, BM, D, p.sw_qk, m0, bidx, q_full)

            def tile(kt: Any) -> None:
                s, ph = stage(b.add(base, kt))
                n0 = b.mul(kt, c(BN))
                b.mbar_wait(k_empty(s), b.sub(c(1), ph))  # 3a
                b.mbar_expect(k_full(s), lay.k_stage)
                load("K", lay.k, s, lay.k_stage, BN, D, p.sw_qk, n0, bidx, k_full(s))
                b.mbar_wait(v_empty(s), b.sub(c(1), ph))  # 3b
                b.mbar_expect(v_full(s), lay.v_bytes)
                load("V", lay.v, s, lay.v_stage, BN, DV, p.sw_v, n0, bidx, v_full(s))

            b.loop0(c(0), nt, tile)
            return [b.add(base, nt)]

        b.when(b.eq(tid, c(0)), lambda: b.loop(mine, [c(0)], work, ["index"]))

    # 4. consumers
    def consumer() -> None:
        b.setmaxnreg(True, p.consumer_regs)
        cw = b.sub(wg, c(1))
        t128 = b.rem(tid, c(WG))
        warp, lane = b.div(t128, c(32)), b.rem(t128, c(32))
        g, t = b.div(lane, c(4)), b.rem(lane, c(4))
        t2 = b.mul(t, c(2))
        r_in = b.add(b.mul(cw, c(64)), b.add(b.mul(warp, c(16)), g))  # the lane's first row in the tile
        leader = b.eq(t128, c(0))
        # descriptors: Q's rows of this consumer (64 rows: whole 8-row groups, the swizzle
        # phase unchanged), K's and V's stage 0; k-steps and stages add to the start address
        qd = b.descriptor(b.add_i32(at(lay.q), b.mul_i32(cw, 64 * p.sw_qk)), 16, 8 * p.sw_qk, p.sw_qk)
        kd0 = b.descriptor(at(lay.k), 16, 8 * p.sw_qk, p.sw_qk)
        # (a shared ones box: stage s's LBO is ones - V(s), lay.v_stage less a stage)
        vd0 = b.descriptor(at(lay.v), lay.ones - lay.v if lay.ones else BN * p.sw_v, 8 * p.sw_v, p.sw_v)
        lbo_step = lay.v_stage if lay.ones else 0
        qsteps = [desc_layout(BM, p.sw_qk, True, kk)[0] for kk in range(D // 16)]
        ksteps = [desc_layout(BN, p.sw_qk, True, kk)[0] for kk in range(D // 16)]
        vsteps = [desc_layout(BN, p.sw_v, False, kk)[0] for kk in range(BN // 16)]
        raw = spec.scale > 0  # the row max on raw scores, the scale inside exp2's fma
        sc = b.fconst(spec.scale * LOG2E)

        def release(bar: Any) -> None:
            b.when(leader, lambda: b.mbar_arrive(bar))

        # pingpong: the consumers issue their wgmma in turn (named barrier 1 + cw: a ring of 2 or
        # 3), so that one's softmax runs while another's GEMMs hold the tensor cores (FA3's
        # scheduling; its warp scheduler barriers take 3 consumers at head dim 64 too)
        def turn() -> None:
            if p.pingpong:
                b.bar_sync(b.add(cw, c(1)), 2 * WG)

        def pass_turn(more: Any) -> None:
            """The next consumer's turn; the last (wgs - 1) passes none after its very last
            issue (`more` false there), so that each barrier sees as many arrivals as syncs."""
            if not p.pingpong:
                return
            two = p.wgs == 2  # (2: the other one; the PTX as measured before the ring)
            nxt = b.sub(c(2), cw) if two else b.add(b.rem(b.add(cw, c(1)), c(p.wgs)), c(1))
            if more is None:
                b.bar_arrive(nxt, 2 * WG)
            else:
                first = b.eq(cw, c(0)) if two else b.lt(cw, c(p.wgs - 1))
                b.when(b.or_(first, more), lambda: b.bar_arrive(nxt, 2 * WG))

        def issue_s(it: Any) -> list[Any]:  # 4a
            s, ph = stage(it)
            b.mbar_wait(k_full(s), ph)
            b.wgmma_fence()
            sacc = None
            for kk in range(D // 16):
                sacc = b.wgmma_ss(sacc, b.desc_add(qd, qsteps[kk]), b.desc_add(kd0, ksteps[kk], s, lay.k_stage), BN)
            b.wgmma_commit()
            return sacc

        def issue_pv(it: Any, acc: list[Any], frags: list[list[Any]]) -> list[Any]:  # 4e
            s, ph = stage(it)
            b.mbar_wait(v_full(s), ph)
            b.wgmma_fence()
            for kk in range(NT // 2):
                acc = b.wgmma_rs(acc, frags[kk], b.desc_add(vd0, vsteps[kk], s, lay.v_stage, lbo_step), p.nv)
            b.wgmma_commit()
            return acc

        def softmax(sv: list[Any], mrow: list[Any], lrow: list[Any], kt: Any, rows: list[Any], last: bool):
            """4b-4d, 4f on tile kt's scores: (maxima, sums, correction, rescale?, P fragments)."""
            sv = list(sv)
            n0 = b.mul(kt, c(BN))
            keys = [b.add(n0, b.add(t2, c(8 * j + e))) for j in range(NT) for e in range(2)]
            for j in range(NT):  # 4b
                for q in range(4):
                    x = sv[4 * j + q] if raw else b.fmul(sv[4 * j + q], sc)
                    past = last and spec.S % BN  # (keys past S exist in the last tile only)
                    sv[4 * j + q] = b.fsel(b.ge(keys[2 * j + q % 2], c(spec.S)), b.fconst(neg), x) if past else x
            if spec.causal:  # only where the tile reaches past the warp's first row (a branch)
                def causal() -> list[Any]:
                    return [b.fsel(b.gt(keys[2 * j + q % 2], rows[q // 2]), b.fconst(neg), sv[4 * j + q])
                            for j in range(NT) for q in range(4)]
                sv = b.cond(b.warp_any(b.gt(b.add(n0, c(BN - 1)), rows[0])), causal, sv)
            mx = []  # 4c
            for h in range(2):
                m = b.fmax(mrow[h], tree(b.fmax, [sv[4 * j + q] for j in range(NT) for q in (2 * h, 2 * h + 1)]))
                m = b.fmax(m, b.shfl_xor(m, 1))
                mx.append(b.fmax(m, b.shfl_xor(m, 2)))
            grow = [b.fgt(b.fmul(b.fsub(mx[h], mrow[h]), sc) if raw else b.fsub(mx[h], mrow[h]),
                          b.fconst(RESCALE)) for h in range(2)]  # (-inf - -inf is NaN: no growth)
            pred = b.warp_any(b.or_(grow[0], grow[1]))

            def grown() -> list[Any]:
                us = [b.fsel(b.feq(x, b.fconst(neg)), b.fconst(0.0), x) for x in mx]
                return list(mx) + [b.fexp2(b.fmul(b.fsub(mrow[h], us[h]), sc) if raw else b.fsub(mrow[h], us[h]))
                                   for h in range(2)]

            out = b.cond(pred, grown, list(mrow) + [b.fconst(1.0)] * 2)
            mnew, corr = out[:2], out[2:]
            muse = [b.fsel(b.feq(x, b.fconst(neg)), b.fconst(0.0), x) for x in mnew]
            muse = [b.fmul(u, sc) if raw else u for u in muse]
            for i in range(len(sv)):  # 4d
                x = b.fsub(b.fmul(sv[i], sc) if raw else sv[i], muse[(i % 4) // 2])
                sv[i] = b.fexp2_poly(x) if i % 8 < p.poly else b.fexp2(x)
            frags = [[b.pack_i32(sv[8 * kk + 2 * r], sv[8 * kk + 2 * r + 1]) for r in range(4)]
                     for kk in range(NT // 2)]
            if p.onesum:  # (l is O's column Dv)
                return mnew, lrow, corr, pred, frags
            lnew = [b.fadd(b.fmul(lrow[h], corr[h]), tree(b.fadd, [sv[4 * j + q] for j in range(NT)
                                                                   for q in (2 * h, 2 * h + 1)])) for h in range(2)]
            return mnew, lnew, corr, pred, frags

        def retire_pv(it: Any, kt: Any, acc: list[Any], pprev: list[Any], corr: list[Any], pred: Any) -> list[Any]:
            """4g: P V of tile kt - 1 retired (its P fragments held in their registers until
            then): V's stage free; O *= corr where a row max grew (the warp-uniform branch)."""
            acc = b.wgmma_wait(0, acc, pprev)[:len(acc)]
            b.when(b.lt(c(0), kt), lambda: release(v_empty(stage(b.sub(it, c(1)))[0])))
            return b.cond(pred, lambda: [b.fmul(a, corr[(i % 4) // 2]) for i, a in enumerate(acc)], acc)

        npf = 2 * NT  # P fragment registers
        types = ["f32"] * (4 + 4 * NA + 4 * NT) + ["i32"] * npf

        def work(i: Any, carried: list[Any]) -> list[Any]:
            base = carried[0]
            m0, bidx, nt = locate(i)
            r0 = b.add(m0, r_in)
            rows = [r0, b.add(r0, c(8))]  # the lane's query rows
            b.mbar_wait(q_full, b.rem(i, c(2)))
            turn()
            sacc = issue_s(base)
            pass_turn(None)
            sv = b.wgmma_wait(0, sacc)
            release(k_empty(stage(base)[0]))
            init = [b.fconst(neg)] * 2 + [b.fconst(0.0)] * (2 + 4 * NA) + sv + [b.izero()] * npf

            def body(kt: Any, state: list[Any]) -> list[Any]:
                # tile kt: its softmax while P V of tile kt - 1 runs, then S of tile kt + 1 and
                # P V of tile kt issued; S(kt + 1) waited for, P V(kt) left in flight
                mrow, lrow, acc = state[0:2], state[2:4], state[4:4 + 4 * NA]
                sv, pprev = state[4 + 4 * NA:4 + 4 * NA + 4 * NT], state[4 + 4 * NA + 4 * NT:]
                it = b.add(base, kt)
                mnew, lnew, corr, pred, frags = softmax(sv, mrow, lrow, kt, rows, False)
                acc = retire_pv(it, kt, acc, pprev, corr, pred)
                nxt = b.add(it, c(1))
                turn()
                sacc = issue_s(nxt)
                acc = issue_pv(it, acc, frags)
                pass_turn(None)
                if p.serial:  # (bisecting: nothing in flight across the softmax)
                    out = b.wgmma_wait(0, sacc + acc, [x for f in frags for x in f])
                    sv, acc = out[:len(sacc)], out[len(sacc):len(sacc) + len(acc)]
                else:
                    sv = b.wgmma_wait(1, sacc)
                release(k_empty(stage(nxt)[0]))
                return list(mnew) + list(lnew) + list(acc) + list(sv) + [x for f in frags for x in f]

            state = b.loop(b.sub(nt, c(1)), init, body, types)
            # the last tile (peeled: it alone masks keys past S); every S has retired: Q is free
            release(q_empty)
            kt = b.sub(nt, c(1))
            it = b.add(base, kt)
            sv, pprev = state[4 + 4 * NA:4 + 4 * NA + 4 * NT], state[4 + 4 * NA + 4 * NT:]
            mnew, lnew, corr, pred, frags = softmax(sv, state[0:2], state[2:4], kt, rows, True)
            acc = retire_pv(it, kt, state[4:4 + 4 * NA], pprev, corr, pred)
            turn()
            acc = issue_pv(it, acc, frags)
            pass_turn(b.lt(i, b.sub(mine, c(1))))
            acc = b.wgmma_wait(0, acc, [x for f in frags for x in f])[:4 * NA]
            release(v_empty(stage(it)[0]))
            # 5. finish
            inv = []
            for h in range(2):
                if p.onesum:  # (the whole row's sum in every lane of the quad)
                    x = acc[4 * NO + 2 * h]
                else:
                    x = lnew[h]
                    x = b.fadd(x, b.shfl_xor(x, 1))
                    x = b.fadd(x, b.shfl_xor(x, 2))
                inv.append(b.fsel(b.feq(x, b.fconst(0.0)), b.fconst(0.0), b.fdiv(b.fconst(1.0), x)))
            for j in range(NO):
                for h in range(2):
                    col = b.add(t2, c(8 * j))
                    vals = [b.fmul(acc[4 * j + 2 * h + e], inv[h]) for e in range(2)]
                    b.store_pair(bidx + [rows[h], col], vals, b.lt(rows[h], c(spec.L)))
            return [b.add(base, nt)]

        if p.pingpong:  # the last consumer lets consumer 0 go first
            b.when(b.eq(cw, c(p.wgs - 1)), lambda: b.bar_arrive(c(1), 2 * WG))
        b.loop(mine, [c(0)], work, ["index"])

    b.role(b.eq(wg, c(0)), producer, consumer)

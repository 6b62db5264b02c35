"""Tiling and layout math of the Hopper GEMM (wgmma_gemm.py's kernel): the Plan of a GemmSpec
(tile width, K slice, stages, how each operand is staged by TMA, how C is stored) and the
descriptor and swizzle arithmetic the kernel bakes in, all plain Python on ints, tested against
a numpy model of TMA's swizzled write and wgmma's canonical-layout read (tests/test_wgmma_gemm.py).

Tile width: 256 once it fills the GPU, else 128; at most the narrowest that covers N, and
128 for K <= 128 (`narrow`: ResNet's 1x1 convs, whose time is the epilogue's memory traffic).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from gac_torch.kernels.cuda_mma import Operand, Spec
from gac_torch.kernels.gemm_epilogue import Epilogue



BM = 128
WG = 128  # threads per warpgroup
THREADS = 3 * WG
SWIZZLE = 128  # bytes: the swizzle span, and the inner extent of every TMA box
ALIGN = 1024  # a swizzled tile's atom (8 rows of 128 B) must start 1024-byte aligned
ESIZE = {"f16": 2, "bf16": 2, "f32": 4}
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # setmaxnreg: 128*40 + 256*232 <= 64K registers
SMEM_LIMIT = 227 * 1024
MIN_WORK = 1 << 21  # M*N*K*batch below this stays with mma.sync (launch-bound sizes)
SM_COUNT_HINT = 132
PREFETCH = 64  # 5c: accumulators whose epilogue loads precede the main loop (see prefetch)


@dataclass(frozen=True)
class GemmSpec(Spec):
    """cuda_mma's Spec plus C's fused elementwise consumer (kernels/gemm_epilogue.py), whose
    operands are conv_gemm.Operands over the contraction's dims or the consumer's own space."""

    epilogue: Epilogue | None = None


def epilogue_of(spec: Any) -> Epilogue | None:
    return getattr(spec, "epilogue", None)  # (a cuda_mma.Spec has none; a conv_gemm.Spec may)


@dataclass(frozen=True)
class Side:
    """One operand's staging: `k_major` (K is its contiguous dim), the tile's rows (BM or BN),
    the TMA box (inner extent first) and the byte size of one stage of it."""

    k_major: bool
    rows: int
    box: tuple[int, int]  # elements: (inner, outer)
    nbox: int  # boxes per stage (MN-major tiles are rows/64 boxes side by side)
    stage_bytes: int


@dataclass(frozen=True)
class Plan:
    bn: int
    bk: int
    ks: int  # K per wgmma: 16 (f16/bf16), 8 (tf32)
    stages: int
    a: Side
    b: Side
    grid: tuple[int, int, int]  # persistent: (CTAs, 1, 1), each takes tiles bid, bid + CTAs, ...
    pair_store: bool  # C stored two columns at a time
    tiles: int  # work units: BM x BN tiles over the batch (cluster 2: pairs of M-adjacent tiles)
    staged_store: bool = False  # C through shared memory, 16-byte coalesced stores (5b)
    a_regs: bool = False  # tf32 with an M-major A: fragments from shared memory to registers (4b')
    row_pairs: bool = False  # (a_regs) C's rows contiguous: a thread's rows pr, pr+1 stored at once
    c_bytes: int = 2
    cluster: int = 1  # 2: CTA pairs on M-adjacent tiles, each loading half of B for both
    maxnreg: bool = True  # setmaxnreg: the producer's registers go to the consumers
    regs: tuple[int, int] = (PRODUCER_REGS, CONSUMER_REGS)  # (producer, consumer) after setmaxnreg
    # 5d (stage_epilogue): `ring` tile buffers of ring_bytes after the A/B stages, each a fused
    # epilogue's tile (its M-varying operand `res` TMA-loaded by the producer, -1: none) that the
    # consumers overwrite with the output and store as 16-byte row chunks (`out_es` bytes each)
    ring: int = 0
    ring_bytes: int = 0
    res: int = -1
    out_es: int = 4
    tma_store: bool = False  # 5d: Z leaves by TMA (bulk tensor stores of [64 rows][128 B] boxes)

    @property
    def stage_row(self) -> int:  # bytes per row of the C staging buffer (padded: no conflicts)
        return self.bn * self.c_bytes + 16

    @property
    def smem_bytes(self) -> int:
        staging = BM * self.stage_row if self.staged_store else 0
        return (self.stages * (self.a.stage_bytes + self.b.stage_bytes) + 16 * self.stages + staging + ALIGN
                + self.ring * (self.ring_bytes + 16))


def _elem(spec: Spec) -> str:
    return "f32" if spec.kind == "tf32" else spec.kind


def orient(spec: Spec) -> Spec:
    """The product the kernel computes: `spec`, or for tf32 with B N-major and A K-major the
    transposed one, C^T[n, m] = sum_k B^T[n, k] A^T[k, m] (its A, B's tile, is M-major and read
    from registers; its B, A's tile, K-major; C's subscripts follow the dims, so the stores land
    transposed). GAC_WGMMA_TF32_REGS=0 (bisecting): no register A, so neither."""
    if (spec.kind != "tf32" or spec.b.dims[-1] == spec.k or spec.a.dims[-1] != spec.k
            or os.environ.get("GAC_WGMMA_TF32_REGS") == "0"):
        return spec
    return replace(spec, m=spec.n, n=spec.m, a=spec.b, b=spec.a)


def _side(op: Operand, spec: Spec, outer: int, rows: int, bk: int, es: int) -> Side | None:
    """Staging for one operand, or None when TMA cannot read it (strides not 16-byte
    multiples, a view offset not 16-byte aligned, or a dim that is neither K nor M/N) or wgmma
    cannot (a tf32 B that is not K-major)."""
    if op.strides[-1] != 1 or len(op.dims) != len(set(op.dims)) or len(op.dims) > 3:
        return None
    if any(s * es % 16 for s in op.strides[:-1]) or op.offset * es % 16:
        return None
    outer_strides = list(op.strides[:-1])  # TMA: positive; kept to plain row-major-like views
    if any(x <= 0 for x in outer_strides) or outer_strides != sorted(outer_strides, reverse=True):
        return None
    inner = op.dims[-1]
    if set(op.dims) - {outer, spec.k, *spec.batch} or inner not in (outer, spec.k):
        return None
    span = SWIZZLE // es  # elements in 128 bytes
    if inner == spec.k:
        return Side(True, rows, (bk, rows), 1, rows * bk * es)
    if spec.kind == "tf32" and (outer != spec.m or os.environ.get("GAC_WGMMA_TF32_REGS") == "0"):
        return None  # wgmma reads a tf32 B K-major only (an M-major A: from registers)
    return Side(False, rows, (span, bk), rows // span, rows * bk * es)


def narrow(spec: Spec) -> int:
    """The widest tile worth having (GAC_WGMMA_NARROW=0: 256, as before): the narrowest of
    64 / 128 that covers N (a ResNet 1x1 conv's 64 channels in a 256-wide tile spend 3/4 of
    the MMAs and of the epilogue on zeros); 128 for a short K (<= 128: the tile's MMAs take
    ~1 us, its epilogue's memory traffic the rest; 64 accumulators per thread leave registers
    for the epilogue's loads issued before the main loop, 5c)."""
    if os.environ.get("GAC_WGMMA_NARROW") == "0":
        return 256
    return 64 if spec.N <= 64 else 128 if spec.N <= 128 or spec.K <= 128 else 256


def prefetch(p: Plan) -> int:
    """How many accumulators' epilogue loads along M (5c) go before the main loop: the first
    PREFETCH with 64 accumulators per thread at most (BN <= 128) and A not in registers, the
    rest of the registers hold them (GAC_WGMMA_EPILOGUE_PREFETCH=<n>: n, 0 never)."""
    return 0 if p.bn > 128 or p.a_regs else int(os.environ.get("GAC_WGMMA_EPILOGUE_PREFETCH", PREFETCH))



def plan(spec: Spec, bn: int | None = None) -> Plan | None:
    """Tiling for `spec`, or None when the template does not apply (the mma path then does)."""
    if spec.kind not in ("f16", "bf16", "tf32") or 0 in (spec.M, spec.N, spec.K):
        return None
    e = _elem(spec)
    if spec.a.elem != e or spec.b.elem != e or len(spec.batch) > 1:
        return None
    batch = math.prod(spec.batch_ext)
    if spec.M * spec.N * spec.K * batch < MIN_WORK:
        return None
    es = ESIZE[e]
    bk = SWIZZLE // es  # one swizzle span of K per slice: 64 (16-bit), 32 (tf32)
    bn = bn or int(os.environ.get("GAC_WGMMA_BN", 0))  # (tuning: force a tile width)
    if not bn:  # the wide tile once it still fills the GPU. tf32: already once it fills half of
        # it (128 x 128 tiles would then take two rounds on some SMs: the same time as one wide
        # tile, which reads 80 instead of 96 bytes of shared memory per tensor-core cycle; 2048^3:
        # 128 wide tiles, 256 narrow ones on 132 SMs)
        wide = -(-spec.M // BM) * -(-spec.N // 256) * batch
        bn = 256 if wide >= SM_COUNT_HINT or (spec.kind == "tf32" and 2 * wide > SM_COUNT_HINT) else 128
        bn = min(bn, narrow(spec))
    sa = _side(spec.a, spec, spec.m, BM, bk, es)
    sb = _side(spec.b, spec, spec.n, bn, bk, es)
    if sa is None or sb is None:
        return None
    # GAC_WGMMA_CLUSTER=2 (being measured): B's tile, shared by two M-adjacent tiles, is read
    # from L2 once for both CTAs of a cluster (TMA multicast); a K-major B tile as two boxes
    # (an even number of M tiles: a pair never has a tile wholly outside the matrix)
    cluster = 2 if os.environ.get("GAC_WGMMA_CLUSTER") == "2" and -(-spec.M // BM) % 2 == 0 else 1
    if cluster == 2 and sb.k_major:
        sb = Side(True, bn, (bk, bn // 2), 2, sb.stage_bytes)
    tiles = -(-spec.N // bn) * -(-spec.M // (BM * cluster)) * batch
    grid = (cluster * min(tiles, SM_COUNT_HINT // cluster), 1, 1)
    c = spec.c
    pair = (c.dims[-1] == spec.n and c.strides[-1] == 1 and spec.N % 2 == 0
            and all(s % 2 == 0 for s in c.strides[:-1]) and c.offset % 2 == 0)
    per_stage = sa.stage_bytes + sb.stage_bytes + 16
    # 3 x 48 KiB for the wide tile, 4 x 32 KiB for the narrow one (H200, 2026-12-01: 128x256
    # with 4 stages measured slower than with 3; benchmarks/wgmma_tiles.py). tf32 slices are
    # half as deep (BK = 32): 50 % more of them in flight for the same TMA latency (unmeasured)
    want = int(os.environ.get("GAC_WGMMA_STAGES", 0)) or (3 if bn == 256 else 4) * (3 if spec.kind == "tf32" else 2) // 2
    stages = min(want, (SMEM_LIMIT - ALIGN) // per_stage)
    if stages < 2:
        return None
    a_regs = spec.kind == "tf32" and not sa.k_major
    row_pairs = (a_regs and c.dims[-1] == spec.m and c.strides[-1] == 1 and spec.M % 2 == 0
                 and all(s % 2 == 0 for s in c.strides[:-1]) and c.offset % 2 == 0)
    p = Plan(bn, bk, 8 if spec.kind == "tf32" else 16, stages, sa, sb, grid, pair, tiles,
             cluster=cluster, a_regs=a_regs, row_pairs=row_pairs)
    # 5b: 16-bit C whose rows are 16-byte multiples goes through shared memory (H200,
    # 2026-12-01, 4096^3: 4-9 % faster than pair stores); GAC_WGMMA_EPILOGUE=direct: never
    c_es = ESIZE.get(c.elem, 4)
    if (os.environ.get("GAC_WGMMA_EPILOGUE", "smem") == "smem" and pair and c_es == 2 and spec.N % 8 == 0
            and all(x % 8 == 0 for x in c.strides[:-1]) and c.offset % 8 == 0):
        staged = Plan(**{**p.__dict__, "staged_store": True, "c_bytes": c_es})
        p = staged if staged.smem_bytes <= SMEM_LIMIT else p
    return p


# --------------------------------------------------------------------------------------------
# layout math (ints only: the text builder bakes it in, the tests check it against a model)


def box_origins(side: Side, es: int) -> list[tuple[int, int]]:
    """Per TMA box of a stage: (smem byte offset in the stage, offset along the operand's
    M/N dim of the box's first element)."""
    if side.k_major:  # boxes of box[1] whole rows, one after the other
        return [(j * side.box[1] * SWIZZLE, j * side.box[1]) for j in range(side.nbox)]
    span = SWIZZLE // es
    return [(j * side.box[0] * side.box[1] * es, j * span) for j in range(side.nbox)]


def desc_layout(side: Side, es: int, rows0: int, kstep: int) -> tuple[int, int, int]:
    """(byte offset from the stage's start, leading byte offset, stride byte offset) of the
    wgmma matrix descriptor for the 64 rows from `rows0` (0 for B: all BN rows) and the K
    step `kstep` (ks elements each).

    K-major, 128B swizzle: rows are 128 bytes apart, 8-row groups SBO = 1024 apart, LBO unused
    (1); a K step moves the start within the swizzled row. MN-major: 8 K-rows of 128 bytes
    (64 M/N elements) form an atom, SBO = 1024 between 8-row K groups, LBO = one box between
    64-element M/N chunks; a K step is ks rows."""
    ks = 8 if es == 4 else 16
    if side.k_major:
        return rows0 * SWIZZLE + kstep * ks * es, 16, 8 * SWIZZLE
    box_bytes = side.box[0] * side.box[1] * es
    span = SWIZZLE // es
    return (rows0 // span) * box_bytes + kstep * ks * SWIZZLE, box_bytes, 8 * SWIZZLE


def a_frag_offset(b: Any, side: Side, es: int, row: Any, k: Any) -> Any:
    """Byte offset in a stage of element (row, k) of an M-major A tile (4b'): box row // span
    (TMA wrote them side by side), in it K-row k of 128 bytes, the element's 16-byte chunk XOR
    k % 8 (the 128-byte swizzle; the box starts 1024-byte aligned). `b`: the kernel's builder,
    or plain ints (the tests)."""
    c = b.const
    span = SWIZZLE // es
    box = b.mul(b.div(row, c(span)), c(side.box[0] * side.box[1] * es))
    chunk = b.xor(b.mul(b.rem(row, c(span)), c(es)), b.mul(b.rem(k, c(8)), c(16)))
    return b.add(box, b.add(b.mul(k, c(SWIZZLE)), chunk))


def a_pair_row(b: Any, warp: Any, g: Any) -> Any:
    """4b': the physical row pr (of the warpgroup's 64) whose pair pr, pr + 1 holds the rows
    g, g + 8 of warp `warp`'s m16 slice of the fragment (FRAG_A8). Rows are a free permutation
    (C's rows follow them in the store), so a thread's two rows at one k are 8 adjacent bytes
    (one ld.shared.v2) and the 16 lanes of a half-warp hit 16 distinct 8-byte bank pairs under
    the 128-byte swizzle: bits of pr/2 = (g0, g2, warp0, g1, warp1), g1 on the row's 64-byte
    half, g0 on its 8-byte slot, the swizzle's k XOR on the 16-byte chunk in between."""
    c = b.const
    g0, g1, g2 = b.rem(g, c(2)), b.rem(b.div(g, c(2)), c(2)), b.div(g, c(4))
    w0, w1 = b.rem(warp, c(2)), b.div(warp, c(2))
    j = b.add(b.add(g0, b.mul(g2, c(2))), b.add(b.mul(w0, c(4)), b.add(b.mul(g1, c(8)), b.mul(w1, c(16)))))
    return b.mul(j, c(2))


def descriptor(addr: int, lbo: int, sbo: int) -> int:
    """The 64-bit sm_90 matrix descriptor: start address, LBO and SBO in 16-byte units, layout
    type 1 (128-byte swizzle) in bits 62-63."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


def swizzle128(offset: int) -> int:
    """Where TMA's 128-byte swizzle puts byte `offset` of a 1024-byte aligned tile: the
    16-byte chunk index (bits 4-6) XOR the row within the 8-row atom (bits 7-9)."""
    return offset ^ (((offset >> 7) & 7) << 4)


# --------------------------------------------------------------------------------------------
# 5d: the fused epilogue through shared memory (the 1x1 convs' kernels are memory-bound: a tile's
# residual read and output write are ~90 % of its bytes)


def _rows_view(op: Any, spec: Spec, es: int) -> bool:
    """`op` (an epilogue operand over the contraction's dims) is a row-major M x N view TMA and
    16-byte chunks can address: contiguous along N, rows and start 16-byte aligned."""
    m, n = spec.m, spec.n
    return (op.coef[n] == 1 and op.coef[m] > 0 and op.coef[m] * es % 16 == 0 and not op.guards
            and (op.offset + op.const) * es % 16 == 0
            and all(k == 0 for d, k in enumerate(op.coef) if d not in (m, n)))


def stage_epilogue(spec: Any, p: Plan) -> Plan:
    """`p` with the fused epilogue staged through shared memory (5d), where it applies: the
    output and at most one operand that varies along M (the residual) are row-major M x N views
    of one element size, every other operand constant along M, N whole 16-byte chunks, no batch,
    A not in registers; two tile buffers (one where two do not fit beside 3 A/B stages; with a
    residual, a 256-wide tile goes 128 wide instead). GAC_WGMMA_EPILOGUE_STAGE=0: never (the
    loads and stores from registers, 5c); =tma: Z leaves by TMA stores instead of the threads'
    16-byte ones."""
    ep = epilogue_of(spec)
    mode = os.environ.get("GAC_WGMMA_EPILOGUE_STAGE", "1")
    if (ep is None or mode == "0" or p.a_regs or p.cluster > 1
            or spec.batch or ep.out[1] is not None or ep.out[0].elem not in ESIZE):
        return p
    es = ESIZE[ep.out[0].elem]
    if spec.N * es % 16 or not _rows_view(ep.out[0], spec, es):
        return p
    along_m = [k for k, x in enumerate(ep.inputs) if x is not None and (x[1] is not None or x[0].coef[spec.m] != 0)]
    if len(along_m) > 1:
        return p
    res = along_m[0] if along_m else -1
    if res >= 0:
        op = ep.inputs[res]
        if op[1] is not None or op[0].elem not in ESIZE or ESIZE[op[0].elem] != es or not _rows_view(op[0], spec, es):
            return p
    for q in (p, *([plan(spec, bn=128)] if p.bn == 256 and res >= 0 else [])):
        if q is None:
            continue
        ring_bytes = BM * q.bn * es
        per_stage = q.a.stage_bytes + q.b.stage_bytes + 16
        # a residual tile's load waits for the buffer's previous tile to be read out: with one
        # buffer, each tile would wait for its residual; a 256-wide tile then goes 128 wide (f32:
        # a 128 KiB buffer leaves no room for a second; ResNet's layer-3/4 1x1s, M 9000 / 2250)
        for ring in (2,) if res >= 0 and q is p and p.bn == 256 else (2, 1):
            room = SMEM_LIMIT - ALIGN - ring * (ring_bytes + 16)
            stages = min(q.stages, room // per_stage)
            # 3 stages at least; without a residual, all of them for a long K (compute-bound:
            # the mainloop's depth pays, the epilogue is a small part of the tile's time; a
            # residual read from registers costs a memory latency per chunk: ResNet's layer-4
            # 1x1s, K 512, 65-78 us for ~12 us of MMAs)
            short = res >= 0 or -(-spec.K // q.bk) <= 8
            if stages >= min(3 if short else q.stages, q.stages):
                return replace(q, stages=stages, ring=ring, ring_bytes=ring_bytes, res=res, out_es=es,
                               pair_store=False, staged_store=False, tma_store=mode == "tma")
    return p


def stage_c(spec: Spec, p: Plan) -> Plan:
    """`p` with an f32 C (no epilogue) stored through two tile buffers as 16-byte row chunks
    (5d without a residual; 16-bit C has 5b) where K is short (8 slices at most: the tile's
    time is its bytes, ResNet's downsample 1x1 with its BatchNorm fused into the block's last
    conv) and C's rows are 16-byte aligned; GAC_WGMMA_EPILOGUE_STAGE=0: never."""
    c = spec.c
    if (os.environ.get("GAC_WGMMA_EPILOGUE_STAGE") == "0" or epilogue_of(spec) is not None or c.elem != "f32"
            or p.a_regs or p.cluster > 1 or p.staged_store or not p.pair_store or -(-spec.K // p.bk) > 8
            or c.dims[-1] != spec.n or spec.N % 4 or c.offset % 4 or any(x % 4 for x in c.strides[:-1])):
        return p
    ring_bytes = BM * p.bn * 4
    stages = min(p.stages, (SMEM_LIMIT - ALIGN - 2 * (ring_bytes + 16)) // (p.a.stage_bytes + p.b.stage_bytes + 16))
    if stages < min(3, p.stages):
        return p
    return replace(p, stages=stages, ring=2, ring_bytes=ring_bytes, res=-1, out_es=4, pair_store=False)


def ring_offset(b: Any, row: Any, col: Any, es: int) -> Any:
    """Byte offset in a tile buffer (5d) of element (row, col) of the BM x BN tile: the layout
    TMA's 128-byte swizzled boxes of [BM rows][128 bytes] give it, box col * es // 128 after
    box; in a box, row `row` of 128 bytes, its 16-byte chunk XOR row % 8. `b`: the kernel's
    builder, or plain ints (the tests)."""
    c = b.const
    byte = b.mul(col, c(es))
    box = b.mul(b.div(byte, c(SWIZZLE)), c(BM * SWIZZLE))
    within = b.rem(byte, c(SWIZZLE))
    chunk = b.xor(b.div(within, c(16)), b.rem(row, c(8)))
    return b.add(box, b.add(b.mul(row, c(SWIZZLE)), b.add(b.mul(chunk, c(16)), b.rem(within, c(16)))))

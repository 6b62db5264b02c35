"""The tiling of the implicit-GEMM kernel (conv_gemm.py): a Spec's Plan -- tile sizes and warp
layout (mma.sync) or register tiles (exact-f32 SIMT), each operand's staging (vector width, the
global run it walks, shared-memory layout, cp.async or registers), the buffer count that fits
in shared memory, split-K for the SIMT kernel's long reductions and stream-K for its partial
last waves (`streamk`) -- plus the bisecting switches the plan and the kernel read.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from gac_torch.kernels import cuda_mma as mma
from gac_torch.kernels.conv_gemm_spec import Operand, Spec


KINDS = ("f16", "bf16", "tf32", "f32")
ESIZE = {"f16": 2, "bf16": 2, "f32": 4}


@dataclass(frozen=True)
class Staging:
    """One operand's BK-deep slice: global loads of `vec` elements along k (glob_k) or along
    the outer dims; shared tile [rows][cols + pad] per buffer, [outer][k] when smem_k."""

    glob_k: bool
    smem_k: bool
    rows: int
    cols: int
    pad: int
    vec: int
    per_thread: int
    cp: bool = False  # staged by cp.async (whole vectors of 4, 8 or 16 bytes), not via registers
    scatter: bool = False  # simt k-runs by 4-byte cp.async into [k][outer]: a warp 8 k x 4 outer


@dataclass(frozen=True)
class Plan(mma.WarpTiling):
    bm: int
    bn: int
    bk: int
    ks: int  # k per mma; 0 for simt
    warps_m: int
    warps_n: int
    a: Staging
    b: Staging
    grid: tuple[int, int, int]
    tm: int = 0  # simt register tile
    tn: int = 0
    stages: int = 2  # shared-memory buffers per operand (cp.async: up to stages - 1 slices in flight)
    dynamic: bool = False  # the buffers are dynamic shared memory (over the static 48 KB)
    splits: int = 1  # simt split-K: grid z = batch x splits; each block adds its `kchunk`'s sum
    kchunk: int = 0  # to C atomically (C holds the init: no fused fill or epilogue then)
    lean: bool = False  # simt: fewer integer ops per slice (see `kernel`, 4a)
    sk_workers: int = 0  # simt stream-K (conv_gemm_streamk.py): blocks 0 .. sk_workers-1 share the
    sk_tiles: int = 0  # first sk_tiles tiles' K slices evenly; a 1-d grid, one block per other tile


def smem_elem(kind: str) -> str:
    return "f32" if kind in ("tf32", "f32") else kind


def unit_run(op: Operand, dims: tuple[int, ...], ranges: tuple[int, ...]) -> tuple[int, set[int]]:
    """Extent and dims of the unit-stride run at the end of `dims` (unit-extent dims skipped:
    they move no address)."""
    run, inside = 1, set()
    for d in reversed(dims):
        if ranges[d] == 1:
            inside.add(d)
            continue
        if op.coef[d] != run:
            break
        run *= ranges[d]
        inside.add(d)
    return run, inside


def _step(op: Operand, dims: tuple[int, ...], ranges: tuple[int, ...]) -> int:
    """Address step between consecutive elements along the innermost non-unit dim of `dims`."""
    return next((abs(op.coef[d]) for d in reversed(dims) if ranges[d] > 1), 0)


def _staging(spec: Spec, op: Operand, outer: tuple[int, ...], tile_o: int, bk: int, threads: int,
             simt: bool, simt_cp: bool) -> Staging | None:
    r = spec.ranges
    (run_k, in_k), (run_o, in_o) = unit_run(op, spec.ks, r), unit_run(op, outer, r)
    # consecutive threads walk the longer unit-stride run (coalesced; vectors where it allows);
    # mma, neither run (a strided conv's input): the dim with the smaller address step (a
    # stride-2 ow, not c's whole plane apart: 2 lanes a 32-byte sector instead of 1 each)
    glob_k = run_k >= run_o
    if not simt and run_k == run_o == 1:
        glob_k = _step(op, spec.ks, r) <= _step(op, outer, r)
    run, inside, cols_g = (run_k, in_k, bk) if glob_k else (run_o, in_o, tile_o)
    es = ESIZE[op.elem]
    if op.guards:  # a vector could straddle the padding's edge: only along K's innermost dim
        last = next((d for d in reversed(spec.ks) if r[d] > 1), None)  # when no guard reads it
        if not glob_k or last is None or op.coef[last] != 1 or any(gc[last] for gc, _, _ in op.guards):
            return _fit(glob_k, simt, simt_cp, op, tile_o, bk, threads, 1)
        run, inside = r[last], {d for d in spec.ks if r[d] == 1} | {last}  # (an NHWC input's c)
    rest = [k for d, k in enumerate(op.coef) if d not in inside and r[d] > 1]
    plain = not op.guards and sum(r[d] > 1 for d in spec.ks) <= 1  # (one K dim: not a conv's)
    vec = 1
    # (tf32 at 4 wide through registers: sm_90's ptxas caps the 64x64 kernel at 72 registers
    # and spills; 2 wide not. cp.async holds no registers: 4 wide)
    for v in ((8, 4, 2) if es == 2 else (4, 2) if simt or CP_ASYNC else (2,)):
        if (run % v == 0 and op.offset % v == 0 and op.const % v == 0 and all(k % v == 0 for k in rest)
                and cols_g % v == 0 and (tile_o * bk // v) % threads == 0):
            vec = v
            break
    return _fit(glob_k, simt, simt_cp, op, tile_o, bk, threads, vec, plain)


# bisecting switches (read at import; with GAC_CACHE=0, the program cache does not key on them)
LDMATRIX = os.environ.get("GAC_IGEMM_LDMATRIX") != "0"  # f16/bf16 fragments by ldmatrix, else lds
CP_ASYNC = os.environ.get("GAC_IGEMM_CP_ASYNC") != "0"  # stage >= 4-byte vectors by cp.async
SPLIT_K = os.environ.get("GAC_SGEMM_SPLIT_K") != "0"  # simt: split long K over small grids
EARLY_LOADS = os.environ.get("GAC_SGEMM_EARLY") != "0"  # simt: register loads before the slice's barrier


def _fit(glob_k: bool, simt: bool, simt_cp: bool, op: Operand, tile_o: int, bk: int, threads: int,
         vec: int, plain: bool = False) -> Staging | None:
    es = ESIZE[op.elem]
    # simt, a run along k (x @ W^T reads both so): each element by its own 4-byte cp.async,
    # transposed into the [k][outer] tile the FMAs read (as a run along outer lands), instead of
    # through registers (16 registers held, stores after the FMAs); a warp covers 8 k x 4 rows:
    # whole 32-byte sectors, and conflict-free shared stores ((4 k + row) % 32 with the pad of 4).
    # Plain GEMMs only (`plain`; convolutions unmeasured). GAC_SGEMM_CP_K=0 bisects (read when
    # planning: part of the cache key)
    if (plain and simt and simt_cp and glob_k and CP_ASYNC and os.environ.get("GAC_SGEMM_CP_K") != "0"
            and es == 4 and bk % 8 == 0 and (tile_o * bk) % threads == 0):
        return Staging(True, False, bk, tile_o, 4, 1, tile_o * bk // threads, True, True)
    if (tile_o * bk // vec) % threads:
        return None
    smem_k = glob_k and not simt
    rows, cols = (tile_o, bk) if smem_k else (bk, tile_o)
    # pads: conflict-free fragment loads (cuda_mma), 16-byte aligned rows; simt rows keep float4s
    pad = 4 if simt else (8 if es == 2 else 4) if smem_k else 8
    cp = CP_ASYNC and (not simt or simt_cp and not glob_k) and vec * es in (4, 8, 16)  # ([k][outer])
    return Staging(glob_k, smem_k, rows, cols, pad, vec, tile_o * bk // vec // threads, cp)


# dynamic shared memory per block when cp.async staging may use it: two blocks per SM (sm_80 /
# sm_90: 164 / 228 KB per SM, 1 KB of it reserved per block)
DYNAMIC_SMEM_PER_BLOCK = 80 * 1024


def sgemm_blocks_per_sm() -> int:
    """Blocks per SM the exact-f32 kernel is compiled for (backends/cuda/pipeline.py: 2 cap its
    registers at 128): 1 for 128x256 tiles (128 accumulators per thread) or GAC_SGEMM_CTAS=1."""
    return 1 if os.environ.get("GAC_SGEMM_CTAS") == "1" or os.environ.get("GAC_SGEMM_BN") == "256" else 2


def _simt_roof(smem_limit: int, dynamic_limit: int) -> int:
    """Shared memory one simt block may use: with two per SM, half the SM's (the opt-in limit
    + 1 KB) less each block's reserved 1 KB (sm_90: 113 KB; sm_80: 81 KB)."""
    if not dynamic_limit:
        return smem_limit
    per_sm = dynamic_limit + 1024
    return max(smem_limit, dynamic_limit if sgemm_blocks_per_sm() == 1 else per_sm // 2 - 1024)


def plan(spec: Spec, max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535),
         smem_limit: int = 48 * 1024, big: bool | None = None, dynamic_limit: int = 0,
         simt_cp: bool = True, split_k: bool = True, bk: int | None = None,
         simt_threads: int = 256) -> Plan | None:
    """Tiling for `spec`, or None when the template does not apply. Tiles: 128 x 128 (64 x 64
    when 128-wide ones make under about a wave, `big` forces), 128 x 64 when N <= 64. With
    cp.async staging, as many buffers (up to 4) as fit in `smem_limit`, or in dynamic shared
    memory (up to DYNAMIC_SMEM_PER_BLOCK) where the target allows `dynamic_limit` bytes.
    `simt_cp`: f32 operands may stage by cp.async too (sm_80+); `split_k`: f32 may split K;
    `bk`: simt's slice depth (16; 32: half the barriers and slice overheads per FMA, fewer
    buffers; GAC_SGEMM_BK forces one); `simt_threads`: 128 holds 128-wide tiles as 8 x 16 per
    thread (GAC_SGEMM_THREADS=128 forces it)."""
    if spec.kind not in KINDS or 0 in (spec.M, spec.N, spec.K) or not (spec.ms and spec.ns and spec.ks):
        return None
    e = smem_elem(spec.kind)
    if spec.a.elem != e or spec.b.elem != e:
        return None
    batch = spec.ext(spec.batch)
    if big is None:
        big = -(-spec.M // 128) * -(-spec.N // 128) * batch >= mma.SM_COUNT_HINT
    simt = spec.kind == "f32"
    if not big:  # (8 warps here too: at 4, sm_90's ptxas caps registers low and spills)
        bm, bn, wm, wn = 64, 64, 2, 4
    elif spec.N <= 64:
        bm, bn, wm, wn = 128, 64, 4, 2
    else:
        bm, bn, wm, wn = 128, 128, 2, 4
    if simt:
        wm, wn = 2, 4  # 256 threads as 16 x 16
        if big and os.environ.get("GAC_SGEMM_BN") == "256" and spec.N > 128:  # (being measured: 8 x 16
            bn = 256  # per thread, 128 accumulators: one block per SM, sgemm_blocks_per_sm)
        elif big and bn == 128 and (simt_threads == 128 or os.environ.get("GAC_SGEMM_THREADS") == "128"):  # (measured:
            wm = 1  # 128 threads as 16 x 8, 8 x 16 each: half the shared reads per FMA, still 2 blocks/SM)
        bk, ks, tm, tn = int(os.environ.get("GAC_SGEMM_BK", 0)) or bk or 16, 0, bm // 16, bn * 16 // (32 * wm * wn)
    else:
        bk, ks, tm, tn = (16, 8, 0, 0) if spec.kind == "tf32" else (32, 16, 0, 0)
    threads = 32 * wm * wn
    sa = _staging(spec, spec.a, spec.ms, bm, bk, threads, simt, simt_cp)
    sb = _staging(spec, spec.b, spec.ns, bn, bk, threads, simt, simt_cp)
    if sa is None or sb is None:
        return None
    grid = (-(-spec.N // bn), -(-spec.M // bm), batch)
    if any(x > lim for x, lim in zip(grid, max_grid)):
        return None
    lean = simt and os.environ.get("GAC_SGEMM_LEAN") != "0"  # (bisects)
    p = Plan(bm, bn, bk, ks, wm, wn, sa, sb, grid, tm, tn, lean=lean)
    # simt: dynamic shared memory for register-staged tiles too (32-deep or 256-wide ones pass
    # the static 48 KB; else a [k][n]-read GEMM fell back to simt_matmul's kernel)
    roof = (_simt_roof(smem_limit, dynamic_limit) if simt
            else max(smem_limit, min(dynamic_limit, DYNAMIC_SMEM_PER_BLOCK)) if sa.cp or sb.cp else smem_limit)
    if sa.cp or sb.cp:
        for stages in (4, 3, 2):
            p = Plan(bm, bn, bk, ks, wm, wn, sa, sb, grid, tm, tn, stages, lean=lean)
            if smem_bytes(p, spec) <= roof:
                break
    if smem_bytes(p, spec) > roof:
        return None
    p = dataclasses.replace(p, dynamic=smem_bytes(p, spec) > smem_limit)
    # simt, at most a wave of blocks and a long K (a weight gradient: K = tokens): split K
    # into chunks of >= 512 until about two blocks per SM; fp32 atomics add the partial sums
    splits = min(8, spec.K // 512, 2 * mma.SM_COUNT_HINT // math.prod(grid)) if simt and split_k and SPLIT_K else 1
    if splits > 1 and spec.c.elem == "f32" and grid[2] * splits <= max_grid[2]:
        kchunk = -(-spec.K // (splits * bk)) * bk
        p = dataclasses.replace(p, grid=(grid[0], grid[1], batch * -(-spec.K // kchunk)),
                                splits=-(-spec.K // kchunk), kchunk=kchunk)
    return streamk(p, spec) if simt and split_k and p.splits == 1 else p


def streamk(p: Plan, spec: Spec, slots: int | None = None, force: bool = False) -> Plan:
    """Stream-K (conv_gemm_streamk.py) where it pays: `slots` = co-resident blocks (SM count x
    blocks per SM: 264 on the H200). T tiles make T / slots waves; the last, partial one leaves
    slots idle while the busiest SMs run one more tile than the average: a loss of
    ceil(w) / w - 1 (4096^3 at 128x128: 1024 tiles, 3.88 waves, 3.1 %). Taken when that loss is
    >= 2 %, there are >= 2 waves (under that, split-K's territory) and K is long (>= 64 slices
    of BK: the fix-up of a split tile, ~2 x 64 KB through L2, is small next to its FMAs), and
    each worker gets >= 8 slices. Then the T % slots tiles of the last wave are shared by
    `slots` workers (equal contiguous ranges of their (tile, slice) space; blocks 0 ..
    slots-1), every other tile is one block of its own. Only over whole tiles and whole K slices
    of one K dim (`_whole_slices`: the slice loop is then the plain kernel's, and no bound check
    holds registers; sm_90 ptxas: 128 registers, no spills, where a ragged M / N spilled 60 bytes
    at 3000 x 3000 x 1040 and a ragged K 32 at 3000 x 3000 x 1030; the plain kernel: none).
    `force` (tests): whenever there is a partial wave."""
    slots = slots or mma.SM_COUNT_HINT * sgemm_blocks_per_sm()
    tiles = math.prod(p.grid)
    nk = -(-spec.K // p.bk)
    waves = tiles / slots
    tail = tiles % slots
    on = os.environ.get("GAC_SGEMM_STREAMK") != "0"  # (read when planning: gemm_variants sets it per variant)
    if not force and (not on or waves < 2 or not tail or -(-tiles // slots) / waves - 1 < 0.02 or nk < 64
            or tail * nk < 8 * slots or not _whole_slices(p, spec) or spec.M % p.bm or spec.N % p.bn) or not tail:
        return p
    return dataclasses.replace(p, grid=(slots + tiles - tail, 1, 1), sk_workers=slots, sk_tiles=tail)


def _whole_slices(p: Plan, spec: Spec) -> bool:
    """One K dim of whole BK slices, no padding guards, the lean kernel: a stream-K segment's
    first k then moves the operands' bases (conv_gemm._tile)."""
    return len(spec.ks) == 1 and spec.K % p.bk == 0 and p.lean and not spec.a.guards and not spec.b.guards


def smem_bytes(p: Plan, spec: Spec) -> int:
    es = ESIZE[smem_elem(spec.kind)]
    return sum(p.stages * s.rows * (s.cols + s.pad) * es for s in (p.a, p.b))

"""Tiling of the implicit-GEMM contraction (conv_gemm.py): block tile, warps, K slice, how each
operand's slice is staged (vector width, layout in shared memory, cp.async or registers) and how
many shared-memory buffers, for a `conv_gemm.Spec`; None when the template does not apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gac_torch.kernels import cuda_mma as mma

if TYPE_CHECKING:
    from gac_torch.kernels.conv_gemm import Operand, Spec

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
             simt: bool) -> Staging | None:
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
    rest = [k for d, k in enumerate(op.coef) if d not in inside and r[d] > 1]
    vec = 1
    if op.guards:  # a vector could straddle the padding's edge
        return _fit(glob_k, simt, op, tile_o, bk, threads, 1)
    # (tf32 at 4 wide through registers: sm_90's ptxas caps the 64x64 kernel at 72 registers
    # and spills; 2 wide not. cp.async holds no registers: 4 wide)
    for v in ((8, 4, 2) if es == 2 else (4, 2) if simt or CP_ASYNC else (2,)):
        if (run % v == 0 and op.offset % v == 0 and op.const % v == 0 and all(k % v == 0 for k in rest)
                and cols_g % v == 0 and (tile_o * bk // v) % threads == 0):
            vec = v
            break
    return _fit(glob_k, simt, op, tile_o, bk, threads, vec)


# bisecting switches (read at import; with GAC_CACHE=0, the program cache does not key on them)
LDMATRIX = os.environ.get("GAC_IGEMM_LDMATRIX") != "0"  # f16/bf16 fragments by ldmatrix, else lds
CP_ASYNC = os.environ.get("GAC_IGEMM_CP_ASYNC") != "0"  # mma kinds stage >= 4-byte vectors by cp.async


def _fit(glob_k: bool, simt: bool, op: Operand, tile_o: int, bk: int, threads: int, vec: int) -> Staging | None:
    es = ESIZE[op.elem]
    if (tile_o * bk // vec) % threads:
        return None
    smem_k = glob_k and not simt
    rows, cols = (tile_o, bk) if smem_k else (bk, tile_o)
    # pads: conflict-free fragment loads (cuda_mma), 16-byte aligned rows; simt rows keep float4s
    pad = 4 if simt else (8 if es == 2 else 4) if smem_k else 8
    cp = CP_ASYNC and not simt and vec * es in (4, 8, 16)
    return Staging(glob_k, smem_k, rows, cols, pad, vec, tile_o * bk // vec // threads, cp)


# dynamic shared memory per block when cp.async staging may use it: two blocks per SM (sm_80 /
# sm_90: 164 / 228 KB per SM, 1 KB of it reserved per block)
DYNAMIC_SMEM_PER_BLOCK = 80 * 1024


def plan(spec: Spec, max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535),
         smem_limit: int = 48 * 1024, big: bool | None = None, dynamic_limit: int = 0) -> Plan | None:
    """Tiling for `spec`, or None when the template does not apply. Tiles: 128 x 128 (64 x 64
    when 128-wide ones make under about a wave, `big` forces), 128 x 64 when N <= 64. With
    cp.async staging, as many buffers (up to 4) as fit in `smem_limit`, or in dynamic shared
    memory (up to DYNAMIC_SMEM_PER_BLOCK) where the target allows `dynamic_limit` bytes."""
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
        bk, ks, tm, tn = 16, 0, bm // 16, bn // 16
    else:
        bk, ks, tm, tn = (16, 8, 0, 0) if spec.kind == "tf32" else (32, 16, 0, 0)
    threads = 32 * wm * wn
    sa = _staging(spec, spec.a, spec.ms, bm, bk, threads, simt)
    sb = _staging(spec, spec.b, spec.ns, bn, bk, threads, simt)
    if sa is None or sb is None:
        return None
    grid = (-(-spec.N // bn), -(-spec.M // bm), batch)
    if any(x > lim for x, lim in zip(grid, max_grid)):
        return None
    p = Plan(bm, bn, bk, ks, wm, wn, sa, sb, grid, tm, tn)
    if sa.cp or sb.cp:
        roof = max(smem_limit, min(dynamic_limit, DYNAMIC_SMEM_PER_BLOCK))
        for stages in (4, 3, 2):
            p = Plan(bm, bn, bk, ks, wm, wn, sa, sb, grid, tm, tn, stages)
            if smem_bytes(p, spec) <= roof:
                p = Plan(bm, bn, bk, ks, wm, wn, sa, sb, grid, tm, tn, stages, smem_bytes(p, spec) > smem_limit)
                return p
    if smem_bytes(p, spec) > smem_limit:
        return None
    return p


def smem_bytes(p: Plan, spec: Spec) -> int:
    es = ESIZE[smem_elem(spec.kind)]
    return sum(p.stages * s.rows * (s.cols + s.pad) * es for s in (p.a, p.b))

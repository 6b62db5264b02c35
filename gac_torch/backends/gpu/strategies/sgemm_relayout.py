"""Exact-f32 GEMM operands that run along K copied into the K-outer layout first.

The SIMT sgemm (kernels/conv_gemm.py, kind f32) stages an operand stored [outer][k] (x @ W^T
reads both so) by 4-byte cp.async, one per element, transposed into its [k][outer] tile; an
operand stored [k][outer] goes by 16-byte cp.async. Measured on the H200 (2026-12-02, 4096^3,
TF32 off): layout tn (both K-outer) 2.67 ms, nn (A along K) 2.81 ms, nt (both along K) 2.93 ms:
~0.13 ms per K-contiguous operand, while a 64 MB transpose moves 128 MB (~0.035 ms at
~3.7 TB/s). So where the estimate says it pays, such an operand is first transposed (one launch
of the tiled kernel gac_torch/kernels/transpose.py) into a dense [batch..][k][outer] buffer,
which the GEMM then reads as its tn operand. As weight_layout.py for the conv weights, the copy
is per call and exact.

GAC_SGEMM_RELAYOUT=0 keeps every operand as it is (bisects, the behaviour before); =all copies
every eligible operand whatever its size (tests); default (and any other value): where `pays`.
(=graph is backends/gpu/relayout.py's graph-level opt-in instead: `loops` copies, measured slower;
an operand it made K-outer is not copied again here.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import memref

from gac_torch.backends.gpu.irutil import static_memref
from gac_torch.backends.gpu.strategy import splice_template, template_text
from gac_torch.kernels import conv_gemm, transpose

SAVED_S = 0.13e-3 / 2**36  # s saved per unit of M*N*K*batch per K-contiguous operand (H200, above)
BANDWIDTH = 3.7e12  # bytes/s of the transpose (read + write)
LAUNCH_S = 4e-6  # one more launch, and its tail
MIN_WORK = 2**33  # M*N*K*batch below which it is never done (a 2048^3 GEMM: ~0.35 ms)


@dataclass(frozen=True)
class Transposed:
    """The copy (its kernel's spec) and the operand the GEMM reads from it."""

    spec: transpose.Spec
    operand: conv_gemm.Operand


def mode() -> str:
    return os.environ.get("GAC_SGEMM_RELAYOUT", "")


def pays(work: int, nbytes: int) -> bool:
    """Whether copying an operand of `nbytes` saves time on a GEMM of `work` = M*N*K*batch:
    the estimated saving at least 1.5x the copy's time."""
    return work >= MIN_WORK and SAVED_S * work >= 1.5 * (2 * nbytes / BANDWIDTH + LAUNCH_S)


def plan(v: ir.Value, m: ir.AffineMap, op: conv_gemm.Operand, k: tuple[int, ...], outer: list[int],
         batch: tuple[int, ...], ranges: tuple[int, ...], max_grid: tuple[int, int, int]) -> Transposed | None:
    """The copy of GEMM operand `v` (read through `m`, as `op`) into [batch..][k][outer], or
    None (see `permuted`)."""
    if mode() == "0" or not static_memref(v.type):
        return None
    t = ir.MemRefType(v.type)
    dims = tuple(e.position if isinstance(e, ir.AffineDimExpr) else -1 for e in m.results)
    return permuted(str(t), str(t.element_type), tuple(t.shape), dims, op, k, outer, batch, ranges, max_grid)


def permuted(type_text: str, elem: str, shape: tuple[int, ...], dims: tuple[int, ...], op: conv_gemm.Operand,
             k: tuple[int, ...], outer: list[int], batch: tuple[int, ...], ranges: tuple[int, ...],
             max_grid: tuple[int, int, int]) -> Transposed | None:
    """An f32 operand of `shape` whose dim j is iteration dim dims[j] (-1: not a dim), copied
    as [batch..][k][outer], or None: switched off, not one K dim and one outer dim with K at
    unit stride (`op.coef`), not paying (GAC_SGEMM_RELAYOUT=all: any size), or too large a grid."""
    if mode() == "0" or len(k) != 1 or len(outer) != 1 or elem != "f32" or -1 in dims:
        return None
    (kd,), (od,) = k, outer
    if (dims.count(kd) != 1 or dims.count(od) != 1 or op.coef[kd] != 1 or ranges[kd] < 2 or ranges[od] < 2
            or any(d not in batch and ranges[d] != 1 for d in dims if d not in (kd, od))):
        return None
    if mode() != "all" and not pays(math.prod(ranges), 4 * math.prod(shape)):  # (M*N*K*batch)
        return None
    perm = tuple([j for j, d in enumerate(dims) if d not in (kd, od)] + [dims.index(kd), dims.index(od)])
    s = transpose.spec(type_text, elem, shape, perm)
    if not transpose.fits(s, max_grid):
        return None
    new_shape = tuple(shape[j] for j in perm)
    dense = tuple(math.prod(new_shape[j + 1:]) for j in range(len(new_shape)))
    new = conv_gemm.operand(s.dst, elem, new_shape, dense, 0, [({dims[j]: 1}, 0) for j in perm], len(ranges))
    return Transposed(s, new)


def copy_before(tr: Transposed, v: ir.Value, before: ir.Operation, name: str) -> ir.Value:
    """Allocate the copy and splice the transpose kernel (named `name`) before `before`;
    returns the copy."""
    with ir.InsertionPoint(before), before.location:
        buf = memref.alloc(ir.MemRefType(ir.Type.parse(tr.spec.dst)), [], [])
    text = template_text(("transpose", tr.spec), lambda: transpose.template(tr.spec))
    splice_template(text, before, [v, buf], None, "f32", name)
    return buf

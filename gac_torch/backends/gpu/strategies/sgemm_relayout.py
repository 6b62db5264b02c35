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

Where the operand is a scratch buffer written whole by one elementwise generic not yet emitted
(a `loops` kernel to be: the MLP step's dy = 2 (y - t) / n before dh = dy @ W2), the transpose
computes it instead (kernels/transpose.py's prologue): one kernel reads the generic's inputs and
writes the operand (where something else reads it) and its K-outer copy; the generic is erased.
At 4096^2 that saves reading the operand back (64 MB, ~0.014 ms at 4.8 TB/s) and a launch.
GAC_TRANSPOSE_PRODUCER=0 keeps the generic and the plain transpose (bisects).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import memref

from gac_torch.backends.gpu.analysis import Generic, analyze, map_dims
from gac_torch.backends.gpu.irutil import block_ops, buffer_root, defining_op, identity_layout, static_memref, users
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template, template_text
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


def producer(v: ir.Value, gemm: ir.Operation) -> tuple[ir.Operation, transpose.Prologue, list[ir.Value],
                                                       Generic | None] | None:
    """(generic, its prologue, the prologue's input buffers, a `column_sum` of v or None) where
    `v`, a dense scratch buffer (a memref.alloc), is written by one op only: an all-parallel
    linalg.generic before `gemm` in its block whose one output is v at its own point, whose
    inputs are read at the point or broadcast along some of v's dims (in order), never v, and
    whose body is plain elementwise ops (strategies/epilogue.py's form); every other user of v a
    generic not yet emitted that only reads it (or a dealloc); else None. The prologue's
    `plain`: whether anything besides `gemm` (and the column sum) reads v."""
    from gac_torch.backends.gpu.strategies.epilogue import _body_ops

    if os.environ.get("GAC_TRANSPOSE_PRODUCER") == "0":
        return None
    alloc = defining_op(v)
    if alloc is None or alloc.name != "memref.alloc" or not static_memref(v.type) or not identity_layout(v.type):
        return None
    writer, readers, sums = None, 0, []
    for u in users(v):
        if u == gemm or u.name == "memref.dealloc":
            continue
        g = analyze(u) if u.name == "linalg.generic" else None
        if g is None:
            return None  # (an emitted kernel, a copy: it may write v)
        if any(buffer_root(o) == v for o in g.outputs):
            if writer is not None or g.outputs != [v]:
                return None
            writer = g
        elif not sums and column_sum(g, v) is not None:
            sums.append(g)
        else:
            readers += 1
    g = writer
    if g is None or g.op.block != gemm.block or not g.op.is_before_in_block(gemm):
        return None
    n = len(ir.MemRefType(v.type).shape)
    if (any(it != "parallel" for it in g.iters) or len(g.iters) != n or g.dynamic
            or map_dims(g.maps[-1]) != list(range(n))):
        return None
    body = _body_ops(g)
    if body is None:
        return None
    ins: list[tuple[str, tuple[int, ...]]] = []
    for x, m in zip(g.inputs, g.maps[:-1]):
        dims = map_dims(m)
        if dims is None or dims != sorted(dims) or not static_memref(x.type) or buffer_root(x) == v:
            return None
        ins.append((str(x.type), tuple(dims)))
    return g.op, transpose.Prologue(tuple(ins), body[0], body[1], readers > 0), list(g.inputs), (sums or [None])[0]


def column_sum(g: Generic, v: ir.Value) -> tuple[list[int], int] | None:
    """(Q's shape, its column dim) where generic `g` sums 2-D `v` [R][C] over R, reading v or a
    view of it that only adds unit dims after R ([R][1][C]: the backward's bias gradient),
    its one output over the view's other dims in order, its body out + in (GAC_TRANSPOSE_COLSUM=0:
    never)."""
    if os.environ.get("GAC_TRANSPOSE_COLSUM") == "0" or len(g.inputs) != 1 or len(g.outputs) != 1:
        return None
    x, vt = g.inputs[0], ir.MemRefType(v.type)
    if len(vt.shape) != 2 or buffer_root(x) != v or buffer_root(g.outputs[0]) == v or not static_memref(x.type):
        return None
    shape = list(ir.MemRefType(x.type).shape)
    rest = shape[1:]
    n = len(shape)
    if (shape[0] != vt.shape[0] or math.prod(rest) != vt.shape[1] or sum(e != 1 for e in rest) != 1
            or g.iters != ["reduction"] + ["parallel"] * (n - 1) or map_dims(g.maps[0]) != list(range(n))
            or map_dims(g.maps[1]) != list(range(1, n))):
        return None
    ops = block_ops(g.body)
    args = list(g.body.arguments)
    if (len(ops) != 2 or ops[0].name != "arith.addf" or set(ops[0].operands) != {args[0], args[1]}
            or ops[1].operands[0] != ops[0].results[0] or str(args[0].type) != "f32"):
        return None
    return shape, 1 + [e != 1 for e in rest].index(True)


def copy_before(tr: Transposed, v: ir.Value, before: ir.Operation, name: str) -> ir.Value:
    """Allocate the copy and splice the transpose kernel (named `name`) before `before`;
    returns the copy. Where `v` has a `producer`, the kernel computes it in its place."""
    made = producer(v, before)
    if made is not None:
        p, pro, ins, summed = made
        q = None
        if summed is not None and tr.spec.perm == (1, 0):
            shape, qdim = column_sum(summed, v)  # type: ignore[misc]
            qt = transpose.dense_type((transpose.colsum_rows(tr.spec), *shape[1:]), "f32")
            pro = transpose.Prologue(pro.inputs, pro.ops, pro.result, pro.plain, (qt, qdim))
            with ir.InsertionPoint(p), p.location:
                q = memref.alloc(ir.MemRefType(ir.Type.parse(qt)), [], [])
        elif summed is not None:
            pro = transpose.Prologue(pro.inputs, pro.ops, pro.result, True)  # (v read by the sum)
        sp = transpose.Spec(**{**tr.spec.__dict__, "pro": pro})
        with ir.InsertionPoint(p), p.location:
            buf = memref.alloc(ir.MemRefType(ir.Type.parse(sp.dst)), [], [])
        text = template_text(("transpose", sp), lambda: transpose.template(sp))
        splice_template(text, p, [*ins, *([v] if pro.plain else []), buf, *([q] if q is not None else [])],
                        None, "f32", name)
        p.erase()
        if q is not None:  # the sum now adds the tiles' partial sums (its first stage done)
            summed.op.operands[0] = q  # type: ignore[union-attr]
        return buf
    with ir.InsertionPoint(before), before.location:
        buf = memref.alloc(ir.MemRefType(ir.Type.parse(tr.spec.dst)), [], [])
    text = template_text(("transpose", tr.spec), lambda: transpose.template(tr.spec))
    splice_template(text, before, [v, buf], None, "f32", name)
    return buf


COPY = "gac.k_outer_copy"  # relayout.py's K-outer copy generic (for an epilogue to store)


def copy_strategy() -> Strategy:
    """backends/gpu/relayout.py's K-outer copy that no GEMM epilogue took (its GEMM split K, say):
    the tiled transpose kernel, as the operand would have had here, not an uncoalesced `loops`
    copy. (After implicit_gemm's `fused` strategy: a copy an epilogue took is that one's.)"""
    def match(g: Generic, limits: GpuLimits):
        if COPY not in g.op.attributes or len(g.inputs) != 1 or len(g.outputs) != 1 or g.dynamic:
            return None
        src, dst = g.inputs[0], g.outputs[0]
        t = ir.MemRefType(src.type)
        if len(t.shape) != 2 or map_dims(g.maps[0]) != [1, 0] or map_dims(g.maps[1]) != [0, 1]:
            return None
        sp = transpose.spec(str(t), str(t.element_type), tuple(t.shape), (1, 0))
        return (g, sp) if sp.dst == str(dst.type) and transpose.fits(sp, limits.max_grid) else None

    def emit(m, name: str, limits: GpuLimits) -> bool:
        g, sp = m
        text = template_text(("transpose", sp), lambda: transpose.template(sp))
        splice_template(text, g.op, [g.inputs[0], g.outputs[0]], None, sp.elem, name)
        g.op.erase()
        return True

    return Strategy("transpose", match, emit)

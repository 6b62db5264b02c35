"""A large exact-f32 GEMM's operand that an earlier GEMM's epilogue computes is stored K-outer by
that epilogue as well (GAC_SGEMM_EPILOGUE_T, default on; cuda without TF32 only:
GpuLimits.sgemm_relayout).

The SIMT sgemm runs its K-outer layout `tn` at cuBLAS speed and pays ~0.13 ms per K-contiguous
operand at 4096^3 (strategies/sgemm_relayout.py), which therefore copies such an operand with a
tiled transpose (64 MB read + 64 MB written at 4096^2, ~0.033 ms on the H200). The MLP's
forward reads a = GELU(x @ W1^T + b1) as the second GEMM's A along K; a is the first GEMM's
epilogue output (a graph output: the backward reads it). Here a transposed copy of such an
operand is added as a plain copy generic right after the generic that writes it; the first
GEMM's epilogue fusion takes it as one more consumer (strategies/epilogue.py: the copy's
[k][m] store from the accumulators), and the second GEMM reads the copy as its K-outer
operand: the transpose kernel (and its 64 MB read, a launch) is gone, the epilogue writes 64 MB
more. Only where the writer is within a few elementwise generics of a contraction (the
epilogue's chain); every other operand is left to sgemm_relayout.py's transposes, and a copy
no epilogue takes after all (that GEMM splits K, say) is that tiled transpose too
(sgemm_relayout.copy_strategy), not a `loops` copy.

(Before 2026-12-02's session 11 this module copied every K-contiguous operand by such `loops`
copies, GAC_SGEMM_RELAYOUT=graph: measured 14.21 ms against 13.77 with the tiled transposes on
the MLP step, removed.)
"""

from __future__ import annotations

import math
import os

from mlir import ir

from gac_torch.backends.gpu.analysis import analyze, fill_before, map_dims, match_contraction
from gac_torch.backends.gpu.hoist import contractions
from gac_torch.backends.gpu.irutil import buffer_root, identity_layout, ops_after, users
from gac_torch.backends.gpu.strategies.sgemm_relayout import COPY, mode, pays
from gac_torch.backends.gpu.strategies.weight_layout import copy_before, permuted

CHAIN = 4  # elementwise generics at most between the contraction and the operand's writer


def enabled(limits) -> bool:
    """On for the cuda target without TF32, unless GAC_SGEMM_EPILOGUE_T=0 or GAC_SGEMM_RELAYOUT=0
    (which keeps every operand as it is); GAC_SGEMM_RELAYOUT=all: whatever the GEMM's size."""
    return (os.environ.get("GAC_SGEMM_EPILOGUE_T") != "0" and mode() != "0"
            and getattr(limits, "sgemm_relayout", False))


def _writers(v: ir.Value, before: ir.Operation) -> list | None:
    """The generics (analyzed) before `before` in its block that write v's buffer, or None
    where anything else uses it (an emitted kernel, a copy)."""
    root, found = buffer_root(v), []
    for u in users(root):
        if u.name == "memref.dealloc":
            continue
        g = analyze(u) if u.name == "linalg.generic" else None
        if g is None:
            return None
        if (any(buffer_root(o) == root for o in g.outputs) and g.op.block == before.block
                and g.op.is_before_in_block(before)):
            found.append(g)
    return found


def _writer(v: ir.Value, before: ir.Operation):
    """The one generic before `before` writing v, all-parallel, v itself its output at the
    point; else None."""
    ws = _writers(v, before)
    if not ws or len(ws) != 1:
        return None
    g = ws[0]
    if g.outputs != [v] or any(it != "parallel" for it in g.iters) or map_dims(g.maps[-1]) != list(range(len(g.iters))):
        return None
    return g


def from_epilogue(v: ir.Value, before: ir.Operation) -> bool:
    """Whether v is written by an elementwise generic that reads, through at most CHAIN such
    generics, the output of a contraction (the chain a contraction's epilogue fusion takes)."""
    g = _writer(v, before)
    for _ in range(CHAIN):
        if g is None:
            return False
        nxt = None
        for x in g.inputs:
            ws = _writers(x, g.op) or []
            if any(match_contraction(w) is not None for w in ws):
                return True
            if nxt is None and ws:
                nxt = _writer(x, g.op)
        g = nxt
    return False


def relayout_gemm_operands(fn: ir.Operation, limits) -> int:
    """Copies the K-contiguous operands of large exact-f32 matmuls that an epilogue computes
    (module docstring); returns how many copies it made."""
    if not enabled(limits):
        return 0
    made = 0
    for g_op, g, c in list(contractions(fn)):
        if g.dynamic or c.batch or c.a_casts or c.b_casts or not c.is_float:
            continue
        work = math.prod(g.ranges)  # type: ignore[arg-type]
        fill = fill_before(g_op, g.outputs[0])
        maps = list(g.maps)
        for k, outer in ((0, c.m), (1, c.n)):
            v = g.inputs[k]
            t = ir.MemRefType(v.type)
            if (map_dims(maps[k]) != [outer, c.k] or str(t.element_type) != "f32" or not identity_layout(v.type)
                    or not t.has_static_shape or not (mode() == "all" or pays(work, 4 * math.prod(t.shape)))
                    or not from_epilogue(v, fill[0] if fill is not None else g_op)):
                continue
            r = permuted(str(t), "f32", tuple(t.shape), (t.shape[1], 1), 0, (outer, c.k), len(g.iters),
                         (outer,), tuple(g.ranges))  # type: ignore[arg-type]
            if r is None:
                continue
            w = _writer(v, g_op)
            buf = copy_before(r, v, next(ops_after(w.op)))  # (right after the writer: the epilogue's chain)
            for u in users(buf):  # (no epilogue takes it: sgemm_relayout.copy_strategy's transpose)
                if u.name == "linalg.generic":
                    u.attributes[COPY] = ir.UnitAttr.get()
            g_op.operands[k] = buf
            maps[k] = ir.AffineMap.get(len(g.iters), 0, [ir.AffineDimExpr.get(c.k), ir.AffineDimExpr.get(outer)])
            made += 1
        g_op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    return made


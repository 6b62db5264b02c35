"""Large exact-f32 GEMMs fed their operands in the outer-contiguous layout (GAC_SGEMM_RELAYOUT=graph;
opt-in, cuda without TF32 only: GpuLimits.sgemm_relayout).

The SIMT sgemm runs its layouts at different speeds on the H200 (4096^3 at 26d8c19, kernel
time: A and B outer-contiguous `tn` 2.67 ms, `nn` 2.80, k-contiguous `nt` 2.92; cuBLAS 2.65-2.73):
an MLP's forward x @ W^T is nt. Here an operand that is read along k (A as [m][k], B as [n][k])
is first copied into [k][m] / [k][n] (a transpose: one `loops` kernel, 128 MB of traffic for a
4096^2 operand), and the GEMM reads the copy; worth it only where the GEMM is much larger than
the copy (every dim >= MIN_DIM). Measured on the H200 (MLP step 4096, 2026-12-02): 14.21 ms, against
13.77 ms with the default tiled transposes of strategies/sgemm_relayout.py: kept opt-in.
"""

from __future__ import annotations

import os

from mlir import ir

from gac_torch.backends.gpu.analysis import fill_before, map_dims
from gac_torch.backends.gpu.hoist import contractions
from gac_torch.backends.gpu.irutil import identity_layout
from gac_torch.backends.gpu.strategies.weight_layout import copy_before, permuted

MIN_DIM = 2048


def enabled(limits) -> bool:
    return os.environ.get("GAC_SGEMM_RELAYOUT") == "graph" and getattr(limits, "sgemm_relayout", False)


def relayout_gemm_operands(fn: ir.Operation, limits) -> int:
    """Copies the k-contiguous operands of large exact-f32 matmuls (module docstring); returns
    how many copies it made."""
    if not enabled(limits):
        return 0
    made = 0
    for g_op, g, c in list(contractions(fn)):
        if g.dynamic or c.batch or c.a_casts or c.b_casts or not c.is_float:
            continue
        if min(g.ranges[c.m], g.ranges[c.n], g.ranges[c.k]) < MIN_DIM:  # type: ignore[type-var]
            continue
        fill = fill_before(g_op, g.outputs[0])
        before = fill[0] if fill is not None else g_op
        maps = list(g.maps)
        for k, outer in ((0, c.m), (1, c.n)):
            v = g.inputs[k]
            t = ir.MemRefType(v.type)
            if (map_dims(maps[k]) != [outer, c.k] or str(t.element_type) != "f32" or not identity_layout(v.type)
                    or not t.has_static_shape):
                continue
            r = permuted(str(t), "f32", tuple(t.shape), (t.shape[1], 1), 0, (outer, c.k), len(g.iters),
                         (outer,), tuple(g.ranges))  # type: ignore[arg-type]
            if r is None:
                continue
            g_op.operands[k] = copy_before(r, v, before)
            maps[k] = ir.AffineMap.get(len(g.iters), 0, [ir.AffineDimExpr.get(c.k), ir.AffineDimExpr.get(outer)])
            made += 1
        g_op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    return made

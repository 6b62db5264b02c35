"""A contraction whose M is several dims, as one: nn.Linear on [B, S, K] reaches the GPU schedule
as a generic over (b, s, n, k) (elementwise fusion propagated the input's reshape into the
matmul), which `match_contraction` (one M dim) refuses. When the M dims form one run in A and in
C, in the same order, and both are dense row-major buffers, the run is one dim of extent
prod(extents): the GEMM reads A and writes C through `memref.collapse_shape` views.

`merged_spec` gives the tensor-core Spec over the merged M (its dim: the run's first; the run's
other dims get extent 1 and no operand uses them); `collapse` makes a view at emit time;
`merge_coef` rewrites an epilogue operand addressed over the contraction's dims."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from mlir import ir
from mlir.dialects import memref

from gac_torch.backends.gpu.analysis import Generic, contraction_body, fill_before, map_dims
from gac_torch.backends.gpu.irutil import identity_layout
from gac_torch.backends.gpu.strategies import mma
from gac_torch.kernels import cuda_mma


@dataclass(frozen=True)
class Rows:
    ms: tuple[int, ...]  # the M dims, outermost first
    ranges: tuple[int, ...]  # the contraction's extents (for merge_coef)

    def merge(self, op: cuda_mma.Operand) -> cuda_mma.Operand:
        """An operand over (.., ms.., ..) as one over (.., ms[0], ..): the run's dims collapsed."""
        p, n = op.dims.index(self.ms[0]), len(self.ms)
        shape = (*op.shape[:p], math.prod(op.shape[p:p + n]), *op.shape[p + n:])
        return cuda_mma.Operand(f"memref<{'x'.join(map(str, shape))}x{op.elem}>", op.elem,
                                (*op.dims[:p], self.ms[0], *op.dims[p + n:]), shape,
                                (*op.strides[:p], op.strides[p + n - 1], *op.strides[p + n:]), op.offset)

    def has_run(self, v: ir.Value, m: ir.AffineMap) -> bool:
        """v is dense row-major and its subscripts hold the M dims as one run, in order."""
        dims = map_dims(m) or []
        if not identity_layout(v.type) or self.ms[0] not in dims:
            return False
        p = dims.index(self.ms[0])
        return tuple(dims[p:p + len(self.ms)]) == self.ms

    def collapse(self, v: ir.Value, m: ir.AffineMap, before: ir.Operation) -> ir.Value:
        """A `memref.collapse_shape` view of v (made before `before`) with the run as one dim."""
        dims = map_dims(m) or []
        p, n = dims.index(self.ms[0]), len(self.ms)
        mt = ir.MemRefType(v.type)
        shape = list(mt.shape)
        groups = [[i] for i in range(p)] + [list(range(p, p + n))] + [[i] for i in range(p + n, mt.rank)]
        i64 = ir.IntegerType.get_signless(64, v.context)
        with ir.InsertionPoint(before), before.location:
            return memref.collapse_shape(
                ir.MemRefType.get([*shape[:p], math.prod(shape[p:p + n]), *shape[p + n:]], mt.element_type), v,
                ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in grp]) for grp in groups]))

    def merge_coef(self, op: Any) -> Any:
        """A conv_gemm.Operand addressed as sum coef[d] * i[d] over the contraction's dims, with
        the run's part linear in the merged index (else None)."""
        coef, ms, r = list(op.coef), self.ms, self.ranges
        if any(coef[ms[i]] != coef[ms[i + 1]] * r[ms[i + 1]] for i in range(len(ms) - 1)):
            return None
        coef[ms[0]] = coef[ms[-1]]
        for d in ms[1:]:
            coef[d] = 0
        return replace(op, coef=tuple(coef))


def merged_spec(g: Generic, allow_tf32: bool) -> tuple[cuda_mma.Spec, Any, Rows] | None:
    """(Spec over the merged M, the fill folded in, Rows) for a float contraction with two or
    more M dims forming one run in dense A and C; None otherwise."""
    if len(g.inputs) != 2 or len(g.outputs) != 1 or g.dynamic:
        return None
    dims = [map_dims(m) for m in g.maps]
    if any(d is None for d in dims):
        return None
    da, db, dc = dims  # type: ignore[misc]
    red = [i for i, t in enumerate(g.iters) if t == "reduction"]
    par = [i for i, t in enumerate(g.iters) if t == "parallel"]
    if len(red) != 1 or red[0] in dc or red[0] not in da or red[0] not in db:
        return None
    ms = tuple(d for d in da if d in par and d not in db)
    ns = [d for d in par if d in db and d not in da]
    batch = [d for d in par if d in da and d in db]
    if len(ms) < 2 or len(ns) != 1 or len(batch) > 1 or not all(d in dc for d in par):
        return None
    body = contraction_body(g)
    if body is None or not body[2]:
        return None
    rows = Rows(ms, tuple(g.ranges))  # type: ignore[arg-type]
    if not rows.has_run(g.inputs[0], g.maps[0]) or not rows.has_run(g.outputs[0], g.maps[2]):
        return None
    kind = mma.tensor_core_kind(g, body[0], body[1], allow_tf32)
    if kind is None:
        return None
    ranges = list(g.ranges)
    ranges[ms[0]] = math.prod(g.ranges[d] for d in ms)  # type: ignore[misc]
    for d in ms[1:]:
        ranges[d] = 1
    fill = fill_before(g.op, g.outputs[0])
    spec = cuda_mma.Spec(kind, ms[0], ns[0], red[0], tuple(batch), tuple(ranges),  # type: ignore[arg-type]
                         rows.merge(mma.operand(g.inputs[0], g.maps[0])), mma.operand(g.inputs[1], g.maps[1]),
                         rows.merge(mma.operand(g.outputs[0], g.maps[2])), fill is not None)
    return spec, fill, rows

"""`matmul`: a contraction with one M, one N, one K dim (+ batch dims) whose body is
`out + cast(a) * cast(b)` -> the SIMT tiled kernel gac_torch/kernels/simt_matmul.py (register
tiles, K staged through shared memory). A fill of the output right before becomes the
accumulators' initial value. Run-time extents take a 64-wide tile and a host-computed grid."""

from __future__ import annotations

from mlir import ir

from gac_torch.backends.gpu.analysis import Contraction, Generic, fill_before, match_contraction
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_fused
from gac_torch.kernels import simt_matmul


def strategy(big_tile_min_blocks: int = 256) -> Strategy:
    """`big_tile_min_blocks`: 128x128 tiles once they still make about two waves."""

    def match(g: Generic, limits: GpuLimits) -> Contraction | None:
        return match_contraction(g)

    def emit(c: Contraction, name: str, limits: GpuLimits) -> bool:
        g = c.g
        names = {g.inputs[0]: "A", g.inputs[1]: "B"}
        fill = fill_before(g.op, g.outputs[0])
        spec = simt_matmul.Spec(
            c.m, c.n, c.k, tuple(c.batch), tuple(g.ranges),
            tuple((names.get(buf, "C"), pos) for buf, pos in g.sources),
            _operand(g.inputs[0], g.maps[0], c.a_casts), _operand(g.inputs[1], g.maps[1], c.b_casts),
            _operand(g.outputs[0], g.maps[2], []), c.is_float, fill is not None)
        tiling = simt_matmul.plan(spec, limits.max_grid, limits.max_static_shared_bytes,
                                  big_tile_min_blocks)
        if tiling is None:
            return False
        splice_fused(simt_matmul.template(spec, tiling), g, fill, spec.c.elem, name)
        return True

    return Strategy("matmul", match, emit)


def _operand(v: ir.Value, m: ir.AffineMap, casts: list[tuple[str, str]]) -> simt_matmul.Operand:
    dims = tuple(e.position for e in m.results)  # a projected permutation (match_contraction)
    return simt_matmul.Operand(str(v.type), str(ir.MemRefType(v.type).element_type), dims, tuple(casts))

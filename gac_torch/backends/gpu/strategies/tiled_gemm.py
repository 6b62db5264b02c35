"""`gemm` (vortex): a plain f32 GEMM -> the tiled local-memory template
gac_torch.kernels.vortex_gemm, a `threads` (rows x cols) CTA with a register tile per thread.
A Vortex CTA must fit one core (its barrier waits for all of its warps) and warps are narrow."""

from __future__ import annotations

from mlir import ir

from gac_torch.backends.gpu.analysis import Generic, fill_before, subscript_dims
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_fused
from gac_torch.kernels import vortex_gemm


def strategy(threads: tuple[int, int]) -> Strategy:
    """`threads`: (rows, cols) of the GEMM CTA; rows * cols <= one core's threads."""

    def match(g: Generic, limits: GpuLimits) -> tuple[Generic, vortex_gemm.GemmShape] | None:
        shape = match_gemm(g) if len(g.inputs) == 2 and len(g.outputs) == 1 else None
        if shape is None or 0 in (shape.M, shape.N, shape.K):
            return None
        return g, shape

    def emit(m: tuple[Generic, vortex_gemm.GemmShape], name: str, limits: GpuLimits) -> bool:
        g, shape = m
        tiling = vortex_gemm.choose_tiling(shape.M, shape.N, shape.K, *threads)
        if tiling.lmem_bytes() > limits.max_static_shared_bytes or any(
                x > lim for x, lim in zip(vortex_gemm.grid(shape, tiling), limits.max_grid)):
            return False
        fill = fill_before(g.op, g.outputs[0])
        text = vortex_gemm.gemm_template(shape, tiling, fused_fill=fill is not None)
        splice_fused(text, g, fill, "f32", name)
        return True

    return Strategy("gemm", match, emit)


def match_gemm(g: Generic) -> vortex_gemm.GemmShape | None:
    """A plain f32 GEMM: out += a * b with one reduction dim k (in A and B), column dims
    (B and C), row dims (A and C) and batch dims (A, B and C)."""
    elems = [str(ir.MemRefType(v.type).element_type) if isinstance(v.type, ir.MemRefType) else ""
             for v in (*g.inputs, *g.outputs)]
    subs = [subscript_dims(m) for m in g.maps]
    if elems != ["f32"] * 3 or any(d is None for d in subs):
        return None
    a, b, out = ({d for d in ds if d is not None} for ds in subs)  # type: ignore[union-attr]
    red = [d for d, t in enumerate(g.iters) if t == "reduction"]
    par = [d for d, t in enumerate(g.iters) if t == "parallel"]
    if len(red) != 1 or red[0] not in a or red[0] not in b or red[0] in out:
        return None
    rows = [d for d in par if d in a and d not in b]
    cols = [d for d in par if d in b and d not in a]
    batch = [d for d in par if d in a and d in b]
    if not rows or not cols or any(d not in out for d in par):
        return None
    # body: yield(addf(out, mulf(a, b))), operands in any order
    ops = [op.operation for op in g.body.operations]
    ba, bb, bc = g.body.arguments
    if [op.name for op in ops] != ["arith.mulf", "arith.addf", "linalg.yield"]:
        return None
    mul, add, yld = ops
    if (set(mul.operands) != {ba, bb} or set(add.operands) != {bc, mul.results[0]}
            or yld.operands[0] != add.results[0]):
        return None
    ext = g.ranges
    return vortex_gemm.GemmShape(
        m_dims=tuple(rows), m_ext=tuple(ext[d] for d in rows),
        n_dims=tuple(cols), n_ext=tuple(ext[d] for d in cols), k=red[0], K=ext[red[0]],
        batch_dims=tuple(batch), batch=tuple(ext[d] for d in batch),
        a_dims=tuple(subs[0]), b_dims=tuple(subs[1]), c_dims=tuple(subs[2]),  # type: ignore[arg-type]
        a_type=str(g.inputs[0].type), b_type=str(g.inputs[1].type), c_type=str(g.outputs[0].type))

"""linalg on tensors -> one gpu.launch per op, for Vortex.

The steps are the CUDA target's (gac_torch.backends.cuda.mapping.map_to_gpu, called with a
Vortex template hook): elementwise fusion, bufferization, copy elision, one `linalg.generic` per
kernel, the `loops` strategy (scf.parallel linearized onto a 1-D grid), `serial` kernels, global
sinking, outlining. What differs is the choice of templates, because a Vortex CTA must fit one core (its barrier
waits for all of its warps) and warps are narrow:

- `gemm`: f32 contractions -> the tiled local-memory template gac_torch.kernels.vortex_gemm,
  a 4x4-thread CTA with a register tile per thread;
- `loops`: everything else, reductions included (CUDA's `reduce` relies on gpu.all_reduce,
  whose upstream lowering assumes 32-lane subgroups).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

from gac_torch.backends.cuda import mapping as cm
from gac_torch.kernels import vortex_gemm


@dataclass(frozen=True)
class VortexLimits:
    """What the mapping needs to know about the device (from the target's data block)."""

    threads_per_warp: int
    threads_per_block: int        # `loops` CTA size: one core's worth of threads
    gemm_threads: tuple[int, int]  # (rows, cols) of the GEMM CTA; rows * cols <= one core
    lmem_bytes: int               # local memory per core
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    tiled_gemm: bool = True       # False: matmuls use `loops` (the scalar baseline)

    def cuda_limits(self) -> cm.MappingLimits:
        return cm.MappingLimits(warp_size=self.threads_per_warp,
                                max_threads_per_block=self.threads_per_block,
                                max_static_shared_bytes=self.lmem_bytes, max_grid=self.max_grid,
                                threads_per_block=self.threads_per_block)


def _subscript_dims(m: ir.AffineMap) -> list[int | None] | None:
    """Dim of each result of a projected permutation; None for a constant-0 (unit) result."""
    out: list[int | None] = []
    for e in m.results:
        if isinstance(e, ir.AffineDimExpr):
            out.append(e.position)
        elif isinstance(e, ir.AffineConstantExpr) and e.value == 0:
            out.append(None)
        else:
            return None
    named = [d for d in out if d is not None]
    return out if len(set(named)) == len(named) else None


def match_gemm(g: cm._Generic) -> vortex_gemm.GemmShape | None:
    """A plain f32 GEMM: out += a * b with one reduction dim k (in A and B), column dims
    (B and C), row dims (A and C) and batch dims (A, B and C)."""
    elems = [str(ir.MemRefType(v.type).element_type) if isinstance(v.type, ir.MemRefType) else ""
             for v in (*g.inputs, *g.outputs)]
    subs = [_subscript_dims(m) for m in g.maps]
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


def _emit_gemm(op: ir.Operation, name: str, limits: VortexLimits) -> bool:
    g = cm._analyze(op)
    shape = match_gemm(g) if g is not None and len(g.inputs) == 2 and len(g.outputs) == 1 else None
    if shape is None or 0 in (shape.M, shape.N, shape.K):
        return False
    tiling = vortex_gemm.choose_tiling(shape.M, shape.N, shape.K, *limits.gemm_threads)
    if tiling.lmem_bytes() > limits.lmem_bytes or any(
            x > lim for x, lim in zip(vortex_gemm.grid(shape, tiling), limits.max_grid)):
        return False
    fill = cm._fill_before(op, g.outputs[0])  # type: ignore[union-attr]
    text = vortex_gemm.gemm_template(shape, tiling, fused_fill=fill is not None)
    cm._splice_template(text, op, [*g.inputs, g.outputs[0]],  # type: ignore[union-attr]
                        fill[1] if fill is not None else None, "f32", name)
    if fill is not None:
        fill[0].erase()
    op.erase()
    return True


def map_to_gpu(module: ir.Module, limits: VortexLimits) -> None:
    """Rewrite the linalg-on-tensors `@main` into host code launching outlined kernels: the
    CUDA target's sequence, with Vortex's template choice (the tiled GEMM, else `loops`)."""
    def map_op(op: ir.Operation, name) -> bool:
        return limits.tiled_gemm and _emit_gemm(op, name("gemm"), limits)

    cm.map_to_gpu(module, limits.cuda_limits(), map_op)


__all__ = ["VortexLimits", "map_to_gpu", "match_gemm"]

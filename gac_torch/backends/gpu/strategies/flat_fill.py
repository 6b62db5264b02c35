"""`fill` and `copy` (vortex), the data movement of a zero padding, on gac_torch.kernels.vortex_fill:
- `fill`: a generic that sets every element of a dense buffer to one scalar (a padding's zeros,
  a max-pool's -inf) -> a flat store loop. A fill right before an op writing the same buffer is
  left alone (that op folds it in: a GEMM's `fill_before`, the `loops` kernel's absorbed fill).
- `copy`: an identity copy between two static buffers of any strides (a source into a padded
  buffer's interior) with rows at least a CTA wide -> a row copy: the outer index decomposed
  once per row, not per element."""

from __future__ import annotations

from mlir import ir

from gac_torch.backends.gpu.analysis import Generic, map_dims
from gac_torch.backends.gpu.irutil import block_ops, defining_op, static_memref
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template
from gac_torch.kernels import vortex_fill


def _dense(t: ir.MemRefType) -> bool:
    strides, offset = t.get_strides_and_offset()
    step = 1
    for n, s in zip(reversed(t.shape), reversed(strides)):
        if n != 1 and s != step:
            return False
        step *= n
    return offset == 0


def _fill_value(g: Generic) -> ir.Value | None:
    """The scalar a fill generic yields (a constant or a value from outside), else None."""
    if len(g.outputs) != 1 or g.inputs or "reduction" in g.iters or g.dynamic:
        return None
    ops = block_ops(g.body)
    if len(ops) != 1 or map_dims(g.maps[-1]) != list(range(len(g.iters))):
        return None
    v = ops[0].operands[0]
    if isinstance(v.owner, ir.Block) and v.owner == g.body:
        return None
    d = defining_op(v)
    return v if d is None or d.block != g.body else None


def strategy() -> Strategy:
    def match(g: Generic, limits: GpuLimits):
        out = g.outputs[0] if len(g.outputs) == 1 else None
        if out is None or not static_memref(out.type) or not _dense(ir.MemRefType(out.type)):
            return None
        value = _fill_value(g)
        if value is None:
            return None
        ops = block_ops(g.op.block)
        nxt = ops[ops.index(g.op) + 1] if ops.index(g.op) + 1 < len(ops) else None
        if nxt is not None and nxt.name == "linalg.generic" and out in list(nxt.operands):
            return None   # the next op folds the fill in
        return g, value

    def emit(m, name: str, limits: GpuLimits) -> bool:
        g, value = m
        t = ir.MemRefType(g.outputs[0].type)
        n = 1
        for s in t.shape:
            n *= s
        threads = limits.threads_per_block
        per = limits.coarsen if n >= limits.coarsen_min_points else 1
        elem = str(t.element_type)
        splice_template(vortex_fill.fill_template(n, per, threads, str(t), elem), g.op, [g.outputs[0]],
                        value, elem, name)
        g.op.erase()
        return True

    return Strategy("fill", match, emit)


def copy_strategy() -> Strategy:
    def match(g: Generic, limits: GpuLimits):
        if len(g.inputs) != 1 or len(g.outputs) != 1 or g.dynamic or "reduction" in g.iters:
            return None
        x, y = g.inputs[0], g.outputs[0]
        if not all(isinstance(v.type, ir.MemRefType) and static_memref(v.type) for v in (x, y)):
            return None
        ident = list(range(len(g.iters)))
        ops = block_ops(g.body)
        if (any(map_dims(m) != ident for m in g.maps) or len(ops) != 1
                or ops[0].operands[0] != g.body.arguments[0] or not g.iters):
            return None
        if x.type.element_type != y.type.element_type:  # type: ignore[attr-defined]
            return None
        # rows shorter than a CTA leave threads idle: SimX, BEVFormer's backbone, rows of 12, 6
        # and 3 took 1.1-2.1x the `loops` kernel's cycles (rows of 24-96: 0.19-0.42x)
        if ir.MemRefType(y.type).shape[-1] < limits.threads_per_block:
            return None
        return g

    def emit(g: Generic, name: str, limits: GpuLimits) -> bool:
        x, y = g.inputs[0], g.outputs[0]
        shape = list(ir.MemRefType(y.type).shape)
        outer, width = tuple(shape[:-1]), shape[-1]
        rows_total = 1
        for n in outer:
            rows_total *= n
        threads = limits.threads_per_block
        # about `coarsen` elements per thread once the copy is large (CTA start-up amortised)
        per_row = -(-width // threads)
        big = rows_total * width >= limits.coarsen_min_points
        rows = max(1, min(rows_total, limits.coarsen // per_row)) if big else 1
        elem = str(ir.MemRefType(y.type).element_type)
        text = vortex_fill.copy_template(outer, width, rows, threads, str(x.type), str(y.type), elem)
        splice_template(text, g.op, [x, y], None, elem, name)
        g.op.erase()
        return True

    return Strategy("copy", match, emit)

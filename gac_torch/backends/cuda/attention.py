"""The GPU mapping's hook for gac.attention (see gac_torch/lowering/attention.py): each call of a
private `gac.attention` function becomes the flash-attention kernel
(gac_torch/kernels/flash_attention.py) where it applies, and is inlined otherwise (then its
maths maps like any other linalg: a score matrix in memory).

Runs on linalg-on-tensors, before bufferization: the kernel reads its operands through
`bufferization.to_buffer ... read_only` (identity layouts; bufferization copies a strided
view first) and writes a fresh buffer that `to_tensor ... restrict writable` hands back, so
bufferization treats the launch like any op and can still write the result straight into an
output argument.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import bufferization, memref

from gac_torch.backends.cuda import mapping as m
from gac_torch.kernels import flash_attention as fa
from gac_torch.lowering.attention import CALLEE_ATTR


def _buf(t: ir.Type) -> fa.Buf | None:
    rt = ir.RankedTensorType(t)
    if not rt.has_static_shape:
        return None
    mt = ir.MemRefType.get(list(rt.shape), rt.element_type)
    strides, _ = mt.get_strides_and_offset()
    return fa.Buf(str(mt), str(rt.element_type), tuple(rt.shape), tuple(strides))


def _spec(call: ir.Operation, info: dict, allow_tf32: bool) -> fa.Spec | None:
    bufs = [_buf(v.type) for v in call.operands] + [_buf(call.results[0].type)]
    if any(b is None for b in bufs):
        return None  # run-time sizes: the unfused maths
    kind = fa.kind_for(bufs[0].elem, allow_tf32)  # type: ignore[union-attr]
    if kind is None:
        return None
    mask = bufs[3] if len(call.operands) == 4 else None
    return fa.Spec(kind, bufs[0], bufs[1], bufs[2], bufs[-1], mask, info["mask"], info["scale"],  # type: ignore[arg-type]
                   info["causal"])


def map_attention(module: ir.Module, fn: ir.Operation, limits: m.MappingLimits | None) -> None:
    """Flash kernels for the calls it can take (limits None: none, e.g. a target without the
    template), then every other call inlined and the private functions dropped."""
    callees = {}
    for op in module.body.operations:
        op = op.operation
        if op.name == "func.func" and CALLEE_ATTR in op.attributes:
            d = ir.DictAttr(op.attributes[CALLEE_ATTR])
            callees[ir.StringAttr(op.attributes["sym_name"]).value] = {
                "scale": ir.FloatAttr(d["scale"]).value, "causal": ir.BoolAttr(d["causal"]).value,
                "mask": ir.StringAttr(d["mask"]).value}
    if not callees:
        return
    n = 0
    for op in m._ops(m._block(fn)):
        if op.name != "func.call":
            continue
        info = callees.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        if info is None or limits is None or not limits.mma:
            continue
        spec = _spec(op, info, limits.allow_tf32)
        p = fa.plan(spec, limits.max_grid, limits.max_static_shared_bytes) if spec is not None else None
        if p is None:
            continue
        with ir.InsertionPoint(op), op.location:
            args = []
            for v in op.operands:
                rt = ir.RankedTensorType(v.type)
                args.append(bufferization.ToBufferOp(ir.MemRefType.get(list(rt.shape), rt.element_type),
                                                     v, read_only=True).result)
            rt = ir.RankedTensorType(op.results[0].type)
            out = memref.AllocOp(ir.MemRefType.get(list(rt.shape), rt.element_type), [], []).result
        # a unique name (outlining would rename a duplicate); _number_kernels renumbers them all
        m._splice_template(fa.template(spec, p), op, [*args, out], None, "f32", f"gac_attn{n}_flash")  # type: ignore[arg-type]
        n += 1
        with ir.InsertionPoint(op), op.location:
            res = bufferization.ToTensorOp(rt, out, restrict=True, writable=True).result
        op.results[0].replace_all_uses_with(res)
        op.erase()
    m.run_passes(module, "inline{default-pipeline=}, symbol-dce")  # (no canonicalize of @main)

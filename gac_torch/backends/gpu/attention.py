"""The schedule's step for gac.attention (see gac_torch/lowering/attention.py): each call of a
private `gac.attention` function is offered to the target's "attention" strategies (e.g.
strategies/flash_attention.py), and is inlined otherwise (then its maths maps like any other
linalg: a score matrix in memory).

Runs on linalg-on-tensors, before bufferization. A strategy's emitter reads the operands through
`bufferization.to_buffer ... read_only` (identity layouts; bufferization copies a strided view
first) and writes a fresh buffer that `to_tensor ... restrict writable` hands back (`buffers`,
`replace_call`), so bufferization treats the launch like any op and can still write the result
straight into an output argument.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import bufferization, memref

from gac_torch.backends.gpu.irutil import block_ops, func_block, run_passes
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.lowering.attention import CALLEE_ATTR


@dataclass(frozen=True)
class AttentionCall:
    """A `func.call` of a gac.attention function: operands (q, k, v[, mask]) -> out."""

    op: ir.Operation
    scale: float
    causal: bool
    mask: str  # the mask's kind, as lowering/attention.py records it


def map_attention(module: ir.Module, fn: ir.Operation, strategies: Sequence[Strategy],
                  limits: GpuLimits, counter: Iterator[int]) -> None:
    """Kernels for the calls an "attention" strategy takes, then every other call inlined and the
    private functions dropped (a module without such calls is left untouched)."""
    callees = {}
    for op in module.body.operations:
        op = op.operation
        if op.name == "func.func" and CALLEE_ATTR in op.attributes:
            d = ir.DictAttr(op.attributes[CALLEE_ATTR])
            callees[ir.StringAttr(op.attributes["sym_name"]).value] = (
                ir.FloatAttr(d["scale"]).value, ir.BoolAttr(d["causal"]).value, ir.StringAttr(d["mask"]).value)
    if not callees:
        return
    mine = [s for s in strategies if s.on == "attention"]
    for op in block_ops(func_block(fn)):
        info = callees.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value) if op.name == "func.call" else None
        if info is None:
            continue
        call = AttentionCall(op, *info)
        for s in mine:
            m = s.match(call, limits)
            if m is not None and s.emit(m, f"gac_k{next(counter)}_{s.name}", limits):
                break
    run_passes(module, "inline{default-pipeline=}, symbol-dce")  # (no canonicalize of @main)


def buffers(call: ir.Operation) -> list[ir.Value]:
    """The call's operands as read-only buffers and a fresh output buffer, inserted before it."""
    with ir.InsertionPoint(call), call.location:
        args = []
        for v in call.operands:
            rt = ir.RankedTensorType(v.type)
            args.append(bufferization.ToBufferOp(ir.MemRefType.get(list(rt.shape), rt.element_type),
                                                 v, read_only=True).result)
        rt = ir.RankedTensorType(call.results[0].type)
        out = memref.AllocOp(ir.MemRefType.get(list(rt.shape), rt.element_type), [], []).result
    return [*args, out]


def replace_call(call: ir.Operation, out: ir.Value) -> None:
    """The call's result becomes the tensor of `out` (written by the kernel spliced before it)."""
    with ir.InsertionPoint(call), call.location:
        res = bufferization.ToTensorOp(call.results[0].type, out, restrict=True, writable=True).result
    call.results[0].replace_all_uses_with(res)
    call.erase()

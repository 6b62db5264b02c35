"""memref-copy-to-linalg: bufferization emits memref.copy, which lowers to a call into MLIR's
C runner library (absent on GPUs and Vortex). linalg.copy lowers to plain loops everywhere."""

from __future__ import annotations

from mlir import ir
from mlir.dialects import linalg


def memref_copy_to_linalg(module: ir.Module) -> ir.Module:
    copies = []

    def visit(op):
        if op.name == "memref.copy":
            copies.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in copies:
        src, dst = op.operands
        with ir.InsertionPoint(op), op.location:
            linalg.copy(src, outs=[dst])
        op.erase()
    return module

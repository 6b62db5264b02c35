"""i1 kernel buffers as bytes. Imports only the MLIR bindings: the cuda compile workers
(backends/cuda/ptx_worker.py) load this file too, without gac_torch (and torch)."""

from __future__ import annotations

from mlir import ir


class I1Unsupported(ValueError):
    """An i1 buffer used in a way the byte rewrite does not handle (host.py: GacUnsupportedError)."""


def store_i1_as_bytes(kernel: ir.Operation) -> None:
    """Kernel buffers of i1 hold one byte per element (torch.bool); the LLVM lowering has no
    i1 memory access. Retype such arguments to i8 and convert at each load and store."""
    from mlir.dialects import arith

    i1, i8 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(8)
    body = kernel.regions[0].blocks[0]
    retyped = []
    for arg in body.arguments:
        if isinstance(arg.type, ir.MemRefType) and ir.MemRefType(arg.type).element_type == i1:
            mt = ir.MemRefType(arg.type)
            arg.set_type(ir.MemRefType.get(mt.shape, i8, mt.layout, mt.memory_space))
            retyped.append(arg)
    if not retyped:
        return
    results = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value).results
    kernel.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in body.arguments], results))
    loads, stores, unsupported = [], [], []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "memref.reinterpret_cast" and op.operands[0] in retyped:
            # a run-time-sized view rebuilt from its base pointer (mapping.py): bytes too
            mt = ir.MemRefType(op.results[0].type)
            op.results[0].set_type(ir.MemRefType.get(mt.shape, i8, mt.layout, mt.memory_space))
            retyped.append(op.results[0])
        elif op.name == "memref.load" and op.operands[0] in retyped:
            loads.append(op)
        elif op.name == "memref.store" and op.operands[1] in retyped:
            stores.append(op)
        elif any(v in retyped for v in op.operands) and op.name not in ("memref.load", "memref.store", "memref.dim"):
            unsupported.append(op.name)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    kernel.walk(collect, ir.WalkOrder.PRE_ORDER)
    if unsupported:  # (raised here: MLIR turns an exception inside a walk into a RuntimeError)
        raise I1Unsupported(f"i1 buffer used by {unsupported[0]} in a kernel")
    for op in loads:
        res = op.results[0]
        users = [(u.owner, u.operand_number) for u in res.uses]
        res.set_type(i8)
        with ir.InsertionPoint.after(op), op.location:
            narrow = arith.trunci(i1, res)
        for owner, idx in users:
            owner.operands[idx] = narrow
    for op in stores:
        with ir.InsertionPoint(op), op.location:
            op.operands[0] = arith.extui(i8, op.operands[0])

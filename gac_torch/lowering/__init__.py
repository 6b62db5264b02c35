"""The shared lowering: a gac module becomes the `linalg` stage every target starts from.

The result follows the ABI described in gac_torch/backends/base.py: memref arguments for inputs
and outputs, tensors inside, outputs written in place with materialize_in_destination.
"""

from __future__ import annotations

from mlir import ir, passmanager
from mlir.dialects import bufferization, func

from gac_torch.ir.builder import op_attrs
from gac_torch.lowering import elementwise, reduction, shape, structured  # noqa: F401 (registers)
from gac_torch.lowering.registry import LOWERINGS


class LoweringError(RuntimeError):
    pass


def _memref(t: ir.RankedTensorType) -> ir.MemRefType:
    return ir.MemRefType.get(list(t.shape), t.element_type)


def lower_to_linalg(gac_module: ir.Module) -> ir.Module:
    """Returns a new module (same context) holding @main in the linalg-stage ABI."""
    src = next(o for o in gac_module.body.operations if o.operation.name == "func.func")
    fn_type = ir.FunctionType(ir.TypeAttr(src.attributes["function_type"]).value)
    ins, outs = list(fn_type.inputs), list(fn_type.results)
    with gac_module.context, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            f = func.FuncOp("main", ir.FunctionType.get([_memref(t) for t in ins + outs], []))
            f.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
            entry = f.add_entry_block()
        with ir.InsertionPoint(entry):
            values: dict = {}
            for arg, t, mem in zip(src.regions[0].blocks[0].arguments, ins, entry.arguments):
                values[arg] = bufferization.ToTensorOp(t, mem, restrict=True).result
            for op in src.regions[0].blocks[0].operations:
                opname = op.operation.name
                if opname == "func.return":
                    for v, dest in zip(op.operands, entry.arguments[len(ins):]):
                        bufferization.MaterializeInDestinationOp(
                            None, values[v], dest, restrict=True, writable=True)
                    func.ReturnOp([])
                    continue
                name = opname.removeprefix("gac.")
                if name not in LOWERINGS:
                    raise LoweringError(f"no lowering for {opname}")
                results = LOWERINGS[name](op, [values[v] for v in op.operands])
                for r, new in zip(op.results, results):
                    if str(r.type) != str(new.type):
                        raise LoweringError(f"lowering of {opname} produced {new.type}, expected {r.type}")
                    values[r] = new
        module.operation.verify()
        pm = passmanager.PassManager.parse("builtin.module(canonicalize, cse)")
        pm.run(module.operation)
    return module


__all__ = ["lower_to_linalg", "LoweringError", "op_attrs"]

"""The shared lowering: a gac module becomes the `linalg` stage every target starts from.

The result follows the ABI described in gac_torch/backends/base.py: memref arguments for inputs
and outputs, tensors inside, outputs written in place with materialize_in_destination.

Bools: torch stores a bool in a byte and LLVM cannot store i1 memrefs, so bool tensors live as
i8 (0/1) "storage" between ops. Data-movement lowerings work on the storage directly; compute
lowerings get an i1 view made by a one-use conversion generic, which elementwise fusion folds
into them, and their i1 results are widened back the same way.
"""

from __future__ import annotations

from mlir import ir, passmanager
from mlir.dialects import bufferization, func

from gac_torch.ir.builder import op_attrs
from gac_torch.lowering import elementwise, reduction, shape, structured  # noqa: F401 (registers)
from gac_torch.lowering.core import convert, elem, elementwise as ew
from gac_torch.lowering.registry import DATA_MOVEMENT, LOWERINGS


class LoweringError(RuntimeError):
    pass


def _i1() -> ir.Type:
    return ir.IntegerType.get_signless(1)


def _i8() -> ir.Type:
    return ir.IntegerType.get_signless(8)


def storage_type(t: ir.RankedTensorType) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(t.shape), _i8()) if str(t.element_type) == "i1" else t


def _memref(t: ir.RankedTensorType) -> ir.MemRefType:
    t = storage_type(t)
    return ir.MemRefType.get(list(t.shape), t.element_type)


def _retype(v: ir.Value, to: ir.Type) -> ir.Value:
    return ew([v], list(ir.RankedTensorType(v.type).shape), [to], lambda s: [convert(s, to)])[0]


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
            values: dict = {}  # gac value -> its storage-form tensor
            for arg, t, mem in zip(src.regions[0].blocks[0].arguments, ins, entry.arguments):
                values[arg] = bufferization.ToTensorOp(storage_type(t), mem, restrict=True).result
            for index, op in enumerate(src.regions[0].blocks[0].operations):
                opname = op.operation.name
                if opname == "func.return":
                    for v, dest in zip(op.operands, entry.arguments[len(ins):]):
                        bufferization.MaterializeInDestinationOp(
                            None, values[v], dest, restrict=True, writable=True)
                    func.ReturnOp([])
                    continue
                # Every op made for gac op #i carries the location "gac<i>"; fusion merges
                # locations, which is how passes/fusion.py reads the kernels back.
                with ir.Location.name(f"gac{index}"):
                    _lower_op(op, opname, values)
        module.operation.verify()
        # Fuse elementwise chains here, once for every target: fewer loops and temporaries, and
        # the bool conversions above disappear into their users. Fusion only moves single-use
        # producers, so it runs before CSE would merge two users' private i8 -> i1 conversions;
        # it can also move a reshape onto an i1 value, which a second round fuses through.
        fuse = passmanager.PassManager.parse(
            "builtin.module(func.func(linalg-fuse-elementwise-ops), canonicalize, cse)")
        for _ in range(3):
            fuse.run(module.operation)
            if not _bool_tensors(module):
                break
        _check_no_bool_buffers(module)
    return module


def _lower_op(op, opname: str, values: dict) -> None:
    name = opname.removeprefix("gac.")
    if name not in LOWERINGS:
        raise LoweringError(f"no lowering for {opname}")
    moves = name in DATA_MOVEMENT
    operands = []
    for v in op.operands:
        s = values[v]
        logical_bool = str(ir.RankedTensorType(v.type).element_type) == "i1"
        operands.append(_retype(s, _i1()) if logical_bool and not moves else s)
    results = LOWERINGS[name](op, operands)
    for r, new in zip(op.results, results):
        want = storage_type(r.type)
        if str(elem(new.type)) == "i1" and str(want.element_type) == "i8":
            new = _retype(new, _i8())
        if str(new.type) != str(want):
            raise LoweringError(f"lowering of {opname} produced {new.type}, expected {want}")
        values[r] = new


def _bool_tensors(module: ir.Module) -> list[str]:
    bad: list[str] = []

    def visit(op):
        for r in op.results:
            t = r.type
            if isinstance(t, ir.RankedTensorType) and str(t.element_type) == "i1":
                bad.append(op.name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return bad


def _check_no_bool_buffers(module: ir.Module) -> None:
    """An i1 tensor that survived fusion would become an i1 buffer, which LLVM lowering cannot
    store (it aborts the process): refuse it here with an error instead."""
    bad = _bool_tensors(module)
    if bad:
        raise LoweringError(f"bool tensor would be materialized by {sorted(set(bad))}")


__all__ = ["lower_to_linalg", "LoweringError", "op_attrs", "storage_type"]

"""The shared lowering: a gac module becomes the `linalg` stage every target starts from.

The result follows the ABI described in gac_torch/backends/base.py: memref arguments for inputs
and outputs, tensors inside, outputs written in place with materialize_in_destination.

Bools: torch stores a bool in a byte and LLVM cannot store i1 memrefs, so bool tensors live as
i8 (0/1) "storage" between ops. Data-movement lowerings work on the storage directly; compute
lowerings get an i1 view made by a one-use conversion generic, which elementwise fusion folds
into them, and their i1 results are widened back the same way.

Run-time sizes: tensor types may have `?` dims and @main may take index arguments (sizes). The
index math the legalizer emitted (arith on index, gac.dim) is carried over as is; before a gac op
is lowered, the dims of its `?` results are reified from its operands (`_reify`), so lowerings
size their buffers with `shape(result)` whatever the shapes.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import bufferization, func
from mlir.dialects import tensor as tensor_d

from gac_torch.ir.builder import op_attrs
from gac_torch.ir.types import DYN
from gac_torch.lowering import core
from gac_torch.lowering import attention, elementwise, reduction, shape, structured  # noqa: F401 (registers)
from gac_torch.lowering.core import convert, elem, elementwise as ew
from gac_torch.lowering.fusion import fuse_elementwise
from gac_torch.lowering.registry import DATA_MOVEMENT, LOWERINGS
from gac_torch.errors import GacUnsupportedError
from gac_torch.runtime import progress


class LoweringError(GacUnsupportedError):
    pass


def _i1() -> ir.Type:
    return ir.IntegerType.get_signless(1)


def _i8() -> ir.Type:
    return ir.IntegerType.get_signless(8)


def storage_type(t: ir.RankedTensorType) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(t.shape), _i8()) if str(t.element_type) == "i1" else t


def _memref(t: ir.Type) -> ir.Type:
    if not isinstance(t, ir.RankedTensorType):
        return t  # a size argument (index) stays a scalar
    t = storage_type(t)
    return ir.MemRefType.get(list(t.shape), t.element_type)


def _retype(v: ir.Value, to: ir.Type) -> ir.Value:
    return ew([v], core.shape(v), [to], lambda s: [convert(s, to)])[0]


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
        core.result_dims.clear()
        core.lowered_attrs.start()
        try:
            _lower_body(src, ins, entry, _i1(), _i8())
        finally:
            core.result_dims.clear()
            core.lowered_attrs.clear()
        module.operation.verify()
        # Fuse elementwise chains here, once for every target: fewer loops and temporaries, and
        # the bool conversions above disappear into their users. Fusion only moves single-use
        # producers, so it runs before CSE would merge two users' private i8 -> i1 conversions;
        # it can also move a reshape onto an i1 value, which a second round fuses through.
        # Contractions take no computing producer as a prologue (fusion.py says why).
        for _ in range(3):
            with progress.timed("fusion (in lower_to_linalg)"):
                fuse_elementwise(module)
            bools = _bool_tensors(module)
            if not bools:
                break
        if bools:  # an i1 buffer, which LLVM lowering cannot store (it aborts the process)
            raise LoweringError(f"bool tensor would be materialized by {sorted(set(bools))}")
    return module


def _lower_body(src, ins: list, entry: ir.Block, i1: ir.Type, i8: ir.Type) -> None:
    with ir.InsertionPoint(entry):
        values: dict = {}  # gac value -> its storage-form tensor (or index)
        for arg, t, mem in zip(src.regions[0].blocks[0].arguments, ins, entry.arguments):
            values[arg] = (bufferization.ToTensorOp(storage_type(t), mem, restrict=True).result
                           if isinstance(t, ir.RankedTensorType) else mem)
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
                if not opname.startswith("gac."):  # index math on sizes: carried over
                    _clone(op, values)
                else:
                    _lower_op(op, opname, values, i1, i8)


def _clone(op, values: dict) -> None:
    if op.operation.name.split(".")[0] != "arith" or any(
            not isinstance(v.type, ir.IndexType) for v in list(op.operands) + list(op.results)):
        raise LoweringError(f"unexpected non-gac op in a gac function: {op.operation.name}")
    new = op.operation.clone()
    for i, v in enumerate(op.operands):
        new.operands[i] = values[v]
    for r, n in zip(op.results, new.results):
        values[r] = n


def _reify(op, name: str, operands: list) -> list[list]:
    """The dims of each result of a gac op with `?` results, from its lowered operands: every
    run-time size of a result is one of an operand (or one of the sizes reshape/broadcast take)."""
    outs = [list(ir.RankedTensorType(r.type).shape) for r in op.results]
    tensors = [v for v in operands if isinstance(v.type, ir.RankedTensorType)]
    dims = [core.shape(v) for v in tensors]
    attrs = op_attrs(op)
    if name in ("reshape", "broadcast", "iota"):
        sizes = iter(v for v in operands if isinstance(v.type, ir.IndexType))
        return [[next(sizes) if s == DYN else s for s in outs[0]]]
    if name == "transpose":
        return [[dims[0][p] for p in attrs["perm"]]]
    if name == "matmul":
        return [dims[0][:-1] + dims[1][-1:]]
    if name == "attention":
        return [dims[0][:-1] + dims[2][-1:]]
    if name == "index_select":
        d = attrs["dim"] % len(dims[0])
        return [dims[0][:d] + dims[1] + dims[0][d + 1:]]
    if name == "gather":
        return [dims[1]]
    if name == "concat":
        d = attrs["dim"] % len(dims[0])
        return [dims[0][:d] + [core.add_sizes(dims[0][d], dims[1][d])] + dims[0][d + 1:]]
    if name in ("reduce", "arg_reduce"):
        rank = len(dims[0])
        red = {d % rank for d in (attrs["dims"] if name == "reduce" else [attrs["dim"]])}
        keep = attrs["keepdim"]
        return [[1 if d in red else s for d, s in enumerate(dims[0]) if keep or d not in red]] * len(outs)
    # Elementwise-like (unary, binary, select, cast, softmax, scan, layer_norm, slice, concat):
    # a run-time size of the result is the size at the same (trailing-aligned) position of an
    # operand that has it as a run-time size too.
    reified = []
    for out in outs:
        row = []
        for i, s in enumerate(out):
            if s != DYN:
                row.append(s)
                continue
            pos = i - len(out)
            src = next((d[pos] for v, d in zip(tensors, dims) if len(d) >= -pos and
                        ir.RankedTensorType(v.type).shape[pos] == DYN), None)
            if src is None:
                raise LoweringError(f"gac.{name}: no operand gives the run-time size of result dim {i}")
            row.append(src)
        reified.append(row)
    return reified


def _lower_op(op, opname: str, values: dict, i1: ir.Type, i8: ir.Type) -> None:
    """(i1, i8: the context's types, made once per module; types compare by identity)"""
    name = opname.removeprefix("gac.")
    if name not in LOWERINGS:
        raise LoweringError(f"no lowering for {opname}")
    moves = name in DATA_MOVEMENT
    operands = []
    for v in op.operands:
        s = values[v]
        t = v.type
        logical_bool = isinstance(t, ir.RankedTensorType) and t.element_type == i1
        operands.append(_retype(s, i1) if logical_bool and not moves else s)
    dynamic = [r for r in op.results if isinstance(r.type, ir.RankedTensorType) and DYN in r.type.shape]
    if dynamic:
        for r, dims in zip(op.results, _reify(op, name, operands)):
            core.result_dims[r] = dims
    results = LOWERINGS[name](op, operands)
    for r, new in zip(op.results, results):
        rt = r.type
        if not isinstance(rt, ir.RankedTensorType):
            values[r] = new
            continue
        want = rt if rt.element_type != i1 else storage_type(rt)
        if want.element_type == i8 and elem(new.type) == i1:
            new = _retype(new, i8)
        if new.type != want and dynamic and _compatible(new.type, want):
            new = tensor_d.CastOp(want, new).result  # a size the lowering knew statically
        if new.type != want:
            raise LoweringError(f"lowering of {opname} produced {new.type}, expected {want}")
        values[r] = new


def _compatible(a: ir.Type, b: ir.Type) -> bool:
    sa, sb = ir.RankedTensorType(a).shape, ir.RankedTensorType(b).shape
    return (len(sa) == len(sb) and str(ir.RankedTensorType(a).element_type) == str(ir.RankedTensorType(b).element_type)
            and all(x == y or DYN in (x, y) for x, y in zip(sa, sb)))


def _bool_tensors(module: ir.Module) -> list[str]:
    bad: list[str] = []

    i1 = _i1()

    def visit(op):
        for r in op.results:
            t = r.type
            if isinstance(t, ir.RankedTensorType) and t.element_type == i1:
                bad.append(op.name)
        # a linalg op's body computes scalars: not visited (pre-order), its results are
        return ir.WalkResult.SKIP if op.name.startswith("linalg.") else ir.WalkResult.ADVANCE

    with module.context:
        module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return bad


__all__ = ["lower_to_linalg", "LoweringError", "op_attrs", "storage_type"]

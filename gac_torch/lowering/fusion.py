"""Elementwise fusion on linalg with one exception: no prologue inside a contraction.

`linalg-fuse-elementwise-ops` fuses every single-use elementwise producer into its consumer, and
propagates reshapes by expanding the consumer's loops, which turns a named `linalg.matmul` into a
generic. A contraction consumer would then get its operand's producer (e.g. bias + ReLU before a
Linear) as a prologue: it is recomputed once per output column, and the body is no longer the
multiply-add that the GEMM strategies (cuda, vortex) recognise. The pass takes no
control function from Python, so such a producer is given a second, temporary use (an op the
pass cannot fold) while it runs: it stays a kernel of its own (its own producers still fuse into
it), or becomes the epilogue of the contraction that produced it where a target does that.
Data movement (transpose, broadcast, copy, widening casts) still folds into the contraction's indexing
maps, which every contraction strategy reads. Such a fold rebuilds the contraction without its
discardable attributes: those in CARRIED come back by the gac op's location name, which the
rebuilt op's (fused) location keeps.
"""

from __future__ import annotations

import re

from mlir import ir, passmanager

_PIPELINE = "func.func(linalg-fuse-elementwise-ops), canonicalize, cse"
_KEEP = "gac_fusion.keep"  # the temporary use; never outlives fuse_elementwise
NAMED_CONTRACTIONS = (
    "linalg.matmul", "linalg.batch_matmul", "linalg.batch_reduce_matmul", "linalg.matvec",
    "linalg.vecmat", "linalg.batch_matvec", "linalg.batch_vecmat", "linalg.dot", "linalg.contract",
    "linalg.mmt4d", "linalg.batch_mmt4d", "linalg.quantized_",
)
CARRIED = ("gac.conv",)  # (lowering/structured.py's CONV_CONTRACTION: a conv's TF32 flag)
_RESHAPES = ("tensor.expand_shape", "tensor.collapse_shape")
_MOVES = ("linalg.transpose", "linalg.broadcast", "linalg.copy")
# Widening conversions: the GEMM kernels apply them while loading an operand (mma/igemm take
# extf), so they still fold into a contraction. A narrowing one (e.g. attention's f32 output to
# bf16) runs once, in its own kernel, and the contraction reads the narrow type.
_WIDENING = ("arith.extf", "arith.extsi", "arith.extui")


def fuse_elementwise(module: ir.Module) -> None:
    """Elementwise fusion (then canonicalize, cse), every computing producer of a contraction's
    operand kept out of the contraction."""
    ctx = module.context
    allowed = ctx.allow_unregistered_dialects
    ctx.allow_unregistered_dialects = True
    keeps: list[ir.Operation] = []
    try:
        contractions = _contractions(module)
        carried = {(name, a) for op in contractions for a in CARRIED if a in op.attributes
                   for name in _loc_names(op)}
        for op in contractions:
            for v in op.operands[:_num_inputs(op)]:
                p = _computing_producer(v)
                if p is not None:
                    with ir.InsertionPoint(op), op.location:
                        keeps.append(ir.Operation.create(_KEEP, operands=[p.result]))
        pm = passmanager.PassManager.parse(f"builtin.module({_PIPELINE})", ctx)
        pm.enable_verifier(False)  # (the result is verified once, below: not after each pass)
        pm.run(module.operation)
        module.operation.verify()
        for op in _contractions(module) if carried else ():  # (no flag to carry: no walk)
            names = _loc_names(op)
            for name, a in carried:
                if name in names:
                    op.attributes[a] = ir.UnitAttr.get()
    finally:
        for k in keeps:
            k.erase()
        ctx.allow_unregistered_dialects = allowed


def _loc_names(op: ir.Operation) -> set[str]:
    """The gac op names ("gac<i>", lowering/__init__.py) in an op's location, fused or not."""
    return set(re.findall(r'"(gac\d+)"', str(op.location)))


def is_contraction(op: ir.Operation) -> bool:
    """A named matmul-like op, or a generic with a reduction dim that two inputs share while each
    has a parallel dim the other lacks (an M and an N)."""
    name = op.name
    if name.startswith(NAMED_CONTRACTIONS):
        return True
    if name != "linalg.generic":
        return False
    iterator_types = op.attributes["iterator_types"]
    if "reduction" not in str(iterator_types):  # (most generics: one string, not one per dim)
        return False
    iters = ["reduction" in str(a) for a in iterator_types]
    if not any(iters):
        return False
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    dims = [{e.position for e in m.results if isinstance(e, ir.AffineDimExpr)}
            for m in maps[:_num_inputs(op)]]
    red = {d for d, r in enumerate(iters) if r}
    par = set(range(len(iters))) - red
    return any((a & b & red) and (a - b) & par and (b - a) & par
               for i, a in enumerate(dims) for b in dims[i + 1:])


def _num_inputs(op: ir.Operation) -> int:
    return len(op.opview.inputs)


def _defining_op(v: ir.Value) -> ir.Operation | None:
    return None if isinstance(v.owner, ir.Block) else v.owner.operation


def _contractions(module: ir.Module) -> list[ir.Operation]:
    found: list[ir.Operation] = []

    def visit(op):
        if op.name.startswith("linalg."):
            if is_contraction(op):
                found.append(op)
            return ir.WalkResult.SKIP  # bodies hold no linalg ops
        return ir.WalkResult.ADVANCE

    # (pre-order: SKIP then leaves the bodies unvisited; the linalg ops come in the same order)
    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _computing_producer(v: ir.Value) -> ir.Operation | None:
    """The all-parallel generic that computes `v`, looking through data movement that fusion
    folds into the contraction's maps; None if `v` comes from elsewhere."""
    while (op := _defining_op(v)) is not None:
        if op.name in _RESHAPES or op.name in _MOVES:
            v = op.operands[0]
            continue
        if op.name != "linalg.generic" or len(op.results) != 1:
            return None
        if any("reduction" in str(a) for a in op.attributes["iterator_types"]):
            return None  # never fused as a producer
        if str(ir.ShapedType(op.results[0].type).element_type) == "i1":
            return None  # a bool view: it must fuse into its users (lowering/__init__.py)
        moved = _moved_input(op)
        if moved is None:
            return op
        v = moved
    return None


def _moved_input(op: ir.Operation) -> ir.Value | None:
    """The input a generic only moves or widens (its body yields ext*(input)), else None."""
    body = op.regions[0].blocks[0]
    ops = list(body.operations)
    x = ops[-1].operands[0] if len(ops[-1].operands) == 1 else None
    for inner in reversed(ops[:-1]):
        if x is None or inner.name not in _WIDENING or _defining_op(x) != inner:
            return None
        x = inner.operands[0]
    args = list(body.arguments)[:_num_inputs(op)]
    if x is None or not isinstance(x.owner, ir.Block) or x not in args:
        return None
    return op.operands[args.index(x)]

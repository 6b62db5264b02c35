"""Divergence-safe control flow for SimX (README: "Divergence: what the code generator must do").

SimX resolves a conditional branch with the last active thread's operands, so every branch
whose condition may differ between the threads of a warp is bracketed:

    %t = vx_split(cond)        // run the two lane groups one after the other
    scf.if %cond { ... } else { ... }
    vx_join(%t)                // reconverge (post-dominates both arms)

A forward uniformity analysis decides which conditions may diverge: thread ids and memory loads
are divergent (a load's value may differ per thread), block ids/dims, constants and kernel
arguments are uniform, and anything computed from a divergent value is divergent. Uniform
branches (a bound on block ids, constant trip counts) are left alone: SPLIT/JOIN costs a few
instructions even when the warp does not diverge.

Loops: every scf.for the mapping emits has uniform bounds; a loop with divergent bounds (or an
scf.while on a divergent condition) would need `vx_pred` and is refused with a clear error.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, func

DIVERGENT_HELPERS = frozenset({"vx_thread_id_x", "vx_thread_id_y", "vx_thread_id_z",
                               "vx_thread_id", "vx_hart_id", "vx_active_threads"})
_MEMORY_READS = ("memref.load", "llvm.load", "vector.load")


def divergent_values(f: ir.Operation) -> set[ir.Value]:
    """Values of `f` that may differ between the threads of a warp (fixpoint over loops)."""
    div: set[ir.Value] = set()

    def any_div(vals) -> bool:
        return any(v in div for v in vals)

    def mark(vals) -> bool:
        new = [v for v in vals if v not in div]
        div.update(new)
        return bool(new)

    changed = True
    while changed:
        changed = False

        def visit(op: ir.Operation) -> ir.WalkResult:
            nonlocal changed
            name = op.name
            if name == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                if callee in DIVERGENT_HELPERS or any_div(op.operands):
                    changed |= mark(op.results)
            elif name in _MEMORY_READS:
                changed |= mark(op.results)
            elif name == "scf.for":
                body = op.regions[0].blocks[0]
                lb, ub, step, *inits = op.operands
                if any_div([lb, ub, step]):
                    changed |= mark([body.arguments[0]])
                yields = list(_terminator(body).operands)
                for i, (init, res) in enumerate(zip(inits, op.results)):
                    if init in div or yields[i] in div or body.arguments[0] in div:
                        changed |= mark([body.arguments[i + 1], res])
            elif name == "scf.if":
                cond_div = op.operands[0] in div
                for region in op.regions:
                    for block in region.blocks:
                        for i, v in enumerate(_terminator(block).operands):
                            if cond_div or v in div:
                                changed |= mark([op.results[i]])
            elif name == "scf.while":
                changed |= mark(op.results)   # refused below when its condition diverges
                for region in op.regions:
                    changed |= mark(region.blocks[0].arguments)
            elif any_div(op.operands):
                changed |= mark(op.results)
            return ir.WalkResult.ADVANCE

        f.walk(visit, ir.WalkOrder.PRE_ORDER)
    return div


def _terminator(block: ir.Block) -> ir.Operation:
    return list(block.operations)[-1].operation


def insert_split_join(f: ir.Operation) -> int:
    """Bracket every divergent scf.if of kernel `f` with vx_split / vx_join; returns how many."""
    div = divergent_values(f)
    ifs: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "scf.if" and op.operands[0] in div:
            ifs.append(op)
        elif op.name == "scf.for" and any(v in div for v in list(op.operands)[:3]):
            raise NotImplementedError("vortex: a loop whose trip count differs between threads "
                                      "(needs vx_pred); not emitted by the mapping")
        elif op.name == "scf.condition" and op.operands[0] in div:
            raise NotImplementedError("vortex: scf.while with a per-thread condition (needs vx_pred)")
        return ir.WalkResult.ADVANCE

    f.walk(visit, ir.WalkOrder.PRE_ORDER)
    i32 = ir.IntegerType.get_signless(32)
    for op in ifs:
        with ir.InsertionPoint(op), op.location:
            token = func.CallOp([i32], "vx_split", [arith.extui(i32, op.operands[0])]).result
        with ir.InsertionPoint.after(op), op.location:
            func.CallOp([], "vx_join", [token])
    return len(ifs)


def declare_helpers(module: ir.Module, names: list[str]) -> None:
    """`func.func private` declarations of vx_split / vx_join if the module lacks them."""
    have = {ir.StringAttr(op.attributes["sym_name"]).value for op in module.body.operations
            if op.operation.name == "func.func"}
    i32 = ir.IntegerType.get_signless(32)
    sigs = {"vx_split": ([i32], [i32]), "vx_join": ([i32], [])}
    with ir.InsertionPoint.at_block_begin(module.body):
        for n in names:
            if n not in have:
                func.FuncOp(n, ir.FunctionType.get(*sigs[n]), visibility="private")

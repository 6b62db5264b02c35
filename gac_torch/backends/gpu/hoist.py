"""Elementwise consumers of a contraction moved up to right after it, so that the GEMM
strategies' epilogue fusion (strategies/epilogue.py: "the elementwise generic right after") can
take them. An MLP's backward computes dh = (dy @ W2) * gelu'(h) with the weight gradient
dW2 = dy^T @ h and the bias gradient sum(dy) in between: without the move, dy @ W2 is stored,
and a loops kernel reads it back with h and stores dh (192 MB at 4096^2 for 64 MB of result).

The move is a reordering of the host block of generics on memrefs (after bufferization, before
any strategy runs), made only where it cannot change a value: no op in between writes a buffer
the consumer reads or writes, or reads the buffer it writes; the views, allocations and
constants it needs move with it. GAC_EPILOGUE_HOIST=0 turns it off (for A/B runs).
"""

from __future__ import annotations

import os

from mlir import ir

from gac_torch.backends.gpu.analysis import analyze, match_contraction
from gac_torch.backends.gpu.irutil import (
    VIEW_OPS, block_ops, buffer_root, defining_op, op_index, ops_between, top_level, users,
)

# Pure host ops a moved consumer may take along (they define buffers, views and constants).
_MOVABLE = ("arith.constant", "ub.poison", "memref.alloc", "memref.get_global", *VIEW_OPS)


def enabled() -> bool:
    return os.environ.get("GAC_EPILOGUE_HOIST", "1") != "0"


def _memrefs(op: ir.Operation) -> tuple[set, set]:
    """(roots read, roots written) by a top-level op: a generic reads its inputs and writes its
    outputs; any other op (with its regions) is taken to read and write every buffer it uses."""
    if op.name == "linalg.generic":
        g = op.opview
        reads = {buffer_root(v) for v in g.inputs if isinstance(v.type, ir.MemRefType)}
        writes = {buffer_root(v) for v in g.outputs if isinstance(v.type, ir.MemRefType)}
        return reads | writes, writes  # (an output's old value may be read too)
    if op.name in _MOVABLE:
        return set(), set()
    touched: set = set()

    def visit(inner: ir.Operation):
        for v in inner.operands:
            if isinstance(v.type, ir.MemRefType):
                touched.add(buffer_root(v))
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return touched, touched


def _elementwise_reader(root: ir.Value, after: ir.Operation) -> ir.Operation | None:
    """The first op after `after` that touches `root`, if it is an elementwise generic with
    one output that reads it (and does not write it)."""
    block = after.block
    tops = sorted({top_level(u, block) for u in users(root)} - {after}, key=op_index)
    later = [t for t in tops if after.is_before_in_block(t)]
    if not later or later[0].name != "linalg.generic":
        return None
    e = analyze(later[0])
    if e is None or "reduction" in e.iters or len(e.outputs) != 1:
        return None
    if buffer_root(e.outputs[0]) == root or not any(
            isinstance(v.type, ir.MemRefType) and buffer_root(v) == root for v in e.inputs):
        return None
    return later[0]


def _needs(e: ir.Operation, first: ir.Operation) -> list[ir.Operation] | None:
    """The ops after `first` that e's operands are defined by (transitively), in block order;
    None if one of them is not a pure host op that may move."""
    block = e.block
    need: dict = {}
    stack = [defining_op(v) for v in e.operands]
    while stack:
        d = stack.pop()
        if d is None or d in need:
            continue
        d = top_level(d, block)
        if not first.is_before_in_block(d):
            continue
        if d.name not in _MOVABLE or d.regions and any(len(r.blocks) for r in d.regions):
            return None
        need[d] = True
        stack.extend(defining_op(v) for v in d.operands)
    return sorted(need, key=op_index)


def contractions(fn: ir.Operation):
    """(op, Generic, Contraction) of each matmul-like generic of fn's block (a snapshot: the
    caller may move ops), in order."""
    for op in block_ops(fn.regions[0].blocks[0]):
        g = analyze(op) if op.name == "linalg.generic" else None
        c = match_contraction(g) if g is not None and len(g.outputs) == 1 else None
        if c is not None:
            yield op, g, c


def hoist_epilogue_consumers(fn: ir.Operation) -> int:
    """Moves each contraction's elementwise consumer up to right after it where that is safe
    (see the module docstring). Returns how many moved."""
    if not enabled():
        return 0
    moved = 0
    for g_op, g, _ in list(contractions(fn)):
        root = buffer_root(g.outputs[0])
        d = defining_op(root)
        if d is None or d.name != "memref.alloc":
            continue  # (a graph output: the epilogue would have to store it too)
        e_op = _elementwise_reader(root, g_op)
        if e_op is None:
            continue
        between = ops_between(g_op, e_op)
        if not any(o.name not in _MOVABLE for o in between):
            continue  # already right after it
        take = _needs(e_op, g_op)
        if take is None:
            continue
        reads, writes = _memrefs(e_op)
        e_reads = reads - writes | {buffer_root(v) for v in e_op.opview.inputs if isinstance(v.type, ir.MemRefType)}
        ok = True
        for x in between:
            if x in take:
                continue
            x_reads, x_writes = _memrefs(x)
            if x_writes & (e_reads | writes) or x_reads & writes:
                ok = False
                break
        if not ok:
            continue
        for o in [*take, e_op][::-1]:
            o.move_after(g_op)
        moved += 1
    return moved

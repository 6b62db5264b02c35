"""A weight cast computed inside the copy that reads it (a memref-level vertical fusion).

Under bf16 autocast a 3x3 conv's weight is cast per call (`T = bf16(w)`, a `loops` kernel) and
then copied into the conv's K order (strategies/weight_layout.py); the stem's is copied into a
zero-padded buffer. With the cast done in the copy, the copy reads w itself: one kernel instead
of two, T never written nor read again (ResNet-50 bf16: ~45 MB less traffic per call), and the
copy is one level earlier for combine.py. Exact: the cast's body is cloned unchanged. Runs on
memrefs after the strategies (the relayout copies exist from then on), under GAC_COMBO.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import linalg

from gac_torch.backends.gpu.combine import READS
from gac_torch.backends.gpu.irutil import (
    block_ops, buffer_root, clone_into, defining_op, erase_if_unused, func_block, identity_layout, users,
    verify_ops,
)


def fold_casts_into_copies(fn: ir.Operation) -> int:
    """On memrefs, after the strategies: an elementwise `T = f(inputs)` (a weight cast) whose
    only reader is one copy-like generic (a weight relayout, a copy into a padded buffer:
    reading each element of T once, through reshapes) is computed inside that copy instead:
    one kernel where there were two, and T is neither written nor read again. Returns how
    many were folded."""
    plans = []  # (found first: folding erases ops a walk's list still holds)
    for p in block_ops(func_block(fn)):
        t = _elementwise_of_inputs(p)
        if t is None:
            continue
        readers = [u for u in users(t) if u != p and u.name != "memref.dealloc"]
        if len(readers) != 1 or readers[0].name != "linalg.generic" or readers[0].block != p.block:
            continue
        c = readers[0]
        ins = list(c.opview.inputs)
        at = [j for j, v in enumerate(ins) if buffer_root(v) == t]
        if len(at) != 1 or not p.is_before_in_block(c) or any(buffer_root(v) == t for v in c.opview.outputs):
            continue
        chain = _reshapes(ins[at[0]], t)
        m = ir.AffineMapAttr(c.attributes["indexing_maps"][at[0]]).value
        if chain is not None and m.is_permutation:
            plans.append((p, c, at[0], chain, t))
    for p, c, j, chain, t in plans:
        _fold(p, c, j, chain)
        erase_if_unused(t)
    return len(plans)


def _elementwise_of_inputs(p: ir.Operation) -> ir.Value | None:
    """The buffer T of `p` when p is `T = f(a, b, ...)`: elementwise, identity maps, T a fresh
    allocation, a, b, ... function arguments (or reshapes of them) of T's shape that nothing
    writes. Not without inputs (a constant T, e.g. `zeros + c`): its reader would read nothing
    in its place, and a loop dim only T's map bounded (a reduction over T) would be left without
    a range (an invalid generic that convert-linalg-to-parallel-loops crashed on)."""
    if p.name != "linalg.generic" or p.results or len(p.opview.outputs) != 1 or not p.opview.inputs:
        return None
    t = p.opview.outputs[0]
    alloc = defining_op(t)
    rank = ir.MemRefType(t.type).rank
    if (alloc is None or alloc.name != "memref.alloc" or not identity_layout(t.type)
            or any(str(a) != '#linalg.iterator_type<parallel>' for a in p.attributes["iterator_types"])
            or any(ir.AffineMapAttr(m).value != ir.AffineMap.get_identity(rank)
                   for m in p.attributes["indexing_maps"])):
        return None
    body = p.regions[0].blocks[0]
    if list(body.arguments[-1].uses) or any(o.name == "linalg.index" for o in block_ops(body)):
        return None
    shape = ir.MemRefType(t.type).shape
    for a in p.opview.inputs:
        root = buffer_root(a)
        if (not isinstance(root.owner, ir.Block) or _reshapes(a, root) is None or not identity_layout(a.type)
                or ir.MemRefType(a.type).shape != shape
                or any(u.name not in READS and not (u.name == "linalg.generic" and _only_input(u))
                       for u in users(root))):
            return None
    return t


def _only_input(g: ir.Operation) -> bool:
    """Whether generic `g` writes no function argument (its outputs are allocations)."""
    return all(not isinstance(buffer_root(v).owner, ir.Block) for v in g.opview.outputs)


def _reshapes(v: ir.Value, t: ir.Value) -> list[ir.Operation] | None:
    """The expand/collapse_shape ops from `t` to `v`, first first; None if the chain holds
    anything else."""
    chain = []
    while v != t:
        d = defining_op(v)
        if d is None or d.name not in ("memref.expand_shape", "memref.collapse_shape"):
            return None
        chain.append(d)
        v = d.operands[0]
    return chain[::-1]


def _fold(p: ir.Operation, c: ir.Operation, j: int, chain: list[ir.Operation]) -> None:
    """Rebuild copy `c` reading p's inputs (through `chain`'s reshapes) in place of its input
    j, with p's body computing the value c read."""
    srcs = list(p.opview.inputs)
    ins, outs = list(c.opview.inputs), list(c.opview.outputs)
    maps = list(c.attributes["indexing_maps"])
    with ir.InsertionPoint(c), c.location:
        views = []
        for a in srcs:
            for op in chain:  # the same reshapes of a (its element type)
                new = op.clone()
                new.operands[0] = a
                mt = ir.MemRefType(op.results[0].type)
                new.results[0].set_type(ir.MemRefType.get(mt.shape, ir.MemRefType(a.type).element_type, mt.layout,
                                                          mt.memory_space))
                a = new.results[0]
            views.append(a)
        new_ins = ins[:j] + views + ins[j + 1:]
        g = linalg.GenericOp([], new_ins, outs, ir.ArrayAttr.get(maps[:j] + [maps[j]] * len(views) + maps[j + 1:]),
                             c.attributes["iterator_types"])
        types = [ir.MemRefType(v.type).element_type for v in new_ins + outs]
        block = g.regions[0].blocks.append(*types)
        args = list(block.arguments)
        with ir.InsertionPoint(block):
            pbody = p.regions[0].blocks[0]
            mapping = dict(zip(list(pbody.arguments)[:-1], args[j:j + len(views)]))
            pops = block_ops(pbody)
            clone_into(pops[:-1], mapping)  # p's value at the element c reads
            value = pops[-1].operands[0]
            cargs = list(c.regions[0].blocks[0].arguments)
            mapping.update(zip(cargs[:j], args[:j]))
            mapping[cargs[j]] = mapping.get(value, value)
            mapping.update(zip(cargs[j + 1:], args[j + len(views):]))
            clone_into(block_ops(c.regions[0].blocks[0]), mapping)
    verify_ops([g.operation], "fold_casts_into_copies")
    c.erase()
    p.erase()

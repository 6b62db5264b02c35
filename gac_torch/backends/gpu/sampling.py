"""Tensor-level steps that let deformable-attention sampling fuse (issue 15, sampling).

Multi-scale deformable attention (models/bevformer/attention.py) is, per level l, a gather
generic `s_l[n, c, q*p]` (grid_sampler_2d) reshaped to [n, c, q, p], weighted and summed over
p; the levels' sums are added (passes/concat_sum.py turns the sum over the concatenated levels
into that form). Two things would keep each level's samples in memory:

1. The gather reads its per-point inputs (grid coordinates [n, 1, q*p]) through maps with a
   constant 0 (a broadcast unit dim), and the coordinates carry a unit dim of their own (a
   slice of the grid's last dim). Reshape propagation (`linalg-fuse-elementwise-ops` folding
   the expand_shape into the gather) needs projected permutations and no collapse in the way:
   `has_reshaped_gather` asks for `linalg-fold-unit-extent-dims` first (only in such graphs).
2. Sibling gather reductions over the same iteration space whose results are only added
   become one reduction whose body adds their terms (`merge_added_reductions`): one kernel for
   all levels, the per-level partial sums never written. (Only sums of gathers: other
   reductions keep the strategies that take them.)
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, linalg

from gac_torch.backends.gpu.bufferize import is_fill
from gac_torch.backends.gpu.irutil import block_ops, clone_into, defining_op, func_block


def _users(v: ir.Value) -> list[ir.Operation]:
    return [u.owner.operation if hasattr(u.owner, "operation") else u.owner for u in v.uses]


def _has_gather(op: ir.Operation) -> bool:
    return any(o.name == "tensor.extract" for o in block_ops(op.regions[0].blocks[0]))


def has_reshaped_gather(fn: ir.Operation) -> bool:
    """A gather generic (a tensor.extract in its body) whose result is reshaped for a
    reduction (deformable attention's weighted sum over points)."""
    def reduces(op: ir.Operation) -> bool:
        return op.name == "linalg.generic" and any("reduction" in str(a) for a in op.attributes["iterator_types"])

    return any(op.name == "linalg.generic" and len(op.results) == 1 and _has_gather(op)
               and any(u.name == "tensor.expand_shape" and any(reduces(c) for c in _users(u.results[0]))
                       for u in _users(op.results[0]))
               for op in block_ops(func_block(fn)))


def _sum_reduction(op: ir.Operation | None) -> ir.Value | None:
    """For a generic summing terms into a zero-filled init (body ends `yield addf(t, out)`):
    its term t, else None."""
    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return None
    iters = [str(a) for a in op.attributes["iterator_types"]]
    if not any("reduction" in a for a in iters):
        return None
    init = defining_op(op.operands[len(op.operands) - 1])
    while init is not None and init.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        init = defining_op(init.operands[0])  # (unit dims dropped or added)
    if init is None or not is_fill(init) or not _zero(init):
        return None
    body = op.regions[0].blocks[0]
    ops = block_ops(body)
    out = body.arguments[len(body.arguments) - 1]
    if len(ops) < 2 or ops[-2].name != "arith.addf" or ops[-1].operands[0] != ops[-2].results[0]:
        return None
    if len(list(out.uses)) != 1:
        return None  # the term reads the running sum
    a, b = ops[-2].operands
    if b == out and a != out:
        return a
    if a == out and b != out:
        return b
    return None


def _loop_ranges(op: ir.Operation) -> list[int] | None:
    """Each loop's extent, read off the operands' static shapes (None if not all known)."""
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    ranges: dict[int, int] = {}
    for v, m in zip(op.operands, maps):
        t = ir.RankedTensorType(v.type)
        for k, e in enumerate(m.results):
            if isinstance(e, ir.AffineDimExpr):
                if t.is_dynamic_dim(k):
                    return None
                ranges[ir.AffineDimExpr(e).position] = t.shape[k]
    n = maps[0].n_dims
    return [ranges[d] for d in range(n)] if len(ranges) == n else None


def _zero(fill: ir.Operation) -> bool:
    v = fill.operands[0] if fill.name == "linalg.fill" else block_ops(fill.regions[0].blocks[0])[0].operands[0]
    c = defining_op(v)
    return c is not None and c.name == "arith.constant" and ir.FloatAttr(c.attributes["value"]).value == 0.0


def _sum_of_inputs(op: ir.Operation) -> bool:
    """An elementwise generic adding all its inputs (one output, same map everywhere)."""
    if op.name != "linalg.generic" or len(op.results) != 1 or len(op.operands) < 3:
        return False
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    if any("reduction" in str(a) for a in op.attributes["iterator_types"]) or any(
            m != maps[0] for m in maps[:-1]) or not maps[0].is_permutation or not maps[-1].is_permutation:
        return False  # (inputs read alike; the output may be a permutation of them)
    body = op.regions[0].blocks[0]
    ops = block_ops(body)
    n = len(op.operands) - 1
    if len(ops) != n or any(o.name != "arith.addf" for o in ops[:-1]) or ops[-1].operands[0] != ops[-2].results[0]:
        return False
    used = [v for o in ops[:-1] for v in o.operands if v in list(body.arguments)]
    return sorted(map(str, used)) == sorted(map(str, list(body.arguments)[:n])) and len(used) == n


def merge_added_reductions(fn: ir.Operation) -> int:
    """sum_a + sum_b (+ ...) of zero-initialised sum reductions over the same iteration space
    (same iterators and output map, each result used only by the add) -> one reduction whose
    body adds all the terms. Returns the number of merged adds."""
    merged = 0
    for add in block_ops(func_block(fn)):
        if not _sum_of_inputs(add):
            continue
        reds = [defining_op(v) for v in list(add.operands)[:-1]]
        if any(r is None or _sum_reduction(r) is None or len(_users(r.results[0])) != 1
               or not _has_gather(r) for r in reds):
            continue  # (sums of gathers only: other reductions keep their strategies)
        if len({r for r in reds}) != len(reds):
            continue
        maps = [list(r.attributes["indexing_maps"]) for r in reds]
        ranges = [_loop_ranges(r) for r in reds]
        if (len({str(r.attributes["iterator_types"]) for r in reds}) != 1
                or len({str(m[-1]) for m in maps}) != 1 or None in ranges
                or any(x != ranges[0] for x in ranges)):
            continue  # not one iteration space
        _merge(reds, maps, add)
        merged += 1
    return merged


def _merge(reds: list[ir.Operation], maps: list[list], add: ir.Operation) -> None:
    last = max(reds, key=lambda r: sum(1 for o in reds if o.is_before_in_block(r)))
    ins = [list(r.operands)[:-1] for r in reds]
    # The add reads the sums through map A and writes through B (permutations): the merged
    # reduction writes element i of a sum straight to the add's position B(A^-1(i)).
    add_maps = list(add.attributes["indexing_maps"])
    a_map, b_map = ir.AffineMapAttr(add_maps[0]).value, ir.AffineMapAttr(add_maps[-1]).value
    a_dims = [ir.AffineDimExpr(e).position for e in a_map.results]
    r_out = ir.AffineMapAttr(maps[0][-1]).value
    out_map = ir.AffineMap.get(r_out.n_dims, r_out.n_symbols, [
        r_out.results[a_dims.index(ir.AffineDimExpr(e).position)] for e in b_map.results])
    with ir.InsertionPoint(last), last.location:  # after every reduction's operands
        out = add.operands[len(add.operands) - 1]
        if not isinstance(out.owner, ir.Block) and not defining_op(out).is_before_in_block(last):
            defining_op(out).move_before(last)
        elem = ir.RankedTensorType(out.type).element_type
        init = linalg.fill(arith.constant(elem, 0.0), outs=[out])
        all_maps = [m for ms, r in zip(maps, reds) for m in ms[:-1]] + [ir.AffineMapAttr.get(out_map)]
        flat = [v for vs in ins for v in vs]
        op = linalg.GenericOp([init.type], flat, [init], ir.ArrayAttr.get(all_maps),
                              reds[0].attributes["iterator_types"])
        block = op.regions[0].blocks.append(*[ir.RankedTensorType(v.type).element_type for v in flat], elem)
        args = list(block.arguments)
        with ir.InsertionPoint(block):
            total, at = None, 0
            for r, vs in zip(reds, ins):
                body = r.regions[0].blocks[0]
                mapping = dict(zip(list(body.arguments)[:-1], args[at:at + len(vs)]))
                at += len(vs)
                clone_into(block_ops(body)[:-2], mapping)
                t = _sum_reduction(r)
                t = mapping.get(t, t)
                total = t if total is None else arith.addf(total, t)
            linalg.YieldOp([arith.addf(total, args[-1])])
    add.results[0].replace_all_uses_with(op.results[0])
    add.erase()
    for r in reds:
        r.erase()

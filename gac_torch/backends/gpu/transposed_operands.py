"""Transposed contraction operands read in place (issue 14, "transposed operands without copies").

`x @ w.T` (nn.Linear's weight, K-major B) and `a.T @ b` arrive as a named contraction reading the
result of a transpose. Elementwise fusion leaves named contractions alone (it would recompute
producers once per use), so the transpose stays a kernel of its own that materialises a copy.
A pure permutation computes nothing, though: here the contraction is generalized and reads the
transpose's source through the composed indexing map instead; the kernel strategies then see
the operand's real layout (wgmma/mma: K- or M/N-major operands, TMA boxes over the original
tensor). A transpose with no other reader is dead afterwards and goes away.

Runs on tensors after elementwise fusion (nothing else is fused into the generalized op).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects.transform import interpreter

from gac_torch.backends.gpu.bufferize import GENERALIZE_SCRIPT
from gac_torch.backends.gpu.irutil import block_ops, defining_op, func_block

_CONTRACTIONS = ("linalg.matmul", "linalg.batch_matmul")


def _maps(op: ir.Operation) -> list[ir.AffineMap]:
    return [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]


def permutation_source(v: ir.Value) -> tuple[ir.Value, ir.AffineMap] | None:
    """(source, map) when `v` is the result of a generic that only permutes one tensor's dims:
    v[i] = source[map(i)]; None otherwise."""
    op = defining_op(v)
    if op is None or op.name != "linalg.generic" or len(op.results) != 1:
        return None
    g = op.opview
    if len(g.inputs) != 1 or len(g.outputs) != 1 or not isinstance(g.inputs[0].type, ir.RankedTensorType):
        return None
    if any("reduction" in str(a) for a in op.attributes["iterator_types"]):
        return None
    body = op.regions[0].blocks[0]
    ops = block_ops(body)
    if len(ops) != 1 or ops[0].name != "linalg.yield" or ops[0].operands[0] != body.arguments[0]:
        return None
    m_in, m_out = _maps(op)
    if not m_in.is_permutation or not m_out.is_permutation:
        return None
    inv = [0] * m_out.n_dims  # out index -> loop index -> source index
    for k, e in enumerate(m_out.results):
        inv[e.position] = k
    return g.inputs[0], _compose(m_in, ir.AffineMap.get_permutation(inv))


def _compose(f: ir.AffineMap, g: ir.AffineMap) -> ir.AffineMap:
    """x -> f(g(x)) for a map `f` of plain dims (a permutation)."""
    return ir.AffineMap.get(g.n_dims, g.n_symbols, [g.results[e.position] for e in f.results])


def fold_transposed_operands(module: ir.Module, fn: ir.Operation) -> None:
    """Each named contraction with a permuted operand becomes a generic reading the permutation's
    source through the composed map."""
    at = [i for i, op in enumerate(block_ops(func_block(fn)))
          if op.name in _CONTRACTIONS and any(permutation_source(v) for v in op.opview.inputs)]
    if not at:
        return
    for i in at:
        block_ops(func_block(fn))[i].attributes["gac.generalize"] = ir.UnitAttr.get()
    script = ir.Module.parse(GENERALIZE_SCRIPT, module.context)
    interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)
    ops = block_ops(func_block(fn))  # (generalizing replaces each op in its place)
    for op in (ops[i] for i in at):
        maps = _maps(op)
        for k, v in enumerate(list(op.opview.inputs)):
            src = permutation_source(v)
            if src is not None:  # contraction index -> permuted tensor's index -> source's
                op.operands[k] = src[0]
                maps[k] = _compose(src[1], maps[k])
        op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    for op in reversed(block_ops(func_block(fn))):  # transposes nobody reads any more
        if len(op.results) == 1 and not list(op.results[0].uses) and permutation_source(op.results[0]):
            op.erase()

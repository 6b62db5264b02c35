"""Transposed matmul operands read in place: `linalg.transpose` feeding a `linalg.matmul` /
`linalg.batch_matmul` folds into the contraction's indexing map, so the GEMM kernel addresses
the untransposed tensor (no transpose kernel, no copy). `x @ w.T`, `dy.T @ x` and the
backward's other layouts arrive this way from the shared lowering. The transpose stays only
where something else still reads it.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import linalg

from gac_torch.backends.gpu.irutil import block_ops, defining_op, func_block

_CONTRACTIONS = {"linalg.matmul": linalg.matmul, "linalg.batch_matmul": linalg.batch_matmul}


def _default_maps(name: str) -> list[ir.AffineMap]:
    """The maps a named matmul / batch_matmul has when it carries none: (b,) m, n, k."""
    b = [0] if name == "linalg.batch_matmul" else []
    m, n, k = (len(b) + i for i in range(3))
    d = ir.AffineDimExpr.get
    return [ir.AffineMap.get(len(b) + 3, 0, [d(x) for x in (*b, *dims)])
            for dims in ((m, k), (k, n), (m, n))]


def _permuted(m: ir.AffineMap, perm: list[int]) -> ir.AffineMap:
    """The map reading transpose(x, perm) at m's results, as a map reading x: result j of the
    transpose is dim perm[j] of x."""
    res: list[ir.AffineExpr] = [None] * len(perm)  # type: ignore[list-item]
    for j, p in enumerate(perm):
        res[p] = m.results[j]
    return ir.AffineMap.get(m.n_dims, m.n_symbols, res)


def fold_transposes_into_matmuls(fn: ir.Operation) -> int:
    """Rewrites every named matmul on tensors whose input is a transpose; returns how many."""
    folded = 0
    for op in block_ops(func_block(fn)):
        build = _CONTRACTIONS.get(op.name)
        if build is None or len(op.results) != 1:
            continue
        ins, init = list(op.operands[:2]), op.operands[2]
        maps = ([ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
                if "indexing_maps" in op.attributes else _default_maps(op.name))
        changed = False
        for i, v in enumerate(ins):
            t = defining_op(v)
            if t is None or t.name != "linalg.transpose":
                continue
            perm = list(ir.DenseI64ArrayAttr(t.attributes["permutation"]))
            new = _permuted(maps[i], perm)
            if op.name == "linalg.batch_matmul" and new.results[0] != maps[i].results[0]:
                continue  # (batch_matmul's verifier wants the batch dim outermost)
            ins[i], maps[i] = t.operands[0], new
            changed = True
        if not changed:
            continue
        cast = op.attributes["cast"] if "cast" in op.attributes else None
        with ir.InsertionPoint(op), op.location:
            res = build(*ins, outs=[init], indexing_maps=maps, cast=cast)
        op.results[0].replace_all_uses_with(res)
        op.erase()
        folded += 1
    for op in block_ops(func_block(fn)):  # transposes nothing reads any more
        if op.name == "linalg.transpose" and not any(True for _ in op.results[0].uses):
            op.erase()
    return folded

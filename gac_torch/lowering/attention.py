"""gac.attention -> a call of a private function holding the plain maths.

A target without a fused kernel inlines the call (the cpu target first thing; the GPU mapping
for each call it does not replace) and runs the maths like any other linalg. A target with one
finds the calls by the callee's `gac.attention` attribute (scale, causal, mask kind) and
replaces them: the cuda target's flash-attention kernel (gac_torch/kernels/flash_attention.py,
a strategy of backends/gpu/strategies/flash_attention.py). The maths here is the reference the
kernel must match:

  s[.., i, j] = scale · Σ_d q[.., i, d] k[.., j, d]  (+ mask, or -inf where a bool mask is false,
                -inf where causal and j > i)
  m = max_j s (0 where every s is -inf), e = exp(s - m), l = Σ_j e
  o[.., i, c] = (Σ_j e[.., i, j] v[.., j, c]) / l, and 0 where l == 0 (every key hidden).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, func
from mlir.dialects import math as mmath

from gac_torch.ir.builder import op_attrs
from gac_torch.lowering.core import (
    PARALLEL,
    REDUCTION,
    accumulator_type,
    const,
    convert,
    dim_map,
    elem,
    empty,
    full,
    generic,
    index,
    shape,
)
from gac_torch.lowering.registry import lowers

CALLEE_ATTR = "gac.attention"  # on the private function: {scale, causal, mask = none|add|bool}


def _d(*ds: int) -> list[ir.AffineExpr]:
    return [ir.AffineDimExpr.get(d) for d in ds]


def _maths(q, k, v, mask, scale: float, causal: bool, out_elem: ir.Type) -> ir.Value:
    qs, ks, vs = shape(q), shape(k), shape(v)
    nb = len(qs) - 2
    S, Dv = ks[-2], vs[-1]
    acc = accumulator_type(elem(q))
    b = list(range(nb))
    i, j, d = nb, nb + 1, nb + 2  # iteration dims of the score generics
    rank = nb + 3
    # 1. scores (accumulated in f32 for f16/bf16, as the matmul lowering does)
    s = generic([q, k], [dim_map(rank, _d(*b, i, d)), dim_map(rank, _d(*b, j, d))],
                [full(qs[:-1] + [S], 0.0, acc)], [dim_map(rank, _d(*b, i, j))],
                [PARALLEL] * (nb + 2) + [REDUCTION],
                lambda x, y, a: [arith.addf(a, arith.mulf(convert(x, acc), convert(y, acc)))])[0]
    # 2. scale, mask, causal
    r2 = nb + 2
    ins, maps = [s], [dim_map(r2, _d(*b, i, j))]
    if mask is not None:
        ms = shape(mask)
        ins.append(mask)
        maps.append(dim_map(r2, [ir.AffineConstantExpr.get(0) if sz == 1 else ir.AffineDimExpr.get(p)
                                 for p, sz in enumerate(ms)]))
    neg = float("-inf")

    def masked(x, *rest):
        y = arith.mulf(x, const(scale, acc))
        if mask is not None:
            mv = rest[0]
            if str(elem(mask)) == "i8":  # bool mask in its storage form: nonzero keeps
                keep = arith.cmpi(arith.CmpIPredicate.ne, mv, const(0, elem(mask)))
                y = arith.select(keep, y, const(neg, acc))
            else:
                y = arith.addf(y, convert(mv, acc))
        if causal:
            y = arith.select(arith.cmpi(arith.CmpIPredicate.sgt, index(j), index(i)), const(neg, acc), y)
        return [y]

    s = generic(ins, maps, [empty(qs[:-1] + [S], acc)], [dim_map(r2, _d(*b, i, j))], [PARALLEL] * r2,
                lambda *a: masked(*a[:-1]))[0]
    # 3. softmax statistics: row max (0 for a row of -inf) and the exponentials
    row = dim_map(r2, _d(*b, i))
    full_map = dim_map(r2, _d(*b, i, j))
    m = generic([s], [full_map], [full(qs[:-1], neg, acc)], [row], [PARALLEL] * (nb + 1) + [REDUCTION],
                lambda x, a: [arith.maximumf(a, x)])[0]
    e = generic([s, m], [full_map, row], [empty(qs[:-1] + [S], acc)], [full_map], [PARALLEL] * r2,
                lambda x, mx, _o: [mmath.exp(arith.subf(x, arith.select(
                    arith.cmpf(arith.CmpFPredicate.OEQ, mx, const(neg, acc)), const(0.0, acc), mx)))])[0]
    lsum = generic([e], [full_map], [full(qs[:-1], 0.0, acc)], [row], [PARALLEL] * (nb + 1) + [REDUCTION],
                   lambda x, a: [arith.addf(a, x)])[0]
    # 4. e @ v, then divided by the row sum
    c = nb + 1
    r3 = nb + 3  # (b.., i, c, j)
    jj = nb + 2
    o = generic([e, v], [dim_map(r3, _d(*b, i, jj)), dim_map(r3, _d(*b, jj, c))],
                [full(qs[:-1] + [Dv], 0.0, acc)], [dim_map(r3, _d(*b, i, c))],
                [PARALLEL] * (nb + 2) + [REDUCTION],
                lambda x, y, a: [arith.addf(a, arith.mulf(x, convert(y, acc)))])[0]
    ro = dim_map(nb + 2, _d(*b, i))
    om = dim_map(nb + 2, _d(*b, i, c))
    return generic([o, lsum], [om, ro], [empty(qs[:-1] + [Dv], out_elem)], [om], [PARALLEL] * (nb + 2),
                   lambda x, t, _o: [convert(arith.select(
                       arith.cmpf(arith.CmpFPredicate.OEQ, t, const(0.0, acc)), const(0.0, acc),
                       arith.divf(x, t)), out_elem)])[0]


def _module_of(block: ir.Block) -> ir.Operation:
    op = block.owner
    while op.name != "builtin.module":
        op = op.parent
    return op


@lowers("attention", moves_data_only=True)  # (a bool mask arrives in its i8 storage form)
def lower_attention(op, operands):
    attrs = op_attrs(op)
    mask = operands[3] if len(operands) > 3 else None
    out_t = ir.RankedTensorType.get(list(ir.RankedTensorType(op.results[0].type).shape),
                                    ir.RankedTensorType(op.results[0].type).element_type)
    here = ir.InsertionPoint.current
    module = _module_of(here.block)
    body = module.regions[0].blocks[0]
    name = f"gac_attention_{sum(1 for o in body.operations if o.operation.name == 'func.func')}"
    kind = "none" if mask is None else "bool" if str(elem(mask)) == "i8" else "add"
    with ir.InsertionPoint(body):
        f = func.FuncOp(name, ir.FunctionType.get([x.type for x in operands], [out_t]),
                        visibility="private")
        f.attributes[CALLEE_ATTR] = ir.DictAttr.get({
            "scale": ir.FloatAttr.get(ir.F64Type.get(), float(attrs["scale"])),
            "causal": ir.BoolAttr.get(bool(attrs["causal"])),
            "mask": ir.StringAttr.get(kind)})
        entry = f.add_entry_block()
        with ir.InsertionPoint(entry):
            a = list(entry.arguments)
            out = _maths(a[0], a[1], a[2], a[3] if mask is not None else None,
                         float(attrs["scale"]), bool(attrs["causal"]), out_t.element_type)
            func.ReturnOp([out])
    return [func.CallOp(f, list(operands)).result]

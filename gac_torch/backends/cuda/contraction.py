"""Strategies `igemm` (tensor cores) and `sgemm` (exact f32, SIMT): a bufferized linalg.generic
that is a contraction over dim *sets* with affine operand maps -- a convolution (M = n, oh, ow;
N = f; K = c, kh, kw; batch = groups), or a GEMM with several M/N/K/batch dims or permuted
operands -- on the implicit-GEMM template gac_torch/kernels/conv_gemm.py.

Precision: f16/bf16 operands use mma.sync with f32 accumulators; f32 ones use TF32 tensor cores
when allowed (convolutions: torch.backends.cudnn.allow_tf32; other contractions: the matmul
flags), else the exact SIMT kernel.
"""

from __future__ import annotations

from mlir import ir

from gac_torch.backends.cuda import mapping as mp
from gac_torch.kernels import conv_gemm, cuda_mma


def _linear(e: ir.AffineExpr) -> tuple[dict[int, int], int] | None:
    """An affine expression as ({dim: coefficient}, constant), or None (mod, floordiv, ...)."""
    if isinstance(e, ir.AffineDimExpr):
        return {e.position: 1}, 0
    if isinstance(e, ir.AffineConstantExpr):
        return {}, e.value
    if isinstance(e, ir.AffineAddExpr):
        x, y = _linear(e.lhs), _linear(e.rhs)
        if x is None or y is None:
            return None
        out = dict(x[0])
        for d, k in y[0].items():
            out[d] = out.get(d, 0) + k
        return out, x[1] + y[1]
    if isinstance(e, ir.AffineMulExpr):
        x, y = _linear(e.lhs), _linear(e.rhs)
        if x is None or y is None:
            return None
        (lin, k), c = (x, y[1]) if not y[0] else (y, x[1]) if not x[0] else (None, None)  # type: ignore[assignment]
        if lin is None:
            return None
        return {d: v * c for d, v in lin.items()}, k * c
    return None


def _body(g: mp._Generic) -> tuple[list, list, bool] | None:
    """(A's casts, B's casts, float) if the body is out + cast*(a) * cast*(b)."""
    body = list(g.body.operations)
    a, b, c = g.body.arguments
    add = mp._defining_op(body[-1].operands[0])
    if add is None or add.name not in ("arith.addf", "arith.addi") or len(body) > 12:
        return None
    lhs, rhs = add.operands
    prod = rhs if lhs == c else lhs if rhs == c else None
    mul = mp._defining_op(prod) if prod is not None else None
    if mul is None or mul.name not in ("arith.mulf", "arith.muli"):
        return None
    x, z = mul.operands
    ca, cb = mp._cast_chain(x, a), mp._cast_chain(z, b)
    if ca is None or cb is None:
        ca, cb = mp._cast_chain(z, a), mp._cast_chain(x, b)
    if ca is None or cb is None or len(body) != len(ca) + len(cb) + 3:
        return None
    return ca, cb, add.name == "arith.addf"


def _operand(v: ir.Value, m: ir.AffineMap) -> conv_gemm.Operand | None:
    t = ir.MemRefType(v.type)
    if not mp.static_memref(v.type):
        return None
    terms = [_linear(e) for e in m.results]
    if any(x is None for x in terms):
        return None
    strides, offset = t.get_strides_and_offset()
    return conv_gemm.operand(str(t), str(t.element_type), tuple(t.shape), tuple(strides), offset,
                             terms, m.n_dims)  # type: ignore[arg-type]


def emit(g: mp._Generic, name, limits: mp.MappingLimits) -> bool:
    """Emit `g` as an implicit-GEMM kernel and return True, or leave it (False)."""
    if len(g.inputs) != 2 or len(g.outputs) != 1 or g.dynamic or not limits.implicit_gemm:
        return False
    if not all(isinstance(v.type, ir.MemRefType) for v in (*g.inputs, *g.outputs)):
        return False
    out_dims = mp._dims(g.maps[2])
    par = [d for d, t in enumerate(g.iters) if t == "parallel"]
    red = [d for d, t in enumerate(g.iters) if t == "reduction"]
    if out_dims is None or sorted(out_dims) != par or not red:
        return False
    body = _body(g)
    if body is None or not body[2]:
        return False
    a_casts, b_casts, _ = body
    ops = [_operand(v, m) for v, m in zip((*g.inputs, *g.outputs), g.maps)]
    if any(o is None for o in ops):
        return False
    a, b, c = ops
    used_a = {d for d, k in enumerate(a.coef) if k}  # type: ignore[union-attr]
    used_b = {d for d, k in enumerate(b.coef) if k}  # type: ignore[union-attr]
    r = tuple(g.ranges)
    if any(d not in used_a or d not in used_b for d in red if r[d] > 1):
        return False
    batch = tuple(d for d in par if d in used_a and d in used_b)
    ms = [d for d in par if d in used_a and d not in used_b]
    ns = [d for d in par if d in used_b and d not in used_a]
    if any(d not in used_a and d not in used_b and r[d] > 1 for d in par):
        return False
    # each set outermost first by C's (K: B's, then A's) address step: unit-stride runs last
    ms.sort(key=lambda d: (-c.coef[d], d))  # type: ignore[union-attr]
    ns.sort(key=lambda d: (-c.coef[d], d))  # type: ignore[union-attr]
    ks = sorted(red, key=lambda d: (-b.coef[d], -a.coef[d], d))  # type: ignore[union-attr]
    ms = ms or [d for d in par if r[d] == 1 and d not in batch][:1]
    ns = ns or [d for d in par if r[d] == 1 and d not in batch and d not in ms][:1]
    if not ms or not ns:
        return False
    ea, eb, ec = a.elem, b.elem, c.elem  # type: ignore[union-attr]
    widen = [("arith.extf", "f32")]
    casts_ok = (a_casts in ([], widen) and b_casts in ([], widen)
                and (ec == "f32" or (not a_casts and not b_casts)))
    conv = any(not isinstance(e, ir.AffineDimExpr) for m in g.maps[:2] for e in m.results)
    allow_tf32 = limits.conv_allow_tf32 if conv else limits.allow_tf32
    kind = cuda_mma.mma_kind(ea, eb, ec, casts_ok, allow_tf32) if limits.mma else None
    if kind is None and ea == eb == ec == "f32" and not a_casts and not b_casts:
        kind = "f32"
    if kind is None:
        return False
    fill = mp._fill_before(g.op, g.outputs[0])
    spec = conv_gemm.Spec(kind, tuple(ms), tuple(ns), tuple(ks), batch, r, a, b, c,  # type: ignore[arg-type]
                          fill is not None)
    plan = conv_gemm.plan(spec, limits.max_grid, limits.max_static_shared_bytes)
    if plan is None:
        return False
    strategy = "sgemm" if kind == "f32" else "igemm"
    mp._splice_template(conv_gemm.template(spec, plan), g.op, [*g.inputs, g.outputs[0]],
                        fill[1] if fill is not None else None, ec, name(strategy))
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True

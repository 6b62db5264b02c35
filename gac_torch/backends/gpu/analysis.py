"""What the strategies ask about a `linalg.generic` on memrefs: its loop space (`Generic`), the
fill right before it, and whether it is a matmul-like contraction."""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import memref

from gac_torch.backends.gpu.irutil import DYN, as_index, block_ops, defining_op, op_at, op_index

@dataclass
class Generic:
    op: ir.Operation
    maps: list[ir.AffineMap]
    iters: list[str]  # "parallel" | "reduction"
    ranges: list[int | None]  # None: known at run time only (see `extent`)
    sources: list[tuple[ir.Value, int]]  # per loop dim: a buffer and its dim of that extent
    inputs: list[ir.Value]
    outputs: list[ir.Value]

    @property
    def body(self) -> ir.Block:
        return self.op.regions[0].blocks[0]

    @property
    def dynamic(self) -> bool:
        return None in self.ranges

    def extent(self, d: int) -> int | ir.Value:
        """Loop dim d's extent: an int, or a host-side `memref.dim` (at the insertion point)."""
        if self.ranges[d] is not None:
            return self.ranges[d]  # type: ignore[return-value]
        buf, pos = self.sources[d]
        return memref.dim(buf, as_index(pos))


def analyze(op: ir.Operation) -> Generic | None:
    g = op.opview
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    iters = ["reduction" if "reduction" in str(a) else "parallel"
             for a in op.attributes["iterator_types"]]
    operands = list(g.inputs) + list(g.outputs)
    ranges: list[int | None] = [None] * len(iters)
    sources: list[tuple[ir.Value, int] | None] = [None] * len(iters)
    for v, m in zip(operands, maps):
        if not isinstance(v.type, ir.MemRefType):
            continue  # scalar operand (e.g. a fill value)
        shape = ir.MemRefType(v.type).shape
        for pos, (size, e) in enumerate(zip(shape, m.results)):
            if isinstance(e, ir.AffineDimExpr):
                if sources[e.position] is None or (ranges[e.position] is None and size != DYN):
                    ranges[e.position] = None if size == DYN else size
                    sources[e.position] = (v, pos)
    if any(s is None for s in sources):
        return None
    return Generic(op, maps, iters, ranges, sources, list(g.inputs), list(g.outputs))  # type: ignore[arg-type]


def map_dims(m: ir.AffineMap) -> list[int] | None:
    """Dim positions of a projected permutation map, or None."""
    out = [e.position for e in m.results if isinstance(e, ir.AffineDimExpr)]
    return out if len(out) == len(m.results) and len(set(out)) == len(out) else None


def fill_before(op: ir.Operation, out: ir.Value) -> tuple[ir.Operation, ir.Value] | None:
    """(fill op, scalar) if the op right before `op` sets every element of `out` to one scalar."""
    f = op_at(op.block, op_index(op) - 1)
    if f is None or f.name != "linalg.generic" or f.operands[len(f.operands) - 1] != out:
        return None
    body = f.regions[0].blocks[0]
    body_ops = block_ops(body)
    maps = [ir.AffineMapAttr(a).value for a in f.attributes["indexing_maps"]]
    if len(body_ops) != 1 or map_dims(maps[-1]) != list(range(maps[-1].n_dims)):
        return None
    value = body_ops[0].operands[0]
    if isinstance(value.owner, ir.Block) and value.owner == body:
        k = list(body.arguments).index(value)
        if k == len(body.arguments) - 1 or maps[k].results:
            return None  # yields the old output or a non-scalar input
        value = f.operands[k]
        if isinstance(value.type, ir.ShapedType):
            return None
    elif defining_op(value).block == body:
        return None
    return f, value


CASTS = ("arith.extf", "arith.truncf", "arith.sitofp", "arith.uitofp", "arith.extsi",
          "arith.extui", "arith.trunci", "arith.fptosi", "arith.fptoui")


@dataclass
class Contraction:
    g: Generic
    m: int
    n: int
    k: int
    batch: list[int]
    a_casts: list[tuple[str, str]]  # (op name, result type) applied to A's element, in order
    b_casts: list[tuple[str, str]]
    is_float: bool


def cast_chain(v: ir.Value, arg: ir.Value) -> list[tuple[str, str]] | None:
    chain: list[tuple[str, str]] = []
    while v != arg:
        op = defining_op(v)
        if op is None or op.name not in CASTS:
            return None
        chain.append((op.name, str(op.results[0].type)))
        v = op.operands[0]
    return chain[::-1]


def match_contraction(g: Generic) -> Contraction | None:
    if len(g.inputs) != 2 or len(g.outputs) != 1:
        return None
    dims = [map_dims(m) for m in g.maps]
    if any(d is None for d in dims):
        return None
    da, db, dc = (set(d) for d in dims)  # type: ignore[arg-type]
    red = [i for i, t in enumerate(g.iters) if t == "reduction"]
    if len(red) != 1 or red[0] in dc or red[0] not in da or red[0] not in db:
        return None
    par = [i for i, t in enumerate(g.iters) if t == "parallel"]
    ms = [d for d in par if d in da and d not in db]
    ns = [d for d in par if d in db and d not in da]
    batch = [d for d in par if d in da and d in db]
    if len(ms) != 1 or len(ns) != 1 or not all(d in dc for d in par):
        return None
    body = contraction_body(g)
    if body is None:
        return None
    ca, cb, is_float = body
    return Contraction(g, ms[0], ns[0], red[0], batch, ca, cb, is_float)


def contraction_body(g: Generic) -> tuple[list, list, bool] | None:
    """(A's casts, B's casts, float) if the body is yield(out + cast*(a) * cast*(b)), in any
    operand order."""
    body = list(g.body.operations)
    a, b, c = g.body.arguments
    add = defining_op(body[-1].operands[0])
    if add is None or add.name not in ("arith.addf", "arith.addi") or len(body) > 12:
        return None
    lhs, rhs = add.operands
    prod = rhs if lhs == c else lhs if rhs == c else None
    mul = defining_op(prod) if prod is not None else None
    if mul is None or mul.name not in ("arith.mulf", "arith.muli"):
        return None
    x, z = mul.operands
    ca, cb = cast_chain(x, a), cast_chain(z, b)
    if ca is None or cb is None:
        ca, cb = cast_chain(z, a), cast_chain(x, b)
    if ca is None or cb is None or len(body) != len(ca) + len(cb) + 3:
        return None
    return ca, cb, add.name == "arith.addf"


def subscript_dims(m: ir.AffineMap) -> list[int | None] | None:
    """Dim of each result of a projected permutation; None for a constant-0 (unit) result."""
    out: list[int | None] = []
    for e in m.results:
        if isinstance(e, ir.AffineDimExpr):
            out.append(e.position)
        elif isinstance(e, ir.AffineConstantExpr) and e.value == 0:
            out.append(None)
        else:
            return None
    named = [d for d in out if d is not None]
    return out if len(set(named)) == len(named) else None


def read_at_own_point(g: Generic, k: int) -> Generic | None:
    """`g` (all parallel, no linalg.index) with its loops permuted so that input k, read through
    a permutation, is read at the loop point; every map composed with that permutation's
    inverse (same elements, same body; e.g. a BatchNorm + ReLU reading an NHWC conv's result
    and writing NCHW). The op is rewritten in place; None (unchanged) when not possible."""
    p = map_dims(g.maps[k])
    n = len(g.iters)
    if p is None or sorted(p) != list(range(n)) or "reduction" in g.iters or any(
            o.name == "linalg.index" for o in g.body.operations):
        return None
    inv = [p.index(d) for d in range(n)]
    q = ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(inv[d]) for d in range(n)])
    maps = [ir.AffineMap.get(n, 0, [e.compose(q) for e in m.results]) for m in g.maps]
    g.op.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    return analyze(g.op)

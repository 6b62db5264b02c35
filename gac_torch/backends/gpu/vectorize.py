"""16-byte accesses for large elementwise `loops` kernels (GAC_LOOPS_VEC=1; off by default until
measured on the H200).

A `loops` kernel gives each thread `coarsen` points a grid apart, each a 4-byte load per input
and a 4-byte store (an optimizer step, an MSE backward: ~2.7 TB/s at 4096^2 on the H200 at
94f1c50). Here a thread's point is 4 consecutive elements of the last dim instead: one
`vector.load` per input (16 bytes, aligned: buffers start 16-byte aligned and the flat index is
a multiple of 4) and one `vector.store`, the arithmetic on vector<4>. Taken only where every
access is a dense, offset-free buffer of the iteration space's own shape read at the point
itself (or a rank-0 scalar, broadcast), the last extent is a multiple of 4, the elements are
f32 and the body is plain arithmetic (no math calls, whose vector forms the NVVM lowering may
not have).
"""

from __future__ import annotations

import os

from mlir import ir
from mlir.dialects import memref, vector

from gac_torch.backends.gpu.irutil import identity_layout

WIDTH = 4
_ARITH = ("arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.negf", "arith.maximumf",
          "arith.minimumf", "arith.maxnumf", "arith.minnumf", "arith.select", "arith.cmpf")


def enabled() -> bool:
    return os.environ.get("GAC_LOOPS_VEC", "0") == "1"


def _dense_point(op: ir.Operation, m: ir.Value, idx: list, args: list, extents: list) -> bool:
    t = m.type
    if not isinstance(t, ir.MemRefType):
        return False
    mt = ir.MemRefType(t)
    return (identity_layout(t) and list(mt.shape) == list(extents) and str(mt.element_type) == "f32"
            and list(idx) == list(args))


def vector_width(body: ir.Block, extents: list) -> int:
    """WIDTH if the scf.parallel body qualifies (module docstring), else 1."""
    if not enabled() or not extents or not all(isinstance(e, int) for e in extents) or extents[-1] % WIDTH:
        return 1
    args = list(body.arguments)
    f32 = ir.F32Type.get()
    for op in list(body.operations)[:-1]:  # (the last: scf.reduce)
        op = op.operation
        name = op.name
        if name == "memref.load":
            ops = list(op.operands)
            if len(ops) == 1 and ir.MemRefType(ops[0].type).rank == 0:
                continue  # a scalar, broadcast
            if not _dense_point(op, ops[0], ops[1:], args, extents):
                return 1
        elif name == "memref.store":
            ops = list(op.operands)
            if not _dense_point(op, ops[1], ops[2:], args, extents):
                return 1
        elif name == "arith.constant":
            if op.results[0].type != f32:
                return 1
        elif name in _ARITH:
            if op.regions or any(str(v.type) not in ("f32", "i1") for v in [*op.operands, *op.results]):
                return 1
        else:
            return 1
    return WIDTH


def emit_vector_body(body: ir.Block, ivs: list) -> None:
    """The body's ops as their vector<WIDTH> forms at the current insertion point, at the
    points `ivs` (the first of WIDTH consecutive ones). The old body is left to the caller."""
    mapping: dict = {}

    def vtype(t: ir.Type) -> ir.Type:
        return ir.VectorType.get([WIDTH], t)

    def vec(v: ir.Value) -> ir.Value:
        x = mapping.get(v, v)
        if isinstance(x.type, ir.VectorType):
            return x
        return vector.broadcast(vtype(x.type), x)

    align = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 4 * WIDTH)
    for op in list(body.operations)[:-1]:
        op = op.operation
        name = op.name
        if name == "memref.load":
            m = op.operands[0]
            if ir.MemRefType(m.type).rank == 0:
                mapping[op.results[0]] = memref.load(m, [])
            else:
                ld = vector.LoadOp(vtype(ir.MemRefType(m.type).element_type), m, ivs)
                ld.operation.attributes["alignment"] = align
                mapping[op.results[0]] = ld.result
        elif name == "memref.store":
            st = vector.StoreOp(vec(op.operands[0]), op.operands[1], ivs)
            st.operation.attributes["alignment"] = align
        elif name == "arith.constant":
            mapping[op.results[0]] = op.clone().results[0]
        else:
            attrs = op.attributes
            new = ir.Operation.create(name, results=[vtype(op.results[0].type)],
                                      operands=[vec(v) for v in op.operands],
                                      attributes={attrs[i].name: attrs[i].attr for i in range(len(attrs))})
            mapping[op.results[0]] = new.results[0]

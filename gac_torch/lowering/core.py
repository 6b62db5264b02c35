"""Building blocks of the gac -> linalg lowering: tensors, generics, scalar math with torch semantics.

Floating-point math on f16/bf16 runs in f32 and is rounded once at the end (as ATen's CPU and CUDA
kernels do); reductions and contractions accumulate in f32 (f64 for f64).

Shapes here are lists of ints with an index Value for each size known only at run time (`?` in
the type): `shape(v)` gives them (tensor.dim of a lowered value, or the sizes lowering/__init__
reified for the gac op being lowered), and every builder below accepts them.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, linalg, tensor

from gac_torch.ir.types import DYN, is_bool, is_float



class _PerThreadDict(threading.local):
    """A dict of its own in every thread: modules are lowered in parallel threads."""

    def __init__(self):
        self.items: dict = {}

    def clear(self) -> None:
        self.items.clear()

    def __contains__(self, key) -> bool:
        return key in self.items

    def __getitem__(self, key):
        return self.items[key]

    def __setitem__(self, key, value) -> None:
        self.items[key] = value


# gac result Value -> its dims (ints / index Values), set while that op is lowered.
result_dims = _PerThreadDict()


class _LoweringAttrs(_PerThreadDict):
    """Attributes reused within one lower_to_linalg call (one context), per thread: `active`
    only between its start() and clear(), so a builder used elsewhere parses its own."""

    def __init__(self):
        super().__init__()
        self.active = False

    def start(self) -> None:
        self.items.clear()
        self.active = True

    def clear(self) -> None:
        self.items.clear()
        self.active = False


lowered_attrs = _LoweringAttrs()

PARALLEL = "parallel"
REDUCTION = "reduction"


def f32() -> ir.Type:
    return ir.F32Type.get()


def index_type() -> ir.Type:
    return ir.IndexType.get()


def static(s) -> int:
    return s if isinstance(s, int) else DYN


def tensor_t(shape: Sequence, elem: ir.Type) -> ir.RankedTensorType:
    return ir.RankedTensorType.get([static(s) for s in shape], elem)


def shape(v: ir.Value) -> list:
    """v's dims: ints, and an index Value where the size is known only at run time."""
    dims = list(ir.RankedTensorType(v.type).shape)
    if DYN not in dims:
        return dims
    if v in result_dims:
        return list(result_dims[v])
    return [tensor.DimOp(v, const(i, index_type())).result if s == DYN else s for i, s in enumerate(dims)]


def prod(dims: Sequence) -> int | ir.Value:
    """The product of sizes (an index Value if any of them is one)."""
    n, values = 1, []
    for s in dims:
        if isinstance(s, int):
            n *= s
        else:
            values.append(s)
    if not values:
        return n
    acc = values[0]
    for v in values[1:] + ([const(n, index_type())] if n != 1 else []):
        acc = arith.muli(acc, v)
    return acc


def add_sizes(a, b) -> int | ir.Value:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    as_value = (lambda s: s if isinstance(s, ir.Value) else const(s, index_type()))
    return arith.addi(as_value(a), as_value(b))


def same_size(a, b) -> bool:
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or (
        isinstance(a, ir.Value) and isinstance(b, ir.Value) and a == b)


def elem(v: ir.Value | ir.Type) -> ir.Type:
    t = v.type if isinstance(v, ir.Value) else v
    if isinstance(t, ir.RankedTensorType):
        return t.element_type
    if isinstance(t, (ir.FloatType, ir.IntegerType, ir.IndexType)):  # a scalar (no printing)
        return t
    return ir.RankedTensorType(t).element_type if str(t).startswith("tensor<") else t


def compute_type(e: ir.Type) -> ir.Type:
    """The type scalar math runs in: f32 for f16/bf16, the type itself otherwise."""
    return f32() if str(e) in ("f16", "bf16") else e


def accumulator_type(e: ir.Type) -> ir.Type:
    return f32() if str(e) in ("f16", "bf16") else e


def empty(shape_: Sequence, e: ir.Type) -> ir.Value:
    return tensor.EmptyOp(list(shape_), e).result


def const(value: float | int | bool, e: ir.Type) -> ir.Value:
    if is_float(e):
        return arith.ConstantOp(e, ir.FloatAttr.get(e, float(value))).result
    if isinstance(e, ir.IndexType) or str(e) == "index":
        return arith.ConstantOp(e, ir.IntegerAttr.get(e, int(value))).result
    return arith.ConstantOp(e, ir.IntegerAttr.get(e, int(value))).result


def full(shape_: Sequence[int], value, e: ir.Type) -> ir.Value:
    """A tensor filled with one value (linalg.fill), the usual reduction init."""
    scalar = const(value, e)  # (made before the empty tensor, as before)
    out = empty(shape_, e)
    # linalg.FillOp with its builtin region: what the OpDSL `linalg.fill` builds (the value's type
    # is the element type: no cast), without that builder's per-call op-definition work
    op = linalg.FillOp([out.type], [scalar], [out])
    linalg.fill_builtin_region(op.operation)
    return op.result


def lowest(e: ir.Type):
    if is_float(e):
        return -math.inf
    return 0 if is_bool(e) else -(1 << (ir.IntegerType(e).width - 1))


def highest(e: ir.Type):
    if is_float(e):
        return math.inf
    return 1 if is_bool(e) else (1 << (ir.IntegerType(e).width - 1)) - 1


def convert(x: ir.Value, to: ir.Type) -> ir.Value:
    """Scalar conversion with torch semantics: float->int truncates, x->bool is x != 0."""
    src = x.type
    if src == to:  # (types are uniqued in their context: equal exactly when printed alike)
        return x
    if is_bool(to):
        zero = const(0, src)
        return (arith.cmpf(arith.CmpFPredicate.UNE, x, zero) if is_float(src)
                else arith.cmpi(arith.CmpIPredicate.ne, x, zero))
    if is_float(src) and is_float(to):
        if str(src) == "f64" and str(to) in ("f16", "bf16"):
            # Through f32, as ATen converts (static_cast<float> first); a direct f64 -> 16-bit
            # truncation would also need a runtime helper the JIT lacks (__truncdfhf2).
            return arith.truncf(to, arith.truncf(f32(), x))
        wider = _float_bits(to) > _float_bits(src)
        if {str(src), str(to)} == {"f16", "bf16"}:  # no direct ext/trunc between the two
            return arith.truncf(to, arith.extf(f32(), x))
        return arith.extf(to, x) if wider else arith.truncf(to, x)
    if is_float(src):
        return arith.fptosi(to, x)
    if is_float(to):
        return arith.uitofp(to, x) if is_bool(src) else arith.sitofp(to, x)
    sw, tw = ir.IntegerType(src).width, ir.IntegerType(to).width
    if tw > sw:
        return arith.extui(to, x) if is_bool(src) else arith.extsi(to, x)
    return arith.trunci(to, x)


def _float_bits(t: ir.Type) -> int:
    return {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}[str(t)]


def dim_map(rank: int, exprs: Sequence[ir.AffineExpr]) -> ir.AffineMap:
    return ir.AffineMap.get(rank, 0, list(exprs))


def identity_map(rank: int) -> ir.AffineMap:
    return ir.AffineMap.get_identity(rank)


def broadcast_map(src_shape: Sequence[int], out_shape: Sequence[int]) -> ir.AffineMap:
    """Indexing map reading a numpy-broadcast operand inside an iteration over out_shape."""
    rank, off = len(out_shape), len(out_shape) - len(src_shape)
    exprs = [ir.AffineConstantExpr.get(0) if isinstance(s, int) and s == 1 and not same_size(out_shape[off + i], 1)
             else ir.AffineDimExpr.get(off + i) for i, s in enumerate(src_shape)]
    return dim_map(rank, exprs)


def splat_scalar(v: ir.Value) -> ir.Attribute | None:
    """The scalar of an arith.constant splat tensor, so generics can use it without a load."""
    owner = v.owner
    if not isinstance(owner, (ir.OpView, ir.Operation)) or owner.operation.name != "arith.constant":
        return None
    attr = owner.attributes["value"]
    if isinstance(attr, ir.DenseElementsAttr) and attr.is_splat:
        return attr.get_splat_value()
    return None


def generic(inputs: Sequence[ir.Value], in_maps: Sequence[ir.AffineMap],
            outputs: Sequence[ir.Value], out_maps: Sequence[ir.AffineMap],
            iterators: Sequence[str],
            body: Callable[..., Sequence[ir.Value]]) -> list[ir.Value]:
    """linalg.generic; `body(*input_scalars, *output_scalars)` returns the yielded values.
    Splat-constant inputs are passed to the body as scalar constants, not read from memory."""
    if REDUCTION not in iterators and any(not _is_empty(o) for o in outputs):
        # An all-parallel generic reading its init (e.g. a sum over no dims of a 0-d tensor)
        # counts as elementwise for linalg-fuse-elementwise-ops, which then folds the init read
        # into every iteration of a broadcasting consumer: read the init as an input instead.
        n_in = len(inputs)
        return generic(list(inputs) + list(outputs), list(in_maps) + list(out_maps),
                       [empty(shape(o), elem(o)) for o in outputs], out_maps, iterators,
                       lambda *a: body(*a[: n_in + len(outputs)]))
    real_inputs, real_maps, slots = [], [], []
    for v, m in zip(inputs, in_maps):
        s = splat_scalar(v)
        slots.append(s)
        if s is None:
            real_inputs.append(v)
            real_maps.append(m)
    maps = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in list(real_maps) + list(out_maps)])
    iters = _iterator_types(tuple(iterators))
    op = linalg.GenericOp([o.type for o in outputs], real_inputs, list(outputs), maps, iters)
    block = op.regions[0].blocks.append(*[elem(v) for v in real_inputs], *[elem(o) for o in outputs])
    with ir.InsertionPoint(block):
        args = list(block.arguments)
        scalars = []
        for s in slots:
            scalars.append(arith.ConstantOp(s.type, s).result if s is not None else args.pop(0))
        linalg.YieldOp(list(body(*scalars, *args)))
    return list(op.results)


def _iterator_types(iterators: tuple) -> ir.Attribute:
    """The iterator_types ArrayAttr, parsed once per kind of iteration while a module is lowered
    (`lowered_attrs`: cleared with result_dims, the attributes belong to that module's context)."""
    attr = lowered_attrs.items.get(iterators) if lowered_attrs.active else None
    if attr is None:
        attr = ir.Attribute.parse("[" + ", ".join(f"#linalg.iterator_type<{it}>" for it in iterators) + "]")
        if lowered_attrs.active:
            lowered_attrs[iterators] = attr
    return attr


def _is_empty(v: ir.Value) -> bool:
    owner = v.owner
    return isinstance(owner, (ir.OpView, ir.Operation)) and owner.operation.name == "tensor.empty"


def elementwise(inputs: Sequence[ir.Value], out_shape: Sequence[int], out_elems: Sequence[ir.Type],
                body: Callable[..., Sequence[ir.Value]]) -> list[ir.Value]:
    """A parallel generic over out_shape reading numpy-broadcast inputs."""
    rank = len(out_shape)
    outs = [empty(out_shape, e) for e in out_elems]
    return generic(inputs, [broadcast_map(shape(v), out_shape) for v in inputs],
                   outs, [identity_map(rank)] * len(outs), [PARALLEL] * rank,
                   lambda *a: body(*a[: len(inputs)]))


def index(d: int, to: ir.Type | None = None) -> ir.Value:
    """linalg.index d inside a generic body, converted to `to` (i64 by default)."""
    i = linalg.IndexOp(ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d)).result
    return arith.index_cast(to or ir.IntegerType.get_signless(64), i)


def reshape(v: ir.Value, new_shape: Sequence) -> ir.Value:
    """Row-major reshape via collapse-to-1-D then expand. An expand may make at most one run-time
    size per group (memref lowering needs the others to divide it out), so a target shape with
    several goes through tensor.reshape with its sizes as a shape operand."""
    src = shape(v)
    if len(src) == len(new_shape) and all(map(same_size, src, new_shape)):
        return v
    e = elem(v)
    if sum(1 for s in new_shape if not isinstance(s, int)) > 1:
        sizes = tensor.FromElementsOp(tensor_t([len(new_shape)], index_type()),
                                      [s if not isinstance(s, int) else const(s, index_type())
                                       for s in new_shape]).result
        return tensor.ReshapeOp(tensor_t(new_shape, e), v, sizes).result
    if len(src) > 1:
        v = tensor.CollapseShapeOp(tensor_t([static(prod(src))], e), v, [list(range(len(src)))]).result
    elif len(src) == 0:
        v = tensor.ExpandShapeOp(tensor_t([1], e), v, [], [], [1]).result
    if len(new_shape) == 0:
        return tensor.CollapseShapeOp(tensor_t([], e), v, []).result
    if len(new_shape) == 1:
        want = tensor_t(new_shape, e)
        return v if v.type == want else tensor.CastOp(want, v).result
    return tensor.ExpandShapeOp(tensor_t(new_shape, e), v, [list(range(len(new_shape)))],
                                [s for s in new_shape if not isinstance(s, int)],
                                [static(s) for s in new_shape]).result


def extract_slice(v: ir.Value, offsets, sizes, strides) -> ir.Value:
    # An empty slice may start at the end; MLIR wants every offset in bounds.
    offsets = [0 if same_size(n, 0) else o for o, n in zip(offsets, sizes)]
    return tensor.ExtractSliceOp(tensor_t(sizes, elem(v)), v, [], [s for s in sizes if not isinstance(s, int)],
                                 [], list(offsets), [static(s) for s in sizes], list(strides)).result


def insert_slice(src: ir.Value, dest: ir.Value, offsets, strides=None) -> ir.Value:
    sizes = shape(src)
    if any(same_size(s, 0) for s in sizes):
        return dest
    strides = strides or [1] * len(sizes)
    return tensor.InsertSliceOp(src, dest, [o for o in offsets if not isinstance(o, int)],
                                [s for s in sizes if not isinstance(s, int)], [],
                                [static(o) for o in offsets], [static(s) for s in sizes],
                                list(strides)).result


def pad_constant(v: ir.Value, low, high, value) -> ir.Value:
    if not any(low) and not any(high):
        return v
    e = elem(v)
    out = [s if lo == hi == 0 else s + lo + hi for s, lo, hi in zip(shape(v), low, high)]
    op = tensor.PadOp(tensor_t(out, e), v, [], [], list(low), list(high))
    block = op.regions[0].blocks.append(*[index_type()] * len(out))
    with ir.InsertionPoint(block):
        tensor.YieldOp(const(value, e))
    return op.result

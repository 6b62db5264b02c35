"""Small IR helpers for the GPU schedule layer: op/value navigation, index arithmetic that folds
when sizes are known, and the one-block gpu.launch every strategy builds its kernel in.

Extents known only at run time are index Values computed on the host (memref.dim of a buffer);
the `size_*` helpers fold when both sides are ints, so static programs keep their constants.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from mlir import ir, passmanager
from mlir.dialects import arith, gpu, memref

from gac_torch.errors import CompileError
from gac_torch.kernels import builder

KERNEL_MODULE = "gac_kernels"  # the gpu.module every kernel is outlined into
DYN = ir.ShapedType.get_dynamic_size()  # a `?` in a memref type's shape
DYN_STRIDE = ir.ShapedType.get_dynamic_stride_or_offset()
VIEW_OPS = ("memref.subview", "memref.expand_shape", "memref.collapse_shape", "memref.cast",
            "memref.reinterpret_cast", "memref.view",
            "memref.extract_strided_metadata")  # (its result 0: the base buffer)
# Ops that may stay in the host function: they only define buffers, views and constants.
HOST_OPS = ("arith.constant", "ub.poison", "memref.alloc", "memref.dealloc", "memref.get_global",
            "gpu.launch", "func.return", "nvgpu.tma.create.descriptor", *VIEW_OPS)


def is_size_math(op: ir.Operation) -> bool:
    """Scalar arithmetic over run-time sizes (and constants) in the host function: it stays on
    the host (the host program evaluates it per call, see gpu/program.py) and feeds grids, kernel
    scalars (e.g. a mean's divisor) and allocation sizes."""
    if op.name in ("memref.dim", "memref.extract_strided_metadata"):
        return True
    if not op.name.startswith("arith.") or op.name == "arith.constant" or op.regions:
        return False
    if any(isinstance(t, ir.ShapedType) for t in [v.type for v in op.operands] + [r.type for r in op.results]):
        return False
    for v in op.operands:  # from the host: function arguments, constants, other size math
        d = defining_op(v)
        if d is not None and d.name != "arith.constant" and not is_size_math(d):
            return False
    return True


def run_passes(module: ir.Module, pipeline: str, verify: bool = True) -> None:
    """Run `pipeline` on `module`; `verify`: its result is verified, once (after the last pass,
    not after each: the verifier changes nothing, and a verification per pass cost ~0.25 s of
    BEVFormer-tiny's gpu stage); `verify=False`: not at all (the caller verifies later: a host
    function holding every kernel body took 0.25 s per verification). GAC_VERIFY_PASSES=1
    verifies after each pass (to find the pass that broke the IR)."""
    pm = passmanager.PassManager.parse(f"builtin.module({pipeline})", module.context)
    each = os.environ.get("GAC_VERIFY_PASSES") == "1"
    pm.enable_verifier(each)
    pm.run(module.operation)
    if verify and not each:
        module.operation.verify()  # (an invalid result: MLIRError, as from a pass's verifier)


def verify_ops(ops, step: str) -> None:
    """Verify each of `ops` (and what they hold) before a pipeline that runs unverified: an
    invalid op there (e.g. a generic with a loop dim no operand bounds, which
    convert-linalg-to-parallel-loops crashed the process on) fails the compile with a
    CompileError naming `step` instead. Cheap where `ops` are the few loose linalg ops rather
    than the whole host function (every kernel body)."""
    for op in ops:
        try:
            op.verify()
        except ir.MLIRError as e:
            raise CompileError(f"gpu stage: {step} left an invalid {op.name} (a compiler bug): {e}") from e


def main_func(module: ir.Module) -> ir.Operation:
    funcs = [op.operation for op in module.body.operations if op.operation.name == "func.func"]
    named = [f for f in funcs if ir.StringAttr(f.attributes["sym_name"]).value == "main"]
    if len(named) != 1 and len(funcs) != 1:
        raise ValueError("expected one func.func @main in the linalg module")
    return (named or funcs)[0]


def func_block(func_op: ir.Operation) -> ir.Block:
    return func_op.regions[0].blocks[0]


def block_ops(block: ir.Block) -> list[ir.Operation]:
    parent = block.owner
    regions = parent.regions if parent is not None else []
    if len(regions) != 1 or len(regions[0].blocks) != 1:
        return [op.operation for op in block.operations]
    # a walk hands out plain Operations: ~8x cheaper than block.operations' OpViews
    parent, ops = parent.operation, []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op == parent:
            return ir.WalkResult.ADVANCE
        ops.append(op)
        return ir.WalkResult.SKIP

    parent.walk(visit, ir.WalkOrder.PRE_ORDER)
    return ops


# Listing a block costs ~10 us an op in Python (an OpView each); the host function has thousands,
# and strategies asked for an op's neighbours by listing it (quadratic over a model). Indexing a
# block walks its list in C, and MLIR caches the op order is_before_in_block compares with.
def op_index(op: ir.Operation) -> int:
    """The position of `op` in its block (a bisection over the block's order)."""
    ops = op.block.operations
    lo, hi = 0, len(ops)
    while lo < hi:
        mid = (lo + hi) // 2
        o = ops[mid].operation
        if o == op:
            return mid
        lo, hi = (mid + 1, hi) if o.is_before_in_block(op) else (lo, mid)
    raise ValueError(f"{op.name} is not in its block")


def op_at(block: ir.Block, i: int) -> ir.Operation | None:
    """The op at position `i` of `block` (None past either end)."""
    ops = block.operations
    return ops[i].operation if 0 <= i < len(ops) else None


def ops_after(op: ir.Operation) -> Iterator[ir.Operation]:
    """The ops after `op` in its block, in order (lazily: a caller after the next few stops early)."""
    ops = op.block.operations
    for i in range(op_index(op) + 1, len(ops)):
        yield ops[i].operation


def ops_between(first: ir.Operation, last: ir.Operation) -> list[ir.Operation]:
    """The ops strictly between `first` and `last` (same block, `first` before)."""
    ops = first.block.operations
    return [ops[i].operation for i in range(op_index(first) + 1, op_index(last))]


def const_int(v: ir.Value) -> int | None:
    owner = v.owner
    if isinstance(owner, ir.Block):
        return None
    op = owner.operation if hasattr(owner, "operation") else owner
    if op.name != "arith.constant":
        return None
    attr = op.attributes["value"]
    return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else None


def defining_op(v: ir.Value) -> ir.Operation | None:
    owner = v.owner
    return None if isinstance(owner, ir.Block) else owner.operation


def buffer_root(v: ir.Value) -> ir.Value:
    """The allocation (func arg, memref.alloc, get_global) a memref view ultimately reads."""
    op = defining_op(v)
    while op is not None and op.name in VIEW_OPS:
        v = op.operands[0]
        op = defining_op(v)
    return v


SETTLE: list = []  # while templates are folded meanwhile: strategy.settle (kernels using v put in place)
PENDING = "__gac_pending_template"  # callee of a kernel's stand-in while a worker folds its template


def is_pending(op: ir.Operation) -> bool:
    """A stand-in of a kernel whose template is being folded (strategy.splice_template): it
    uses the values the kernel will use."""
    return op.name == "func.call" and ir.FlatSymbolRefAttr(op.attributes["callee"]).value == PENDING


def users_now(v: ir.Value) -> Iterator[ir.Operation]:
    """users(v), with the stand-ins of pending kernels (is_pending) among them instead of the
    kernels' own ops (nothing waits for a template to be folded)."""
    yield from _users(v)


def users(v: ir.Value) -> Iterator[ir.Operation]:
    """Ops using `v` directly or through view ops (the views themselves are not returned)."""
    if SETTLE:
        SETTLE[0](v)
    yield from _users(v)


def _users(v: ir.Value) -> Iterator[ir.Operation]:
    for use in v.uses:
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name in VIEW_OPS and op.operands[0] == v:
            yield from _users(op.results[0])
        else:
            yield op


def top_level(op: ir.Operation, block: ir.Block) -> ir.Operation:
    while op.block != block:
        op = op.parent.operation
    return op


class Tops:
    """top_level(op, block) for the many ops of one analysis, memoized by the block holding
    each: the uses of host values are mostly deep in kernel bodies, whose parents are then
    walked once per block rather than once per use. Valid while the IR does not change."""

    def __init__(self, block: ir.Block):
        self.block, self.memo = block, {}

    def __call__(self, op: ir.Operation) -> ir.Operation:
        b = op.block
        if b == self.block:
            return op
        top = self.memo.get(b)
        if top is None:
            top = self.memo[b] = top_level(b.owner.operation, self.block)
        return top


def as_index(v: int | ir.Value) -> ir.Value:
    return v if isinstance(v, ir.Value) else arith.constant(ir.IndexType.get(), v)


def size_mul(a: int | ir.Value, b: int | ir.Value) -> int | ir.Value:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if isinstance(a, int) and a == 1:
        return b
    if isinstance(b, int) and b == 1:
        return a
    return arith.muli(as_index(a), as_index(b))


def size_prod(xs: list) -> int | ir.Value:
    out: int | ir.Value = 1
    for x in xs:
        out = size_mul(out, x)
    return out


def size_ceildiv(a: int | ir.Value, b: int) -> int | ir.Value:
    if isinstance(a, int):
        return -(-a // b)
    return a if b == 1 else arith.ceildivui(a, as_index(b))


def is_static(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def set_kernel_name(launch: ir.Operation, name: str) -> None:
    launch.attributes["module"] = ir.FlatSymbolRefAttr.get(KERNEL_MODULE)
    launch.attributes["function"] = ir.FlatSymbolRefAttr.get(name)


def new_launch(grid: int | ir.Value, block: int, name: str,
                workgroup: tuple[ir.Type, ...] = ()) -> tuple[ir.Operation, ir.Block]:
    """A 1-D gpu.launch at the current insertion point; returns it and its body block."""
    one = as_index(1)
    launch = gpu.LaunchOp((as_index(grid), one, one), (as_index(block), one, one)).operation
    body = launch.regions[0].blocks[0]
    for t in workgroup:
        body.add_argument(t, ir.Location.unknown())
    if workgroup:
        launch.attributes["workgroup_attributions"] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(64), len(workgroup))
    set_kernel_name(launch, name)
    return launch, body


def delinearize(lin: ir.Value, extents: list[int | ir.Value]) -> list[ir.Value]:
    """Row-major indices of `lin` in a box of `extents` (last fastest); lin < prod(extents)."""
    return builder.delinearize(builder.Ir(), lin, extents)


def clone_into(ops: list[ir.Operation], mapping: dict[ir.Value, ir.Value]) -> None:
    """Clone `ops` at the current insertion point, remapping operands (also in nested regions)."""
    for op in ops:
        new = op.clone()
        for old_res, new_res in zip(op.results, new.results):
            mapping[old_res] = new_res

        def remap(o: ir.Operation) -> ir.WalkResult:
            for i, v in enumerate(o.operands):
                if v in mapping:
                    o.operands[i] = mapping[v]
            return ir.WalkResult.ADVANCE

        new.walk(remap, ir.WalkOrder.PRE_ORDER)


def identity_layout(t: ir.Type) -> bool:
    layout = ir.MemRefType(t).layout
    if not isinstance(layout, ir.AffineMapAttr):
        return False
    m = layout.value
    return m == ir.AffineMap.get_identity(m.n_dims) and m.n_symbols == 0


def static_memref(t: ir.Type) -> bool:
    """Shape, strides and offset all known at compile time."""
    mt = ir.MemRefType(t)
    strides, offset = mt.get_strides_and_offset()
    return DYN not in mt.shape and DYN_STRIDE not in (*strides, offset)


def merge_dims(dims: list[int], vals: list[ir.Value], n: int) -> list[ir.Value]:
    out: list[ir.Value] = [None] * n  # type: ignore[list-item]
    for d, v in zip(dims, vals):
        out[d] = v
    return out


def map_indices(m: ir.AffineMap, ivs: list[ir.Value]) -> list[ir.Value]:
    from mlir.dialects import affine

    out = []
    for e in m.results:
        if isinstance(e, ir.AffineDimExpr):
            out.append(ivs[e.position])
        else:
            single = ir.AffineMap.get(m.n_dims, m.n_symbols, [e])
            out.append(affine.apply(single, ivs))
    return out


def load_at(buf: ir.Value, m: ir.AffineMap, ivs: list[ir.Value]) -> ir.Value:
    if not isinstance(buf.type, ir.MemRefType):
        return buf  # scalar operand
    return memref.load(buf, map_indices(m, ivs))


def clone_body(ops: list[ir.Operation], skip: ir.Operation, mapping: dict[ir.Value, ir.Value],
                ivs: list[ir.Value]) -> None:
    for op in ops:
        if op == skip:
            continue
        if op.name == "linalg.index":
            mapping[op.results[0]] = ivs[ir.IntegerAttr(op.attributes["dim"]).value]
            continue
        clone_into([op], mapping)


def erase_if_unused(root: ir.Value) -> None:
    """Drop a scratch allocation nothing reads or writes any more: its views, deallocs, alloc."""
    alloc = defining_op(root)
    if alloc is None or alloc.name != "memref.alloc":
        return
    # (a kernel whose template is folded meanwhile uses what its stand-in uses: strategy.py)
    if any(u.name != "memref.dealloc" for u in _users(root)):
        return

    def drop(v: ir.Value) -> None:
        for use in list(v.uses):
            o = use.owner.operation if hasattr(use.owner, "operation") else use.owner
            if o.name in VIEW_OPS:
                drop(o.results[0])
            o.erase()

    drop(root)
    alloc.erase()

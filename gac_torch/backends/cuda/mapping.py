"""linalg on tensors -> gpu.launch per op: the mapping half of the CUDA pipeline.

Order of work (all in one MLIR module, in place):

1. Tensor level: elementwise named ops (add, exp, transpose, broadcast, ...) are generalized and
   fused into their consumers (`linalg-fuse-elementwise-ops`); matmul/conv/pooling stay named so
   no producer is fused (and recomputed) into them.
2. Bufferization (`bufferize`). Fills are un-shared (CSE merges the zero inits of several
   reductions/matmuls; each consumer gets its own fill right before it). The ABI's
   `materialize_in_destination ... restrict writable %out` (memref destination, a write One-Shot
   Analysis cannot see) is rewritten to the tensor form on `to_tensor %out restrict writable`, so
   `eliminate-empty-tensors` + one-shot-bufferize write results straight into the output
   buffers only where that is safe; intermediates become `memref.alloc`. Copies into an output
   from a buffer that dies right after are elided (the producer writes the output directly).
   Remaining copies become `linalg.copy`, then every named op is generalized, so each op left is
   one `linalg.generic` on memrefs = one kernel. (pipeline.py checks the resulting launch list's
   dataflow: a lost or clobbered value fails the compile.)
3. Each generic picks a strategy (the kernel name records it):
   - `mma`: a matmul-like contraction (below) on f16/bf16 operands, or f32 ones when TF32 is
     allowed, on sm_80+: tensor cores with mma.sync (gac_torch/kernels/cuda_mma.py), f32
     accumulators.
   - `matmul`: a contraction with one M, one N, one K dim (+ batch dims) whose body is
     `out + cast(a) * cast(b)`: a 16x16-thread block computes a (16*TM)x(16*TN) tile (TM, TN up
     to 8 when the grid still has ~2 waves), K is staged through shared memory 16 deep, each
     thread accumulates a TMxTN register tile (f32 for f16/bf16 outputs, as torch does). A fill
     of the output right before becomes the accumulators' initial value.
   - `reduce`: a reduction with a recognized combiner (add, mul, min/max, and/or/xor) over at
     least 128 elements, when the reduced dims are innermost or the output is small: one warp
     per output (rows up to 1024, shuffle butterfly) or one block per output (gpu.all_reduce);
     lanes stride over the reduction space with a constant trip count; f16/bf16 accumulate in
     f32, small ints in i32.
   - `loops` (the fallback for any linalg op): loops are interchanged so parallel dims come
     first, `convert-linalg-to-parallel-loops`, then the scf.parallel space is linearized onto a
     1-D grid of 1-D blocks (last dim fastest, so row-major writes coalesce; large elementwise
     spaces give each thread 4 points a grid apart); reduction dims stay sequential loops inside
     the thread. A fill of the output right before is folded into the same kernel.
   - `serial`: scalar leftovers (rank-0 ops) run in a single-thread kernel.
4. `gpu-kernel-outlining` puts every kernel into one `gpu.module @gac_kernels`.

Run-time sizes (`?` dims): extents become host index values (`memref.dim` + arith, evaluated per
call by the host program); `loops` and `reduce` take run-time trip counts and grids (a run-time
reduction length gets a warp per row), `matmul` a 64-wide tile and a host-computed grid (`mma`
needs static shapes); a buffer with a run-time layout enters a kernel as its base pointer plus
index scalars and is rebuilt there with `memref.reinterpret_cast` (bare pointers stay the ABI).
What this cannot map raises NotImplementedError, which the cuda pipeline reports as
StaticShapesOnly: the graph is then compiled per shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mlir import ir, passmanager
from mlir.dialects import arith, gpu, linalg, memref, scf
from mlir.dialects.transform import interpreter

from gac_torch.kernels import cuda_mma

KERNEL_MODULE = "gac_kernels"
_DYN = ir.ShapedType.get_dynamic_size()  # a `?` in a memref type's shape

# Named ops kept named through elementwise fusion: fusing a producer into them would recompute
# it once per use (N times for a matmul operand); they also get dedicated strategies.
_KEEP_NAMED = (
    "linalg.matmul", "linalg.batch_matmul", "linalg.batch_reduce_matmul", "linalg.matvec",
    "linalg.vecmat", "linalg.batch_matvec", "linalg.batch_vecmat", "linalg.dot", "linalg.contract",
    "linalg.conv_", "linalg.depthwise_conv", "linalg.pooling_", "linalg.mmt4d",
    "linalg.batch_mmt4d", "linalg.quantized_",
)
_VIEW_OPS = ("memref.subview", "memref.expand_shape", "memref.collapse_shape", "memref.cast",
             "memref.reinterpret_cast", "memref.view",
             "memref.extract_strided_metadata")  # (its result 0: the base buffer)
# Ops that may stay in the host function: they only define buffers, views and constants.
_HOST_OPS = ("arith.constant", "ub.poison", "memref.alloc", "memref.dealloc", "memref.get_global",
             "gpu.launch", "func.return", *_VIEW_OPS)


@dataclass(frozen=True)
class MappingLimits:
    """What the mapping needs to know about the device (filled from target.py's data block)."""

    warp_size: int = 32
    max_threads_per_block: int = 1024
    max_static_shared_bytes: int = 48 * 1024
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    threads_per_block: int = 256  # `loops` strategy block size
    coarsen: int = 4  # `loops`: points per thread for large elementwise spaces
    coarsen_min_points: int = 1 << 20
    big_tile_min_blocks: int = 256  # matmul: 128x128 tiles once they still make ~2 waves
    reduce_threads: int = 256  # `reduce` strategy: threads per block
    warp_reduce_max: int = 1024  # reductions up to this extent get one warp per output
    reduce_min_extent: int = 128  # smaller reductions stay sequential per thread
    mma: bool = False  # tensor cores with mma.sync m16n8k16 / m16n8k8 (sm_80 and later)
    allow_tf32: bool = False  # f32 matmuls may run on tensor cores in TF32 (numerics option)
    conv_allow_tf32: bool = False  # f32 convolutions likewise (torch.backends.cudnn.allow_tf32)
    implicit_gemm: bool = True  # convs / multi-dim contractions on kernels/conv_gemm.py
    fuse_epilogue: bool = True  # ... with the elementwise consumer in their store step
    fuse_padding: bool = True  # ... reading a zero-padded input through bounds checks


def is_size_math(op: ir.Operation) -> bool:
    """Scalar arithmetic over run-time sizes (and constants) in the host function: it stays on
    the host (the host program evaluates it per call, see program.py) and feeds grids, kernel
    scalars (e.g. a mean's divisor) and allocation sizes."""
    if op.name in ("memref.dim", "memref.extract_strided_metadata"):
        return True
    if not op.name.startswith("arith.") or op.name == "arith.constant" or op.regions:
        return False
    if any(isinstance(t, ir.ShapedType) for t in [v.type for v in op.operands] + [r.type for r in op.results]):
        return False
    for v in op.operands:  # from the host: function arguments, constants, other size math
        d = _defining_op(v)
        if d is not None and d.name != "arith.constant" and not is_size_math(d):
            return False
    return True


# --------------------------------------------------------------------------------------------
# small IR helpers


def run_passes(module: ir.Module, pipeline: str) -> None:
    passmanager.PassManager.parse(f"builtin.module({pipeline})", module.context).run(
        module.operation)


def main_func(module: ir.Module) -> ir.Operation:
    funcs = [op.operation for op in module.body.operations if op.operation.name == "func.func"]
    named = [f for f in funcs if ir.StringAttr(f.attributes["sym_name"]).value == "main"]
    if len(named) != 1 and len(funcs) != 1:
        raise ValueError("expected one func.func @main in the linalg module")
    return (named or funcs)[0]


def _block(func_op: ir.Operation) -> ir.Block:
    return func_op.regions[0].blocks[0]


def _ops(block: ir.Block) -> list[ir.Operation]:
    return [op.operation for op in block.operations]


def _const_int(v: ir.Value) -> int | None:
    owner = v.owner
    if isinstance(owner, ir.Block):
        return None
    op = owner.operation if hasattr(owner, "operation") else owner
    if op.name != "arith.constant":
        return None
    attr = op.attributes["value"]
    return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else None


def _defining_op(v: ir.Value) -> ir.Operation | None:
    owner = v.owner
    return None if isinstance(owner, ir.Block) else owner.operation


def buffer_root(v: ir.Value) -> ir.Value:
    """The allocation (func arg, memref.alloc, get_global) a memref view ultimately reads."""
    op = _defining_op(v)
    while op is not None and op.name in _VIEW_OPS:
        v = op.operands[0]
        op = _defining_op(v)
    return v


def _users(v: ir.Value) -> Iterator[ir.Operation]:
    """Ops using `v` directly or through view ops (the views themselves are not returned)."""
    for use in v.uses:
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name in _VIEW_OPS and op.operands[0] == v:
            yield from _users(op.results[0])
        else:
            yield op


def _top_level(op: ir.Operation, block: ir.Block) -> ir.Operation:
    while op.block != block:
        op = op.parent.operation
    return op


def _index(v: int | ir.Value) -> ir.Value:
    return v if isinstance(v, ir.Value) else arith.constant(ir.IndexType.get(), v)


# Extents known only at run time are index Values computed on the host (memref.dim of a buffer);
# these helpers fold when both sides are known ints, so static programs keep their constants.
def _mul(a: int | ir.Value, b: int | ir.Value) -> int | ir.Value:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if isinstance(a, int) and a == 1:
        return b
    if isinstance(b, int) and b == 1:
        return a
    return arith.muli(_index(a), _index(b))


def _prod(xs: list) -> int | ir.Value:
    out: int | ir.Value = 1
    for x in xs:
        out = _mul(out, x)
    return out


def _ceildiv(a: int | ir.Value, b: int) -> int | ir.Value:
    if isinstance(a, int):
        return -(-a // b)
    return a if b == 1 else arith.ceildivui(a, _index(b))


def _is_static(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def _set_kernel_name(launch: ir.Operation, name: str) -> None:
    launch.attributes["module"] = ir.FlatSymbolRefAttr.get(KERNEL_MODULE)
    launch.attributes["function"] = ir.FlatSymbolRefAttr.get(name)


def _new_launch(grid: int | ir.Value, block: int, name: str,
                workgroup: tuple[ir.Type, ...] = ()) -> tuple[ir.Operation, ir.Block]:
    """A 1-D gpu.launch at the current insertion point; returns it and its body block."""
    one = _index(1)
    launch = gpu.LaunchOp((_index(grid), one, one), (_index(block), one, one)).operation
    body = launch.regions[0].blocks[0]
    for t in workgroup:
        body.add_argument(t, ir.Location.unknown())
    if workgroup:
        launch.attributes["workgroup_attributions"] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(64), len(workgroup))
    _set_kernel_name(launch, name)
    return launch, body


def _delinearize(lin: ir.Value, extents: list[int | ir.Value]) -> list[ir.Value]:
    """Row-major indices of `lin` in a box of `extents` (last fastest); lin < prod(extents)."""
    out: list[ir.Value] = []
    for pos in range(len(extents) - 1, -1, -1):
        n = extents[pos]
        if isinstance(n, int) and n == 1:
            out.append(_index(0))
        elif pos == 0:
            out.append(lin)
        else:
            out.append(arith.remui(lin, _index(n)))
            lin = arith.divui(lin, _index(n))
    return out[::-1]


def _clone_into(ops: list[ir.Operation], mapping: dict[ir.Value, ir.Value]) -> None:
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


# --------------------------------------------------------------------------------------------
# tensor level


_GENERALIZE_SCRIPT = """
module attributes {transform.with_named_sequence} {
  transform.named_sequence @__transform_main(%root: !transform.any_op {transform.readonly}) {
    %ops = transform.structured.match attributes {gac.generalize} in %root
      : (!transform.any_op) -> !transform.any_op
    %g = transform.structured.generalize %ops : (!transform.any_op) -> !transform.any_op
    transform.yield
  }
}
"""


def _generalize_elementwise_named_ops(module: ir.Module, fn: ir.Operation) -> None:
    tagged = False
    for op in _ops(_block(fn)):
        name = op.name
        if (name.startswith("linalg.") and name not in ("linalg.generic", "linalg.yield")
                and not name.startswith(_KEEP_NAMED)):
            op.attributes["gac.generalize"] = ir.UnitAttr.get()
            tagged = True
    if tagged:
        script = ir.Module.parse(_GENERALIZE_SCRIPT, module.context)
        interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)


# --------------------------------------------------------------------------------------------
# bufferization


def _tensor_destinations(fn: ir.Operation) -> None:
    """Rewrite the ABI's `materialize_in_destination %r in restrict writable %out` (a memref
    destination) into the tensor form `materialize_in_destination %r in %d` with
    `%d = to_tensor %out restrict writable` at the function entry.

    Why: with a memref destination the write into `%out` is invisible to One-Shot Analysis.
    `eliminate-empty-tensors` then moves the `restrict` onto a `to_tensor %out` that replaces the
    tensor.empty at the root of the result's chain, so other values can be computed in `%out`'s
    buffer (e.g. when CSE merged the zero fills of two reductions: one reduction accumulates in
    place in output 1's buffer and is then copied to output 2 -- after output 1's own copy
    already overwrote it). With a tensor destination the write is a tensor write the analysis
    sees (the op must bufferize in place on `%d`), so such conflicts are resolved by allocating.
    """
    from mlir.dialects import bufferization

    block = _block(fn)
    ops = [op for op in _ops(block) if op.name == "bufferization.materialize_in_destination"
           and isinstance(op.operands[1].type, ir.MemRefType)]
    dests = [op.operands[1] for op in ops]
    first = _ops(block)[0]
    for op in ops:
        src, dst = op.operands[0], op.operands[1]
        if not isinstance(dst.owner, ir.Block) or dests.count(dst) != 1:
            continue  # only whole function arguments, each materialized once
        with ir.InsertionPoint(first), op.location:
            d = bufferization.ToTensorOp(src.type, dst, restrict=True, writable=True).result
        with ir.InsertionPoint(op), op.location:
            bufferization.MaterializeInDestinationOp(src.type, src, d)
        op.erase()


def _is_fill(op: ir.Operation) -> bool:
    """A linalg op (named fill or generic) that sets every element of its one init to a value
    from outside the body, reading nothing."""
    if op.name == "linalg.fill":
        return True
    if op.name != "linalg.generic" or len(op.results) != 1:
        return False
    g = op.opview
    if any(isinstance(v.type, ir.ShapedType) for v in g.inputs) or len(g.outputs) != 1:
        return False
    body = op.regions[0].blocks[0]
    ops = _ops(body)
    if len(ops) != 1 or any(list(a.uses) for a in body.arguments[len(g.inputs):]):
        return False
    m = ir.AffineMapAttr(op.attributes["indexing_maps"][len(g.inputs)]).value
    return _dims(m) == list(range(m.n_dims))


def _unshare_fills(fn: ir.Operation) -> None:
    """Give each consumer of a fill its own copy of the fill (and of its tensor.empty), right
    before it.

    CSE merges identical fills (the zero init of two reductions, two matmuls); bufferization
    must then copy the shared filled buffer for all but one consumer (a fill + copy kernel, and
    a matmul that loads its init instead of starting from zero). A private fill per consumer
    bufferizes into the consumer's own buffer and folds into its kernel."""
    for op in _ops(_block(fn)):
        if not _is_fill(op):
            continue
        uses = [(u.owner.operation if hasattr(u.owner, "operation") else u.owner, u.operand_number)
                for u in op.results[0].uses]
        if any(user.block != op.block for user, _ in uses):
            continue
        if len(uses) == 1:  # next to its consumer, where the kernel strategies fold it in
            op.move_before(uses[0][0])
            continue
        for user, idx in uses:  # each consumer gets a fill right before it
            with ir.InsertionPoint(user), user.location:
                init_def = _defining_op(op.operands[len(op.operands) - 1])
                empty = init_def.clone() if init_def is not None and init_def.name == "tensor.empty" else None
                clone = op.clone()
                if empty is not None:
                    clone.operands[len(clone.operands) - 1] = empty.results[0]
            user.operands[idx] = clone.results[0]
        op.erase()


def bufferize(module: ir.Module, fn: ir.Operation) -> None:
    """Tensors -> memrefs with results written straight into the output arguments where that is
    safe; any remaining `alloc A ... copy A -> out` with A dead afterwards is retargeted."""
    _unshare_fills(fn)
    _tensor_destinations(fn)
    run_passes(module, "eliminate-empty-tensors, one-shot-bufferize, canonicalize, cse")
    _elide_copies_into_outputs(fn)


# --------------------------------------------------------------------------------------------
# memref level clean-up


def _elide_copies_into_outputs(fn: ir.Operation) -> None:
    """`alloc A; ...writes A...; memref.copy A, D` with A dead afterwards -> write D directly.

    Bufferizing tensor.pad / concat allocates a fresh buffer even when the result only goes to
    an output; this saves the copy kernel and the intermediate.
    """
    block = _block(fn)
    for copy in [op for op in _ops(block) if op.name == "memref.copy"]:
        src, dst = copy.operands[0], copy.operands[1]
        alloc = _defining_op(src)
        if alloc is None or alloc.name != "memref.alloc" or src.type != dst.type:
            continue
        dst_def = _defining_op(dst)
        if dst_def is not None and dst_def.name != "memref.alloc":
            continue  # only whole buffers: a view's users are harder to order
        src_users = [_top_level(u, block) for u in _users(src)]
        if any(copy.is_before_in_block(u) for u in src_users if u != copy):
            continue  # A is read after the copy
        between = [u for u in (_top_level(x, block) for x in _users(dst)) if u != copy
                   and alloc.is_before_in_block(u) and u.is_before_in_block(copy)]
        if between:
            continue  # D is used while A is live: cannot share
        if dst_def is not None and alloc.is_before_in_block(dst_def):
            dst_def.move_before(alloc)
        src.replace_all_uses_with(dst)
        copy.erase()
        alloc.erase()


def _identity_layout(t: ir.Type) -> bool:
    layout = ir.MemRefType(t).layout
    if not isinstance(layout, ir.AffineMapAttr):
        return False
    m = layout.value
    return m == ir.AffineMap.get_identity(m.n_dims) and m.n_symbols == 0


def _reshapes_to_views(fn: ir.Operation) -> None:
    """`memref.reshape %src(%shape)` (tensor.reshape with several run-time sizes) -> a
    row-major `memref.reinterpret_cast` of %src with the sizes the shape buffer was filled with
    on the host; the shape buffer (alloc + constant-index stores) goes away. %src has the
    identity layout (bufferization copies otherwise), so offset 0 and row-major strides hold."""
    block = _block(fn)
    for op in _ops(block):
        if op.name != "memref.reshape":
            continue
        src, shape = op.operands[0], op.operands[1]
        alloc = _defining_op(shape)
        out_t = ir.MemRefType(op.results[0].type)
        if alloc is None or alloc.name != "memref.alloc" or not _identity_layout(src.type):
            continue
        sizes: dict[int, ir.Value] = {}
        stores, others = [], []
        for u in _users(shape):
            if u.name == "memref.store" and u.operands[1] == shape and _const_int(u.operands[2]) is not None:
                stores.append(u)
                sizes[_const_int(u.operands[2])] = u.operands[0]  # type: ignore[index]
            elif u.name != "memref.reshape":
                others.append(u)
        if others or sorted(sizes) != list(range(out_t.rank)) or any(
                u.block != block or not u.is_before_in_block(op) for u in stores):
            continue
        with ir.InsertionPoint(op), op.location:
            dyn_sizes, static_sizes = [], []
            for i, n in enumerate(out_t.shape):
                static_sizes.append(n)
                if n == _DYN:
                    dyn_sizes.append(sizes[i])
            dyn_strides, static_strides = [], []
            stride: int | ir.Value = 1
            for i in range(out_t.rank - 1, -1, -1):
                static_strides.append(stride if isinstance(stride, int) else _DYN)
                if not isinstance(stride, int):
                    dyn_strides.append(stride)
                n = out_t.shape[i]
                stride = _mul(stride, n if n != _DYN else sizes[i])
            static_strides.reverse()
            dyn_strides.reverse()
            # (the identity layout's strides are these: static where the inner sizes are)
            view = memref.reinterpret_cast(out_t, src, [], dyn_sizes, dyn_strides,
                                           [0], static_sizes, static_strides)
        op.results[0].replace_all_uses_with(view)
        op.erase()
        if not list(_users(shape)) or all(u.name == "memref.store" for u in _users(shape)):
            for u in stores:
                u.erase()
            alloc.erase()


def _copies_to_linalg(fn: ir.Operation) -> None:
    for op in _ops(_block(fn)):
        if op.name == "memref.copy":
            with ir.InsertionPoint(op), op.location:
                linalg.copy(op.operands[0], outs=[op.operands[1]])
            op.erase()


# --------------------------------------------------------------------------------------------
# generic analysis shared by the matmul and reduce strategies


@dataclass
class _Generic:
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
        return memref.dim(buf, _index(pos))


def _analyze(op: ir.Operation) -> _Generic | None:
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
                if sources[e.position] is None or (ranges[e.position] is None and size != _DYN):
                    ranges[e.position] = None if size == _DYN else size
                    sources[e.position] = (v, pos)
    if any(s is None for s in sources):
        return None
    return _Generic(op, maps, iters, ranges, sources, list(g.inputs), list(g.outputs))  # type: ignore[arg-type]


def _dims(m: ir.AffineMap) -> list[int] | None:
    """Dim positions of a projected permutation map, or None."""
    out = [e.position for e in m.results if isinstance(e, ir.AffineDimExpr)]
    return out if len(out) == len(m.results) and len(set(out)) == len(out) else None


def _fill_before(op: ir.Operation, out: ir.Value) -> tuple[ir.Operation, ir.Value] | None:
    """(fill op, scalar) if the op right before `op` sets every element of `out` to one scalar."""
    ops = _ops(op.block)
    i = ops.index(op)
    f = ops[i - 1] if i > 0 else None
    if f is None or f.name != "linalg.generic" or f.operands[len(f.operands) - 1] != out:
        return None
    body = f.regions[0].blocks[0]
    body_ops = _ops(body)
    maps = [ir.AffineMapAttr(a).value for a in f.attributes["indexing_maps"]]
    if len(body_ops) != 1 or _dims(maps[-1]) != list(range(maps[-1].n_dims)):
        return None
    value = body_ops[0].operands[0]
    if isinstance(value.owner, ir.Block) and value.owner == body:
        k = list(body.arguments).index(value)
        if k == len(body.arguments) - 1 or maps[k].results:
            return None  # yields the old output or a non-scalar input
        value = f.operands[k]
        if isinstance(value.type, ir.ShapedType):
            return None
    elif _defining_op(value).block == body:
        return None
    return f, value


# --------------------------------------------------------------------------------------------
# strategy: matmul


_CASTS = ("arith.extf", "arith.truncf", "arith.sitofp", "arith.uitofp", "arith.extsi",
          "arith.extui", "arith.trunci", "arith.fptosi", "arith.fptoui")


@dataclass
class _Contraction:
    g: _Generic
    m: int
    n: int
    k: int
    batch: list[int]
    a_casts: list[tuple[str, str]]  # (op name, result type) applied to A's element, in order
    b_casts: list[tuple[str, str]]
    is_float: bool


def _cast_chain(v: ir.Value, arg: ir.Value) -> list[tuple[str, str]] | None:
    chain: list[tuple[str, str]] = []
    while v != arg:
        op = _defining_op(v)
        if op is None or op.name not in _CASTS:
            return None
        chain.append((op.name, str(op.results[0].type)))
        v = op.operands[0]
    return chain[::-1]


def _match_contraction(g: _Generic) -> _Contraction | None:
    if len(g.inputs) != 2 or len(g.outputs) != 1:
        return None
    dims = [_dims(m) for m in g.maps]
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
    # Body: yield(add(out, mul(cast*(a), cast*(b)))) in any operand order.
    body = list(g.body.operations)
    a, b, c = g.body.arguments
    y = body[-1].operands[0]
    add = _defining_op(y)
    if add is None or add.name not in ("arith.addf", "arith.addi") or len(body) > 12:
        return None
    lhs, rhs = add.operands
    prod = rhs if lhs == c else lhs if rhs == c else None
    mul = _defining_op(prod) if prod is not None else None
    if mul is None or mul.name not in ("arith.mulf", "arith.muli"):
        return None
    x, z = mul.operands
    ca, cb = _cast_chain(x, a), _cast_chain(z, b)
    if ca is None or cb is None:
        ca, cb = _cast_chain(z, a), _cast_chain(x, b)
    if ca is None or cb is None or len(body) != len(ca) + len(cb) + 3:
        return None
    return _Contraction(g, ms[0], ns[0], red[0], batch, ca, cb, add.name == "arith.addf")


def _acc_type(elem: str, is_float: bool) -> str:
    # Accumulate low-precision floats in f32 like torch's GEMMs; ints wrap identically in any width.
    return "f32" if is_float and elem in ("f16", "bf16") else elem


def _convert(x: str, src: str, dst: str, is_float: bool, out: str) -> tuple[str, str]:
    """MLIR text converting `x` from element type `src` to `dst`: (lines, name of the result)."""
    if src == dst:
        return "", x
    if is_float:
        if {src, dst} == {"f16", "bf16"}:  # no direct cast between the two halves
            return (f"{out}_w = arith.extf {x} : {src} to f32\n"
                    f"{out} = arith.truncf {out}_w : f32 to {dst}\n", out)
        widths = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
        op = "arith.extf" if widths[dst] > widths[src] else "arith.truncf"
    else:
        op = "arith.extsi" if int(dst[1:]) > int(src[1:]) else "arith.trunci"
    return f"{out} = {op} {x} : {src} to {dst}\n", out


def _mma_operand(v: ir.Value, m: ir.AffineMap) -> cuda_mma.Operand:
    t = ir.MemRefType(v.type)
    strides, offset = t.get_strides_and_offset()
    return cuda_mma.Operand(str(t), str(t.element_type), tuple(_dims(m) or ()), tuple(t.shape),
                            tuple(strides), offset)


def _emit_mma(c: _Contraction, name: str, limits: MappingLimits) -> bool:
    """Tensor-core template (gac_torch/kernels/cuda_mma.py) when the element types allow it."""
    if not limits.mma or not c.is_float or c.g.dynamic:
        return False
    g = c.g
    ea, eb = (str(ir.MemRefType(v.type).element_type) for v in g.inputs)
    ec = str(ir.MemRefType(g.outputs[0].type).element_type)
    widen = [("arith.extf", "f32")]
    casts_ok = (c.a_casts in ([], widen) and c.b_casts in ([], widen)
                and (ec == "f32" or (not c.a_casts and not c.b_casts)))
    kind = cuda_mma.mma_kind(ea, eb, ec, casts_ok, limits.allow_tf32)
    if kind is None:
        return False
    fill = _fill_before(g.op, g.outputs[0])
    spec = cuda_mma.Spec(kind, c.m, c.n, c.k, tuple(c.batch), tuple(g.ranges),
                         _mma_operand(g.inputs[0], g.maps[0]), _mma_operand(g.inputs[1], g.maps[1]),
                         _mma_operand(g.outputs[0], g.maps[2]), fill is not None)
    plan = cuda_mma.plan(spec, limits.max_grid, limits.max_static_shared_bytes)
    if plan is None:
        return False
    _splice_template(cuda_mma.template(spec, plan), g.op, [*g.inputs, g.outputs[0]],
                     fill[1] if fill is not None else None, ec, name.rsplit("_", 1)[0] + "_mma")
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True


def _emit_matmul(c: _Contraction, name: str, limits: MappingLimits) -> bool:
    if _emit_mma(c, name, limits):
        return True
    g = c.g
    M, N, K = g.ranges[c.m], g.ranges[c.n], g.ranges[c.k]
    batch_ext = [g.ranges[d] for d in c.batch]
    # Run-time extents (None) take a 64-wide tile; the grid is computed on the host per call.
    big = not g.dynamic and (-(-M // 128) * -(-N // 128) * math.prod(batch_ext)  # type: ignore
                             >= limits.big_tile_min_blocks)
    tm = 8 if big else 4 if M is None or M >= 64 else 2 if M >= 32 else 1  # (16*tm) x (16*tn) tile
    tn = 8 if big else 4 if N is None or N >= 64 else 2 if N >= 32 else 1
    tt, bk = 16, 16  # a 16x16 thread block; K staged 16 deep through shared memory
    bm, bn = tt * tm, tt * tn
    if not g.dynamic:
        grid = (-(-N // bn), -(-M // bm), math.prod(batch_ext))  # type: ignore[operator]
        if any(x > lim for x, lim in zip(grid, limits.max_grid)) or 0 in grid or K == 0:
            return False
    ta, tb = (str(v.type) for v in g.inputs)
    tc = str(g.outputs[0].type)
    ea, eb = (str(ir.MemRefType(v.type).element_type) for v in g.inputs)
    ec = str(ir.MemRefType(g.outputs[0].type).element_type)
    acc = _acc_type(ec, c.is_float)
    acc_bytes = {"f16": 2, "bf16": 2, "f32": 4, "i32": 4, "f64": 8, "i64": 8}.get(acc, 4)
    if bk * (bm + bn) * acc_bytes > limits.max_static_shared_bytes:
        return False
    fill = _fill_before(g.op, g.outputs[0])
    zero = "0.0" if c.is_float else "0"
    mul, add = ("arith.mulf", "arith.addf") if c.is_float else ("arith.muli", "arith.addi")
    fm = " fastmath<contract>" if c.is_float else ""  # lets LLVM form FMAs
    sa = f"memref<{bk}x{bm}x{acc}, #gpu.address_space<workgroup>>"
    sb = f"memref<{bk}x{bn}x{acc}, #gpu.address_space<workgroup>>"

    def idx(m: ir.AffineMap, names: dict[int, str]) -> str:
        return ", ".join(names[d] for d in _dims(m))  # type: ignore[union-attr]

    bnames = {d: f"%bi{j}" for j, d in enumerate(c.batch)}
    a_names = {**bnames, c.m: "%am", c.k: "%ak"}
    b_names = {**bnames, c.n: "%bn", c.k: "%bk"}
    c_names = {**bnames, c.m: "%cm", c.n: "%cn"}

    def casts(x: str, chain: list[tuple[str, str]], src: str, out: str) -> tuple[str, str]:
        text, cur, ty = "", x, src
        for i, (op, rt) in enumerate(chain):
            text += f"{out}_{i} = {op} {cur} : {ty} to {rt}\n"
            cur, ty = f"{out}_{i}", rt
        more, cur = _convert(cur, ty, acc, c.is_float, f"{out}_acc")
        return text + more, cur

    lines: list[str] = []
    w = lines.append
    w(f"func.func @tmpl(%A: {ta}, %B: {tb}, %C: {tc}, %init: {ec}) {{")
    w("%one = arith.constant 1 : index")

    def extent(ssa: str, d: int) -> None:  # host side: a constant or the buffer's run-time dim
        if g.ranges[d] is not None:
            w(f"{ssa} = arith.constant {g.ranges[d]} : index")
            return
        buf, pos = g.sources[d]
        operand, ty = {g.inputs[0]: ("%A", ta), g.inputs[1]: ("%B", tb)}.get(buf, ("%C", tc))
        w(f"{ssa}_pos = arith.constant {pos} : index\n{ssa} = memref.dim {operand}, {ssa}_pos : {ty}")

    extent("%cM", c.m)
    extent("%cN", c.n)
    extent("%cK", c.k)
    for j, d in enumerate(c.batch):
        extent(f"%bext{j}", d)
    w(f"%hbm = arith.constant {bm} : index\n%hbn = arith.constant {bn} : index")
    w("%gx = arith.ceildivui %cN, %hbn : index\n%gy = arith.ceildivui %cM, %hbm : index")
    gz = "%one"
    for j in range(len(batch_ext)):
        w(f"%gzb{j} = arith.muli {gz}, %bext{j} : index")
        gz = f"%gzb{j}"
    w(f"%nt = arith.constant {tt * tt} : index")
    w(f"gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = {gz}) "
      "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
      f"workgroup(%As : {sa}, %Bs : {sb}) {{")
    w("%c0 = arith.constant 0 : index\n%c1 = arith.constant 1 : index")
    w(f"%ctt = arith.constant {tt} : index\n%cbk = arith.constant {bk} : index")
    w(f"%cbm = arith.constant {bm} : index\n%cbn = arith.constant {bn} : index")
    w(f"%zero = arith.constant {zero} : {acc}")
    w("%tr = arith.divui %tid, %ctt : index\n%tc = arith.remui %tid, %ctt : index")
    w("%m0 = arith.muli %by, %cbm : index\n%n0 = arith.muli %bx, %cbn : index")
    rest = "%bz"
    for j in range(len(batch_ext) - 1, -1, -1):  # delinearize the batch index, last fastest
        if j == 0:
            w(f"%bi0 = arith.addi {rest}, %c0 : index")
        else:
            w(f"%bi{j} = arith.remui {rest}, %bext{j} : index")
            w(f"%bq{j} = arith.divui {rest}, %bext{j} : index")
            rest = f"%bq{j}"
    # Accumulator (i, j) is output (tr + 16 i, tc + 16 j): conflict-free shared-memory reads,
    # coalesced stores.
    accs = [(i, j) for i in range(tm) for j in range(tn)]
    for i in range(tm):
        w(f"%ro{i} = arith.constant {i * tt} : index\n%rr{i} = arith.addi %tr, %ro{i} : index")
        w(f"%cm{i} = arith.addi %m0, %rr{i} : index\n%mok{i} = arith.cmpi ult, %cm{i}, %cM : index")
    for j in range(tn):
        w(f"%co{j} = arith.constant {j * tt} : index\n%cc{j} = arith.addi %tc, %co{j} : index")
        w(f"%cn{j} = arith.addi %n0, %cc{j} : index\n%nok{j} = arith.cmpi ult, %cn{j}, %cN : index")
    text, init = _convert("%init", ec, acc, c.is_float, "%init_acc")
    w(text)
    inits = []
    for i, j in accs:
        if fill is not None:  # the fill right before is folded into the accumulator's start
            inits.append(init)
            continue
        w(f"%ok{i}_{j} = arith.andi %mok{i}, %nok{j} : i1")
        w(f"%init{i}_{j} = scf.if %ok{i}_{j} -> ({acc}) {{")
        w(f"%cm = arith.addi %cm{i}, %c0 : index\n%cn = arith.addi %cn{j}, %c0 : index")
        w(f"%x = memref.load %C[{idx(g.maps[2], c_names)}] : {tc}")
        text, res = _convert("%x", ec, acc, c.is_float, "%xa")
        w(text + f"scf.yield {res} : {acc}\n}} else {{\nscf.yield %zero : {acc}\n}}")
        inits.append(f"%init{i}_{j}")
    acc_names = [f"%acc{i}_{j}" for i, j in accs]
    acc_types = ", ".join([acc] * len(accs))
    w(f"%res:{len(accs)} = scf.for %k0 = %c0 to %cK step %cbk iter_args("
      + ", ".join(f"{a} = {v}" for a, v in zip(acc_names, inits)) + f") -> ({acc_types}) {{")

    def load_tile(which: str, rows: int, tensor: str, ttype: str, elem: str,
                  names: dict[int, str], m: ir.AffineMap, chain: list[tuple[str, str]]) -> None:
        # A rows x bk tile (rows = M or N extent), stored k-major in shared memory. Consecutive
        # threads walk the operand's contiguous dim so the global loads coalesce.
        k_fast = _dims(m)[-1] == c.k  # type: ignore[index]
        r_name, k_name, lim, base, sh, st = (
            ("%am", "%ak", "%cM", "%m0", "%As", sa) if which == "A"
            else ("%bn", "%bk", "%cN", "%n0", "%Bs", sb))
        for l in range(rows * bk // (tt * tt)):
            p = f"%{which}{l}"
            w(f"{p}off = arith.constant {l * tt * tt} : index\n{p}e = arith.addi %tid, {p}off : index")
            if k_fast:
                w(f"{p}r = arith.divui {p}e, %cbk : index\n{p}k = arith.remui {p}e, %cbk : index")
            else:
                w(f"{p}rows = arith.constant {rows} : index")
                w(f"{p}k = arith.divui {p}e, {p}rows : index\n{p}r = arith.remui {p}e, {p}rows : index")
            w(f"{p}gr = arith.addi {base}, {p}r : index\n{p}gk = arith.addi %k0, {p}k : index")
            w(f"{p}okr = arith.cmpi ult, {p}gr, {lim} : index")
            w(f"{p}okk = arith.cmpi ult, {p}gk, %cK : index\n{p}ok = arith.andi {p}okr, {p}okk : i1")
            w(f"{p}v = scf.if {p}ok -> ({acc}) {{")
            w(f"{r_name} = arith.addi {p}gr, %c0 : index\n{k_name} = arith.addi {p}gk, %c0 : index")
            w(f"%x = memref.load {tensor}[{idx(m, names)}] : {ttype}")
            text, res = casts("%x", chain, elem, "%xc")
            w(text + f"scf.yield {res} : {acc}\n}} else {{\nscf.yield %zero : {acc}\n}}")
            w(f"memref.store {p}v, {sh}[{p}k, {p}r] : {st}")

    load_tile("A", bm, "%A", ta, ea, a_names, g.maps[0], c.a_casts)
    load_tile("B", bn, "%B", tb, eb, b_names, g.maps[1], c.b_casts)
    w("gpu.barrier")
    inner = [f"%i{i}_{j}" for i, j in accs]
    w(f"%part:{len(accs)} = scf.for %kk = %c0 to %cbk step %c1 iter_args("
      + ", ".join(f"{x} = {a}" for x, a in zip(inner, acc_names)) + f") -> ({acc_types}) {{")
    for i in range(tm):
        w(f"%a{i} = memref.load %As[%kk, %rr{i}] : {sa}")
    for j in range(tn):
        w(f"%b{j} = memref.load %Bs[%kk, %cc{j}] : {sb}")
    for i, j in accs:
        w(f"%p{i}_{j} = {mul} %a{i}, %b{j}{fm} : {acc}")
        w(f"%s{i}_{j} = {add} %i{i}_{j}, %p{i}_{j}{fm} : {acc}")
    w("scf.yield " + ", ".join(f"%s{i}_{j}" for i, j in accs) + f" : {acc_types}\n}}")
    w("gpu.barrier")  # the next stage overwrites the tiles
    w("scf.yield " + ", ".join(f"%part#{n}" for n in range(len(accs))) + f" : {acc_types}\n}}")
    for n, (i, j) in enumerate(accs):
        w(f"%oks{i}_{j} = arith.andi %mok{i}, %nok{j} : i1\nscf.if %oks{i}_{j} {{")
        w(f"%cm = arith.addi %cm{i}, %c0 : index\n%cn = arith.addi %cn{j}, %c0 : index")
        text, res = _convert(f"%res#{n}", acc, ec, c.is_float, "%out")
        w(text + f"memref.store {res}, %C[{idx(g.maps[2], c_names)}] : {tc}\n}}")
    w("gpu.terminator\n}\nreturn\n}")
    init_value = fill[1] if fill is not None else None
    _splice_template("\n".join(lines), g.op, [*g.inputs, g.outputs[0]], init_value, ec, name)
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True


def _splice_template(text: str, before: ir.Operation, args: list[ir.Value],
                     init: ir.Value | None, acc: str, name: str) -> None:
    """Parse a `func.func @tmpl(args..., %init)` holding one gpu.launch and move the launch
    before `before`, wiring the template's arguments to `args` (and `init`)."""
    tmpl = ir.Module.parse(text, before.context)
    tfn = tmpl.body.operations[0].operation
    tblock = _block(tfn)
    if init is None:  # unused by the kernel; any value of the type will do
        t = ir.Type.parse(acc, before.context)
        with ir.InsertionPoint(before), before.location:
            init = arith.constant(t, 0.0 if isinstance(t, ir.FloatType) else 0)
    for targ, actual in zip(tblock.arguments, [*args, init]):
        targ.replace_all_uses_with(actual)
    for op in _ops(tblock)[:-1]:  # constants and the launch; not the return
        op.move_before(before)
        if op.name == "gpu.launch":
            _set_kernel_name(op, name)


# --------------------------------------------------------------------------------------------
# strategy: reduce (one block per output element)


_COMBINERS = {
    "arith.addf": "add", "arith.addi": "add", "arith.mulf": "mul", "arith.muli": "mul",
    "arith.maxnumf": "maxnumf", "arith.minnumf": "minnumf", "arith.maximumf": "maximumf",
    "arith.minimumf": "minimumf", "arith.maxsi": "maxsi", "arith.minsi": "minsi",
    "arith.maxui": "maxui", "arith.minui": "minui", "arith.andi": "and", "arith.ori": "or",
    "arith.xori": "xor",
}


def _identity(kind: str, t: ir.Type) -> ir.Attribute:
    if isinstance(t, ir.FloatType):
        v = {"add": 0.0, "mul": 1.0, "maxnumf": -math.inf, "maximumf": -math.inf,
             "minnumf": math.inf, "minimumf": math.inf}[kind]
        return ir.FloatAttr.get(t, v)
    w = ir.IntegerType(t).width
    v = {"add": 0, "mul": 1, "maxsi": -(1 << (w - 1)), "minsi": (1 << (w - 1)) - 1, "maxui": 0,
         "minui": -1, "and": -1, "or": 0, "xor": 0}[kind]
    return ir.IntegerAttr.get(t, v)


def _widen(v: ir.Value, t: ir.Type, signed: bool) -> ir.Value:
    if v.type == t:
        return v
    if isinstance(t, ir.FloatType):
        return arith.extf(t, v)
    return arith.extsi(t, v) if signed else arith.extui(t, v)


def _narrow(v: ir.Value, t: ir.Type) -> ir.Value:
    if v.type == t:
        return v
    return arith.truncf(t, v) if isinstance(t, ir.FloatType) else arith.trunci(t, v)


def _emit_reduce(g: _Generic, name: str, limits: MappingLimits) -> bool:
    if len(g.outputs) != 1:
        return False
    out_dims = _dims(g.maps[-1])
    par = [i for i, t in enumerate(g.iters) if t == "parallel"]
    red = [i for i, t in enumerate(g.iters) if t == "reduction"]
    if out_dims is None or sorted(out_dims) != par:
        return False  # each output element must be owned by exactly one parallel point
    body_ops = [op.operation for op in g.body.operations]
    out_arg = g.body.arguments[len(g.inputs)]
    comb = _defining_op(body_ops[-1].operands[0])
    if comb is None or comb.name not in _COMBINERS or comb.block != g.body:
        return False
    uses = list(out_arg.uses)
    if len(uses) != 1 or out_arg not in list(comb.operands):
        return False
    if any(op.regions and len(op.regions) for op in body_ops[:-2]):
        return False
    kind = _COMBINERS[comb.name]
    value = comb.operands[1] if comb.operands[0] == out_arg else comb.operands[0]
    with ir.InsertionPoint(g.op), g.op.location:  # run-time extents: memref.dim on the host
        p_ext = [g.extent(d) for d in par]
        r_ext = [g.extent(d) for d in red]
        n_out, n_red = _prod(p_ext), _prod(r_ext)
    if _is_static(n_out) and (n_out == 0 or n_out > limits.max_grid[0]):
        return False
    # Short rows: one warp per output, 8 outputs per block, combined with shuffles. Long rows:
    # one block per output, combined with gpu.all_reduce (shuffles + shared memory). Rows of
    # run-time length take a warp each.
    warp = limits.warp_size
    per_warp = not _is_static(n_red) or n_red <= limits.warp_reduce_max
    threads = (limits.reduce_threads if per_warp else
               min(limits.reduce_threads, max(warp, 1 << (max(n_red, 1) - 1).bit_length())))
    group = warp if per_warp else threads  # threads cooperating on one output
    outs_per_block = threads // group
    elem = ir.MemRefType(g.outputs[0].type).element_type
    if isinstance(elem, ir.FloatType):
        acc_t = ir.F32Type.get() if ir.FloatType(elem).width < 32 else elem
    else:
        acc_t = ir.IntegerType.get_signless(32) if ir.IntegerType(elem).width < 32 else elem
    signed = kind not in ("maxui", "minui")
    fill = _fill_before(g.op, g.outputs[0])

    def combine(x: ir.Value, y: ir.Value) -> ir.Value:
        new = comb.clone()
        new.operands[0], new.operands[1] = x, y
        new.results[0].set_type(acc_t)
        return new.results[0]

    with ir.InsertionPoint(g.op), g.op.location:
        grid = _ceildiv(n_out, outs_per_block)
        trips = _ceildiv(n_red, group)
        launch, body = _new_launch(grid, threads, name)
        with ir.InsertionPoint(body):
            bid, tid = body.arguments[0], body.arguments[3]
            if per_warp:
                lane = arith.remui(tid, _index(group))
                out_lin = arith.addi(arith.muli(bid, _index(outs_per_block)), arith.divui(tid, _index(group)))
            else:
                lane, out_lin = tid, bid
            active = None
            if not _is_static(grid, n_out) or grid * outs_per_block != n_out:  # idle groups
                active = arith.cmpi(arith.CmpIPredicate.ult, out_lin, _index(n_out))
            p_ivs = _delinearize(out_lin, p_ext)
            ident = arith.constant(acc_t, _identity(kind, acc_t))
            # Constant trip count (lane + it * group): LLVM unrolls it and keeps loads in flight.
            loop = scf.ForOp(_index(0), _index(trips), _index(1), [ident])
            with ir.InsertionPoint(loop.body):
                acc = loop.inner_iter_args[0]
                j = arith.addi(arith.muli(loop.induction_variable, _index(group)), lane)
                cond = active
                if not _is_static(n_red) or n_red % group:
                    in_row = arith.cmpi(arith.CmpIPredicate.ult, j, _index(n_red))
                    cond = in_row if cond is None else arith.andi(cond, in_row)
                guard = scf.IfOp(cond, [acc_t], has_else=True) if cond is not None else None
                with ir.InsertionPoint(guard.then_block) if guard else ir.InsertionPoint(loop.body):
                    r_ivs = _delinearize(j, r_ext)
                    ivs = _merge(par, p_ivs, len(g.iters))
                    for d, v in zip(red, r_ivs):
                        ivs[d] = v
                    mapping: dict[ir.Value, ir.Value] = {}
                    for arg, buf, m in zip(g.body.arguments, g.inputs, g.maps):
                        mapping[arg] = _load(buf, m, ivs)
                    _clone_body(body_ops[:-1], comb, mapping, ivs)
                    new = combine(acc, _widen(mapping.get(value, value), acc_t, signed))
                    if guard:
                        scf.YieldOp([new])
                if guard:
                    with ir.InsertionPoint(guard.else_block):
                        scf.YieldOp([acc])
                    new = guard.results[0]
                scf.YieldOp([new])
            total = loop.results[0]
            if per_warp:  # butterfly: every lane ends with the warp's total
                i32 = ir.IntegerType.get_signless(32)
                mode = ir.Attribute.parse("#gpu<shuffle_mode xor>")
                for off in (16, 8, 4, 2, 1):
                    other = gpu.ShuffleOp(total, arith.constant(i32, off), arith.constant(i32, warp),
                                          mode).results[0]
                    total = combine(total, other)
            else:
                op_attr = ir.Attribute.parse(f"#gpu<all_reduce_op {kind}>")
                total = gpu.AllReduceOp(total, op=op_attr, uniform=True).result
            leader = arith.cmpi(arith.CmpIPredicate.eq, lane, _index(0))
            if active is not None:
                leader = arith.andi(leader, active)
            if_op = scf.IfOp(leader)
            with ir.InsertionPoint(if_op.then_block):
                out_idx = _map_indices(g.maps[-1], _merge(par, p_ivs, len(g.iters)))
                init = fill[1] if fill is not None else memref.load(g.outputs[0], out_idx)
                final = combine(_widen(init, acc_t, signed), total)
                memref.store(_narrow(final, elem), g.outputs[0], out_idx)
                scf.YieldOp([])
            gpu.TerminatorOp()
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True


def _merge(dims: list[int], vals: list[ir.Value], n: int) -> list[ir.Value]:
    out: list[ir.Value] = [None] * n  # type: ignore[list-item]
    for d, v in zip(dims, vals):
        out[d] = v
    return out


def _map_indices(m: ir.AffineMap, ivs: list[ir.Value]) -> list[ir.Value]:
    from mlir.dialects import affine

    out = []
    for e in m.results:
        if isinstance(e, ir.AffineDimExpr):
            out.append(ivs[e.position])
        else:
            single = ir.AffineMap.get(m.n_dims, m.n_symbols, [e])
            out.append(affine.apply(single, ivs))
    return out


def _load(buf: ir.Value, m: ir.AffineMap, ivs: list[ir.Value]) -> ir.Value:
    if not isinstance(buf.type, ir.MemRefType):
        return buf  # scalar operand
    return memref.load(buf, _map_indices(m, ivs))


def _clone_body(ops: list[ir.Operation], skip: ir.Operation, mapping: dict[ir.Value, ir.Value],
                ivs: list[ir.Value]) -> None:
    for op in ops:
        if op == skip:
            continue
        if op.name == "linalg.index":
            mapping[op.results[0]] = ivs[ir.IntegerAttr(op.attributes["dim"]).value]
            continue
        _clone_into([op], mapping)


# --------------------------------------------------------------------------------------------
# strategy: loops (fallback for every op) and serial


def _parallel_bounds(p: ir.Operation) -> list[tuple]:
    """(lower, upper, step) per dim: ints where constant, else the host index Values."""
    po = p.opview
    out = []
    for lb, ub, st in zip(po.lowerBound, po.upperBound, po.step):
        out.append(tuple(v if c is None else c for v, c in ((x, _const_int(x)) for x in (lb, ub, st))))
    return out


def _fill_loop(p: ir.Operation) -> tuple[ir.Value, ir.Value, list[ir.Value]] | None:
    """(value, buffer, indices) if scf.parallel `p` only stores one outside value per point."""
    body = p.regions[0].blocks[0]
    ops = _ops(body)
    if len(ops) != 2 or ops[0].name != "memref.store":
        return None
    value, buf, idx = ops[0].operands[0], ops[0].operands[1], list(ops[0].operands)[2:]
    ivs = list(body.arguments)
    if [v for v in idx if v in ivs] != ivs or any(v not in ivs and _const_int(v) is None for v in idx):
        return None  # each iv once, in order; the rest constant (unit dims)
    if (isinstance(value.owner, ir.Block) and value.owner == body) or (
            _defining_op(value) is not None and _defining_op(value).block == body):
        return None
    return value, buf, idx


def _absorb_fill(fill_loop: ir.Operation, p: ir.Operation) -> bool:
    """Fold `fill_loop` into the start of the next loop `p` when each thread of `p` touches the
    filled buffer only at its own point's element (so that element is filled first)."""
    info = _fill_loop(fill_loop)
    if info is None or _parallel_bounds(fill_loop) != _parallel_bounds(p):
        return False
    value, buf, fill_idx = info
    body = p.regions[0].blocks[0]
    to_p = dict(zip(fill_loop.regions[0].blocks[0].arguments, body.arguments))
    idx = [to_p.get(v, v) for v in fill_idx]
    root = buffer_root(buf)
    ok = True

    def check(o: ir.Operation) -> ir.WalkResult:
        nonlocal ok
        for v in o.operands:
            if isinstance(v.type, ir.MemRefType) and buffer_root(v) == root:
                if v != buf or o.name not in ("memref.load", "memref.store"):
                    ok = False
                    continue
                at = list(o.operands)[1:] if o.name == "memref.load" else list(o.operands)[2:]
                same = len(at) == len(idx) and all(
                    x == y or (_const_int(x) is not None and _const_int(x) == _const_int(y))
                    for x, y in zip(at, idx))
                ok = ok and same
        return ir.WalkResult.ADVANCE

    p.walk(check, ir.WalkOrder.PRE_ORDER)
    if not ok:
        return False
    with ir.InsertionPoint.at_block_begin(body), fill_loop.location:
        memref.store(value, buf, idx)
    fill_loop.erase()
    return True


def _linearize(p: ir.Operation, name: str, limits: MappingLimits) -> None:
    """scf.parallel -> 1-D gpu.launch, one thread per iteration point (last dim fastest).

    Large loop-free (elementwise) spaces give each thread `coarsen` points a grid-stride apart:
    independent loads in flight per thread, which a one-point thread lacks to fill HBM."""
    bounds = _parallel_bounds(p)
    if any(not _is_static(lb, st) for lb, _, st in bounds):
        raise NotImplementedError("scf.parallel with a run-time lower bound or step")
    with ir.InsertionPoint(p), p.location:  # run-time extents: (ub - lb) / step on the host
        extents = [max(0, -(-(ub - lb) // st)) if _is_static(ub) else
                   _ceildiv(ub if lb == 0 else arith.subi(ub, _index(lb)), st) for lb, ub, st in bounds]
        total = _prod(extents)
    if total == 0:
        p.erase()
        return
    has_loops = False

    def find_loops(o: ir.Operation) -> ir.WalkResult:
        nonlocal has_loops
        has_loops = has_loops or o.name in ("scf.for", "scf.while", "scf.parallel") and o != p
        return ir.WalkResult.ADVANCE

    p.walk(find_loops, ir.WalkOrder.PRE_ORDER)
    if _is_static(total):
        coarsen = limits.coarsen if total >= limits.coarsen_min_points and not has_loops else 1
        threads = min(limits.threads_per_block, -(-total // limits.warp_size) * limits.warp_size)
        if -(-total // (threads * coarsen)) > limits.max_grid[0]:
            raise NotImplementedError(f"{total} iterations exceed a 1-D grid")
    else:  # (a grid larger than the device allows is refused when the sizes are bound)
        coarsen, threads = 1, limits.threads_per_block
    with ir.InsertionPoint(p), p.location:
        grid = _ceildiv(total, threads * coarsen)
        launch, kbody = _new_launch(grid, threads, name)
        with ir.InsertionPoint(kbody):
            bid, tid = kbody.arguments[0], kbody.arguments[3]
            lin = arith.addi(arith.muli(bid, _index(threads)), tid)
            if coarsen > 1:
                step = scf.ForOp(_index(0), _index(coarsen), _index(1))
                with ir.InsertionPoint(step.body):
                    lin = arith.addi(lin, arith.muli(step.induction_variable, _index(grid * threads)))  # type: ignore[operator]
                    inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lin, _index(total)))
                    scf.YieldOp([])
            else:
                inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lin, _index(total)))
            with ir.InsertionPoint(inside.then_block):
                idx = _delinearize(lin, extents)
                ivs = []
                for (lb, _, st), i in zip(bounds, idx):
                    v = i if st == 1 else arith.muli(i, _index(st))
                    ivs.append(v if lb == 0 else arith.addi(v, _index(lb)))
                term = scf.YieldOp([])
            gpu.TerminatorOp()
    pbody = p.regions[0].blocks[0]
    for op in _ops(pbody)[:-1]:  # all but scf.reduce
        op.move_before(term.operation)
    for old, new in zip(pbody.arguments, ivs):
        old.replace_all_uses_with(new)
    p.erase()


# Host ops without side effects: moved above pending serial code rather than cutting it in two
# (a cut leaves the serial ops' scalars, e.g. an index read from a tensor, used across kernels).
_HOISTABLE = ("ub.poison", "memref.alloc", "memref.get_global", *_VIEW_OPS)


def _uses_any(op: ir.Operation, ops: list[ir.Operation]) -> bool:
    """Does op read a result of one of ops?"""
    defined = {r for o in ops for r in o.results}
    return any(v in defined for v in op.operands)


def _wrap_serial(ops: list[ir.Operation], name: str) -> None:
    """Run host-level scalar code (e.g. a rank-0 op's loads/stores) in a one-thread kernel."""
    with ir.InsertionPoint(ops[0]), ops[0].location:
        launch, body = _new_launch(1, 1, name)
        with ir.InsertionPoint(body):
            term = gpu.TerminatorOp()
    for op in ops:
        op.move_before(term.operation)
    for op in ops:
        for r in op.results:
            for use in r.uses:
                if _top_level(use.owner.operation, launch.block) != launch:
                    raise NotImplementedError(f"host value from {op.name} used outside its kernel")


def _sink_globals(fn: ir.Operation) -> None:
    """Clone memref.get_global (and views of it) into the kernels using them, so the global's
    constant data is emitted into the PTX by outlining instead of being a host buffer."""
    block = _block(fn)
    for op in _ops(block):
        if op.name != "memref.get_global":
            continue
        for user in list(_users(op.results[0])):
            launch = _top_level(user, block)
            if launch.name != "gpu.launch":
                continue
            kbody = launch.regions[0].blocks[0]
            mapping: dict[ir.Value, ir.Value] = {}
            with ir.InsertionPoint.at_block_begin(kbody):
                _clone_chain(user, op, mapping)
    for op in reversed(_ops(block)):
        if (op.name == "memref.get_global" or op.name in _VIEW_OPS) and all(
                not list(r.uses) for r in op.results):
            op.erase()


def _clone_chain(user: ir.Operation, glob: ir.Operation, mapping: dict[ir.Value, ir.Value]) -> None:
    for i, v in enumerate(user.operands):
        if not isinstance(v.type, ir.MemRefType) or buffer_root(v) != glob.results[0]:
            continue
        chain = []
        d = _defining_op(v)
        while d is not None:
            chain.append(d)
            if d == glob:
                break
            d = _defining_op(d.operands[0])
        for c in reversed(chain):
            if c.results[0] not in mapping:
                _clone_into([c], mapping)
        user.operands[i] = mapping[v]


_DYN_STRIDE = ir.ShapedType.get_dynamic_stride_or_offset()


def static_memref(t: ir.Type) -> bool:
    """Shape, strides and offset all known at compile time."""
    mt = ir.MemRefType(t)
    strides, offset = mt.get_strides_and_offset()
    return _DYN not in mt.shape and _DYN_STRIDE not in (*strides, offset)


def _dynamic_memrefs_as_metadata(fn: ir.Operation) -> None:
    """Kernels take buffers as bare pointers, their layout compiled in. A buffer whose sizes,
    strides or offset are known only at run time enters a kernel as its base pointer (a 0-d
    memref, from memref.extract_strided_metadata on the host) plus index scalars, and the
    kernel rebuilds the view with memref.reinterpret_cast."""
    block = _block(fn)
    for launch in [op for op in _ops(block) if op.name == "gpu.launch"]:
        captured: list[ir.Value] = []

        def visit(o: ir.Operation) -> ir.WalkResult:
            for v in o.operands:
                if (isinstance(v.type, ir.MemRefType) and not static_memref(v.type) and v not in captured
                        and (v.owner == block if isinstance(v.owner, ir.Block)
                             else _top_level(v.owner.operation, block) != launch)):
                    captured.append(v)
            return ir.WalkResult.ADVANCE

        for o in _ops(launch.regions[0].blocks[0]):
            o.walk(visit, ir.WalkOrder.PRE_ORDER)
        for v in captured:
            t = ir.MemRefType(v.type)
            strides, offset = t.get_strides_and_offset()
            with ir.InsertionPoint(launch), launch.location:
                md = memref.ExtractStridedMetadataOp(v).results
            sizes_v, strides_v = list(md)[2:2 + t.rank], list(md)[2 + t.rank:]
            with ir.InsertionPoint.at_block_begin(launch.regions[0].blocks[0]), launch.location:
                view = memref.reinterpret_cast(
                    t, md[0], [md[1]] if offset == _DYN_STRIDE else [],
                    [x for x, n in zip(sizes_v, t.shape) if n == _DYN],
                    [x for x, n in zip(strides_v, strides) if n == _DYN_STRIDE],
                    [offset], list(t.shape), list(strides))
            for use in list(v.uses):
                owner = use.owner.operation if hasattr(use.owner, "operation") else use.owner
                if owner != view.owner and _top_level(owner, block) == launch:
                    owner.operands[use.operand_number] = view


def _parallel_dims_first(op: ir.Operation) -> None:
    """Interchange a generic's loops so parallel dims precede reduction dims (stable order):
    convert-linalg-to-parallel-loops then yields one scf.parallel holding the reduction loops,
    instead of parallel loops nested inside sequential ones."""
    iters = list(op.attributes["iterator_types"])
    red = ["reduction" in str(a) for a in iters]
    perm = [d for d in range(len(iters)) if not red[d]] + [d for d in range(len(iters)) if red[d]]
    if perm == list(range(len(iters))):
        return
    inv = {old: new for new, old in enumerate(perm)}
    n = len(perm)
    q = ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(inv[i]) for i in range(n)])
    maps = []
    for a in op.attributes["indexing_maps"]:
        m = ir.AffineMapAttr(a).value
        maps.append(ir.AffineMapAttr.get(ir.AffineMap.get(n, m.n_symbols, [e.compose(q) for e in m.results])))
    op.attributes["indexing_maps"] = ir.ArrayAttr.get(maps)
    op.attributes["iterator_types"] = ir.ArrayAttr.get([iters[d] for d in perm])

    def renumber(o: ir.Operation) -> ir.WalkResult:
        if o.name == "linalg.index":
            d = ir.IntegerAttr(o.attributes["dim"]).value
            o.attributes["dim"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), inv[d])
        return ir.WalkResult.ADVANCE

    for body_op in _ops(op.regions[0].blocks[0]):
        body_op.walk(renumber, ir.WalkOrder.PRE_ORDER)


def _strategy(g: _Generic | None, limits: MappingLimits) -> str:
    if g is None:
        return "loops"
    if _match_contraction(g) is not None:
        return "matmul"
    red = [g.ranges[i] for i, t in enumerate(g.iters) if t == "reduction"]
    par = [g.ranges[i] for i, t in enumerate(g.iters) if t == "parallel"]
    inner_is_reduction = bool(g.iters) and g.iters[-1] == "reduction"
    if red and None in red + par:  # run-time extents: rows of the innermost dim(s) only
        short = None not in red and math.prod(red) < limits.reduce_min_extent  # type: ignore[arg-type]
        return "reduce" if inner_is_reduction and not short else "loops"
    if red and math.prod(red) >= limits.reduce_min_extent:  # type: ignore[arg-type]
        if inner_is_reduction or math.prod(par) < 8192:  # type: ignore[arg-type]
            return "reduce"
    return "loops"


# A target's hook for one linalg.generic: emit it as a template kernel named name(kind) and
# return True, or return False to leave it to the `loops` strategy.
MapOp = Callable[[ir.Operation, Callable[[str], str]], bool]


def cuda_templates(limits: MappingLimits) -> MapOp:
    """CUDA's choice: tensor-core / tiled matmuls and block reductions where they apply."""
    def map_op(op: ir.Operation, name: Callable[[str], str]) -> bool:
        g = _analyze(op)
        # --- implicit-GEMM contractions over dim sets: convs, multi-dim GEMMs (helper kern) ---
        from gac_torch.backends.cuda import contraction
        if contraction.FUSED in op.attributes:  # runs in its producer's epilogue
            contraction.erase_fused(op)
            return True
        if g is not None and _match_contraction(g) is None and contraction.emit(g, name, limits):
            return True
        # --- end implicit-GEMM ---
        kind = _strategy(g, limits)
        if kind == "matmul":
            return _emit_matmul(_match_contraction(g), name(kind), limits)  # type: ignore[arg-type]
        if kind == "reduce":
            return _emit_reduce(g, name(kind), limits)  # type: ignore[arg-type]
        return False
    return map_op


def map_to_gpu(module: ir.Module, limits: MappingLimits, map_op: MapOp | None = None) -> None:
    """Rewrite the linalg-on-tensors `@main` into host code launching outlined kernels.
    `map_op` picks template kernels per op (default: cuda_templates); everything else becomes
    `loops` kernels (scf.parallel linearized onto a 1-D grid) or `serial` ones."""
    map_op = map_op or cuda_templates(limits)
    fn = main_func(module)
    _generalize_elementwise_named_ops(module, fn)
    run_passes(module, "func.func(linalg-fuse-elementwise-ops), canonicalize, cse")
    bufferize(module, fn)
    _reshapes_to_views(fn)
    _copies_to_linalg(fn)
    run_passes(module, "func.func(linalg-generalize-named-ops), canonicalize, cse")

    counter = iter(range(1 << 30))
    block = _block(fn)
    for op in _ops(block):
        if op.name != "linalg.generic":
            continue
        if map_op(op, lambda kind: f"gac_k{next(counter)}_{kind}"):
            continue
        _parallel_dims_first(op)

    run_passes(module, "func.func(convert-linalg-to-parallel-loops), canonicalize, cse")
    ops = _ops(block)
    serial: list[ir.Operation] = []
    for i, op in enumerate(ops):
        if op.name == "scf.parallel":
            if serial:
                _wrap_serial(serial, f"gac_k{next(counter)}_serial")
                serial = []
            if i + 1 < len(ops) and ops[i + 1].name == "scf.parallel" and _absorb_fill(op, ops[i + 1]):
                continue
            _linearize(op, f"gac_k{next(counter)}_loops", limits)
            continue
        size_math = is_size_math(op)
        if op.name not in _HOST_OPS and not size_math:
            serial.append(op)
        elif not serial or op.name == "arith.constant":
            pass
        elif (op.name in _HOISTABLE or size_math) and not _uses_any(op, serial):
            op.move_before(serial[0])  # a buffer, view or size the serial code does not define
        else:
            _wrap_serial(serial, f"gac_k{next(counter)}_serial")
            serial = []
    if serial:
        _wrap_serial(serial, f"gac_k{next(counter)}_serial")
    _sink_globals(fn)
    run_passes(module, "gpu-launch-sink-index-computations")
    _dynamic_memrefs_as_metadata(fn)
    run_passes(module, "gpu-kernel-outlining, canonicalize, cse")
    _number_kernels(module, fn)


def _number_kernels(module: ir.Module, fn: ir.Operation) -> None:
    """Rename kernels gac_k<launch order>_<strategy> (they were named in creation order)."""
    funcs = {}
    for op in module.body.operations:
        if op.operation.name == "gpu.module":
            for f in op.regions[0].blocks[0].operations:
                funcs[ir.StringAttr(f.attributes["sym_name"]).value] = f.operation
    launches = [op for op in _ops(_block(fn)) if op.name == "gpu.launch_func"]
    for i, op in enumerate(launches):
        old = str(op.attributes["kernel"]).rsplit("::@", 1)[-1].strip('"')
        new = f"gac_k{i}_{old.rsplit('_', 1)[-1]}"
        funcs[old].attributes["sym_name"] = ir.StringAttr.get(new)
        op.attributes["kernel"] = ir.SymbolRefAttr.get([KERNEL_MODULE, new])

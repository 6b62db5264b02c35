"""Tensors -> memrefs for the GPU targets, and the memref-level clean-ups that leave exactly one
`linalg.generic` per kernel.

1. Elementwise named ops (add, exp, transpose, broadcast, ...) are generalized so that
   `linalg-fuse-elementwise-ops` fuses them into their consumers; matmul/conv/pooling stay named
   so no producer is fused (and recomputed) into them.
2. Fills are un-shared (CSE merges the zero inits of several reductions/matmuls; each consumer
   gets its own fill right before it). The ABI's `materialize_in_destination ... restrict
   writable %out` (a memref destination, a write One-Shot Analysis cannot see) is rewritten to
   the tensor form on `to_tensor %out restrict writable`, so `eliminate-empty-tensors` +
   one-shot-bufferize write results straight into the output buffers only where that is safe;
   intermediates become `memref.alloc`. Copies into an output from a buffer that dies right
   after are elided (the producer writes the output directly).
3. `memref.reshape` with a host-filled shape becomes a view; remaining copies become
   `linalg.copy` (then every named op is generalized by the scheduler).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import linalg, memref
from mlir.dialects.transform import interpreter

from gac_torch.backends.gpu.analysis import map_dims
from gac_torch.backends.gpu.irutil import (
    DYN, block_ops, const_int, defining_op, func_block, identity_layout, run_passes, size_mul,
    top_level, users,
)
from gac_torch.lowering.fusion import NAMED_CONTRACTIONS

# Named ops kept named through elementwise fusion: fusing a producer into them would recompute
# it once per use (N times for a matmul operand); they also get dedicated strategies.
_KEEP_NAMED = (*NAMED_CONTRACTIONS, "linalg.conv_", "linalg.depthwise_conv", "linalg.pooling_")


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


def generalize_elementwise_named_ops(module: ir.Module, fn: ir.Operation) -> None:
    tagged = False
    for op in block_ops(func_block(fn)):
        name = op.name
        if (name.startswith("linalg.") and name not in ("linalg.generic", "linalg.yield")
                and not name.startswith(_KEEP_NAMED)):
            op.attributes["gac.generalize"] = ir.UnitAttr.get()
            tagged = True
    if tagged:
        script = ir.Module.parse(_GENERALIZE_SCRIPT, module.context)
        interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)


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

    block = func_block(fn)
    ops = [op for op in block_ops(block) if op.name == "bufferization.materialize_in_destination"
           and isinstance(op.operands[1].type, ir.MemRefType)]
    dests = [op.operands[1] for op in ops]
    first = block_ops(block)[0]
    for op in ops:
        src, dst = op.operands[0], op.operands[1]
        if not isinstance(dst.owner, ir.Block) or dests.count(dst) != 1:
            continue  # only whole function arguments, each materialized once
        with ir.InsertionPoint(first), op.location:
            d = bufferization.ToTensorOp(src.type, dst, restrict=True, writable=True).result
        with ir.InsertionPoint(op), op.location:
            bufferization.MaterializeInDestinationOp(src.type, src, d)
        op.erase()


def is_fill(op: ir.Operation) -> bool:
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
    ops = block_ops(body)
    if len(ops) != 1 or any(list(a.uses) for a in body.arguments[len(g.inputs):]):
        return False
    m = ir.AffineMapAttr(op.attributes["indexing_maps"][len(g.inputs)]).value
    return map_dims(m) == list(range(m.n_dims))


def _unshare_fills(fn: ir.Operation) -> None:
    """Give each consumer of a fill its own copy of the fill (and of its tensor.empty), right
    before it.

    CSE merges identical fills (the zero init of two reductions, two matmuls); bufferization
    must then copy the shared filled buffer for all but one consumer (a fill + copy kernel, and
    a matmul that loads its init instead of starting from zero). A private fill per consumer
    bufferizes into the consumer's own buffer and folds into its kernel."""
    for op in block_ops(func_block(fn)):
        if not is_fill(op):
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
                init_def = defining_op(op.operands[len(op.operands) - 1])
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
    outputs = [op.operands[1] for op in block_ops(func_block(fn))  # the ABI's output arguments
               if op.name == "bufferization.materialize_in_destination" and isinstance(op.operands[1].owner, ir.Block)]
    _tensor_destinations(fn)
    run_passes(module, "eliminate-empty-tensors, one-shot-bufferize, canonicalize, cse")
    _drop_copies_of_unwritten_outputs(fn, outputs)
    _elide_copies_into_outputs(fn)


def _drop_copies_of_unwritten_outputs(fn: ir.Operation, outputs: list[ir.Value]) -> None:
    """`memref.copy %out, A` before anything touches %out copies undefined bytes (outputs come
    uninitialized): drop it. One-Shot Bufferize emits one when eliminate-empty-tensors made
    `to_tensor %out` the init of a result it then bufferizes out of place (a concat that is an
    output and also feeds a slice that is another output: H200 fuzz seed 120, which the
    dataflow check refused as 'reads arg1 before any write')."""
    block = func_block(fn)
    for copy in [op for op in block_ops(block) if op.name == "memref.copy"]:
        src = copy.operands[0]
        if not any(src == o for o in outputs):
            continue
        if all(copy.is_before_in_block(u) for u in (top_level(x, block) for x in users(src)) if u != copy):
            copy.erase()


def _elide_copies_into_outputs(fn: ir.Operation) -> None:
    """`alloc A; ...writes A...; memref.copy A, D` with A dead afterwards -> write D directly.

    Bufferizing tensor.pad / concat allocates a fresh buffer even when the result only goes to
    an output; this saves the copy kernel and the intermediate.
    """
    block = func_block(fn)
    for copy in [op for op in block_ops(block) if op.name == "memref.copy"]:
        if _reshaped_copy_into_output(copy, block):
            continue
        src, dst = copy.operands[0], copy.operands[1]
        alloc = defining_op(src)
        if alloc is None or alloc.name != "memref.alloc" or src.type != dst.type:
            continue
        dst_def = defining_op(dst)
        if dst_def is not None and dst_def.name != "memref.alloc":
            continue  # only whole buffers: a view's users are harder to order
        src_users = [top_level(u, block) for u in users(src)]
        if any(copy.is_before_in_block(u) for u in src_users if u != copy):
            continue  # A is read after the copy
        between = [u for u in (top_level(x, block) for x in users(dst)) if u != copy
                   and alloc.is_before_in_block(u) and u.is_before_in_block(copy)]
        if between:
            continue  # D is used while A is live: cannot share
        if dst_def is not None and alloc.is_before_in_block(dst_def):
            dst_def.move_before(alloc)
        src.replace_all_uses_with(dst)
        copy.erase()
        alloc.erase()


def _reshaped_copy_into_output(copy: ir.Operation, block: ir.Block) -> bool:
    """`alloc A; ...writes A...; memref.copy reshape(A), %out` (an expand_shape or collapse_shape)
    with %out a whole output argument and A used by nothing after the copy -> A becomes the
    inverse reshape of %out (the same bytes, row-major both ways) and the copy goes.

    A result reshaped into the output (grid_sample's [n, c, oh*ow] into [n, c, oh, ow]) would
    otherwise cost a copy kernel and an intermediate as large as the output."""
    src, dst = copy.operands[0], copy.operands[1]
    view = defining_op(src)
    if (view is None or view.name not in ("memref.expand_shape", "memref.collapse_shape")
            or not isinstance(dst.owner, ir.Block)):
        return False
    alloc = defining_op(view.operands[0])
    if (alloc is None or alloc.name != "memref.alloc" or alloc.block != block or src.type != dst.type
            or not identity_layout(dst.type) or not identity_layout(alloc.results[0].type)):
        return False
    a = alloc.results[0]
    a_type = ir.MemRefType(a.type)
    if view.name == "memref.collapse_shape" and not a_type.has_static_shape:
        return False
    if any(u != copy and copy.is_before_in_block(u) for u in (top_level(x, block) for x in users(a))):
        return False  # A is read after the copy
    if any(u != copy and u.is_before_in_block(copy) for u in (top_level(x, block) for x in users(dst))):
        return False  # %out is used while A is live
    reassoc = view.attributes["reassociation"]
    with ir.InsertionPoint(alloc), alloc.location:
        if view.name == "memref.expand_shape":
            alias = memref.collapse_shape(a.type, dst, reassoc)
        else:
            alias = memref.expand_shape(a.type, dst, reassoc, [], list(a_type.shape))
    copy.erase()
    if not list(view.results[0].uses):
        view.erase()
    a.replace_all_uses_with(alias)
    alloc.erase()
    return True


def reshapes_to_views(fn: ir.Operation) -> None:
    """`memref.reshape %src(%shape)` (tensor.reshape with several run-time sizes) -> a
    row-major `memref.reinterpret_cast` of %src with the sizes the shape buffer was filled with
    on the host; the shape buffer (alloc + constant-index stores) goes away. %src has the
    identity layout (bufferization copies otherwise), so offset 0 and row-major strides hold."""
    block = func_block(fn)
    for op in block_ops(block):
        if op.name != "memref.reshape":
            continue
        src, shape = op.operands[0], op.operands[1]
        alloc = defining_op(shape)
        out_t = ir.MemRefType(op.results[0].type)
        if alloc is None or alloc.name != "memref.alloc" or not identity_layout(src.type):
            continue
        sizes: dict[int, ir.Value] = {}
        stores, others = [], []
        for u in users(shape):
            if u.name == "memref.store" and u.operands[1] == shape and const_int(u.operands[2]) is not None:
                stores.append(u)
                sizes[const_int(u.operands[2])] = u.operands[0]  # type: ignore[index]
            elif u.name != "memref.reshape":
                others.append(u)
        if others or sorted(sizes) != list(range(out_t.rank)) or any(
                u.block != block or not u.is_before_in_block(op) for u in stores):
            continue
        with ir.InsertionPoint(op), op.location:
            dyn_sizes, static_sizes = [], []
            for i, n in enumerate(out_t.shape):
                static_sizes.append(n)
                if n == DYN:
                    dyn_sizes.append(sizes[i])
            dyn_strides, static_strides = [], []
            stride: int | ir.Value = 1
            for i in range(out_t.rank - 1, -1, -1):
                static_strides.append(stride if isinstance(stride, int) else DYN)
                if not isinstance(stride, int):
                    dyn_strides.append(stride)
                n = out_t.shape[i]
                stride = size_mul(stride, n if n != DYN else sizes[i])
            static_strides.reverse()
            dyn_strides.reverse()
            # (the identity layout's strides are these: static where the inner sizes are)
            view = memref.reinterpret_cast(out_t, src, [], dyn_sizes, dyn_strides,
                                           [0], static_sizes, static_strides)
        op.results[0].replace_all_uses_with(view)
        op.erase()
        if not list(users(shape)) or all(u.name == "memref.store" for u in users(shape)):
            for u in stores:
                u.erase()
            alloc.erase()


def copies_to_linalg(fn: ir.Operation) -> None:
    for op in block_ops(func_block(fn)):
        if op.name == "memref.copy":
            with ir.InsertionPoint(op), op.location:
                linalg.copy(op.operands[0], outs=[op.operands[1]])
            op.erase()

"""Outlining: what happens to the host function once every op is a gpu.launch."""

from __future__ import annotations

from mlir import ir
from mlir.dialects import memref

from gac_torch.backends.gpu.irutil import (
    DYN, DYN_STRIDE, KERNEL_MODULE, VIEW_OPS, block_ops, buffer_root, clone_into, defining_op,
    func_block, static_memref, top_level, users,
)

def sink_globals(fn: ir.Operation) -> None:
    """Clone memref.get_global (and views of it) into the kernels using them, so the global's
    constant data is emitted into the PTX by outlining instead of being a host buffer."""
    block = func_block(fn)
    for op in block_ops(block):
        if op.name != "memref.get_global":
            continue
        for user in list(users(op.results[0])):
            launch = top_level(user, block)
            if launch.name != "gpu.launch":
                continue
            kbody = launch.regions[0].blocks[0]
            mapping: dict[ir.Value, ir.Value] = {}
            with ir.InsertionPoint.at_block_begin(kbody):
                _clone_chain(user, op, mapping)
    for op in reversed(block_ops(block)):
        if (op.name == "memref.get_global" or op.name in VIEW_OPS) and all(
                not list(r.uses) for r in op.results):
            op.erase()


def _clone_chain(user: ir.Operation, glob: ir.Operation, mapping: dict[ir.Value, ir.Value]) -> None:
    for i, v in enumerate(user.operands):
        if not isinstance(v.type, ir.MemRefType) or buffer_root(v) != glob.results[0]:
            continue
        chain = []
        d = defining_op(v)
        while d is not None:
            chain.append(d)
            if d == glob:
                break
            d = defining_op(d.operands[0])
        for c in reversed(chain):
            if c.results[0] not in mapping:
                clone_into([c], mapping)
        user.operands[i] = mapping[v]


def dynamic_memrefs_as_metadata(fn: ir.Operation) -> None:
    """Kernels take buffers as bare pointers, their layout compiled in. A buffer whose sizes,
    strides or offset are known only at run time enters a kernel as its base pointer (a 0-d
    memref, from memref.extract_strided_metadata on the host) plus index scalars, and the
    kernel rebuilds the view with memref.reinterpret_cast."""
    block = func_block(fn)
    ops = block_ops(block)
    capturing = _capturing(block, ops)
    for launch in [op for op in ops if op.name == "gpu.launch" and op in capturing]:
        captured: list[ir.Value] = []

        def visit(o: ir.Operation) -> ir.WalkResult:
            for v in o.operands:
                if (isinstance(v.type, ir.MemRefType) and not static_memref(v.type) and v not in captured
                        and (v.owner == block if isinstance(v.owner, ir.Block)
                             else top_level(v.owner.operation, block) != launch)):
                    captured.append(v)
            return ir.WalkResult.ADVANCE

        for o in block_ops(launch.regions[0].blocks[0]):
            o.walk(visit, ir.WalkOrder.PRE_ORDER)
        for v in captured:
            t = ir.MemRefType(v.type)
            strides, offset = t.get_strides_and_offset()
            with ir.InsertionPoint(launch), launch.location:
                md = memref.ExtractStridedMetadataOp(v).results
            sizes_v, strides_v = list(md)[2:2 + t.rank], list(md)[2 + t.rank:]
            with ir.InsertionPoint.at_block_begin(launch.regions[0].blocks[0]), launch.location:
                view = memref.reinterpret_cast(
                    t, md[0], [md[1]] if offset == DYN_STRIDE else [],
                    [x for x, n in zip(sizes_v, t.shape) if n == DYN],
                    [x for x, n in zip(strides_v, strides) if n == DYN_STRIDE],
                    [offset], list(t.shape), list(strides))
            for use in list(v.uses):
                owner = use.owner.operation if hasattr(use.owner, "operation") else use.owner
                if owner != view.owner and top_level(owner, block) == launch:
                    owner.operands[use.operand_number] = view


def _capturing(block: ir.Block, ops: list[ir.Operation]) -> set[ir.Operation]:
    """The launches using a run-time-shaped buffer of the host (a block argument or a host op's
    result), found from those values' uses: walking every kernel body instead costs ~5 us an op
    (BEVFormer-tiny's kernels hold 255k)."""
    values = list(block.arguments) + [r for op in ops if op.name != "gpu.launch" for r in op.results]
    found = set()
    for v in values:
        if isinstance(v.type, ir.MemRefType) and not static_memref(v.type):
            for use in v.uses:
                owner = use.owner.operation if hasattr(use.owner, "operation") else use.owner
                top = top_level(owner, block)
                if top.name == "gpu.launch":
                    found.add(top)
    return found


def number_kernels(module: ir.Module, fn: ir.Operation) -> dict[str, str]:
    """Rename kernels gac_k<launch order>_<strategy> (they were named in creation order);
    returns old name -> new name."""
    funcs = {}
    for op in module.body.operations:
        if op.operation.name == "gpu.module":
            for f in op.regions[0].blocks[0].operations:
                funcs[ir.StringAttr(f.attributes["sym_name"]).value] = f.operation
    launches = [op for op in block_ops(func_block(fn)) if op.name == "gpu.launch_func"]
    renames = {}
    for i, op in enumerate(launches):
        old = str(op.attributes["kernel"]).rsplit("::@", 1)[-1].strip('"')
        new = f"gac_k{i}_{old.rsplit('_', 1)[-1]}"
        funcs[old].attributes["sym_name"] = ir.StringAttr.get(new)
        op.attributes["kernel"] = ir.SymbolRefAttr.get([KERNEL_MODULE, new])
        renames[old] = new
    return renames

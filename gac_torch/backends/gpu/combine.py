"""Combo kernels: the `loops` kernels that only prepare the graph's inputs, merged into one
launch per dependence level (the idea of Inductor's combo kernels and torch's foreach kernels).

Under bf16 autocast every convolution's weight is cast per call (the graph's `_to_copy`), a 3x3
conv's weight is then copied into its K order (strategies/weight_layout.py) and the stem's is
zero-padded: ResNet-50's body launched ~70 such kernels per call, 1.5-6 us each, most of them a
fraction of a wave. They read nothing but function arguments (or each other's results), so all
of them can run first, before every other kernel, and the independent ones in one launch:

1. Each launch's reads and writes, per allocation (function argument or memref.alloc), from the
   uses of the host's buffers (no kernel body is walked: a model's kernels hold ~10^5 ops).
2. A launch is *prep* when it is a static 1-D `loops` (or `serial`) kernel writing one buffer,
   its operands can be defined at the top of the host function, and every earlier launch it
   conflicts with (read-after-write, write-after-read, write-after-write on one allocation) is
   prep; its level is one more than the highest such level (0 with none). A program that is
   all prep (e.g. elementwise ops alone) is left as it is: nothing is prepared for.
3. Per level, one `combo` launch before the first kernel of the program: its grid is the
   members' grids end to end, a binary search on the block index picks the member, whose body
   runs unchanged on its own block index (grid-relative constants stay valid); blocks narrower
   than the widest member's idle their extra threads.

Everything stays per call and exact (each member's body is moved, not rewritten); what the
members write now lives from the program's start to its reader (ResNet-50 bf16: +47 MB of
workspace, the weights in bf16). GAC_COMBO=0 leaves the kernels apart (A/B, bisects).
"""

from __future__ import annotations

import os
from collections import defaultdict

from mlir import ir
from mlir.dialects import arith, gpu, scf

from gac_torch.backends.gpu.irutil import (
    VIEW_OPS, Tops, as_index, block_ops, const_int, defining_op, func_block, is_size_math, new_launch,
    top_level, users,
)

READ, WRITE = 1, 2
READS = ("memref.load", "vector.load", "vector.transfer_read", "vector.maskedload", "memref.dim")
_WRITES = ("memref.store", "vector.store", "vector.transfer_write", "vector.maskedstore")
# host ops a prep kernel's operands may come from: pure, so they can move to the function's top
_MOVABLE = ("arith.constant", "ub.poison", "memref.alloc", "memref.get_global", *VIEW_OPS)
_LAUNCH_ARGS = 12  # block ids, thread ids, grid dims, block dims (x, y, z each)


def enabled() -> bool:
    return os.environ.get("GAC_COMBO", "1") != "0"


def combine_prep_kernels(fn: ir.Operation, counter) -> int:
    """Merge the prep kernels of `fn` (scheduled: every kernel a gpu.launch) into one launch per
    level, placed before the first kernel. Returns how many launches were saved."""
    block = func_block(fn)
    ops = block_ops(block)
    launches = [op for op in ops if op.name == "gpu.launch"]
    if len(launches) < 2:
        return 0
    access, captured = _accesses(block, ops)
    levels = _prep_levels(launches, access, captured)
    n_prep = sum(len(ms) for ms in levels)
    if len(levels) >= n_prep or n_prep == len(launches):  # nothing to merge, or nothing to prepare for
        return 0
    with ir.InsertionPoint(launches[0]), launches[0].location:  # (a first kernel may be a member)
        anchor = arith.constant(ir.IndexType.get(), 0).owner.operation
    for op in ops:  # the host's constants first: any member may use any of them
        if op.name == "arith.constant" and not op.is_before_in_block(anchor):
            op.move_before(anchor)
    for members in levels:
        for m in members:
            for v in captured[m]:
                _define_before(v, anchor)
    saved = 0
    for members in levels:
        for part in _chunks(members, captured):
            if len(part) > 1:
                _merge(part, anchor, f"gac_k{next(counter)}_combo")
                saved += len(part) - 1
            else:
                part[0].move_before(anchor)
    anchor.erase()
    return saved


MAX_PARAMS = 384  # a combo's kernel parameters (8 bytes a pointer): well inside CUDA's 4 KB


def _chunks(members: list[ir.Operation], captured) -> list[list[ir.Operation]]:
    """`members` in runs whose kernel parameters (the host values they use) fit MAX_PARAMS."""
    runs: list[list[ir.Operation]] = [[]]
    params: set[ir.Value] = set()
    for m in members:
        mine = set(captured[m])  # (constants, not among them, sink into the kernel)
        new = params | mine
        if runs[-1] and len(new) > MAX_PARAMS:
            runs.append([])
            new = mine
        runs[-1].append(m)
        params = new
    return runs


def unshare_prep_inits(fn: ir.Operation) -> None:
    """On tensors, before bufferization: a generic reading only function arguments (a weight
    cast) gets a tensor.empty of its own. CSE merges equal-typed empties, and One-Shot
    Bufferize then writes every cast of one shape into one buffer, each after the previous
    one's conv: a chain no level could run at once. (The memory plan still shares the bytes
    of buffers whose live ranges do not overlap.)"""
    for op in block_ops(func_block(fn)):
        if op.name != "linalg.generic" or not all(_from_argument(v) for v in op.opview.inputs):
            continue
        for i, v in enumerate(op.opview.outputs, start=len(op.opview.inputs)):
            d = defining_op(v)
            if d is not None and d.name == "tensor.empty" and sum(1 for _ in v.uses) > 1:
                with ir.InsertionPoint(op), op.location:
                    op.operands[i] = d.clone().results[0]


def _from_argument(v: ir.Value) -> bool:
    """A tensor that is a function argument's contents, possibly reshaped."""
    d = defining_op(v)
    while d is not None and d.name in ("tensor.expand_shape", "tensor.collapse_shape"):
        d = defining_op(d.operands[0])
    return d is not None and d.name == "bufferization.to_tensor" and defining_op(d.operands[0]) is None


def _accesses(block: ir.Block, ops: list[ir.Operation]):
    """Per launch: {allocation: READ|WRITE bits} and the host values its body uses."""
    access: dict[ir.Operation, dict[ir.Value, int]] = defaultdict(lambda: defaultdict(int))
    captured: dict[ir.Operation, dict[ir.Value, None]] = defaultdict(dict)  # (ordered sets)
    host = list(block.arguments) + [r for op in ops if op.name != "gpu.launch" for r in op.results]
    top_of = Tops(block)
    for v in host:
        d = defining_op(v)
        if d is not None and d.name == "arith.constant":
            continue  # (all move to the top when kernels are combined)
        for use in v.uses:
            top = top_of(use.owner.operation if hasattr(use.owner, "operation") else use.owner)
            if top.name == "gpu.launch":
                captured[top][v] = None
    roots = [v for v in host if isinstance(v.type, ir.MemRefType) and
             (defining_op(v) is None or defining_op(v).name not in VIEW_OPS)]
    for root in roots:
        for user in users(root):
            top = top_of(user)
            if top.name == "gpu.launch":
                bits = READ if user.name in READS else WRITE if user.name in _WRITES else READ | WRITE
                access[top][root] |= bits
            else:  # e.g. a TMA descriptor: the launches using it may read and write the buffer
                for launch in _launches_using(top, block):
                    access[launch][root] |= READ | WRITE
    return access, captured


def _prep_levels(launches: list[ir.Operation], access, captured) -> list[list[ir.Operation]]:
    """The prep launches (module docstring, step 2) grouped by level, each in program order."""
    readers: dict[ir.Value, list[int]] = defaultdict(list)
    writers: dict[ir.Value, list[int]] = defaultdict(list)
    level: dict[int, int] = {}
    for j, launch in enumerate(launches):
        deps: set[int] = set()
        for root, bits in access[launch].items():
            deps.update(writers[root])
            if bits & WRITE:
                deps.update(readers[root])
        writes = sum(1 for bits in access[launch].values() if bits & WRITE)
        if all(i in level for i in deps) and writes == 1 and _candidate(launch, captured[launch]):
            level[j] = 1 + max((level[i] for i in deps), default=-1)
        for root, bits in access[launch].items():
            if bits & READ:
                readers[root].append(j)
            if bits & WRITE:
                writers[root].append(j)
    grouped: list[list[ir.Operation]] = [[] for _ in range(1 + max(level.values(), default=-1))]
    for j in sorted(level):
        grouped[level[j]].append(launches[j])
    return grouped


def _candidate(launch: ir.Operation, captured) -> bool:
    """A static 1-D `loops` or `serial` kernel (no shared memory, no barriers: schedule.py's)
    whose operands can be defined at the function's top."""
    lo = launch.opview
    if not str(lo.attributes["function"]).endswith(("_loops", "_serial")):
        return False
    if (lo.asyncDependencies or lo.dynamicSharedMemorySize is not None or lo.clusterSizeX is not None
            or len(launch.regions[0].blocks[0].arguments) != _LAUNCH_ARGS):
        return False
    dims = [const_int(v) for v in (lo.gridSizeX, lo.gridSizeY, lo.gridSizeZ,
                                   lo.blockSizeX, lo.blockSizeY, lo.blockSizeZ)]
    if None in dims or dims[1:3] != [1, 1] or dims[4:] != [1, 1]:
        return False
    return all(_movable(v) for v in captured)


def _movable(v: ir.Value) -> bool:
    d = defining_op(v)
    if d is None:
        return True  # a function argument
    if d.name not in _MOVABLE and not is_size_math(d):
        return False
    return all(_movable(x) for x in d.operands)


def _define_before(v: ir.Value, anchor: ir.Operation) -> None:
    """Move the host ops defining `v` (and their operands') above `anchor` where they are not."""
    d = defining_op(v)
    if d is None or d.is_before_in_block(anchor):
        return
    for x in d.operands:
        _define_before(x, anchor)
    d.move_before(anchor)


def _grid(launch: ir.Operation) -> tuple[int, int]:
    lo = launch.opview
    return const_int(lo.gridSizeX), const_int(lo.blockSizeX)  # type: ignore[return-value]


def _merge(members: list[ir.Operation], anchor: ir.Operation, name: str) -> None:
    """One launch running each member on its own range of blocks (module docstring, step 3)."""
    sizes = [_grid(m) for m in members]
    starts = [0]
    for g, _ in sizes:
        starts.append(starts[-1] + g)
    threads = max(b for _, b in sizes)
    with ir.InsertionPoint(anchor), anchor.location:
        _, body = new_launch(starts[-1], threads, name)
        with ir.InsertionPoint(body):
            end = gpu.TerminatorOp()
    args = list(body.arguments)

    def place(lo: int, hi: int, at: ir.Operation) -> None:
        if hi - lo == 1:
            _run_member(members[lo], starts[lo], sizes[lo], threads, args, at)
            return
        mid = (lo + hi) // 2
        with ir.InsertionPoint(at), at.location:
            branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, args[0], as_index(starts[mid])), has_else=True)
            with ir.InsertionPoint(branch.then_block):
                left = scf.YieldOp([])
            with ir.InsertionPoint(branch.else_block):
                right = scf.YieldOp([])
        place(lo, mid, left.operation)
        place(mid, hi, right.operation)

    place(0, len(members), end.operation)
    for m in members:
        m.erase()


def _run_member(member: ir.Operation, start: int, size: tuple[int, int], threads: int,
                args: list[ir.Value], at: ir.Operation) -> None:
    """Move `member`'s body before `at`, on block index (block - start) and its own dims."""
    grid, width = size
    mbody = member.regions[0].blocks[0]
    with ir.InsertionPoint(at), at.location:
        bid = args[0] if start == 0 else arith.subi(args[0], as_index(start))
        own = {0: bid, 6: as_index(grid), 9: as_index(width)}
        if width < threads:  # the wider blocks' extra threads skip this member
            guard = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, args[3], as_index(width)))
            with ir.InsertionPoint(guard.then_block):
                at = scf.YieldOp([]).operation
    for i, a in enumerate(mbody.arguments):
        a.replace_all_uses_with(own.get(i, args[i]))
    for op in block_ops(mbody)[:-1]:  # all but its gpu.terminator
        op.move_before(at)


def _top(owner, block: ir.Block) -> ir.Operation:
    return top_level(owner.operation if hasattr(owner, "operation") else owner, block)


def _launches_using(op: ir.Operation, block: ir.Block) -> set[ir.Operation]:
    """The launches using a result of host op `op`, directly or through other host ops."""
    found: set[ir.Operation] = set()
    todo, seen = [op], set()
    while todo:
        o = todo.pop()
        if o in seen:
            continue
        seen.add(o)
        for r in o.results:
            for use in r.uses:
                top = _top(use.owner, block)
                (found.add if top.name == "gpu.launch" else todo.append)(top)
    return found

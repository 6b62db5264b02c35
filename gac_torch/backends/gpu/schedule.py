"""The GPU schedule: linalg on tensors -> host code launching one outlined kernel per op.

Order of work (all in one MLIR module, in place):

1. Tensor level: calls of gac.attention go to the target's "attention" strategies (e.g. one
   flash-attention kernel) or are inlined (attention.py); elementwise fusion (gathers reshaped
   into weighted sums first lose their unit dims, and added sums of gathers become one
   reduction: sampling.py); row groups
   (reductions with the elementwise ops around them over the same rows) go to the "rows"
   strategies (rows.py); then bufferization (bufferize.py), one `linalg.generic` on memrefs per
   kernel.
2. Each generic is offered to the target's strategies in order (strategy.py); the first whose
   matcher accepts it emits its kernel (named gac_k<i>_<strategy>).
3. `loops` (the fallback for any linalg op): loops are interchanged so parallel dims come
   first, `convert-linalg-to-parallel-loops`, then the scf.parallel space is linearized onto a
   1-D grid of 1-D blocks (last dim fastest, so row-major writes coalesce; large elementwise
   spaces give each thread `coarsen` points a grid apart); reduction dims stay sequential loops
   inside the thread, and so does a parallel dim along which most of a loop-free body is
   invariant (invariant.py: grid_sample's position math once per point, not per channel).
   A fill of the output right before is folded into the same kernel.
4. `serial`: scalar leftovers (rank-0 ops) run in a single-thread kernel.
5. Where the target asks (GpuLimits.combine_prep: cuda), the kernels that only prepare the
   inputs (bf16 autocast's weight casts, computed in their relayout copies: fold_casts.py) run
   first, one `combo` launch per dependence level (combine.py).
6. Outlining (outline.py): globals sink into kernels, run-time-sized buffers enter as base
   pointers plus sizes, `gpu-kernel-outlining` puts every kernel into `gpu.module @gac_kernels`.

Run-time sizes (`?` dims): extents become host index values (`memref.dim` + arith, evaluated per
call by the host program); `loops` takes run-time trip counts and grids. What the schedule cannot
map with run-time sizes raises NotImplementedError, which the target reports as StaticShapesOnly:
the graph is then compiled per shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlir import ir
from mlir.dialects import arith, gpu, memref, scf

from gac_torch.errors import GacUnsupportedError
from gac_torch.backends.gpu import combine
from gac_torch.backends.gpu.fold_casts import fold_casts_into_copies
from gac_torch.backends.gpu.analysis import analyze
from gac_torch.backends.gpu.aside import kernels_aside
from gac_torch.backends.gpu.attention import map_attention
from gac_torch.backends.gpu.bufferize import (
    bufferize, copies_to_linalg, generalize_elementwise_named_ops, reshapes_to_views,
)
from gac_torch.backends.gpu.irutil import (
    HOST_OPS, VIEW_OPS, as_index, block_ops, buffer_root, const_int, defining_op, delinearize,
    func_block, is_size_math, is_static, main_func, new_launch, run_passes, size_ceildiv, size_prod,
    top_level, verify_ops,
)
from gac_torch.backends.gpu import in_place
from gac_torch.backends.gpu.hoist import hoist_epilogue_consumers
from gac_torch.backends.gpu.relayout import relayout_gemm_operands
from gac_torch.backends.gpu.invariant import loop_over, serial_dim
from gac_torch.backends.gpu.rows import map_rows
from gac_torch.backends.gpu import tuning
from gac_torch.backends.gpu.sampling import has_reshaped_gather, merge_added_reductions
from gac_torch.backends.gpu.outline import dynamic_memrefs_as_metadata, number_kernels, sink_globals
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, deferred_splices, template_cache
from gac_torch.backends.gpu.transposes import fold_transposes_into_matmuls
from gac_torch.lowering.fusion import fuse_elementwise

# Host ops without side effects: moved above pending serial code rather than cutting it in two
# (a cut leaves the serial ops' scalars, e.g. an index read from a tensor, used across kernels).
HOISTABLE = ("ub.poison", "memref.alloc", "memref.get_global", *VIEW_OPS)


def map_to_gpu(module: ir.Module, limits: GpuLimits, strategies: Sequence[Strategy] = (),
               n_inputs: int | None = None) -> None:
    """Rewrite the linalg-on-tensors `@main` into host code launching outlined kernels: each
    generic goes to the first of `strategies` that matches it, else to a `loops` kernel; scalar
    host code goes to `serial` kernels. `n_inputs` (the arguments before the outputs): where
    given, the outputs that may share an input's buffer are recorded (in_place.py)."""
    with template_cache():  # a kernel template repeated (same layer shapes) is parsed once
        _map_to_gpu(module, limits, strategies, n_inputs)


def _map_to_gpu(module: ir.Module, limits: GpuLimits, strategies: Sequence[Strategy], n_inputs: int | None) -> None:
    fn = main_func(module)
    counter = iter(range(1 << 30))
    map_attention(module, fn, strategies, limits, counter)  # fused units first, on tensors
    fold_transposes_into_matmuls(fn)  # a GEMM reads its transposed operands in place
    generalize_elementwise_named_ops(module, fn)
    if has_reshaped_gather(fn):  # sampling: gathers fuse into their weighted sums (sampling.py)
        run_passes(module, "func.func(linalg-fold-unit-extent-dims)")
    fuse_elementwise(module)  # as in the shared lowering: no prologue inside a contraction
    if merge_added_reductions(fn):  # e.g. the levels of deformable attention: one kernel
        run_passes(module, "canonicalize, cse")
    map_rows(fn, strategies, limits, counter)  # row groups (norms, softmax): one kernel each
    combining = limits.combine_prep and combine.enabled()
    if combining:  # weight casts into buffers of their own, so that they can run at once
        combine.unshare_prep_inits(fn)
    bufferize(module, fn)
    reshapes_to_views(fn)
    copies_to_linalg(fn)
    run_passes(module, "func.func(linalg-generalize-named-ops), canonicalize, cse")
    hoist_epilogue_consumers(fn)  # a GEMM's elementwise consumer right after it (its epilogue)
    relayout_gemm_operands(fn, limits)  # (an epilogue stores a later GEMM's operand K-outer)
    if n_inputs is not None:
        in_place.record(fn, n_inputs)  # (before strategies: generics still say what they read)

    block = func_block(fn)
    ops = block_ops(block)
    # (templates not folded yet are folded by worker processes meanwhile: fold_pool.py)
    with deferred_splices(sum(op.name == "linalg.generic" for op in ops)):
        for op in ops:
            if op.name != "linalg.generic":
                continue
            if not _apply_strategy(op, strategies, limits, counter):
                parallel_dims_first(op)
    if combining:  # a weight cast computed in its relayout copy
        fold_casts_into_copies(fn)

    # (from here the host function holds every kernel body: verified once, at the end; the
    # linalg ops left for the pipeline below are verified now: it crashes on an invalid one)
    verify_ops([o for o in block_ops(block) if o.name.startswith("linalg.")],
               "the strategies or fold_casts_into_copies")
    with kernels_aside(module, block):  # (folded templates that do not meet the host: aside.py)
        run_passes(module, "func.func(convert-linalg-to-parallel-loops), canonicalize, cse", verify=False)
    ops = block_ops(block)
    serial: list[ir.Operation] = []
    for i, op in enumerate(ops):
        if op.name == "scf.parallel":
            if serial:  # scalars the serial code after this loop reads move there with it
                later = sink_past(serial, op, ops[i + 1] if i + 1 < len(ops) else None)
                wrap_serial([o for o in serial if o not in later], f"gac_k{next(counter)}_serial")
                serial = later
            if i + 1 < len(ops) and ops[i + 1].name == "scf.parallel" and absorb_fill(op, ops[i + 1]):
                continue
            linearize(op, f"gac_k{next(counter)}_loops", limits)
            continue
        size_math = is_size_math(op)
        if op.name not in HOST_OPS and not size_math:
            serial.append(op)
        elif not serial or op.name == "arith.constant":
            pass
        elif (op.name in HOISTABLE or size_math) and not uses_any(op, serial):
            op.move_before(serial[0])  # a buffer, view or size the serial code does not define
        else:
            wrap_serial(serial, f"gac_k{next(counter)}_serial")
            serial = []
    if serial:
        wrap_serial(serial, f"gac_k{next(counter)}_serial")
    if combining:  # per-call input preparation (weight casts, relayouts): one launch a level
        combine.combine_prep_kernels(fn, counter)
    sink_globals(fn)
    run_passes(module, "gpu-launch-sink-index-computations", verify=False)
    dynamic_memrefs_as_metadata(fn)
    # per function: the kernels fold in parallel (a module-level canonicalize is one thread)
    run_passes(module, "gpu-kernel-outlining, func.func(canonicalize, cse), "
                       "gpu.module(gpu.func(canonicalize, cse))", verify=False)
    module.operation.verify()  # (kernels outlined: in parallel, one per function)
    tuning.rename(number_kernels(module, fn))


def _apply_strategy(op: ir.Operation, strategies: Sequence[Strategy], limits: GpuLimits,
                    counter) -> bool:
    """The first strategy whose matcher accepts `op` emits it (True), or declines (False)."""
    mine = [s for s in strategies if s.on == "generic"]
    g = analyze(op) if mine else None
    if g is None:
        return False
    for s in mine:
        tuning.discard()  # choices of a matcher that declined are nobody's
        m = s.match(g, limits)
        if m is not None:
            name = f"gac_k{next(counter)}_{s.name}"
            done = s.emit(m, name, limits)
            tuning.bind(name) if done else tuning.discard()
            return done
    return False


def _parallel_bounds(p: ir.Operation) -> list[tuple]:
    """(lower, upper, step) per dim: ints where constant, else the host index Values."""
    po = p.opview
    out = []
    for lb, ub, st in zip(po.lowerBound, po.upperBound, po.step):
        out.append(tuple(v if c is None else c for v, c in ((x, const_int(x)) for x in (lb, ub, st))))
    return out


def _fill_loop(p: ir.Operation) -> tuple[ir.Value, ir.Value, list[ir.Value]] | None:
    """(value, buffer, indices) if scf.parallel `p` only stores one outside value per point."""
    body = p.regions[0].blocks[0]
    ops = block_ops(body)
    if len(ops) != 2 or ops[0].name != "memref.store":
        return None
    value, buf, idx = ops[0].operands[0], ops[0].operands[1], list(ops[0].operands)[2:]
    ivs = list(body.arguments)
    if [v for v in idx if v in ivs] != ivs or any(v not in ivs and const_int(v) is None for v in idx):
        return None  # each iv once, in order; the rest constant (unit dims)
    if (isinstance(value.owner, ir.Block) and value.owner == body) or (
            defining_op(value) is not None and defining_op(value).block == body):
        return None
    return value, buf, idx


def absorb_fill(fill_loop: ir.Operation, p: ir.Operation) -> bool:
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
                    x == y or (const_int(x) is not None and const_int(x) == const_int(y))
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


def linearize(p: ir.Operation, name: str, limits: GpuLimits) -> None:
    """scf.parallel -> 1-D gpu.launch, one thread per iteration point (last dim fastest).

    Large loop-free (elementwise) spaces give each thread `coarsen` points a grid-stride apart:
    independent loads in flight per thread, which a one-point thread lacks to fill HBM."""
    bounds = _parallel_bounds(p)
    if any(not is_static(lb, st) for lb, _, st in bounds):
        raise GacUnsupportedError("scf.parallel with a run-time lower bound or step")
    with ir.InsertionPoint(p), p.location:  # run-time extents: (ub - lb) / step on the host
        extents = [max(0, -(-(ub - lb) // st)) if is_static(ub) else
                   size_ceildiv(ub if lb == 0 else arith.subi(ub, as_index(lb)), st) for lb, ub, st in bounds]
        total = size_prod(extents)
    if total == 0:
        p.erase()
        return
    has_loops = False

    def find_loops(o: ir.Operation) -> ir.WalkResult:
        nonlocal has_loops
        has_loops = has_loops or o.name in ("scf.for", "scf.while", "scf.parallel") and o != p
        return ir.WalkResult.ADVANCE

    p.walk(find_loops, ir.WalkOrder.PRE_ORDER)
    pbody = p.regions[0].blocks[0]
    plan = serial_dim(pbody, bounds, extents, limits.serial_min_threads)  # a dim looped over inside each thread
    inner = plan.dim if plan is not None else None
    if plan is not None:
        extents = extents[:plan.dim] + extents[plan.dim + 1:]
        total, has_loops = total // plan.extent, True
    if is_static(total):
        coarsen = limits.coarsen if total >= limits.coarsen_min_points and not has_loops else 1
        threads = min(limits.threads_per_block, -(-total // limits.warp_size) * limits.warp_size)
        if -(-total // (threads * coarsen)) > limits.max_grid[0]:
            raise GacUnsupportedError(f"{total} iterations exceed a 1-D grid")
    else:  # (a grid larger than the device allows is refused when the sizes are bound)
        coarsen, threads = 1, limits.threads_per_block
    with ir.InsertionPoint(p), p.location:
        grid = size_ceildiv(total, threads * coarsen)
        launch, kbody = new_launch(grid, threads, name)
        with ir.InsertionPoint(kbody):
            bid, tid = kbody.arguments[0], kbody.arguments[3]
            lin = arith.addi(arith.muli(bid, as_index(threads)), tid)
            if coarsen > 1:
                step = scf.ForOp(as_index(0), as_index(coarsen), as_index(1))
                with ir.InsertionPoint(step.body):
                    lin = arith.addi(lin, arith.muli(step.induction_variable, as_index(grid * threads)))  # type: ignore[operator]
                    inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lin, as_index(total)))
                    scf.YieldOp([])
            else:
                inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lin, as_index(total)))
            with ir.InsertionPoint(inside.then_block):
                idx = delinearize(lin, extents)
                ivs = []
                for (lb, _, st), i in zip([b for d, b in enumerate(bounds) if d != inner], idx):
                    v = i if st == 1 else arith.muli(i, as_index(st))
                    ivs.append(v if lb == 0 else arith.addi(v, as_index(lb)))
                if inner is not None:  # (its uses move into loops over it: loop_over)
                    ivs.insert(inner, None)
                term = scf.YieldOp([])
            gpu.TerminatorOp()
    for op in block_ops(pbody)[:-1]:  # all but scf.reduce
        op.move_before(term.operation)
    if plan is not None:
        loop_over(plan, pbody.arguments[plan.dim], inside.then_block)
    for old, new in zip(pbody.arguments, ivs):
        if new is not None:
            old.replace_all_uses_with(new)
    p.erase()


def _writes(op: ir.Operation, root: ir.Value) -> bool:
    """Might `op` (or an op nested in it) write the allocation `root`? Anything but a load or a
    size query that touches it counts."""
    found = False

    def visit(o: ir.Operation) -> ir.WalkResult:
        nonlocal found
        if o.name not in ("memref.load", "memref.dim", *VIEW_OPS) and any(
                isinstance(v.type, ir.MemRefType) and buffer_root(v) == root for v in o.operands):
            found = True
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def sink_past(serial: list[ir.Operation], cut: ir.Operation, after: ir.Operation | None) -> list[ir.Operation]:
    """Pending serial code is cut in two by the kernel `cut`. Its scalars that only the code
    after the cut uses (e.g. an index computed from a tensor, read by a later store) move there,
    right before `after`: pure arith, and loads of buffers nothing in between writes. Returns
    the moved ops, in order (the next serial kernel's first ops)."""
    if after is None:
        return []
    moved: list[ir.Operation] = []
    stays: list[ir.Operation] = []
    for o in reversed(serial):
        users = [top_level(u.owner.operation, o.block) for r in o.results for u in r.uses]
        pure = o.name.startswith("arith.") and not o.regions
        load = (o.name == "memref.load" and not _writes(cut, buffer_root(o.operands[0]))
                and not any(_writes(x, buffer_root(o.operands[0])) for x in stays))
        if (o.results and (pure or load) and users
                and all(u not in serial or u in moved for u in users)):
            moved.append(o)
        else:
            stays.append(o)
    moved.reverse()
    for o in moved:
        o.move_before(after)
    return moved


def uses_any(op: ir.Operation, ops: list[ir.Operation]) -> bool:
    """Does op read a result of one of ops?"""
    defined = {r for o in ops for r in o.results}
    return any(v in defined for v in op.operands)


def wrap_serial(ops: list[ir.Operation], name: str) -> None:
    """Run host-level scalar code (e.g. a rank-0 op's loads/stores) in a one-thread kernel."""
    with ir.InsertionPoint(ops[0]), ops[0].location:
        launch, body = new_launch(1, 1, name)
        with ir.InsertionPoint(body):
            term = gpu.TerminatorOp()
    for op in ops:
        op.move_before(term.operation)
    for op in ops:
        for r in op.results:
            for use in r.uses:
                if top_level(use.owner.operation, launch.block) != launch:
                    raise GacUnsupportedError(f"host value from {op.name} used outside its kernel")


def parallel_dims_first(op: ir.Operation) -> None:
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

    for body_op in block_ops(op.regions[0].blocks[0]):
        body_op.walk(renumber, ir.WalkOrder.PRE_ORDER)

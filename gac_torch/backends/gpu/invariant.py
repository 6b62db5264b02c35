"""`loops` kernels: a parallel dim along which most of the body is invariant becomes a loop
inside each thread, with the invariant work computed once before it.

Why: a gather kernel such as grid_sampler_2d (out[n, c, p] = sum of 4 corners of value[n, c]
at a position computed from grid[n, p]) spends ~60 ops per point on the position and ~15 on
the channel's taps. One thread per (n, c, p) recomputes the position C times; one thread per
(n, p) looping over c computes it once, and its stores still coalesce along p (the last dim
stays in the thread index).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, scf

from gac_torch.backends.gpu.irutil import as_index, block_ops, clone_into, const_int

MIN_INVARIANT = 24  # ops computed once per thread instead of once per point
MAX_EXTENT = 256  # the serial dim's extent: the per-thread loop's trip count
UNROLL = 4  # iterations per trip: their independent loads (gathers) are in flight together


def depends_on(body: ir.Block, v: ir.Value) -> set[ir.Operation]:
    """Ops of `body` (top level) whose results or effects depend on `v`, transitively."""
    tainted: set = {v}
    deps: set[ir.Operation] = set()
    for op in block_ops(body):
        if any(x in tainted for x in op.operands):
            deps.add(op)
            tainted.update(op.results)
    return deps


@dataclass(frozen=True)
class Plan:
    """Loop over `dim` inside each thread: its ops in `blocks` (the thread's body, and the
    innermost body of the reduction loop nest when there is one) that depend on the dim move
    into a loop over it; the rest run once per thread (per reduction step)."""

    dim: int
    extent: int
    nest: ir.Block | None  # the innermost reduction body, or None for a loop-free body


def _nest(body: ir.Block, v: ir.Value) -> ir.Block | None | bool:
    """The innermost body of the body's one loop nest (its last op; scf.for all the way down,
    nothing else at the outer levels depending on `v`); None without loops; False if neither."""
    ops = block_ops(body)[:-1]
    loops = [o for o in ops if o.regions]
    if not loops:
        return None
    if len(loops) != 1 or loops[0] != ops[-1] or loops[0].name != "scf.for":
        return False
    # the thread-level ops that depend on `v` must feed nothing else (e.g. the output's fill)
    top = depends_on(body, v)
    if any(u not in top for o in top for r in o.results for u in _users(r)):
        return False
    cur = loops[0]
    while True:
        inner = cur.regions[0].blocks[0]
        ops = block_ops(inner)[:-1]
        loops = [o for o in ops if o.regions]
        if not loops:
            return inner
        if len(loops) != 1 or loops[0] != ops[-1] or loops[0].name != "scf.for" or depends_on(inner, v):
            return False
        cur = loops[0]


def _users(v: ir.Value) -> list[ir.Operation]:
    return [u.owner.operation if hasattr(u.owner, "operation") else u.owner for u in v.uses]


def serial_dim(body: ir.Block, bounds: list[tuple], extents: list, min_threads: int) -> Plan | None:
    """The dim (not the last; from 0 in steps of 1) to loop over inside each thread, or None.
    For static extents, where at least MIN_INVARIANT ops and twice as many as the rest of the
    body (of the innermost reduction loop, when there is one) do not depend on the dim, and at
    least `min_threads` points are left for the threads (enough to fill the device)."""
    if len(extents) < 2 or not all(isinstance(e, int) for e in extents):
        return None
    total = 1
    for e in extents:
        total *= e
    best, best_inv = None, 0
    for d in range(len(extents) - 1):
        if (not 2 <= extents[d] <= MAX_EXTENT or total // extents[d] < min_threads
                or bounds[d][0] != 0 or bounds[d][2] != 1):
            continue
        v = body.arguments[d]
        nest = _nest(body, v)
        if nest is False:
            continue
        hot = nest if nest is not None else body
        ops = [o for o in block_ops(hot)[:-1] if o.name != "arith.constant"]
        dep = len([o for o in depends_on(hot, v) if o.name != "arith.constant"])
        inv = len(ops) - dep
        if inv >= MIN_INVARIANT and inv >= 2 * dep and inv > best_inv:
            best, best_inv = Plan(d, extents[d], nest), inv
    return best


def loop_over(plan: Plan, v: ir.Value, thread: ir.Block) -> None:
    """Apply `plan` to the ops now in `thread` (the kernel's per-thread block, ops in their
    original order, `v` the dim's old index): a loop over the dim in front of the thread's
    reduction nest (or at its end) and one at the end of the innermost reduction body, each
    holding the ops there that depend on `v`, unrolled."""
    for block in [thread] + ([plan.nest] if plan.nest is not None else []):
        dep = depends_on(block, v)  # (once: not once per op)
        deps = [o for o in block_ops(block) if o in dep]
        if not deps:
            continue
        ops = block_ops(block)
        at = ops[-1]  # the terminator, or in the thread the reduction nest (its last op)
        if block is thread and plan.nest is not None:
            at = next(o for o in ops if o.regions)
        with ir.InsertionPoint(at), at.location:
            loop = scf.ForOp(as_index(0), as_index(plan.extent), as_index(unroll_by(plan.extent)))
            with ir.InsertionPoint(loop.body):
                term = scf.YieldOp([])
        iv = loop.induction_variable
        for o in deps:
            o.move_before(term.operation)
            for i, x in enumerate(o.operands):
                if x == v:
                    o.operands[i] = iv
        unroll(loop)


def unroll_by(extent: int) -> int:
    """The largest factor up to UNROLL that divides `extent` (no remainder loop)."""
    return next(f for f in range(UNROLL, 0, -1) if extent % f == 0)


def unroll(loop: scf.ForOp) -> None:
    """Repeat the body of `loop` (built with step = the unroll factor, from 0) for iv + 1 ..
    iv + step - 1."""
    step = const_int(loop.step)
    body = loop.body
    ops = block_ops(body)[:-1]
    iv = loop.induction_variable
    term = block_ops(body)[-1]
    for k in range(1, step):
        with ir.InsertionPoint(term), loop.location:
            clone_into(ops, {iv: arith.addi(iv, as_index(k))})

"""`loops` kernels: a parallel dim along which most of the body is invariant becomes a loop
inside each thread, with the invariant work computed once before it.

Why: a gather kernel such as grid_sampler_2d (out[n, c, p] = sum of 4 corners of value[n, c]
at a position computed from grid[n, p]) spends ~60 ops per point on the position and ~15 on
the channel's taps. One thread per (n, c, p) recomputes the position C times; one thread per
(n, p) looping over c computes it once, and its stores still coalesce along p (the last dim
stays in the thread index).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, scf

from gac_torch.backends.gpu.irutil import as_index, block_ops, clone_into, const_int

MIN_INVARIANT = 24  # ops computed once per thread instead of once per point
MAX_EXTENT = 256  # the serial dim's extent: the per-thread loop's trip count
MIN_THREADS = 1 << 15  # points left for the threads: enough to fill the GPU
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


def serial_dim(body: ir.Block, bounds: list[tuple], extents: list, has_loops: bool) -> int | None:
    """The dim (not the last; from 0 in steps of 1) to loop over inside each thread, or None.
    Only for loop-free bodies with static extents, where at least MIN_INVARIANT ops and twice
    as many as the rest do not depend on the dim."""
    if has_loops or len(extents) < 2 or not all(isinstance(e, int) for e in extents):
        return None
    ops = [o for o in block_ops(body)[:-1] if o.name != "arith.constant"]
    if any(o.regions for o in ops):
        return None
    total = 1
    for e in extents:
        total *= e
    best, best_inv = None, 0
    for d in range(len(extents) - 1):
        if (not 2 <= extents[d] <= MAX_EXTENT or total // extents[d] < MIN_THREADS
                or bounds[d][0] != 0 or bounds[d][2] != 1):
            continue
        dep = len([o for o in depends_on(body, body.arguments[d]) if o.name != "arith.constant"])
        inv = len(ops) - dep
        if inv >= MIN_INVARIANT and inv >= 2 * dep and inv > best_inv:
            best, best_inv = d, inv
    return best


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

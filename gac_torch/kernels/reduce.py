"""Row reduction for the GPU targets: out[p] = combine(init[p], combine_r element(p, r)), one
group of threads per output element p, with a recognized combiner (add, mul, min/max, and/or/xor).

Short rows (up to `warp_max`, or a run-time length) get one warp per output, `threads / warp`
outputs per block, combined with a shuffle butterfly (or a thread per output: `per_thread`, for
columns, where consecutive outputs are consecutive addresses); long rows get one block per output
(a power of two of threads up to `threads`), combined with gpu.all_reduce. f16/bf16 accumulate in
f32, small ints in i32 (the backend's `acc` type).

  1. locate   block, thread -> the output `out_lin` (idle groups past the end are inactive) and
              the lane inside its group; out_lin -> the parallel indices p (last fastest)
  2. stride   acc = identity; lane l visits r = l, l + G, l + 2G, ... (a constant trip count:
              LLVM unrolls it and keeps loads in flight), r -> the reduction indices;
              acc = combine(acc, element(p, r)) where r is inside the row
  3. combine  the group's accumulators: warp shuffles (xor 16, 8, 4, 2, 1) or gpu.all_reduce
  4. store    lane 0: out[p] = combine(init or out[p], total), narrowed to out's type

The schedule is here once (`kernel`); the math comes from the backend: `element`, `combine`, `identity`,
`out_index`, `init`, `store` (backends/gpu/strategies/reduce.py clones them from the linalg body through the
`Ir` builder; `_Numpy` here takes them as numpy functions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels.builder import Numpy, as_type, delinearize


@dataclass(frozen=True)
class Plan:
    per_warp: bool  # one warp per output (else one block)
    threads: int  # per block
    group: int  # threads cooperating on one output
    warp: int

    @property
    def outs_per_block(self) -> int:
        return self.threads // self.group


def plan(n_red: int | None, warp: int = 32, threads: int = 256, warp_max: int = 1024) -> Plan:
    """`n_red`: the reduction length (None: known at run time)."""
    per_warp = n_red is None or n_red <= warp_max
    threads = (threads if per_warp else
               min(threads, max(warp, 1 << (max(n_red, 1) - 1).bit_length())))  # type: ignore[operator]
    return Plan(per_warp, threads, warp if per_warp else threads, warp)


def per_thread(threads: int = 256, warp: int = 32) -> Plan:
    """One thread per output (its whole row in sequence): for reductions over an outer dim,
    where consecutive threads' loads are consecutive addresses."""
    return Plan(True, threads, 1, warp)


def kernel(b: Any, p: Plan, acc: Any, n_out: Any, n_red: Any, trips: Any, p_ext: Sequence[Any],
            r_ext: Sequence[Any], exact_grid: bool, exact_rows: bool) -> None:
    """`exact_grid`: every group has an output; `exact_rows`: every lane's r is in its row."""
    # 1. locate
    bid, tid = b.bid(0), b.tid()
    if p.per_warp:
        lane = b.rem(tid, p.group)
        out_lin = b.add(b.mul(bid, p.outs_per_block), b.div(tid, p.group))
    else:
        lane, out_lin = tid, bid
    active = None if exact_grid else b.lt(out_lin, n_out)
    p_ivs = delinearize(b, out_lin, p_ext)

    # 2. stride over the row
    def step(it: Any, accs: list[Any]) -> list[Any]:
        j = b.add(b.mul(it, p.group), lane)
        cond = active
        if not exact_rows:
            in_row = b.lt(j, n_red)
            cond = in_row if cond is None else b.and_(cond, in_row)

        def visit() -> Any:
            return b.combine(accs[0], b.element(p_ivs, delinearize(b, j, r_ext)))

        return [visit() if cond is None else b.if_(cond, acc, visit, lambda: accs[0])]

    (total,) = b.for_(0, trips, 1, [b.identity()], [acc], step)
    # 3. combine the group
    if p.per_warp:  # butterfly: every lane ends with the warp's total
        for off in (o for o in (16, 8, 4, 2, 1) if o < p.group):  # narrow warps (Vortex: 4); 1: a thread
            total = b.combine(total, b.shuffle_xor(total, off, p.warp))
    else:
        total = b.block_reduce(total)
    # 4. store
    leader = b.eq(lane, 0)
    if active is not None:
        leader = b.and_(leader, active)

    def store() -> None:
        idx = b.out_index(p_ivs)
        b.store(idx, b.combine(b.init(idx), total))

    b.when(leader, store)


# --------------------------------------------------------------------------------------------
# numpy: one block at a time, threads in lockstep


_NP_COMBINE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
}
_NP_IDENTITY = {"add": 0, "mul": 1, "max": -math.inf, "min": math.inf, "and": -1, "or": 0, "xor": 0}


class _Numpy(Numpy):
    def __init__(self, p: Plan, kind: str, acc: str, element: Callable, out: np.ndarray,
                 init: float | None, block: int):
        super().__init__(p.threads, (block, 0, 0))
        self.kind, self.acc, self.elem_fn, self.out, self.initv = kind, acc, element, out, init

    def combine(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return as_type(_NP_COMBINE[self.kind](x, y), self.acc)

    def identity(self) -> np.ndarray:
        ident = _NP_IDENTITY[self.kind]
        if self.acc[0] == "i" and math.isinf(ident):  # integer max/min (signed)
            w = int(self.acc[1:])
            ident = -(1 << (w - 1)) if ident < 0 else (1 << (w - 1)) - 1
        return as_type(self.const(ident, self.acc), self.acc)

    def element(self, p_ivs: list[np.ndarray], r_ivs: list[np.ndarray]) -> np.ndarray:
        on = self.mask  # inactive lanes read index 0 (their value is not used)
        p = [np.where(on, x, 0) for x in p_ivs]
        r = [np.where(on, x, 0) for x in r_ivs]
        return as_type(self.elem_fn(p, r), self.acc)

    def shuffle_xor(self, x: np.ndarray, off: int, width: int) -> np.ndarray:
        return x[np.arange(self.T) ^ off]

    def block_reduce(self, x: np.ndarray) -> np.ndarray:
        return np.full_like(x, as_type(_NP_COMBINE[self.kind].reduce(x), self.acc))

    def out_index(self, p_ivs: list[np.ndarray]) -> list[np.ndarray]:
        return p_ivs  # `out` is shaped like the parallel space

    def init(self, idx: list[np.ndarray]) -> np.ndarray:
        if self.initv is not None:
            return as_type(self.const(self.initv, self.acc), self.acc)
        return as_type(self.load(self.out, "", idx), self.acc)

    def store(self, idx: list[np.ndarray], val: np.ndarray) -> None:  # type: ignore[override]
        super().store(val, self.out, "", idx)  # (narrowed to out's dtype by numpy)


def emulate(kind: str, acc: str, element: Callable, p_ext: Sequence[int], r_ext: Sequence[int],
            out: np.ndarray, init: float | None = None, p: Plan | None = None) -> np.ndarray:
    """Run the kernel on the CPU: out (shaped p_ext) gets combine(init or out, the reduction of
    element(p_indices, r_indices) over r_ext); `element` takes per-lane index arrays. `kind`:
    add | mul | max | min | and | or | xor; `acc`: the accumulator's MLIR type. Returns out."""
    n_out, n_red = math.prod(p_ext), math.prod(r_ext)
    p = p or plan(n_red)
    grid = -(-n_out // p.outs_per_block)
    trips = -(-n_red // p.group)
    for block in range(grid):
        b = _Numpy(p, kind, acc, element, out, init, block)
        kernel(b, p, acc, n_out, n_red, trips, list(p_ext), list(r_ext),
                grid * p.outs_per_block == n_out, n_red % p.group == 0)
    return out

"""One pass per row for the GPU targets: a chain of elementwise maps and row reductions over the
same rows (LayerNorm, RMSNorm, softmax, log_softmax, ...) as one kernel that reads each input
row once, keeps it in registers, and writes each output once.

The row space is R rows of C columns. A program is a list of nodes in dataflow order, each one
value per element (`full`, or `other`: a leaf indexed through the loop dims, e.g. GroupNorm's
per-channel weight), per row (`row`), per column (`col`, e.g. an affine weight) or one for all
(`scalar`): `load` a leaf, `map` its arguments, `reduce` a full value over the row to
a row value, or `pick` a full value's element at one column (LayerNorm's shift by x[:, 0]). A group of `group` threads (a power of two: part of a warp, or a whole block) owns
one row; lane l holds `slots` vectors of `vec` columns at c = (s * group + l) * vec, so a warp's
accesses are consecutive 16-byte vectors.

  1. locate   block, thread -> row = bid * rows_per_block + tid / group, lane = tid % group;
              rows past R are inactive (no loads, no stores)
  2. nodes    in order; a full node is computed per slot and element (columns past C are masked:
              loads read nothing, reductions skip them, stores are predicated off)
  3. reduce   per thread: a balanced tree over its valid elements (identity for masked ones);
              per warp: a shuffle butterfly (xor group/2 .. 1); a block group: lane 0 of each
              warp writes smem[node][warp], one barrier (shared by the reductions pending at
              that point), every thread combines the group's warps; then combine(init, total)
  4. store    an output node right where it is computed: full nodes per slot (vector stores),
              row nodes by lane 0

The schedule is here once (`kernel`); the math comes from the backend: `load`, `compute`,
`element`, `combine`, `identity`, `finish`, `store`, `shuffle_xor` / `shuffle_idx`,
`smem_put` / `smem_get`
(backends/gpu/strategies/row.py clones it from the linalg bodies through the `Ir` builder;
`_Numpy` here takes numpy functions and checks bounds, masks and barriers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels.builder import Numpy, Smem, as_type

SPACES = ("full", "row", "col", "scalar", "other")  # other: a leaf gathered per element
PER_COLUMN = ("full", "col", "other")  # values per slot and element


@dataclass(frozen=True)
class Node:
    op: str  # "load" | "map" | "reduce"
    space: str  # one of SPACES (map: full | row; reduce: row)
    args: tuple[int, ...] = ()  # earlier nodes (reduce: the element's operands)
    out: bool = False  # stored to an output buffer
    init: int | None = None  # reduce: a row node combined first (else the backend's constant)
    at: int = 0  # pick: the column whose element of a full node every thread of the row gets


@dataclass(frozen=True)
class Plan:
    R: int
    C: int
    vec: int  # columns per vector access
    group: int  # threads per row
    slots: int  # vectors per thread
    threads: int  # per block
    warp: int = 32
    trips: int = 1  # chunks of slots * group * vec columns; > 1: streamed, not held

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.group

    @property
    def grid(self) -> int:
        return -(-self.R // self.rows_per_block)

    @property
    def warps_per_group(self) -> int:
        return max(1, self.group // self.warp)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(R: int, C: int, vec: int, warp: int = 32, threads: int = 256, max_elems: int = 32,
         max_threads: int = 1024, min_block_group: int = 64, pref_elems: int = 16) -> Plan | None:
    """A group per row holding about `pref_elems` (at most `max_elems`) elements per thread;
    None when the row does not fit in `max_threads` threads' registers. `vec` must divide C.
    (H200, 2026-12-01: 4 vectors of 4 per thread ran 2 % faster than 8 or 1.)"""
    assert C % vec == 0
    n_vec = C // vec
    group = _pow2(-(-n_vec // max(1, pref_elems // vec)))
    if group > max_threads:
        group = _pow2(-(-n_vec // max(1, max_elems // vec)))
    if group > max_threads:  # too long to hold: stream chunks, each pass reads the row again
        slots = max(1, pref_elems // vec)
        return Plan(R, C, vec, max_threads, slots, max_threads, warp, -(-n_vec // (slots * max_threads)))
    if group <= warp:  # short rows: a warp or part of one, as many lanes as the row has vectors
        group = min(warp, _pow2(n_vec))
    else:
        group = max(group, min(min_block_group, _pow2(n_vec)))
    return Plan(R, C, vec, group, -(-n_vec // group), group if group > warp else threads, warp)


class _Chunk:
    """The full and per-column values of `slots` vectors of `vec` columns per thread at `cols`
    (one chunk: the whole row in registers; streaming: one loop iteration), computed on demand
    from the leaves; per-row values come from `vals`."""

    def __init__(self, b: Any, nodes: Sequence[Node], vals: dict[int, Any], row: Any, cols: list[Any],
                 in_row: list[Any], valid: list[Any], vec: int):
        self.b, self.nodes, self.vals, self.row, self.vec = b, nodes, vals, row, vec
        self.cols, self.in_row, self.valid = cols, in_row, valid
        self.local: dict[int, list[list[Any]]] = {}

    def arg(self, n: int, s: int, e: int) -> Any:
        return self.get(n)[s][e] if self.nodes[n].space in PER_COLUMN else self.vals[n]

    def get(self, n: int) -> list[list[Any]]:
        if n not in self.local:
            nd, b = self.nodes[n], self.b
            if nd.op == "load":
                self.local[n] = [b.load(n, self.row, c, self.vec, r if nd.space == "col" else v)
                                 for c, r, v in zip(self.cols, self.in_row, self.valid)]
            else:
                self.local[n] = [[b.compute(n, [self.arg(a, s, e) for a in nd.args]) for e in range(self.vec)]
                                 for s in range(len(self.cols))]
        return self.local[n]

    def elements(self, i: int) -> list[Any]:
        """Reduction i's element values, the identity where a column lies past the row."""
        b, out = self.b, []
        for s, v in enumerate(self.valid):
            for e in range(self.vec):
                x = b.element(i, [self.arg(a, s, e) for a in self.nodes[i].args])
                out.append(x if v is None else b.select(v, x, b.identity(i)))
        return out


def kernel(b: Any, p: Plan, nodes: Sequence[Node]) -> None:
    # 1. locate
    tid, bid = b.tid(), b.bid(0)
    if p.rows_per_block > 1:
        row, lane = b.add(b.mul(bid, p.rows_per_block), b.div(tid, p.group)), b.rem(tid, p.group)
    else:
        row, lane = bid, tid
    active = None if p.R % p.rows_per_block == 0 else b.lt(row, p.R)
    span = p.slots * p.group * p.vec  # columns per chunk

    def chunk(base: Any, exact: bool) -> _Chunk:
        cols, in_row, valid = [], [], []
        for s in range(p.slots):
            off = b.mul(b.add(lane, s * p.group), p.vec)
            cols.append(off if base is None else b.add(base, off))
            ragged = not exact and (base is not None or ((s + 1) * p.group - 1) * p.vec >= p.C)
            in_row.append(b.lt(cols[s], p.C) if ragged else None)  # some lane's vector may lie past C
            cond = in_row[s]
            valid.append(cond if active is None else active if cond is None else b.and_(active, cond))
        return _Chunk(b, nodes, vals, row, cols, in_row, valid, p.vec)

    vals: dict[int, Any] = {}  # row/scalar values
    pending: list[int] = []  # reductions (and picks) waiting for the block barrier
    regs = chunk(None, False) if p.trips == 1 else None  # the row, in registers
    exact = p.C % span == 0

    def each_chunk(inits: list[Any], body) -> list[Any]:
        """body(chunk, accs) -> accs over the row: once, or a loop of `trips` chunks."""
        if regs is not None:
            return body(regs, inits)
        return b.for_(0, p.trips, 1, inits, [None] * len(inits),
                      lambda it, accs: body(chunk(b.mul(it, span), exact), accs))

    def resolve() -> None:  # one barrier for every pending block reduction
        b.barrier()
        for j in pending:
            vals[j] = _finish_block(b, p, nodes[j], j, vals)
            if nodes[j].out:
                _store_row(b, j, vals[j], row, lane, active)
        pending.clear()

    # 2. nodes in order
    for i, nd in enumerate(nodes):
        if any(a in pending for a in (*nd.args, *([nd.init] if nd.init is not None else []))):
            resolve()
        if nd.space in PER_COLUMN:
            if regs is not None:  # computed now (loads issued in node order), kept in registers
                regs.get(i)
        elif nd.op == "load":
            vals[i] = b.load(i, row, None, 1, active if nd.space == "row" else None)[0]
        elif nd.op == "map":
            vals[i] = b.compute(i, [vals[a] for a in nd.args])
        elif nd.op == "pick" and regs is None:  # streaming: every thread computes that column
            one = _Chunk(b, nodes, vals, row, [b.const(nd.at)], [None], [active], 1)
            vals[i] = one.get(nd.args[0])[0][0]
        elif nd.op == "pick":  # the owner lane's register, to the whole group
            slot, rest = divmod(nd.at, p.vec * p.group)
            owner, e = divmod(rest, p.vec)
            v = regs.get(nd.args[0])[slot][e]
            if p.group <= p.warp:
                src = b.add(b.mul(b.div(b.rem(tid, p.warp), p.group), p.group), owner)
                vals[i] = b.shuffle_idx(v, src, p.warp)
            else:
                b.when(b.eq(tid, owner), lambda v=v, i=i: b.smem_put(i, b.const(0), v))
                pending.append(i)
        else:
            # 3. reduce: per thread, per warp, then the block (after one barrier)
            (total,) = each_chunk([b.identity(i)], lambda c, accs, i=i: [
                _tree(b, i, [accs[0]] + c.elements(i)) if regs is None else _tree(b, i, c.elements(i))])
            for off in (16, 8, 4, 2, 1):
                if off < min(p.group, p.warp):
                    total = b.combine(i, total, b.shuffle_xor(total, off, p.warp))
            if p.group > p.warp:
                warp_id = b.div(tid, p.warp)
                b.when(b.eq(b.rem(tid, p.warp), 0), lambda t=total, w=warp_id, i=i: b.smem_put(i, w, t))
                pending.append(i)
            else:
                vals[i] = b.finish(i, total, vals[nd.init] if nd.init is not None else None)
        # 4. store: row values right away, full values at the end
        if nd.out and nd.space != "full" and i not in pending:
            _store_row(b, i, vals[i], row, lane, active)
    if pending:  # outputs nothing reads
        resolve()
    outs = [i for i, nd in enumerate(nodes) if nd.out and nd.space == "full"]
    if outs:
        def store(c: _Chunk, accs: list[Any]) -> list[Any]:
            for i in outs:
                for s, v in enumerate(c.get(i)):
                    b.store(i, row, c.cols[s], v, c.valid[s])
            return []
        each_chunk([], store)


def _tree(b: Any, i: int, xs: list[Any]) -> Any:
    while len(xs) > 1:
        xs = [b.combine(i, xs[k], xs[k + 1]) if k + 1 < len(xs) else xs[k] for k in range(0, len(xs), 2)]
    return xs[0]


def _finish_block(b: Any, p: Plan, nd: Node, i: int, vals: dict[int, Any]) -> Any:
    if nd.op == "pick":
        return b.smem_get(i, 0)
    total = _tree(b, i, [b.smem_get(i, w) for w in range(p.warps_per_group)])
    return b.finish(i, total, vals[nd.init] if nd.init is not None else None)


def _store_row(b: Any, i: int, v: Any, row: Any, lane: Any, active: Any) -> None:
    lead = b.eq(lane, 0)
    b.store(i, row, None, [v], lead if active is None else b.and_(lead, active))


# --------------------------------------------------------------------------------------------
# numpy: one block at a time, threads in lockstep


_NP_COMBINE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
_NP_IDENTITY = {"add": 0.0, "mul": 1.0, "max": -math.inf, "min": math.inf}


@dataclass
class Math:
    """A node's numpy semantics: `fn` maps argument arrays (map: the value; reduce: the
    element), `kind` a reduction's combiner, `init` its constant start, `data` a load's array
    (flat: R*C, R, C or 1 elements; `other`: any, read at index(r * C + c)), `acc` the type
    values are rounded to."""

    fn: Callable[..., np.ndarray] | None = None
    kind: str = "add"
    init: float = 0.0
    data: np.ndarray | None = None
    acc: str = "f32"
    index: Callable[[np.ndarray], np.ndarray] | None = None  # `other` load: element -> data index


class _Numpy(Numpy):
    def __init__(self, p: Plan, nodes: Sequence[Node], math_: Sequence[Math], outs: dict[int, np.ndarray],
                 block: int, smem: dict[int, Smem]):
        super().__init__(p.threads, (block, 0, 0))
        self.p, self.nodes, self.m, self.outs, self.smem = p, nodes, math_, outs, smem

    def _flat(self, n: int, row: Any, col: Any, e: int) -> np.ndarray:
        space = self.nodes[n].space
        if space == "full":
            return row * self.p.C + col + e
        if space == "other":
            return self.m[n].index(row * self.p.C + col + e)  # type: ignore[misc]
        return row if space == "row" else col + e if space == "col" else self.const(0)

    def load(self, n: int, row: Any, col: Any, vec: int, cond: Any) -> list[np.ndarray]:
        data, out = self.m[n].data, []
        saved = self.mask
        self.mask = saved if cond is None else saved & cond
        try:
            for e in range(vec):
                out.append(as_type(Numpy.load(self, data, "", [self._flat(n, row, col, e)]), self.m[n].acc))
        finally:
            self.mask = saved
        return out

    def compute(self, n: int, args: list[np.ndarray]) -> np.ndarray:
        with np.errstate(all="ignore"):  # masked lanes compute on zeros
            return as_type(self.m[n].fn(*args), self.m[n].acc)  # type: ignore[misc]

    def element(self, n: int, args: list[np.ndarray]) -> np.ndarray:
        return self.compute(n, args)

    def combine(self, n: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return as_type(_NP_COMBINE[self.m[n].kind](x, y), self.m[n].acc)

    def identity(self, n: int) -> np.ndarray:
        return self.const(_NP_IDENTITY[self.m[n].kind], self.m[n].acc)

    def finish(self, n: int, total: np.ndarray, init: np.ndarray | None) -> np.ndarray:
        start = init if init is not None else self.const(self.m[n].init, self.m[n].acc)
        return self.combine(n, start, total)

    def select(self, cond, x, y, ty: str = ""):
        return np.where(cond, x, y)

    def shuffle_xor(self, x: np.ndarray, off: int, width: int) -> np.ndarray:
        return x[np.arange(self.T) ^ off]

    def shuffle_idx(self, x: np.ndarray, src: np.ndarray, width: int) -> np.ndarray:
        lanes = np.arange(self.T)
        return x[lanes - lanes % width + src % width]

    def smem_put(self, n: int, w: Any, v: np.ndarray) -> None:
        lanes = self.mask.copy()
        self.touch(self.smem[n], [w], 1, True, lanes)
        self.smem[n].data[np.asarray(w)[lanes]] = v[lanes]

    def smem_get(self, n: int, w: int) -> np.ndarray:
        return self.smem_load(self.smem[n], [self.const(w)])

    def store(self, n: int, row: Any, col: Any, vals: list[np.ndarray], cond: Any) -> None:  # type: ignore[override]
        saved = self.mask
        self.mask = saved if cond is None else saved & cond
        try:
            for e, v in enumerate(vals):
                Numpy.store(self, v, self.outs[n], "", [self._flat(n, row, col, e)])
        finally:
            self.mask = saved


def emulate(p: Plan, nodes: Sequence[Node], math_: Sequence[Math]) -> dict[int, np.ndarray]:
    """Run the kernel on the CPU: returns each output node's flat array (R*C or R values)."""
    outs = {i: np.full(p.R * p.C if nd.space == "full" else p.R, np.nan)
            for i, nd in enumerate(nodes) if nd.out}
    for block in range(p.grid):
        smem = {i: Smem(f"red{i}", (p.warps_per_group,), np.float64)
                for i, nd in enumerate(nodes) if nd.op in ("reduce", "pick")}
        kernel(_Numpy(p, nodes, math_, outs, block, smem), p, nodes)
    return outs

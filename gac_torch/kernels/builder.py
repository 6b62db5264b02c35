"""One kernel builder: a kernel body is a Python function of a builder `b`, written once, that
either emits MLIR text (`Text`) or runs on the CPU with numpy (`Numpy`: all threads of one block
in lockstep, memory accesses bounds-checked, shared-memory races checked against the barriers).
A kernel whose math is cloned from a linalg body (reduce) builds ops through the MLIR Python
bindings instead of text (`Ir`, same verbs). A kernel file subclasses them with its own verbs
(e.g. cuda_mma's `mma`, reduce's `element` / `combine`).

Values: `Text` returns SSA names (`V`, a str); `Numpy` returns one numpy array per value with a
lane per thread. Index values support `+ - * // % < &` in both, so index math reads like math:
`row = m0 + (wrow + (g + 16 * i))` (ints become constants). Control flow takes callables:
`b.if_(cond, ty, then, else_)` (a value per lane), `b.when(cond, then)`, `b.for_(lo, hi, step,
inits, types, body)`; the numpy backend runs `then` under a lane mask and loops in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gac_torch.errors import GacError

WORKGROUP = "#gpu.address_space<workgroup>"


class RaceError(GacError, AssertionError):
    """A shared-memory access races with another thread's since the last barrier."""


# --------------------------------------------------------------------------------------------
# backend 1: MLIR text


class V(str):
    """An SSA value of the text builder; index arithmetic through operators."""

    b: Text

    def _o(self, x: Any) -> str:
        return self.b.const(x) if isinstance(x, int) else x

    def __add__(self, x):  # type: ignore[override]
        return self.b.add(self, self._o(x))

    def __radd__(self, x):
        return self.b.add(self._o(x), self)

    def __sub__(self, x):
        return self.b.sub(self, self._o(x))

    def __mul__(self, x):  # type: ignore[override]
        return self.b.mul(self, self._o(x))

    def __rmul__(self, x):  # type: ignore[override]
        return self.b.mul(self._o(x), self)

    def __floordiv__(self, x):
        return self.b.div(self, self._o(x))

    def __mod__(self, x):  # type: ignore[override]
        return self.b.rem(self, self._o(x))

    def __lt__(self, x):  # type: ignore[override]
        return self.b.lt(self, self._o(x))

    def __and__(self, x):
        return self.b.and_(self, x)

    __hash__ = str.__hash__


class Text:
    """Emits MLIR text lines; `const` reuses one constant per value in the current scope (a
    loop body opens a scope: constants defined inside stay inside). `hoist`: every constant goes
    to `const_lines` instead, which the template puts at the top of the kernel."""

    def __init__(self, hoist: bool = False) -> None:
        self.lines: list[str] = []
        self.const_lines: list[str] = []
        self.hoist = hoist
        self.n = 0
        self.consts: dict[tuple[Any, str], V] = {}

    def val(self, name: str) -> V:
        v = V(name)
        v.b = self
        return v

    def fresh(self) -> V:
        self.n += 1
        return self.val(f"%v{self.n}")

    def w(self, line: str) -> None:
        self.lines.append(line)

    def const(self, x: int | float, ty: str = "index") -> V:
        key = (x, ty)
        if key not in self.consts:
            name = self.fresh()
            (self.const_lines if self.hoist else self.lines).append(f"{name} = arith.constant {x} : {ty}")
            self.consts[key] = name
        return self.consts[key]

    def tid(self) -> V:
        return self.val("%tid")

    def bid(self, axis: int) -> V:
        return self.val(("%bx", "%by", "%bz")[axis])

    def binop(self, op: str, x: str, y: str, ty: str = "index", attr: str = "") -> V:
        r = self.fresh()
        self.w(f"{r} = {op} {x}, {y}{attr} : {ty}")
        return r

    def add(self, x: str, y: str) -> V:
        return self.binop("arith.addi", x, y)

    def sub(self, x: str, y: str) -> V:
        return self.binop("arith.subi", x, y)

    def mul(self, x: str, y: str) -> V:
        return self.binop("arith.muli", x, y)

    def div(self, x: str, y: str) -> V:
        return self.binop("arith.divui", x, y)

    def rem(self, x: str, y: str) -> V:
        return self.binop("arith.remui", x, y)

    def lt(self, x: str, y: str) -> V:
        r = self.fresh()
        self.w(f"{r} = arith.cmpi ult, {x}, {y} : index")
        return r

    def eq(self, x: str, y: str) -> V:
        r = self.fresh()
        self.w(f"{r} = arith.cmpi eq, {x}, {y} : index")
        return r

    def and_(self, x: str, y: str) -> V:
        return self.binop("arith.andi", x, y, "i1")

    def min_(self, x: str, y: str) -> V:
        return self.binop("arith.minui", x, y)

    def select(self, cond: str, x: str, y: str, ty: str) -> V:
        r = self.fresh()
        self.w(f"{r} = arith.select {cond}, {x}, {y} : {ty}")
        return r

    def fma(self, x: str, y: str, z: str, ty: str) -> V:
        r = self.fresh()
        self.w(f"{r} = math.fma {x}, {y}, {z} : {ty}")
        return r

    def cast(self, op: str, x: str, src: str, dst: str) -> V:
        r = self.fresh()
        self.w(f"{r} = {op} {x} : {src} to {dst}")
        return r

    def load(self, buf: str, ty: str, idx: Sequence[str]) -> V:
        r = self.fresh()
        self.w(f"{r} = memref.load {buf}[{', '.join(idx)}] : {ty}")
        return r

    def store(self, val: str, buf: str, ty: str, idx: Sequence[str]) -> None:
        self.w(f"memref.store {val}, {buf}[{', '.join(idx)}] : {ty}")

    # Named buffers: a kernel's `types` maps a name (A, B, C, As, ...) to its memref type; the
    # template's function arguments and workgroup buffers are %<name>.
    types: dict[str, str]

    def get(self, which: str, idx: Sequence[str]) -> V:
        return self.load(f"%{which}", self.types[which], idx)

    def put(self, which: str, idx: Sequence[str], val: str) -> None:
        self.store(val, f"%{which}", self.types[which], idx)

    def barrier(self) -> None:
        self.w("gpu.barrier")

    def if_(self, cond: str, ty: str, then: Callable[[], str], else_: Callable[[], str]) -> V:
        r = self.fresh()
        self.w(f"{r} = scf.if {cond} -> ({ty}) {{")
        self._scoped(lambda: self.w(f"scf.yield {then()} : {ty}"))
        self.w("} else {")
        self._scoped(lambda: self.w(f"scf.yield {else_()} : {ty}"))
        self.w("}")
        return r

    def when(self, cond: str, then: Callable[[], None]) -> None:
        self.w(f"scf.if {cond} {{")
        self._scoped(then)
        self.w("}")

    def for_(self, lo: str, hi: str, step: str, inits: Sequence[str], types: Sequence[str],
             body: Callable[[V, list[V]], Sequence[str]]) -> list[V]:
        res = self.fresh()
        iv = self.val(f"%iv{self.n}")
        iters = [self.val(f"%it{self.n}_{i}") for i in range(len(inits))]
        self.w(f"{res}:{len(inits)} = scf.for {iv} = {lo} to {hi} step {step} iter_args("
               + ", ".join(f"{a} = {v}" for a, v in zip(iters, inits)) + f") -> ({', '.join(types)}) {{")
        out: list[Sequence[str]] = []
        self._scoped(lambda: out.append(body(iv, iters)))
        self.w(f"scf.yield {', '.join(out[0])} : {', '.join(types)}\n}}")
        return [self.val(f"{res}#{i}") for i in range(len(inits))]

    def _scoped(self, fn: Callable[[], Any]) -> None:
        if self.hoist:
            return fn()
        saved = self.consts
        self.consts = dict(saved)  # constants defined inside a region stay inside
        try:
            fn()
        finally:
            self.consts = saved


def delinearize(b: Any, lin: Any, extents: Sequence[Any]) -> list[Any]:
    """Row-major indices of `lin` in a box of `extents` (last fastest; ints or values);
    lin < prod(extents)."""
    out: list[Any] = []
    for pos in range(len(extents) - 1, -1, -1):
        n = extents[pos]
        if isinstance(n, int) and n == 1:
            out.append(b.const(0))
        elif pos == 0:
            out.append(lin)
        else:
            out.append(b.rem(lin, n))
            lin = b.div(lin, n)
    return out[::-1]


# --------------------------------------------------------------------------------------------
# backend 2: numpy, one block at a time, threads in lockstep

_INT_BITS = {"i1": 1, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "index": 64}


def round_to(x: np.ndarray, elem: str) -> np.ndarray:
    """Float values rounded to `elem` (round to nearest even; tf32: ties away, as cvt.rna),
    returned as f32 (f64 stays f64)."""
    if elem == "f64":
        return np.asarray(x, dtype=np.float64)
    x = np.asarray(x, dtype=np.float32)
    if elem == "f32":
        return x
    if elem == "f16":
        return x.astype(np.float16).astype(np.float32)
    keep = 16 if elem == "bf16" else 13  # bf16: 16 low bits dropped; tf32: 13
    u = x.view(np.uint32).astype(np.uint64)
    if elem == "bf16":  # round to nearest even
        u = u + np.uint64(0x7FFF) + ((u >> np.uint64(keep)) & np.uint64(1))
    else:  # tf32 cvt.rna: round to nearest, ties away from zero
        u = u + np.uint64(1 << (keep - 1))
    u = (u >> np.uint64(keep)) << np.uint64(keep)
    return (u & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)


def as_type(x: np.ndarray, ty: str, signed: bool = True) -> np.ndarray:
    """Values as a device register of MLIR type `ty` holds them: floats rounded, ints wrapped."""
    if ty in ("f16", "bf16", "f32", "f64", "tf32"):
        return round_to(np.asarray(x, dtype=np.float64), ty)
    bits = _INT_BITS[ty]
    v = np.asarray(np.trunc(x) if np.asarray(x).dtype.kind == "f" else x).astype(np.int64)
    if bits == 64:
        return v
    v = v & ((1 << bits) - 1)
    return np.where(signed & (v >= (1 << (bits - 1))), v - (1 << bits), v) if bits > 1 else v


class Smem:
    """A shared-memory buffer that records, per element, who touched it since the last barrier."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any = np.float32):
        self.name = name
        self.data = np.full(shape, np.nan, dtype=dtype)
        self.w_epoch = np.full(shape, -1)
        self.w_tid = np.full(shape, -1)
        self.r_epoch = np.full(shape, -1)
        self.r_tid = np.full(shape, -1)  # -2: several readers


class Numpy:
    """The same verbs on numpy arrays, one lane per thread of block `block`."""

    def __init__(self, threads: int, block: tuple[int, int, int]):
        self.T = threads
        self.block = block
        self.epoch = 0
        self.mask = np.ones(threads, dtype=bool)  # lanes inside every enclosing scf.if

    def const(self, x: int | float, ty: str = "index") -> np.ndarray:
        dtype = np.int64 if ty in _INT_BITS else np.float64 if ty == "f64" else np.float32
        return np.full(self.T, x, dtype=dtype)

    def tid(self) -> np.ndarray:
        return np.arange(self.T, dtype=np.int64)

    def bid(self, axis: int) -> np.ndarray:
        return self.const(self.block[axis])

    def add(self, x, y):
        return x + y

    def sub(self, x, y):
        return x - y

    def mul(self, x, y):
        return x * y

    def div(self, x, y):
        return x // y

    def rem(self, x, y):
        return x % y

    def lt(self, x, y):
        return x < y

    def eq(self, x, y):
        return x == y

    def min_(self, x, y):
        return np.minimum(x, y)

    def select(self, cond, x, y, ty: str):
        return np.where(cond, x, y)

    def fma(self, x, y, z, ty: str):  # one rounding, as the instruction
        return as_type(np.asarray(x, np.float64) * y + z, ty)

    def and_(self, x, y):
        return x & y

    def cast(self, op: str, x: np.ndarray, src: str, dst: str) -> np.ndarray:
        return as_type(x, dst, signed=op not in ("arith.uitofp", "arith.extui", "arith.fptoui"))

    def load(self, buf: np.ndarray, ty: str, idx: Sequence[np.ndarray]) -> np.ndarray:
        on = self.mask
        at = tuple(np.where(on, x, 0) for x in idx)
        if on.any():
            assert all(((a[on] >= 0) & (a[on] < s)).all() for a, s in zip(at, buf.shape)), "load out of bounds"
        return np.where(on, buf[at], 0)

    def store(self, val: np.ndarray, buf: np.ndarray, ty: str, idx: Sequence[np.ndarray]) -> None:
        on = self.mask
        at = tuple(np.asarray(x)[on] for x in idx)
        assert all(((a >= 0) & (a < s)).all() for a, s in zip(at, buf.shape)), "store out of bounds"
        flat = np.ravel_multi_index(at, buf.shape)
        assert len(np.unique(flat)) == len(flat), "two threads store one element"
        buf[at] = np.asarray(val)[on]

    def touch(self, s: Smem, idx: Sequence[np.ndarray], n: int, write: bool,
              lanes: np.ndarray | None = None) -> list[tuple]:
        """The cells lanes access at idx (+0..n-1 in the last dim), race-checked; `lanes`: only
        these lanes access (default: all)."""
        sel = np.ones(self.T, dtype=bool) if lanes is None else lanes
        tids = np.arange(self.T)[sel]
        idx = [np.broadcast_to(np.asarray(x), (self.T,))[sel] for x in idx]
        cells = []
        for i in range(n):
            at = tuple(idx[:-1]) + (idx[-1] + i,)
            for d, (a, ext) in enumerate(zip(at, s.data.shape)):
                if ((a < 0) | (a >= ext)).any():
                    raise AssertionError(f"smem {s.name} index {d} out of range")
            cells.append(at)
            e = self.epoch
            if write:
                flat = np.ravel_multi_index(at, s.data.shape)
                if len(np.unique(flat)) != len(flat):
                    raise RaceError(f"smem {s.name}: two threads write one element in one store")
                bad = (s.r_epoch[at] == e) & (s.r_tid[at] != tids)
                bad |= (s.w_epoch[at] == e) & (s.w_tid[at] != tids)
                if bad.any():
                    raise RaceError(f"smem {s.name}: write races with another thread since the barrier")
                s.w_epoch[at], s.w_tid[at] = e, tids
            else:
                if ((s.w_epoch[at] == e) & (s.w_tid[at] != tids)).any():
                    raise RaceError(f"smem {s.name}: read of an element another thread wrote since the barrier")
                same = (s.r_epoch[at] == e) & (s.r_tid[at] != tids)
                s.r_tid[at] = np.where(same, -2, tids)
                s.r_epoch[at] = e
        return cells

    # Named buffers: `bufs` (global arrays) and `S` (shared memory), as the text backend's types.
    bufs: dict[str, np.ndarray]
    S: dict[str, Smem]

    def get(self, which: str, idx: Sequence[np.ndarray]) -> np.ndarray:
        if which in self.S:
            return self.smem_load(self.S[which], idx)
        return self.load(self.bufs[which], "", idx)

    def put(self, which: str, idx: Sequence[np.ndarray], val: np.ndarray) -> None:
        if which in self.S:
            self.smem_store(self.S[which], idx, val)
        else:
            self.store(val, self.bufs[which], "", idx)

    def smem_store(self, s: Smem, idx: Sequence[np.ndarray], val: np.ndarray, vec: int = 1) -> None:
        assert self.mask.all(), "shared-memory stores are unconditional in these kernels"
        val = val if vec > 1 else np.asarray(val)[:, None]
        for i, at in enumerate(self.touch(s, idx, vec, True)):
            s.data[at] = val[:, i]

    def smem_load(self, s: Smem, idx: Sequence[np.ndarray], vec: int = 1) -> np.ndarray:
        cells = self.touch(s, idx, vec, False)
        vals = np.stack([s.data[at] for at in cells], axis=1)
        if np.isnan(vals).any():
            raise AssertionError(f"smem {s.name}: read of an element never written")
        return vals if vec > 1 else vals[:, 0]

    def barrier(self) -> None:
        assert self.mask.all(), "a barrier inside divergent control flow"
        self.epoch += 1

    def if_(self, cond: np.ndarray, ty: str, then: Callable[[], Any], else_: Callable[[], Any]) -> np.ndarray:
        saved = self.mask
        try:
            self.mask = saved & cond
            t = then()
            self.mask = saved & ~cond
            e = else_()
        finally:
            self.mask = saved
        return np.where(cond, t, e)

    def when(self, cond: np.ndarray, then: Callable[[], None]) -> None:
        saved = self.mask
        self.mask = saved & cond
        try:
            then()
        finally:
            self.mask = saved

    def for_(self, lo, hi, step, inits: Sequence[np.ndarray], types: Sequence[str],
             body: Callable[[np.ndarray, list[np.ndarray]], Sequence[np.ndarray]]) -> list[np.ndarray]:
        bounds = [int(np.asarray(x).flat[0]) for x in (lo, hi, step)]  # uniform trip counts
        iters = list(inits)
        for i in range(*bounds):
            iters = list(body(self.const(i), iters))
        return iters


# --------------------------------------------------------------------------------------------
# backend 3: MLIR ops through the Python bindings, at the current insertion point


class Ir:
    """Values are ir.Values; ints become index constants where an index is expected (a new
    constant each time: CSE merges them). `ids` are the gpu.launch body's block and thread ids."""

    def __init__(self, ids: Sequence[Any] = ()):
        from mlir import ir
        from mlir.dialects import arith, scf

        self.ir, self.arith, self.scf = ir, arith, scf
        self.ids = list(ids)

    def _i(self, x: Any) -> Any:
        return self.const(x) if isinstance(x, int) else x

    def const(self, x: int | float, ty: str = "index") -> Any:
        t = self.ir.IndexType.get() if ty == "index" else self.ir.Type.parse(ty)
        return self.arith.constant(t, x)

    def tid(self) -> Any:
        return self.ids[3]

    def bid(self, axis: int) -> Any:
        return self.ids[axis]

    def add(self, x, y):
        return self.arith.addi(self._i(x), self._i(y))

    def sub(self, x, y):
        return self.arith.subi(self._i(x), self._i(y))

    def mul(self, x, y):
        return self.arith.muli(self._i(x), self._i(y))

    def div(self, x, y):
        return self.arith.divui(self._i(x), self._i(y))

    def rem(self, x, y):
        return self.arith.remui(self._i(x), self._i(y))

    def lt(self, x, y):
        return self.arith.cmpi(self.arith.CmpIPredicate.ult, self._i(x), self._i(y))

    def eq(self, x, y):
        return self.arith.cmpi(self.arith.CmpIPredicate.eq, self._i(x), self._i(y))

    def and_(self, x, y):
        return self.arith.andi(x, y)

    def if_(self, cond: Any, ty: Any, then: Callable[[], Any], else_: Callable[[], Any]) -> Any:
        op = self.scf.IfOp(cond, [ty], has_else=True)
        with self.ir.InsertionPoint(op.then_block):
            self.scf.YieldOp([then()])
        with self.ir.InsertionPoint(op.else_block):
            self.scf.YieldOp([else_()])
        return op.results[0]

    def when(self, cond: Any, then: Callable[[], None]) -> None:
        op = self.scf.IfOp(cond)
        with self.ir.InsertionPoint(op.then_block):
            then()
            self.scf.YieldOp([])

    def for_(self, lo, hi, step, inits: Sequence[Any], types: Sequence[Any],
             body: Callable[[Any, list[Any]], Sequence[Any]]) -> list[Any]:
        loop = self.scf.ForOp(self._i(lo), self._i(hi), self._i(step), list(inits))
        with self.ir.InsertionPoint(loop.body):
            self.scf.YieldOp(list(body(loop.induction_variable, list(loop.inner_iter_args))))
        return list(loop.results)

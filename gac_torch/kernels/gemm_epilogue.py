"""Epilogue of the implicit-GEMM kernel (conv_gemm.py): an elementwise op that consumes the
contraction's result runs in the kernel's store step instead of as its own pass.

    Z[e] = body(Y[e], X1[map1(e)], X2[map2(e)], ...)      e over Y's elements, row-major

(bias, ReLU, BatchNorm-eval scale/shift, residual add, the output cast: whatever elementwise
generics follow, chained through scratch buffers, each possibly over its own reshaped view of
Y: every operand carries the iteration space its index e is taken in). Per accumulator: 1. the
value rounded to Y's type, 2. its flat index in Y delinearised into e (per space), 3. each other
operand loaded at its linear address in e (a chunk's loads before its stores, an operand
constant along M once per column), 4. the body's ops (generic MLIR form in the text
builder, a numpy table in the twin), 5. the store to Z.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels.builder import round_to

Ref = tuple  # ("arg", i) | ("op", j) | ("const", value text, type)


@dataclass(frozen=True)
class EOp:
    """One op of the body: name, operands, attribute dict text, operand types, result type."""

    name: str
    args: tuple[Ref, ...]
    attrs: str
    types: tuple[str, ...]
    result: str


@dataclass(frozen=True)
class Epilogue:
    # per body argument ("arg", i): (conv_gemm.Operand over e, e's space), None for Y itself;
    # a space None: the Operand is over the contraction's iteration dims
    inputs: tuple[tuple[Any, tuple[int, ...] | None] | None, ...]
    out: tuple[Any, tuple[int, ...] | None]  # Z, likewise
    ops: tuple[EOp, ...]
    result: Ref  # the stored value
    # an intermediate stage's value that is also a buffer of its own (a graph output the next
    # stage reads: x @ W^T + b, saved for the backward, then GELU): (value, (Operand, space));
    # the conv_gemm template only (implicit_gemm passes `taps` to fused_epilogue)
    taps: tuple[tuple[Ref, tuple[Any, tuple[int, ...] | None]], ...] = ()


def store(b: Any, spec: Any, addr: Any, val: Any, ok: Any, split: Any, lin: Any, direct: Any) -> None:
    """Steps 1-5 for one accumulator `val` at C address `addr` (Y dense: the flat index).
    Operands whose space is None are given over the contraction's own dims (a reshape that
    only merges Y's dims keeps addresses linear in them): `direct(op)` is their address, no
    delinearisation."""
    ep: Epilogue = spec.epilogue
    b.begin_if(ok)
    y = b.round_to(val, spec.c.elem)  # 1
    at = _locator(b, addr, split, lin, direct)
    args = [y if x is None else b.load_e(k, at(x)) for k, x in enumerate(ep.inputs)]  # 3
    _body_store(b, ep, args, at(ep.out), [at(t[1]) for t in ep.taps])
    b.end_if()




def store_all(b: Any, spec: Any, points: list, vals: list, places: list, col_ok: dict, split: Any,
              lin: Any, direct: Any, chunk: int) -> None:
    """`store` for every accumulator: `points` (C address, inside) per accumulator `vals` at
    (row, column) `places`; `direct(i, j)` as `store`'s `direct` there. Loads go first, without
    branches (addresses outside moved to element 0): a load after a store could read what it
    wrote, so each waited for the stores before it (one memory latency per accumulator).
    Accumulators go by pairs of columns, `chunk` at a time: operands constant along M (a bias,
    BatchNorm's per-channel parameters) are loaded once per column (`col_ok`: inside N), the
    others per accumulator."""
    ep: Epilogue = spec.epilogue
    zero = b.const(0)
    per_col = [x is not None and x[1] is None and all(x[0].coef[d] == 0 for d in spec.ms) for x in ep.inputs]
    order = sorted(range(len(vals)), key=lambda n: (places[n][1] // 2, n))
    col_args: dict[tuple[int, int], Any] = {}
    for s in range(0, len(order), chunk):
        part = order[s:s + chunk]
        outs, args, taps = {}, {}, {}
        for n in part:
            (addr, ok), (i, j) = points[n], places[n]
            at = _locator(b, addr, split, lin, direct(i, j))
            for k, x in enumerate(ep.inputs):
                if per_col[k] and (k, j) not in col_args:
                    col_args[k, j] = b.load_e(k, b.select(col_ok[j], at(x), zero, "index"))
            args[n] = [None if x is None else col_args[k, j] if per_col[k] else
                       b.load_e(k, b.select(ok, at(x), zero, "index")) for k, x in enumerate(ep.inputs)]  # 3
            outs[n] = at(ep.out)
            taps[n] = [at(t[1]) for t in ep.taps]
        for n in part:
            b.begin_if(points[n][1])
            y = b.round_to(vals[n], spec.c.elem)  # 1
            _body_store(b, ep, [y if v is None else v for v in args[n]], outs[n], taps[n])
            b.end_if()


def _locator(b: Any, addr: Any, split: Any, lin: Any, direct: Any) -> Any:
    """Operand (Operand, space) -> its address for the accumulator at flat index `addr`."""
    spaces: dict[tuple[int, ...], Any] = {}

    def at(x: tuple[Any, tuple[int, ...] | None]) -> Any:
        op, shape = x
        if shape is None:
            return direct(op)
        dims = tuple(range(len(shape)))
        if shape not in spaces:
            spaces[shape] = split(b, addr, dims, shape)  # 2
        return lin(b, op, spaces[shape], dims, b.const(op.const))

    return at


def _body_store(b: Any, ep: Epilogue, args: list, out: Any, taps: list | None = None) -> None:
    results: list[Any] = []

    def value(r: Ref) -> Any:
        return args[r[1]] if r[0] == "arg" else results[r[1]] if r[0] == "op" else b.econst(r[1], r[2])

    for op in ep.ops:  # 4
        results.append(b.eop(op, [value(r) for r in op.args]))
    for t, ((ref, x), addr) in enumerate(zip(ep.taps, taps or [])):
        b.store_e(addr, value(ref), t)  # (an intermediate stage's own buffer)
    b.store_e(out, value(ep.result))  # 5


# --------------------------------------------------------------------------------------------
# the twin's op table (f32 arrays holding values of the op's type)

_CMPF = {1: np.equal, 2: np.greater, 3: np.greater_equal, 4: np.less, 5: np.less_equal,
         6: np.not_equal}
_BIN = {"arith.addf": np.add, "arith.subf": np.subtract, "arith.mulf": np.multiply,
        "arith.divf": np.divide, "arith.maximumf": np.maximum, "arith.minimumf": np.minimum,
        "arith.maxnumf": np.fmax, "arith.minnumf": np.fmin}
_UN = {"arith.negf": np.negative, "math.sqrt": np.sqrt, "math.rsqrt": lambda x: 1 / np.sqrt(x),
       "math.exp": np.exp, "math.tanh": np.tanh, "math.absf": np.abs}


def _elem(t: str) -> str:
    return t if t in ("f16", "bf16") else "f32"


def eval_op(op: EOp, ins: list[np.ndarray]) -> np.ndarray:
    with np.errstate(all="ignore"):
        x = [np.asarray(v, np.float64) for v in ins]
        if op.name in _BIN:
            r = _BIN[op.name](x[0], x[1])
        elif op.name in _UN:
            r = _UN[op.name](x[0])
        elif op.name in ("arith.extf", "arith.truncf"):
            r = x[0]
        elif op.name == "arith.select":
            r = np.where(ins[0].astype(bool), x[1], x[2])
        elif op.name == "arith.cmpf":
            pred = int(op.attrs.split("predicate = ")[1].split(" ")[0])
            unordered = np.isnan(x[0]) | np.isnan(x[1])
            if pred == 14:  # uno
                return unordered
            if pred == 7:  # ord
                return ~unordered
            base = _CMPF.get(pred if pred < 8 else pred - 7)
            if base is None:
                raise NotImplementedError(f"cmpf predicate {pred} in the twin")
            return base(x[0], x[1]) | (unordered if pred >= 8 else False)
        else:
            raise NotImplementedError(f"{op.name} in the epilogue twin")
    return round_to(r.astype(np.float32), _elem(op.result))


class TextMixin:
    """The text builder's epilogue verbs (mixed into conv_gemm_text._Text)."""

    def begin_if(self, ok: str) -> None:
        self.w(f"scf.if {ok} {{")
        self._saved = self.consts
        self.consts = dict(self.consts)  # constants made inside stay inside

    def end_if(self) -> None:
        self.consts = self._saved
        self.w("}")

    def true(self) -> str:
        """The i1 constant true (a hoisting builder: defined once at the top)."""
        if ("true", "i1") not in self.consts:
            self.const_lines.append("%true = arith.constant true")
            self.consts[("true", "i1")] = self.val("%true")
        return self.consts[("true", "i1")]

    def round_to(self, val: str, elem: str) -> str:
        if elem == "f32":
            return val
        r = self.fresh()
        self.w(f"{r} = arith.truncf {val} : f32 to {elem}")
        return r

    def load_e(self, k: int, addr: str) -> str:
        r = self.fresh()
        self.w(f"{r} = memref.load %E{k}f[{addr}] : {self.spec.epilogue.inputs[k][0].flat}")
        return r

    def econst(self, value: str, ty: str) -> str:
        r = self.fresh()
        self.w(f"{r} = arith.constant {value} : {ty}" if ":" not in value else f"{r} = arith.constant {value}")
        return r

    def eop(self, op: EOp, ins: list[str]) -> str:
        r = self.fresh()
        self.w(f'{r} = "{op.name}"({", ".join(ins)}) {op.attrs} : ({", ".join(op.types)}) -> {op.result}')
        return r

    def store_e(self, addr: str, val: str, tap: int | None = None) -> None:
        ep = self.spec.epilogue
        name, op = ("Zf", ep.out[0]) if tap is None else (f"T{tap}f", ep.taps[tap][1][0])
        self.w(f"memref.store {val}, %{name}[{addr}] : {op.flat}")


class NumpyMixin:
    """The twin's epilogue verbs (mixed into conv_gemm_twin._Numpy); self.E: flat inputs, self.Z."""

    emask: np.ndarray | None = None  # the epilogue's scf.if (builder.Numpy.mask is scf.if's)

    def begin_if(self, ok: np.ndarray) -> None:
        self.emask = ok

    def end_if(self) -> None:
        self.emask = None

    def round_to(self, val: np.ndarray, elem: str) -> np.ndarray:
        return round_to(val, elem)

    def load_e(self, k: int, addr: np.ndarray) -> np.ndarray:
        buf = self.E[k]
        mask = np.ones(self.T, bool) if self.emask is None else self.emask
        at = np.where(mask, addr, 0)
        assert ((at >= 0) & (at < buf.size)).all(), "epilogue load out of bounds"
        return np.where(mask, buf[at], 0.0).astype(np.float32)

    def econst(self, value: str, ty: str) -> np.ndarray:
        text = value.split(":")[0].strip()
        v = np.uint32(int(text, 16)).view(np.float32) if text.startswith("0x") else np.float32(text)
        return np.full(self.T, v, np.float32)

    def eop(self, op: EOp, ins: list[np.ndarray]) -> np.ndarray:
        return eval_op(op, ins)

    def store_e(self, addr: np.ndarray, val: np.ndarray, tap: int | None = None) -> None:
        ep = self.spec.epilogue
        buf, op = (self.Z, ep.out[0]) if tap is None else (self.taps[tap], ep.taps[tap][1][0])
        at = addr[self.emask]
        assert ((at >= 0) & (at < buf.size)).all(), "epilogue store out of bounds"
        assert len(np.unique(at)) == len(at), "two threads store one Z element"
        buf[at] = round_to(val[self.emask], op.elem)

"""Run-time sizes: torch's symbolic sizes (sympy expressions over s0, s1, ...) as gac index values.

A graph traced with symbolic shapes (dynamo `dynamic=True` / `mark_dynamic`, export `Dim`s) keeps
each size as a sympy expression. gac types mark those dims `?`; where an op needs the size itself
(reshape, broadcast) the legalizer asks this table for an index Value. Symbols are bound once at
the function entry, to a scalar size argument or to `gac.dim` of an input that has the bare symbol
as one of its dims; expressions over them become `arith` index math (CSE'd by expression).
"""

from __future__ import annotations

import sympy
import torch
from mlir import ir
from mlir.dialects import arith
from torch.utils._sympy import functions as symfn
from gac_torch.errors import GacError


def _kinds(*names: str) -> tuple[type, ...]:
    """torch's sympy function classes by name (the set varies across torch versions)."""
    return tuple(getattr(symfn, n) for n in names if hasattr(symfn, n))


_FLOORDIV = _kinds("FloorDiv", "CleanDiv")
_MOD = _kinds("Mod", "PythonMod")
_MAX = (sympy.Max, *_kinds("Max"))
_MIN = (sympy.Min, *_kinds("Min"))


class SizeError(GacError, ValueError):
    """A symbolic size gac cannot evaluate at run time (names the expression)."""


def size_expr(s) -> sympy.Expr:
    """The sympy expression of an int or torch.SymInt size."""
    if isinstance(s, torch.SymInt):
        return sympy.sympify(s.node.expr)
    return sympy.Integer(int(s))


def free_symbols(shape) -> set[sympy.Symbol]:
    out: set = set()
    for s in shape:
        out |= size_expr(s).free_symbols
    return out


class SizeTable:
    """expression -> index Value, for one function being built (use inside its entry block)."""

    def __init__(self):
        self.values: dict[sympy.Expr, ir.Value] = {}

    def bind(self, expr: sympy.Expr, value: ir.Value) -> None:
        self.values.setdefault(expr, value)

    def __contains__(self, expr) -> bool:
        return expr in self.values

    def value(self, s) -> ir.Value:
        """An index Value computing the size `s` (int, SymInt or sympy expression)."""
        expr = s if isinstance(s, sympy.Basic) else size_expr(s)
        if expr not in self.values:
            self.values[expr] = self._emit(expr)
        return self.values[expr]

    def _emit(self, e: sympy.Expr) -> ir.Value:
        index = ir.IndexType.get()
        if e.is_Integer:
            return arith.ConstantOp(index, int(e)).result
        if e.is_Symbol:
            raise SizeError(f"size symbol {e} is neither a dim of an input nor a size argument")
        if isinstance(e, sympy.Add):
            return self._fold(arith.addi, e.args)
        if isinstance(e, sympy.Mul):
            return self._fold(arith.muli, e.args)
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
            return self._fold(arith.muli, [e.base] * int(e.exp))
        if isinstance(e, _FLOORDIV):
            return arith.floordivsi(self.value(e.args[0]), self.value(e.args[1]))
        if isinstance(e, _MOD):  # sizes are non-negative
            return arith.remsi(self.value(e.args[0]), self.value(e.args[1]))
        if isinstance(e, _MAX):
            return self._fold(arith.maxsi, e.args)
        if isinstance(e, _MIN):
            return self._fold(arith.minsi, e.args)
        raise SizeError(f"gac cannot compute the size {e} ({type(e).__name__}) at run time")

    def _fold(self, fn, args) -> ir.Value:
        for a in args:
            if not (a.is_Integer or a.free_symbols):
                raise SizeError(f"gac cannot compute the size term {a} at run time (not an integer)")
        vals = [self.value(a) for a in args]
        acc = vals[0]
        for v in vals[1:]:
            acc = fn(acc, v)
        return acc

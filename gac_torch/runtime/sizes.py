"""Binding size symbols from the sizes a call actually has (shared by the compiler and runtime).

A graph input's dim is a sympy expression over size symbols. A bare symbol binds directly; a
linear one (a*s + b, e.g. `s - 1` after a slice) binds its single unknown symbol by solving.
"""

from __future__ import annotations

import sympy


def linear_in(expr, symbol) -> tuple[int, int] | None:
    """(a, b) with expr == a*symbol + b for integers a != 0 and b, else None."""
    try:
        poly = sympy.Poly(expr, symbol)
    except sympy.PolynomialError:
        return None
    if poly.degree() != 1:
        return None
    a, b = poly.all_coeffs()
    if not (a.is_Integer and b.is_Integer) or a == 0:
        return None
    return int(a), int(b)


def solvable(expr, known) -> tuple[object, int, int] | None:
    """(symbol, a, b) when expr has exactly one symbol outside `known` and is linear in it."""
    if isinstance(expr, int):
        return None
    unknown = [s for s in expr.free_symbols if s not in known]
    if len(unknown) != 1 or expr.free_symbols - {unknown[0]}:
        return None
    ab = linear_in(expr, unknown[0])
    return (unknown[0], *ab) if ab else None


def bind_all(dims: list[tuple[object, int]]) -> tuple[dict, list[str]]:
    """Solves (expr, actual size) pairs for their symbols: bare symbols first, then linear ones.
    Returns the bindings and the contradictions found (an expr whose value differs)."""
    sizes: dict = {}
    for expr, n in dims:
        if not isinstance(expr, int) and expr.is_Symbol:
            sizes.setdefault(expr, n)
    for expr, n in dims:
        found = solvable(expr, sizes)
        if found:
            sym, a, b = found
            if (n - b) % a == 0:
                sizes[sym] = (n - b) // a
    errors = []
    for expr, n in dims:
        value = expr if isinstance(expr, int) else expr.xreplace({k: sympy.Integer(v) for k, v in sizes.items()})
        if not getattr(value, "is_number", True) or int(value) != n:
            shown = value if getattr(value, "is_number", True) else "unknown"
            errors.append(f"size {expr} = {n} here, but {shown} from the other inputs")
    return sizes, errors

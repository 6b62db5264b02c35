"""Plain data <-> JSON for the host side of compiled programs (cache entries, saved artifacts).

Only dataclasses named in the caller's allowlist, and JSON's own types, come back: nothing is
pickled, nothing is imported or evaluated by name. Tuples and bytes are tagged so they return as
tuples and bytes (frozen dataclasses compare shapes as tuples).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Iterable
from typing import Any

from gac_torch.errors import GacError


class PlainDataError(GacError, ValueError):
    """The data does not describe an object of the allowed types."""


def encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        return {"bytes": base64.b64encode(obj).decode()}
    if isinstance(obj, tuple):
        return {"tuple": [encode(x) for x in obj]}
    if isinstance(obj, list):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise PlainDataError(f"dict keys must be strings: {list(obj)[:3]}")
        return {"dict": {k: encode(v) for k, v in obj.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"type": type(obj).__name__,
                "fields": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    raise PlainDataError(f"cannot encode {type(obj).__name__} as plain data")


def decode(data: Any, types: Iterable[type]) -> Any:
    """The inverse of encode, building only the dataclasses in `types`."""
    allowed = {t.__name__: t for t in types}

    def go(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [go(v) for v in x]
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise PlainDataError(f"unexpected value {str(x)[:80]}")
        if "tuple" in x:
            return tuple(go(v) for v in x["tuple"])
        if "bytes" in x:
            return base64.b64decode(x["bytes"])
        if "dict" in x:
            return {k: go(v) for k, v in x["dict"].items()}
        cls = allowed.get(x.get("type"))
        if cls is None:
            raise PlainDataError(f"type {x.get('type')!r} is not one of {sorted(allowed)}")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = x.get("fields", {})
        if not set(fields) <= names:
            raise PlainDataError(f"{cls.__name__} has no field(s) {sorted(set(fields) - names)}")
        return cls(**{k: go(v) for k, v in fields.items()})

    return go(data)


# -- size expressions (sympy) ----------------------------------------------------------------------

def _size_classes() -> dict[str, type]:
    """The sympy classes a size expression may use: sympy's arithmetic and torch's size functions."""
    import sympy
    from torch.utils._sympy import functions as symfn

    classes: dict[str, type] = {f"sympy.{c.__name__}": c for c in (
        sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min, sympy.floor, sympy.ceiling, sympy.Mod)}
    for name in ("FloorDiv", "CleanDiv", "CeilDiv", "ModularIndexing", "Mod", "PythonMod", "Max", "Min",
                 "IntTrueDiv", "FloorToInt", "CeilToInt", "TruncToInt", "Identity"):
        if hasattr(symfn, name):
            classes[f"torch.{name}"] = getattr(symfn, name)
    return classes


def encode_size(expr: Any) -> Any:
    """An int or a sympy size expression as JSON: ints as is, symbols with their assumptions,
    operations as [class name, args...] (decode_size accepts only _size_classes)."""
    import sympy

    if isinstance(expr, int) or (isinstance(expr, sympy.Integer)):
        return int(expr)
    if isinstance(expr, sympy.Rational):
        return {"rational": [int(expr.p), int(expr.q)]}
    if isinstance(expr, sympy.Symbol):
        return {"symbol": expr.name, "assumptions": {k: v for k, v in expr.assumptions0.items() if v is not None}}
    name = next((k for k, c in _size_classes().items() if type(expr) is c), None)
    if name is None:
        raise PlainDataError(f"size expression {expr} uses {type(expr).__name__}")
    return {"op": name, "args": [encode_size(a) for a in expr.args]}


def decode_size(data: Any) -> Any:
    import sympy

    if isinstance(data, int) and not isinstance(data, bool):
        return data
    if not isinstance(data, dict):
        raise PlainDataError(f"not a size expression: {str(data)[:80]}")
    if "rational" in data:
        p, q = data["rational"]
        return sympy.Rational(int(p), int(q))
    if "symbol" in data:
        assumptions = {k: bool(v) for k, v in data.get("assumptions", {}).items() if isinstance(k, str)}
        return sympy.Symbol(str(data["symbol"]), **assumptions)
    cls = _size_classes().get(data.get("op"))
    if cls is None:
        raise PlainDataError(f"size operation {data.get('op')!r} is not allowed")
    args = [decode_size(a) for a in data.get("args", [])]
    return cls(*[sympy.Integer(a) if isinstance(a, int) else a for a in args])

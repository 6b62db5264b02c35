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


class PlainDataError(ValueError):
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

"""The ATen op registry: each overload is in exactly one bucket — lower, decompose or fallback.

- lower:     a function that emits gac ops for the node (`@lower(aten.relu.default)`).
- decompose: torch's own decomposition of the op is applied before legalization (both front-ends
             share the table, see decompositions()).
- fallback:  the op runs in eager, with a stated reason.
An op in no bucket falls back with the reason "no lowering". A lowering may also refuse one
particular node (an unsupported dtype or argument) through its `check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch._ops import OpOverload

aten = torch.ops.aten

Check = Callable[[torch.fx.Node], "str | None"]


@dataclass(frozen=True)
class Entry:
    overload: OpOverload
    bucket: str  # "lower" | "decompose" | "fallback"
    fn: Callable | None = None
    check: Check | None = None
    reason: str = ""


REGISTRY: dict[OpOverload, Entry] = {}


def _add(entry: Entry) -> None:
    if entry.overload in REGISTRY:
        raise ValueError(f"{entry.overload} is registered twice "
                         f"({REGISTRY[entry.overload].bucket} and {entry.bucket})")
    REGISTRY[entry.overload] = entry


def lower(*overloads: OpOverload, check: Check | None = None):
    """Registers fn(cx, *args, **kwargs) -> Value | tuple[Value, ...] for each overload."""
    def register(fn):
        for ov in overloads:
            _add(Entry(ov, "lower", fn, check))
        return fn
    return register


def decompose(*overloads: OpOverload) -> None:
    for ov in overloads:
        _add(Entry(ov, "decompose"))


def fallback(overload: OpOverload, reason: str) -> None:
    _add(Entry(overload, "fallback", reason=reason))


def decompositions() -> dict:
    """The decomposition table both front-ends use: core ATen plus our `decompose` bucket,
    minus ops we lower ourselves (a fused lowering beats torch's expansion)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    table.update(get_decompositions([e.overload for e in REGISTRY.values() if e.bucket == "decompose"]))
    for ov, e in REGISTRY.items():
        if e.bucket == "lower":
            table.pop(ov, None)
    return table


def lowered_ops() -> list[OpOverload]:
    return sorted((e.overload for e in REGISTRY.values() if e.bucket == "lower"), key=str)

"""One lowering per gac op family: `@lowers("binary")` registers fn(op, operands) -> results."""

from __future__ import annotations

from typing import Callable, Sequence

from mlir import ir

LowerFn = Callable[[ir.OpView, Sequence[ir.Value]], Sequence[ir.Value]]
LOWERINGS: dict[str, LowerFn] = {}


def lowers(*names: str):
    def register(fn: LowerFn) -> LowerFn:
        for n in names:
            if n in LOWERINGS:
                raise ValueError(f"gac.{n} already has a lowering")
            LOWERINGS[n] = fn
        return fn

    return register

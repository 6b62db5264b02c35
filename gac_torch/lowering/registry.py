"""One lowering per gac op family: `@lowers("binary")` registers fn(op, operands) -> results."""

from __future__ import annotations

from typing import Callable, Sequence

from mlir import ir

LowerFn = Callable[[ir.OpView, Sequence[ir.Value]], Sequence[ir.Value]]
LOWERINGS: dict[str, LowerFn] = {}
# Ops that only move elements: they see bool tensors in their i8 storage form (see lowering/__init__).
DATA_MOVEMENT: set[str] = set()


def lowers(*names: str, moves_data_only: bool = False):
    def register(fn: LowerFn) -> LowerFn:
        for n in names:
            if n in LOWERINGS:
                raise ValueError(f"gac.{n} already has a lowering")
            LOWERINGS[n] = fn
            if moves_data_only:
                DATA_MOVEMENT.add(n)
        return fn

    return register

"""gac-dce: drop gac ops none of whose results are used (gac ops have no side effects).
Legalization emits some values only to mirror ATen's tuple outputs (e.g. batch-norm stats)."""

from __future__ import annotations

from mlir import ir


def gac_dce(module: ir.Module) -> ir.Module:
    for fn in module.body.operations:
        block = fn.regions[0].blocks[0]
        for op in reversed(list(block.operations)):
            if op.operation.name.startswith("gac.") and all(not list(r.uses) for r in op.results):
                op.operation.erase()
    return module

"""gac-verify: the shape/dtype rules IRDL cannot express, checked on every gac op of a module."""

from __future__ import annotations

from mlir import ir, passmanager

from gac_torch.ir.builder import infer_result_types, op_attrs
from gac_torch.ir.ops._infer import GacTypeError


def gac_ops(module: ir.Module | ir.Operation):
    """Every gac op of the module (or of any op holding gac ops), in order."""
    found = []

    def visit(op):
        if op.operation.name.startswith("gac."):
            found.append(op)
        return ir.WalkResult.ADVANCE

    getattr(module, "operation", module).walk(visit)
    return found


def verify_gac(module: ir.Module | ir.Operation) -> None:
    """Raises GacTypeError naming the first op that breaks its rules."""
    for op in gac_ops(module):
        name = op.operation.name.removeprefix("gac.")
        try:
            infer_result_types(name, [v.type for v in op.operands], op_attrs(op),
                               [r.type for r in op.results])
        except GacTypeError as e:
            raise GacTypeError(f"{e}\n  at: {op}") from None


def add_verify_pass(pm: passmanager.PassManager) -> None:
    """Runs gac-verify inside a pass pipeline (after IRDL's own op verification)."""

    def run(op, pass_=None):
        verify_gac(op)

    pm.add(run, name="gac-verify", argument="gac-verify")

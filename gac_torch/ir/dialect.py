"""The `gac` dialect: op definitions as data, turned into IRDL and loaded into every context.

IRDL checks operand/result counts, that they are tensors, and attribute kinds and enums. What it
cannot express (shapes, dtypes, broadcasting) each op states as an `infer` function, used both by
the builder (to type results) and by the verifier pass (to re-check a whole module).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Callable

from mlir import ir
from mlir.dialects import irdl

# Attribute kinds, as IRDL constraints.
_ATTR_BASE = {
    "str": '"#builtin.string"',
    "int": '"#builtin.integer"',
    "float": '"#builtin.float"',
    "ints": '"#builtin.dense_array"',
}

_TENSOR = 'irdl.base "!builtin.tensor"'
_INDEX = "irdl.is index"  # run-time sizes (`name:index`): gac.dim results, reshape/broadcast sizes
InferFn = Callable[[list[ir.Type], dict], list[ir.Type]]
CheckFn = Callable[[list[ir.Type], dict, list[ir.Type]], None]


@dataclass(frozen=True)
class OpDef:
    """One gac op. operands/results: names, tensors unless suffixed `:index`; a '*' after the name
    marks a variadic one. attrs: name -> kind, where kind is a key of _ATTR_BASE, "any", or a
    tuple of allowed strings (an enum)."""

    name: str
    operands: tuple[str, ...]
    results: tuple[str, ...]
    attrs: dict[str, object] = field(default_factory=dict)
    infer: InferFn | None = None  # None: the result types are given by the builder (e.g. cast)
    check: CheckFn | None = None  # for ops with given result types: raises on a bad combination
    doc: str = ""


OPS: dict[str, OpDef] = {}


def define(name: str, operands, results=("result",), attrs=None, infer=None, check=None,
           doc="") -> OpDef:
    if name in OPS:
        raise ValueError(f"gac.{name} defined twice")
    op = OpDef(name, tuple(operands), tuple(results), dict(attrs or {}), infer, check, doc)
    OPS[name] = op
    return op


def _irdl_operation(op: OpDef) -> str:
    lines, n = [], 0

    def fresh(constraint: str) -> str:
        nonlocal n
        n += 1
        lines.append(f"    %c{n} = {constraint}")
        return f"%c{n}"

    def tensors(names) -> str:
        # One constraint value per operand: an IRDL value binds a single type per op instance.
        parts = []
        for spec in names:
            nm, _, kind = spec.partition(":")
            var = "variadic " if nm.endswith("*") else ""
            parts.append(f"{nm.rstrip('*')}: {var}{fresh(_INDEX if kind == 'index' else _TENSOR)}")
        return ", ".join(parts)

    if op.operands:
        lines.append(f"    irdl.operands({tensors(op.operands)})")
    lines.append(f"    irdl.results({tensors(op.results)})")
    if op.attrs:
        attrs = []
        for attr, kind in op.attrs.items():
            if isinstance(kind, tuple):
                opts = [fresh(f'irdl.is "{k}"') for k in kind]
                c = fresh(f"irdl.any_of({', '.join(opts)})")
            elif kind == "any":
                c = fresh("irdl.any")
            else:
                c = fresh(f"irdl.base {_ATTR_BASE[kind]}")
            attrs.append(f'"{attr}" = {c}')
        lines.append(f"    irdl.attributes {{{', '.join(attrs)}}}")
    body = "\n".join(lines)
    return f"  irdl.operation @{op.name} {{\n{body}\n  }}"


def irdl_source() -> str:
    from gac_torch.ir import ops as _ops  # noqa: F401  (fills OPS)

    return "irdl.dialect @gac {\n" + "\n".join(_irdl_operation(o) for o in OPS.values()) + "\n}\n"


# The bindings wrap each op in its dialect's Python module, importing mlir.dialects.<namespace> at
# every wrap until an import succeeds: for `gac` (no Python op classes) every one failed, 46k
# failed imports (1-4 s) per BEVFormer compile. An empty module ends the search at the first.
sys.modules.setdefault("mlir.dialects.gac", types.ModuleType("mlir.dialects.gac",
                                                             "gac ops: generic OpViews (gac_torch.ir)"))


def make_context() -> ir.Context:
    """A fresh MLIR context with every upstream dialect and `gac` loaded."""
    ctx = ir.Context()
    ctx.allow_unregistered_dialects = False
    with ctx, ir.Location.unknown():
        irdl.load_dialects(ir.Module.parse(irdl_source()))
    return ctx

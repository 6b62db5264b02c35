"""Shrinks a failing fuzz program: drops lines and outputs while it still fails the same way.

"The same way": the same status (mismatch / crash) in the same configuration (target, front-end,
mode), with the same first line of the error for a crash. Greedy, one line at a time from the
end; a line that later lines read cannot go (eager then rejects the program: not the same way).
"""

from __future__ import annotations

import dataclasses
import re

from gac_torch.tools.fuzz.gen import Program
from gac_torch.tools.fuzz.runners import CaseResult, run_case


def _signature(result: CaseResult) -> tuple | None:
    bad = [o for o in result.outcomes if o.status in ("mismatch", "crash")]
    if not bad:
        return None
    o = bad[0]
    if o.status != "crash" or not o.detail:
        return o.config, o.status, ""
    first = o.detail.splitlines()[0]  # its error type and op (node names and users change)
    op = re.search(r"aten\.\w+\.\w+", first)
    return o.config, o.status, first.split(":", 1)[0], op.group(0) if op else ""


def _defines(line: str) -> str:
    return line.split(" = ", 1)[0]


def _try(program: Program, lines: list[str], outputs: list[str], targets, frontends, want) -> bool:
    cand = dataclasses.replace(program, lines=lines, outputs=outputs)
    return _signature(run_case(cand.source(), program.seed, targets, frontends)) == want


def minify(program: Program, targets: tuple[str, ...] = ("cpu",),
           frontends: tuple[str, ...] = ("compile", "export"), budget: int = 40) -> Program:
    """A smaller program with the same failure (the program itself when it does not fail)."""
    want = _signature(run_case(program.source(), program.seed, targets, frontends))
    if want is None:
        return program
    frontends = tuple(f for f in frontends if f in want[0].split("/")) or frontends  # only the failing one
    lines, outputs = list(program.lines), list(program.outputs)
    tries = 0
    for out in list(outputs):  # 1. fewer outputs
        if len(outputs) > 1 and tries < budget:
            tries += 1
            rest = [o for o in outputs if o != out]
            if _try(program, lines, rest, targets, frontends, want):
                outputs = rest
    progress = True
    while progress and tries < budget:  # 2. fewer lines (an output it defined: the last line's value)
        progress = False
        for line in reversed(list(lines)):
            name = _defines(line)
            rest = [ln for ln in lines if ln is not line]
            if not rest or any(re.search(rf"\b{name}\b", ln) for ln in rest) or tries >= budget:
                continue  # the last line, or read by a later one
            outs = [o for o in outputs if o != name] or [_defines(rest[-1])]
            tries += 1
            if _try(program, rest, outs, targets, frontends, want):
                lines, outputs, progress = rest, outs, True
    return dataclasses.replace(program, lines=lines, outputs=outputs)

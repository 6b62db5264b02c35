"""A random-graph fuzzer for gac: seeded programs through both front-ends, checked against eager.

    python -m gac_torch.tools.fuzz --cases 200 --seed 0 --target cpu
    fuzz: 200 cases, ok 190, mismatch 1, crash 2, unsupported 7

Pieces: table.py + ops_math.py + ops_data.py (the op table, drawn from the registry's lowered
ops), gen.py (seed -> program source), oracle.py (compare with eager / float64), runners.py (the
front-ends and the classification), minify.py (shrinks a failing program), __main__.py (the CLI,
repro files). gac_torch.debug.bisect names the op of a failing program that gac gets wrong.
"""

from __future__ import annotations

import sys

from gac_torch.tools.fuzz.gen import Program, generate, load
from gac_torch.tools.fuzz.runners import CaseResult, Outcome, run_case


def replay(path: str, argv: list[str] | None = None) -> CaseResult:
    """Runs a repro file written by the CLI (or any program source with make_inputs/forward)."""
    import argparse

    ap = argparse.ArgumentParser(description=f"replay the fuzz case {path}")
    ap.add_argument("--target", default="cpu", help="comma-separated targets (cpu, cuda, vortex)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    with open(path) as f:
        source = f.read()
    seed = load(source)["SEED"]
    result = run_case(source, seed, tuple(args.target.split(",")))
    print(f"seed {seed}: {result.status}\n{result.summary()}")
    return result


__all__ = ["CaseResult", "Outcome", "Program", "generate", "load", "replay", "run_case"]

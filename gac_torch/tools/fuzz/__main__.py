"""The fuzzer's command line: N seeded cases, a one-line summary, a repro file per failure.

    python -m gac_torch.tools.fuzz --cases 200 --seed 0 --target cpu [--out fuzz_repros]
    python -m gac_torch.tools.fuzz --cases 20 --target cpu,vortex   # cross-target differential
    python -m gac_torch.tools.fuzz --cases 500 --target cuda         # on a GPU machine
    python -m gac_torch.tools.fuzz --cases 1 --seed 26 --minify      # a failing case, shrunk
    PYTHONPATH=. python fuzz_repros/case_26_crash.py                 # replay a repro
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time

from gac_torch.tools.fuzz.gen import generate
from gac_torch.tools.fuzz.runners import FRONTENDS, run_case


def summary_line(n: int, counts: collections.Counter) -> str:
    return (f"fuzz: {n} cases, ok {counts['ok']}, mismatch {counts['mismatch']}, "
            f"crash {counts['crash']}, unsupported {counts['unsupported']}"
            + (f", skipped {counts['skipped']}" if counts["skipped"] else ""))


def write_repro(out_dir: str, program, result) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"case_{program.seed}_{result.status}.py")
    notes = "\n".join(f"# {ln}" for ln in result.summary().splitlines())
    with open(path, "w") as f:
        f.write(program.source() + f"\n\n# What happened (seed {program.seed}):\n{notes}\n")
    return path


def _record(path: str, program, result) -> None:
    bad = [o for o in result.outcomes if o.status == result.status]
    rec = {"seed": program.seed, "status": result.status, "features": sorted(program.features),
           "config": bad[0].config if bad else "", "detail": bad[0].detail.splitlines()[0][:300]
           if bad and bad[0].detail else "",
           "unsupported": sorted({ln for o in result.outcomes for ln in o.unsupported})}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gac_torch.tools.fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="case i uses seed SEED + i")
    ap.add_argument("--target", default="cpu", help="comma-separated: cpu, cuda, vortex")
    ap.add_argument("--frontends", default=",".join(FRONTENDS))
    ap.add_argument("--exclude", default="", help="comma-separated features / op names to leave out")
    ap.add_argument("--out", default="fuzz_repros", help="folder for repro files of failures")
    ap.add_argument("--minify", action="store_true", help="shrink each failing program (minify.py) "
                    "before writing its repro")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new case after this long (the summary counts the cases run)")
    ap.add_argument("--json", default=None, help="append one JSON line per case to this file")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failure's details")
    args = ap.parse_args(argv)
    logging.getLogger("gac_torch").setLevel(logging.ERROR)  # failures are reported below

    targets = tuple(args.target.split(","))
    exclude = frozenset(x for x in args.exclude.split(",") if x)
    counts: collections.Counter = collections.Counter()
    rejected: collections.Counter = collections.Counter()  # "op: reason" -> cases
    by_feature: collections.Counter = collections.Counter()
    start = time.time()
    done = 0
    for i in range(args.cases):
        if args.max_seconds is not None and time.time() - start > args.max_seconds:
            break
        done += 1
        program = generate(args.seed + i, exclude)
        result = run_case(program.source(), program.seed, targets, tuple(args.frontends.split(",")))
        counts[result.status] += 1
        if args.json:
            _record(args.json, program, result)
        for line in {ln for o in result.outcomes for ln in o.unsupported}:
            rejected[line] += 1
        if result.status in ("mismatch", "crash"):
            if args.minify:
                from gac_torch.tools.fuzz.minify import minify

                program = minify(program, targets, tuple(args.frontends.split(",")))
                result = run_case(program.source(), program.seed, targets, tuple(args.frontends.split(",")))
            path = write_repro(args.out, program, result)
            by_feature.update(program.features)
            first = next(o for o in result.outcomes if o.status == result.status)
            print(f"seed {program.seed}: {result.status} ({first.config}): "
                  f"{first.detail.splitlines()[0][:160] if first.detail else ''} -> {path}", flush=True)
            if args.verbose:
                print(result.summary())
    print(f"({time.time() - start:.0f} s)")
    if rejected:
        print("rejected with GacUnsupportedError (strict mode), cases per op:")
        for line, n in rejected.most_common():
            print(f"  {n:4d}  {line}")
    if by_feature:
        print("features of failing cases: " + ", ".join(f"{k} {v}" for k, v in by_feature.most_common(25)))
    print(summary_line(done, counts))
    return 0 if counts["mismatch"] == counts["crash"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

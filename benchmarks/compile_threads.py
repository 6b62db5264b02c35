"""Concurrent compiles (issue 12 item 8): 4 threads compile 4 different exported programs at once,
`--rounds` times (default 20), each result checked against eager; then a training step through
torch.compile(backend="gac") must still give every parameter its eager gradient.

    python benchmarks/compile_threads.py --rounds 20 --out benchmarks/results/compile_threads.md
"""

from __future__ import annotations

import argparse
import datetime
import time

from common import write_report  # also puts tests/ on sys.path
from test_threads import _programs, compile_in_threads, test_training_after_threaded_compiles_gets_every_gradient


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.time()
    results = compile_in_threads(_programs(args.threads), args.rounds)
    seconds = time.time() - t0
    good = sum(all(r is True for r in got) for got in results)
    errors = sorted({str(r) for got in results for r in got if r is not True})
    test_training_after_threaded_compiles_gets_every_gradient()  # raises if a gradient is lost
    summary = (f"{args.threads} threads x {args.rounds} rounds: {good}/{args.rounds} rounds with every "
               f"thread's program equal to eager ({seconds:.1f} s); training afterwards: every gradient "
               "equal to eager.")
    lines = [f"# Concurrent compiles ({datetime.date.today()}, cpu)", "", summary, ""]
    lines += [f"- error: {e}" for e in errors]
    write_report("\n".join(lines) + "\n", args.out)
    if good != args.rounds:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

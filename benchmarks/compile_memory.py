"""Memory over repeated compiles (issue 12 items 7, 10): RSS and live gac objects over `--cycles`
compile cycles of a small model, through torch.export -> gac_torch.compile and through
torch.compile(backend="gac") with torch._dynamo.reset() between cycles. Each cycle compiles, runs
once, drops the program and collects garbage; every compiled partition is watched by a weakref.

    python benchmarks/compile_memory.py --cycles 1000 --out benchmarks/results/compile_memory.md

Growth is measured after `--warmup` cycles (first-use caches: op tables, MLIR dialects, torch's
own lazy state) to the end, and as a least-squares slope per cycle.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import time

import torch
from common import write_report  # also puts tests/ on sys.path
from test_compile_lifetime import one_cycle, small_model

FRONTENDS = ("export", "dynamo")
BASELINE = "aot_eager"  # torch alone, the same dynamo loop: what torch itself keeps per cycle


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(frontend: str, cycles: int, warmup: int = 10, sample_every: int = 1, fresh: bool = False) -> dict:
    """Runs the cycles (`fresh`: a new module each cycle, else one module compiled again and
    again); returns RSS figures (MB), the per-cycle slope (KB) and live objects."""
    model, x = small_model()
    watch: list = []
    samples: list[tuple[int, float]] = []
    t0 = time.time()
    start = rss_mb()
    for i in range(cycles):
        if fresh:
            model, x = small_model()
        one_cycle(frontend, model, x, watch)
        gc.collect()
        if i + 1 >= warmup and ((i + 1) % sample_every == 0 or i + 1 == cycles):
            samples.append((i + 1, rss_mb()))
            print(f"{frontend} cycle {i + 1}: RSS {samples[-1][1]:.1f} MB, {time.time() - t0:.0f} s", flush=True)
    seconds = time.time() - t0
    n = len(samples)
    mean_x = sum(c for c, _ in samples) / n
    mean_y = sum(r for _, r in samples) / n
    var = sum((c - mean_x) ** 2 for c, _ in samples)
    slope = sum((c - mean_x) * (r - mean_y) for c, r in samples) / var if var else 0.0
    return {"frontend": frontend + (" (new module per cycle)" if fresh else ""), "cycles": cycles, "warmup": warmup, "seconds": seconds,
            "rss_start": start, "rss_warm": samples[0][1], "rss_end": samples[-1][1],
            "growth": samples[-1][1] - samples[0][1], "kb_per_cycle": slope * 1024,
            "watched": len(watch), "alive": sum(r() is not None for r in watch)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--frontend", choices=(*FRONTENDS, BASELINE, "all"), default="all")
    ap.add_argument("--fresh", action="store_true", help="also a new module per cycle (dynamo rows)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    runs = [(fe, False) for fe in ((*FRONTENDS, BASELINE) if args.frontend == "all" else (args.frontend,))]
    if args.fresh:
        runs += [(fe, True) for fe, _ in runs if fe != "export"]
    for fe, fresh in runs:
        r = measure(fe, args.cycles, args.warmup, sample_every=max(1, args.cycles // 100), fresh=fresh)
        rows.append(r)
        print(r, flush=True)
    about = ("Each cycle: compile a 4-op MLP (Linear-GELU-Linear-LayerNorm), call it once, drop it, "
             "gc.collect(); dynamo cycles call torch._dynamo.reset() before and after. aot_eager is "
             "torch alone in the dynamo loop (what torch itself keeps per cycle). RSS growth from "
             f"cycle {args.warmup} to the last; slope by least squares over samples.")
    header = ("| front-end | cycles | s | RSS start MB | RSS at warm-up MB | RSS end MB | growth MB | "
              "KB/cycle | compiled objects alive |")
    lines = [f"# Memory over compile cycles ({datetime.date.today()}, cpu, torch {torch.__version__})", "",
             about, "", header, "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['frontend']} | {r['cycles']} | {r['seconds']:.0f} | {r['rss_start']:.1f} | "
              f"{r['rss_warm']:.1f} | {r['rss_end']:.1f} | {r['growth']:+.1f} | {r['kb_per_cycle']:+.1f} | "
              f"{r['alive']}/{r['watched']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    write_report(text, args.out)


if __name__ == "__main__":
    main()

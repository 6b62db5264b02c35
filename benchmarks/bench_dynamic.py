"""Run-time sizes on the GPU: one gac compilation for every shape vs one per shape, against eager
and Inductor (dynamic and static) in the same run.

    python benchmarks/bench_dynamic.py --out results.md

The plain-op transformer block of the tests (tests/models.py "attention") at several
(batch, sequence) shapes: parity with eager, then per shape the median over rounds of the mean
CUDA-event time of back-to-back calls (after warm-up; METHOD.md), and the compile seconds.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from common import REL_TOL, parity, rel_err, time_ms, write_report

import gac_torch
from models import build

SHAPES = [(1, 7), (8, 64), (32, 128), (64, 130)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, (x0,) = build("attention")
    model = model.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = {s: torch.randn(*s, 64, generator=g, device="cuda") for s in SHAPES}
    compile_s: dict[str, float] = {}
    with torch.no_grad():
        t0 = time.time()
        dims = ({0: torch.export.Dim("batch", min=1, max=64), 1: torch.export.Dim("seq", min=7, max=130)},)
        dynamic = gac_torch.compile(torch.export.export(model, (x0.cuda(),), dynamic_shapes=dims), target="cuda")
        compile_s["gac run-time sizes"] = time.time() - t0
        assert dynamic.dynamic
        static, t0 = {}, time.time()
        for s, x in inputs.items():
            static[s] = gac_torch.compile(torch.export.export(model, (x,)), target="cuda")
        compile_s["gac per shape"] = time.time() - t0
        ind_dyn, ind_static = torch.compile(model, dynamic=True), torch.compile(model, dynamic=False)
        for name, fn in (("Inductor dynamic", ind_dyn), ("Inductor per shape", ind_static)):
            t0 = time.time()
            for x in inputs.values():
                fn(x)
            torch.cuda.synchronize()
            compile_s[name] = time.time() - t0
        variants = {"eager": lambda s: model, "gac run-time sizes": lambda s: dynamic,
                    "gac per shape": lambda s: static[s], "Inductor dynamic": lambda s: ind_dyn,
                    "Inductor per shape": lambda s: ind_static}
        errs = {}
        for s, x in inputs.items():
            ref = model(x)
            errs[s] = max(rel_err(variants[v](s)(x), ref) for v in variants if v != "eager")
        verdict = {s: parity(f"{s[0]}x{s[1]}", e, REL_TOL[torch.float32]) for s, e in errs.items()}
        times = {v: {} for v in variants}
        for s, x in inputs.items():
            for v in variants:
                variants[v](s)(x)  # warm-up
            rounds = {v: [] for v in variants}
            for _ in range(args.rounds):  # interleaved so drift hits every variant alike
                for v in variants:
                    rounds[v].append(time_ms(variants[v](s), (x,), args.iters))
            for v in variants:
                times[v][s] = statistics.median(rounds[v])
    lines = [f"# Run-time sizes on cuda: the attention block ({datetime.date.today()})", "",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}. Command: "
             "`python benchmarks/bench_dynamic.py` (rounds "
             f"{args.rounds}, {args.iters} calls each; medians of per-round means, CUDA events).", "",
             "| variant | " + " | ".join(f"{b}x{t}" for b, t in SHAPES) + " | compile s |",
             "|---|" + "---|" * (len(SHAPES) + 1)]
    for v in variants:
        lines.append(f"| {v} | " + " | ".join(f"{times[v][s]:.3f} ms" for s in SHAPES)
                     + f" | {compile_s.get(v, 0):.1f} |")
    lines += ["", f"Relative error |compiled - eager| / |eager| per shape, worst compiled variant (tolerance "
              f"{REL_TOL[torch.float32]:.0e}): " + ", ".join(f"{b}x{t}: {errs[(b, t)]:.1e} {verdict[(b, t)]}"
                                                           for b, t in SHAPES), "",
              "gac run-time sizes / gac per shape: " + ", ".join(
                  f"{b}x{t}: {times['gac run-time sizes'][(b, t)] / times['gac per shape'][(b, t)]:.2f}x"
                  for b, t in SHAPES)]
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

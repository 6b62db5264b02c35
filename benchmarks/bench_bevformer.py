"""BEVFormer at full size on one GPU: gac parity vs eager (fp32) and latency eager / Inductor / gac.

    python benchmarks/bench_bevformer.py --configs tiny base --out results.md

Two frames per config (frame 0 without prev_bev, frame 1 with it) checked against eager; then
frame-1 latency: warm-up, CUDA events, medians of interleaved rounds (METHOD.md).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from common import REL_TOL, parity, rel_err, time_ms, write_report

import gac_torch
from gac_torch.models.bevformer import build_bevformer, make_test_inputs


def log(config: str, what: str, t_start: float) -> None:
    """Progress (a guarded run cut short by `timeout` still shows how far it got)."""
    print(f"[{config} +{time.time() - t_start:.0f}s] {what}", flush=True)


def run(config: str, rounds: int, iters: int, inductor: bool) -> dict:
    row: dict = {"config": config}
    t_run = time.time()
    model = build_bevformer(config, seed=0).cuda()
    frame0 = [t.cuda() for t in make_test_inputs(model.cfg, frame=0)]
    with torch.no_grad():
        ref0 = model(*frame0)
        frame1 = [t.cuda() for t in make_test_inputs(model.cfg, frame=1, prev_bev=ref0[2].cpu())]
        ref1 = model(*frame1)
        t0 = time.time()
        ep = torch.export.export(model, tuple(frame0))
        compiled = gac_torch.compile(ep, target="cuda")
        row["compile_s"] = time.time() - t0
        row["coverage"] = compiled.report.summary()
        log(config, f"gac compiled in {row['compile_s']:.0f}s: {row['coverage']}", t_run)
        out0, out1 = compiled(*frame0), compiled(*frame1)
        row["rel_err"] = {name: max(rel_err(a, b), rel_err(c, d)) for name, a, b, c, d in zip(
            ("cls", "bbox", "bev"), out0, ref0, out1, ref1, strict=True)}
        row["parity"] = parity(config, max(row["rel_err"].values()), REL_TOL[torch.float32])
        log(config, f"parity over 2 frames: {row['rel_err']}", t_run)
        variants = {"eager": model, "gac": compiled}
        if inductor:
            t0 = time.time()
            variants["inductor"] = torch.compile(model)
            variants["inductor"](*frame1)
            row["inductor_compile_s"] = time.time() - t0
            log(config, f"Inductor compiled (and ran once) in {row['inductor_compile_s']:.0f}s", t_run)
        for fn in variants.values():
            fn(*frame1)
        torch.cuda.synchronize()
        samples: dict = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                samples[k].append(time_ms(fn, frame1, iters))
            log(config, "round: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in samples.items()), t_run)
    row["ms"] = {k: statistics.median(v) for k, v in samples.items()}
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["tiny", "base"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run(c, args.rounds, args.iters, not args.no_inductor) for c in args.configs]
    lines = [f"# BEVFormer on the GPU ({datetime.date.today()}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "",
             f"Command: `python benchmarks/bench_bevformer.py --configs {' '.join(args.configs)}`"
             f"{' --no-inductor' if args.no_inductor else ''}; fp32, batch 1, frame 1 (with prev_bev); "
             f"medians of {args.rounds} interleaved rounds x {args.iters} calls, CUDA events.", "",
             ("| config | eager ms | inductor ms | gac ms | eager/gac | gac compile s "
              "| rel.err cls / bbox / bev (2 frames) | parity | coverage |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r["ms"]
        e = r["rel_err"]
        lines.append(f"| {r['config']} | {ms['eager']:.2f} | {ms.get('inductor', float('nan')):.2f} | {ms['gac']:.2f} | "
                     f"{ms['eager'] / ms['gac']:.2f} | {r['compile_s']:.0f} | {e['cls']:.1e} / {e['bbox']:.1e} / {e['bev']:.1e} | "
                     f"{r['parity']} | {r['coverage']} |")
    lines += [f"\n{r['config']}: Inductor compile + first call {r['inductor_compile_s']:.0f} s"
              for r in rows if "inductor_compile_s" in r]
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

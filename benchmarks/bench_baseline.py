"""Baseline: eager vs Inductor vs gac on one GPU, in one run.

    python benchmarks/bench_baseline.py --out results.md

Method (../.library device METHOD.md): warm-up first (compilation excluded), CUDA-event timing of
`--iters` back-to-back calls per sample, `--rounds` samples per variant, variants interleaved
round by round, medians reported. Each workload is checked against eager before it is timed.
Ratios > 1 mean gac is faster.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch
from common import (REL_TOL, Chain, Gemm, LinearGelu, cuda_randn, failed, parity, rel_err, small_models, time_ms,
                    write_report)


def workloads():
    rnd = cuda_randn()
    yield "gemm fp32 2048^3", Gemm(), (rnd(2048, 2048), rnd(2048, 2048))
    yield "gemm fp16 4096^3", Gemm(), (rnd(4096, 4096, dtype=torch.float16), rnd(4096, 4096, dtype=torch.float16))
    yield "gelu(x*a+b)*c 16M fp32", Chain(), (rnd(4096, 4096), rnd(4096), rnd(4096), rnd(4096))
    yield "gelu(x@w+b)*s 4096x1024x1024", LinearGelu(), (rnd(4096, 1024), rnd(1024, 1024), rnd(1024), rnd(1024))
    yield from small_models(rnd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from gac_torch.frontends import dynamo as gac_dynamo

    rows = []
    for name, model, inputs in workloads():
        torch._dynamo.reset()
        variants = {"eager": model}
        with torch.no_grad():
            variants["inductor"] = torch.compile(model)
            variants["gac"] = torch.compile(model, backend="gac")
            ref = model(*inputs)
            status, coverage = "ok", ""
            for vname in ("inductor", "gac"):
                try:
                    out = variants[vname](*inputs)  # compiles (warm-up 1)
                    err = rel_err(out, ref)
                    if vname == "gac":
                        coverage = f"{gac_dynamo.compiled_graphs[-1].report.percent:.0f}%"
                        status = f"rel.err {err:.1e} {parity(name, err, REL_TOL[inputs[0].dtype])}"
                except Exception as e:  # report, keep benchmarking the others
                    variants.pop(vname)
                    status = failed(f"{name} {vname}", f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
            for fn in variants.values():  # warm-up
                for _ in range(3):
                    fn(*inputs)
            torch.cuda.synchronize()
            samples = {k: [] for k in variants}
            for _ in range(args.rounds):  # interleaved
                for k, fn in variants.items():
                    samples[k].append(time_ms(fn, inputs, args.iters))
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append((name, med, coverage, status))
        print(name, {k: round(v, 4) for k, v in med.items()}, coverage, status, flush=True)

    lines = [
        f"# Baseline: eager / Inductor / gac ({datetime.date.today()}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__})",
        "",
        f"Command: `python benchmarks/bench_baseline.py` (medians of {args.rounds} interleaved rounds x "
        f"{args.iters} calls, CUDA events, after warm-up). Ratios > 1: gac faster.",
        "",
        "| workload | eager ms | inductor ms | gac ms | eager/gac | inductor/gac | gac coverage | check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, med, cov, status in rows:
        e, i, g = med.get("eager"), med.get("inductor"), med.get("gac")
        fmt = (lambda v: f"{v:.4f}" if v is not None else "-")
        ratio = (lambda a, b: f"{a / b:.2f}" if a and b else "-")
        lines.append(f"| {name} | {fmt(e)} | {fmt(i)} | {fmt(g)} | {ratio(e, g)} | {ratio(i, g)} | {cov} | {status} |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

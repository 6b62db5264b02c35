"""gac inside torch.distributed on 2 GPUs (NCCL, target cuda): DDP around a gac-compiled model,
and FSDP2 with every block compiled by gac (`torch.compile(block, backend="gac")`, then
`fully_shard(block)`), against eager (parity of the parameters after 3 SGD steps) and Inductor
(training tokens/s per rank, in the same run). Each case runs in 2 fresh processes, one per rank
(tests/distributed.py, the same workers as the CPU test).

    python benchmarks/bench_distributed.py                  # 2 GPUs -> results/distributed_<date>_h200x2.md
    python benchmarks/bench_distributed.py --cpu            # gloo, target cpu, small cases, no Inductor

Exits non-zero if any case misses its parity tolerance (the table marks the row FAIL).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch
from common import write_report  # also puts tests/ on sys.path

from distributed import CASES, STEPS, launch

# Parameters after STEPS SGD steps, gac against eager: fp32 rounding order only (TF32 off).
TOL = {"cpu": {"rtol": 1e-5, "atol": 1e-5}, "cuda": {"rtol": 1e-4, "atol": 1e-4}}
GPU_CASES = ["ddp_mlp", "ddp_block", "fsdp2_blocks", "ddp_block_large", "fsdp2_blocks_large"]
CPU_CASES = ["ddp_mlp", "ddp_block", "funcol_mlp", "fsdp2_blocks"]


def parity(res: dict) -> tuple[float, bool]:
    """(max abs difference gac vs eager over all parameters, within tolerance)."""
    device = "cuda" if res["cuda"] else "cpu"
    worst, ok = 0.0, True
    for pe, pg in zip(res["eager"]["params"], res["gac"]["params"], strict=True):
        worst = max(worst, (pe - pg).abs().max().item())
        ok = ok and torch.allclose(pg, pe, **TOL[device])
    return worst, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo + target cpu (no GPU needed)")
    ap.add_argument("--cases", default=None, help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument("--iters", type=int, default=None, help="timed training steps per backend")
    ap.add_argument("--out", default=None, help="report file (default: results/distributed_<date>_<machine>.md)")
    a = ap.parse_args()

    cuda = not a.cpu
    if cuda and torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs, found {torch.cuda.device_count()} (use --cpu for the gloo run)")
    cases = a.cases.split(",") if a.cases else (GPU_CASES if cuda else CPU_CASES)
    backends = ("eager", "gac", "inductor") if cuda else ("eager", "gac")
    iters = a.iters if a.iters is not None else (50 if cuda else 3)
    machine = "h200x2" if cuda else "cpu"
    out = a.out or Path(__file__).parent / "results" / f"distributed_{datetime.date.today():%Y-%m-%d}_{machine}.md"

    rows, reports, failed = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            ranks = launch([case], Path(tmp), cuda=cuda, backends=backends, bench_iters=iters, timeout=600)
            res = {**ranks[0][case], "cuda": cuda}
            worst, ok = parity(res)
            if not ok:
                failed.append(case)
            tps = {b: sum(r[case][b]["tokens_per_s"] for r in ranks) for b in backends}
            kind, dim, shape, wrapping = CASES[case]
            row = [case, wrapping, f"{kind} d={dim} x{tuple(shape)}/rank", f"{worst:.2e}", "ok" if ok else "FAIL"]
            row += [f"{tps[b]:,.0f}" for b in backends]
            if "inductor" in tps:
                row.append(f"{tps['gac'] / tps['inductor']:.2f}x")
            rows.append(row)
            reports += [f"- {case}: {r}" for r in res["gac"]["reports"]]

    header = ["case", "wrapping", "model / input", "max |gac - eager|", "parity"]
    header += [f"{b} tokens/s" for b in backends] + (["gac / inductor"] if cuda else [])
    device = (f"2 x {torch.cuda.get_device_name(0)}, NCCL, target cuda" if cuda
              else "CPU, gloo, 2 processes, target cpu")
    text = "\n".join([
        f"# gac inside torch.distributed ({datetime.date.today():%Y-%m-%d})",
        "",
        f"{device}; torch {torch.__version__}. Command: `python benchmarks/bench_distributed.py"
        f"{' --cpu' if a.cpu else ''}`.",
        f"Parity: parameters after {STEPS} SGD steps (lr 0.1), gac vs eager, tolerance "
        f"{TOL['cuda' if cuda else 'cpu']}. Throughput: forward + backward + SGD step, {iters} timed steps "
        "after those, summed over both ranks (tokens = batch x sequence per rank).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "What gac compiled (rank 0, one line per graph in compile order: each forward, then its backward):",
        "",
        *reports,
        "",
    ])
    write_report(text, out)
    if failed:
        print(f"FAIL: parity over tolerance in {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

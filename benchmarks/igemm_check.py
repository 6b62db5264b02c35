"""gac vs eager on bench_h200 workloads without Inductor's compile (which alone takes ~40 s on
the ResNet body): parity with float64, medians of interleaved CUDA-event samples over inputs
rotated past L2, and gac's per-kernel device time (CUPTI). For a quick device check of a
kernel change when the time on the H200 is short; bench_h200.py stays the evidence.

    python benchmarks/igemm_check.py --only resnet50_body_default [--out prof.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_h200 as h  # noqa: E402
from common import time_ms  # noqa: E402


def check(w: h.Workload, rounds: int = 7, iters: int = 4) -> str:
    torch._dynamo.reset()
    sets = [w.make_inputs(s) for s in range(4)]
    lines = [f"## {w.name} ({w.flags})", ""]
    with torch.no_grad():
        ref = h._copy_to(w.model, torch.float64)(*(t.double() for t in sets[0]))
        gac = torch.compile(w.model, backend="gac")
        with h.torch_flags(w.flags):
            t = time.time()
            err = h.rel_err(gac(*sets[0]), ref)
            torch.cuda.synchronize()
            lines.append(f"compile+first call: {time.time() - t:.1f} s; rel err vs float64 {err:.2e} "
                         f"(tol {w.tol:.0e}: {'ok' if err <= w.tol else 'FAIL'})")
            fns = {"eager": w.model, "gac": gac}
            samples: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(rounds):  # interleaved
                for k, fn in fns.items():
                    samples[k].append(time_ms(lambda fn=fn: [fn(*x) for x in sets], (), iters) / len(sets))
            med = {k: statistics.median(v) for k, v in samples.items()}
            lines.append(f"eager {med['eager']:.3f} ms, gac {med['gac']:.3f} ms (gac/eager {med['gac'] / med['eager']:.2f})")
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                for x in sets:
                    gac(*x)
                torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("gac:"):
            per[e.name][0] += getattr(e, "device_time_total", 0) or e.cuda_time_total
            per[e.name][1] += 1
    n = len(sets)
    total = sum(v[0] for v in per.values()) / n / 1e3
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in per.items():
        by_kind[name.rsplit("_", 1)[-1]] += us / n / 1e3
    lines += [f"device time per call: {total:.3f} ms over {sum(v[1] for v in per.values()) / n:.0f} kernels; "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])),
              "", "| kernel | ms/call |", "|---|---|"]
    for name, (us, _) in sorted(per.items(), key=lambda kv: -kv[1][0])[:20]:
        lines.append(f"| `{name[:60]}` | {us / n / 1e3:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", required=True, help="comma-separated bench_h200 workload names")
    ap.add_argument("--conv-flags", default="default", choices=list(h.CONV_FLAGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    h.conv_flags = args.conv_flags
    want = set(args.only.split(","))
    out = []
    groups = {n.split("_")[0] if not n.startswith("resnet") else "resnet" for n in want}  # (name prefixes)
    for g in (h.GROUPS[k] for k in h.GROUPS if k in groups):
        for w in g():
            if w.name in want:
                text = check(w)
                print(text, flush=True)
                out.append(text)
    if args.out:
        Path(args.out).write_text("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention rows of issue 15 (eager / Inductor / gac in one process, parity enforced):
sdpa_{f32,bf16}_{8x8x2500x32,4x16x4096x64} and encoder_layer_1x2500x256.

    python benchmarks/bench_attention.py            # with bench_h200.py present: its runner and
                                                    # JSON (group "attention"); else the small
                                                    # runner below (same method, table only)

`group_attention` is the workload group "attention" of bench_h200.GROUPS.
"""

from __future__ import annotations

import copy
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import time_ms

import gac_torch

try:
    import bench_h200 as h
except ImportError:  # this branch predates bench_h200.py
    h = None


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def _rand(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=dtype)


def attention_workloads() -> Iterator[tuple]:
    """(name, model, make_inputs(seed), flags, precision, tol, TFLOP per call)."""
    for dt, prec, tol in ((torch.float32, "fp32", 1e-5), (torch.bfloat16, "bf16", 1e-2)):
        for b, hh, n, d in ((8, 8, 2500, 32), (4, 16, 4096, 64)):
            yield (f"sdpa_{'f32' if dt == torch.float32 else 'bf16'}_{b}x{hh}x{n}x{d}", Sdpa(),
                   lambda s, b=b, hh=hh, n=n, d=d, dt=dt: tuple(_rand(s * 3 + i, b, hh, n, d, dtype=dt) for i in range(3)),
                   "tf32off", prec, tol, 4 * b * hh * n * n * d / 1e12)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 8, 512, dropout=0.0, batch_first=True).cuda().eval()
    yield ("encoder_layer_1x2500x256", layer, lambda s: (_rand(s, 1, 2500, 256),), "tf32off", "fp32", 1e-4,
           4 * 2500 * 2500 * 256 / 1e12)


def group_attention():
    for name, model, make, flags, prec, tol, tflops in attention_workloads():
        yield h.Workload(name, model, make, flags, prec, tol, {"tflops_per_call": tflops})


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _standalone(rounds: int = 7) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print("| workload | eager ms | inductor ms | gac ms | gac/min | gac TFLOP/s | err | status |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for name, model, make, _flags, _prec, tol, tflops in attention_workloads():
        sets = [make(s) for s in range(3)]
        with torch.no_grad():
            ref = copy.deepcopy(model).double()(*(t.double() for t in sets[0]))
            torch._dynamo.reset()
            variants = {"eager": model, "inductor": torch.compile(model), "gac": torch.compile(model, backend=gac_torch.backend)}
            errs = {k: _rel(fn(*sets[0]), ref) for k, fn in variants.items()}
            for fn in variants.values():
                for x in sets:
                    fn(*x)
            samples: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(rounds):
                for k, fn in variants.items():
                    samples[k].append(time_ms(lambda fn=fn, sets=sets: [fn(*x) for x in sets], (), 5) / len(sets))
        ms = {k: statistics.median(v) for k, v in samples.items()}
        ok = errs["gac"] <= tol
        bad += not ok
        print(f"| {name} | {ms['eager']:.4f} | {ms['inductor']:.4f} | {ms['gac']:.4f} | "
              f"{ms['gac'] / min(ms['eager'], ms['inductor']):.2f} | {tflops / ms['gac'] * 1e3:.1f} | "
              f"{errs['gac']:.1e} | {'ok' if ok else 'FAIL'} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    if h is not None:
        h.GROUPS["attention"] = group_attention
        if "--only" not in sys.argv:
            sys.argv += ["--only", "attention"]
        sys.exit(h.main())
    sys.exit(_standalone())

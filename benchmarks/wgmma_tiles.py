"""Tile variants of the wgmma GEMM (kernels/wgmma_gemm.py) on the H200: each compiled with
GAC_WGMMA_BN / _STAGES / _EPILOGUE / _CLUSTER set, timed against torch (cuBLAS) in one process with CUDA
events (medians over rounds, inputs rotated past L2), checked against a float64 reference.

    python benchmarks/wgmma_tiles.py [--size 4096] [--dtypes bf16,fp16] [--variants 256:3,256:3:c2]

A variant is bn:stages, then optionally :direct (no staged store) and :c2 (CTA pairs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import compile_variants  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}  # tf32: f32, TF32 on


def switches(variant: str) -> str:
    """bn:stages[:direct][:c2] as common.compile_variants' NAME=VALUE+... form."""
    bn, stages, *more = variant.split(":")
    return (f"GAC_WGMMA_BN={bn}+GAC_WGMMA_STAGES={stages}+GAC_WGMMA_EPILOGUE={'direct' if 'direct' in more else 'smem'}"
            f"+GAC_WGMMA_CLUSTER={'2' if 'c2' in more else '1'}")


class Mm(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


def _sample(fn, sets, iters: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(*sets[i % len(sets)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _race(fns: dict, sets, rounds: int = 9, warm_ms: float = 300.0) -> dict:
    """Median ms per call of each function, rounds interleaved after a warm-up of warm_ms
    (clocks ramp up), so every variant sees the same GPU state."""
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record()
    while True:
        for fn in fns.values():
            _sample(fn, sets, 5)
        t1 = torch.cuda.Event(enable_timing=True)
        t1.record()
        torch.cuda.synchronize()
        if t0.elapsed_time(t1) > warm_ms:
            break
    samples: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(_sample(fn, sets))
    return {k: (statistics.median(v), min(v)) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--variants", default="256:3,256:4:direct,128:4,256:3:c2,128:4:c2")
    args = ap.parse_args()
    n = args.size
    for name in args.dtypes.split(","):
        dt = DT[name]
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"  # eager (cuBLAS) and gac alike
        gen = torch.Generator().manual_seed(0)
        sets = [(torch.randn(n, n, generator=gen).to("cuda", dt), torch.randn(n, n, generator=gen).to("cuda", dt))
                for _ in range(5)]  # 5 x 64 MiB: past the L2
        ref = sets[0][0].double() @ sets[0][1].double()
        flops = 2 * n**3
        variants = args.variants.split(",")
        fns = {"eager": torch.matmul, **compile_variants(Mm(), sets, variants, name == "tf32", ref, name,
                                                           {v: switches(v) for v in variants})}
        times = _race(fns, sets)
        eager = times["eager"][0]
        for k, (med, best) in times.items():
            print(f"  {name} {k}: median {med:.4f} ms (min {best:.4f}), {flops / med / 1e12:.0f} TFLOP/s, "
                  f"throughput vs eager {eager / med:.2f}", flush=True)


if __name__ == "__main__":
    main()

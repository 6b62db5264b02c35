"""Env-switch variants of gac's f32 GEMM kernels on the H200, timed against torch (cuBLAS) in
one process with CUDA events (medians of interleaved rounds, inputs rotated past L2), each
checked against a float64 reference. A variant is `NAME=VALUE[+NAME=VALUE...]` (or `default`),
applied while that variant compiles (with the compile cache off):

    python benchmarks/gemm_variants.py --gemm sgemm:nn:4096,sgemm:nt:4096 \
        --variants default,GAC_SGEMM_THREADS=128,GAC_SGEMM_BN=256,GAC_SGEMM_BK=32
    python benchmarks/gemm_variants.py --gemm tf32:nn:2048 --variants default,GAC_WGMMA_BN=128

A GEMM is kind:layout:size; kind sgemm (exact f32, TF32 off) or tf32; layout nn / nt / tn / tt
(A as [m][k] or [k][m], B as [k][n] or [n][k]: an MLP step's forward is nt, its weight
gradients tn, its input gradient nn). `--train 4096` times instead bench_h200's training step
(size -> size -> size GELU MLP, batch size, mse_loss, SGD; TF32 off) per variant against eager,
each variant's gradients checked against eager's from the same weights.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gac_torch  # noqa: E402, F401 (registers the "gac" torch.compile backend)
from common import VariantEnv, compile_variants  # noqa: E402
from wgmma_tiles import _race, _sample  # noqa: E402

FNS = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.t(), "tn": lambda a, b: a.t() @ b,
       "tt": lambda a, b: a.t() @ b.t()}


class Gemm(torch.nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, a, b):
        return FNS[self.layout](a, b)


def _device_ms(fn, sets, iters: int = 20) -> float | None:
    """Device time per call from the profiler (kernels only: free of host time, which can
    exceed a 2048^3 TF32 GEMM's); None where the profiler is not available."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(iters):
                fn(*sets[i % len(sets)])
            torch.cuda.synchronize()
        us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                 for e in prof.key_averages())
        return us / iters / 1e3
    except Exception as e:  # noqa: BLE001 - a missing CUPTI only loses this column
        print(f"  (profiler: {type(e).__name__}: {str(e)[:120]})", flush=True)
        return None


def _own_code(step: torch.nn.Module) -> torch.nn.Module:
    """`step` with its forward on a code object of its own: dynamo keeps compiled graphs per code
    object, and module instances share it (inline_inbuilt_nn_modules), so without this every
    variant would run the first one's kernels (the H200 run of 2026-12-02 did)."""
    f = type(step).forward
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    step.forward = types.MethodType(g, step)
    return step


def train(n: int, variants: list[str], rounds: int) -> None:
    """The MLP training step per variant against eager, each compiled on its own. Switches read
    at import (GAC_SGEMM_EARLY, GAC_SGEMM_SPLIT_K, the LDMATRIX bisect) need a process each."""
    import copy

    from bench_h200 import TrainStep

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.GELU(), torch.nn.Linear(n, n)).cuda()
    gen = torch.Generator().manual_seed(1)
    sets = [(torch.randn(n, n, generator=gen).cuda(), torch.randn(n, n, generator=gen).cuda()) for _ in range(2)]
    ref = [g.double() for g in TrainStep(copy.deepcopy(mlp))(*sets[0])]
    fns = {"eager": TrainStep(copy.deepcopy(mlp))}
    for v in variants:
        step = torch.compile(_own_code(TrainStep(copy.deepcopy(mlp))), backend="gac", options={"cache": False})
        try:
            with VariantEnv(v):
                got = step(*sets[0])  # (compiles forward, backward and update)
                step(*sets[1])
            err = max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref))
            fns[f"{v} grad err {err:.1e}"] = step
            first = _sample(step, sets, 10)  # (a first number, should the race below run out of time)
            print(f"  train_mlp {n}: {v} compiled, grad err {err:.1e}, {first:.3f} ms per step", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            print(f"  train {v}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    times = _race(fns, sets, rounds=rounds)
    eager = times["eager"][0]
    for k, (med, best) in times.items():
        print(f"  train_mlp {n}: {k}: median {med:.3f} ms (min {best:.3f}), vs eager {med / eager:.3f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm", default="sgemm:nn:4096", help="comma-separated kind:layout:size")
    ap.add_argument("--variants", default="default,GAC_SGEMM_THREADS=128,GAC_SGEMM_BN=256,GAC_SGEMM_BK=32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train", type=int, default=0, help="time the MLP training step of this size instead")
    args = ap.parse_args()
    if args.train:
        return train(args.train, args.variants.split(","), args.rounds)
    for gemm in args.gemm.split(","):
        kind, layout, size = gemm.split(":")
        n, tf32 = int(size), kind == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32  # eager (cuBLAS) and gac alike
        gen = torch.Generator().manual_seed(0)
        sets = [(torch.randn(n, n, generator=gen).cuda(), torch.randn(n, n, generator=gen).cuda())
                for _ in range(max(2, -(-256 * 2**20 // (8 * n * n))))]  # past the L2
        model = Gemm(layout)
        ref = model(sets[0][0].double(), sets[0][1].double())
        fns = {"eager": model, **compile_variants(model, sets, args.variants.split(","), tf32, ref, gemm)}
        times = _race(fns, sets, rounds=args.rounds)
        device = {k: _device_ms(fn, sets) for k, fn in fns.items()}
        eager, eager_dev = times["eager"][0], device["eager"]
        for k, (med, best) in times.items():
            dev = device[k]
            kern = "" if dev is None or eager_dev is None else f"; kernels {dev:.4f} ms, vs eager's {eager_dev / dev:.3f}"
            print(f"  {gemm} {k}: median {med:.4f} ms (min {best:.4f}), {2 * n**3 / med / 1e9:.1f} TFLOP/s, "
                  f"throughput vs eager {eager / med:.3f}{kern}", flush=True)


if __name__ == "__main__":
    main()

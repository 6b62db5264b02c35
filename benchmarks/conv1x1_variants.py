"""ResNet-50's 1x1-conv GEMMs (on the wgmma kernel, BatchNorm scale/shift [+ residual] + ReLU in
its epilogue) and its 7x7 stem conv, gac vs eager (cuDNN, channels_last, BatchNorm and ReLU as
torch runs them) in TF32 and bf16, on the H200: CUDA events (medians of interleaved rounds) and
kernel-only device times (profiler), each variant checked against a float64 reference. A
variant is `NAME=VALUE[+NAME=VALUE...]` (or `default`), set while it compiles (cache off):

    python benchmarks/conv1x1_variants.py --variants default,old --prec tf32,bf16

`old`: the tile and epilogue as before issue 14's tuning (BN 256, loads 8 at a time, none
before the main loop, no pairs); `nopre`: the new ones without the loads before the main loop. A 1x1 conv is given as the GEMM it lowers to: x [M, K] (NHWC rows) times
w [N, K]^T; the stem as a module on NCHW input (see _stem).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_variants  # noqa: E402
from gemm_variants import _device_ms  # noqa: E402
from wgmma_tiles import _race  # noqa: E402

ALIASES = {"old": "GAC_WGMMA_NARROW=0+GAC_WGMMA_EPILOGUE_CHUNK=8+GAC_WGMMA_EPILOGUE_PREFETCH=0"
                   "+GAC_WGMMA_EPILOGUE_PAIRS=0",
           "nopre": "GAC_WGMMA_EPILOGUE_PREFETCH=0"}
# (M, K, N, residual): layer 1's widening 1x1 (+ identity residual), its narrowing one, layer 2's
GEMMS = [(144000, 64, 256, True), (144000, 256, 64, False), (36000, 512, 128, False)]


class Gemm1x1(torch.nn.Module):
    def forward(self, x, w, s, t, r=None):
        y = torch.nn.functional.linear(x, w) * s + t
        return torch.relu(y if r is None else y + r)


class Eager1x1(torch.nn.Module):
    """The same op as torch runs the conv: NHWC (channels_last) 1x1 conv, BatchNorm, add, ReLU."""

    def __init__(self, w, s, t) -> None:
        super().__init__()
        self.w, self.s, self.t = w[:, :, None, None].contiguous(memory_format=torch.channels_last), s, t

    def forward(self, x, r=None):
        y = torch.nn.functional.conv2d(x, self.w)
        y = y * self.s[:, None, None] + self.t[:, None, None]
        return torch.relu(y if r is None else y + r)


def _stem(dt: torch.dtype) -> torch.nn.Module:
    """The stem (7x7/2 conv, BatchNorm, ReLU), the max-pool and a 1x1 conv after it (joined to a
    conv, the stem goes NHWC: passes/channels_last.py); GAC_STEM_PAD=0 keeps it on NCHW."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from models import randomize_bn

    torch.manual_seed(0)
    return randomize_bn(torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(64, 64, 1, bias=False))).eval().cuda().to(dt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,old")
    ap.add_argument("--rest-variants", default="default", help="for the GEMMs after the first")
    ap.add_argument("--stem-variants", default="default,GAC_STEM_PAD=0")
    ap.add_argument("--prec", default="tf32,bf16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--what", default="gemm,stem")
    ap.add_argument("--gemms", default="", help="MxKxN[r],... (r: with the residual) instead of GEMMS")
    ap.add_argument("--kernels", action="store_true", help="each variant's kernels' device times too")
    args = ap.parse_args()
    gemms = GEMMS if not args.gemms else [
        (*map(int, g.rstrip("r").split("x")), g.endswith("r")) for g in args.gemms.split(",")]
    for prec in args.prec.split(","):
        tf32, dt = prec == "tf32", torch.bfloat16 if prec == "bf16" else torch.float32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        es = 2 if dt == torch.bfloat16 else 4
        for i, (M, K, N, res) in enumerate(gemms if "gemm" in args.what else []):
            gen = torch.Generator().manual_seed(M + K + N)
            w, s, t = torch.randn(N, K, generator=gen) / K**0.5, torch.rand(N, generator=gen) + 0.5, torch.randn(N, generator=gen)
            x = torch.randn(M, K, generator=gen)
            r = torch.randn(M, N, generator=gen) if res else None
            ref = Gemm1x1()(x.double(), w.double(), s.double(), t.double(), None if r is None else r.double()).cuda()
            cu = [v.to("cuda", dt) for v in (x, w, s, t)] + ([r.to("cuda", dt)] if res else [])
            sets = [tuple(cu), tuple(c.clone() for c in cu)]
            variants = (args.rest_variants if i else args.variants).split(",")
            fns = compile_variants(Gemm1x1(), sets, variants, tf32, ref, aliases=ALIASES)
            eager = Eager1x1(cu[1], cu[2], cu[3])
            nhwc = (6, M // 6 // 200 if M % 1200 == 0 else 1, 200 if M % 1200 == 0 else M // 6)

            def as4(v, c):  # [M, c] rows as a channels_last [6, c, h, w] view
                return v.view(*nhwc, c).permute(0, 3, 1, 2)
            esets = [(as4(st[0], K), as4(st[4], N)) if res else (as4(st[0], K),) for st in sets]
            fns = {"eager": eager, **fns}
            moved = (M * K + M * N * (2 if res else 1)) * es
            _race_pair(fns, sets, esets, moved, args.rounds, f"{prec} 1x1 M={M} K={K} N={N}{' +res' if res else ''}")
        if "stem" in args.what:
            model = _stem(dt)
            gen = torch.Generator().manual_seed(1)
            xs = [torch.randn(6, 3, 480, 800, generator=gen).to("cuda", dt) for _ in range(2)]
            with torch.no_grad():
                ref = model.double()(xs[0].double())
                model = model.to(dt)
                fns = compile_variants(model, [(x,) for x in xs], args.stem_variants.split(","), tf32, ref)
                em = copy.deepcopy(model).to(memory_format=torch.channels_last)  # (gac keeps its own)
                fns = {"eager": em, **fns}
                esets = [(x.contiguous(memory_format=torch.channels_last),) for x in xs]
                moved = (6 * 3 * 480 * 800 + 6 * 64 * 240 * 400) * es  # (the conv's own)
                _race_pair(fns, [(x,) for x in xs], esets, moved, args.rounds, f"{prec} stem 7x7s2+pool+1x1",
                           args.kernels)


def _race_pair(fns: dict, sets, esets, moved: int, rounds: int, name: str, kernels: bool = False) -> None:
    """Each function timed alone (eager on its channels_last views, gac's variants on the
    plain inputs), then the profiler's kernel time (`kernels`: per kernel too)."""
    times, device, per = {}, {}, {}
    for k, fn in fns.items():
        ss = esets if k == "eager" else sets
        times[k] = _race({k: fn}, ss, rounds=rounds)[k]
        if kernels:  # (one profiler run: the kernels' sum is the device time)
            per[k] = _per_kernel_ms(fn, ss)
            device[k] = sum(ms for _, ms in per[k])
        else:
            device[k] = _device_ms(fn, ss)
    eager_dev = device["eager"]
    for k, (med, best) in times.items():
        dev = device[k]
        kern = "" if dev is None else f"; kernels {dev:.4f} ms ({moved / dev / 1e9:.2f} TB/s compulsory)"
        rel = "" if dev is None or eager_dev is None else f", eager/this {eager_dev / dev:.2f}"
        print(f"  {name} {k}: median {med:.4f} ms (min {best:.4f}){kern}{rel}", flush=True)
        if kernels:
            print("    " + ", ".join(f"{n[:48]} {ms:.4f}" for n, ms in per[k]), flush=True)


def _per_kernel_ms(fn, sets, iters: int = 10) -> list[tuple[str, float]]:
    """(kernel, device ms per call) in launch order, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("gac:"):
            per[e.name] = per.get(e.name, 0.0) + (getattr(e, "device_time_total", None) or e.cuda_time_total)
    return [(n, us / iters / 1e3) for n, us in per.items()]


if __name__ == "__main__":
    with torch.no_grad():
        main()

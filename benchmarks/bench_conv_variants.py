"""A/B of implicit-GEMM conv variants on the device: ResNet-50's distinct 3x3 convs and two of its
1x1 convs (+ BatchNorm-eval + ReLU, fused into the kernel) at the BEVFormer input (batch 6, 480x800),
compiled by gac once per variant (environment switches read at compile time, the program cache
off) and timed with CUDA events next to eager (cuDNN); or the whole body, gac only.

    python benchmarks/bench_conv_variants.py --prec tf32,bf16 [--variants gather,copy] [--match k3s1] [--out-dir D]
    python benchmarks/bench_conv_variants.py --resnet default [--wait FILE]   # whole body, gac

Variants: `gather` as before weight_layout.py: the weights read as [f, c, kh, kw] with K =
(kh, kw, c) (c a stride-9 gather), the epilogue per accumulator; `natural` K = (c, kh, kw)
(contiguous weights, im2col indices per element); `peracc` the default but the epilogue per
accumulator; `copy` the default: weights copied to [f, kh, kw, c] first, epilogue loads first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
os.environ["GAC_CACHE"] = "0"  # (the cache does not key on the switches)

_OFF = {"GAC_IGEMM_WEIGHT_LAYOUT": "", "GAC_IGEMM_KORDER": "", "GAC_IGEMM_EPILOGUE_PER_ACC": "",
        "GAC_CONV_WGMMA_TMA": "", "GAC_CONV_WGMMA_BN": "", "GAC_WGMMA_EPILOGUE_CHUNK": "",
        "GAC_CONV_WGMMA_CLUSTER": ""}
VARIANTS = {"gather": {**_OFF, "GAC_IGEMM_WEIGHT_LAYOUT": "0", "GAC_IGEMM_KORDER": "cinner",
                       "GAC_IGEMM_EPILOGUE_PER_ACC": "1"},
            "natural": {**_OFF, "GAC_IGEMM_WEIGHT_LAYOUT": "0"},
            "peracc": {**_OFF, "GAC_IGEMM_EPILOGUE_PER_ACC": "1"},
            "copy": _OFF,
            # cwgmma (sm_90, TF32 / bf16 convs with whole 16-byte channel vectors): `copy` is
            # its default too (TMA boxes for stride-1 convs); `cpasync` the producers' cp.async
            # gather instead; `tma64` 64-wide tiles (the default: 128 for N > 64)
            "cpasync": {**_OFF, "GAC_CONV_WGMMA_TMA": "0"},
            "tma64": {**_OFF, "GAC_CONV_WGMMA_BN": "64"},
            "chunk4": {**_OFF, "GAC_WGMMA_EPILOGUE_CHUNK": "4"},  # (the TMA path's epilogue as before)
            "cluster2": {**_OFF, "GAC_CONV_WGMMA_CLUSTER": "2"}}  # (CTA pairs multicasting B)
# (cin, h, w, cout, k, stride): ResNet-50's 3x3 convs at batch 6 (x count in the body), two 1x1
SHAPES = [(64, 120, 200, 64, 3, 1), (128, 120, 200, 128, 3, 2), (128, 60, 100, 128, 3, 1),
          (256, 60, 100, 256, 3, 2), (256, 30, 50, 256, 3, 1), (512, 30, 50, 512, 3, 2),
          (512, 15, 25, 512, 3, 1), (64, 120, 200, 256, 1, 1), (1024, 30, 50, 256, 1, 1)]
COUNT = {SHAPES[0]: 3, SHAPES[1]: 1, SHAPES[2]: 3, SHAPES[3]: 1, SHAPES[4]: 5, SHAPES[5]: 1, SHAPES[6]: 2,
         SHAPES[7]: 4, SHAPES[8]: 5}


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a smoke run of the script itself)


def _time(fn, x, iters: int = 10, rounds: int = 5) -> float:
    for _ in range(3):
        fn(x)
    if DEV == "cpu":
        t = time.perf_counter()
        fn(x)
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn(x)
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def convs(precs: list[str], variants: list[str], budget_s: float = 1e9, match: str = "",
          chain: bool = False) -> list[dict]:
    """`chain`: each conv twice (the second cout -> cout, stride 1, + BatchNorm + ReLU) on a
    channels-last input: gac's layout pass keeps a chain's activations NHWC (what the ResNet
    body runs: cwgmma on sm_90), a lone NCHW conv stays NCHW (igemm)."""
    from models import randomize_bn

    rows: list[dict] = []
    t0 = time.time()
    pats = match.split(",") if match else [""]
    order = sorted((min(j for j, m in enumerate(pats) if m in f"{cin}x{h}x{w}_{cout}_k{k}s{s}"), i)
                   for i, (cin, h, w, cout, k, s) in enumerate(SHAPES)
                   if any(m in f"{cin}x{h}x{w}_{cout}_k{k}s{s}" for m in pats))
    for pos, (_, i) in enumerate(order):  # (each shape in every precision first; --match's order)
        cin, h, w, cout, k, s = SHAPES[i]
        if time.time() - t0 > budget_s:
            print(f"budget: {[SHAPES[j] for _, j in order[pos:]]} not run", flush=True)
            break
        for prec in precs:
            torch.backends.cudnn.allow_tf32 = prec == "tf32"
            dt = torch.bfloat16 if prec == "bf16" else torch.float32
            torch.manual_seed(i)
            blocks = [(cin, s), (cout, 1)] if chain else [(cin, s)]
            model = randomize_bn(torch.nn.Sequential(*[m for c, st in blocks for m in (
                torch.nn.Conv2d(c, cout, k, st, k // 2, bias=False), torch.nn.BatchNorm2d(cout),
                torch.nn.ReLU())])).eval().to(DEV)
            x = torch.randn(6 if DEV == "cuda" else 1, cin, h // 8 if DEV == "cpu" else h, w // 8 if DEV == "cpu" else w, device=DEV)
            if chain:
                x = x.to(memory_format=torch.channels_last)
            with torch.no_grad():
                ref = model.double()(x.double())
                model = model.to(dt)
                x = x.to(dt)
                flop = 2 * x.shape[0] * cout * ref.shape[2] * ref.shape[3] * k * k * sum(c for c, _ in blocks)
                row = {"conv": f"{cin}x{h}x{w}_{cout}_k{k}s{s}" + ("_x2" if chain else ""), "prec": prec, "count": COUNT[SHAPES[i]],
                       "eager_ms": round(_time(model, x), 4)}
                for v in variants:
                    for key, val in VARIANTS[v].items():  # ("": unset)
                        os.environ.pop(key, None) if val == "" else os.environ.__setitem__(key, val)
                    torch._dynamo.reset()
                    t = time.time()
                    try:
                        f = torch.compile(model, backend="gac")
                        row[f"{v}_err"] = float(f"{_rel(f(x), ref):.2e}")
                        row[f"{v}_ms"] = round(_time(f, x), 4)
                        row[f"{v}_tflops"] = round(flop / row[f"{v}_ms"] / 1e9, 1)
                    except Exception as e:  # noqa: BLE001  (report, keep going)
                        row[f"{v}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    row[f"{v}_compile_s"] = round(time.time() - t, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    for v in VARIANTS.values():
        for key in v:
            os.environ.pop(key, None)
    return rows


def resnet(flags: str, wait: str | None) -> dict:
    """The ResNet-50 body under bench_h200's flags, gac only (compiled, then timed once `wait`
    exists: other GPU work can run during the compile)."""
    import bench_h200 as bh

    body = bh._resnet50().cuda()
    xs = [bh._rand(s, *bh.BEV_INPUT) for s in range(2)]
    with torch.no_grad():
        ref = body.double()(xs[0].double())
        body = body.float()
        with bh.torch_flags(flags):
            t = time.time()
            f = torch.compile(body, backend="gac")
            err = bh.rel_err(f(xs[0]), ref)
            torch.cuda.synchronize()
            compile_s = time.time() - t
            while wait and not os.path.exists(wait):
                time.sleep(0.5)
            ms = _time(lambda _: [f(x) for x in xs], None, iters=3) / len(xs)
    row = {"workload": f"resnet50_body_{flags}", "gac_ms": round(ms, 3), "rel_err": float(f"{err:.2e}"),
           "compile_s": round(compile_s, 1), "env": {k: v for k, v in os.environ.items() if k.startswith("GAC_")}}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prec", default="tf32,bf16")
    ap.add_argument("--variants", default="gather,copy")
    ap.add_argument("--resnet", default="", help="time the whole body under these bench_h200 flags instead")
    ap.add_argument("--wait", default=None)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no conv after this many seconds")
    ap.add_argument("--chain", action="store_true", help="each conv twice, NHWC (see convs)")
    ap.add_argument("--match", default="", help="only the convs whose name contains one of these (comma-separated)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.resnet:
        rows = [resnet(args.resnet, args.wait)]
        name = f"resnet_{args.resnet}.json"
    else:
        variants = args.variants.split(",")
        rows = convs(args.prec.split(","), variants, args.budget_s, args.match, args.chain)
        name = "conv_variants.json"
        for prec in args.prec.split(","):  # the body's 3x3 convs, each as often as the body has it
            mine = [r for r in rows if r["prec"] == prec]
            tot = {v: sum(r["count"] * r.get(f"{v}_ms", float("nan")) for r in mine) for v in ["eager", *variants]}
            print(f"{prec}: these convs as often as the body has them, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in tot.items()))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / name).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

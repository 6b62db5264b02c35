"""Flash-attention tilings timed side by side on the GPU (one process, eager as the yardstick):
for each SDPA bench shape, the default plan and forced (warps, BN) tilings, with the error
against float64. Used to choose `flash_attention.plan`'s tiles per head dim from measurements.

    python benchmarks/flash_variants.py [--rounds 7] [--only bf16] [--quick] [--shape 8x8x2500x32]

Method (/work/.library/device/METHOD.md): CUDA events after warm-up, medians of interleaved
rounds, input sets rotated past L2; `ratio` = variant / eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import time_ms  # noqa: E402

import gac_torch  # noqa: E402
from gac_torch.backends.cuda import kernel_prep  # noqa: E402
from gac_torch.kernels import flash_attention as fa  # noqa: E402
from tests.parity import Fn  # noqa: E402

SHAPES = [(8, 8, 2500, 32), (4, 16, 4096, 64)]
# ((warps, BN) or None for the default plan, register cap or None for the default, m-tiles a warp,
# K/V stages or None for the plan's choice)
VARIANTS = {"bf16": [(None, None, 1, None), (None, None, 1, 1), ((4, 128), None, 1, None), ((8, 128), None, 1, None),
                     ((4, 64), None, 1, None), ((8, 32), None, 1, None), ((4, 64), None, 2, None),
                     ((4, 128), None, 2, None)],
            "f32": [(None, None, 1, None), (None, 255, 1, None), ((4, 64), None, 1, None), ((8, 16), None, 1, None)]}
# --quick (the GPU check of branch flash): the default (at D <= 32 f16/bf16: 4 warps of 2 m-tiles),
# 8 warps of one (the default before), 4 warps of one
QUICK = [(None, None, 1, None), ((8, 64), None, 1, None), ((4, 64), None, 1, None)]
DT = {"bf16": torch.bfloat16, "f32": torch.float32}


def _compile(inputs: tuple, tiles: tuple[int, int] | None, maxnreg: int | None, mt: int, stages: int | None):
    orig, orig_reg = fa.plan, kernel_prep.flash_maxnreg
    if tiles is not None or stages is not None:
        fa.plan = lambda spec, *a, **k: orig(spec, *a, **({"tiles": (tiles,), "mt": mt} if tiles else {}), stages=stages)
    if maxnreg is not None:
        kernel_prep.flash_maxnreg = lambda kernel: maxnreg
    try:
        c = gac_torch.compile(Fn(F.scaled_dot_product_attention), inputs, target="cuda",
                              options={"fallback": False, "cache": False})
    finally:
        fa.plan, kernel_prep.flash_maxnreg = orig, orig_reg
    ptx = c.ir("ptx")
    launch = [line for line in ptx.splitlines() if line.startswith("// launch") and "flash" in line]
    if not launch:
        raise RuntimeError("no flash kernel (the tiling does not fit)")
    return c, launch[0].split(" grid=")[1].split(" [")[0]


def race(fns: dict, sets: list[tuple], ref: torch.Tensor, rounds: int, sample_ms: float = 15.0
         ) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's (fn, _) error on sets[0] against `ref`, and its median ms a call over
    interleaved rounds (every input set per sample: rotated past L2)."""
    errs = {k: ((fn(*sets[0]).double() - ref).norm() / ref.norm()).item() for k, (fn, _) in fns.items()}
    nsets, est = len(sets), {}
    for k, (fn, _) in fns.items():
        for x in sets:
            fn(*x)
        torch.cuda.synchronize()
        est[k] = time_ms(lambda fn=fn: [fn(*x) for x in sets], (), 1) / nsets
    reps = max(1, int(sample_ms / max(max(est.values()), 1e-3) / nsets))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (fn, _) in fns.items():
            samples[k].append(time_ms(lambda fn=fn: [fn(*x) for x in sets], (), reps) / nsets)
    return errs, {k: statistics.median(v) for k, v in samples.items()}


TABLE_HEAD = "| shape | variant | grid/block | ms | / eager | TFLOP/s | err |\n|---|---|---|---|---|---|---|\n"


def table_rows(dname: str, shape: tuple, fns: dict, med: dict[str, float], errs: dict[str, float]) -> list[str]:
    """Markdown rows: ms, ratio to eager, TFLOP/s (4·B·H·L·S·D), error."""
    flops = 4 * shape[0] * shape[1] * shape[2] * shape[2] * shape[3]
    return [f"| {dname} {'x'.join(map(str, shape))} | {k} | {grid} | {med[k]:.4f} | {med[k] / med['eager']:.2f} | "
            f"{flops / med[k] / 1e9:.0f} | {errs[k]:.2e} |" for k, (_, grid) in fns.items()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="bf16,f32")
    ap.add_argument("--quick", action="store_true", help="bf16: only the QUICK variants")
    ap.add_argument("--shape", action="append", help="BxHxLxD (repeatable; default both bench shapes)")
    args = ap.parse_args()
    shapes = [tuple(map(int, x.split("x"))) for x in args.shape] if args.shape else SHAPES
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    rows = []
    for dname in args.only.split(","):
        for shape in shapes:
            g = torch.Generator(device="cuda").manual_seed(0)
            nbytes = 4 * torch.Size(shape).numel() * DT[dname].itemsize
            nsets = max(2, min(6, -(-2 * 60 * 2**20 // nbytes) + 1))
            sets = [tuple(torch.randn(shape, generator=g, device="cuda", dtype=DT[dname]) for _ in range(3))
                    for _ in range(nsets)]
            with torch.no_grad():
                ref = F.scaled_dot_product_attention(*(t.double() for t in sets[0]))
                fns = {"eager": (F.scaled_dot_product_attention, "")}
                for tiles, reg, mt, stages in (QUICK if args.quick and dname == "bf16" else VARIANTS[dname]):
                    name = (f"gac {tiles or 'default'}{f' mt {mt}' if mt > 1 else ''}{f' maxnreg {reg}' if reg else ''}"
                            f"{f' stages {stages}' if stages else ''}")
                    try:
                        fns[name] = _compile(sets[0], tiles, reg, mt, stages)
                    except Exception as e:  # noqa: BLE001  (a tiling that does not apply: report it)
                        print(f"{dname} {shape} {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                errs, med = race(fns, sets, ref, args.rounds)
                del ref
            rows += table_rows(dname, shape, fns, med, errs)
    print(TABLE_HEAD + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

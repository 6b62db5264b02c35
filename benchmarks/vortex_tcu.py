"""Tensor-core (TCU) GEMM (gac_torch/kernels/vortex_tcu_gemm.py) vs the tiled local-memory f32 GEMM
on Vortex SimX built with the TCU (CONFIGS=-DVX_CFG_EXT_TCU_ENABLE).

    VORTEX_HOME=/path/to/tcu/simx/build python benchmarks/vortex_tcu.py \
        --shapes 64x64x64 128x128x128 256x128x192 --out benchmarks/results/vortex_tcu.md

A shape is MxKxN (`a @ b`); MxKxNt is `a @ b.t()` with b of shape (N, K), the form of a linear
layer (B's k-pairs contiguous: one 32-bit load each). Variants: `tcu`, f16 `a @ b` with option vortex_tcu (one kernel: the WMMA
GEMM into f32, the rounding to f16 in its store step); `tcu-gemm`, the same with the epilogue
off (`compile_flags(gemm_epilogue=False)`: the GEMM kernel stores f32, a second `loops` kernel
rounds): its first launch is the GEMM alone; `tiled`, the product in f32 through the tiled GEMM
(the default for f32; vortex_tcu off). Counters of each launch come from one run
(deterministic); results are checked against float64 first (tcu: f16 output rounding, relative
to the largest |result|; tiled: f32).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch

import gac_torch
from gac_torch.backends import vortex

from common import write_report  # also puts tests/ on sys.path
from parity import Fn

TOL = {"tcu": 1e-3, "tcu-gemm": 1e-3, "tiled": 1e-5}   # max |err| / max |ref|
VARIANTS = tuple(TOL)


def run(m: int, k: int, n: int, variant: str, mode: str, trans: bool = False) -> dict:
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    a, b = torch.randn(m, k, generator=g), torch.randn(*((n, k) if trans else (k, n)), generator=g)
    tcu = variant.startswith("tcu")
    dt = torch.float16 if tcu else torch.float32
    a, b = a.to(dt), b.to(dt)
    with vortex.compile_flags(gemm_epilogue=variant != "tcu-gemm"):
        compiled = gac_torch.compile(Fn((lambda x, y: x @ y.t()) if trans else (lambda x, y: x @ y)), (a, b), target="vortex",
                                     options={"vortex_mode": mode, "vortex_tcu": tcu, "fallback": False})
    start = time.perf_counter()
    out = compiled(a, b)
    wall = time.perf_counter() - start
    ref = a.double() @ (b.double().t() if trans else b.double())
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    if rel > TOL[variant]:
        raise AssertionError(f"{variant} {m}x{k}x{n}: relative error {rel:.3g} > {TOL[variant]}")
    c = vortex.last_counters(compiled)
    gemm = c["kernels"][0]
    return dict(c, gemm=gemm, wall=wall, rel=rel)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["64x64x64"])
    p.add_argument("--mode", default="simx", choices=["simx", "functional"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.mode == "simx" and not os.environ.get("VORTEX_HOME"):
        sys.exit("--mode simx needs VORTEX_HOME (a Vortex build with the TCU); or pass --mode functional")
    rows = []
    for shape in args.shapes:
        m, k, n = (int(x) for x in shape.rstrip("t").split("x"))
        res = {v: run(m, k, n, v, args.mode, shape.endswith("t")) for v in VARIANTS}
        rows.append((shape, res))
        print(shape, {v: (r["gemm"]["instructions"], r["gemm"]["cycles"]) for v, r in res.items()}, flush=True)
    where = ("SimX (Vortex v3.0 with the TCU), 1 core x 4 warps x 4 threads" if args.mode == "simx"
             else "functional simulator (no cycles)")
    lines = [
        "# Vortex tensor-core GEMM (WMMA) vs the tiled local-memory f32 GEMM",
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `VORTEX_HOME=<TCU SimX build> python "
        f"benchmarks/vortex_tcu.py --shapes {' '.join(args.shapes)} --mode {args.mode}"
        f"{' --out ' + str(args.out) if args.out else ''}`",
        "",
        f"Device: {where}; host {platform.machine()}, torch {torch.__version__}. `a @ b`, shape MxKxN; MxKxNt: `a @ b.t()`, b (N, K) (a linear layer's weight). "
        "Counters per launch (instruction counts are deterministic, SimX cycles vary by ~1% between runs); `rel err` = max |out - float64| / max |float64|.",
        "",
        "* tcu: f16 inputs, option `vortex_tcu`: `gac_torch/kernels/vortex_tcu_gemm.py`, a CTA of 4 warps, "
        "one 8x4 f32 tile per warp, one WMMA (8x4 += 8x8 @ 8x4, 16 micro-ops) per 8-deep K step, "
        "operand k-pairs loaded from global memory; the rounding of C to f16 in the store step.",
        "* tcu-gemm: the same with the epilogue off: the GEMM kernel stores f32 (its counters below), "
        "a second `loops` kernel rounds to f16 (`other kernels`).",
        "* tiled: f32 inputs, `gac_torch/kernels/vortex_gemm.py` (the default f32 GEMM): 4x4-thread CTA, "
        "4x4 register tile per thread, K staged 16 deep through local memory.",
        "",
        "| shape | variant | GEMM kernel | warp instr | cycles | IPC | other kernels' cycles | rel err | sim wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, res in rows:
        for v, r in res.items():
            g = r["gemm"]
            ipc = f"{g['instructions'] / g['cycles']:.2f}" if g["cycles"] else "n/a"
            rest = (r["cycles"] - g["cycles"]) if r["cycles"] is not None else None
            lines.append(f"| {shape} | {v} | {g['kernel']} | {g['instructions']} | {g['cycles']} | {ipc} | "
                         f"{rest if len(r['kernels']) > 1 else '-'} | {r['rel']:.2g} | {r['wall']:.1f} |")
    lines += ["", "| shape | GEMM cycles tiled / tcu-gemm | warp instructions tiled / tcu-gemm | "
              "cycles tiled / tcu (f16 result, one launch) |", "|---|---|---|---|"]
    for shape, res in rows:
        t, u, f = res["tiled"], res["tcu-gemm"], res["tcu"]
        if u["gemm"]["cycles"]:
            lines.append(f"| {shape} | {t['gemm']['cycles'] / u['gemm']['cycles']:.2f}x | "
                         f"{t['gemm']['instructions'] / u['gemm']['instructions']:.2f}x | "
                         f"{t['cycles'] / f['cycles']:.2f}x |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

"""Tiled local-memory GEMM (gac_torch/kernels/vortex_gemm.py) vs our scalar matmul on Vortex.

    VORTEX_HOME=/path/to/vortex/install python benchmarks/vortex_gemm.py \
        --sizes 32 64 --out benchmarks/results/vortex_gemm.md [--config device]

Both variants compile `a @ b` (f32, M = N = K = size) through the vortex target; the scalar one
disables the GEMM template (`vortex.compile_flags(tiled_gemm=False)`), so the matmul takes the
generic `loops` strategy: one thread per output element, K sequential, operands from global
memory. Counters come from one launch on SimX (deterministic: one run per variant); results are
checked against torch first. Speedup = scalar cycles / tiled cycles. `--config device` compiles
for the configuration the SimX build reports (option `vortex_config`, e.g. a 4-core build).
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


def run(size: int, tiled: bool, mode: str, config: str | None = None) -> dict:
    g = torch.Generator().manual_seed(size)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    with vortex.compile_flags(tiled_gemm=tiled):
        compiled = gac_torch.compile(Fn(lambda x, y: x @ y), (a, b), target="vortex",
                                     options={"vortex_mode": mode, "vortex_config": config})
    start = time.perf_counter()
    out = compiled(a, b)
    wall = time.perf_counter() - start
    torch.testing.assert_close(out, a @ b, rtol=1e-4, atol=1e-4)
    c = vortex.last_counters(compiled)
    (k,) = c["kernels"]
    cfg = next(iter(compiled.compiled.partitions.values())).executable.device.config
    return dict(c, kernel=k["kernel"], wall=wall, config=cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    p.add_argument("--mode", default="simx", choices=["simx", "functional"])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--config", default=None, help="option vortex_config: CxWxT or device")
    args = p.parse_args()
    if args.mode == "simx" and not os.environ.get("VORTEX_HOME"):
        sys.exit("--mode simx needs VORTEX_HOME (a Vortex build); or pass --mode functional")
    rows = []
    for n in args.sizes:
        tiled, scalar = run(n, True, args.mode, args.config), run(n, False, args.mode, args.config)
        rows.append((n, tiled, scalar))
        print(f"{n}^3: tiled {tiled['instructions']} instr / {tiled['cycles']} cycles, "
              f"scalar {scalar['instructions']} / {scalar['cycles']}", flush=True)

    def ratio(s: dict, t: dict, key: str) -> str:
        return f"{s[key] / t[key]:.2f}x" if s[key] and t[key] else "n/a"

    cfg = rows[0][1]["config"]
    where = (f"SimX (Vortex v3.0), {cfg.cores} core(s) x {cfg.warps} warps x {cfg.threads} threads"
             if args.mode == "simx" else "functional simulator (no cycles)")
    lines = [
        "# Vortex GEMM: tiled local-memory kernel vs scalar matmul",
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `VORTEX_HOME=... python "
        f"benchmarks/vortex_gemm.py --sizes {' '.join(map(str, args.sizes))} --mode {args.mode}"
        f"{' --out ' + str(args.out) if args.out else ''}{' --config ' + args.config if args.config else ''}`",
        "",
        f"Device: {where}; "
        f"host {platform.machine()}, torch {torch.__version__}. f32 `a @ b`, M = N = K = size; "
        "one launch per variant, counters of that launch (deterministic).",
        "",
        "* tiled: `gac_torch/kernels/vortex_gemm.py` — 4x4-thread CTA, 4x4 register tile per "
        "thread (16x16 C tile), K staged 16 deep through local memory, two barriers per stage.",
        "* scalar: the generic `loops` mapping — one thread per C element, K sequential, "
        "operands read from global memory (`compile_flags(tiled_gemm=False)`).",
        "",
        "| size | variant | kernel | warp instructions | cycles | IPC | sim wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, t, s in rows:
        for name, c in (("tiled", t), ("scalar", s)):
            ipc = f"{c['instructions'] / c['cycles']:.2f}" if c["cycles"] else "n/a"
            lines.append(f"| {n}^3 | {name} | {c['kernel']} | {c['instructions']} | {c['cycles']} | "
                         f"{ipc} | {c['wall']:.1f} |")
    lines += ["", "| size | speedup in cycles (scalar / tiled) | instruction ratio |", "|---|---|---|"]
    lines += [f"| {n}^3 | {ratio(s, t, 'cycles')} | {ratio(s, t, 'instructions')} |" for n, t, s in rows]
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

"""The Hopper flash-attention kernel (kernels/flash_wgmma.py) timed against eager and the mma.sync
flash kernel on the SDPA bench shapes, over its tilings (GAC_FLASH_WGMMA_{WGS,BN,STAGES}), with
the error against float64. Used to choose flash_wgmma.plan's defaults from measurements.

    python benchmarks/fa3_variants.py [--rounds 5] [--dtype bf16] [--quick]
        [--shape 4x16x4096x64] [--variants "fa3 default,fa3 sums by adds"]

Method as flash_variants.py: CUDA events after warm-up, medians of interleaved rounds, input sets
rotated past L2; `ratio` = variant / eager.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from flash_variants import TABLE_HEAD, race, table_rows  # noqa: E402

import gac_torch  # noqa: E402
from tests.parity import Fn  # noqa: E402

SHAPES = [(4, 16, 4096, 64), (8, 8, 2500, 32)]
VARIANTS = {  # name -> environment
    "mma.sync flash": {"GAC_FLASH_WGMMA": "0"},
    "fa3 default": {"GAC_FLASH_WGMMA": "1"},
    "fa3 sums by adds": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_ONESUM": "0"},
    "fa3 wgs 2": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_WGS": "2"},
    "fa3 wgs 2 pingpong": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_WGS": "2", "GAC_FLASH_WGMMA_PINGPONG": "1"},
    "fa3 before (3 stages + adds)": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_WGS": "2", "GAC_FLASH_WGMMA_STAGES": "3",
                                    "GAC_FLASH_WGMMA_ONESUM": "0"},  # (the kernel measured before)
    "fa3 wgs 3 bn 128": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_WGS": "3", "GAC_FLASH_WGMMA_BN": "128"},
    "fa3 bn 192": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_BN": "192"},
    "fa3 bn 192 pingpong": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_BN": "192", "GAC_FLASH_WGMMA_PINGPONG": "1"},
    "fa3 stages 2": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_STAGES": "2"},
    "fa3 one CTA a tile": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_PERSISTENT": "0"},
    "fa3 pingpong": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_PINGPONG": "1"},
    "fa3 poly 1": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_POLY": "1"},
    "fa3 poly 1 pingpong": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_POLY": "1", "GAC_FLASH_WGMMA_PINGPONG": "1"},
    "fa3 poly 2": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_POLY": "2"},
    "fa3 poly 2 pingpong": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_POLY": "2", "GAC_FLASH_WGMMA_PINGPONG": "1"},
    "fa3 bn 64": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_BN": "64"},
    "fa3 wgs 3 bn 64": {"GAC_FLASH_WGMMA": "1", "GAC_FLASH_WGMMA_WGS": "3", "GAC_FLASH_WGMMA_BN": "64"},
}
assert not any("," in name for name in VARIANTS)  # (--variants splits at commas)
QUICK = ("fa3 default", "fa3 pingpong", "fa3 poly 2")  # --quick (the GPU check)
DT = {"bf16": torch.bfloat16, "f16": torch.float16}


def _compile(inputs: tuple, env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        c = gac_torch.compile(Fn(F.scaled_dot_product_attention), inputs, target="cuda",
                              options={"fallback": False, "cache": False})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ptx = c.ir("ptx")
    launch = [line for line in ptx.splitlines() if line.startswith("// launch") and ("_fa3" in line or "flash" in line)]
    return c, launch[0].split(" grid=")[1].split(" [")[0] if launch else "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--shape", action="append", help="BxHxLxD (repeatable; default both bench shapes)")
    ap.add_argument("--variants", help=f"comma-separated names of {list(VARIANTS)}")
    args = ap.parse_args()
    pick = args.variants.split(",") if args.variants else None
    if pick and not set(pick) <= set(VARIANTS):
        ap.error(f"unknown variants {set(pick) - set(VARIANTS)}")
    rows = []
    for shape in [tuple(map(int, x.split("x"))) for x in args.shape] if args.shape else SHAPES:
        dt = DT[args.dtype]
        g = torch.Generator(device="cuda").manual_seed(0)
        nbytes = 4 * torch.Size(shape).numel() * dt.itemsize
        nsets = max(2, min(6, -(-2 * 60 * 2**20 // nbytes) + 1))
        sets = [tuple(torch.randn(shape, generator=g, device="cuda", dtype=dt) for _ in range(3)) for _ in range(nsets)]
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(*(t.double() for t in sets[0]))
            fns = {"eager": (F.scaled_dot_product_attention, "")}
            for name, env in VARIANTS.items():
                if (args.quick and name not in QUICK) or (pick and name not in pick):
                    continue
                try:
                    fns[name] = _compile(sets[0], env)
                except Exception as e:  # noqa: BLE001  (report a variant that fails, go on)
                    print(f"{shape} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            errs, med = race(fns, sets, ref, args.rounds, sample_ms=10.0)
            del ref
        rows += table_rows(args.dtype, shape, fns, med, errs)
        print("\n".join(rows[-len(fns):]), flush=True)
    print(TABLE_HEAD + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

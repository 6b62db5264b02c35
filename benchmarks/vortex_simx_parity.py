"""Op and model parity on the vortex target, SimX vs the functional simulator, with counters.

    VORTEX_HOME=/path/to/vortex/install python benchmarks/vortex_simx_parity.py \
        --out benchmarks/results/vortex_simx.md

Runs every op case of tests/test_vortex_target.py (CASES) and its three models on both
simulators (the same .vxbin), checks each result against eager (tests/parity.py tolerances) and
records warp instructions (must agree between the two), SimX cycles and the functional
simulator's divergent-branch count (must be 0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

import gac_torch
from gac_torch.backends import vortex

from common import write_report  # also puts tests/ on sys.path
from models import MODEL_TOL
from parity import check_op
from test_vortex_target import CASES, _models

MODES = ("functional", "simx")
os.environ.setdefault("GAC_VORTEX_SIMX_TIMEOUT", "120")   # a lost SimX launch: rerun (runtime.py)


def _run_case(name: str, inputs: list) -> dict:
    compiled = check_op(CASES[name][0], inputs, target="vortex", what=name)  # raises on a mismatch
    return vortex.last_counters(compiled)


def _run_model(name: str, inputs: tuple) -> dict:
    model = _models()[name][0]
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(model, inputs), target="vortex")
        torch.testing.assert_close(compiled(*inputs), model(*inputs), **MODEL_TOL)
    return vortex.last_counters(compiled)


def measure(kind: str, name: str) -> dict:
    out: dict = {"name": f"{kind} {name}"}
    inputs = CASES[name][1]() if kind == "op" else _models()[name][1]   # same data on both
    for mode in MODES:
        home = os.environ.pop("VORTEX_HOME", None) if mode == "functional" else None
        start = time.perf_counter()
        try:
            c = _run_case(name, inputs) if kind == "op" else _run_model(name, inputs)
            out[mode] = dict(c, ok=True, wall=time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 (recorded as a failure)
            out[mode] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}",
                         "wall": time.perf_counter() - start}
        finally:
            if home is not None:
                os.environ["VORTEX_HOME"] = home
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("-k", default="", help="only names containing this")
    args = p.parse_args()
    if not os.environ.get("VORTEX_HOME"):
        sys.exit("needs VORTEX_HOME (a Vortex build with SimX)")
    jobs = [("op", n) for n in sorted(CASES)] + [("model", n) for n in ("mlp", "cnn", "transformer")]
    rows = []
    for kind, name in jobs:
        if args.k in name:
            rows.append(measure(kind, name))
            r = rows[-1]
            print(r["name"], {m: (r[m].get("instructions"), r[m].get("cycles"), r[m]["ok"]) for m in MODES},
                  flush=True)
    passed = {m: sum(r[m]["ok"] for r in rows) for m in MODES}
    same = sum(r["simx"].get("instructions") == r["functional"].get("instructions") for r in rows)
    total_i = sum(r["simx"].get("instructions") or 0 for r in rows)
    total_c = sum(r["simx"].get("cycles") or 0 for r in rows)
    lines = [
        "# Vortex target on SimX: op and model parity with counters", "",
        f"Date: {datetime.date.today().isoformat()}. Command: `VORTEX_HOME=... python "
        "benchmarks/vortex_simx_parity.py --out benchmarks/results/vortex_simx.md`", "",
        "SimX: vortexgpgpu/vortex d76b7f24e (v3.0) default build (1 core x 4 warps x 4 threads, "
        "16 KiB local memory; gac_torch/backends/vortex/README.md says how it was built); "
        "functional: our simulator (same .vxbin). Cases: tests/test_vortex_target.py `CASES` and "
        "its models (MLP 8x32, SmallCNN 1x3x16x16, TransformerEncoderLayer(64, 4) 1x8x64); each "
        "checked against eager with tests/parity.py tolerances. Counters are summed over the "
        "graph's launches.", "",
        f"* passed: SimX {passed['simx']}/{len(rows)}, functional {passed['functional']}/{len(rows)}",
        f"* identical warp-instruction counts on both simulators: {same}/{len(rows)}",
        f"* divergent branches (functional): {sum(r['functional'].get('divergent_branches') or 0 for r in rows)}",
        f"* SimX restarts after a launch SimX never reported finished (rerun, see runtime.py): "
        f"{sum(r['simx'].get('simx_restarts') or 0 for r in rows)}",
        f"* SimX totals: {total_i} warp instructions, {total_c} cycles "
        f"(IPC {total_i / max(total_c, 1):.2f})", "",
        "| case | ok (SimX / func.) | launches | warp instructions | SimX cycles | IPC | SimX wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, f = r["simx"], r["functional"]
        ok = f"{'yes' if s['ok'] else 'NO'} / {'yes' if f['ok'] else 'NO'}"
        if not s["ok"]:
            lines.append(f"| {r['name']} | {ok} | | | | | {s['wall']:.1f} ({s['error']}) |")
            continue
        ipc = s["instructions"] / s["cycles"] if s["cycles"] else 0
        lines.append(f"| {r['name']} | {ok} | {s['launches']} | {s['instructions']} | {s['cycles']} | "
                     f"{ipc:.2f} | {s['wall']:.1f} |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

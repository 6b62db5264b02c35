"""Cold and warm compile times of BEVFormer beside Inductor's, each in a new process.

    python benchmarks/compile_time.py --config test_tiny --target cpu --out results.md
    python benchmarks/compile_time.py --config tiny --target cuda          # on the GPU machine
    python benchmarks/compile_time.py --config tiny --target cuda --rows cold,warm   # no GPU: PTX only
    python benchmarks/compile_time.py --config resnet50_body --target cuda --workers 2

`--config` is a BEVFormer preset or `resnet50_body` (the tiny config's ResNet-50 on 6x3x480x800,
bench_h200's workload). Without a GPU, `--target cuda` compiles for sm_90 up to PTX and runs
nothing (no outputs compared, no load or Inductor rows: they need the device). `--workers N` sets
GAC_COMPILE_WORKERS (the processes that compile cuda kernels; default: the CPUs).

Rows (each a fresh interpreter, so nothing is shared in memory):
  gac cold     gac_torch.compile(ExportedProgram) into an empty GAC_CACHE_DIR
  gac warm     the same into the cache the cold run filled (the on-disk cache's hit path)
  gac load     gac_torch.load of a file gac_torch.save wrote (no MLIR, no export)
  inductor     torch.compile(backend="inductor") cold, then warm (its own on-disk caches)
Times are wall seconds of the compile call, and its CPU seconds (this process and its children:
llc, the linker), which a loaded machine inflates far less (export and imports shown apart; a first
gac_torch.load also imports torch's deserializer, so it is timed again); every gac row checks its
outputs equal the cold run's bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time
def cpu(children_only=False):  # CPU s of this process and its finished children (llc, cuda workers)
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime + (0 if children_only else s.ru_utime + s.ru_stime)
def task_cpu():  # per thread of this process (Linux): "tid name" -> CPU s
    out = {}
    for tid in (os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{tid} {name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out
t0 = time.perf_counter()
import torch, gac_torch
from gac_torch.models.bevformer import build_bevformer, make_test_inputs
imports = time.perf_counter() - t0
config, target, what, path, root = sys.argv[1:6]
device = target == "cuda" and torch.cuda.is_available()
dev = "cuda" if device else "cpu"
options = {"arch": "sm_90"} if target == "cuda" and not device else None  # PTX without a GPU
if config == "resnet50_body":
    sys.path[:0] = [os.path.join(root, "benchmarks"), os.path.join(root, "tests")]
    from bench_h200 import BEV_INPUT, _resnet50
    model = _resnet50().to(dev).eval()
    inputs = (torch.randn(*BEV_INPUT, generator=torch.Generator().manual_seed(0)).to(dev),)
else:
    model = build_bevformer(config, seed=0).to(dev).eval()
    inputs = tuple(t.to(dev) for t in make_test_inputs(model.cfg, frame=0))
row = {"imports_s": round(imports, 2)}
with torch.no_grad():
    if what == "load":
        t, c = time.perf_counter(), cpu()
        compiled = gac_torch.load(path)
        row["compile_s"], row["compile_cpu_s"] = time.perf_counter() - t, cpu() - c
        # again in the same process: without the first call's imports of torch's deserializer
        t = time.perf_counter(); gac_torch.load(path); row["again_s"] = time.perf_counter() - t
    elif what.startswith("inductor"):
        fn = torch.compile(model, backend="inductor")
        t, c = time.perf_counter(), cpu()
        fn(*inputs)
        row["compile_s"], row["compile_cpu_s"] = time.perf_counter() - t, cpu() - c
        compiled = fn
    else:
        t = time.perf_counter(); ep = torch.export.export(model, inputs); row["export_s"] = time.perf_counter() - t
        t, c, k, tasks = time.perf_counter(), cpu(), cpu(True), task_cpu()
        compiled = gac_torch.compile(ep, target=target, options=options)
        row["compile_s"], row["compile_cpu_s"] = time.perf_counter() - t, cpu() - c
        row["children_cpu_s"] = cpu(True) - k
        # CPU s per thread of this process during the compile (name: s), the busy ones: a thread
        # other than the compile's own taking the GIL slows the compile without showing in it
        row["threads_cpu_s"] = {n: round(s - tasks.get(n, 0), 2) for n, s in task_cpu().items()
                                if s - tasks.get(n, 0) >= 0.05}
        if what == "save":
            gac_torch.save(compiled, path)
    if target != "cuda" or device:
        t = time.perf_counter()
        out = compiled(*inputs)
        if device:
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t  # cuda: the driver JIT-compiles the PTX
        torch.save([o.cpu() for o in (out if isinstance(out, (tuple, list)) else [out])], path + f".{what}.out")
row["mlir_imported"] = "mlir" in sys.modules
print("ROW " + json.dumps(row))
"""


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, target: str, what: str, path: str, env: dict, timeout: float,
        show_log: bool = False) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, config, target, what, path, ROOT], env=env,
                       capture_output=True, text=True, timeout=timeout)
    rows = [line for line in p.stdout.splitlines() if line.startswith("ROW ")]
    if p.returncode or not rows:
        raise SystemExit(f"{what} failed:\n{p.stderr[-4000:]}")
    if show_log:  # gac's log lines (timestamped by torch's handler under TORCH_LOGS)
        print("\n".join(line for line in p.stderr.splitlines() if "gac" in line and "cache " not in line))
    return json.loads(rows[-1][4:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="test_tiny")
    ap.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None, help="append a markdown table here")
    ap.add_argument("--skip-inductor", action="store_true", help="gac rows only (Inductor's cold compile is slow)")
    ap.add_argument("--rows", default="cold,warm,save,load,inductor_cold,inductor_warm",
                    help="which rows, comma-separated")
    ap.add_argument("--workers", type=int, default=None, help="GAC_COMPILE_WORKERS for the gac rows")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per row (a row past it is reported)")
    ap.add_argument("--show-log", action="store_true",
                    help="print each row's gac log lines (with TORCH_LOGS=+gac_torch: the stages' times)")
    args = ap.parse_args()
    import torch

    work = tempfile.mkdtemp(prefix="gac_compile_time_")
    path = os.path.join(work, "model.gac")
    env = dict(os.environ, GAC_CACHE="1", GAC_CACHE_DIR=os.path.join(work, "gac_cache"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor_cache"))
    if args.workers:
        env["GAC_COMPILE_WORKERS"] = str(args.workers)
    device = args.target != "cuda" or torch.cuda.is_available()
    runs = [r for r in args.rows.split(",") if r]
    if args.skip_inductor or not device:
        runs = [r for r in runs if not r.startswith("inductor")]
    if not device:  # gac_torch.load needs the target's device
        runs = [r for r in runs if r != "load"]
    if "load" in runs and "save" not in runs:
        runs.insert(runs.index("load"), "save")
    rows, notes = {}, []
    for what in runs:
        try:
            rows[what] = run(args.config, args.target, what, path, env, args.timeout, args.show_log)
        except subprocess.TimeoutExpired:
            notes.append(f"{what}: not finished in {args.timeout:.0f} s")
            continue
        print(what, rows[what], flush=True)
    if device and os.path.exists(f"{path}.cold.out"):
        ref = torch.load(f"{path}.cold.out")
        for what in ("warm", "save", "load"):
            if what in rows:
                got = torch.load(f"{path}.{what}.out")
                rows[what]["identical"] = all(torch.equal(a, b) for a, b in zip(got, ref))
    gpu = torch.cuda.get_device_name() if args.target == "cuda" and device else "no GPU: sm_90 PTX, nothing run"
    title = "ResNet-50 body (BEVFormer-tiny's)" if args.config == "resnet50_body" else f"BEVFormer {args.config}"
    lines = [f"## {title} on {args.target}: compile time ({datetime.date.today()}, "
             f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
             f"{', ' + gpu if args.target == 'cuda' else ''}, "
             f"compile workers {args.workers or 'default'})", "",
             "| run | compile s | compile CPU s | first call s | export s | imports s | MLIR imported | outputs identical to cold |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if "again_s" in rows.get("load", {}):
        rows["load"]["compile_s_text"] = f"{rows['load']['compile_s']:.2f} ({rows['load']['again_s']:.2f} again)"
    names = {"cold": "gac cold (empty cache)", "warm": "gac warm (cache hit, new process)",
             "save": "gac compile + save (cache hit)", "load": "gac_torch.load (new process)",
             "inductor_cold": "inductor cold", "inductor_warm": "inductor warm (its caches)"}
    for what, row in rows.items():
        shown = row.get("compile_s_text", f"{row['compile_s']:.2f}")
        cpu_s = f"{row['compile_cpu_s']:.2f}" if "compile_cpu_s" in row else "-"
        if row.get("children_cpu_s"):
            cpu_s += f" ({row['children_cpu_s']:.2f} in children)"
        first = f"{row['first_call_s']:.2f}" if "first_call_s" in row else "-"
        lines.append(f"| {names[what]} | {shown} | {cpu_s} | {first} | {row.get('export_s', 0):.2f} | "
                     f"{row['imports_s']:.2f} | {row['mlir_imported']} | {row.get('identical', '-')} |")
    text = "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

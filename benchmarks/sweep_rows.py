"""Device time of gac's one-pass row kernels (kernels/rows.py) per plan -- threads per row forced,
the default plan first -- against eager's kernels and a copy of the same bytes (the bandwidth
ceiling), from CUPTI (torch.profiler), so gac's host time per call does not enter.

    python benchmarks/sweep_rows.py [--out sweep.md] [--groups 32,128,256] [--only layernorm_65536x1024]
        [--env "GAC_ROWS_STREAM=0,GAC_ROWS_STREAM=0;GAC_ROWS_RCP=0"]   # the default plan under
                              # each environment (variants split at ',', variables at ';'), one process
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import gac_torch  # noqa: E402
from gac_torch.kernels import rows  # noqa: E402
from parity import Fn  # noqa: E402  (a function as a module)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


WORK = {  # name -> (fn, x shape, number of (C,) parameters)
    "layernorm_65536x1024": (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5), (65536, 1024), 2),
    "rmsnorm_65536x1024": (_rms, (65536, 1024), 1),
    "softmax_32768x2048": (lambda x: torch.softmax(x, -1), (32768, 2048), 0),
    "log_softmax_32768x2048": (lambda x: torch.log_softmax(x, -1), (32768, 2048), 0),
    "layernorm_2500x256": (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5), (2500, 256), 2),
    "mse_loss_4096x4096": (lambda x, y: F.mse_loss(x, y), (4096, 4096), -1),
}


def device_ms(fn, args, iters: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*args)
        torch.cuda.synchronize()
    us = sum(getattr(e, "device_time_total", 0) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("gac:"))
    return us / iters / 1e3


def forced_plan(group: int | None):
    orig = rows.plan

    def plan(R, C, vec, warp=32, threads=256, max_elems=32, max_threads=1024, min_block_group=64, pref_elems=16):
        p = orig(R, C, vec, warp, threads, max_elems, max_threads, min_block_group, pref_elems)
        if p is None or group is None:
            return p
        slots = -(-(C // vec) // group)
        if slots * vec > 64:  # more than 64 registers of row: not worth trying
            return None
        return rows.Plan(R, C, vec, group, slots, group if group > warp else threads, warp)

    return plan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--groups", default="32,64,128,256,512")
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--env", default="", help="environments to compare on the default plan: A=1;B=0,A=0")
    args = ap.parse_args()
    groups: list[int | str | None] = [None] + [int(g) for g in args.groups.split(",") if g]
    groups += [e for e in args.env.split(",") if e]
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# row kernels, device time (CUPTI), {torch.cuda.get_device_name()}", "",
             "| workload | copy ms | eager ms | gac plan | gac ms | gac TB/s | gac/copy bw | gac/eager |",
             "|---|---|---|---|---|---|---|---|"]
    orig = rows.plan
    for name, (fn, shape, n_par) in WORK.items():
        if args.only and name not in args.only.split(","):
            continue
        x = torch.randn(shape, device="cuda", generator=g)
        inputs = [x] + ([torch.randn(shape, device="cuda", generator=g)] if n_par < 0 else
                        [torch.rand(shape[-1], device="cuda", generator=g) + 0.5 for _ in range(n_par)])
        nbytes = sum(t.numel() * t.element_size() for t in inputs) + (x.numel() * 4 if n_par >= 0 else 4)
        copy = device_ms(lambda t: t.clone(), [x]) * nbytes / (2 * x.numel() * 4)
        eager = device_ms(fn, inputs)
        ref = fn(*[t.double() for t in inputs])
        for grp in groups if n_par >= 0 else [None]:
            env = dict(kv.split("=", 1) for kv in grp.split(";")) if isinstance(grp, str) else {}
            rows.plan = forced_plan(None if isinstance(grp, str) else grp)
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda",
                                             options={"fallback": False, "cache": False})
                out = compiled(*inputs)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = device_ms(compiled, inputs)
                kern = "+".join(re.findall(r"// launch gac_k\d+_(\w+) ", compiled.ir("gpu")))
            except Exception as e:  # noqa: BLE001  (a plan that fails is reported)
                lines.append(f"| {name} | | | {grp} | {type(e).__name__}: {str(e)[:80]} | | | |")
                continue
            finally:
                rows.plan = orig
                for k, v in saved.items():
                    if v is None:
                        del os.environ[k]
                    else:
                        os.environ[k] = v
            tbps = nbytes / (ms / 1e3) / 1e12
            lines.append(f"| {name} | {copy:.4f} | {eager:.4f} | {grp or 'default'} ({kern}) err {err:.1e} | "
                         f"{ms:.4f} | {tbps:.2f} | {copy / ms:.2f} | {ms / eager:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

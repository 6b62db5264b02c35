"""Where gac's GPU time goes: per-kernel device time (torch.profiler/CUPTI, which sees the kernels
gac launches through the driver API) and host time per call, for named workloads.

    python benchmarks/profile_h200.py --only resnet50_body_default,layernorm_65536x1024 --out prof.md

Workloads are bench_h200's (every group's: the norms are its `norms` group). Profile
before optimizing: a kernel's share of the device time says what to work on next.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_h200 as h  # noqa: E402


def all_workloads():
    for g in h.GROUPS.values():
        yield from g()


def profile(w, iters: int, top: int = 30) -> str:
    torch._dynamo.reset()
    x = w.make_inputs(0)
    fn = torch.compile(w.model, backend="gac")
    lines = [f"## {w.name} ({w.flags})", ""]
    with torch.no_grad(), h.torch_flags(w.flags):
        t = time.time()
        fn(*x)
        torch.cuda.synchronize()
        lines.append(f"compile+first call: {time.time() - t:.1f} s")
        for _ in range(3):
            fn(*x)
        torch.cuda.synchronize()
        # host time per call: the time to issue `iters` calls, measured before the queue drains
        n = max(iters, 20)
        t = time.perf_counter()
        for _ in range(n):
            fn(*x)
        host = (time.perf_counter() - t) / n * 1e3
        torch.cuda.synchronize()
        lines.append(f"host time per call (issue only): {host:.3f} ms")
        launch_of: dict[str, str] = {}
        lines += host_breakdown(fn, x, launch_of)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(iters):
                fn(*x)
            torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        # "gac:<partition>" is gac's own profiler range mirrored on the GPU timeline: not a kernel
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("gac:"):
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name][1] += 1
    total = sum(v[0] for v in per.values()) / iters / 1e3
    lines += [f"device time per call: {total:.3f} ms over {sum(v[1] for v in per.values()) / iters:.0f} kernels",
              "", "| kernel | ms/call | share | launches/call | strategy grid block smem |", "|---|---|---|---|---|"]
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        ms = us / iters / 1e3
        lines.append(f"| `{name[:90]}` | {ms:.4f} | {ms / max(total, 1e-9):.1%} | {n / iters:.1f} "
                     f"| {launch_of.get(name, '')} |")
    return "\n".join(lines) + "\n"


def host_breakdown(fn, x, launch_of: dict[str, str], n: int = 20) -> list[str]:
    """gac's share of the host time: per compiled partition, the host time of a call to it
    (CompiledGraph: its executable's `call`, or the checks and `run` where that declines) and of
    its executable's `call` and `call_guarded` alone (the path dynamo's guarded inputs take),
    with the executable's launch statistics (tables and graphs built, replays, pool misses)."""
    from gac_torch.frontends.dynamo import compiled_graphs

    seen: dict[int, tuple] = {}
    parts = [cg for c in compiled_graphs for cg in c.partitions.values()]
    # (restored as they were: re-setting cg.executable would also drop an in-place update's
    # donation, and the profile would then time AOTAutograd's copy-back as 4 DtoD memcpys)
    saved = [(cg, cg._call, cg._guarded) for cg in parts]
    for cg in parts:  # the partitions' arguments, caught where every call passes
        for attr in ("_call", "_guarded"):  # (the checked path; dynamo's guarded one)
            real = getattr(cg, attr)

            def spy(args, cg=cg, real=real):
                seen.setdefault(id(cg), (cg, list(args)))
                return real(args) if real is not None else None

            setattr(cg, attr, spy)
    try:
        fn(*x)
    finally:
        for cg, call, guarded in saved:
            cg._call, cg._guarded = call, guarded
    torch.cuda.synchronize()
    lines = []
    for cg, a in seen.values():
        t = time.perf_counter()
        for _ in range(n):
            cg(*a)
        part = (time.perf_counter() - t) / n * 1e3
        exe = ""
        dense = all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in a)
        for what, call in (("call", cg._call), ("call_guarded", cg._guarded if dense else None)):
            if call is not None:  # (call_guarded reads pointers only: dense inputs only)
                t = time.perf_counter()
                for _ in range(n):
                    taken = call(a) is not None
                exe += (f", executable.{what} {(time.perf_counter() - t) / n * 1e3:.4f} ms"
                        f"{'' if taken else ' (declines)'}")
        torch.cuda.synchronize()
        program_launches = getattr(getattr(cg.executable, "program", None), "launches", ())
        launches = len(program_launches)
        for k in program_launches:  # what each kernel is: its strategy and launch shape
            launch_of[k.kernel] = f"{k.strategy} {tuple(map(str, k.grid))} {k.block} {k.shared_mem}"
        lines.append(f"  partition {cg.name} ({launches} launches, {len(a)} inputs): call {part:.4f} ms"
                     f"{exe}; {getattr(cg.executable, 'stats', {})}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", required=True, help="comma-separated workload names")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=30, help="kernels listed per workload")
    args = ap.parse_args()
    want = args.only.split(",")
    found = {w.name: w for w in all_workloads() if w.name in want}
    out = []
    for name in want:
        if name not in found:
            out.append(f"## {name}: unknown workload\n")
            continue
        try:
            out.append(profile(found[name], args.iters, args.top))
        except Exception as e:  # noqa: BLE001  (report and go on to the next workload)
            out.append(f"## {name}: {type(e).__name__}: {e}\n")
        print(out[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

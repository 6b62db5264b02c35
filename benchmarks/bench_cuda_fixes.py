"""cuda target: tensor-core matmuls and per-call overhead, eager vs gac (plain launches) vs gac
(CUDA graph replay), on one GPU.

    python benchmarks/bench_cuda_fixes.py --out results.md

Method as bench_baseline.py (../.library device METHOD.md): compile and check against eager
first, warm up, then CUDA-event medians of `--rounds` interleaved samples of `--iters`
back-to-back calls. "host us/call" is wall time per call over 200 back-to-back calls with one
synchronize at the end: the per-call CPU cost when the GPU work is small.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import time

import torch
from common import REL_TOL, Gemm, LinearGelu, cuda_randn, failed, parity, small_models, time_ms, write_report


def workloads():
    """(name, model, inputs, allow_tf32)."""
    rnd = cuda_randn()
    f16, bf16 = torch.float16, torch.bfloat16
    yield "gemm fp16 4096^3", Gemm(), (rnd(4096, 4096, dtype=f16), rnd(4096, 4096, dtype=f16)), False
    yield "gemm bf16 4096^3", Gemm(), (rnd(4096, 4096, dtype=bf16), rnd(4096, 4096, dtype=bf16)), False
    yield "gemm fp16 1024x4096x1024", Gemm(), (rnd(1024, 4096, dtype=f16), rnd(4096, 1024, dtype=f16)), False
    yield "gemm fp32 2048^3 (exact)", Gemm(), (rnd(2048, 2048), rnd(2048, 2048)), False
    yield "gemm fp32 2048^3 (tf32 allowed)", Gemm(), (rnd(2048, 2048), rnd(2048, 2048)), True
    yield "gelu(x@w+b)*s fp16 4096x1024x1024", LinearGelu(), (
        rnd(4096, 1024, dtype=f16), rnd(1024, 1024, dtype=f16), rnd(1024, dtype=f16), rnd(1024, dtype=f16)), False
    for name, model, inputs in small_models(rnd):
        yield name, model, inputs, False


def host_us(fn, args, n: int = 200) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from gac_torch.frontends import dynamo as gac_dynamo

    rows = []
    for name, model, inputs, tf32 in workloads():
        torch._dynamo.reset()
        torch.backends.cuda.matmul.allow_tf32 = tf32  # read by eager and by gac at compile time
        with torch.no_grad():
            ref = model(*inputs)
            compiled = torch.compile(model, backend="gac")
            try:
                out = compiled(*inputs)
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append((name, {}, {}, "", failed(name, f"gac raised {type(e).__name__}: {str(e)[:80]}")))
                continue
            cfx = gac_dynamo.compiled_graphs[-1]
            exes = [p.executable for p in cfx.partitions.values()]
            progs = [e.program for e in exes if hasattr(e, "program")]
            strategies = sorted({k.strategy for pr in progs for k in pr.launches})
            n_launch = sum(len(pr.launches) for pr in progs)
            wide = copy.deepcopy(model).double()(*[i.double() for i in inputs]).float()
            err = ((out.float() - wide).norm() / wide.norm()).item()
            eerr = ((ref.float() - wide).norm() / wide.norm()).item()

            def gac_plain(*a, _c=compiled, _e=exes):
                for e in _e:
                    e.use_graphs = False
                return _c(*a)

            def gac_graphs(*a, _c=compiled, _e=exes):
                for e in _e:
                    e.use_graphs = True
                return _c(*a)

            variants = {"eager": model, "gac": gac_plain, "gac+graphs": gac_graphs}
            for fn in variants.values():
                for _ in range(4):
                    fn(*inputs)
            torch.cuda.synchronize()
            gout = gac_graphs(*inputs)
            gerr = ((gout.float() - wide).norm() / wide.norm()).item()
            samples = {k: [] for k in variants}
            for _ in range(args.rounds):
                for k, fn in variants.items():
                    samples[k].append(time_ms(fn, inputs, args.iters))
            med = {k: statistics.median(v) for k, v in samples.items()}
            host = {k: host_us(fn, inputs) for k, fn in variants.items()}
        tol = REL_TOL["tf32" if tf32 else inputs[0].dtype]
        verdict = parity(f"{name} gac", err, tol), parity(f"{name} gac+graphs", gerr, tol)
        status = (f"rel.err vs fp64: gac {err:.1e}, gac+graphs {gerr:.1e}, eager {eerr:.1e} (tol {tol:.0e}): "
                  f"{' / '.join(verdict)}; {n_launch} kernels ({', '.join(strategies)})")
        rows.append((name, med, host, f"{cfx.report.percent:.0f}%", status))
        print(name, {k: round(v, 4) for k, v in med.items()}, {k: round(v, 1) for k, v in host.items()},
              status, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    lines = [
        (f"# cuda target: tensor cores and call overhead ({datetime.date.today()}, "
         f"{torch.cuda.get_device_name()}, torch {torch.__version__})"),
        "",
        (f"Command: `python benchmarks/bench_cuda_fixes.py` (CUDA-event medians of {args.rounds} "
         f"interleaved rounds x {args.iters} calls after warm-up; host us/call: 200 calls, one sync)."),
        "",
        "gac is the default configuration (CUDA graphs off); gac+graphs replays CUDA graphs (an option).",
        "",
        ("| workload | eager ms | gac ms | gac+graphs ms | eager/gac | eager/(gac+graphs) "
         "| host us/call eager / gac / gac+graphs | coverage | check |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, med, host, cov, status in rows:
        e, g, gg = med.get("eager"), med.get("gac"), med.get("gac+graphs")
        fmt = (lambda v: f"{v:.4f}" if v is not None else "-")
        ratio = (lambda a, b: f"{a / b:.2f}" if a and b else "-")
        hs = " / ".join(f"{host[k]:.0f}" for k in ("eager", "gac", "gac+graphs")) if host else "-"
        lines.append(f"| {name} | {fmt(e)} | {fmt(g)} | {fmt(gg)} | {ratio(e, g)} | {ratio(e, gg)} | {hs} | {cov} "
                     f"| {status} |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()

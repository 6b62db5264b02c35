"""Eager vs Inductor vs gac on the H200, one process, workload groups; parity enforced.

    python benchmarks/bench_h200.py                      # every group
    python benchmarks/bench_h200.py --only gemm,conv     # some groups

Writes benchmarks/results/h200_latest.json (a list of rows {"workload", "eager_ms",
"inductor_ms", "gac_ms", "flags", "max_rel_err", "commit", "date", ...}; rows of groups not run
are kept) and benchmarks/results/h200_<date>.md, and copies both to $OUT when it is set.

Method (.library/device/METHOD.md): each workload is compiled and warmed up first (compile time
excluded and printed), then timed with CUDA events over `iters` calls per sample, the three
variants interleaved round by round, medians reported; each call takes the next of several input
sets whose bytes exceed twice the L2, so no variant reads its inputs from cache. Parity:
max_rel_err = the largest ||out - ref|| / ||ref|| over the outputs, ref = the model in float64
(fp32 data, same inputs); a row over its precision's tolerance is FAIL and the script exits 1.

A group is a function yielding Workloads; add one by adding a function to GROUPS.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import Gemm, time_ms

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
L2_BYTES = 60 * 2**20  # H200 (read off the device when possible, see _l2_bytes)
# relative-norm tolerance vs float64 per precision (METHOD.md's bands; deep nets a notch looser)
TOL = {"fp32": 1e-5, "tf32": 3e-3, "fp16": 2e-3, "bf16": 1e-2}
NET_TOL = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    make_inputs: Callable[[int], tuple[torch.Tensor, ...]]  # seed -> one input set on the GPU
    flags: str  # "tf32off" | "tf32on" | "default" | "bf16autocast"
    precision: str  # key of TOL
    tol: float
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# flags


@contextlib.contextmanager
def torch_flags(flags: str) -> Iterator[None]:
    """tf32off: TF32 nowhere; tf32on: matmul + conv TF32; default: torch's defaults (convs TF32,
    matmuls not); bf16autocast: default flags + bf16 autocast around every call."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = flags == "tf32on"
        torch.set_float32_matmul_precision("high" if flags == "tf32on" else "highest")
        torch.backends.cudnn.allow_tf32 = flags != "tf32off"
        with torch.autocast("cuda", dtype=torch.bfloat16) if flags == "bf16autocast" else contextlib.nullcontext():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


# --------------------------------------------------------------------------------------------
# groups


def _rand(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=dtype)


def group_gemm() -> Iterator[Workload]:
    for name, n, dt, flags, prec in (
            ("gemm_bf16_4096", 4096, torch.bfloat16, "tf32off", "bf16"),
            ("gemm_fp16_4096", 4096, torch.float16, "tf32off", "fp16"),
            ("gemm_fp32_2048_tf32off", 2048, torch.float32, "tf32off", "fp32"),
            ("gemm_fp32_2048_tf32on", 2048, torch.float32, "tf32on", "tf32")):
        yield Workload(name, Gemm(), lambda s, n=n, dt=dt: (_rand(s, n, n, dtype=dt), _rand(s + 1000, n, n, dtype=dt)),
                       flags, prec, TOL[prec], {"tflops_per_call": 2 * n**3 / 1e12})


def _resnet50(with_fpn: bool = False) -> torch.nn.Module:
    from gac_torch.models.bevformer.backbone import ResNet
    from gac_torch.models.bevformer.config import get_config
    from gac_torch.models.bevformer.fpn import FPN

    sys.path.insert(0, str(ROOT / "tests"))
    from models import randomize_bn

    torch.manual_seed(0)
    cfg = get_config("tiny")
    body = randomize_bn(ResNet(cfg)).eval()
    if not with_fpn:
        return body
    return torch.nn.ModuleDict({"backbone": body, "neck": FPN(cfg.fpn_in_channels, cfg.embed_dims, cfg.num_outs)})


BEV_INPUT = (6, 3, 480, 800)


def bevformer_tiny_convs() -> list[tuple[tuple[int, ...], torch.nn.Conv2d]]:
    """(input shape, conv) for each distinct conv of the BEVFormer-tiny backbone + FPN, in order."""
    net = _resnet50(with_fpn=True)
    seen: dict[tuple, tuple] = {}

    def hook(mod, args, _out):
        x = args[0]
        key = (tuple(x.shape), mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride,
               mod.padding, mod.dilation, mod.groups, mod.bias is not None)
        seen.setdefault(key, (tuple(x.shape), mod))

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad(), torch.device("meta"):
        x = torch.empty(BEV_INPUT, device="meta")
        feats = net["backbone"].to("meta")(x)
        net["neck"].to("meta")(feats)
    for h in handles:
        h.remove()
    return list(seen.values())


CONV_FLAGS = {"tf32off": "fp32", "default": "tf32", "bf16autocast": "bf16"}
conv_flags = "tf32off"  # --conv-flags


def group_conv() -> Iterator[Workload]:
    prec = CONV_FLAGS[conv_flags]
    for i, (shape, mod) in enumerate(bevformer_tiny_convs()):
        torch.manual_seed(i)
        conv = torch.nn.Conv2d(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride,
                               mod.padding, mod.dilation, mod.groups, mod.bias is not None)
        conv = conv.to("cuda").eval()
        k, s = mod.kernel_size[0], mod.stride[0]
        name = f"conv_{shape[1]}x{shape[2]}x{shape[3]}_{mod.out_channels}_k{k}s{s}"
        oh = (shape[2] + 2 * mod.padding[0] - k) // s + 1
        ow = (shape[3] + 2 * mod.padding[1] - k) // s + 1
        flops = 2 * shape[0] * mod.out_channels * oh * ow * mod.in_channels * k * k / mod.groups / 1e12
        suffix = "" if conv_flags == "tf32off" else f"_{conv_flags}"
        yield Workload(name + suffix, conv, lambda seed, shape=shape: (_rand(seed, *shape),), conv_flags, prec,
                       TOL[prec], {"tflops_per_call": flops})


def group_resnet() -> Iterator[Workload]:
    body = _resnet50().cuda()
    for suffix, flags, prec in (("fp32", "tf32off", "fp32"), ("default", "default", "tf32"),
                                ("bf16", "bf16autocast", "bf16")):
        yield Workload(f"resnet50_body_{suffix}", body, lambda seed: (_rand(seed, *BEV_INPUT),), flags, prec,
                       NET_TOL[prec])


def group_attention() -> Iterator[Workload]:
    """SDPA and the encoder layer (issue 15), defined in bench_attention.py."""
    import bench_attention

    yield from bench_attention.group_attention()


# -- launch overhead, training steps, sampling (issue 15 points 3-5) ------------------------------
# extra keys run_workload reads: "fresh_model" (each variant gets its own copy: a training step
# updates its parameters), "graphs_off" (also time gac with cuda_graphs=False).


class Chain200(torch.nn.Module):
    """200 elementwise ops on small tensors: launch-bound (eager launches 200 kernels)."""

    def forward(self, x, a, b):
        for _ in range(50):
            x = torch.tanh(x * a + b) * 0.5
        return x


def group_launch() -> Iterator[Workload]:
    yield Workload("launch_bound_200", Chain200(), lambda s: tuple(_rand(s + 100 * i, 64, 64) for i in range(3)),
                   "tf32off", "fp32", TOL["fp32"], {"graphs_off": True})


class TrainStep(torch.nn.Module):
    """One SGD step of `net` on mse_loss; returns the gradients (compared with float64).
    torch.compile traces the forward and loss (AOT autograd compiles forward and backward),
    breaks at backward(), and compiles the update."""

    def __init__(self, net: torch.nn.Module, lr: float = 1e-3):
        super().__init__()
        self.net, self.lr = net, lr

    def forward(self, x, target):
        params = list(self.net.parameters())
        with torch.enable_grad():
            for p in params:
                p.grad = None
            torch.nn.functional.mse_loss(self.net(x), target).backward()
        grads = [p.grad for p in params]
        with torch.no_grad():
            for p in params:
                p.sub_(p.grad, alpha=self.lr)
        return grads


def group_train() -> Iterator[Workload]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
    yield Workload("train_mlp_fp32", TrainStep(mlp).cuda(),
                   lambda s: (_rand(s, 4096, 4096), _rand(s + 1000, 4096, 4096)), "tf32off", "fp32",
                   NET_TOL["fp32"], {"fresh_model": True})
    torch.manual_seed(1)
    enc = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True)
    yield Workload("train_encoder_fp32", TrainStep(enc).cuda(),
                   lambda s: (_rand(s, 8, 512, 256), _rand(s + 1000, 8, 512, 256)), "tf32off", "fp32",
                   NET_TOL["fp32"], {"fresh_model": True})


class GridSampleMsda(torch.nn.Module):
    """One level of multi-scale deformable attention's sampling (as in
    gac_torch/models/bevformer/attention.py): bilinear, zeros padding, align_corners=False."""

    def forward(self, value, grid):
        return torch.nn.functional.grid_sample(value, grid, mode="bilinear", padding_mode="zeros",
                                               align_corners=False)


def _grid(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(shape, generator=g, device="cuda") * 2.2 - 1.1  # some points outside: zeros


def group_sampling() -> Iterator[Workload]:
    yield Workload("grid_sample_msda", GridSampleMsda(), lambda s: (_rand(s, 8, 32, 15, 25), _grid(s + 1000, 8, 2500, 32, 2)),
                   "tf32off", "fp32", TOL["fp32"])


def group_norms() -> Iterator[Workload]:
    """One pass per row (issue 15): `bytes_per_call` (input read once + output written once)
    gives gac_tbps, to hold against the copy bandwidth."""

    class LayerNorm(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.ln = torch.nn.LayerNorm(n)

        def forward(self, x):
            return self.ln(x)

    class Softmax(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)

    class RMSNorm(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(n) + 0.5)

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w

    torch.manual_seed(0)
    for name, model, (m, n) in (("layernorm_65536x1024", LayerNorm(1024), (65536, 1024)),
                                ("rmsnorm_65536x1024", RMSNorm(1024), (65536, 1024)),
                                ("softmax_32768x2048", Softmax(), (32768, 2048))):
        yield Workload(name, model.cuda(), lambda s, m=m, n=n: (_rand(s, m, n),), "tf32off", "fp32", TOL["fp32"],
                       {"bytes_per_call": 2 * 4 * m * n})


GROUPS: dict[str, Callable[[], Iterator[Workload]]] = {
    "gemm": group_gemm, "conv": group_conv, "resnet": group_resnet, "attention": group_attention,
    "launch": group_launch, "train": group_train, "sampling": group_sampling,
    "norms": group_norms,
}


# --------------------------------------------------------------------------------------------
# measuring


def _l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size) or L2_BYTES
    except (AttributeError, RuntimeError):
        return L2_BYTES


def _outputs(y) -> list[torch.Tensor]:
    if isinstance(y, torch.Tensor):
        return [y]
    if isinstance(y, dict):
        y = list(y.values())
    return [t for x in y for t in _outputs(x)]


def rel_err(got, ref) -> float:
    errs = [((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
            for a, b in zip(_outputs(got), _outputs(ref))]
    return max(errs) if all(math.isfinite(e) for e in errs) else float("inf")  # NaN fails


def run_workload(w: Workload, rounds: int, sample_ms: float) -> dict:
    row: dict = {"workload": w.name, "flags": w.flags, "precision": w.precision, "tol": w.tol}
    t0 = time.time()
    x0 = w.make_inputs(0)
    nbytes = sum(t.numel() * t.element_size() for t in x0)
    sets = [x0] + [w.make_inputs(s) for s in range(1, min(8, max(2, -(-2 * _l2_bytes() // max(nbytes, 1)) + 1)))]
    torch._dynamo.reset()
    with torch.no_grad():
        model64 = _copy_to(w.model, torch.float64)
        ref = model64(*(t.double() for t in x0))
        del model64
        fresh = (lambda: _copy_to(w.model, torch.float32)) if w.extra.get("fresh_model") else (lambda: w.model)
        variants: dict[str, Callable] = {"eager": fresh()}
        with torch_flags(w.flags):
            variants["inductor"] = torch.compile(fresh())
            variants["gac"] = torch.compile(fresh(), backend="gac")
            if w.extra.get("graphs_off"):
                variants["gac_nographs"] = torch.compile(fresh(), backend="gac", options={"cuda_graphs": False})
            errs = {}
            for name in list(variants):
                t = time.time()
                try:
                    out = variants[name](*x0)  # compiles
                    torch.cuda.synchronize()
                    errs[name] = rel_err(out, ref)
                except Exception as e:  # noqa: BLE001  (report, keep timing the others)
                    variants.pop(name)
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                row[f"{name}_compile_s"] = round(time.time() - t, 1)
            # iterations per sample: about sample_ms of the slowest variant, at least one input sweep
            est = {}
            for name, fn in variants.items():
                for x in sets:
                    fn(*x)
                torch.cuda.synchronize()
                est[name] = time_ms(lambda fn=fn: [fn(*x) for x in sets], (), 1) / len(sets)
            iters = max(len(sets), int(sample_ms / max(max(est.values(), default=1.0), 1e-3)))
            iters = -(-iters // len(sets)) * len(sets)
            samples: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(rounds):  # interleaved
                for name, fn in variants.items():
                    samples[name].append(time_ms(lambda fn=fn: [fn(*x) for x in sets], (), iters // len(sets))
                                         / len(sets))
            host = {name: _host_ms(fn, sets, max(5, rounds)) for name, fn in variants.items()}
    for name in ("eager", "inductor", "gac", "gac_nographs"):
        if name == "gac_nographs" and name not in variants:
            continue
        row[f"{name}_ms"] = round(statistics.median(samples[name]), 5) if name in samples else None
        row[f"{name}_host_ms"] = round(host[name], 5) if name in host else None
        row[f"{name}_rel_err"] = errs.get(name)
    row["max_rel_err"] = errs.get("gac")
    ok = "gac" in samples and row["max_rel_err"] is not None and row["max_rel_err"] <= w.tol
    row["status"] = "ok" if ok else "FAIL"
    if "tflops_per_call" in w.extra and row["gac_ms"]:
        row["gac_tflops"] = round(w.extra["tflops_per_call"] / (row["gac_ms"] / 1e3), 1)
    if "bytes_per_call" in w.extra and row["gac_ms"]:  # achieved bandwidth, TB/s
        row["gac_tbps"] = round(w.extra["bytes_per_call"] / (row["gac_ms"] / 1e3) / 1e12, 3)
    row["iters"], row["rounds"], row["input_sets"] = iters, rounds, len(sets)
    row["wall_s"] = round(time.time() - t0, 1)
    return row


def _host_ms(fn: Callable, sets: list, n: int) -> float:
    """Host time per call: the median time to issue one call with an idle queue (no waiting
    for the device; a back-to-back loop would measure the device once the queue fills), after
    the same calls were made a few times (steady state: gac's graphs for them captured)."""
    for _ in range(3):
        for i in range(n):
            fn(*sets[i % len(sets)])
    times = []
    for i in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*sets[i % len(sets)])
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _copy_to(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).to(dtype)


def _commit() -> str:
    if os.environ.get("GAC_COMMIT"):
        return os.environ["GAC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _markdown(rows: list[dict], date: str) -> str:
    lines = [f"# H200: eager / Inductor / gac ({date}, {torch.cuda.get_device_name()}, torch {torch.__version__})",
             "", ("`python benchmarks/bench_h200.py` - medians of interleaved rounds, CUDA events, inputs "
                  "rotated past L2. err = max ||gac - ref64|| / ||ref64||; FAIL: over the precision's tolerance."), "",
             "| workload | flags | eager ms | inductor ms | gac ms | gac/min(eager,ind) | gac TFLOP/s | err | tol | status "
             "| host ms/call e/i/g |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = (lambda v: f"{v:.4f}" if isinstance(v, float) else "-")
    for r in rows:
        best = min([v for v in (r.get("eager_ms"), r.get("inductor_ms")) if v] or [0])
        ratio = f"{r['gac_ms'] / best:.2f}" if best and r.get("gac_ms") else "-"
        err = f"{r['max_rel_err']:.1e}" if r.get("max_rel_err") is not None else r.get("gac_error", "-")
        lines.append(f"| {r['workload']} | {r['flags']} | {f(r.get('eager_ms'))} | {f(r.get('inductor_ms'))} | "
                     f"{f(r.get('gac_ms'))} | {ratio} | {r.get('gac_tflops', '-')} | {err} | {r['tol']:.0e} | "
                     f"{r['status']} | {'/'.join(f(r.get(k + '_host_ms')) for k in ('eager', 'inductor', 'gac'))} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of {list(GROUPS)}")
    ap.add_argument("--match", default="", help="only workloads whose name contains this")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sample-ms", type=float, default=20.0, help="target time of one timed sample")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--conv-flags", default="tf32off", choices=list(CONV_FLAGS),
                    help="precision of the conv group (rows get a _<flags> suffix unless tf32off)")
    args = ap.parse_args()
    global conv_flags
    conv_flags = args.conv_flags
    groups = [g for g in args.only.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        ap.error(f"unknown groups {unknown}; known: {list(GROUPS)}")
    date, commit = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"), _commit()
    out_dir = Path(args.out_dir)
    latest = out_dir / "h200_latest.json"
    rows = {r["workload"]: r for r in (json.loads(latest.read_text()) if latest.exists() else [])}
    new: list[dict] = []
    t_start = time.time()
    for gname in groups:
        for w in GROUPS[gname]():
            if args.match not in w.name:
                continue
            try:
                row = run_workload(w, args.rounds, args.sample_ms)
            except Exception as e:  # noqa: BLE001  (a broken workload is a FAIL row; the rest run)
                row = {"workload": w.name, "flags": w.flags, "tol": w.tol, "status": "FAIL",
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            row.update(group=gname, commit=commit, date=date)
            rows[w.name] = row
            new.append(row)
            print(f"[+{time.time() - t_start:.0f}s] {json.dumps(row)}", flush=True)
            torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    latest.write_text(json.dumps(list(rows.values()), indent=1) + "\n")
    table = out_dir / f"h200_{date[:10]}.md"
    table.write_text(_markdown(list(rows.values()), date))
    print(_markdown(new, date))
    if os.environ.get("OUT") and Path(os.environ["OUT"]).resolve() != out_dir.resolve():
        for p in (latest, table):
            shutil.copy(p, os.environ["OUT"])
    return 1 if any(r["status"] != "ok" for r in new) else 0


if __name__ == "__main__":
    sys.exit(main())

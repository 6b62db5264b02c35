"""Shared by the benchmark scripts: CUDA-event timing (METHOD.md: events, after warm-up), the
small workloads several scripts time, parity enforcement, writing the report, and compiling a
model once per env-switch variant."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/models.py


def time_ms(fn, args, iters: int) -> float:
    """Mean milliseconds of `iters` back-to-back calls, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def cuda_randn(seed: int = 0):
    """rnd(*shape, dtype=...) -> a seeded random CUDA tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g, device="cuda", dtype=dtype)

    return rnd


class Gemm(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


class Chain(torch.nn.Module):
    def forward(self, x, a, b, c):
        return F.gelu(x * a + b) * c


class LinearGelu(torch.nn.Module):
    def forward(self, x, w, b, s):
        return F.gelu(x @ w + b) * s


def small_models(rnd):
    """(name, model, inputs) of the test models at benchmark sizes."""
    from models import MLP, SmallCNN, randomize_bn, transformer_layer

    torch.manual_seed(0)
    yield "MLP b=512", MLP().eval().cuda(), (rnd(512, 32),)
    yield "SmallCNN b=32 64x64", randomize_bn(SmallCNN()).eval().cuda(), (rnd(32, 3, 64, 64),)
    yield "TransformerEncoderLayer(64,4) 8x128", transformer_layer().eval().cuda(), (rnd(8, 128, 64),)


# Norm-wise relative error allowed against the reference, by the workload's compute dtype: a few
# units of the dtype's rounding, with margin (fp32 also covers eager's TF32 convolutions, ~1e-4).
REL_TOL = {torch.float32: 1e-3, "tf32": 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
_FAILED: list[str] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def parity(what: str, err: float, tol: float) -> str:
    """"ok", or "FAIL (...)" when err is over tol (NaN included): the row says so and
    write_report() then exits non-zero, so a benchmark never reports speed for wrong answers."""
    if err <= tol:
        return "ok"
    _FAILED.append(f"{what}: error {err:.2e} > tolerance {tol:.0e}")
    return f"FAIL ({err:.1e} > {tol:.0e})"


def failed(what: str, why: str) -> str:
    """A variant that raised: marked and counted like a parity failure."""
    _FAILED.append(f"{what}: {why}")
    return f"FAIL ({why})"


def write_report(text: str, out) -> None:
    """Prints and writes the report; exits with status 1 after writing it if any parity() failed."""
    print(text)
    if out:
        Path(out).write_text(text)
    if _FAILED:
        print("parity FAILED:\n  " + "\n  ".join(_FAILED), file=sys.stderr)
        sys.exit(1)


# env-switch variants (gemm_variants.py, wgmma_tiles.py, conv1x1_variants.py)


def variant_env(variant: str) -> dict[str, str]:
    """A variant's switches: `NAME=VALUE[+NAME=VALUE...]`, or `default` (none)."""
    return {} if variant == "default" else dict(kv.split("=", 1) for kv in variant.split("+"))


class VariantEnv:
    """The variant's switches while gac compiles (torch.compile compiles at the first calls)."""

    def __init__(self, variant: str) -> None:
        self.env = variant_env(variant)

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc) -> None:
        for k, old in self.saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def compile_variants(model, sets, variants: list[str], tf32: bool, ref, name: str = "",
                     aliases: dict[str, str] | None = None) -> dict:
    """gac's compile of `model` per variant (its switches set while it compiles, cache off),
    keyed by the variant, its error against `ref` and its launches; a failure is reported."""
    import gac_torch  # (here: common's other users need no MLIR)

    fns = {}
    for v in variants:
        try:
            with VariantEnv((aliases or {}).get(v, v)):
                compiled = gac_torch.compile(model, sets[0], target="cuda",
                                             options={"cache": False, "allow_tf32": tf32, "fallback": False})
            launches = [ln.split("launch ")[1].split(" (")[0] for ln in compiled.ir("ptx").splitlines()
                        if ln.startswith("// launch")]
            err = ((compiled(*sets[0]).double() - ref).norm() / ref.norm()).item()
            fns[f"{v} err {err:.1e} {launches}"] = compiled
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            print(f"  {name} {v}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return fns

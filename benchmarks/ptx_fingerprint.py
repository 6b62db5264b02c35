"""A hash per (model, partition, stage) of what the GPU targets generate, without a GPU.

Used to check that a refactoring of the GPU schedule layer keeps the generated code
byte-identical: run it before and after, then compare the two JSON files.

    PYTHONPATH=$PWD python benchmarks/ptx_fingerprint.py OUT.json [--no-bevformer] [--compare BASE.json]

cuda (sm_90 and sm_80, stages only): every stage's text (gpu, llvm, ptx) plus the host program
(launches, temps, memory plan, host ops) of the tests/models.py models, BEVFormer
test_tiny/test_base, and the tests/cuda_cases.py linalg cases. vortex: the stages up to
the LLVM IR (the vxbin needs the Vortex toolchain) of the tests/models.py models.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from gac_torch.backends import get_target, stages_only  # noqa: E402
from gac_torch.frontends.fx import compile_graph  # noqa: E402
from gac_torch.legalize import decompositions  # noqa: E402
from gac_torch.options import resolve  # noqa: E402

MODELS = ["mlp", "cnn", "transformer", "unsupported", "attention"]
CUDA_OPTS = [{"arch": "sm_90", "allow_tf32": False}, {"arch": "sm_80", "allow_tf32": False}]


def _h(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def _host(program) -> str:
    """The host program as data: every field of the GpuProgram but the PTX."""
    fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(program) if f.name != "ptx"}
    return repr(fields)


def _target(name: str):
    t = stages_only(get_target(name))
    if name == "vortex":  # the vxbin stage needs the Vortex toolchain: stop at the LLVM IR
        return dataclasses.replace(t, stages=lambda o, s=t.stages: [x for x in s(o) if x.name != "vxbin"])
    return t


def _graph(model: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    ep = torch.export.export(model, args)
    return ep.run_decompositions(decompositions()).graph_module


def fingerprint_graph(gm, target: str, opts: dict, out: dict, key: str) -> None:
    options = resolve({"fallback": True, **opts}, target=target)
    compiled = compile_graph(gm, options, target=_target(target))
    out[f"{key}/report"] = str(compiled.report)  # a partition that stops compiling shows here
    for pname, part in compiled.partitions.items():
        for stage, text in part.stages.items():
            if stage in ("gac", "linalg") and target == "vortex":
                continue  # shared with cuda: hashed there
            out[f"{key}/{pname}/{stage}"] = _h(text)
        if target == "cuda":
            out[f"{key}/{pname}/host"] = _h(_host(part.executable))


def models(out: dict) -> None:
    from models import build

    for name in MODELS:
        model, args = build(name)
        with torch.no_grad():  # compile_graph partitions its graph in place: one export each
            for opts in CUDA_OPTS:
                fingerprint_graph(_graph(model, args), "cuda", opts, out, f"cuda-{opts['arch']}/{name}")
            fingerprint_graph(_graph(model, args), "vortex", {}, out, f"vortex/{name}")
        print(f"  {name}", flush=True)


def bevformer(out: dict) -> None:
    from gac_torch.models.bevformer import build_bevformer, make_test_inputs

    for config in ("test_tiny", "test_base"):
        t0 = time.time()
        model = build_bevformer(config, seed=0)
        frame0 = make_test_inputs(model.cfg, frame=0)
        with torch.no_grad():
            gm = _graph(model, tuple(frame0))
            fingerprint_graph(gm, "cuda", CUDA_OPTS[0], out, f"cuda-sm_90/bevformer-{config}")
        print(f"  bevformer {config}: {time.time() - t0:.0f}s", flush=True)


def pipeline_cases(out: dict) -> None:
    from cuda_cases import CASES, compile_case

    for name, case in CASES.items():
        for arch in ("sm_90", "sm_80"):
            program = compile_case(case, arch)
            out[f"case-{arch}/{name}/ptx"] = _h(program.ptx)
            out[f"case-{arch}/{name}/host"] = _h(_host(program))
    print(f"  {len(CASES)} pipeline cases", flush=True)


def compare(new: dict, base: dict) -> int:
    keys = sorted(set(new) | set(base))
    diff = [k for k in keys if new.get(k) != base.get(k)]
    for k in diff:
        print(f"DIFF {k}: {base.get(k)} -> {new.get(k)}")
    print(f"{len(keys) - len(diff)}/{len(keys)} fingerprints identical")
    return 1 if diff else 0


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--no-bevformer", action="store_true")
    ap.add_argument("--no-cases", action="store_true")
    ap.add_argument("--compare", help="a base JSON to compare with")
    args = ap.parse_args()
    out: dict[str, str] = {}
    models(out)
    if not args.no_cases:
        pipeline_cases(out)
    if not args.no_bevformer:
        bevformer(out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {len(out)} fingerprints to {args.out}")
    if args.compare:
        with open(args.compare) as f:
            base = json.load(f)
        if args.no_bevformer:
            base = {k: v for k, v in base.items() if "bevformer" not in k}
        if args.no_cases:
            base = {k: v for k, v in base.items() if not k.startswith("case-")}
        return compare(out, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())

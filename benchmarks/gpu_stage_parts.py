"""The cuda "gpu" stage of BEVFormer-tiny alone, main-thread CPU per part (issue 16).

    PYTHONPATH=$PWD python benchmarks/gpu_stage_parts.py [--runs "GAC_GPU_LAZY_SETTLE=0,GAC_GPU_LAZY_SETTLE=1"]
        [--linalg FILE] [--save FILE]

Builds the model, runs the front end up to the linalg stage (cuda, sm_90, no GPU needed, cache
off), then runs `pipeline.map_stage` on a fresh parse of that module once per run given (each a
space-separated list of NAME=VALUE environment settings, e.g. GAC_GPU_STAGE_WORKERS=8), printing wall and main-thread CPU (`time.thread_time`) of the
stage and of its parts (the scheduler's steps, each MLIR pipeline by name, the strategies'
emission, the template splices put in place at the loop's end), and the sha256 prefix of the
stage's text (fc6a88871844 at fa26a66: the same in every run). A cProfile of the
whole compile mixes the fold pool's threads into the main thread's tree; this does not.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import hashlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = ["map_attention", "fold_transposes_into_matmuls", "generalize_elementwise_named_ops",
         "fuse_elementwise", "merge_added_reductions", "map_rows", "bufferize", "reshapes_to_views",
         "copies_to_linalg", "hoist_epilogue_consumers", "_apply_strategy", "parallel_dims_first",
         "fold_casts_into_copies", "linearize", "wrap_serial", "absorb_fill", "sink_past", "sink_globals",
         "dynamic_memrefs_as_metadata", "number_kernels"]


def linalg_text() -> str:
    """BEVFormer-tiny's linalg stage (the module map_stage is handed), as text."""
    import torch
    import gac_torch
    from gac_torch.backends.cuda import pipeline
    from gac_torch.models.bevformer import build_bevformer, make_test_inputs

    model = build_bevformer("tiny", seed=0).eval()
    inputs = tuple(make_test_inputs(model.cfg, frame=0))
    got: list[str] = []

    class Stop(Exception):
        pass

    def grab(artifact, options):
        got.append(str(artifact))
        raise Stop

    real, pipeline.map_stage = pipeline.map_stage, grab
    try:
        with torch.no_grad():
            ep = torch.export.export(model, inputs)
            with contextlib.suppress(Exception):
                gac_torch.compile(ep, target="cuda", options={"arch": "sm_90", "cache": False})
    finally:
        pipeline.map_stage = real
    if not got:
        raise SystemExit("the linalg stage was not reached")
    return got[0]


def instrument(acc: dict, cnt: collections.Counter) -> None:
    """Wrap the scheduler's steps (module globals of schedule.py) to add their thread CPU up."""
    from gac_torch.backends.gpu import schedule, stage as gstage, strategy

    def wrap(mod, name, key=None):
        f = getattr(mod, name)

        @functools.wraps(f)
        def w(*a, **k):
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                kk = key(a) if key else name
                acc[kk] += time.thread_time() - t
                cnt[kk] += 1
        setattr(mod, name, w)

    for n in STEPS:
        if hasattr(schedule, n):
            wrap(schedule, n)
    wrap(schedule, "run_passes", key=lambda a: "passes: " + a[1][:70])
    wrap(strategy, "_resolve")  # (the folded templates put in place: early by settle, or at the end)
    wrap(gstage, "read_host_program")
    wrap(gstage, "annotate_noalias")
    for n in ("combine_prep_kernels", "unshare_prep_inits"):
        if hasattr(schedule.combine, n):
            wrap(schedule.combine, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="", help="comma-separated runs, each space-separated NAME=VALUE "
                    "settings (default: one run, the environment as it is)")
    ap.add_argument("--linalg", help="read the linalg stage from this file instead of compiling the front end")
    ap.add_argument("--save", help="write the linalg stage to this file")
    ap.add_argument("--top", type=int, default=22, help="parts shown per run")
    args = ap.parse_args()
    t = time.perf_counter()
    text = open(args.linalg).read() if args.linalg else linalg_text()
    print(f"linalg stage: {len(text)} chars ({time.perf_counter() - t:.1f} s to get it)", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            f.write(text)
    from mlir import ir
    from gac_torch.backends.cuda import pipeline, target
    from gac_torch.ir.dialect import make_context

    acc: dict = collections.defaultdict(float)
    cnt: collections.Counter = collections.Counter()
    instrument(acc, cnt)
    opts = target.compile_options({"arch": "sm_90"})
    for run in args.runs.split(",") if args.runs else [""]:
        for setting in run.split():
            name, _, value = setting.partition("=")
            os.environ[name] = value
        acc.clear()
        cnt.clear()
        module = ir.Module.parse(text, make_context())
        t, c = time.perf_counter(), time.thread_time()
        stage = pipeline.map_stage(module, opts)
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        digest = hashlib.sha256(stage.text.encode()).hexdigest()[:12]
        print(f"{run or '(environment)'}: gpu stage wall {wall:.2f} s, main-thread CPU {cpu:.2f} s, text {digest}")
        for k, v in sorted(acc.items(), key=lambda x: -x[1])[:args.top]:
            print(f"  {v:7.3f} s {cnt[k]:5d}x  {k}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

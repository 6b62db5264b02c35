"""CPU seconds of gac's front-end: gac_torch.compile(ExportedProgram) from its entry to the first
partition's legalization (torch's run_decompositions, export semantics, partitioning), stopped
there, so no MLIR runs and no GPU is needed (issue 16, point 3).

    PYTHONPATH=$PWD python benchmarks/compile_front.py --config tiny --target cuda
    PYTHONPATH=$PWD python benchmarks/compile_front.py --config test_tiny --target cpu --profile out.prof
    GAC_DECOMPOSE=torch PYTHONPATH=$PWD python benchmarks/compile_front.py   # torch's run_decompositions

Prints the main thread's CPU seconds (a loaded machine inflates them far less than wall seconds)
in total and per step; steps nest (decompose_program holds run_decompositions where it falls back
to it, run_decompositions most of the recompiles). With a GPU, a cuda target exports the model on
the GPU (as compile_time.py does), else on the cpu with PTX for sm_90. The script
imports gac_torch from PYTHONPATH, so one copy measures two checkouts (before / after).
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import functools
import os
import tempfile
import time
import warnings

os.environ["GAC_CACHE_DIR"] = tempfile.mkdtemp()  # cold: no whole-program hit skips the front-end
import torch  # noqa: E402

import gac_torch  # noqa: E402
import gac_torch.frontends.export as export_frontend  # noqa: E402
import gac_torch.frontends.fx as fx_frontend  # noqa: E402
from gac_torch.errors import MissingDependency  # noqa: E402
from gac_torch.models.bevformer import build_bevformer, make_test_inputs  # noqa: E402
from gac_torch.runtime import artifact  # noqa: E402

STEPS = collections.Counter()


class _Stop(MissingDependency):  # compile_graph re-raises it (a partition failure would not)
    pass


def _stop(*args, **kwargs):
    raise _Stop


def _timed(owner, name: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            STEPS[name] += time.thread_time() - t
    setattr(owner, name, timed)


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny", help="a BEVFormer preset")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--profile", help="write a cProfile of the front-end here")
    ap.add_argument("--check", action="store_true",
                    help="then torch's run_decompositions on the same program: its CPU s (second, so warmer) and "
                         "whether the node-by-node graph is its graph node for node")
    args = ap.parse_args()
    fx_frontend.compile_partition = _stop
    _timed(export_frontend, "decompose_program")
    _timed(torch.export.ExportedProgram, "run_decompositions")
    _timed(torch.fx.GraphModule, "recompile")
    _timed(export_frontend, "ExportSemantics")
    _timed(artifact, "program_key")
    for name in ("drop_metadata_asserts", "analyze", "partition"):
        _timed(fx_frontend, name)
    on_gpu = args.target == "cuda" and torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    model = build_bevformer(args.config, seed=0).to(dev).eval()
    inputs = tuple(t.to(dev) for t in make_test_inputs(model.cfg, frame=0))
    t = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(model, inputs)
    print(f"torch {torch.__version__}: export {time.perf_counter() - t:.2f} s on {dev}")
    options = {"arch": "sm_90"} if args.target == "cuda" and not on_gpu else None  # PTX: no GPU needed
    STEPS.clear()
    profile = cProfile.Profile() if args.profile else None
    t = time.thread_time()
    try:
        with torch.no_grad():
            if profile:
                profile.enable()
            gac_torch.compile(ep, target=args.target, options=options)
    except _Stop:
        pass
    finally:
        if profile:
            profile.disable()
    total = time.thread_time() - t
    print(f"{args.config} on {args.target}: front-end {total:.2f} CPU s"
          f"{' (profiled)' if profile else ''}")
    for name, s in STEPS.most_common():
        print(f"  {name:24s} {s:6.2f}")
    if profile:
        profile.dump_stats(args.profile)
    if args.check:
        _check(ep)


def _check(ep) -> None:
    from gac_torch.frontends import decompose
    from gac_torch.frontends.torch_state import lazy_graph_modules, retrace_without_export_guards, tracing
    from gac_torch.legalize import decompositions

    with torch.no_grad(), tracing():
        t = time.thread_time()
        decomposer = decompose._Decomposer(ep, decompositions())
        got = decomposer.program()
        fast = time.thread_time() - t
        with retrace_without_export_guards(), lazy_graph_modules():
            t = time.thread_time()
            want = ep.run_decompositions(decompositions())
            slow = time.thread_time() - t
    a, b = decompose.graph_rows(got.graph_module), decompose.graph_rows(want.graph_module)
    same = a == b and str(got.graph_signature) == str(want.graph_signature)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"check: node-by-node {fast:.2f} CPU s ({decomposer.retraced} nodes traced anew), run_decompositions {slow:.2f} CPU s; {len(a)} vs {len(b)} nodes, "
          f"{'the same graph' if same else f'DIFFERENT (first at node {first})'}")


if __name__ == "__main__":
    main()

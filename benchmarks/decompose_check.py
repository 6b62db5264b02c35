"""The node-by-node decomposition (gac_torch/frontends/decompose.py) against torch's
run_decompositions on the fuzz cases: for each seed, the exported program's two decomposed graphs
must be the same node for node (targets, arguments, names, values' metadata; decompose.graph_rows)
and have the same signature. No compile: a few seconds per hundred seeds.

    PYTHONPATH=. python benchmarks/decompose_check.py --seeds 0:600 [--device cpu|cuda]

--device cuda on a machine without a GPU exports on fake cuda tensors (the metadata torch gives a
cuda graph). Prints one line per differing seed (the first differing node) and a summary; exits 1
when a seed differs or the node-by-node path failed on a program it takes.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch


def _inputs(ns: dict, device: str) -> tuple:
    ins = ns["make_inputs"]()
    if device == "cpu" or torch.cuda.is_available():
        return tuple(t.to(device) for t in ins)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in ins]
    with mode:
        return tuple(t.to(device) for t in fakes)


def check(seed: int, device: str) -> tuple[str, str]:
    """(status, detail): status ok / differs / unsupported (the fast path declines) / failed (it
    raised) / skipped (torch.export refused the program)."""
    from gac_torch.frontends import decompose
    from gac_torch.frontends.torch_state import lazy_graph_modules, retrace_without_export_guards, tracing
    from gac_torch.legalize import decompositions
    from gac_torch.tools.fuzz import generate
    from gac_torch.tools.fuzz.gen import load
    from gac_torch.tools.fuzz.runners import _Case

    ns = load(generate(seed).source())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(_Case(ns["forward"]), _inputs(ns, device))
    except Exception as e:  # torch's exporter refused it: not the decomposition's business
        return "skipped", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    with tracing(), retrace_without_export_guards(), lazy_graph_modules():
        want = ep.run_decompositions(decompositions())
    try:
        with tracing():
            got = decompose._Decomposer(ep, decompositions()).program()
    except decompose._Unsupported as e:
        return "unsupported", str(e)
    except Exception as e:
        return "failed", f"{type(e).__name__}: {e}"
    a, b = decompose.graph_rows(got.graph_module), decompose.graph_rows(want.graph_module)
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return "differs", f"node {i}: node-by-node {a[i] if i < len(a) else None} | torch {b[i] if i < len(b) else None}"
    if str(got.graph_signature) != str(want.graph_signature):
        return "differs", "signature"
    return "ok", ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:200", help="start:stop (fuzz seeds)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    start, stop = (int(x) for x in args.seeds.split(":"))
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    for seed in range(start, stop):
        status, detail = check(seed, args.device)
        counts[status] = counts.get(status, 0) + 1
        if status in ("differs", "failed"):
            print(f"seed {seed}: {status}: {detail}", flush=True)
    print(f"decompose_check torch {torch.__version__} {args.device} seeds {start}:{stop}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" ({time.perf_counter() - t0:.0f} s)")
    return 1 if counts.get("differs") or counts.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())

"""BEVFormer test_tiny frame 0 on the vortex target, counters per model part.

    VORTEX_HOME=/path/to/vortex/install python benchmarks/vortex_bevformer_parts.py [--mode simx]
        [--config device] [--parts backbone,whole]

Each part (backbone, neck, encoder, decoder, heads) is exported on the inputs it receives in an
eager frame and compiled on its own; "whole model" is the full graph (its remainder over the sum
of the parts: can-bus MLP, BEV positions, shift, prev_bev rotation and the glue between parts).
Every output is compared with eager (rtol = atol = 2e-4, as tests/test_vortex_target.py).
`--config` is option `vortex_config` ("device": what the SimX build reports, e.g. 4 cores).
Prints one markdown table (rows: part; launches, warp instructions, SimX cycles or -).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils import _pytree as pytree

import gac_torch
from gac_torch.backends import vortex
from gac_torch.models.bevformer import build_bevformer, make_test_inputs

PARTS = ("backbone", "neck", "encoder", "decoder", "heads")


class Part(torch.nn.Module):
    """A submodule called with the (args, kwargs) seen in the eager frame; its tensor leaves
    become the inputs, everything else (ints, shapes, modules) stays baked in."""

    def __init__(self, mod: torch.nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.mod = mod
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.is_t = [isinstance(x, torch.Tensor) for x in leaves]
        self.fixed = [None if t else x for x, t in zip(leaves, self.is_t)]
        self.mods = torch.nn.ModuleList([x for x in leaves if isinstance(x, torch.nn.Module)])
        self.inputs = tuple(x for x, t in zip(leaves, self.is_t) if t)

    def forward(self, *ts):
        it = iter(ts)
        leaves = [next(it) if t else x for x, t in zip(self.fixed, self.is_t)]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.mod(*args, **kwargs)


def measure(module: torch.nn.Module, inputs: tuple, mode: str, config: str | None = None) -> dict:
    with torch.no_grad():
        start = time.perf_counter()
        compiled = gac_torch.compile(torch.export.export(module, inputs), target="vortex",
                                     options={"vortex_mode": mode, "vortex_config": config})
        got, want = compiled(*inputs), module(*inputs)
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4)
    c = vortex.last_counters(compiled)
    return dict(launches=c["launches"], instructions=c["instructions"], cycles=c["cycles"],
                wall=time.perf_counter() - start, kernels=c["kernels"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="functional", choices=("functional", "simx"))
    p.add_argument("--parts", default=",".join(PARTS + ("whole",)))
    p.add_argument("--config", default=None, help="option vortex_config: CxWxT or device")
    p.add_argument("--top", type=int, default=0, help="also list each part's N costliest launches")
    args = p.parse_args()
    model = build_bevformer("test_tiny", seed=0)
    frame = tuple(make_test_inputs(model.cfg, frame=0))
    seen: dict[str, tuple] = {}
    hooks = [getattr(model, n).register_forward_pre_hook(
        lambda m, a, kw, n=n: seen.setdefault(n, (a, kw)), with_kwargs=True) for n in PARTS]
    with torch.no_grad():
        model(*frame)
    for h in hooks:
        h.remove()
    rows = {}
    for name in args.parts.split(","):
        if name == "whole":
            rows[name] = measure(model, frame, args.mode, args.config)
        else:
            part = Part(getattr(model, name), *seen[name])
            rows[name] = measure(part, part.inputs, args.mode, args.config)
        print(name, {k: v for k, v in rows[name].items() if k != "kernels"}, flush=True)
        if args.top:
            key = "cycles" if args.mode == "simx" else "instructions"
            for k in sorted(rows[name]["kernels"], key=lambda k: -(k.get(key) or 0))[:args.top]:
                print(f"  {k['kernel']:32s} grid {k.get('grid')} block {k.get('block')} "
                      f"instructions {k.get('instructions'):,} cycles {k.get('cycles')}")
    print("\n| part | launches | warp instructions | SimX cycles |\n|---|---|---|---|")
    for name, r in rows.items():
        cyc = f"{r['cycles']:,}" if r["cycles"] is not None else "-"
        print(f"| {name} | {r['launches']} | {r['instructions']:,} | {cyc} |")


if __name__ == "__main__":
    main()

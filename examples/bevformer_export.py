"""Build a BEVFormer, export one temporal step with torch.export, compile it with gac, run two frames.

    python examples/bevformer_export.py [--config test_tiny|test_base|tiny|base] [--seed 0]
                                        [--target cpu|cuda] [--checkpoint bevformer_tiny_epoch_24.pth]

Frame 0 has no previous BEV (use_prev_bev = 0, zero prev_bev); frame 1 feeds frame 0's
bev_embed back as prev_bev with an ego translation and a 7 degree yaw change. Both frames go
through the eager model, the exported program and `gac_torch.compile(exported)` (the same graph
for both frames); the script prints the largest differences, the ATen op histogram of the
decomposed graph, gac's coverage report and the decoded boxes of frame 1. The full-size configs
work too but take minutes on a CPU.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import gac_torch
from gac_torch.models.bevformer import (
    build_bevformer,
    decode_bboxes,
    load_official_state_dict,
    make_test_inputs,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="test_tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="official BEVFormer .pth (optional)")
    parser.add_argument("--target", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = "cuda" if args.target == "cuda" else "cpu"

    model = build_bevformer(args.config, seed=args.seed).to(device)
    if args.checkpoint:
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        load_official_state_dict(model, ckpt, strict=True)
    cfg = model.cfg

    frame0 = tuple(t.to(device) for t in make_test_inputs(cfg, frame=0, seed=args.seed))
    t = time.perf_counter()
    exported = torch.export.export(model, frame0)
    print(f"export: {time.perf_counter() - t:.1f} s")
    decomposed = exported.run_decompositions()
    ops = collections.Counter(str(n.target) for n in decomposed.graph.nodes
                              if n.op == "call_function")
    print(f"decomposed graph: {sum(ops.values())} ops")
    for name, count in sorted(ops.items()):
        print(f"  {count:5d}  {name}")

    t = time.perf_counter()
    compiled = gac_torch.compile(exported, target=args.target)
    print(f"gac compile ({args.target}): {time.perf_counter() - t:.1f} s; {compiled.report}")

    runners = {"eager": model, "exported": exported.module(), "gac": compiled}
    outputs: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    with torch.no_grad():
        for label, fn in runners.items():
            out0 = fn(*frame0)
            frame1 = tuple(t.to(device) for t in make_test_inputs(
                cfg, frame=1, seed=args.seed, prev_bev=out0[2].cpu()))
            outputs[label] = [out0, fn(*frame1)]
    for f in range(2):
        for label in ("exported", "gac"):
            diffs = [(e - x).abs().max().item()
                     for e, x in zip(outputs["eager"][f], outputs[label][f])]
            print(f"frame {f}: max |eager - {label}| cls/bbox/bev = "
                  + ", ".join(f"{d:.3g}" for d in diffs))

    cls, box, _ = (t.cpu() for t in outputs["gac"][1])
    (result,) = decode_bboxes(cls, box, cfg)
    print(f"frame 1: {result['bboxes'].shape[0]} boxes after top-{cfg.max_num} + range filter; "
          f"best score {result['scores'][0].item():.3f}")


if __name__ == "__main__":
    main()

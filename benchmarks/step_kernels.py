"""What bench_h200's training step (train_mlp_fp32) launches, offline: the step compiled for
the cuda target (sm_90, TF32 off) through torch.compile and AOTAutograd with the stub driver
(tests/cuda_stub.py: CPU tensors stand in, no kernel runs), then per compiled partition each
launch with its grid and the bytes of the buffers it is given (each buffer once: read or
written, or both where a kernel updates in place), and that over 4.8 TB/s (the H200's HBM
peak: a floor, not a prediction; the sgemms are compute-bound, ~2.67 ms each at 4096^3).

    PYTHONPATH=$PWD python benchmarks/step_kernels.py [--size 4096] [--env NAME=VALUE,...]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ESIZE = {"f64": 8, "i64": 8, "f32": 4, "i32": 4, "f16": 2, "bf16": 2, "i8": 1, "i1": 1}
HBM = 4.8e12
LAUNCH = re.compile(r"gpu\.launch_func\s+@gac_kernels::@(\w+)\s+blocks in \(([^)]*)\).*?args\((.*)\)")


def buffer_bytes(args: str) -> int:
    """Bytes of the distinct buffers in a launch's argument list (`%name : memref<...>`)."""
    seen, total = set(), 0
    for name, shape, elem in re.findall(r"(%\w+) : memref<((?:\d+x)*)(\w+)", args):
        if name in seen:
            continue
        seen.add(name)
        n = 1
        for d in shape.split("x")[:-1]:
            n *= int(d)
        total += n * ESIZE.get(elem, 4)
    return total


def launches(gpu_ir: str) -> list[tuple[str, str, int]]:
    """(kernel, grid, bytes) per launch of a partition's gpu-stage IR, in order."""
    return [(m.group(1), m.group(2).replace("%c", ""), buffer_bytes(m.group(3))) for m in LAUNCH.finditer(gpu_ir)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--env", default="", help="NAME=VALUE,... set before compiling")
    args = ap.parse_args()
    for kv in filter(None, args.env.split(",")):
        k, v = kv.split("=", 1)
        os.environ[k] = v
    os.environ.setdefault("GAC_IN_PLACE", "1")
    import torch

    from bench_h200 import TrainStep
    from cuda_stub import stub_cuda
    from gac_torch.backends.cuda.runtime import CudaExecutable
    from gac_torch.frontends.dynamo import compiled_graphs
    from gac_torch.runtime.compiled import CompiledGraph

    n = args.size
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.GELU(), torch.nn.Linear(n, n))
    with stub_cuda():
        # (the checked path, which the in-place update takes, refuses CPU tensors: no kernel runs anyway)
        CompiledGraph.check_inputs = lambda self, a: [tuple(s.shape) for s in self.signature.outputs]
        CudaExecutable.run = lambda self, inputs, outputs: None
        step = torch.compile(TrainStep(mlp), backend="gac",
                             options={"target": "cuda", "cache": False, "allow_tf32": False, "arch": "sm_90"})
        step(torch.randn(n, n), torch.randn(n, n))
    total_b, total_n = 0, 0
    for gi, g in enumerate(compiled_graphs):
        for name, part in g.partitions.items():
            print(f"graph {gi} {name} (donated outputs: {getattr(part, '_donate', {})})")
            for kernel, grid, nbytes in launches(part.ir("gpu")):
                print(f"  {kernel:28s} grid ({grid:>14s}) {nbytes / 2**20:8.1f} MiB  {nbytes / HBM * 1e3:7.4f} ms")
                total_b, total_n = total_b + nbytes, total_n + 1
    print(f"{total_n} launches, {total_b / 2**20:.1f} MiB ({total_b / HBM * 1e3:.3f} ms at 4.8 TB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

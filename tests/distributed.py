"""Data-parallel training with gac inside torch.distributed: one worker per rank, launched as
subprocesses the way torchrun does (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE).

Shared by tests/test_distributed.py (cpu, gloo, 2 processes) and benchmarks/bench_distributed.py
(cuda, NCCL, 2 GPUs). Each worker trains the same seeded model once per backend and writes its
final parameters, losses and gac's reports to `<out>/rank<r>.pt`; rank 0's files are compared
by the caller.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/distributed.py --rank R --world 2 \
        --cases ddp_mlp,ddp_block --out DIR [--cuda]   (launch() does this for every rank)
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MLP, AttentionBlock

STEPS = 3
LR = 0.1
# case -> (model, width, input shape per rank, wrapping)
CASES = {
    "ddp_mlp": ("mlp", 32, (16, 32), "ddp"),
    "ddp_block": ("block", 64, (4, 16, 64), "ddp"),
    # a collective inside the compiled graph (tensor-parallel style): it must stay torch's
    "funcol_mlp": ("mlp", 32, (16, 32), "funcol"),
    "fsdp2_blocks": ("blocks", 64, (4, 16, 64), "fsdp2"),
    # benchmark sizes (benchmarks/bench_distributed.py on the GPUs)
    "ddp_block_large": ("block", 512, (16, 256, 512), "ddp"),
    "fsdp2_blocks_large": ("blocks", 512, (16, 256, 512), "fsdp2"),
}


class Blocks(nn.Module):
    """Two transformer blocks: FSDP2 shards and torch.compile compiles each one."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.layers = nn.ModuleList([AttentionBlock(dim), AttentionBlock(dim)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class AllReduced(nn.Module):
    """The block's output summed over ranks inside forward with a functional collective, so that
    dynamo traces `_c10d_functional.all_reduce` + `wait_tensor` into the graph gac gets."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.inner(x), "sum", dist.group.WORLD)


def build(case: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank and for every backend
    kind, dim = CASES[case][:2]
    if kind == "mlp":
        return MLP()
    return {"block": AttentionBlock, "blocks": Blocks}[kind](dim)


def wrap(model: nn.Module, case: str, backend: str, options: dict | None, device: torch.device):
    """The wrapping order each case documents: compile inside DDP / per block inside FSDP2."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = {"backend": backend} if backend != "gac" else {"backend": "gac", "options": options}
    wrapping = CASES[case][3]
    if wrapping == "ddp":
        return DDP(torch.compile(model, **kw), device_ids=[device.index] if device.type == "cuda" else None)
    if wrapping == "funcol":
        return torch.compile(AllReduced(model), **kw)
    if wrapping == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, **kw)
            fully_shard(model.layers[i])
        return fully_shard(model)
    raise KeyError(wrapping)


def inputs(case: str, rank: int, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own shard of the batch
    return torch.randn(CASES[case][2], generator=g).to(device)


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Unsharded parameters (FSDP2 holds DTensors), on the CPU."""
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().cpu().clone())
    return out


def train(case: str, backend: str, options: dict | None, device: torch.device, rank: int,
          steps: int = STEPS) -> dict:
    torch._dynamo.reset()
    model = build(case).to(device)
    wrapped = wrap(model, case, backend, options, device)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = wrapped(inputs(case, rank, step, device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"names": [n for n, _ in model.named_parameters()], "params": full_params(model),
            "losses": losses, "wrapped": wrapped}


def tokens_per_s(wrapped: nn.Module, case: str, rank: int, device: torch.device, iters: int) -> float:
    """Training throughput of one rank (forward + backward + SGD step), after train()'s warm-up."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=1e-6)
    x = inputs(case, rank, 0, device)
    tokens = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        wrapped(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sync()
    return tokens * iters / (time.perf_counter() - t0)


def worker(rank: int, world: int, cases: list[str], out: Path, cuda: bool, backends: list[str],
           bench_iters: int) -> None:
    from gac_torch.frontends import dynamo as gac_dynamo

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    options = {"target": "cuda" if cuda else "cpu"}
    results: dict = {}
    try:
        for case in cases:
            result = results[case] = {"init": full_params(build(case))}
            for backend in backends:
                gac_dynamo.compiled_graphs.clear()
                run = train(case, backend, options, device, rank)
                if bench_iters:
                    run["tokens_per_s"] = tokens_per_s(run["wrapped"], case, rank, device, bench_iters)
                del run["wrapped"]
                if backend == "gac":  # what gac compiled: one report per graph
                    run["reports"] = [c.report for c in gac_dynamo.compiled_graphs]
                result[backend] = run
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cases: list[str], out: Path, world: int = 2, cuda: bool = False, backends=("eager", "gac"),
           bench_iters: int = 0, timeout: float = 300) -> list[dict]:
    """Runs `world` worker processes (torchrun-style) and returns each rank's results by case."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world),
                               "--cases", ",".join(cases), "--out", str(out), "--backends", ",".join(backends),
                               "--bench-iters", str(bench_iters)] + (["--cuda"] if cuda else []),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{cases}: ranks {failed} failed:\n" + "\n".join(log[-4000:] for log in logs))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--cases", required=True, help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backends", default="eager,gac")
    ap.add_argument("--bench-iters", type=int, default=0)
    ap.add_argument("--cuda", action="store_true")
    a = ap.parse_args()
    worker(a.rank, a.world, a.cases.split(","), a.out, a.cuda, a.backends.split(","), a.bench_iters)


if __name__ == "__main__":
    main()

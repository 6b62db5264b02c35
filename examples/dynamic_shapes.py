"""Sizes known only at run time: one compilation for every batch and sequence length.

A small transformer block is exported with `Dim`s for batch (1..64) and sequence (7..130) and
compiled by gac once; the same program then runs every shape: the kernels take the sizes at run
time (`compiled.dynamic`), on the GPU when the machine has one, else on the CPU.
"""

import torch

import gac_torch


class Block(torch.nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.norm(x + self.proj(att.transpose(1, 2).reshape(b, t, c)))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Block().eval().to(device)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=7, max=130)
    ep = torch.export.export(model, (torch.randn(2, 9, 64, device=device),), dynamic_shapes=({0: batch, 1: seq},))
    compiled = gac_torch.compile(ep, target=device)
    print("compiled once for all sizes:", compiled.dynamic, "|", compiled.report)
    worst = 0.0
    with torch.no_grad():
        for b, t in [(1, 7), (8, 50), (64, 130), (3, 129)]:
            x = torch.randn(b, t, 64, device=device)
            err = (compiled(x) - model(x)).abs().max().item()
            worst = max(worst, err)
            print(f"batch {b:2d} seq {t:3d}: max |gac - eager| = {err:.2e}")
    assert worst < 1e-4, worst
    print("OK")


if __name__ == "__main__":
    main()

"""Per-decoder-layer classification and box-regression branches (with_box_refine: one
independent copy per layer) and the assembly of all_cls_scores / all_bbox_preds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import BEVFormerConfig

__all__ = ["ClsBranch", "RegBranch", "DetectionHeads"]


class ClsBranch(nn.Module):
    """(Linear, LayerNorm, ReLU) x 2 -> Linear(num_classes)."""

    def __init__(self, embed_dims: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, embed_dims)
        self.ln1 = nn.LayerNorm(embed_dims)
        self.fc2 = nn.Linear(embed_dims, embed_dims)
        self.ln2 = nn.LayerNorm(embed_dims)
        self.out = nn.Linear(embed_dims, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.ln1(self.fc1(x)))
        x = F.relu(self.ln2(self.fc2(x)))
        return self.out(x)


class RegBranch(nn.Module):
    """(Linear, ReLU) x 2 -> Linear(code_size)."""

    def __init__(self, embed_dims: int, code_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, embed_dims)
        self.fc2 = nn.Linear(embed_dims, embed_dims)
        self.out = nn.Linear(embed_dims, code_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class DetectionHeads(nn.Module):
    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        n = cfg.num_dec_layers
        self.pc_range = tuple(float(v) for v in cfg.pc_range)
        self.cls_branches = nn.ModuleList(ClsBranch(cfg.embed_dims, cfg.num_classes) for _ in range(n))
        self.reg_branches = nn.ModuleList(RegBranch(cfg.embed_dims, cfg.code_size) for _ in range(n))

    def forward(self, states: list[Tensor], refined: list[Tensor], regs: list[Tensor]
                ) -> tuple[Tensor, Tensor]:
        """Box code per query: (cx, cy, w, l, cz, h, sin, cos, vx, vy) with cx, cy, cz in metres
        (the refined normalised centre scaled to pc_range), the rest as regressed."""
        pc = self.pc_range
        all_cls: list[Tensor] = []
        all_box: list[Tensor] = []
        for cls_branch, state, ref, reg in zip(self.cls_branches, states, refined, regs):
            all_cls.append(cls_branch(state))
            cx = ref[..., 0:1] * (pc[3] - pc[0]) + pc[0]
            cy = ref[..., 1:2] * (pc[4] - pc[1]) + pc[1]
            cz = ref[..., 2:3] * (pc[5] - pc[2]) + pc[2]
            all_box.append(torch.cat((cx, cy, reg[..., 2:4], cz, reg[..., 5:]), -1))
        return torch.stack(all_cls), torch.stack(all_box)

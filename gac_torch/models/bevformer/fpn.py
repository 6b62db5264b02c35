"""FPN neck as configured in BEVFormer (mmdet FPN, add_extra_convs='on_output').

lateral 1x1 convs -> top-down nearest upsample (to the exact lower-level size) and add ->
3x3 output convs -> extra 3x3/2 convs on the last output (ReLU before the 2nd and later extra
convs, relu_before_extra_convs=True). Tiny uses a single level, so no top-down path and no extra.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FPN"]


class FPN(nn.Module):
    def __init__(self, in_channels: tuple[int, ...], out_channels: int, num_outs: int) -> None:
        super().__init__()
        self.num_ins = len(in_channels)
        self.num_outs = num_outs
        assert num_outs >= self.num_ins
        self.lateral_convs = nn.ModuleList(nn.Conv2d(c, out_channels, 1) for c in in_channels)
        convs = [nn.Conv2d(out_channels, out_channels, 3, 1, 1) for _ in in_channels]
        convs += [nn.Conv2d(out_channels, out_channels, 3, 2, 1)
                  for _ in range(num_outs - self.num_ins)]
        self.fpn_convs = nn.ModuleList(convs)

    def forward(self, inputs: list[Tensor]) -> list[Tensor]:
        laterals = [conv(x) for conv, x in zip(self.lateral_convs, inputs)]
        for i in range(self.num_ins - 1, 0, -1):
            size = (int(laterals[i - 1].shape[2]), int(laterals[i - 1].shape[3]))
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], size=size, mode="nearest")
        outs = [self.fpn_convs[i](laterals[i]) for i in range(self.num_ins)]
        for i in range(self.num_ins, self.num_outs):
            src = outs[-1] if i == self.num_ins else F.relu(outs[-1])
            outs.append(self.fpn_convs[i](src))
        return outs

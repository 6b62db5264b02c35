"""Bottleneck ResNet (pytorch or caffe style) with optional DCNv2, inference only.

Module names follow mmdet's ResNet (conv1/bn1/layerN.i.convK/bnK/downsample.{0,1}) and mmcv's
ModulatedDeformConv2dPack (weight + conv_offset) so official checkpoints map almost 1:1.
BatchNorm is kept as nn.BatchNorm2d (eval mode) rather than folded: the exported graph then
shows the inference batch_norm that the compiler may fold itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import BEVFormerConfig

__all__ = ["ModulatedDeformConv2d", "Bottleneck", "ResNet"]


class ModulatedDeformConv2d(nn.Module):
    """DCNv2 (deform_groups=1, groups=1, no bias) written with plain ops.

    A regular conv (`conv_offset`, 3*k*k channels) predicts per output pixel and per kernel tap t
    an offset (dy, dx) = channels (2t, 2t+1) and a modulation mask = sigmoid(channel 2*k*k + t),
    exactly mmcv's layout. Each tap samples the input bilinearly with zero padding at
    p = base + offset; grid_sample(align_corners=False) reproduces that when fed the normalised
    coordinate g = (2p + 1) / size - 1. All taps go through ONE grid_sample (taps stacked along
    the height of the grid), then mask, then an im2col matmul with the (out, in*k*k) weight.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 padding: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding = padding
        self.dilation = dilation
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.conv_offset = nn.Conv2d(in_channels, 3 * kernel_size * kernel_size, kernel_size,
                                     stride, padding, dilation, bias=True)
        # mmcv zero-inits the offset conv; keep it small but non-zero so tests exercise sampling.
        nn.init.normal_(self.conv_offset.weight, std=0.05)
        nn.init.normal_(self.conv_offset.bias, std=0.5)

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        k, kk = self.kernel_size, self.kernel_size * self.kernel_size
        om = self.conv_offset(x)  # (n, 3*kk, ho, wo)
        ho, wo = int(om.shape[2]), int(om.shape[3])
        offset = om[:, : 2 * kk].reshape(n, kk, 2, ho, wo)
        mask = torch.sigmoid(om[:, 2 * kk:])  # (n, kk, ho, wo)

        # Sampling position of tap (i, j) at output (oy, ox): oy*stride - pad + i*dilation + dy.
        tap = torch.arange(k, dtype=x.dtype, device=x.device) * self.dilation
        oy = torch.arange(ho, dtype=x.dtype, device=x.device) * self.stride - self.padding
        ox = torch.arange(wo, dtype=x.dtype, device=x.device) * self.stride - self.padding
        base_y = (tap.view(k, 1, 1, 1) + oy.view(1, 1, ho, 1)).expand(k, k, ho, wo).reshape(kk, ho, wo)
        base_x = (tap.view(1, k, 1, 1) + ox.view(1, 1, 1, wo)).expand(k, k, ho, wo).reshape(kk, ho, wo)
        py = base_y + offset[:, :, 0]  # (n, kk, ho, wo)
        px = base_x + offset[:, :, 1]
        gx = (2.0 * px + 1.0) / w - 1.0
        gy = (2.0 * py + 1.0) / h - 1.0
        grid = torch.stack((gx, gy), dim=-1).reshape(n, kk * ho, wo, 2)
        sampled = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        cols = sampled.reshape(n, c, kk, ho * wo) * mask.reshape(n, 1, kk, ho * wo)
        cols = cols.reshape(n, c * kk, ho * wo)  # im2col order (c, i, j) = weight layout
        out = torch.matmul(self.weight.reshape(self.out_channels, c * kk), cols)
        return out.reshape(n, self.out_channels, ho, wo)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, style: str, with_dcn: bool) -> None:
        super().__init__()
        # pytorch style puts the stride on the 3x3 conv, caffe style on the first 1x1 conv.
        s1, s2 = (stride, 1) if style == "caffe" else (1, stride)
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, s1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        if with_dcn:
            self.conv2: nn.Module = ModulatedDeformConv2d(planes, planes, 3, s2, 1)
        else:
            self.conv2 = nn.Conv2d(planes, planes, 3, s2, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + identity)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, BN, ReLU, 3x3/2 max-pool) + 4 bottleneck stages (layer1..layer4)."""

    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        self.out_indices = tuple(cfg.out_indices)
        self.conv1 = nn.Conv2d(3, cfg.stem_channels, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(cfg.stem_channels)
        inplanes = cfg.stem_channels
        self.num_stages = len(cfg.stage_blocks)
        for s, (blocks, planes) in enumerate(zip(cfg.stage_blocks, cfg.stage_planes)):
            stride = 1 if s == 0 else 2
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(inplanes, planes, stride if b == 0 else 1, cfg.style,
                                        cfg.stage_with_dcn[s]))
                inplanes = planes * Bottleneck.expansion
            self.add_module(f"layer{s + 1}", nn.Sequential(*layer))

    def forward(self, x: Tensor) -> list[Tensor]:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        outs: list[Tensor] = []
        for s in range(self.num_stages):
            x = getattr(self, f"layer{s + 1}")(x)
            if s in self.out_indices:
                outs.append(x)
        return outs

"""BEVFormer encoder: reference points, camera projection, ego-motion alignment and layers.

Everything that the original computes from img_metas in numpy (lidar2img projection, shift,
prev-BEV rotation) is done here on tensors so it is part of the single exported graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import SpatialCrossAttention, SpatialShapes, TemporalSelfAttention
from .config import BEVFormerConfig

__all__ = [
    "reference_points_3d",
    "reference_points_2d",
    "point_sampling",
    "camera_visibility",
    "bev_shift",
    "rotation_base_grid",
    "rotate_bev",
    "FFN",
    "EncoderLayer",
    "BEVFormerEncoder",
]

EPS = 1e-5


def reference_points_3d(cfg: BEVFormerConfig) -> Tensor:
    """(D, H*W, 3) pillar points in metres, computed with the original's float32 op order:
    normalised cell centres (z at (linspace(.5, Z-.5, D))/Z), then scaled to pc_range."""
    h, w, d = cfg.bev_h, cfg.bev_w, cfg.num_points_in_pillar
    pc = cfg.pc_range
    z_len = pc[5] - pc[2]
    zs = torch.linspace(0.5, z_len - 0.5, d).view(-1, 1, 1).expand(d, h, w) / z_len
    xs = torch.linspace(0.5, w - 0.5, w).view(1, 1, w).expand(d, h, w) / w
    ys = torch.linspace(0.5, h - 0.5, h).view(1, h, 1).expand(d, h, w) / h
    ref = torch.stack((xs, ys, zs), -1).permute(0, 3, 1, 2).flatten(2).permute(0, 2, 1).clone()
    ref[..., 0:1] = ref[..., 0:1] * (pc[3] - pc[0]) + pc[0]
    ref[..., 1:2] = ref[..., 1:2] * (pc[4] - pc[1]) + pc[1]
    ref[..., 2:3] = ref[..., 2:3] * (pc[5] - pc[2]) + pc[2]
    return ref.contiguous()


def reference_points_2d(bev_h: int, bev_w: int) -> Tensor:
    """(H*W, 2) BEV cell centres as (x, y) in (0, 1); query index is y * W + x."""
    ref_y, ref_x = torch.meshgrid(torch.linspace(0.5, bev_h - 0.5, bev_h),
                                  torch.linspace(0.5, bev_w - 0.5, bev_w), indexing="ij")
    return torch.stack((ref_x.reshape(-1) / bev_w, ref_y.reshape(-1) / bev_h), -1).contiguous()


def point_sampling(ref_3d: Tensor, lidar2img: Tensor, img_h: int, img_w: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Project pillar points into every camera.

    ref_3d (D, HW, 3) metres; lidar2img (1, cams, 4, 4). Returns reference_points_cam
    (cams, HW, D, 2) normalised by the (padded) image size, the visibility mask (cams, HW, D)
    (depth > eps and strictly inside the image) and the camera depth (cams, HW, D).
    Points behind a camera are divided by eps and keep huge (~1e9) coordinates, as in the
    original; they are masked out and sample zeros.
    """
    d, hw, _ = ref_3d.shape
    cams = lidar2img.shape[1]
    pts = torch.cat((ref_3d, torch.ones_like(ref_3d[..., :1])), -1).reshape(1, d * hw, 4)
    cam = torch.matmul(pts, lidar2img[0].transpose(1, 2))  # (cams, D*HW, 4)
    cam = cam.reshape(cams, d, hw, 4).permute(0, 2, 1, 3)  # (cams, HW, D, 4)
    depth = cam[..., 2]
    xy = cam[..., 0:2] / cam[..., 2:3].clamp(min=EPS)
    u = xy[..., 0] / img_w
    v = xy[..., 1] / img_h
    mask = torch.logical_and(depth > EPS, torch.logical_and(v > 0.0, v < 1.0))
    mask = torch.logical_and(mask, torch.logical_and(u < 1.0, u > 0.0))
    return torch.stack((u, v), -1), mask, depth


def camera_visibility(mask: Tensor) -> tuple[Tensor, Tensor]:
    """mask (cams, HW, D) -> visible (cams, HW) float 0/1 (any pillar point seen) and the
    per-query camera count clamped to >= 1 (HW,), the SCA normaliser."""
    visible = (mask.to(torch.float32).sum(-1) > 0.0).to(torch.float32)
    return visible, visible.sum(0).clamp(min=1.0)


def bev_shift(can_bus: Tensor, cfg: BEVFormerConfig) -> Tensor:
    """(2,) BEV shift (x, y) in grid fractions from the ego translation in can_bus.

    Done in float64 like the original's numpy code, then cast to float32.
    """
    cb = can_bus.to(torch.float64)
    dx, dy = cb[0], cb[1]
    grid_len_y = (cfg.pc_range[4] - cfg.pc_range[1]) / cfg.bev_h
    grid_len_x = (cfg.pc_range[3] - cfg.pc_range[0]) / cfg.bev_w
    ego_angle = cb[-2] / math.pi * 180.0
    length = torch.sqrt(dx * dx + dy * dy)
    trans_angle = torch.atan2(dy, dx) / math.pi * 180.0
    trans_angle = torch.where(trans_angle < 0.0, trans_angle + 360.0, trans_angle)
    bev_angle = (ego_angle - trans_angle) / 180.0 * math.pi
    shift_y = length * torch.cos(bev_angle) / grid_len_y / cfg.bev_h
    shift_x = length * torch.sin(bev_angle) / grid_len_x / cfg.bev_w
    return torch.stack((shift_x, shift_y)).to(torch.float32)


def rotation_base_grid(bev_h: int, bev_w: int) -> Tensor:
    """(1, H*W, 3) pixel-centre grid [x, y, 1] relative to the image centre, float32, exactly as
    torchvision's _gen_affine_grid builds it."""
    x = torch.linspace(-bev_w * 0.5 + 0.5, bev_w * 0.5 + 0.5 - 1, steps=bev_w)
    y = torch.linspace(-bev_h * 0.5 + 0.5, bev_h * 0.5 + 0.5 - 1, steps=bev_h)
    base = torch.empty(1, bev_h, bev_w, 3)
    base[..., 0].copy_(x)
    base[..., 1].copy_(y.unsqueeze(-1))
    base[..., 2].fill_(1.0)
    return base.reshape(1, bev_h * bev_w, 3)


def rotate_bev(prev_bev: Tensor, angle_deg: Tensor, base_grid: Tensor, bev_h: int, bev_w: int,
               center: tuple[float, float]) -> Tensor:
    """torchvision.transforms.functional.rotate(prev, angle, center) with NEAREST sampling,
    zero fill, align_corners=False, as the original applies it to prev_bev (HW, 1, C).

    The inverse affine matrix is built in float64 (torchvision uses Python floats) and cast to
    float32: building it in float32 moves some sampling points across .5 ties of the nearest
    rounding.
    """
    c = prev_bev.shape[-1]
    img = prev_bev.reshape(bev_h, bev_w, c).permute(2, 0, 1).unsqueeze(0)  # (1, C, H, W)
    cx = center[0] - bev_w * 0.5  # centre relative to the image centre (pixels)
    cy = center[1] - bev_h * 0.5
    rot = -angle_deg.to(torch.float64) * (math.pi / 180.0)  # rotate() passes -angle
    cos_r, sin_r = torch.cos(rot), torch.sin(rot)
    m2 = (cos_r * -cx + sin_r * -cy) + cx
    m5 = (-sin_r * -cx + cos_r * -cy) + cy
    theta = torch.stack((cos_r, sin_r, m2, -sin_r, cos_r, m5)).to(torch.float32).reshape(1, 2, 3)
    scale = torch.tensor([0.5 * bev_w, 0.5 * bev_h], dtype=torch.float32, device=theta.device)
    grid = torch.bmm(base_grid, theta.transpose(1, 2) / scale).reshape(1, bev_h, bev_w, 2)
    out = F.grid_sample(img, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return out[0].permute(1, 2, 0).reshape(bev_h * bev_w, 1, c)


class FFN(nn.Module):
    """Linear -> ReLU -> Linear with the residual added (mmcv FFN, dropout removed)."""

    def __init__(self, embed_dims: int, ffn_dims: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, ffn_dims)
        self.fc2 = nn.Linear(ffn_dims, embed_dims)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.relu(self.fc1(x))) + x


class EncoderLayer(nn.Module):
    """Post-norm: TSA -> LN -> SCA -> LN -> FFN -> LN."""

    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        c = cfg.embed_dims
        self.tsa = TemporalSelfAttention(c, cfg.num_heads, cfg.tsa_points)
        self.norm1 = nn.LayerNorm(c)
        self.sca = SpatialCrossAttention(c, cfg.num_heads, cfg.num_levels, cfg.sca_points)
        self.norm2 = nn.LayerNorm(c)
        self.ffn = FFN(c, cfg.ffn_dims)
        self.norm3 = nn.LayerNorm(c)

    def forward(self, x: Tensor, bev_pos: Tensor, bev_queue: Tensor, ref_2d: Tensor,
                feats: Tensor, ref_cam: Tensor, visible: Tensor, visible_count: Tensor,
                bev_shapes: SpatialShapes, img_shapes: SpatialShapes) -> Tensor:
        x = self.norm1(self.tsa(x, bev_pos, bev_queue, ref_2d, bev_shapes))
        x = self.norm2(self.sca(x, feats, ref_cam, visible, visible_count, img_shapes))
        return self.norm3(self.ffn(x))


class BEVFormerEncoder(nn.Module):
    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        self.bev_h, self.bev_w = cfg.bev_h, cfg.bev_w
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_enc_layers))
        # Constants, kept as non-persistent buffers (not part of any checkpoint).
        self.register_buffer("ref_3d", reference_points_3d(cfg), persistent=False)
        self.register_buffer("ref_2d", reference_points_2d(cfg.bev_h, cfg.bev_w), persistent=False)

    def forward(self, bev_query: Tensor, bev_pos: Tensor, feats: Tensor, img_shapes: SpatialShapes,
                lidar2img: Tensor, img_hw: tuple[int, int], prev_bev: Tensor, use_prev_bev: Tensor,
                shift: Tensor) -> Tensor:
        """bev_query/bev_pos (1, HW, C); feats (cams, S, C); prev_bev (1, HW, C) already rotated;
        use_prev_bev 0-d float (0 or 1); shift (2,). Returns the BEV features (1, HW, C)."""
        ref_cam, mask, _ = point_sampling(self.ref_3d, lidar2img, img_hw[0], img_hw[1])
        visible, visible_count = camera_visibility(mask)
        u = use_prev_bev
        # TSA queue: with a previous frame [rotated prev_bev, initial query] at [shifted, plain]
        # reference points; without one [x, x] of the current layer input at plain points.
        # Both cases in one graph by blending with u (u is exactly 0 or 1, so no mixing).
        ref_2d = torch.stack((self.ref_2d + shift * u, self.ref_2d))  # (2, HW, 2)
        prev_pair = torch.cat((prev_bev, bev_query), 0)  # (2, HW, C)
        bev_shapes = [(self.bev_h, self.bev_w)]
        x = bev_query
        for layer in self.layers:
            queue = u * prev_pair + (1.0 - u) * torch.cat((x, x), 0)
            x = layer(x, bev_pos, queue, ref_2d, feats, ref_cam, visible, visible_count,
                      bev_shapes, img_shapes)
        return x

"""Deterministic model inputs for tests and examples.

Two (or more) pinhole cameras with hand-made lidar2img matrices: camera 0 looks along +x, camera 1
along +y, both with a 120 degree horizontal field of view, so BEV cells in the +x/+y quadrant
are seen by both cameras, cells ahead of only one camera by one, and cells at -x/-y by none;
the -x half of the grid is behind camera 0 (depth <= 0), the -y half behind camera 1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import BEVFormerConfig

__all__ = ["camera_lidar2img", "make_lidar2img", "make_can_bus", "make_test_inputs",
           "normalize_images", "YAW_STEP_DEG"]

YAW_STEP_DEG = 7.0  # ego yaw change between consecutive test frames
_TRANSLATION = (3.1, 1.2, 0.04)  # ego translation (m) between consecutive test frames
_BASE_YAW_RAD = 0.35


def camera_lidar2img(position: tuple[float, float, float], yaw_deg: float, img_h: int,
                     img_w: int, hfov_deg: float = 120.0) -> Tensor:
    """4x4 lidar->image matrix (float64) of a level pinhole camera at `position` looking along
    yaw (0 = +x, 90 = +y); image x to the right, y down, depth along the view direction."""
    yaw = math.radians(yaw_deg)
    fwd = (math.cos(yaw), math.sin(yaw), 0.0)
    right = (math.sin(yaw), -math.cos(yaw), 0.0)  # fwd x up
    down = (0.0, 0.0, -1.0)
    rot = torch.tensor([right, down, fwd], dtype=torch.float64)
    lidar2cam = torch.eye(4, dtype=torch.float64)
    lidar2cam[:3, :3] = rot
    lidar2cam[:3, 3] = -rot @ torch.tensor(position, dtype=torch.float64)
    f = (img_w / 2.0) / math.tan(math.radians(hfov_deg) / 2.0)
    intrinsic = torch.eye(4, dtype=torch.float64)
    intrinsic[0, 0], intrinsic[1, 1] = f, f
    intrinsic[0, 2], intrinsic[1, 2] = img_w / 2.0, img_h / 2.0
    return intrinsic @ lidar2cam


def make_lidar2img(cfg: BEVFormerConfig) -> Tensor:
    """(1, cams, 4, 4) float32. Camera i faces yaw 5 + 90 i degrees (5 + 360 i / cams with more
    than 4 cameras); slightly off-axis and off the origin so no pillar point sits exactly on an
    image border or at zero depth."""
    mats = []
    step = 90.0 if cfg.num_cams <= 4 else 360.0 / cfg.num_cams
    for i in range(cfg.num_cams):
        yaw = 5.0 + step * i
        pos = (1.0 - 0.7 * (i % 2), 0.2 + 0.8 * (i % 2), 1.5 + 0.05 * i)
        mats.append(camera_lidar2img(pos, yaw, cfg.img_h, cfg.img_w))
    return torch.stack(mats).unsqueeze(0).to(torch.float32)


def make_can_bus(frame: int, seed: int = 0) -> Tensor:
    """(18,) float32 can_bus as the model expects it: [:3] translation delta to the previous
    frame, [-2] absolute yaw (rad), [-1] yaw delta (deg); deltas are zero on frame 0."""
    gen = torch.Generator().manual_seed(seed + 1000)
    can_bus = torch.randn(18, generator=gen, dtype=torch.float64) * 0.5  # quat/acc/rates/velocity
    can_bus[:3] = torch.tensor(_TRANSLATION, dtype=torch.float64) if frame > 0 else 0.0
    can_bus[-2] = _BASE_YAW_RAD + math.radians(YAW_STEP_DEG) * frame
    can_bus[-1] = YAW_STEP_DEG if frame > 0 else 0.0
    return can_bus.to(torch.float32)


def make_test_inputs(cfg: BEVFormerConfig, frame: int = 0, seed: int = 0,
                     prev_bev: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(images, lidar2img, can_bus, prev_bev, use_prev_bev) for one step at batch 1.

    Frame 0 has no previous BEV: use_prev_bev = 0 and prev_bev = zeros. Later frames use
    use_prev_bev = 1 and `prev_bev` (pass the previous step's bev_embed; a seeded random tensor
    is used when it is None), with a non-zero ego translation and a 7 degree yaw change.
    Images are already normalised (standard normal noise, seeded per frame).
    """
    gen = torch.Generator().manual_seed(seed * 9973 + frame)
    images = torch.randn(1, cfg.num_cams, 3, cfg.img_h, cfg.img_w, generator=gen)
    hw, c = cfg.bev_h * cfg.bev_w, cfg.embed_dims
    if frame == 0:
        prev = torch.zeros(hw, 1, c)
        use_prev = torch.tensor(0.0)
    else:
        prev = prev_bev if prev_bev is not None else torch.randn(hw, 1, c, generator=gen)
        use_prev = torch.tensor(1.0)
    return images, make_lidar2img(cfg), make_can_bus(frame, seed), prev, use_prev


def normalize_images(images: Tensor, cfg: BEVFormerConfig) -> Tensor:
    """Raw 0..255 images (..., 3, H, W) in BGR (mmcv's loader order) -> the model's input:
    optional BGR->RGB, then (x - mean) / std with the config's statistics."""
    if cfg.to_rgb:
        images = images.flip(-3)
    mean = torch.tensor(cfg.img_mean, dtype=images.dtype).view(3, 1, 1)
    std = torch.tensor(cfg.img_std, dtype=images.dtype).view(3, 1, 1)
    return (images - mean) / std

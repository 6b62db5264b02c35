"""BEVFormer, one temporal step at batch 1, as one export-friendly module.

forward(images, lidar2img, can_bus, prev_bev, use_prev_bev) ->
    (all_cls_scores (L, 1, Q, classes), all_bbox_preds (L, 1, Q, code_size), bev_embed (HW, 1, C))

bev_embed is the next frame's prev_bev. The first frame (or a scene change) passes
use_prev_bev = 0 and a zero prev_bev of the same shape; the graph is identical either way.
can_bus must already hold the deltas to the previous frame in [:3] and [-1] (zeros without one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .backbone import ResNet
from .config import BEVFormerConfig, get_config
from .decoder import Decoder
from .encoder import BEVFormerEncoder, bev_shift, rotate_bev, rotation_base_grid
from .fpn import FPN
from .heads import DetectionHeads

__all__ = ["CanBusMLP", "BEVFormer", "build_bevformer"]


class CanBusMLP(nn.Module):
    """Linear(18, C/2) -> ReLU -> Linear(C/2, C) -> ReLU -> LayerNorm(C); added to every BEV query."""

    def __init__(self, in_dims: int, embed_dims: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dims, embed_dims // 2)
        self.fc2 = nn.Linear(embed_dims // 2, embed_dims)
        self.norm = nn.LayerNorm(embed_dims)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BEVFormer(nn.Module):
    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c, hw = cfg.embed_dims, cfg.bev_h * cfg.bev_w
        self.backbone = ResNet(cfg)
        self.neck = FPN(cfg.fpn_in_channels, c, cfg.num_outs)
        self.bev_embedding = nn.Parameter(torch.randn(hw, c))
        self.query_embedding = nn.Parameter(torch.randn(cfg.num_query, 2 * c))
        # Learned positional encoding: channel [0:C/2] from the column, [C/2:C] from the row.
        self.row_embed = nn.Parameter(torch.rand(cfg.bev_h, cfg.pos_feats))
        self.col_embed = nn.Parameter(torch.rand(cfg.bev_w, cfg.pos_feats))
        self.level_embeds = nn.Parameter(torch.randn(cfg.num_feature_levels, c))
        self.cams_embeds = nn.Parameter(torch.randn(cfg.num_cams, c))
        self.can_bus_mlp = CanBusMLP(cfg.can_bus_dims, c)
        self.encoder = BEVFormerEncoder(cfg)
        self.decoder = Decoder(cfg)
        self.heads = DetectionHeads(cfg)
        self.register_buffer("rotation_grid", rotation_base_grid(cfg.bev_h, cfg.bev_w),
                             persistent=False)

    def bev_pos(self) -> Tensor:
        """(HW, C) positional encoding, query index y * W + x."""
        h, w = self.cfg.bev_h, self.cfg.bev_w
        col = self.col_embed.unsqueeze(0).expand(h, w, -1)
        row = self.row_embed.unsqueeze(1).expand(h, w, -1)
        return torch.cat((col, row), -1).reshape(h * w, -1)

    def image_features(self, images: Tensor) -> tuple[Tensor, list[tuple[int, int]]]:
        """images (1, cams, 3, H, W) -> flattened multi-level features (cams, S, C) with camera
        and level embeddings added, and the per-level (h, w) as Python ints."""
        b, cams, _, h, w = images.shape
        feats = self.neck(self.backbone(images.reshape(b * cams, 3, h, w)))
        flat: list[Tensor] = []
        shapes: list[tuple[int, int]] = []
        for lvl, f in enumerate(feats):
            shapes.append((int(f.shape[2]), int(f.shape[3])))
            f = f.flatten(2).permute(0, 2, 1)  # (cams, h*w, C)
            flat.append(f + self.cams_embeds[:, None, :] + self.level_embeds[lvl])
        return (flat[0] if len(flat) == 1 else torch.cat(flat, 1)), shapes

    def forward(self, images: Tensor, lidar2img: Tensor, can_bus: Tensor, prev_bev: Tensor,
                use_prev_bev: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        assert images.shape[0] == 1, "batch 1 only (as BEVFormer's temporal inference)"
        assert images.shape[1] == cfg.num_cams
        feats, img_shapes = self.image_features(images)

        bev_query = (self.bev_embedding + self.can_bus_mlp(can_bus)).unsqueeze(0)  # (1, HW, C)
        bev_pos = self.bev_pos().unsqueeze(0)
        shift = bev_shift(can_bus, cfg)
        prev = rotate_bev(prev_bev, can_bus[-1], self.rotation_grid, cfg.bev_h, cfg.bev_w,
                          cfg.rotate_center).permute(1, 0, 2)  # (1, HW, C)
        img_hw = (int(images.shape[3]), int(images.shape[4]))
        bev = self.encoder(bev_query, bev_pos, feats, img_shapes, lidar2img, img_hw, prev,
                           use_prev_bev, shift)

        states, refined, regs = self.decoder(self.query_embedding, bev, self.heads.reg_branches)
        all_cls_scores, all_bbox_preds = self.heads(states, refined, regs)
        return all_cls_scores, all_bbox_preds, bev.permute(1, 0, 2)


def _randomize_norms(model: nn.Module) -> None:
    """Non-trivial norm parameters/statistics so the tests exercise every term."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.uniform_(0.8, 1.2)
                m.bias.normal_(0.0, 0.1)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)


def build_bevformer(name_or_cfg: str | BEVFormerConfig = "test_tiny", seed: int = 0,
                    **overrides: object) -> BEVFormer:
    """Build a BEVFormer in eval mode with deterministic random weights (seeded, without
    touching the global RNG state). Load real weights with weights.load_official_state_dict."""
    cfg = get_config(name_or_cfg, **overrides) if isinstance(name_or_cfg, str) else name_or_cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BEVFormer(cfg)
        _randomize_norms(model)
    return model.eval()

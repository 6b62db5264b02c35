"""BEVFormer configurations: the two published sizes and two CPU test sizes.

`tiny` and `base` follow the official BEVFormer configs (nuScenes, 6 cameras). `test_tiny` and
`test_base` keep every structural feature of their big siblings (single level vs. caffe ResNet +
DCNv2 + 4 FPN levels, TSA with two queues, dense SCA over pillars, box refinement) at a size that
runs in well under a second on a CPU, so eager/exported/compiled parity can be checked quickly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["BEVFormerConfig", "CONFIGS", "get_config"]


@dataclass(frozen=True)
class BEVFormerConfig:
    name: str
    # cameras / images (images are given to the model already normalised and padded to /32)
    num_cams: int = 6
    img_h: int = 480
    img_w: int = 800
    img_mean: tuple[float, float, float] = (123.675, 116.28, 103.53)
    img_std: tuple[float, float, float] = (58.395, 57.12, 57.375)
    to_rgb: bool = True
    # backbone: bottleneck ResNet (expansion 4)
    stage_blocks: tuple[int, ...] = (3, 4, 6, 3)
    stem_channels: int = 64
    stage_planes: tuple[int, ...] = (64, 128, 256, 512)
    style: str = "pytorch"  # "pytorch": stride on the 3x3 conv; "caffe": stride on the first 1x1
    out_indices: tuple[int, ...] = (3,)
    stage_with_dcn: tuple[bool, ...] = (False, False, False, False)
    # neck: FPN with extra convs on the output, ReLU before the 2nd+ extra conv
    num_outs: int = 1
    # transformer
    embed_dims: int = 256
    num_heads: int = 8
    ffn_dims: int = 512
    bev_h: int = 50
    bev_w: int = 50
    num_enc_layers: int = 3
    num_dec_layers: int = 6
    num_query: int = 900
    num_classes: int = 10
    code_size: int = 10
    pc_range: tuple[float, ...] = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
    num_points_in_pillar: int = 4
    sca_points: int = 8
    tsa_points: int = 4
    dec_points: int = 4
    num_feature_levels: int = 4  # size of level_embeds (4 even when fewer levels are used)
    rotate_center: tuple[float, float] = (100.0, 100.0)  # (x, y) in BEV pixels, as the original
    can_bus_dims: int = 18
    # NMS-free decoding
    max_num: int = 300
    post_center_range: tuple[float, ...] = (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0)

    @property
    def expansion(self) -> int:
        return 4

    @property
    def stage_out_channels(self) -> tuple[int, ...]:
        return tuple(p * self.expansion for p in self.stage_planes)

    @property
    def fpn_in_channels(self) -> tuple[int, ...]:
        return tuple(self.stage_out_channels[i] for i in self.out_indices)

    @property
    def num_levels(self) -> int:
        """Feature levels seen by spatial cross-attention (= FPN outputs)."""
        return self.num_outs

    @property
    def head_dims(self) -> int:
        return self.embed_dims // self.num_heads

    @property
    def pos_feats(self) -> int:
        return self.embed_dims // 2


_TINY = BEVFormerConfig(name="tiny")

_BASE = replace(
    _TINY,
    name="base",
    img_h=928,
    img_w=1600,
    img_mean=(103.530, 116.280, 123.675),
    img_std=(1.0, 1.0, 1.0),
    to_rgb=False,
    stage_blocks=(3, 4, 23, 3),
    style="caffe",
    out_indices=(1, 2, 3),
    stage_with_dcn=(False, False, True, True),
    num_outs=4,
    bev_h=200,
    bev_w=200,
    num_enc_layers=6,
)

# Test sizes (docs/bevformer.md): 2 cameras, 64x96 images, small bottleneck ResNet [1,1,2,1],
# embed 32 = 4 heads x 8, FFN 64, non-square 6x8 BEV, 2+2 layers, 16 queries.
_TEST_TINY = replace(
    _TINY,
    name="test_tiny",
    num_cams=2,
    img_h=64,
    img_w=96,
    stage_blocks=(1, 1, 2, 1),
    stem_channels=8,
    stage_planes=(8, 8, 12, 16),
    embed_dims=32,
    num_heads=4,
    ffn_dims=64,
    bev_h=6,
    bev_w=8,
    num_enc_layers=2,
    num_dec_layers=2,
    num_query=16,
    # The original centre (100, 100) lies ~130 cells away from a 6x8 grid, so a 7 degree yaw would
    # rotate the whole previous BEV out of the grid. A centre just outside the grid keeps the test
    # meaningful: part of prev_bev survives, part is zero-padded.
    rotate_center=(10.0, 9.0),
)

_TEST_BASE = replace(
    _TEST_TINY,
    name="test_base",
    img_mean=_BASE.img_mean,
    img_std=_BASE.img_std,
    to_rgb=False,
    style="caffe",
    out_indices=(1, 2, 3),
    stage_with_dcn=(False, False, True, True),
    num_outs=4,
)

CONFIGS: dict[str, BEVFormerConfig] = {
    c.name: c for c in (_TINY, _BASE, _TEST_TINY, _TEST_BASE)
}


def get_config(name: str, **overrides: object) -> BEVFormerConfig:
    """Preset by name ("tiny", "base", "test_tiny", "test_base"), optionally with overrides."""
    if name not in CONFIGS:
        raise KeyError(f"unknown BEVFormer config {name!r}; known: {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    return replace(cfg, **overrides) if overrides else cfg

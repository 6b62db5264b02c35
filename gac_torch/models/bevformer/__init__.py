"""Pure-PyTorch, torch.export-friendly BEVFormer (one temporal step, batch 1).

    from gac_torch.models.bevformer import build_bevformer, make_test_inputs
    model = build_bevformer("test_tiny", seed=0)
    args = make_test_inputs(model.cfg, frame=0)
    all_cls_scores, all_bbox_preds, bev_embed = model(*args)

See docs/bevformer.md for the architecture, the configs and the test-size configuration.
"""

from .config import CONFIGS, BEVFormerConfig, get_config
from .decode import decode_bboxes
from .inputs import make_can_bus, make_lidar2img, make_test_inputs, normalize_images
from .model import BEVFormer, build_bevformer
from .weights import (
    load_official_state_dict,
    make_official_state_dict,
    official_state_dict_shapes,
    official_to_internal,
)

__all__ = [
    "BEVFormer",
    "BEVFormerConfig",
    "CONFIGS",
    "build_bevformer",
    "decode_bboxes",
    "get_config",
    "load_official_state_dict",
    "make_can_bus",
    "make_lidar2img",
    "make_official_state_dict",
    "make_test_inputs",
    "normalize_images",
    "official_state_dict_shapes",
    "official_to_internal",
]

"""NMS-free box decoding (NMSFreeCoder + BEVFormerHead.get_bboxes), eager only.

It has data-dependent output sizes (the boolean range filter), so it stays outside the
exported graph and runs on the model outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import BEVFormerConfig

__all__ = ["denormalize_bbox", "decode_bboxes"]


def denormalize_bbox(boxes: Tensor) -> Tensor:
    """(N, 10) code (cx, cy, w, l, cz, h, sin, cos, vx, vy) with log sizes ->
    (N, 9) (cx, cy, cz, w, l, h, yaw, vx, vy)."""
    rot = torch.atan2(boxes[:, 6:7], boxes[:, 7:8])
    sizes = boxes[:, [2, 3, 5]].exp()
    out = [boxes[:, 0:2], boxes[:, 4:5], sizes, rot]
    if boxes.shape[-1] > 8:
        out.append(boxes[:, 8:10])
    return torch.cat(out, -1)


def decode_bboxes(all_cls_scores: Tensor, all_bbox_preds: Tensor, cfg: BEVFormerConfig,
                  score_threshold: float | None = None, bottom_center: bool = True
                  ) -> list[dict[str, Tensor]]:
    """Decode the last decoder layer's predictions, one dict per batch element with
    'bboxes' (N, 9), 'scores' (N,), 'labels' (N,).

    Top-k (cfg.max_num, 300) over all query x class sigmoid scores, boxes gathered by query,
    kept when the centre lies inside cfg.post_center_range (and above score_threshold, if given,
    lowering it like the original when nothing passes). With bottom_center the box z is moved
    from the gravity centre to the bottom face, as BEVFormerHead.get_bboxes does.
    """
    cls_scores = all_cls_scores[-1]
    bbox_preds = all_bbox_preds[-1]
    num_classes = cls_scores.shape[-1]
    lo = torch.tensor(cfg.post_center_range[:3], dtype=bbox_preds.dtype)
    hi = torch.tensor(cfg.post_center_range[3:], dtype=bbox_preds.dtype)
    results: list[dict[str, Tensor]] = []
    for scores_b, boxes_b in zip(cls_scores, bbox_preds):
        k = min(cfg.max_num, scores_b.numel())
        scores, index = scores_b.sigmoid().reshape(-1).topk(k)
        labels = index % num_classes
        boxes = denormalize_bbox(boxes_b[torch.div(index, num_classes, rounding_mode="floor")])
        keep = (boxes[:, :3] >= lo).all(1) & (boxes[:, :3] <= hi).all(1)
        if score_threshold is not None:
            thresh = score_threshold
            passed = scores > thresh
            while passed.sum() == 0:
                thresh *= 0.9
                if thresh < 0.01:
                    passed = scores > -1
                    break
                passed = scores >= thresh
            keep &= passed
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        if bottom_center:
            boxes = boxes.clone()
            boxes[:, 2] = boxes[:, 2] - boxes[:, 5] * 0.5
        results.append({"bboxes": boxes, "scores": scores, "labels": labels})
    return results

"""Attention blocks of BEVFormer in plain PyTorch (batch 1, batch-first tensors).

* `ms_deform_attn`: multi-scale deformable attention with one grid_sample per level.
* `TemporalSelfAttention` (TSA): deformable attention over a 2-entry BEV queue
  (previous BEV, current BEV), averaged over the queue.
* `SpatialCrossAttention` (SCA) in dense form: every camera attends for every BEV query, the
  result is multiplied by the query's visibility in that camera and divided by the number of
  cameras that see it. The original gathers visible queries with nonzero (data-dependent
  shapes); the dense form gives the same values up to summation order.
* `DeformableCrossAttention`: the decoder's single-level deformable attention into the BEV.
* `MultiheadSelfAttention`: the decoder's self-attention (nn.MultiheadAttention maths with
  separate q/k/v projections so the graph has no weight slicing).

Spatial shapes are Python ints: iterating a shape *tensor* would make shapes data-dependent.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ms_deform_attn",
    "TemporalSelfAttention",
    "SpatialCrossAttention",
    "DeformableCrossAttention",
    "MultiheadSelfAttention",
]

SpatialShapes = list[tuple[int, int]]


def ms_deform_attn(value: Tensor, spatial_shapes: SpatialShapes, sampling_locations: Tensor,
                   attention_weights: Tensor) -> Tensor:
    """value (B, S, heads, d) with S = sum(h*w); sampling_locations (B, Q, heads, L, P, 2) as
    (x, y) in [0, 1]; attention_weights (B, Q, heads, L, P). Returns (B, Q, heads*d).

    Locations far outside [0, 1] (BEVFormer feeds ~1e9 for points behind a camera) sample zeros.
    """
    b, _, heads, d = value.shape
    _, q, _, levels, points, _ = sampling_locations.shape
    grids = 2.0 * sampling_locations - 1.0
    sampled: list[Tensor] = []
    start = 0
    for lvl, (h, w) in enumerate(spatial_shapes):
        v = value if levels == 1 else value[:, start:start + h * w]
        v = v.permute(0, 2, 3, 1).reshape(b * heads, d, h, w)
        start += h * w
        g = grids[:, :, :, lvl].permute(0, 2, 1, 3, 4).reshape(b * heads, q, points, 2)
        # (B*heads, d, Q, P)
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))
    stacked = sampled[0] if levels == 1 else torch.cat(sampled, dim=-1)  # (B*heads, d, Q, L*P)
    weights = attention_weights.permute(0, 2, 1, 3, 4).reshape(b * heads, 1, q, levels * points)
    out = (stacked * weights).sum(-1)  # (B*heads, d, Q)
    return out.reshape(b, heads * d, q).permute(0, 2, 1)


def _init_sampling_offsets(linear: nn.Linear, num_heads: int, groups: int, points: int) -> None:
    """Original bias pattern (head h points along angle 2*pi*h/heads, point p at distance p+1)
    plus small random weights, so offsets depend on the query (exercises the whole path)."""
    thetas = torch.arange(num_heads, dtype=torch.float32) * (2.0 * math.pi / num_heads)
    grid = torch.stack([thetas.cos(), thetas.sin()], -1)
    grid = grid / grid.abs().max(-1, keepdim=True)[0]
    grid = grid.view(num_heads, 1, 1, 2).repeat(1, groups, points, 1)
    grid = grid * torch.arange(1, points + 1, dtype=torch.float32).view(1, 1, points, 1)
    with torch.no_grad():
        nn.init.normal_(linear.weight, std=0.02)
        linear.bias.copy_(grid.reshape(-1))


def _offset_normalizer(spatial_shapes: SpatialShapes, dtype: torch.dtype, device: torch.device
                       ) -> Tensor:
    """(L, 2) tensor of (w, h) per level: offsets are given in feature-map pixels."""
    return torch.tensor([[float(w), float(h)] for h, w in spatial_shapes], dtype=dtype,
                        device=device)


class TemporalSelfAttention(nn.Module):
    """Deformable self-attention over the BEV queue [prev (or current), current].

    Offsets and weights are predicted from cat(value[0], query + pos) (2C channels), for each of
    the 2 queue entries; the two sampled results are averaged, projected and added to the query.
    """

    num_bev_queue = 2

    def __init__(self, embed_dims: int, num_heads: int, num_points: int, num_levels: int = 1
                 ) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_points, self.num_levels = num_points, num_levels
        nq = self.num_bev_queue
        self.sampling_offsets = nn.Linear(embed_dims * nq, nq * num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims * nq, nq * num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        _init_sampling_offsets(self.sampling_offsets, num_heads, nq * num_levels, num_points)

    def forward(self, query: Tensor, query_pos: Tensor, value: Tensor, reference_points: Tensor,
                spatial_shapes: SpatialShapes) -> Tensor:
        """query/query_pos (1, Q, C); value (2, Q, C) the BEV queue; reference_points (2, Q, 2)."""
        nq, heads, lv, pts = self.num_bev_queue, self.num_heads, self.num_levels, self.num_points
        _, num_query, c = query.shape
        num_value = value.shape[1]
        q = torch.cat([value[0:1], query + query_pos], dim=-1)  # (1, Q, 2C)
        v = self.value_proj(value).reshape(nq, num_value, heads, c // heads)
        # Linear outputs are laid out (heads, queue, level, point, xy); bring the queue first.
        offsets = self.sampling_offsets(q).reshape(num_query, heads, nq, lv, pts, 2)
        offsets = offsets.permute(2, 0, 1, 3, 4, 5)  # (2, Q, heads, L, P, 2)
        weights = self.attention_weights(q).reshape(num_query, heads, nq, lv * pts).softmax(-1)
        weights = weights.reshape(num_query, heads, nq, lv, pts).permute(2, 0, 1, 3, 4)
        norm = _offset_normalizer(spatial_shapes, offsets.dtype, offsets.device)
        loc = reference_points[:, :, None, None, None, :] + offsets / norm[None, None, None, :, None, :]
        out = ms_deform_attn(v, spatial_shapes, loc, weights)  # (2, Q, C)
        out = (out[0:1] + out[1:2]) / nq
        return self.output_proj(out) + query


class SpatialCrossAttention(nn.Module):
    """Dense SCA: BEV query -> multi-camera, multi-level image features at projected pillars.

    Sampling point p of a head/level is anchored on pillar point p % D (D points per pillar).
    The query carries no positional encoding (the original passes query_pos=None here).
    Parameter names: `deformable_attention.*` of the original live directly on this module.
    """

    def __init__(self, embed_dims: int, num_heads: int, num_levels: int, num_points: int) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        _init_sampling_offsets(self.sampling_offsets, num_heads, num_levels, num_points)

    def forward(self, query: Tensor, feats: Tensor, reference_points_cam: Tensor,
                visible: Tensor, visible_count: Tensor, spatial_shapes: SpatialShapes) -> Tensor:
        """query (1, Q, C); feats (cams, S, C); reference_points_cam (cams, Q, D, 2);
        visible (cams, Q) float 0/1; visible_count (Q,) float, already clamped to >= 1."""
        heads, lv, pts = self.num_heads, self.num_levels, self.num_points
        cams, num_value, c = feats.shape
        num_query = query.shape[1]
        d = reference_points_cam.shape[2]
        v = self.value_proj(feats).reshape(cams, num_value, heads, c // heads)
        # Offsets/weights depend on the query only, so they are shared by all cameras.
        offsets = self.sampling_offsets(query).reshape(1, num_query, heads, lv, pts, 2)
        weights = self.attention_weights(query).reshape(1, num_query, heads, lv * pts).softmax(-1)
        weights = weights.reshape(1, num_query, heads, lv, pts).expand(cams, -1, -1, -1, -1)
        norm = _offset_normalizer(spatial_shapes, offsets.dtype, offsets.device)
        offsets = (offsets / norm[None, None, None, :, None, :]).reshape(
            1, num_query, heads, lv, pts // d, d, 2)
        loc = reference_points_cam[:, :, None, None, None, :, :] + offsets
        loc = loc.reshape(cams, num_query, heads, lv, pts, 2)
        out = ms_deform_attn(v, spatial_shapes, loc, weights)  # (cams, Q, C)
        slots = (out * visible[:, :, None]).sum(0, keepdim=True)  # (1, Q, C)
        slots = slots / visible_count[None, :, None]
        return self.output_proj(slots) + query


class DeformableCrossAttention(nn.Module):
    """Decoder cross-attention (CustomMSDeformableAttention): object queries -> BEV features."""

    def __init__(self, embed_dims: int, num_heads: int, num_points: int, num_levels: int = 1
                 ) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, embed_dims)
        self.output_proj = nn.Linear(embed_dims, embed_dims)
        _init_sampling_offsets(self.sampling_offsets, num_heads, num_levels, num_points)

    def forward(self, query: Tensor, query_pos: Tensor, value: Tensor, reference_xy: Tensor,
                spatial_shapes: SpatialShapes) -> Tensor:
        """query/query_pos (1, Q, C); value (1, S, C); reference_xy (1, Q, 2) in [0, 1]."""
        heads, lv, pts = self.num_heads, self.num_levels, self.num_points
        b, num_query, c = query.shape
        q = query + query_pos
        v = self.value_proj(value).reshape(b, value.shape[1], heads, c // heads)
        offsets = self.sampling_offsets(q).reshape(b, num_query, heads, lv, pts, 2)
        weights = self.attention_weights(q).reshape(b, num_query, heads, lv * pts).softmax(-1)
        weights = weights.reshape(b, num_query, heads, lv, pts)
        norm = _offset_normalizer(spatial_shapes, offsets.dtype, offsets.device)
        loc = reference_xy[:, :, None, None, None, :] + offsets / norm[None, None, None, :, None, :]
        out = ms_deform_attn(v, spatial_shapes, loc, weights)
        return self.output_proj(out) + query


class MultiheadSelfAttention(nn.Module):
    """nn.MultiheadAttention maths (q scaled by 1/sqrt(d) before q@k^T), q=k=x+pos, v=x, plus
    the residual. The official packed in_proj_weight/bias is split into q/k/v by the loader."""

    def __init__(self, embed_dims: int, num_heads: int) -> None:
        super().__init__()
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.q_proj = nn.Linear(embed_dims, embed_dims)
        self.k_proj = nn.Linear(embed_dims, embed_dims)
        self.v_proj = nn.Linear(embed_dims, embed_dims)
        self.out_proj = nn.Linear(embed_dims, embed_dims)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return x.reshape(b, n, self.num_heads, c // self.num_heads).permute(0, 2, 1, 3).reshape(
            b * self.num_heads, n, c // self.num_heads)

    def forward(self, query: Tensor, query_pos: Tensor) -> Tensor:
        b, n, c = query.shape
        qk_in = query + query_pos
        scale = 1.0 / math.sqrt(c // self.num_heads)
        q = self._split_heads(self.q_proj(qk_in)) * scale
        k = self._split_heads(self.k_proj(qk_in))
        v = self._split_heads(self.v_proj(query))
        attn = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
        out = torch.bmm(attn, v)  # (B*heads, N, d)
        out = out.reshape(b, self.num_heads, n, c // self.num_heads).permute(0, 2, 1, 3).reshape(b, n, c)
        return self.out_proj(out) + query

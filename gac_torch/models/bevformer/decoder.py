"""Detection decoder with iterative box refinement (DetectionTransformerDecoder)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import DeformableCrossAttention, MultiheadSelfAttention, SpatialShapes
from .config import BEVFormerConfig
from .encoder import FFN

__all__ = ["inverse_sigmoid", "DecoderLayer", "Decoder"]


def inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    """log(x / (1 - x)) with the original's clamps, kept in exactly this form."""
    x = x.clamp(min=0.0, max=1.0)
    return torch.log(x.clamp(min=eps) / (1.0 - x).clamp(min=eps))


class DecoderLayer(nn.Module):
    """Post-norm: self-attn -> LN -> deformable cross-attn into the BEV -> LN -> FFN -> LN."""

    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        c = cfg.embed_dims
        self.self_attn = MultiheadSelfAttention(c, cfg.num_heads)
        self.norm1 = nn.LayerNorm(c)
        self.cross_attn = DeformableCrossAttention(c, cfg.num_heads, cfg.dec_points)
        self.norm2 = nn.LayerNorm(c)
        self.ffn = FFN(c, cfg.ffn_dims)
        self.norm3 = nn.LayerNorm(c)

    def forward(self, x: Tensor, query_pos: Tensor, bev: Tensor, reference_xy: Tensor,
                bev_shapes: SpatialShapes) -> Tensor:
        x = self.norm1(self.self_attn(x, query_pos))
        x = self.norm2(self.cross_attn(x, query_pos, bev, reference_xy, bev_shapes))
        return self.norm3(self.ffn(x))


class Decoder(nn.Module):
    """Object queries (pos | content, split from query_embedding) refine 3D reference points
    layer by layer: xy = sigmoid(reg[0:2] + isig(xy)), z = sigmoid(reg[4:5] + isig(z))."""

    def __init__(self, cfg: BEVFormerConfig) -> None:
        super().__init__()
        self.embed_dims = cfg.embed_dims
        self.bev_h, self.bev_w = cfg.bev_h, cfg.bev_w
        self.reference_points = nn.Linear(cfg.embed_dims, 3)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_dec_layers))

    def forward(self, query_embedding: Tensor, bev: Tensor, reg_branches: nn.ModuleList
                ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """query_embedding (Q, 2C); bev (1, HW, C).

        Returns per layer: the output states (1, Q, C), the refined reference points
        sigmoid(reg + isig(ref)) (1, Q, 3) = the next layer's reference and the heads' normalised
        box centre, and the raw regression (1, Q, code_size)."""
        c = self.embed_dims
        query_pos = query_embedding[:, :c].unsqueeze(0)
        x = query_embedding[:, c:].unsqueeze(0)
        ref = torch.sigmoid(self.reference_points(query_pos))  # (1, Q, 3)
        bev_shapes = [(self.bev_h, self.bev_w)]
        states: list[Tensor] = []
        refined: list[Tensor] = []
        regs: list[Tensor] = []
        for layer, reg_branch in zip(self.layers, reg_branches):
            x = layer(x, query_pos, bev, ref[..., 0:2], bev_shapes)
            reg = reg_branch(x)
            ref = torch.sigmoid(torch.cat((reg[..., 0:2] + inverse_sigmoid(ref[..., 0:2]),
                                           reg[..., 4:5] + inverse_sigmoid(ref[..., 2:3])), -1))
            states.append(x)
            refined.append(ref)
            regs.append(reg)
        return states, refined, regs

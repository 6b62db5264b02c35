"""Decompositions of PyTorch's fused inference fast paths.

Under `torch.no_grad()`, nn.TransformerEncoderLayer and nn.MultiheadAttention call single fused
kernels (`_transformer_encoder_layer_fwd`, `_native_multi_head_attention`) that core ATen does not
decompose; dynamo graphs then hold one opaque op and nothing would compile. These functions
restate them in plain ops (batch-first, no mask: the cases the fast paths take without a mask);
with a mask they return NotImplemented and the op runs eagerly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def _attention(x, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads):
    b, length, embed = x.shape
    head = embed // num_heads
    q, k, v = F.linear(x, qkv_weight, qkv_bias).split(embed, dim=-1)
    q, k, v = (t.reshape(b, length, num_heads, head).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, embed)
    return F.linear(out, proj_weight, proj_bias)


def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                  proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                                  norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                                  ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    if mask is not None or src.dim() != 3:
        return NotImplemented
    act = F.gelu if use_gelu else F.relu

    def norm1(t):
        return F.layer_norm(t, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(t):
        return F.layer_norm(t, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    def attn(t):
        return _attention(t, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads)

    def ffn(t):
        return F.linear(act(F.linear(t, ffn_weight_1, ffn_bias_1)), ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = src + attn(norm1(src))
        return x + ffn(norm2(x))
    x = norm1(src + attn(src))
    return norm2(x + ffn(x))


def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                proj_weight, proj_bias, mask=None, need_weights=True,
                                average_attn_weights=True, mask_type=None):
    same = query is key and key is value
    if mask is not None or need_weights or not same or query.dim() != 3:
        return NotImplemented
    out = _attention(query, qkv_weight, qkv_bias, proj_weight, proj_bias, num_head)
    return out, query.new_empty((0,))


FAST_PATH_DECOMPOSITIONS = {
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
    aten._native_multi_head_attention.default: native_multi_head_attention,
}

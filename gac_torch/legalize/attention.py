"""Fused scaled-dot-product attention kernels that export picks on CUDA
(`_scaled_dot_product_{efficient,flash,cudnn}_attention`): lowered to one gac.attention,
softmax(q @ k^T * scale + mask) @ v (a target may run it as one flash-attention kernel).
Only the attention output may be used (the log-sum-exp and RNG outputs exist for training) and
dropout must be off; otherwise (training) the check sends the node to eager, whose kernel and
backward run there, so training keeps working. The CPU kernel that training graphs use
(`_scaled_dot_product_flash_attention_for_cpu`) is decomposed instead, with both outputs."""

from __future__ import annotations

import math
import operator

import torch

from gac_torch.legalize.context import Cx
from gac_torch.legalize.registry import aten, decompose_with, lower


def _inference_only(dropout_pos: int):
    def check(node) -> str | None:
        dropout = node.args[dropout_pos] if len(node.args) > dropout_pos else node.kwargs.get("dropout_p", 0.0)
        if dropout:
            return "attention dropout"
        if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users):
            return "attention statistics are used (training)"
        return None
    return check


def _attention(cx: Cx, q, k, v, bias, is_causal: bool, scale):
    """One gac.attention (the fused unit targets may run as flash attention)."""
    dt = cx.dtype_of(q)
    qs, ks = cx.shape(q), cx.shape(k)
    if ks[:-2] != qs[:-2]:  # grouped / broadcast batch dims
        k = cx.b.broadcast(k, shape=qs[:-2] + ks[-2:])
        v = cx.b.broadcast(v, shape=qs[:-2] + cx.shape(v)[-2:])
    scale = 1.0 / math.sqrt(qs[-1]) if scale is None else scale
    operands = [q, k, v]
    if bias is not None:
        if cx.dtype_of(bias) != torch.bool:
            bias = cx.to(bias, dt)
        bs = cx.shape(bias)
        full = qs[:-1] + [ks[-2]]
        bias = cx.b.reshape(bias, [1] * (len(full) - len(bs)) + bs)
        operands.append(bias)
    return cx.b.attention(*operands, scale=float(scale), causal=int(bool(is_causal)))


@lower(aten._scaled_dot_product_efficient_attention.default, check=_inference_only(5))
def lower_sdpa_efficient(cx: Cx, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                         is_causal=False, *, scale=None):
    return (_attention(cx, q, k, v, attn_bias, is_causal, scale), None, None, None)


@lower(aten._scaled_dot_product_flash_attention.default, check=_inference_only(3))
def lower_sdpa_flash(cx: Cx, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                     *, scale=None):
    return (_attention(cx, q, k, v, None, is_causal, scale),) + (None,) * 8


@lower(aten._scaled_dot_product_cudnn_attention.default, check=_inference_only(5))
def lower_sdpa_cudnn(cx: Cx, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                     is_causal=False, return_debug_mask=False, *, scale=None):
    return (_attention(cx, q, k, v, attn_bias, is_causal, scale),) + (None,) * 8


@decompose_with(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """(output, logsumexp) as the CPU kernel computes them: in f32 for f16/bf16, a fully masked
    row gives output 0 and log-sum-exp 0. torch's own decomposition returns the attention matrix
    as the second output, which the eager backward then reads as the log-sum-exp."""
    if dropout_p:
        return NotImplemented
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if k.size(1) != q.size(1):  # grouped-query attention
        k = k.repeat_interleave(q.size(1) // k.size(1), 1)
        v = v.repeat_interleave(q.size(1) // v.size(1), 1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)
    length, source = q.size(-2), k.size(-2)
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(acc))
    # The output as torch's _safe_softmax writes it, the form passes/attention.py fuses into one
    # gac.attention when the log-sum-exp is dead (inference); training keeps both, unfused.
    probs = torch.softmax(scores, -1)
    hidden = scores.eq(float("-inf")).all(-1, keepdim=True)
    out = (torch.where(hidden, torch.zeros_like(probs), probs) @ v).to(query.dtype)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)
    total = torch.exp(scores - top).sum(-1, keepdim=True)
    lse = torch.where(total == 0, 0.0, top + torch.log(total)).squeeze(-1)
    # The kernel's layouts: output (N, L, H, E) and log-sum-exp (N, L, H) in memory.
    out = out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    return out, lse.transpose(1, 2).contiguous().transpose(1, 2)

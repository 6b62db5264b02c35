"""Official BEVFormer checkpoints (mmdet3d naming) <-> our module names.

`official_state_dict_shapes(cfg)` spells out, independently of our modules, the key names and
shapes that the official code (mmdet ResNet/FPN, mmcv DCNv2/FFN/MultiheadAttention, BEVFormer's
PerceptionTransformer and BEVFormerHead) registers, e.g. in bevformer_tiny_epoch_24.pth.
`load_official_state_dict` renames those keys onto a `BEVFormer` (splitting the packed
nn.MultiheadAttention in_proj into q/k/v) and checks that every key and shape matches.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .config import BEVFormerConfig

__all__ = ["official_state_dict_shapes", "make_official_state_dict", "official_to_internal",
           "load_official_state_dict", "IGNORED_OFFICIAL_KEYS"]

Shape = tuple[int, ...]

# Registered by the official head but unused at inference (loss weights).
IGNORED_OFFICIAL_KEYS = ("pts_bbox_head.code_weights",)


def _bn(sd: dict[str, Shape], prefix: str, ch: int) -> None:
    for k in ("weight", "bias", "running_mean", "running_var"):
        sd[f"{prefix}.{k}"] = (ch,)
    sd[f"{prefix}.num_batches_tracked"] = ()


def _linear(sd: dict[str, Shape], prefix: str, out_f: int, in_f: int) -> None:
    sd[f"{prefix}.weight"] = (out_f, in_f)
    sd[f"{prefix}.bias"] = (out_f,)


def _ln(sd: dict[str, Shape], prefix: str, ch: int) -> None:
    sd[f"{prefix}.weight"] = (ch,)
    sd[f"{prefix}.bias"] = (ch,)


def _backbone_shapes(sd: dict[str, Shape], cfg: BEVFormerConfig) -> None:
    p = "img_backbone"
    sd[f"{p}.conv1.weight"] = (cfg.stem_channels, 3, 7, 7)
    _bn(sd, f"{p}.bn1", cfg.stem_channels)
    inplanes = cfg.stem_channels
    for s, (blocks, planes) in enumerate(zip(cfg.stage_blocks, cfg.stage_planes)):
        out = planes * 4
        for b in range(blocks):
            q = f"{p}.layer{s + 1}.{b}"
            sd[f"{q}.conv1.weight"] = (planes, inplanes, 1, 1)
            _bn(sd, f"{q}.bn1", planes)
            sd[f"{q}.conv2.weight"] = (planes, planes, 3, 3)
            if cfg.stage_with_dcn[s]:  # mmcv ModulatedDeformConv2dPack
                sd[f"{q}.conv2.conv_offset.weight"] = (27, planes, 3, 3)
                sd[f"{q}.conv2.conv_offset.bias"] = (27,)
            _bn(sd, f"{q}.bn2", planes)
            sd[f"{q}.conv3.weight"] = (out, planes, 1, 1)
            _bn(sd, f"{q}.bn3", out)
            if b == 0 and (s > 0 or inplanes != out):
                sd[f"{q}.downsample.0.weight"] = (out, inplanes, 1, 1)
                _bn(sd, f"{q}.downsample.1", out)
            inplanes = out


def _neck_shapes(sd: dict[str, Shape], cfg: BEVFormerConfig) -> None:
    c = cfg.embed_dims
    for i, cin in enumerate(cfg.fpn_in_channels):
        sd[f"img_neck.lateral_convs.{i}.conv.weight"] = (c, cin, 1, 1)
        sd[f"img_neck.lateral_convs.{i}.conv.bias"] = (c,)
    for i in range(cfg.num_outs):
        sd[f"img_neck.fpn_convs.{i}.conv.weight"] = (c, c, 3, 3)
        sd[f"img_neck.fpn_convs.{i}.conv.bias"] = (c,)


def _ffn_norms(sd: dict[str, Shape], p: str, cfg: BEVFormerConfig) -> None:
    c = cfg.embed_dims
    _linear(sd, f"{p}.ffns.0.layers.0.0", cfg.ffn_dims, c)
    _linear(sd, f"{p}.ffns.0.layers.1", c, cfg.ffn_dims)
    for n in range(3):
        _ln(sd, f"{p}.norms.{n}", c)


def _head_shapes(sd: dict[str, Shape], cfg: BEVFormerConfig) -> None:
    c, h = cfg.embed_dims, cfg.num_heads
    p = "pts_bbox_head"
    sd[f"{p}.code_weights"] = (cfg.code_size,)
    for i in range(cfg.num_dec_layers):
        for j in (0, 3):
            _linear(sd, f"{p}.cls_branches.{i}.{j}", c, c)
            _ln(sd, f"{p}.cls_branches.{i}.{j + 1}", c)
        _linear(sd, f"{p}.cls_branches.{i}.6", cfg.num_classes, c)
    for i in range(cfg.num_dec_layers):
        _linear(sd, f"{p}.reg_branches.{i}.0", c, c)
        _linear(sd, f"{p}.reg_branches.{i}.2", c, c)
        _linear(sd, f"{p}.reg_branches.{i}.4", cfg.code_size, c)
    sd[f"{p}.bev_embedding.weight"] = (cfg.bev_h * cfg.bev_w, c)
    sd[f"{p}.query_embedding.weight"] = (cfg.num_query, 2 * c)
    t = f"{p}.transformer"
    sd[f"{t}.level_embeds"] = (cfg.num_feature_levels, c)
    sd[f"{t}.cams_embeds"] = (cfg.num_cams, c)
    for i in range(cfg.num_enc_layers):
        q = f"{t}.encoder.layers.{i}"
        tsa_n = 2 * h * 1 * cfg.tsa_points  # queue x heads x levels x points
        _linear(sd, f"{q}.attentions.0.sampling_offsets", tsa_n * 2, 2 * c)
        _linear(sd, f"{q}.attentions.0.attention_weights", tsa_n, 2 * c)
        _linear(sd, f"{q}.attentions.0.value_proj", c, c)
        _linear(sd, f"{q}.attentions.0.output_proj", c, c)
        sca_n = h * cfg.num_levels * cfg.sca_points
        _linear(sd, f"{q}.attentions.1.deformable_attention.sampling_offsets", sca_n * 2, c)
        _linear(sd, f"{q}.attentions.1.deformable_attention.attention_weights", sca_n, c)
        _linear(sd, f"{q}.attentions.1.deformable_attention.value_proj", c, c)
        _linear(sd, f"{q}.attentions.1.output_proj", c, c)
        _ffn_norms(sd, q, cfg)
    for i in range(cfg.num_dec_layers):
        q = f"{t}.decoder.layers.{i}"
        sd[f"{q}.attentions.0.attn.in_proj_weight"] = (3 * c, c)
        sd[f"{q}.attentions.0.attn.in_proj_bias"] = (3 * c,)
        _linear(sd, f"{q}.attentions.0.attn.out_proj", c, c)
        dec_n = h * 1 * cfg.dec_points
        _linear(sd, f"{q}.attentions.1.sampling_offsets", dec_n * 2, c)
        _linear(sd, f"{q}.attentions.1.attention_weights", dec_n, c)
        _linear(sd, f"{q}.attentions.1.value_proj", c, c)
        _linear(sd, f"{q}.attentions.1.output_proj", c, c)
        _ffn_norms(sd, q, cfg)
    _linear(sd, f"{t}.reference_points", 3, c)
    _linear(sd, f"{t}.can_bus_mlp.0", c // 2, cfg.can_bus_dims)
    _linear(sd, f"{t}.can_bus_mlp.2", c, c // 2)
    _ln(sd, f"{t}.can_bus_mlp.norm", c)
    sd[f"{p}.positional_encoding.row_embed.weight"] = (cfg.bev_h, cfg.pos_feats)
    sd[f"{p}.positional_encoding.col_embed.weight"] = (cfg.bev_w, cfg.pos_feats)


def official_state_dict_shapes(cfg: BEVFormerConfig) -> "OrderedDict[str, Shape]":
    """Key -> shape of the official checkpoint's state_dict for this config."""
    sd: OrderedDict[str, Shape] = OrderedDict()
    _backbone_shapes(sd, cfg)
    _neck_shapes(sd, cfg)
    _head_shapes(sd, cfg)
    return sd


def make_official_state_dict(cfg: BEVFormerConfig, seed: int = 0) -> "OrderedDict[str, Tensor]":
    """A synthetic official-style state_dict (official names and shapes, random values)."""
    gen = torch.Generator().manual_seed(seed)
    out: OrderedDict[str, Tensor] = OrderedDict()
    for name, shape in official_state_dict_shapes(cfg).items():
        if name.endswith("num_batches_tracked"):
            out[name] = torch.tensor(0, dtype=torch.long)
        elif name.endswith("running_var"):
            out[name] = torch.rand(shape, generator=gen) + 0.5
        elif name.endswith("weight") and len(shape) == 1:  # BN / LN scale
            out[name] = torch.rand(shape, generator=gen) * 0.4 + 0.8
        elif "embed" in name:
            out[name] = torch.randn(shape, generator=gen)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            out[name] = torch.randn(shape, generator=gen) / fan_in**0.5
    return out


_ENC = r"pts_bbox_head\.transformer\.encoder\.layers\.(?P<i>\d+)\."
_DEC = r"pts_bbox_head\.transformer\.decoder\.layers\.(?P<i>\d+)\."
_LAYER_COMMON = [
    (r"ffns\.0\.layers\.0\.0\.", "ffn.fc1."),
    (r"ffns\.0\.layers\.1\.", "ffn.fc2."),
    (r"norms\.0\.", "norm1."), (r"norms\.1\.", "norm2."), (r"norms\.2\.", "norm3."),
]
_CLS = (("0", "fc1"), ("1", "ln1"), ("3", "fc2"), ("4", "ln2"), ("6", "out"))
_REG = (("0", "fc1"), ("2", "fc2"), ("4", "out"))
# (official key prefix regex, internal prefix); the rest of the key is kept as is.
_PREFIXES: list[tuple[str, str]] = [
    (r"img_backbone\.", "backbone."),
    (r"img_neck\.(?P<kind>lateral_convs|fpn_convs)\.(?P<i>\d+)\.conv\.", r"neck.\g<kind>.\g<i>."),
    (r"pts_bbox_head\.bev_embedding\.weight", "bev_embedding"),
    (r"pts_bbox_head\.query_embedding\.weight", "query_embedding"),
    (r"pts_bbox_head\.positional_encoding\.(?P<a>row|col)_embed\.weight", r"\g<a>_embed"),
    (r"pts_bbox_head\.transformer\.(?P<a>level_embeds|cams_embeds)", r"\g<a>"),
    (r"pts_bbox_head\.transformer\.reference_points\.", "decoder.reference_points."),
    (r"pts_bbox_head\.transformer\.can_bus_mlp\.0\.", "can_bus_mlp.fc1."),
    (r"pts_bbox_head\.transformer\.can_bus_mlp\.2\.", "can_bus_mlp.fc2."),
    (r"pts_bbox_head\.transformer\.can_bus_mlp\.norm\.", "can_bus_mlp.norm."),
    (_ENC + r"attentions\.0\.", r"encoder.layers.\g<i>.tsa."),
    (_ENC + r"attentions\.1\.deformable_attention\.", r"encoder.layers.\g<i>.sca."),
    (_ENC + r"attentions\.1\.output_proj\.", r"encoder.layers.\g<i>.sca.output_proj."),
    *[(_ENC + a, r"encoder.layers.\g<i>." + b) for a, b in _LAYER_COMMON],
    (_DEC + r"attentions\.0\.attn\.out_proj\.", r"decoder.layers.\g<i>.self_attn.out_proj."),
    (_DEC + r"attentions\.0\.attn\.in_proj_", r"decoder.layers.\g<i>.self_attn.in_proj_"),
    (_DEC + r"attentions\.1\.", r"decoder.layers.\g<i>.cross_attn."),
    *[(_DEC + a, r"decoder.layers.\g<i>." + b) for a, b in _LAYER_COMMON],
    *[(r"pts_bbox_head\.cls_branches\.(?P<i>\d+)\." + j + r"\.", r"heads.cls_branches.\g<i>." + n + ".")
      for j, n in _CLS],
    *[(r"pts_bbox_head\.reg_branches\.(?P<i>\d+)\." + j + r"\.", r"heads.reg_branches.\g<i>." + n + ".")
      for j, n in _REG],
]
_RULES = [(re.compile(a + r"(?P<rest>.*)"), b + r"\g<rest>") for a, b in _PREFIXES]


def official_to_internal(sd: Mapping[str, Tensor]) -> tuple["OrderedDict[str, Tensor]", list[str], list[str]]:
    """Rename official keys. Returns (internal state_dict, ignored keys, unmatched keys).

    The decoder's packed attn.in_proj_weight/bias (3C, ...) is split into q/k/v projections.
    """
    out: OrderedDict[str, Tensor] = OrderedDict()
    ignored: list[str] = []
    unmatched: list[str] = []
    for key, value in sd.items():
        if key in IGNORED_OFFICIAL_KEYS:
            ignored.append(key)
            continue
        for pattern, repl in _RULES:
            m = pattern.fullmatch(key)
            if m is not None:
                new = m.expand(repl)
                break
        else:
            unmatched.append(key)
            continue
        if ".self_attn.in_proj_" in new:
            prefix, kind = new.split(".in_proj_")  # kind: weight | bias
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                out[f"{prefix}.{proj}.{kind}"] = part
        else:
            out[new] = value
    return out, ignored, unmatched


def load_official_state_dict(model: nn.Module, sd: Mapping[str, object], strict: bool = True
                             ) -> dict[str, list[str]]:
    """Load an official BEVFormer checkpoint (the file's dict, or its 'state_dict') into `model`.

    With strict=True every official key must map to a model key of the same shape (apart from
    IGNORED_OFFICIAL_KEYS) and every model key must be provided. Returns a report with the
    'ignored', 'unmatched', 'missing' and 'unexpected' keys.
    """
    if "state_dict" in sd and isinstance(sd["state_dict"], Mapping):
        sd = sd["state_dict"]  # type: ignore[assignment]
    tensors = {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, Tensor)}
    mapped, ignored, unmatched = official_to_internal(tensors)
    own = model.state_dict()
    bad_shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in mapped.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in mapped]
    unexpected = [k for k in mapped if k not in own]
    report = {"ignored": ignored, "unmatched": unmatched, "missing": missing,
              "unexpected": unexpected, "bad_shapes": bad_shapes}
    if strict and (unmatched or missing or unexpected or bad_shapes):
        problems = {k: v[:10] for k, v in report.items() if v and k != "ignored"}
        raise RuntimeError(f"official state_dict does not match the model: {problems}")
    if bad_shapes:
        raise RuntimeError(f"shape mismatch: {bad_shapes[:10]}")
    model.load_state_dict({k: v for k, v in mapped.items() if k in own}, strict=strict)
    return report

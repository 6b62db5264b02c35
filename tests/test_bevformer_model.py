"""BEVFormer model package: build, two-frame runs, export parity, building blocks against
independent references, official checkpoint mapping and decoding. CPU only, deterministic."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from gac_torch.models.bevformer import (
    BEVFormer,
    BEVFormerConfig,
    build_bevformer,
    decode_bboxes,
    get_config,
    load_official_state_dict,
    make_official_state_dict,
    make_test_inputs,
    official_state_dict_shapes,
    official_to_internal,
)
from gac_torch.models.bevformer.attention import ms_deform_attn
from gac_torch.models.bevformer.backbone import ModulatedDeformConv2d
from gac_torch.models.bevformer.encoder import (
    bev_shift,
    camera_visibility,
    point_sampling,
    rotate_bev,
    rotation_base_grid,
)

TEST_CONFIGS = ("test_tiny", "test_base")
# Exported vs eager: same kernels, so the results are expected bit-identical; allow float noise.
EXPORT_ATOL = 1e-5
EXPORT_RTOL = 1e-5


@pytest.fixture(scope="module", params=TEST_CONFIGS)
def model(request: pytest.FixtureRequest) -> BEVFormer:
    return build_bevformer(request.param, seed=0)


def _two_frames(fn: Callable[..., tuple[Tensor, ...]], cfg: BEVFormerConfig
                ) -> list[tuple[Tensor, ...]]:
    """Run frame 0 (no prev_bev) and frame 1 (prev_bev = frame 0's bev_embed) through fn."""
    with torch.no_grad():
        out0 = fn(*make_test_inputs(cfg, frame=0, seed=0))
        out1 = fn(*make_test_inputs(cfg, frame=1, seed=0, prev_bev=out0[2]))
    return [out0, out1]


# ---------------------------------------------------------------------------------------------
# whole model

def test_two_frames_shapes_and_finite(model: BEVFormer) -> None:
    cfg = model.cfg
    outs = _two_frames(model, cfg)
    for cls, box, bev in outs:
        assert cls.shape == (cfg.num_dec_layers, 1, cfg.num_query, cfg.num_classes)
        assert box.shape == (cfg.num_dec_layers, 1, cfg.num_query, cfg.code_size)
        assert bev.shape == (cfg.bev_h * cfg.bev_w, 1, cfg.embed_dims)
        assert all(t.isfinite().all() for t in (cls, box, bev))
    # box centres are sigmoids scaled to pc_range
    pc = cfg.pc_range
    centre = outs[1][1][..., [0, 1, 4]]
    assert (centre >= torch.tensor(pc[:3])).all() and (centre <= torch.tensor(pc[3:])).all()
    assert not torch.equal(outs[0][2], outs[1][2])


def test_use_prev_bev_switch(model: BEVFormer) -> None:
    """u = 0 ignores prev_bev entirely; u = 1 uses it (one graph for both cases)."""
    cfg = model.cfg
    images, l2i, can_bus, _, _ = make_test_inputs(cfg, frame=1, seed=0)
    rand_prev = torch.randn(cfg.bev_h * cfg.bev_w, 1, cfg.embed_dims)
    with torch.no_grad():
        off_zero = model(images, l2i, can_bus, torch.zeros_like(rand_prev), torch.tensor(0.0))
        off_rand = model(images, l2i, can_bus, rand_prev, torch.tensor(0.0))
        on_rand = model(images, l2i, can_bus, rand_prev, torch.tensor(1.0))
    for a, b in zip(off_zero, off_rand, strict=True):
        assert torch.equal(a, b)
    assert not torch.allclose(off_rand[2], on_rand[2])


@pytest.fixture(scope="module")
def exported(model: BEVFormer) -> torch.export.ExportedProgram:
    return torch.export.export(model, make_test_inputs(model.cfg, frame=0, seed=0))


def test_export_matches_eager(model: BEVFormer, exported: torch.export.ExportedProgram) -> None:
    nodes = [n for n in exported.graph.nodes if n.op == "call_function"]
    # Static graph: no data-dependent ops, every intermediate shape is a plain int.
    targets = {str(n.target) for n in nodes}
    assert not any(t.startswith(("aten.nonzero", "aten.item", "aten._local_scalar_dense"))
                   for t in targets)
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, Tensor):
            assert all(isinstance(s, int) for s in val.shape), n
    eager = _two_frames(model, model.cfg)
    for e_out, x_out in zip(eager, _two_frames(exported.module(), model.cfg), strict=True):
        for e, x in zip(e_out, x_out, strict=True):
            torch.testing.assert_close(x, e, atol=EXPORT_ATOL, rtol=EXPORT_RTOL)


def test_decomposed_matches_eager(model: BEVFormer, exported: torch.export.ExportedProgram
                                  ) -> None:
    decomposed = exported.run_decompositions()
    ops = collections.Counter(str(n.target) for n in decomposed.graph.nodes
                              if n.op == "call_function")
    assert ops["aten.grid_sampler_2d.default"] > 0
    eager = _two_frames(model, model.cfg)
    for e_out, d_out in zip(eager, _two_frames(decomposed.module(), model.cfg), strict=True):
        for e, d in zip(e_out, d_out, strict=True):
            torch.testing.assert_close(d, e, atol=EXPORT_ATOL, rtol=EXPORT_RTOL)


# ---------------------------------------------------------------------------------------------
# test inputs

def test_visibility_covers_0_1_2_cameras_and_behind() -> None:
    model = build_bevformer("test_tiny")
    cfg = model.cfg
    _, lidar2img, _, _, _ = make_test_inputs(cfg, frame=0)
    ref_cam, mask, depth = point_sampling(model.encoder.ref_3d, lidar2img, cfg.img_h, cfg.img_w)
    visible, count = camera_visibility(mask)
    seen_by = visible.sum(0).long()
    assert set(seen_by.tolist()) == {0, 1, 2}
    assert min(torch.bincount(seen_by).tolist()) >= 3  # each case covers several cells
    behind = depth <= 1e-5
    assert behind.any() and not mask[behind].any()
    # behind-camera points keep huge but finite coordinates (divided by eps), as the original
    assert ref_cam.isfinite().all() and ref_cam[behind].abs().max() > 1e3
    torch.testing.assert_close(count, seen_by.clamp(min=1).float())


def test_bev_shift_matches_float64_formula() -> None:
    cfg = get_config("test_tiny")
    _, _, cb0, _, _ = make_test_inputs(cfg, frame=0)
    _, _, cb1, _, _ = make_test_inputs(cfg, frame=1)
    assert torch.equal(bev_shift(cb0, cfg), torch.zeros(2))
    dx, dy, yaw = float(cb1[0]), float(cb1[1]), float(cb1[-2])
    assert abs(float(cb1[-1]) - 7.0) < 1e-6 and math.hypot(dx, dy) > 1.0
    length = math.sqrt(dx**2 + dy**2)
    angle = yaw / math.pi * 180 - (math.atan2(dy, dx) / math.pi * 180 % 360)
    expected = [length * math.sin(angle / 180 * math.pi) / (102.4 / cfg.bev_w) / cfg.bev_w,
                length * math.cos(angle / 180 * math.pi) / (102.4 / cfg.bev_h) / cfg.bev_h]
    torch.testing.assert_close(bev_shift(cb1, cfg), torch.tensor(expected), atol=1e-7, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# building blocks against independent references (explicit bilinear sampling by index)

def _bilinear_zero_pad(img: Tensor, y: Tensor, x: Tensor) -> Tensor:
    """img (C, H, W); pixel coordinates y, x (any shape, pixel centres at integers); corners
    outside the image contribute zero. Float64. Returns (C, *y.shape)."""
    c, h, w = img.shape
    img, y, x = img.double().reshape(c, -1), y.double(), x.double()
    y0, x0 = torch.floor(y), torch.floor(x)
    out = torch.zeros(c, *y.shape, dtype=torch.float64)
    for dy, wy in ((0, 1 - (y - y0)), (1, y - y0)):
        for dx, wx in ((0, 1 - (x - x0)), (1, x - x0)):
            yy, xx = y0 + dy, x0 + dx
            valid = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
            idx = (yy.clamp(0, h - 1) * w + xx.clamp(0, w - 1)).long()
            out += img[:, idx.reshape(-1)].reshape(c, *y.shape) * (wy * wx * valid)
    return out


def _ms_deform_attn_reference(value: Tensor, shapes: list[tuple[int, int]], loc: Tensor,
                              attn: Tensor) -> Tensor:
    b, _, heads, d = value.shape
    q = loc.shape[1]
    out = torch.zeros(b, q, heads, d, dtype=torch.float64)
    start = 0
    for lvl, (h, w) in enumerate(shapes):
        for bi in range(b):
            for hd in range(heads):
                img = value[bi, start:start + h * w, hd].T.reshape(d, h, w)
                px = loc[bi, :, hd, lvl, :, 0] * w - 0.5  # (Q, P)
                py = loc[bi, :, hd, lvl, :, 1] * h - 0.5
                s = _bilinear_zero_pad(img, py, px)  # (d, Q, P)
                out[bi, :, hd] += (s * attn[bi, :, hd, lvl].double()).sum(-1).T
        start += h * w
    return out.reshape(b, q, heads * d).float()


def test_ms_deform_attn_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (3, 4), (1, 2)]
    b, heads, d, q, p = 2, 3, 4, 6, 5
    value = torch.randn(b, sum(h * w for h, w in shapes), heads, d, generator=gen)
    loc = torch.rand(b, q, heads, len(shapes), p, 2, generator=gen) * 1.4 - 0.2
    loc[0, 0, 0, 0, 0] = torch.tensor([3e8, -1e9])  # a behind-camera style point
    attn = torch.rand(b, q, heads, len(shapes), p, generator=gen)
    out = ms_deform_attn(value, shapes, loc, attn)
    torch.testing.assert_close(out, _ms_deform_attn_reference(value, shapes, loc, attn),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [1, 2])
def test_dcn_matches_reference(stride: int) -> None:
    torch.manual_seed(0)
    dcn = ModulatedDeformConv2d(3, 5, 3, stride=stride, padding=1)
    with torch.no_grad():
        dcn.conv_offset.weight.normal_(0.0, 0.5)  # offsets of a few pixels, some leave the image
    x = torch.randn(1, 3, 7, 9)
    with torch.no_grad():
        out = dcn(x)
        om = dcn.conv_offset(x)[0]
    ho, wo = om.shape[1:]
    oy = (torch.arange(ho) * stride - 1).double().view(ho, 1).expand(ho, wo)
    ox = (torch.arange(wo) * stride - 1).double().view(1, wo).expand(ho, wo)
    cols = []
    for t in range(9):  # mmcv layout: offset channels (2t, 2t+1) = (dy, dx), mask channel 18 + t
        i, j = divmod(t, 3)
        s = _bilinear_zero_pad(x[0], oy + i + om[2 * t], ox + j + om[2 * t + 1])
        cols.append(s * torch.sigmoid(om[18 + t]).double())
    cols_t = torch.stack(cols, 1).reshape(3 * 9, ho * wo)  # (c, tap) order
    ref = (dcn.weight.detach().double().reshape(5, 27) @ cols_t).reshape(1, 5, ho, wo)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


def test_dense_sca_matches_gather_form(model: BEVFormer) -> None:
    """Dense SCA == the original algorithm (nonzero gather of visible queries per camera)."""
    cfg = model.cfg
    images, l2i, _, _, _ = make_test_inputs(cfg, frame=0)
    sca = model.encoder.layers[0].sca
    with torch.no_grad():
        feats, shapes = model.image_features(images)
        ref_cam, mask, _ = point_sampling(model.encoder.ref_3d, l2i, cfg.img_h, cfg.img_w)
        visible, count = camera_visibility(mask)
        query = torch.randn(1, cfg.bev_h * cfg.bev_w, cfg.embed_dims)
        dense = sca(query, feats, ref_cam, visible, count, shapes)

        cams, c, heads, d_pts = cfg.num_cams, cfg.embed_dims, cfg.num_heads, ref_cam.shape[2]
        lv, pts = cfg.num_levels, cfg.sca_points
        indexes = [mask[i].sum(-1).nonzero().squeeze(-1) for i in range(cams)]
        max_len = max(len(i) for i in indexes)
        q_re = query.new_zeros(cams, max_len, c)
        r_re = ref_cam.new_zeros(cams, max_len, d_pts, 2)
        for i, idx in enumerate(indexes):
            q_re[i, :len(idx)] = query[0, idx]
            r_re[i, :len(idx)] = ref_cam[i, idx]
        value = sca.value_proj(feats).reshape(cams, feats.shape[1], heads, c // heads)
        off = sca.sampling_offsets(q_re).view(cams, max_len, heads, lv, pts, 2)
        attn = sca.attention_weights(q_re).view(cams, max_len, heads, lv * pts).softmax(-1)
        attn = attn.view(cams, max_len, heads, lv, pts)
        norm = torch.tensor([[w, h] for h, w in shapes], dtype=torch.float32)
        off = (off / norm[None, None, None, :, None, :]).view(
            cams, max_len, heads, lv, pts // d_pts, d_pts, 2)
        loc = (r_re[:, :, None, None, None, :, :] + off).view(cams, max_len, heads, lv, pts, 2)
        per_cam = _ms_deform_attn_reference(value, shapes, loc, attn)
        slots = torch.zeros_like(query)
        for i, idx in enumerate(indexes):
            slots[0, idx] += per_cam[i, :len(idx)]
        n_cams = (mask.sum(-1) > 0).sum(0).clamp(min=1)
        reference = sca.output_proj(slots / n_cams[None, :, None]) + query
    torch.testing.assert_close(dense, reference, atol=1e-5, rtol=1e-5)


def test_rotate_bev_geometry() -> None:
    """Each output cell copies the input cell at c + R(angle)(p - c) (pixel centres, nearest,
    zeros outside), computed independently in float64; skips cells within 1e-3 of a tie."""
    cfg = get_config("test_tiny")
    h, w, (cx, cy) = cfg.bev_h, cfg.bev_w, cfg.rotate_center
    prev = torch.randn(h * w, 1, 4)
    angle = 7.0
    out = rotate_bev(prev, torch.tensor(angle), rotation_base_grid(h, w), h, w, (cx, cy))
    a = math.radians(angle)
    grid = prev.reshape(h, w, 4)
    copied = zeroed = 0
    for i in range(h):
        for j in range(w):
            px, py = j + 0.5 - cx, i + 0.5 - cy
            sx = cx + math.cos(a) * px - math.sin(a) * py - 0.5
            sy = cy + math.sin(a) * px + math.cos(a) * py - 0.5
            if min(abs(sx - math.floor(sx) - 0.5), abs(sy - math.floor(sy) - 0.5)) < 1e-3:
                continue
            si, sj = round(sy), round(sx)
            got = out[i * w + j, 0]
            if 0 <= si < h and 0 <= sj < w:
                assert torch.equal(got, grid[si, sj]), (i, j)
                copied += 1
            else:
                assert torch.equal(got, torch.zeros(4)), (i, j)
                zeroed += 1
    assert copied >= 10 and zeroed >= 3  # the test-size rotate_center keeps both cases
    assert torch.equal(rotate_bev(prev, torch.tensor(0.0), rotation_base_grid(h, w), h, w,
                                  (cx, cy)), prev)


# ---------------------------------------------------------------------------------------------
# official checkpoint mapping and decoding

@pytest.mark.parametrize("name", TEST_CONFIGS)
def test_official_state_dict_loads_strict(name: str) -> None:
    model = build_bevformer(name, seed=1)
    sd = make_official_state_dict(model.cfg, seed=3)
    report = load_official_state_dict(model, {"state_dict": sd, "meta": {}}, strict=True)
    assert report["ignored"] == ["pts_bbox_head.code_weights"]
    assert not (report["unmatched"] or report["missing"] or report["unexpected"])
    own = model.state_dict()
    c = model.cfg.embed_dims
    packed = sd["pts_bbox_head.transformer.decoder.layers.1.attentions.0.attn.in_proj_weight"]
    assert torch.equal(own["decoder.layers.1.self_attn.k_proj.weight"], packed[c:2 * c])
    assert torch.equal(own["encoder.layers.0.sca.value_proj.weight"], sd[
        "pts_bbox_head.transformer.encoder.layers.0.attentions.1.deformable_attention.value_proj.weight"])
    assert torch.equal(own["heads.cls_branches.1.ln2.bias"], sd["pts_bbox_head.cls_branches.1.4.bias"])
    for t in _two_frames(model, model.cfg)[1]:
        assert t.isfinite().all()


@pytest.mark.parametrize("name,params_m", [("tiny", 33.5), ("base", 69.0)])
def test_official_names_full_size(name: str, params_m: float) -> None:
    """Full configs on the meta device: official names/shapes map 1:1, parameter counts match
    the derived figures (tiny 33.5 M, base 69.0 M)."""
    cfg = get_config(name)
    with torch.device("meta"):
        model = BEVFormer(cfg)
        sd = {k: torch.empty(s) for k, s in official_state_dict_shapes(cfg).items()}
    mapped, ignored, unmatched = official_to_internal(sd)
    own = model.state_dict()
    assert not unmatched and ignored == ["pts_bbox_head.code_weights"]
    assert set(mapped) == set(own)
    assert all(mapped[k].shape == own[k].shape for k in own)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == params_m


def test_decode(model: BEVFormer) -> None:
    cfg = model.cfg
    cls, box, _ = _two_frames(model, cfg)[1]
    (res,) = decode_bboxes(cls, box, cfg)
    n = res["bboxes"].shape[0]
    assert 0 < n <= min(cfg.max_num, cfg.num_query * cfg.num_classes)
    assert res["bboxes"].shape == (n, 9) and res["scores"].shape == res["labels"].shape == (n,)
    assert (res["scores"][:-1] >= res["scores"][1:]).all()
    assert ((res["labels"] >= 0) & (res["labels"] < cfg.num_classes)).all()
    assert (res["bboxes"][:, 3:6] > 0).all()
    (thr,) = decode_bboxes(cls, box, cfg, score_threshold=0.99)
    assert thr["bboxes"].shape[0] >= 1  # threshold lowered until something passes

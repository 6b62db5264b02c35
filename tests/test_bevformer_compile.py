"""BEVFormer test-size configs through torch.export -> gac_torch.compile, two frames (without,
then with prev_bev: non-zero translation, ~7 deg yaw), against eager on all three outputs."""

from __future__ import annotations

import logging

import pytest
import torch

import gac_torch
from conftest import TARGETS
from gac_torch.models.bevformer import build_bevformer, make_test_inputs
from parity import device_of

# fp32, ~40 layers deep with softmaxes and bilinear sampling: compare against eager fp32.
TOL = dict(rtol=2e-4, atol=2e-4)
log = logging.getLogger(__name__)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("config", ["test_tiny", "test_base"])
def test_bevformer_two_frames(config, target):
    dev = device_of(target)
    model = build_bevformer(config, seed=0).to(dev)
    frame0 = [t.to(dev) for t in make_test_inputs(model.cfg, frame=0)]
    with torch.no_grad():
        ep = torch.export.export(model, tuple(frame0))
        compiled = gac_torch.compile(ep, target=target)
        report = compiled.report
        print(f"{config}: {report.summary()}")
        out0, ref0 = compiled(*frame0), model(*frame0)
        frame1 = [t.to(dev) for t in make_test_inputs(model.cfg, frame=1, prev_bev=ref0[2].cpu())]
        out1, ref1 = compiled(*frame1), model(*frame1)
    names = ("all_cls_scores", "all_bbox_preds", "bev_embed")
    for frame, (outs, refs) in enumerate([(out0, ref0), (out1, ref1)]):
        for name, got, want in zip(names, outs, refs, strict=True):
            where = f"{config} frame {frame} {name}"
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, w=where: f"{w}: {m}")
    # Every ATen node of both configs compiles (grid_sampler_2d and the upsamples are lowered).
    assert report.compiled == report.total and not report.unsupported, report.summary()

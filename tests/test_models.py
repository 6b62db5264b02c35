"""Whole models through both front-ends (torch.export -> gac_torch.compile, and
torch.compile(backend="gac")), against eager PyTorch."""

from __future__ import annotations

import pytest
import torch

import gac_torch
from conftest import TARGETS
from models import MODEL_NAMES, MODEL_TOL, build
from parity import device_of


def _to(model, inputs, target):
    dev = device_of(target)
    return model.to(dev), tuple(t.to(dev) for t in inputs)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_export_path(name, target):
    model, inputs = _to(*build(name), target)
    with torch.no_grad():
        expected = model(*inputs)
        compiled = gac_torch.compile(torch.export.export(model, inputs), target=target)
        got = compiled(*inputs)
    torch.testing.assert_close(got, expected, **MODEL_TOL)
    report = compiled.report
    if name == "unsupported":
        assert report.unsupported and report.compiled < report.total
        assert any("i0" in op for op, _ in report.unsupported)
    else:
        assert report.compiled == report.total, report.summary()
    # fresh inputs, same shapes: the compiled program is reusable
    g = torch.Generator().manual_seed(7)
    fresh = tuple(torch.randn(t.shape, generator=g).to(t.device) for t in inputs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*fresh), model(*fresh), **MODEL_TOL)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_dynamo_path(name, target):
    from gac_torch.frontends import dynamo

    torch._dynamo.reset()
    dynamo.compiled_graphs.clear()
    model, inputs = _to(*build(name), target)
    compiled = torch.compile(model, backend="gac", options={"target": target})
    with torch.no_grad():  # no_grad: nn.TransformerEncoderLayer takes its fused fast path
        torch.testing.assert_close(compiled(*inputs), model(*inputs), **MODEL_TOL)
    reports = [g.report for g in dynamo.compiled_graphs]
    assert reports and all(g.target == target for g in dynamo.compiled_graphs)
    if name != "unsupported":
        assert all(r.compiled == r.total for r in reports), [r.summary() for r in reports]


def test_same_gac_module_through_both_front_ends():
    """Dynamo (AOTAutograd inference graph) and torch.export give the same gac module."""
    from gac_torch.frontends import dynamo

    torch._dynamo.reset()
    model, inputs = build("mlp")
    exported = gac_torch.compile(torch.export.export(model, inputs))
    dynamo.compiled_graphs.clear()
    with torch.no_grad():
        torch.compile(model, backend="gac")(*inputs)
    (via_dynamo,) = dynamo.compiled_graphs
    assert via_dynamo.ir("gac") == exported.ir("gac")


def test_training_keeps_gradients():
    """Inputs/params requiring grad: forward and backward are compiled, gradients match eager."""
    torch._dynamo.reset()
    model, (x,) = build("mlp")
    model.train()
    ref_model, _ = build("mlp")
    ref_model.train()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = torch.compile(model, backend="gac")(x1)
    ref = ref_model(x2)
    torch.testing.assert_close(out, ref, **MODEL_TOL)
    (out.square().sum()).backward()
    (ref.square().sum()).backward()
    torch.testing.assert_close(x1.grad, x2.grad, **MODEL_TOL)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **MODEL_TOL)

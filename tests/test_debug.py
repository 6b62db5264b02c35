"""gac_torch.debug.bisect: names the op a deliberate miscompile breaks, and saves a repro."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gac_torch
from gac_torch.legalize import registry
from gac_torch.legalize.pointwise import _scaled

aten = torch.ops.aten


class Net(torch.nn.Module):
    def forward(self, x, y):
        a = torch.tanh(x) * 2.0
        b = a + y  # the miscompiled op
        return torch.relu(b).sum(-1), b.exp()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, generator=g), torch.randn(6, generator=g)


@pytest.fixture
def add_lowers_to_sub(monkeypatch):
    """aten.add.Tensor lowered as a subtraction: the miscompile bisect must find."""
    entry = registry.REGISTRY[aten.add.Tensor]
    wrong = dataclasses.replace(entry, fn=lambda cx, a, b, alpha=1: _scaled(cx, "sub", a, b, alpha))
    monkeypatch.setitem(registry.REGISTRY, aten.add.Tensor, wrong)


def test_bisect_finds_no_divergence_in_a_correct_compile():
    assert gac_torch.debug.bisect(Net(), _inputs()) is None


def test_bisect_names_the_miscompiled_op(add_lowers_to_sub, tmp_path):
    x, y = _inputs()
    compiled = gac_torch.compile(Net(), (x, y), options={"fallback": False})
    assert not torch.allclose(compiled(x, y)[1], Net()(x, y)[1])  # the injected bug is live

    blame = gac_torch.debug.bisect(Net(), (x, y), out_dir=str(tmp_path))
    assert blame is not None and blame.op == "aten.add.Tensor" and blame.how == "op", blame
    saved = torch.load(blame.repro, weights_only=False)
    assert saved["op"] == "torch.ops.aten.add.Tensor"
    torch.testing.assert_close(saved["args"][0], torch.tanh(x) * 2.0)
    torch.testing.assert_close(saved["args"][1], y)
    eager, got = type(blame).replay(blame.repro)
    torch.testing.assert_close(eager, saved["eager"])
    torch.testing.assert_close(got, saved["args"][0] - saved["args"][1])  # still the bad lowering


def test_bisect_blames_a_fused_miscompile_by_prefix(monkeypatch, tmp_path):
    """A bug that only shows when ops are compiled together: the prefix halving finds it."""
    from gac_torch.frontends import fx as fx_frontend

    real = fx_frontend.compile_graph

    def wrong_when_fused(gm, options, target=None):  # 3+ ops: every result is off by one
        n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        compiled = real(gm, options, target)
        if n_ops < 3:
            return compiled
        inner = compiled.gm

        def call(*args):
            return tuple(o + 1 if o.is_floating_point() else o for o in inner(*args))
        compiled.gm = call
        return compiled
    from gac_torch import debug
    monkeypatch.setattr(debug, "compile_graph", wrong_when_fused)
    blame = debug.bisect(Net(), _inputs(), out_dir=str(tmp_path))
    assert blame is not None and blame.how == "prefix", blame
    assert blame.op == "aten.add.Tensor", blame  # tanh, mul, add: the first 3-op prefix ends at add


def test_minify_shrinks_a_failing_fuzz_program(add_lowers_to_sub):
    from gac_torch.tools.fuzz.gen import Program
    from gac_torch.tools.fuzz.minify import minify

    program = Program(
        seed=0, input_lines=["x0 = torch.randn((3, 4), generator=G).to(F32)"], inputs=["x0"],
        lines=["v0 = torch.sin(x0)", "v1 = v0 + x0", "v2 = torch.cos(v0)", "v3 = v2 * 2"],
        outputs=["v3", "v1"])
    small = minify(program, frontends=("export",))
    assert small.lines == ["v0 = torch.sin(x0)", "v1 = v0 + x0"] and small.outputs == ["v1"], small.source()


def test_bisect_takes_parameters_and_names_the_op_of_a_module(add_lowers_to_sub, tmp_path):
    """Lifted parameters are inputs of the exported graph: bisect feeds them too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh())

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(x) + x[:, :4]

    blame = gac_torch.debug.bisect(Residual(), (torch.randn(3, 5),), out_dir=str(tmp_path))
    assert blame is not None and blame.op == "aten.add.Tensor", blame

"""Regression tests for miscompiles and semantics gaps found by random graphs (issue 12): each
compares gac with eager through both front-ends in strict mode (fallback=False)."""

from __future__ import annotations

import os

import pytest
import torch

import gac_torch
from parity import Fn, assert_close, reference

STRICT = {"fallback": False}


def via_export(fn, inputs):
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cpu", options=STRICT)
    assert compiled.report.compiled == compiled.report.total, compiled.report.summary()
    return compiled(*inputs)


def via_dynamo(fn, inputs):
    torch._dynamo.reset()
    return torch.compile(fn, backend="gac", options=dict(STRICT, target="cpu"))(*inputs)


FRONTENDS = {"export": via_export, "dynamo": via_dynamo}


def check_both(fn, inputs, what=""):
    """Strict compile through both front-ends; each result must match eager (fp64 reference)."""
    want = reference(fn, inputs)
    for name, run in FRONTENDS.items():
        with torch.no_grad():
            assert_close(run(fn, inputs), want, f"{what} via {name}")


# Item 1: a reduction over a 0-d tensor is an all-parallel linalg.generic that reads its init;
# elementwise fusion folded that init read into every iteration of a broadcasting consumer, so
# the consumer summed across the broadcast ([0.7, 1.4, 2.1] for x0d.sum() + zeros(3)).
ZERO_D = {
    "sum": lambda x, z: x.sum() + z,
    "mean": lambda x, z: x.mean() + z,
    "sum_sum": lambda x, z: x.sum().sum() + z,
    "amax": lambda x, z: x.amax() * z,
    "softmax": lambda x, z: torch.softmax(x, 0) + z,
    "log_softmax": lambda x, z: torch.log_softmax(x, 0) + z,
    "logsumexp": lambda x, z: torch.logsumexp(x, 0) + z,
}


@pytest.mark.parametrize("name", sorted(ZERO_D))
def test_zero_d_reduction_feeding_a_broadcast(name):
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn((), generator=g), torch.randn(3, 4, generator=g)
    check_both(ZERO_D[name], [x, z], name)


# Item 4: torch.compile calls its backend under a FakeTensorMode; the index tables gac builds
# while legalizing became fake tensors ("'.numpy() is not supported for tensor subclasses").
FAKE_MODE = {
    "flip": (lambda x: x.flip(0, 2) * 2, (3, 4, 5)),
    "adaptive_avg_pool2d": (lambda x: torch.nn.functional.adaptive_avg_pool2d(x, (3, 2)), (1, 2, 5, 7)),
    "adaptive_max_pool2d": (lambda x: torch.nn.functional.adaptive_max_pool2d(x, (3, 4)), (1, 2, 5, 7)),
}


@pytest.mark.parametrize("name", sorted(FAKE_MODE))
def test_constants_built_under_dynamo_fake_mode(name):
    fn, shape = FAKE_MODE[name]
    check_both(fn, [torch.randn(shape, generator=torch.Generator().manual_seed(2))], name)


@pytest.fixture
def broken_exp(monkeypatch):
    """A lowering that fails like a compiler bug would."""
    from gac_torch.lowering import LoweringError
    from gac_torch.lowering.registry import LOWERINGS

    def fail(op, operands):
        raise LoweringError("bool tensor would be materialized by ['linalg.generic']")

    monkeypatch.setitem(LOWERINGS, "unary", fail)
    return lambda x: torch.exp(x) + 1


def test_compiler_error_default_mode_warns_and_counts(broken_exp, monkeypatch):
    from gac_torch.frontends.fx import GacCompilerWarning

    monkeypatch.delenv("GAC_STRICT_INTERNAL", raising=False)
    x = torch.randn(5, generator=torch.Generator().manual_seed(3))
    with pytest.warns(GacCompilerWarning, match="LoweringError: bool tensor would be materialized"):
        compiled = gac_torch.compile(Fn(broken_exp), (x,), target="cpu")
    assert compiled.report.compiler_errors == 2 and compiled.report.compiled == 0
    assert "compiler error: LoweringError" in compiled.report.summary()
    torch.testing.assert_close(compiled(x), broken_exp(x))


@pytest.mark.parametrize("how", ["strict", "GAC_STRICT_INTERNAL"])
def test_compiler_error_is_an_error_when_strict(broken_exp, monkeypatch, how):
    from gac_torch.frontends.fx import GacCompilerError, GacUnsupportedError

    options = {"fallback": False} if how == "strict" else {}
    monkeypatch.setenv("GAC_STRICT_INTERNAL", "1" if how != "strict" else "0")
    x = torch.randn(5, generator=torch.Generator().manual_seed(3))
    with pytest.raises(GacCompilerError, match="aten.exp.default.*compiler error: LoweringError") as e:
        gac_torch.compile(Fn(broken_exp), (x,), target="cpu", options=options)
    assert isinstance(e.value, GacUnsupportedError)  # strict mode's documented error


def test_the_suite_runs_with_strict_internal_errors():
    assert os.environ.get("GAC_STRICT_INTERNAL") == "1"

"""Regression tests for miscompiles and semantics gaps found by random graphs (issue 12): each
compares gac with eager through both front-ends in strict mode (fallback=False)."""

from __future__ import annotations

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

"""Transposed matrices between graphs as torch's views (passes/input_views.py): a training
forward's saved W^T is not a transpose kernel, and the backward takes the dense matrix it views.
Run on the cpu target (values, pointers) and compiled offline for cuda (the kernels)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gac_torch.frontends.fx import compile_graph
from gac_torch.options import resolve


def _compile(f, *xs, target: str = "cpu"):
    gm = make_fx(f)(*xs)
    cuda = {"arch": "sm_90", "allow_tf32": False} if target == "cuda" else {}
    return compile_graph(gm, resolve({"target": target, "fallback": False, "cache": False, **cuda}))


def _kernels(c) -> list[str]:
    return re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", c.ir("gpu"))


def forward(x, w):
    t = w.t()
    return torch.nn.functional.gelu(x @ t), t  # (AOTAutograd saves t for the backward)


def backward(dy, t):
    return dy @ t.t()


@pytest.mark.parametrize("views", ["1", "0"])
def test_a_returned_transpose_of_an_input_is_a_view(views: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_INPUT_VIEWS", views)
    x, w = torch.randn(37, 29), torch.randn(45, 29)
    c = _compile(forward, x, w)
    y, t = c(x, w)
    torch.testing.assert_close(y, forward(x, w)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(t, w.t())
    assert (t.data_ptr() == w.data_ptr() and t.stride() == (1, 29)) == (views == "1")
    assert c.report.compiled == c.report.total and not c.report.unsupported
    kernels = _kernels(_compile(forward, x, w, target="cuda"))
    assert ("loops" in kernels) == (views == "0"), kernels  # (the transpose kernel)


@pytest.mark.parametrize("views", ["1", "0"])
def test_a_transposed_input_enters_as_the_matrix_it_views(views: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_INPUT_VIEWS", views)
    dy, w = torch.randn(37, 45), torch.randn(45, 29)
    t = w.t()  # strides (1, 29): what the forward above returns
    c = _compile(backward, dy, t)
    (part,) = c.partitions.values()
    want = dy.double() @ w.double()
    torch.testing.assert_close(c(dy, t).double(), want, rtol=1e-5, atol=1e-5)
    # a dense tensor at run time (not what the graph was traced with): still its values
    torch.testing.assert_close(c(dy, t.contiguous()).double(), want, rtol=1e-5, atol=1e-5)
    shapes = [tuple(s.shape) for s in part.signature.inputs]
    assert ((45, 29) in shapes) == (views == "1"), shapes
    cuda = _compile(backward, dy, t, target="cuda")
    assert _kernels(cuda) == ["sgemm"]  # (either way: a dense input's transpose folds into the GEMM)

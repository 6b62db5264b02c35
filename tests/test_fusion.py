"""Fusion: elementwise chains and their producer/consumer become one kernel, the groups are
visible in the gac IR (`gac.kernel`), and the cuda target emits one kernel per group."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import gac_torch
from parity import Fn, assert_close, reference


def _kernels_by_op(gac_text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in gac_text.splitlines():
        m = re.search(r'"gac\.(\w+)".*gac\.kernel = array<i64: ([\d, ]+)>', line)
        kind = re.search(r'kind = "(\w+)"', line)
        if m:
            found.setdefault(kind.group(1) if kind else m.group(1), []).append(m.group(2))
    return found


def test_linear_gelu_epilogue_is_one_kernel():
    fn = lambda x, w, b, s: F.gelu(x @ w + b) * s  # noqa: E731
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(s, generator=g) for s in ((8, 16), (16, 32), (32,), (32,))]
    compiled = gac_torch.compile(Fn(fn), tuple(inputs))
    assert_close(compiled(*inputs), reference(fn, inputs))
    groups = _kernels_by_op(compiled.ir("gac"))
    # x@w is one kernel; +b, gelu and *s share the next one: neither intermediate is stored
    assert groups["add"] == groups["gelu"] == groups["mul"] != groups["matmul"]
    ptx = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"arch": "sm_90"}).ir("ptx")
    assert ptx.count(".entry") == 2


def test_elementwise_chain_is_one_kernel():
    fn = lambda x, y: torch.sigmoid((x * 2 + y).exp() - 1).relu() / (y.abs() + 1)  # noqa: E731
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g)]
    compiled = gac_torch.compile(Fn(fn), tuple(inputs))
    assert_close(compiled(*inputs), reference(fn, inputs))
    groups = _kernels_by_op(compiled.ir("gac"))
    assert len({k for ks in groups.values() for k in ks}) == 1, groups
    ptx = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"arch": "sm_90"}).ir("ptx")
    assert ptx.count(".entry") == 1


def test_elementwise_producer_folds_into_reduction():
    fn = lambda x: (x * x + 1).sum(-1)  # noqa: E731
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(5))
    compiled = gac_torch.compile(Fn(fn), (x,))
    assert_close(compiled(x), reference(fn, [x]))
    groups = _kernels_by_op(compiled.ir("gac"))
    assert groups["mul"] == groups["add"] == groups["sum"]

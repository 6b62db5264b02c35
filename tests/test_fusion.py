"""Fusion: elementwise chains and their producer/consumer become one kernel, the groups are
visible in the gac IR (`gac.kernel`), and the cuda target emits one kernel per group."""

from __future__ import annotations

import re

import pytest
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
    # on cuda the GEMM kernel (sgemm) runs +b, gelu and *s in its store: one kernel
    ptx = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"arch": "sm_90"}).ir("ptx")
    assert ptx.count(".entry") == 1 and "_sgemm" in ptx, ptx.split("\n.version")[0]


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


# Strategies that run a contraction as a GEMM (cuda and vortex); `reduce`/`loops` are not.
GEMMS = {"sgemm", "igemm", "mma", "wgmma", "matmul", "gemm"}


def _strategies(compiled) -> list[str]:
    """The strategy of each kernel launch, from the host program atop the PTX."""
    return re.findall(r"// launch \S+ .*?\[(\w+)\]", compiled.ir("ptx").split("\n.version")[0])


def _encoder(seq: int, dtype=torch.float32):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 160, dropout=0.0, batch_first=True).eval()
    return layer.to(dtype), torch.randn(1, seq, 64).to(dtype)


def test_linear_relu_linear_keeps_bias_relu_out_of_the_second_contraction():
    """On a 3-D input, reshape propagation turns both Linears into generic contractions; bias +
    ReLU then fused into the second one as a prologue (recomputed per output column; no GEMM
    strategy matched it). They stay with the first Linear (cpu: a kernel of their own)."""
    ffn = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 16))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in ffn.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(2, 37, 24, generator=g)
        compiled = gac_torch.compile(ffn, (x,))
        out, ref = compiled(x), ffn.double()(x.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    groups = _kernels_by_op(compiled.ir("gac"))
    assert len(groups["matmul"]) == 2 and not set(groups["relu"]) & set(groups["matmul"]), groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_encoder_layer_contractions_are_gemms_offline(dtype):
    """The encoder layer's four Linears run on GEMM strategies: the FFN's second one ran on
    `reduce` (bias + ReLU fused into it as a prologue; 0.16 of 0.52 ms on the H200), and in bf16
    the output projection too (attention's f32 -> bf16 cast fused into it; igemm takes widening
    casts only)."""
    layer, x = _encoder(37, dtype)
    with torch.no_grad():
        compiled = gac_torch.compile(layer, (x,), target="cuda",
                                     options={"arch": "sm_90", "allow_tf32": False, "cache": False})
    kinds = _strategies(compiled)
    assert kinds.count("flash") == 1 and sum(k in GEMMS for k in kinds) == 4, kinds
    assert "reduce" not in kinds, kinds


def test_encoder_layer_parity_cpu():
    layer, x = _encoder(37)
    with torch.no_grad():
        out = gac_torch.compile(layer, (x,))(x)
        ref = layer.double()(x.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.cuda
def test_encoder_layer_contractions_are_gemms_cuda():
    layer, x = _encoder(301)
    layer, x = layer.cuda(), x.cuda()
    with torch.no_grad():
        compiled = gac_torch.compile(layer, (x,), target="cuda", options={"allow_tf32": False})
        out, ref = compiled(x), layer.double()(x.double())
    kinds = _strategies(compiled)
    assert sum(k in GEMMS for k in kinds) == 4 and "reduce" not in kinds, kinds
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5)

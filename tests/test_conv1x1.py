"""1x1, stride-1 convs on NHWC lowered as a plain contraction (lowering/structured.py's
_conv1x1_nhwc, marked gac.conv): on the cpu target it computes what eager does (odd channel
counts, spatial sizes no tile divides, BatchNorm + ReLU and residual epilogues); on sm_90 the
wgmma GEMM takes it, in TF32 only when torch.backends.cudnn.allow_tf32 allows (not the matmul
flag), with the epilogue fused; GAC_CONV1X1_WGMMA=0 gives the implicit-GEMM conv back."""

from __future__ import annotations

import copy

import re

import pytest
import torch
from mlir import ir
from torch import nn

import gac_torch
from models import randomize_bn
from test_channels_last import _conv
from test_cuda_conv import PRECISIONS, _cudnn_tf32
from test_wgmma_gemm import matmul_tf32


class Chain(nn.Module):
    """3x3 stem -> bottleneck (1x1, 3x3, 1x1 + identity residual, ReLU) -> 1x1 widening (BN,
    ReLU) -> 3x3: three 1x1 stride-1 convs inside the NHWC chain (the last conv writes NCHW),
    and a strided 1x1 (which keeps the implicit GEMM)."""

    def __init__(self, cin: int = 8, c: int = 24, mid: int = 40, wide: int = 72) -> None:
        super().__init__()
        self.stem = _conv(cin, c, 3)
        self.a, self.b, self.c = _conv(c, mid, 1, p=0), _conv(mid, mid, 3), _conv(mid, c, 1, p=0)
        self.wide, self.down, self.out = _conv(c, wide, 1, p=0), _conv(wide, wide, 1, 2, 0), _conv(wide, c, 3)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        z = torch.relu(self.b(torch.relu(self.a(y))))
        y = torch.relu(self.c(z) + y)
        return self.out(torch.relu(self.down(torch.relu(self.wide(y)))))


ONE_BY_ONE = 3  # Chain's stride-1 1x1 convs


def _marked(linalg: str) -> int:
    return len(re.findall(r"attrs =\s+\{gac.conv\}", linalg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on", [True, False])
def test_chain_matches_float64_on_cpu(dtype: torch.dtype, on: bool, monkeypatch) -> None:
    if not on:
        monkeypatch.setenv("GAC_CONV1X1_WGMMA", "0")
    torch.manual_seed(7)
    model = randomize_bn(Chain()).eval()
    x = torch.randn(2, 8, 11, 13)
    ref = model.double()(x.double())
    model, x = model.to(dtype), x.to(dtype)
    compiled = gac_torch.compile(model, (x,), target="cpu",
                                 options={"channels_last": True, "fallback": False, "cache": False})
    (part,) = compiled.compiled.partitions.values()
    assert _marked(part.ir("linalg")) == (ONE_BY_ONE if on else 0)
    got = compiled(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert got.dtype == dtype and got.shape == ref.shape and err < tol, err


def test_fusion_keeps_the_conv_mark() -> None:
    # a transpose folded into the contraction rebuilds it: the mark (the conv's TF32 flag) comes
    # back by the gac op's location
    from gac_torch.ir.dialect import make_context
    from gac_torch.lowering.fusion import fuse_elementwise

    text = """
    func.func @f(%x: tensor<2x8x3x5xf32>, %w: tensor<16x8xf32>) -> tensor<2x3x5x16xf32> {
      %e = tensor.empty() : tensor<2x3x5x8xf32>
      %t = linalg.generic {indexing_maps = [affine_map<(a, b, c, d) -> (a, d, b, c)>,
                                            affine_map<(a, b, c, d) -> (a, b, c, d)>],
                           iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
          ins(%x : tensor<2x8x3x5xf32>) outs(%e : tensor<2x3x5x8xf32>) {
      ^bb0(%a: f32, %o: f32):
        linalg.yield %a : f32
      } -> tensor<2x3x5x8xf32> loc("gac0")
      %z = arith.constant 0.0 : f32
      %e2 = tensor.empty() : tensor<2x3x5x16xf32>
      %i = linalg.fill ins(%z : f32) outs(%e2 : tensor<2x3x5x16xf32>) -> tensor<2x3x5x16xf32>
      %y = linalg.generic {indexing_maps = [affine_map<(n, h, w, f, c) -> (n, h, w, c)>,
                                            affine_map<(n, h, w, f, c) -> (f, c)>,
                                            affine_map<(n, h, w, f, c) -> (n, h, w, f)>],
                           iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
          ins(%t, %w : tensor<2x3x5x8xf32>, tensor<16x8xf32>) outs(%i : tensor<2x3x5x16xf32>)
          attrs = {gac.conv} {
      ^bb0(%a: f32, %b: f32, %o: f32):
        %m = arith.mulf %a, %b : f32
        %s = arith.addf %o, %m : f32
        linalg.yield %s : f32
      } -> tensor<2x3x5x16xf32> loc("gac1")
      return %y : tensor<2x3x5x16xf32>
    }"""
    with make_context() as ctx, ir.Location.unknown():
        module = ir.Module.parse(text, ctx)
        fuse_elementwise(module)
        out = str(module)
    (conv,) = [line for line in out.splitlines() if '"reduction"' in line]
    assert "ins(%arg0, %arg1" in conv and "gac.conv" in conv, out  # the transpose folded, marked


def _kernels(compiled) -> list[str]:
    (part,) = compiled.compiled.partitions.values()
    return re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu"))


def _sm90(dtype: torch.dtype, tf32: bool, conv_tf32: bool):
    # big enough for wgmma (M*N*K >= 2^21), spatial sizes no tile divides
    model = randomize_bn(Chain(16, 96, 48, 160)).eval().to(dtype)
    x = torch.randn(2, 16, 19, 21).to(dtype)
    with matmul_tf32(tf32), _cudnn_tf32(conv_tf32):  # (torch's flags, read at compile time)
        return gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "fallback": False, "cache": False})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_by_one_convs_run_on_wgmma_without_spills(dtype: torch.dtype, monkeypatch) -> None:
    from gac_torch.backends.cuda import ptxas

    compiled = _sm90(dtype, False, True)  # torch's default flags: TF32 for convs only
    kernels = _kernels(compiled)
    # the 1x1s' epilogues (BatchNorm, ReLU, residual add) run in the wgmma store: no loops kernel
    # for them (the input's layout change and the three 3x3s' weight copies into (kh, kw, c) order
    # aside, one `combo` launch: backends/gpu/combine.py); the other convs, their channels whole
    # 16-byte vectors, on the wgmma implicit GEMM (cwgmma: tests/test_wgmma_conv.py)
    assert sorted(kernels) == sorted(["wgmma"] * ONE_BY_ONE + ["cwgmma"] * 4 + ["combo"]), kernels
    (part,) = compiled.compiled.partitions.values()
    ptx = part.ir("ptx")
    wgmma = [k for k in ptx.split(".entry")[1:] if k.split("(")[0].strip().endswith("_wgmma")]
    elem = "tf32" if dtype == torch.float32 else "bf16"
    assert len(wgmma) == ONE_BY_ONE and all(f".f32.{elem}.{elem}" in k for k in wgmma)
    path = ptxas.find_ptxas()
    assert path is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    result = ptxas.assemble(ptx, "sm_90a", path)
    spills = re.findall(r"(\d+) bytes spill stores", result.log)
    assert result.ok and spills and all(int(m) == 0 for m in spills), result.log
    monkeypatch.setenv("GAC_CONV1X1_WGMMA", "0")  # the A/B switches: implicit GEMM everywhere
    monkeypatch.setenv("GAC_CONV_WGMMA", "0")
    assert not {"wgmma", "cwgmma"} & set(_kernels(_sm90(dtype, False, True)))


def test_one_by_one_tf32_follows_the_conv_flag() -> None:
    # the matmul flag alone does not let a conv round to TF32 (exact sgemm); the conv flag does
    assert set(_kernels(_sm90(torch.float32, True, False))) == {"sgemm", "combo"}  # (combo: the layout copies)
    assert "wgmma" in _kernels(_sm90(torch.float32, False, True))


@pytest.mark.cuda
@pytest.mark.parametrize("big", [True, False])
@pytest.mark.parametrize("precision", ["tf32", "bf16autocast"])
def test_chain_matches_float64_on_gpu(precision: str, big: bool) -> None:
    # torch.compile under the default flags (TF32 convs) or bf16 autocast, on the H200: the 1x1s
    # on wgmma (sm_90; `big`), else the 1x1 contractions on igemm (under wgmma's minimum work;
    # as on sm_80), checked against float64
    torch.manual_seed(5)
    model = randomize_bn(Chain(16, 96, 48, 160) if big else Chain()).eval()
    x = torch.randn(2, 16, 19, 21) if big else torch.randn(2, 8, 11, 13)
    ref = copy.deepcopy(model).double()(x.double())  # (.double() converts in place)
    model, x = model.cuda(), x.cuda()
    torch._dynamo.reset()
    with _cudnn_tf32(True), torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=precision != "tf32"):
        got = torch.compile(model, backend="gac")(x)
    tol = 4 * PRECISIONS["tf32" if precision == "tf32" else "bf16"][2]
    err = ((got.double().cpu() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(got).all() and err < tol, (precision, err)

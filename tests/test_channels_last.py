"""passes/channels_last.py on the cpu target (the pass is target-neutral; cuda turns it on by
default, here the option does): convolution chains of odd shapes compute what eager does, and
the gac IR keeps NHWC between the chained convs with transposes only at the chain's edges."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import gac_torch
from models import randomize_bn


def _conv(cin: int, cout: int, k: int = 3, s: int = 1, p: int = 1, d: int = 1, g: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p, d, g, bias=False), nn.BatchNorm2d(cout))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride 2, grouped) -> 1x1 + a strided 1x1 downsample, residual add, ReLU;
    channel counts no tile divides."""

    def __init__(self, c: int = 12, mid: int = 20, out: int = 36, stride: int = 2, groups: int = 2) -> None:
        super().__init__()
        self.a, self.b = _conv(c, mid, 1, p=0), _conv(mid, mid, 3, stride, 1, g=groups)
        self.c, self.down = _conv(mid, out, 1, p=0), _conv(c, out, 1, stride, 0)

    def forward(self, x):
        y = torch.relu(self.a(x))
        y = torch.relu(self.b(y))
        return torch.relu(self.c(y) + self.down(x))


class InputResidual(nn.Module):
    """The graph's NCHW input added to the chain (transposed once), a dilated conv, and a result
    also read by a non-elementwise op (a spatial mean): that use keeps NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _conv(10, 10, 3, p=2, d=2), _conv(10, 9, 3)

    def forward(self, x):
        y = torch.relu(self.a(x) + x)
        z = self.b(y).sigmoid()
        return z, y.mean(dim=(2, 3))


class Mixed(nn.Module):
    """A transposed conv feeding a conv, a depthwise conv (kept NCHW) in between, bias + SiLU."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(8, 16, 3, stride=2, padding=1, output_padding=1)
        self.a = nn.Conv2d(16, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.b = nn.Conv2d(16, 24, 1)

    def forward(self, x):
        y = nn.functional.silu(self.a(self.up(x)))
        return self.b(torch.relu(self.dw(y)) * 0.5 + y)


class Pooled(nn.Module):
    """conv -> ReLU -> max-pool (ceil mode, padded) -> conv -> avg-pool (padding not counted)
    -> conv: the pools run on NHWC too, the chain converts once at each end; the RGB input conv
    as well, its input and weights zero-padded to 4 channels (vectors on NHWC)."""

    def __init__(self) -> None:
        super().__init__()
        self.rgb = nn.Conv2d(3, 8, 3, padding=1)
        self.a, self.b, self.c = _conv(8, 12, 3), _conv(12, 16, 1, p=0), _conv(16, 9, 3)

    def forward(self, x):
        y = torch.relu(self.a(self.rgb(x)))
        y = nn.functional.max_pool2d(y, 3, 2, 1, ceil_mode=True)
        y = nn.functional.avg_pool2d(torch.relu(self.b(y)), 3, 2, 1, count_include_pad=False)
        return self.c(y)


CASES = {  # name -> (model, input shape, convs the pass puts on NHWC)
    "bottleneck": (Bottleneck, (2, 12, 11, 13), 4),
    "input_residual": (InputResidual, (2, 10, 9, 7), 2),
    "mixed": (Mixed, (1, 8, 5, 6), 3),
    "pooled": (Pooled, (2, 3, 13, 11), 4),
}


def _compile(model: nn.Module, x: torch.Tensor, on: bool):
    compiled = gac_torch.compile(model, (x,), target="cpu", options={"channels_last": on, "fallback": False})
    (part,) = compiled.compiled.partitions.values()
    return compiled, part.ir("gac")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_chains_on_nhwc_match_eager(name: str, dtype: torch.dtype) -> None:
    cls, shape, nhwc = CASES[name]
    torch.manual_seed(len(name))
    model = randomize_bn(cls()).eval()
    x = torch.randn(shape)
    ref = model.double()(x.double())
    model, x = model.to(dtype), x.to(dtype)
    compiled, gac = _compile(model, x, True)
    assert len(re.findall(r"\"gac.conv\".*channels_last = 1", gac)) == nhwc, gac
    got = compiled(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert g.dtype == dtype and g.shape == r.shape and g.is_contiguous()
        err = ((g.double() - r).norm() / r.norm()).item()
        assert err < tol, (name, err)


def test_transposes_only_at_the_chain_edges() -> None:
    # bottleneck: the input once to NHWC (read by two convs), the sum once back; nothing between
    model, x = randomize_bn(Bottleneck()).eval(), torch.randn(2, 12, 11, 13)
    _, gac = _compile(model, x, True)
    perms = re.findall(r'"gac.transpose".*perm = array<i64: ([\d, ]+)>', gac)
    assert perms == ["0, 2, 3, 1", "0, 3, 1, 2"], perms
    _, off = _compile(model, x, False)
    assert "gac.transpose" not in off and "channels_last = 1" not in off


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = _conv(8, 8)

    def forward(self, x):
        return torch.relu(self.conv(x) + x)


@pytest.mark.parametrize("name", ["lone", "own_residual"])
def test_a_conv_with_no_conv_to_share_the_transposes_keeps_nchw(name: str) -> None:
    # conv + bias + ReLU, or conv + BN + its own input: the transposes would cost, not save
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()) if name == "lone" else _Residual()
    model, x = randomize_bn(model).eval(), torch.randn(1, 8, 7, 9)
    _, gac = _compile(model, x, True)
    assert "channels_last = 0" in gac and "gac.transpose" not in gac


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["f32", "tf32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_chains_on_nhwc_match_float64_on_gpu(name: str, precision: str) -> None:
    # the cuda target's default (channels_last on): the implicit GEMM on NHWC inputs, 16-byte
    # vectors through the padding guards, the NCHW outputs written by the last epilogue
    from test_cuda_conv import PRECISIONS, _cudnn_tf32

    dtype, tf32, tol = PRECISIONS[precision]
    cls, shape, _ = CASES[name]
    torch.manual_seed(3)
    model = randomize_bn(cls()).eval()
    x = torch.randn(shape)
    ref = model.double()(x.double())
    model, x = model.to("cuda", dtype), x.to("cuda", dtype)
    with _cudnn_tf32(tf32):
        compiled = gac_torch.compile(model, (x,), target="cuda")
        got = compiled(x)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        err = ((g.double().cpu() - r).norm() / r.norm()).item()
        assert torch.isfinite(g).all() and err < 4 * tol, (name, precision, err)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_nhwc_convs_stage_16_byte_vectors_without_spills(precision: str) -> None:
    # offline (sm_90): a 1x1 -> 3x3 (padded) -> 1x1 chain on NHWC: the first conv's operands
    # (igemm: NCHW input) are staged by 16-byte cp.async, the two NHWC convs' by TMA boxes (the
    # 3x3's padding as their zero fill; NCHW: the 3x3's input was gathered one 4-byte element
    # at a time); ptxas spills nothing
    from test_cuda_conv import PRECISIONS, _cudnn_tf32

    from gac_torch.backends.cuda.ptxas import assemble

    dtype, tf32, _ = PRECISIONS[precision]
    model = nn.Sequential(_conv(64, 64, 1, p=0), nn.ReLU(), _conv(64, 64, 3), nn.ReLU(), _conv(64, 128, 1, p=0))
    model, x = randomize_bn(model).eval().to(dtype), torch.randn(2, 64, 20, 24).to(dtype)
    with _cudnn_tf32(tf32):
        compiled = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "fallback": False})
    (part,) = compiled.compiled.partitions.values()
    assert len(re.findall(r"\"gac.conv\".*channels_last = 1", part.ir("gac"))) == 3
    kernels = re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu"))
    # the 3x3 weights' [f, kh, kw, c] copy and three convs: the first reads the NCHW input
    # (its transpose folded into the conv's indexing: igemm), the last one's epilogue writes
    # NCHW; the NHWC ones on sm_90a's wgmma implicit GEMM (cwgmma)
    assert sorted(kernels) == ["cwgmma"] * 2 + ["igemm", "loops"], kernels
    convs = [k for k in part.ir("ptx").split(".entry")[1:] if "mma.sync" in k or "wgmma.mma_async" in k]
    copies = [re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\d+)", k) for k in convs]
    boxes = ["cp.async.bulk.tensor.4d" in k for k in convs]  # (cwgmma: TMA boxes, wgmma_conv.Window)
    assert len(convs) == 3 and all(b or c and set(c) == {"16"} for b, c in zip(boxes, copies)) and sum(boxes) == 2, copies
    result = assemble(part.ir("ptx"), "sm_90a")  # (wgmma: the module targets sm_90a)
    spills = re.findall(r"(\d+) bytes spill stores", result.log)
    assert result.ok and spills and all(int(m) == 0 for m in spills), result.log


def test_epilogue_reading_through_a_permutation_is_interchanged() -> None:
    # the chain's last BatchNorm + ReLU reads the NHWC conv result and writes the NCHW output
    # (the transpose folded in by elementwise fusion): its loops are permuted so that it reads
    # the conv result at its own point, which the implicit GEMM's epilogue fusion needs
    from mlir import ir

    from gac_torch.backends.gpu.analysis import analyze, map_dims, read_at_own_point
    from gac_torch.ir.dialect import make_context

    text = """
    func.func @f(%y: memref<2x5x7x3xf32>, %s: memref<3xf32>, %z: memref<2x3x5x7xf32>) {
      linalg.generic {indexing_maps = [affine_map<(a, b, c, d) -> (a, c, d, b)>,
                                       affine_map<(a, b, c, d) -> (b)>,
                                       affine_map<(a, b, c, d) -> (a, b, c, d)>],
                      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
          ins(%y, %s : memref<2x5x7x3xf32>, memref<3xf32>) outs(%z : memref<2x3x5x7xf32>) {
      ^bb0(%v: f32, %w: f32, %o: f32):
        %m = arith.mulf %v, %w : f32
        linalg.yield %m : f32
      }
      return
    }"""
    with make_context() as ctx, ir.Location.unknown():
        module = ir.Module.parse(text, ctx)
        op = module.body.operations[0].regions[0].blocks[0].operations[0].operation
        g = read_at_own_point(analyze(op), 0)
        assert g is not None and g.ranges == [2, 5, 7, 3]
        assert [map_dims(m) for m in (g.maps[0], g.maps[2])] == [[0, 1, 2, 3], [0, 3, 1, 2]]
        assert [str(e) for e in g.maps[1].results] == ["d3"]
        op.verify()


def test_pools_between_convs_stay_nhwc() -> None:
    model, x = randomize_bn(Pooled()).eval(), torch.randn(2, 3, 13, 11)
    _, gac = _compile(model, x, True)
    assert len(re.findall(r'"gac.pool".*channels_last = 1', gac)) == 2, gac
    perms = re.findall(r'"gac.transpose".*perm = array<i64: ([\d, ]+)>', gac)
    assert perms == ["0, 2, 3, 1", "0, 3, 1, 2"], perms


@pytest.mark.parametrize("pad", [True, False])
def test_rgb_conv_goes_nhwc_on_four_padded_channels(pad: bool, monkeypatch) -> None:
    # the stem's 3 input channels: input and weights padded with a zero channel (4: a 16-byte f32
    # vector on NHWC); GAC_STEM_PAD=0 leaves it on NCHW
    if not pad:
        monkeypatch.setenv("GAC_STEM_PAD", "0")
    model, x = randomize_bn(Pooled()).eval(), torch.randn(2, 3, 13, 11)
    _, gac = _compile(model, x, True)
    convs = re.findall(r'"gac.conv"\(.*\{channels_last = (\d).*\(tensor<([\dx]+)xf32>, tensor<([\dx]+)xf32>\)', gac)
    assert convs[0] == (("1", "2x13x11x4", "8x4x3x3") if pad else ("0", "2x3x13x11", "8x3x3x3")), convs


def test_equal_channel_and_spatial_sizes_are_transposed_not_reshaped() -> None:
    # C == H == W: moving those dims keeps the list of sizes, but not the data (a reshape there
    # gave 1.07 abs error on conv -> relu -> conv, and the cuda cnn/test_base models went wrong)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 16, 3, padding=1),
                          nn.ReLU(), nn.Conv2d(16, 16, 1)).eval()
    x = torch.randn(2, 16, 16, 16)
    ref = model.double()(x.double())
    compiled, _ = _compile(model.float(), x, True)
    assert (compiled(x).double() - ref).abs().max().item() < 1e-5


def test_convs_with_a_single_output_row_stay_nchw() -> None:
    # test_base's FPN: a stride-2 3x3 conv on 2x3 gives one output row; on NHWC the cuda pipeline
    # dropped that unit dim and the generic no longer verified (H200, test_base on cuda)
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, stride=2, padding=1)).eval()
    x = torch.randn(2, 32, 2, 3)
    compiled, gac = _compile(model, x, True)
    assert len(re.findall(r"\"gac.conv\".*channels_last = 1", gac)) == 0, gac
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    ptx = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "fallback": False, "cache": False}).ir("ptx")
    assert ".entry" in ptx

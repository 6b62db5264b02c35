"""The Hopper implicit-GEMM conv (kernels/wgmma_conv.py, strategies/conv_wgmma.py). CPU: the numpy
twin of its producers stages odd-shaped NHWC convs (channels, sizes and counts no tile divides,
padding, stride 2, dilation 2, batch 2) into the swizzled tiles wgmma reads through the kernel's
descriptors, and their product is the convolution; the strategy picks `cwgmma` for the convs
whose channels come in 16-byte vectors on sm_90 (igemm the rest, GAC_CONV_WGMMA=0 all), and the
kernels assemble without spills. GPU (-m cuda): parity with float64 under torch's default flags
(TF32 convs) and bf16 autocast."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

import gac_torch
from gac_torch.kernels import wgmma_conv, wgmma_conv_twin
from gac_torch.kernels.builder import round_to
from gac_torch.kernels.conv_gemm import Operand, Spec
from models import randomize_bn
from test_channels_last import _conv
from test_cuda_conv import PRECISIONS, _cudnn_tf32


def nhwc_spec(kind: str, n: int, h: int, w: int, c: int, f: int, k: int, s: int, p: int, d: int) -> Spec:
    """An NHWC conv as conv_gemm.Spec, the form implicit_gemm._match gives after padding_of and
    the weight copy: dims (n, oh, ow, f, kh, kw, c); x [n, h, w, c] read through two padding
    guards, weights [f, kh, kw, c], y [n, oh, ow, f], all dense."""
    oh, ow = (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1
    e = "f32" if kind == "tf32" else kind
    a = Operand(f"memref<{n}x{h}x{w}x{c}x{e}>", e, (h * w * c, s * w * c, s * c, 0, d * w * c, d * c, 1),
                -p * w * c - p * c, 0, n * h * w * c,
                (((0, s, 0, 0, d, 0, 0), -p, h), ((0, 0, s, 0, 0, d, 0), -p, w)))
    b = Operand(f"memref<{f}x{k}x{k}x{c}x{e}>", e, (0, 0, 0, k * k * c, k * c, c, 1), 0, 0, f * k * k * c)
    y = Operand(f"memref<{n}x{oh}x{ow}x{f}xf32>", "f32", (oh * ow * f, ow * f, f, 1, 0, 0, 0), 0, 0, n * oh * ow * f)
    return Spec(kind, (0, 1, 2), (3,), (4, 5, 6), (), (n, oh, ow, f, k, k, c), a, b, y, True)


# n, h, w, c, f, k, stride, pad, dilation
SHAPES = {
    "3x3": (2, 9, 11, 12, 20, 3, 1, 1, 1),
    "3x3s2": (2, 13, 10, 8, 36, 3, 2, 1, 1),
    "dilated": (1, 12, 9, 16, 24, 3, 1, 2, 2),
    "1x1s2": (2, 11, 9, 24, 72, 1, 2, 0, 1),
    "wide": (1, 17, 15, 40, 136, 3, 1, 1, 1),  # two N tiles, the second mostly outside
    "stem": (2, 19, 21, 4, 64, 7, 2, 3, 1),  # an RGB stem padded to 4 channels: one vector per tap
    "stem_s2d": (2, 13, 11, 12, 64, 4, 1, 0, 1),  # the stem on 2x2 blocks (passes/space_to_depth.py)
}


@pytest.mark.parametrize("bn", [64, 128])
@pytest.mark.parametrize("kind", ["tf32", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_twin_stages_the_im2col_tiles_of_odd_convs(name: str, kind: str, bn: int) -> None:
    n, h, w, c, f, k, s, p, d = SHAPES[name]
    if kind == "bf16" and c % 8:
        c += 4  # (whole 16-byte vectors of bf16)
    spec = nhwc_spec(kind, n, h, w, c, f, k, s, p, d)
    plan = wgmma_conv.plan(spec, bn=bn, tma=False)
    assert plan is not None and plan.bn == bn and plan.window is None
    rng = np.random.default_rng(sum(SHAPES[name]))
    x = round_to(rng.standard_normal((n, h, w, c)).astype(np.float32), "bf16" if kind == "bf16" else "f32")
    wt = round_to(rng.standard_normal((f, k, k, c)).astype(np.float32), "bf16" if kind == "bf16" else "f32")
    got = wgmma_conv_twin.emulate(spec, plan, x.reshape(-1), wt.reshape(-1))
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).double().permute(0, 3, 1, 2),
                                     torch.from_numpy(wt).double().permute(0, 3, 1, 2), stride=s, padding=p, dilation=d)
    ref = ref.permute(0, 2, 3, 1).reshape(spec.M, spec.N).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)


# n, h, w, c, f, k, stride, pad, dilation: whole 128-byte channel slices per tap (C % BK == 0)
WINDOWS = {
    "3x3": (2, 9, 11, 64, 20, 3, 1, 1, 1),  # two slices per tap in tf32; 20 of 64 / 128 columns
    "dilated": (1, 12, 9, 64, 72, 3, 1, 2, 2),  # a second N tile, mostly outside
    "unpadded": (2, 7, 5, 64, 16, 3, 1, 0, 1),  # no guards: the view is the window's extent
    "tall": (1, 37, 6, 64, 24, 3, 1, 1, 1),  # 16 x 8 rectangles, 2 of 8 columns past the image
    "ragged": (3, 45, 37, 64, 20, 3, 1, 1, 1),  # 45 rectangles, more than M / BM = 40 tiles
    "1x1s2": (2, 11, 9, 128, 72, 1, 2, 0, 1),  # a strided view: stride 2 is the view's step
    "3x3s2": (2, 10, 14, 64, 24, 3, 2, 1, 1),  # row pairs: taps off the stride's grid
    "3x3s2d2": (1, 13, 11, 64, 16, 3, 2, 2, 2),  # every tap on the grid: a strided view
}


def _conv_ref(x: np.ndarray, wt: np.ndarray, s: int, p: int, d: int) -> np.ndarray:
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).double().permute(0, 3, 1, 2),
                                     torch.from_numpy(wt).double().permute(0, 3, 1, 2), stride=s, padding=p, dilation=d)
    return ref.permute(0, 2, 3, 1).reshape(-1, wt.shape[0]).numpy()


@pytest.mark.parametrize("bn", [64, 128])
@pytest.mark.parametrize("kind", ["tf32", "bf16"])
@pytest.mark.parametrize("name", list(WINDOWS))
def test_twin_window_boxes_are_the_convolution(name: str, kind: str, bn: int) -> None:
    # TMA's boxes at the kernel's coordinates (zero fill outside x: the padding and the
    # rectangles' overhang), swizzled and read back through wgmma's descriptors, rows stored
    # where WindowHooks.rows says
    n, h, w, c, f, k, s, p, d = WINDOWS[name]
    spec = nhwc_spec(kind, n, h, w, c, f, k, s, p, d)
    plan = wgmma_conv.plan(spec, bn=bn, tma=True)
    assert plan is not None and plan.window is not None and plan.bn == bn
    assert plan.tiles == plan.window.m_tiles * -(-f // bn)
    rng = np.random.default_rng(sum(WINDOWS[name]))
    prec = "bf16" if kind == "bf16" else "f32"
    x = round_to(rng.standard_normal((n, h, w, c)).astype(np.float32), prec)
    wt = round_to(rng.standard_normal((f, k, k, c)).astype(np.float32), prec)
    got = wgmma_conv_twin.emulate_window(spec, plan, x.reshape(-1), wt.reshape(-1))
    np.testing.assert_allclose(got, _conv_ref(x, wt, s, p, d), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["ragged", "3x3s2"])
def test_twin_cluster_pairs_share_b_halves(name: str, monkeypatch) -> None:
    # GAC_CONV_WGMMA_CLUSTER=2: CTA pairs on M-adjacent rectangles (45: the last pair's second
    # one past the image), each rank's half of B multicast to both
    monkeypatch.setenv("GAC_CONV_WGMMA_CLUSTER", "2")
    n, h, w, c, f, k, s, p, d = WINDOWS[name]
    spec = nhwc_spec("bf16", n, h, w, c, f, k, s, p, d)
    plan = wgmma_conv.plan(spec, bn=128, tma=True)
    assert plan.cluster == 2 and plan.tiles == -(-plan.window.m_tiles // 2) and plan.grid[0] % 2 == 0
    rng = np.random.default_rng(5)
    x = round_to(rng.standard_normal((n, h, w, c)).astype(np.float32), "bf16")
    wt = round_to(rng.standard_normal((f, k, k, c)).astype(np.float32), "bf16")
    got = wgmma_conv_twin.emulate_window(spec, plan, x.reshape(-1), wt.reshape(-1))
    np.testing.assert_allclose(got, _conv_ref(x, wt, s, p, d), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_twin_window_of_a_1x1_without_tap_dims(kind: str) -> None:
    # a 1x1 whose contraction has K = (c) alone (ResNet's last conv, NCHW output): dims
    # (n, oh, ow, f, c); the Window reads it with taps of range 1
    n, h, w, c, f = 2, 7, 45, 64, 72
    e = "f32" if kind == "tf32" else kind
    a = Operand(f"memref<{n}x{h}x{w}x{c}x{e}>", e, (h * w * c, w * c, c, 0, 1), 0, 0, n * h * w * c)
    b = Operand(f"memref<{f}x{c}x{e}>", e, (0, 0, 0, c, 1), 0, 0, f * c)
    y = Operand(f"memref<{n}x{h}x{w}x{f}xf32>", "f32", (h * w * f, w * f, f, 1, 0), 0, 0, n * h * w * f)
    spec = Spec(kind, (0, 1, 2), (3,), (4,), (), (n, h, w, f, c), a, b, y, True)
    plan = wgmma_conv.plan(spec, tma=True)
    assert plan is not None and plan.window is not None
    rng = np.random.default_rng(7)
    x = round_to(rng.standard_normal((n, h, w, c)).astype(np.float32), "bf16" if kind == "bf16" else "f32")
    wt = round_to(rng.standard_normal((f, 1, 1, c)).astype(np.float32), "bf16" if kind == "bf16" else "f32")
    got = wgmma_conv_twin.emulate_window(spec, plan, x.reshape(-1), wt.reshape(-1))
    np.testing.assert_allclose(got, _conv_ref(x, wt, 1, 0, 1), rtol=1e-9, atol=1e-9)


def test_twin_catches_rows_past_the_image(monkeypatch) -> None:
    # the rectangle's pixels past the image stored as if inside: they overwrite real rows
    n, h, w, c, f, k, s, p, d = WINDOWS["tall"]
    spec = nhwc_spec("tf32", n, h, w, c, f, k, s, p, d)
    plan = wgmma_conv.plan(spec, tma=True)
    rng = np.random.default_rng(1)
    x, wt = rng.standard_normal((n, h, w, c)), rng.standard_normal((f, k, k, c))
    ref = _conv_ref(x, wt, s, p, d)
    np.testing.assert_allclose(wgmma_conv_twin.emulate_window(spec, plan, x.reshape(-1), wt.reshape(-1)), ref, rtol=1e-9)
    rows = wgmma_conv.WindowHooks.rows
    monkeypatch.setattr(wgmma_conv.WindowHooks, "rows", lambda self, m0, r: rows(self, m0, r) % spec.M)
    assert not np.allclose(wgmma_conv_twin.emulate_window(spec, plan, x.reshape(-1), wt.reshape(-1)), ref)


@pytest.mark.parametrize("kind,shape,why", [
    ("tf32", (2, 9, 11, 64, 20, 3, 2, 1, 1), "stride 2 off its grid, an odd input"),
    ("bf16", (1, 12, 12, 64, 20, 3, 3, 1, 1), "stride 3"),
    ("tf32", (2, 9, 11, 48, 20, 3, 1, 1, 1), "channels not whole slices"),
    ("bf16", (2, 9, 11, 32, 20, 3, 1, 1, 1), "channels not whole slices"),
])
def test_window_declines_to_the_gather(kind: str, shape: tuple, why: str) -> None:
    plan = wgmma_conv.plan(nhwc_spec(kind, *shape), tma=True)
    assert plan is not None and plan.window is None, why


def test_window_rectangles_follow_the_image() -> None:
    # the fewest rectangles, then the widest: ResNet-50's layers at 480x800
    assert wgmma_conv._tile_shape(120, 200) == (8, 16)  # 15 x 13 rectangles (16 x 8: 8 x 25)
    assert wgmma_conv._tile_shape(1, 300) == (1, 128)
    assert all(th * tw == wgmma_conv.BM for th, tw in map(lambda s: wgmma_conv._tile_shape(*s), [(60, 100), (15, 25)]))


def test_twin_catches_a_wrong_swizzle(monkeypatch) -> None:
    # the chunk's swizzle dropped (chunk j, not j ^ row % 8): wgmma would read scrambled tiles
    n, h, w, c, f, k, s, p, d = SHAPES["3x3"]
    spec = nhwc_spec("tf32", n, h, w, c, f, k, s, p, d)
    rng = np.random.default_rng(0)
    x, wt = rng.standard_normal((n, h, w, c)), rng.standard_normal((f, k, k, c))
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).permute(0, 3, 1, 2),
                                     torch.from_numpy(wt).permute(0, 3, 1, 2), padding=p)
    ref = ref.permute(0, 2, 3, 1).reshape(spec.M, spec.N).numpy()
    plan = wgmma_conv.plan(spec)
    np.testing.assert_allclose(wgmma_conv_twin.emulate(spec, plan, x.reshape(-1), wt.reshape(-1)), ref, rtol=1e-9)
    monkeypatch.setattr(wgmma_conv_twin._Producers, "xor", lambda self, x, y: x)
    assert not np.allclose(wgmma_conv_twin.emulate(spec, plan, x.reshape(-1), wt.reshape(-1)), ref)


def test_tile_width_follows_the_rounds_of_tiles() -> None:
    # ResNet-50's layer-3 3x3 (M = 9000, N = 256): 142 wide tiles are two rounds on 132 SMs, 284
    # narrow ones three; layer 4's (M = 2250, N = 512): 72 wide tiles, one round
    assert wgmma_conv.plan(nhwc_spec("tf32", 6, 30, 50, 256, 256, 3, 1, 1, 1), tma=False).bn == 64
    assert wgmma_conv.plan(nhwc_spec("tf32", 6, 15, 25, 512, 512, 3, 1, 1, 1), tma=False).bn == 128
    # TMA boxes: wide tiles (each N tile reads the taps of A again), narrow for N <= 64
    assert wgmma_conv.plan(nhwc_spec("bf16", 6, 30, 50, 256, 256, 3, 1, 1, 1), tma=True).bn == 128
    assert wgmma_conv.plan(nhwc_spec("bf16", 6, 120, 200, 64, 64, 3, 1, 1, 1), tma=True).bn == 64


@pytest.mark.parametrize("kind,c,why", [
    ("tf32", 3, "16-byte vectors"), ("bf16", 12, "16-byte vectors"), ("f32", 16, "kind"),
])
def test_plan_declines_what_it_cannot_gather(kind: str, c: int, why: str) -> None:
    spec = nhwc_spec(kind, 1, 9, 9, c, 16, 3, 1, 1, 1)
    assert wgmma_conv.plan(spec) is None and why in wgmma_conv.applies(spec)


class Net(nn.Module):
    """A 3-channel stem (igemm: no 16-byte vectors), then 3x3, 3x3 stride 2 and dilated 3x3
    convs, a strided 1x1 downsample with a residual; BatchNorm + ReLU epilogues; NHWC inside,
    channel counts no tile divides."""

    def __init__(self, c: int = 16, mid: int = 40, out: int = 72) -> None:
        super().__init__()
        self.stem, self.a = _conv(3, c, 3), _conv(c, mid, 3)
        self.b, self.dil = _conv(mid, mid, 3, 2), _conv(mid, out, 3, 1, 2, 2)
        self.down = _conv(c, out, 1, 2, 0)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        z = torch.relu(self.b(torch.relu(self.a(y))))
        return torch.relu(self.dil(z) + self.down(y))


def _kernels(compiled) -> list[str]:
    (part,) = compiled.compiled.partitions.values()
    return re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu"))


def _sm90(dtype: torch.dtype, conv_tf32: bool = True):
    model = randomize_bn(Net()).eval().to(dtype)
    x = torch.randn(2, 3, 19, 21).to(dtype)
    with _cudnn_tf32(conv_tf32):
        return gac_torch.compile(model, (x,), target="cuda",
                                 options={"arch": "sm_90", "fallback": False, "cache": False, "channels_last": True})


@pytest.mark.parametrize("bn", ["", "128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convs_run_on_cwgmma_without_spills(dtype: torch.dtype, bn: str, monkeypatch) -> None:
    from gac_torch.backends.cuda import ptxas

    monkeypatch.setenv("GAC_CONV_WGMMA_BN", bn)  # (the heuristic takes 64 here: one round)
    compiled = _sm90(dtype)
    kernels = _kernels(compiled)
    # the RGB stem, padded to 4 channels (passes/channels_last.py): one 16-byte vector per tap
    # in f32 (cwgmma), half of one in bf16 (igemm)
    wg = 5 if dtype == torch.float32 else 4
    assert kernels.count("cwgmma") == wg and kernels.count("igemm") == 5 - wg, kernels
    (part,) = compiled.compiled.partitions.values()
    ptx = part.ir("ptx")
    elem = "tf32" if dtype == torch.float32 else "bf16"
    ours = [k for k in ptx.split(".entry")[1:] if k.split("(")[0].strip().endswith("_cwgmma")]
    assert len(ours) == wg and all(f".f32.{elem}.{elem}" in k and "cp.async.cg.shared.global" in k for k in ours)
    result = ptxas.assemble(ptx, "sm_90a", ptxas.find_ptxas())
    spills = re.findall(r"(\d+) bytes spill stores", result.log)
    assert result.ok and spills and all(int(m) == 0 for m in spills), result.log
    monkeypatch.setenv("GAC_CONV_WGMMA", "0")  # the A/B switch: the mma.sync implicit GEMM
    assert "cwgmma" not in _kernels(_sm90(dtype)) and "igemm" in _kernels(_sm90(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stride_1_convs_load_tma_boxes_without_spills(dtype: torch.dtype, monkeypatch) -> None:
    # 64 / 96 channels: whole slices per tap. tf32: the 3x3, the dilated 3x3 and the strided
    # 1x1 take 4-D boxes, the stride-2 3x3 (odd 19 x 21 input) gathers; bf16 (BK = 64): 96
    # channels gather too
    from gac_torch.backends.cuda import ptxas

    def cwgmma_ptx() -> list[str]:
        model = randomize_bn(Net(64, 96, 136)).eval().to(dtype)
        with _cudnn_tf32(True):
            compiled = gac_torch.compile(model, (torch.randn(2, 3, 19, 21).to(dtype),), target="cuda", options={
                "arch": "sm_90", "fallback": False, "cache": False, "channels_last": True})
        (part,) = compiled.compiled.partitions.values()
        ptx = part.ir("ptx")
        result = ptxas.assemble(ptx, "sm_90a", ptxas.find_ptxas())
        spills = re.findall(r"(\d+) bytes spill stores", result.log)
        assert result.ok and spills and all(int(m) == 0 for m in spills), result.log
        return [k for k in ptx.split(".entry")[1:] if k.split("(")[0].strip().endswith("_cwgmma")]

    boxes = ["cp.async.bulk.tensor.4d" in k for k in cwgmma_ptx()]
    assert boxes.count(True) == (3 if dtype == torch.float32 else 2) and boxes.count(False) == len(boxes) - boxes.count(True)
    monkeypatch.setenv("GAC_CONV_WGMMA_TMA", "0")  # the A/B switch: every conv gathers
    assert not any("cp.async.bulk.tensor" in k for k in cwgmma_ptx())


def test_exact_f32_and_the_switch_in_the_cache_key(monkeypatch) -> None:
    from gac_torch.runtime import cache

    assert "cwgmma" not in _kernels(_sm90(torch.float32, conv_tf32=False))  # exact: sgemm
    monkeypatch.setenv("GAC_CONV_WGMMA", "0")
    assert cache.code_switches().get("GAC_CONV_WGMMA") == "0"


def _biased() -> nn.Module:
    # convs with a bias (no BatchNorm): the bias in the wgmma store's epilogue
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 24, 3, 1, 1), nn.ReLU(),
                         nn.Conv2d(24, 40, 3, 2, 1), nn.ReLU())


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["big", "big128", "even", "gather", "bias"])
@pytest.mark.parametrize("precision", ["tf32", "bf16autocast"])
def test_net_matches_float64_on_gpu(precision: str, case: str, monkeypatch) -> None:
    # big: the heuristic's tiles, TMA boxes where channels come in whole slices (the 3x3 and
    # the strided 1x1; the stride-2 3x3 on an odd input gathers); big128: 128-wide tiles;
    # even: 128 channels on an even input, so the stride-2 3x3 takes row-pair boxes too;
    # gather: every conv's tiles by cp.async (GAC_CONV_WGMMA_TMA=0); bias: small convs with a
    # bias and no BatchNorm
    if case == "big128":
        monkeypatch.setenv("GAC_CONV_WGMMA_BN", "128")
    if case == "gather":
        monkeypatch.setenv("GAC_CONV_WGMMA_TMA", "0")
    torch.manual_seed(3)
    big = case != "bias"
    model = randomize_bn(Net(64, 128 if case == "even" else 96, 136)) if big else _biased()
    model.eval()
    x = torch.randn(2, 3, 44, 38) if case == "even" else torch.randn(3, 3, 45, 37) if big else torch.randn(2, 3, 19, 21)
    ref = copy.deepcopy(model).double()(x.double())
    model, x = model.cuda(), x.cuda()
    torch._dynamo.reset()
    with _cudnn_tf32(True), torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=precision != "tf32"):
        got = torch.compile(model, backend="gac", options={"channels_last": True})(x)
    tol = 4 * PRECISIONS["tf32" if precision == "tf32" else "bf16"][2]
    err = ((got.double().cpu() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(got).all() and err < tol, (precision, err)

"""ResNet's 7x7 stride-2 stem on 3 input channels (passes/channels_last.py pads them to 4): on NHWC
its input and weights stage in whole vectors (K = (kh, kw, c), c innermost), where NCHW's padded
input read one scalar per element (bf16: no cp.async at all). The numpy twin on the padded
conv's spec, the PTX's copy widths offline, and the compiled stem against float64 on the GPU."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

import gac_torch
from gac_torch.backends.cuda import ptxas
from gac_torch.kernels import conv_gemm_plan as cgp
from gac_torch.kernels import conv_gemm_twin as twin
from gac_torch.kernels.builder import round_to
from gac_torch.passes import space_to_depth
from models import randomize_bn
from test_conv_gemm import _TOL, nhwc_spec
from test_cuda_conv import _cudnn_tf32

DTYPES = {"tf32": torch.float32, "bf16": torch.bfloat16}


class Stem(torch.nn.Module):
    """conv 7x7/2 (3 -> 64) + BatchNorm + ReLU, max-pool, a 1x1 conv: the stem joined to a conv
    (so the pass takes it to NHWC)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64)
        self.pool, self.next = torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(64, 32, 1, bias=False)

    def forward(self, x):
        return self.next(self.pool(torch.relu(self.bn(self.conv(x)))))


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_padded_stem_twin_matches_float64(kind: str) -> None:
    # 4 channels (the 4th zero in the real graph; random here), 7x7 stride 2 through a padding
    # of 3, sizes no tile divides: the input's 4-channel vectors cp.async'd across the guards
    spec, shapes, strides = nhwc_spec(kind, 2, 4, 19, 23, 24, 7, 2, 1, 3)
    p = cgp.plan(spec)
    assert p is not None and p.a.glob_k and p.a.vec == 4 and p.a.cp, p.a
    rng = np.random.default_rng(7)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    out = twin.emulate(spec, p, X, W, np.zeros(shapes[2], np.float32), strides, init=0.25)
    x64 = torch.from_numpy(round_to(X, kind).astype(np.float64)).reshape(2, 19, 23, 4).permute(0, 3, 1, 2)
    w64 = torch.from_numpy(round_to(W, kind).astype(np.float64)).reshape(24, 7, 7, 4).permute(0, 3, 1, 2)
    ref = torch.nn.functional.conv2d(x64, w64, stride=2, padding=3).permute(0, 2, 3, 1).numpy() + 0.25
    err = np.linalg.norm(out.reshape(ref.shape) - ref) / np.linalg.norm(ref)
    assert err < _TOL[kind], err


def _stem_ptx(kind: str, strategy: str = "igemm") -> tuple[str, str]:
    """The PTX of the stem's conv kernel (the first `strategy` one) and ptxas's log of the program."""
    torch.manual_seed(0)
    model, x = randomize_bn(Stem()).eval().to(DTYPES[kind]), torch.randn(2, 3, 37, 53).to(DTYPES[kind])
    with _cudnn_tf32(True):  # (flags set through it: another test may have frozen them)
        ptx = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "cache": False}).ir("ptx")
    stem = next(k for k in ptx.split(".entry ")[1:] if k.split("(")[0].endswith("_" + strategy))
    return stem, ptxas.assemble(ptx, "sm_90a", ptxas.find_ptxas()).log


def _widths(ptx: str) -> set[str]:
    return set(re.findall(r"cp\.async\.c[ag]\.shared\.global[^\[]*\[[^\]]*\], \[[^\]]*\], (\d+)", ptx))


def _stem_copies(kind: str) -> tuple[set[str], str]:
    """The cp.async widths of the stem's igemm kernel (the first) and ptxas's log of the program."""
    stem, log = _stem_ptx(kind)
    return _widths(stem), log


def _no_spills(log: str) -> bool:
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return bool(spills) and not any(int(n) for n in spills)


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_wide_padded_stem_on_cwgmma_stores_pairs(kind: str, monkeypatch) -> None:
    # GAC_STEM_PAD_WIDE=1: a bf16 stem padded to 8 channels (one 16-byte vector per tap) is
    # cwgmma's; its fused BatchNorm + ReLU epilogue reads and writes 2 columns per access
    monkeypatch.setenv("GAC_STEM_PAD_WIDE", "1")
    stem, log = _stem_ptx(kind, "cwgmma")
    wide = "v2.b32" if kind == "tf32" else "v2.b16"
    stores = re.findall(r"st\.global\.(\S+)", stem)
    assert _widths(stem) == {"16"} and _no_spills(log), log
    assert stores and set(stores) == {wide}, stores
    assert re.findall(r"ld\.global\.nc\.v2", stem), stem  # BatchNorm's per-channel vectors
    monkeypatch.setenv("GAC_CONV_WGMMA_PAIRS", "0")
    assert set(re.findall(r"st\.global\.(\S+)", _stem_ptx(kind, "cwgmma")[0])) == {"b32" if kind == "tf32" else "b16"}


@pytest.mark.parametrize("kind,want,before", [("tf32", {"16"}, {"4"}), ("bf16", {"8"}, set())])
def test_stem_stages_vectors_without_spills(kind: str, want: set, before: set, monkeypatch) -> None:
    monkeypatch.setenv("GAC_CONV_WGMMA", "0")  # (igemm's copies; in tf32 the padded stem is cwgmma's)
    widths, log = _stem_copies(kind)
    assert widths == want and _no_spills(log), (widths, log)
    monkeypatch.setenv("GAC_STEM_PAD", "0")  # NCHW: 4-byte copies (tf32), scalar loads (bf16)
    assert _stem_copies(kind)[0] == before


def _launches(kind: str) -> list[tuple[str, list[str]]]:
    """(strategy, buffers with access) of each kernel of the Stem compiled for sm_90 offline."""
    torch.manual_seed(0)
    model, x = randomize_bn(Stem()).eval(), torch.randn(2, 3, 37, 53)
    with _cudnn_tf32(True), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
        gpu = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "cache": False}).ir("gpu")
    return [(s, a.split(", ")) for s, a in re.findall(r"// launch \S+ .*\[(\w+)\] \((.*)\)", gpu)]


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_stem_input_and_pool_are_one_kernel_each(kind: str, monkeypatch) -> None:
    # the input's channel pad, NHWC transpose (and bf16 cast) are one gather; the max-pool
    # reads the conv's result at clamped indices: no padded copy (a fill and a copy kernel)
    monkeypatch.setenv("GAC_COMBO", "0")  # the stem's own kernels, not merged into combo launches
    ks = _launches(kind)
    conv = next(i for i, (s, _) in enumerate(ks) if s in ("igemm", "cwgmma"))
    a = ks[conv][1][0].split(":")[0]
    prep = [acc for _, acc in ks if f"{a}:W" in acc]  # the kernel writing the conv's input
    assert len(prep) == 1 and len(prep[0]) == 2 and prep[0][0].startswith("arg"), ks
    assert sum(acc[0] == prep[0][0] for _, acc in ks) == 1, ks  # the only one reading x
    out = ks[conv][1][-1].split(":")[0]
    pool = ks[conv + 1][1]
    assert ks[conv + 1][0] == "loops" and pool[0] == f"{out}:r" and pool[1].endswith(":W"), ks
    pooled = pool[1].split(":")[0]  # read by the next conv, directly or through a TMA box
    assert [s for s, acc in ks if re.match(rf"(tma\()?{pooled}\b.*:r$", acc[0])] == ["cwgmma"], ks
    monkeypatch.setenv("GAC_STEM_PAD_GATHER", "0")
    monkeypatch.setenv("GAC_POOL_CLAMP", "0")
    assert len(_launches(kind)) == len(ks) + 4 + (kind == "bf16"), ks


OLD = "GAC_STEM_S2D=0,GAC_STEM_PAD_GATHER=0,GAC_POOL_CLAMP=0,GAC_CONV_WGMMA_PAIRS=0"  # (the stem before them)


@pytest.mark.cuda
@pytest.mark.parametrize("kind,switches", [("tf32", ""), ("tf32", OLD), ("bf16", ""),
                                           ("bf16", "GAC_STEM_S2D=0,GAC_STEM_PAD_WIDE=1"), ("bf16", OLD)])
@pytest.mark.parametrize("shape", [(2, 3, 37, 53), (3, 3, 96, 130)])  # (odd: the padded stem; even: s2d)
def test_stem_matches_float64_on_gpu(kind: str, shape: tuple[int, ...], switches: str, monkeypatch) -> None:
    for kv in filter(None, switches.split(",")):
        monkeypatch.setenv(*kv.split("="))
    torch._dynamo.reset()  # (else dynamo may run another case's graph: the switches are compile-time)
    torch.manual_seed(sum(shape))
    model, x = randomize_bn(Stem()).eval(), torch.randn(shape)
    ref = model.double()(x.double())
    model, x = model.to("cuda", DTYPES[kind]), x.to("cuda", DTYPES[kind])
    with _cudnn_tf32(True):
        got = torch.compile(model, backend="gac")(x)
    err = ((got.double().cpu() - ref).norm() / ref.norm()).item()
    assert got.dtype == x.dtype and got.shape == ref.shape and err < {"tf32": 3e-3, "bf16": 2e-2}[kind], err


@pytest.mark.parametrize("autocast", [False, True])
def test_gathered_input_pad_matches_float64_on_cpu(autocast: bool) -> None:
    # the cpu target on NHWC (option channels_last): the input's padded channel is a masked
    # replicate pad, and under bf16 autocast the input's cast comes after it (one kernel on cuda)
    torch.manual_seed(3)
    model, x = randomize_bn(Stem()).eval(), torch.randn(2, 3, 29, 35)
    ref = copy.deepcopy(model).double()(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        f = gac_torch.compile(model, (x,), target="cpu", options={"channels_last": True, "fallback": False})
        got = f(x)
    gac = f.ir("gac")
    assert re.search(r'"gac.pad".*mode = "replicate".*\n.*\n.*"gac.select"', gac), gac
    assert bool(re.search(r'"gac.select".*\n.*"gac.cast".*bf16', gac)) == autocast, gac
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if autocast else 1e-5), err


class Strided(torch.nn.Module):
    """A stride-2 conv of few channels (+ BatchNorm, ReLU) joined to a 1x1 conv."""

    def __init__(self, c: int, k: int, p: int) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(c, 24, k, 2, p, bias=False), torch.nn.BatchNorm2d(24)
        self.next = torch.nn.Conv2d(24, 8, 1, bias=False)

    def forward(self, x):
        return self.next(torch.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize("c,k,p,shape,autocast", [
    (3, 7, 3, (2, 28, 34), False), (3, 7, 3, (1, 30, 32), True), (3, 3, 1, (2, 10, 12), False),
    (1, 5, 2, (1, 12, 10), False), (2, 4, 1, (1, 14, 8), True), (3, 7, 0, (1, 18, 20), False),
    (3, 6, 3, (1, 16, 14), False)])
def test_space_to_depth_stem_matches_float64_on_cpu(c, k, p, shape, autocast) -> None:
    # passes/space_to_depth.py on the cpu target (option channels_last): odd and even kernels,
    # odd paddings (q = 1), no padding, blocks past the input (a zero border), bf16 autocast
    torch.manual_seed(k + p)
    model, x = randomize_bn(Strided(c, k, p)).eval(), torch.randn(shape[0], c, *shape[1:])
    ref = copy.deepcopy(model).double()(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        f = gac_torch.compile(model, (x,), target="cpu", options={"channels_last": True, "fallback": False})
        got = f(x)
    a = space_to_depth._dim(k, p, 0, 0)[1]
    conv = next(ln for ln in f.ir("gac").splitlines() if '"gac.conv"' in ln)
    assert f"x{a}x{a}x" in conv and "stride = array<i64: 1, 1>" in conv, conv  # the A x A stride-1 conv
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if autocast else 1e-5), err


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_space_to_depth_stem_is_cwgmma_without_spills(kind: str, monkeypatch) -> None:
    # even sizes: X is one gather kernel, its conv cwgmma's (bf16 too: 16 channels, 32 bytes per
    # pixel), the weights relaid so the channels are both operands' unit-stride K run
    monkeypatch.setenv("GAC_COMBO", "0")  # the stem's own kernels, not merged into combo launches
    torch.manual_seed(0)
    model, x = randomize_bn(Stem()).eval(), torch.randn(2, 3, 38, 54)
    with _cudnn_tf32(True), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
        f = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "cache": False})
    ks = [(s, a.split(", ")) for s, a in re.findall(r"// launch \S+ .*\[(\w+)\] \((.*)\)", f.ir("gpu"))]
    conv = next(i for i, (s, _) in enumerate(ks) if s in ("igemm", "cwgmma"))
    assert ks[conv][0] == "cwgmma", ks
    a = ks[conv][1][0].split(":")[0]
    prep = [acc for _, acc in ks if f"{a}:W" in acc]
    assert len(prep) == 1 and len(prep[0]) == 2 and prep[0][0].startswith("arg"), ks
    ptx = f.ir("ptx")
    stem = next(k for k in ptx.split(".entry ")[1:] if k.split("(")[0].endswith("_cwgmma"))
    assert _widths(stem) == {"16"} and _no_spills(ptxas.assemble(ptx, "sm_90a", ptxas.find_ptxas()).log)
    assert set(re.findall(r"st\.global\.(\S+)", stem)) == {"v2.b32" if kind == "tf32" else "v2.b16"}  # pairs
    assert "x4x4x" in next(ln for ln in f.ir("gac").splitlines() if '"gac.conv"' in ln)
    monkeypatch.setenv("GAC_STEM_S2D", "0")  # the padded 7x7 conv
    with _cudnn_tf32(True), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
        gac = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "cache": False}).ir("gac")
    assert "x7x7x" in next(ln for ln in gac.splitlines() if '"gac.conv"' in ln)


def test_a_4x4_conv_on_nhwc_is_cwgmmas() -> None:
    # a patchify-style 4x4 conv (16 channels): its innermost K dim was kw (extent 4, a multiple
    # of a tf32 vector) with a stride of 16 in the NHWC input, so cwgmma refused it and igemm
    # took it; the channels (A's unit-stride run) go innermost now, the weights relaid
    # (after a conv: its input an NHWC intermediate, not the graph's NCHW input read in place)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 32, 4, 4, bias=False), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 16, 3, padding=1, bias=False)).eval()
    with _cudnn_tf32(True):
        gpu = gac_torch.compile(model, (torch.randn(1, 8, 32, 48),), target="cuda",
                                options={"arch": "sm_90", "cache": False}).ir("gpu")
    assert re.findall(r"// launch \S+ .*\[(igemm|cwgmma)\]", gpu) == ["cwgmma"] * 3, gpu

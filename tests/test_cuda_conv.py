"""Convolutions on the cuda target's implicit-GEMM kernels (backends/gpu/strategies/implicit_gemm.py,
kernels/conv_gemm.py). CPU (CI): each conv of odd shape compiles for sm_90 to the `sgemm`
(exact f32) or `igemm` (tensor cores) kernel, which ptxas accepts without spills; changing
cuDNN's TF32 flag under torch.compile recompiles. GPU (-m cuda): parity with a float64
reference at the precision's tolerance, for f32 exact, tf32, f16 and bf16."""

from __future__ import annotations

import re
from contextlib import contextmanager

import pytest
import torch
from torch.backends import __allow_nonbracketed_mutation as _mutable

import gac_torch
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas

# in_ch, out_ch, kernel, stride, padding, dilation, groups, H, W
CONVS = {
    "stem7x7s2": (3, 16, 7, 2, 3, 1, 1, 37, 41),
    "3x3": (16, 24, 3, 1, 1, 1, 1, 19, 23),
    "1x1": (24, 40, 1, 1, 0, 1, 1, 13, 17),
    "3x3s2": (32, 36, 3, 2, 1, 1, 1, 15, 16),
    "dilated": (16, 16, 3, 1, 2, 2, 1, 14, 15),
    "grouped": (16, 32, 3, 1, 1, 1, 4, 12, 13),
    "depthwise": (32, 32, 3, 1, 1, 1, 32, 12, 11),
    "1x1_wide": (64, 136, 1, 1, 0, 1, 1, 20, 20),
}
# precision -> (dtype, cuDNN TF32 flag, relative-norm tolerance vs float64; METHOD.md's bands)
PRECISIONS = {"f32": (torch.float32, False, 1e-5), "tf32": (torch.float32, True, 3e-3),
              "f16": (torch.float16, False, 2e-3), "bf16": (torch.bfloat16, False, 1e-2)}


def _set_tf32(on: bool) -> None:
    # torch's own escape hatch: once torch.testing's common_utils is imported (the OpInfo tests,
    # in the same xdist worker), plain assignments to cudnn flags raise
    with _mutable():
        torch.backends.cudnn.allow_tf32 = on


@contextmanager
def _cudnn_tf32(on: bool):
    saved = torch.backends.cudnn.allow_tf32
    _set_tf32(on)
    try:
        yield
    finally:
        _set_tf32(saved)


def _model(name: str, dtype: torch.dtype, device: str = "cpu"):
    cin, cout, k, s, p, d, g, h, w = CONVS[name]
    gen = torch.Generator().manual_seed(sum(CONVS[name]))
    conv = torch.nn.Conv2d(cin, cout, k, stride=s, padding=p, dilation=d, groups=g, bias=True)
    with torch.no_grad():
        for t in conv.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
    model = torch.nn.Sequential(conv, torch.nn.ReLU()).to(device=device, dtype=dtype).eval()
    x = torch.randn(2, cin, h, w, generator=gen).to(device=device, dtype=dtype)
    return model, x


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_compiles_to_implicit_gemm_without_spills(name: str, precision: str) -> None:
    dtype, tf32, _ = PRECISIONS[precision]
    model, x = _model(name, dtype)
    with _cudnn_tf32(tf32):
        compiled = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90"})
    (part,) = compiled.compiled.partitions.values()
    kernels = set(re.findall(r"gac_k\d+_(\w+)", part.ir("gpu")))
    if name == "depthwise":  # one output channel per group: under an mma tile, left to reduce
        assert not kernels & {"sgemm", "igemm"}, kernels
        return
    assert ("sgemm" if precision == "f32" else "igemm") in kernels, kernels
    ptx = part.ir("ptx")
    mma = {"f32": None, "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
           "f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
           "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}[precision]
    assert (mma in ptx) if mma else ("mma.sync" not in ptx and "fma.rn.f32" in ptx)
    if find_ptxas() is None:
        pytest.fail("ptxas missing: the dev extra installs nvidia-cuda-nvcc-cu12")
    result = assemble(ptx, "sm_90")
    assert result.ok, result.log
    spills = re.findall(r"(\d+) bytes spill stores", result.log)
    assert "gemm" in result.log and spills and all(int(m) == 0 for m in spills), result.log


class _Block(torch.nn.Module):
    """conv -> BatchNorm (eval) -> + residual -> ReLU, the ResNet bottleneck's tail."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


@pytest.mark.parametrize("name,dtype", [("3x3", torch.float32), ("block", torch.float32),
                                        ("block", torch.bfloat16)])
def test_padding_and_epilogue_run_inside_the_conv_kernel(name: str, dtype: torch.dtype) -> None:
    # zero padding read through bounds checks; bias / BatchNorm / residual / ReLU (bf16: after
    # the rounding to bf16 and back, across a reshape) in the store step: the whole graph is one
    # kernel writing the output
    if name == "block":
        from models import randomize_bn

        model, x = randomize_bn(_Block()).eval().to(dtype), torch.randn(2, 8, 9, 11).to(dtype)
    else:
        model, x = _model(name, dtype)
    compiled = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90"})
    (part,) = compiled.compiled.partitions.values()
    kernels = re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu"))
    assert kernels == ["sgemm" if dtype == torch.float32 else "igemm"], kernels
    assert "alloc" not in part.ir("gpu").split("gpu.module")[0]  # no intermediate buffers
    if dtype == torch.float32:
        torch.testing.assert_close(gac_torch.compile(model, (x,), target="cpu")(x), model(x))


def test_cudnn_tf32_flag_is_read_at_compile_time_and_guarded() -> None:
    # dynamo guards the matmul TF32 flag but not cuDNN's: gac's compiled graph checks it per call
    from gac_torch.frontends.dynamo import compiled_graphs

    model, x = _model("3x3", torch.float32)
    with _cudnn_tf32(False):
        fn = torch.compile(model, backend="gac", options={"target": "cpu"})
        before = len(compiled_graphs)
        ref = fn(x)
        once = len(compiled_graphs)
        fn(x)
        assert len(compiled_graphs) == once > before
        _set_tf32(True)
        torch.testing.assert_close(fn(x), ref)
        assert len(compiled_graphs) == once + 1
        _set_tf32(False)
        fn(x)
        assert len(compiled_graphs) == once + 1  # the first compilation is kept


@pytest.mark.cuda
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_matches_float64_on_gpu(name: str, precision: str) -> None:
    dtype, tf32, tol = PRECISIONS[precision]
    model, x = _model(name, dtype, "cuda")
    with _cudnn_tf32(tf32):
        compiled = gac_torch.compile(model, (x,), target="cuda")
    for seed in (0, 1):  # fresh inputs per check, outputs poisoned by the runtime's fresh allocs
        x = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
        got = compiled(x)
        ref = torch.nn.functional.relu(torch.nn.functional.conv2d(
            x.double(), model[0].weight.double(), model[0].bias.double(), model[0].stride,
            model[0].padding, model[0].dilation, model[0].groups))
        assert torch.isfinite(got).all()
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (name, precision, err)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fused_block_matches_float64_on_gpu(precision: str) -> None:
    # conv (padding fused) -> BatchNorm -> + residual -> ReLU in one kernel (epilogue chain)
    from models import randomize_bn

    torch.manual_seed(0)
    _assert_matches_float64_on_gpu(randomize_bn(_Block()).eval(), torch.randn(3, 8, 17, 19), precision, 2)


def _assert_matches_float64_on_gpu(model: torch.nn.Module, x: torch.Tensor, precision: str, slack: float) -> None:
    """gac's output within `slack` x the precision's tolerance of the float64 model's (BN etc.
    round too)."""
    dtype, tf32, tol = PRECISIONS[precision]
    ref = model.double()(x.double())
    model, x = model.to("cuda", dtype), x.to("cuda", dtype)
    with _cudnn_tf32(tf32):
        compiled = gac_torch.compile(model, (x,), target="cuda")
    got = compiled(x).double().cpu()
    err = ((got - ref).norm() / ref.norm()).item()
    assert torch.isfinite(got).all() and err < tol * slack, (precision, err)


def test_implicit_gemm_env_switch_leaves_convs_to_loops(monkeypatch) -> None:
    # GAC_IMPLICIT_GEMM=0 bisects: the strategies igemm / sgemm then match nothing
    from cuda_cases import CASES, compile_case

    case = CASES["conv2d_nchw_stride2"]
    assert {k.strategy for k in compile_case(case, "sm_90").launches} == {"sgemm"}
    monkeypatch.setenv("GAC_IMPLICIT_GEMM", "0")
    assert {k.strategy for k in compile_case(case, "sm_90").launches} == {"loops"}


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_resnet_stage3_conv_stages_by_cp_async_without_spills(precision: str) -> None:
    # a ResNet-50 layer-3 3x3 conv (+ BatchNorm + ReLU) at its real shape: its [f, c, kh, kw]
    # weights are first copied to [f, kh, kw, c] (a `loops` kernel), the contraction's K order,
    # and then staged in 16-byte cp.async vectors (cp.async.cg); tf32 stages the input by
    # 4-byte cp.async too (.ca: 4 buffers, 2 blocks per SM, 128 registers); bf16's scalar NCHW
    # gathers stay in registers (1 block per SM); neither spills
    dtype, tf32, _ = PRECISIONS[precision]
    model = torch.nn.Sequential(torch.nn.Conv2d(256, 256, 3, padding=1, bias=False), torch.nn.BatchNorm2d(256),
                                torch.nn.ReLU()).eval().to(dtype)
    x = torch.randn(6, 256, 30, 50).to(dtype)
    with _cudnn_tf32(tf32):
        compiled = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90"})
    (part,) = compiled.compiled.partitions.values()
    kernels = re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu"))
    assert kernels == ["loops", "igemm"], kernels
    ptx = part.ir("ptx")
    assert ("cp.async.ca.shared.global" in ptx) == (precision == "tf32")
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    # 4 stages of 128 x 128 x 16 (tf32) / 32 (bf16) tiles in dynamic shared memory (the launch
    # opts in)
    dyn = re.search(r"dynamic_shared_memory_size %c(\d+)_i32", part.ir("gpu"))
    assert dyn is not None and 48 * 1024 < int(dyn[1]) <= 80 * 1024
    result = assemble(ptx, "sm_90")
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", result.log)]
    spills = re.findall(r"(\d+) bytes spill stores", result.log)
    assert result.ok and spills and all(int(m) == 0 for m in spills), result.log
    if precision == "tf32":
        assert max(regs) <= 128, result.log
    # the epilogue loads BatchNorm's 4 per-channel parameters once per accumulator column (8 of
    # a thread's 64), not once per accumulator
    (conv,) = [k for k in ptx.split(".entry") if "mma.sync" in k]
    loads = re.findall(r"ld\.global", conv[conv.rindex("mma.sync"):])
    assert 0 < len(loads) <= 8 * 4, len(loads)


class _Bottleneck(torch.nn.Module):
    """max-pool -> ResNet bottleneck with a downsample branch: the memory plan hands the block
    input's buffer (dead after the two 1x1 convs read it) to the first BatchNorm's output."""

    def __init__(self, c: int = 16, mid: int = 8) -> None:
        super().__init__()
        self.pool = torch.nn.MaxPool2d(3, 2, 1)
        self.down = torch.nn.Sequential(torch.nn.Conv2d(c, 2 * c, 1, bias=False), torch.nn.BatchNorm2d(2 * c))
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(c, mid, 1, bias=False), torch.nn.BatchNorm2d(mid), torch.nn.ReLU(),
            torch.nn.Conv2d(mid, mid, 3, padding=1, bias=False), torch.nn.BatchNorm2d(mid), torch.nn.ReLU(),
            torch.nn.Conv2d(mid, 2 * c, 1, bias=False), torch.nn.BatchNorm2d(2 * c))

    def forward(self, x):
        x = self.pool(x)
        return torch.relu(self.body(x) + self.down(x))


@pytest.mark.parametrize("channels_last", [False, True])
def test_batchnorm_into_a_reused_input_buffer_is_fused_through_a_fresh_one(channels_last: bool) -> None:
    # the first BatchNorm + ReLU writes the block input's buffer, which the conv producing its
    # input reads: the fused kernel writes a fresh allocation instead, and the buffer's views
    # made before (the next convs' reshaped input) are rebuilt on it. Before: a `loops` kernel
    # per such BatchNorm. On NHWC (cuda's default) too; the last conv's epilogue writes NCHW
    from models import randomize_bn

    model, x = randomize_bn(_Bottleneck()).eval(), torch.randn(2, 16, 13, 17)
    compiled = gac_torch.compile(model, (x,), target="cuda", options={"arch": "sm_90", "channels_last": channels_last})
    (part,) = compiled.compiled.partitions.values()
    kernels = re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu"))
    convs = [k for k in kernels if k in ("sgemm", "igemm")]  # (exact or TF32: torch's flag)
    # the pool (one kernel: it reads clamped indices, no padded copy); on NHWC its result's
    # transpose (read by two convs)
    assert len(convs) == 4 and kernels.count("loops") == 1 + channels_last, kernels
    assert ("channels_last = 1" in part.ir("gac")) == channels_last


@pytest.mark.cuda
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_bottleneck_matches_float64_on_gpu(precision: str) -> None:
    from models import randomize_bn

    # (128 channels at 130 x 130: the 1x1 convs take 128 x 128 tiles, 4 cp.async buffers in
    # dynamic shared memory where staged so; 4 convs and BNs deep)
    torch.manual_seed(1)
    _assert_matches_float64_on_gpu(randomize_bn(_Bottleneck(128, 64)).eval(), torch.randn(2, 128, 130, 130),
                                   precision, 4)

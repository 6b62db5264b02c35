"""Vortex schedule strategies (issue 17): parity vs eager and the warp-instruction gain over the
plain `loops` kernels, on the functional simulator (CI) and, marked `simx`, on SimX:

- convolutions and batched matmuls through the tiled local-memory GEMM (implicit GEMM: K over
  (c, kh, kw)), where the cost table (backend.GEMM_COSTS) says it pays;
- grid-stride coarsening of elementwise `loops` kernels (backend.LOOPS_COARSEN points per
  thread once they still fill the device's threads);
- a warp per output for row reductions with few outputs (vx_shfl_bfly).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ziglang")
pytest.importorskip("elftools")

import test_vortex_target
from parity import Fn

import gac_torch
from gac_torch.backends import vortex
from gac_torch.backends.vortex import backend

mode = test_vortex_target.mode   # the fixture: functional, and simx-marked


def run(module, inputs, mode, **flags):
    """Compile (no program cache: the switches below are not in its key), run, compare with
    eager; returns (kernel names, counters)."""
    with torch.no_grad(), vortex.compile_flags(**flags):
        compiled = gac_torch.compile(module, tuple(inputs), target="vortex",
                                     options={"vortex_mode": mode, "cache": False})
        got, want = compiled(*inputs), module(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    c = vortex.last_counters(compiled)
    if mode == "functional":
        assert c["divergent_branches"] == 0
    return [k["kernel"] for k in c["kernels"]], c


def g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def conv(cin, cout, k, stride=1, padding=0, groups=1, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Conv2d(cin, cout, k, stride=stride, padding=padding, groups=groups, bias=False).eval()


def test_conv1x1_tiled_gemm_parity_and_gain(mode):
    m, x = conv(8, 16, 1), g(2, 8, 6, 10)
    tiled, ct = run(m, [x], mode)
    plain, cp = run(m, [x], mode, tiled_gemm=False)
    assert tiled[0].endswith("_gemm") and plain[0].endswith("_loops")   # then the same copy-out
    gemm, loops = ct["kernels"][0]["instructions"], cp["kernels"][0]["instructions"]
    assert gemm * 2 < loops, (gemm, loops)


@pytest.mark.parametrize("cin,cout,k,stride,padding,shape", [
    (3, 5, 3, 2, 1, (1, 3, 9, 11)),      # strided, padded, K = 27 overhangs a 16-deep stage
    (4, 6, (2, 3), 1, 0, (2, 4, 5, 7)),  # rectangular kernel, batch of 2
])
def test_conv_implicit_gemm_template_parity(cin, cout, k, stride, padding, shape, mode, monkeypatch):
    """The template on convolutions the cost table would leave to `loops` (forced here):
    linear subscripts (oh * stride + kh) and K over (c, kh, kw)."""
    monkeypatch.setattr(backend, "GEMM_COSTS", dict(backend.GEMM_COSTS, loops_mac=1e9))
    kernels, _ = run(conv(cin, cout, k, stride, padding), [g(*shape)], mode)
    assert any(n.endswith("_gemm") for n in kernels)


def test_cost_table_choice(mode):
    """3x3, 4 -> 4 channels: staging im2col tiles would cost more than they save (few rows
    reuse each staged element), direct register tiles (no local memory) beat `loops`; a 1 x 8
    by 8 x 8 product stays a `loops` kernel (the tiles would be mostly overhang)."""
    m, x = conv(4, 4, 3, padding=1), g(1, 4, 8, 8)
    kernels, c = run(m, [x], mode)
    plain, cp = run(m, [x], mode, tiled_gemm=False)
    i = next(n for n, k in enumerate(kernels) if k.endswith("_gemm"))
    assert c["kernels"][i]["lmem"] == 0, c["kernels"][i]
    assert c["kernels"][i]["instructions"] * 3 < cp["kernels"][i]["instructions"] * 2
    kernels, _ = run(Fn(lambda a, b: a @ b), [g(1, 8), g(8, 8, seed=1)], mode)
    assert kernels == ["gac_k0_loops"], kernels


class ConvBnBlock(torch.nn.Module):
    """relu(bn1(conv3x3(x)) + bn2(conv1x1(x))): a ResNet block's tail with its downsample branch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.b1 = torch.nn.Conv2d(4, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.c2, self.b2 = torch.nn.Conv2d(4, 8, 1, bias=False), torch.nn.BatchNorm2d(8)
        for bn in (self.b1, self.b2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.data.uniform_(0.5, 2)
            bn.bias.data.uniform_(-1, 1)
        self.eval()

    def forward(self, x):
        return torch.relu(self.b1(self.c1(x)) + self.b2(self.c2(x)))


def test_gemm_epilogue_fuses_batchnorm_and_residual(mode):
    """BatchNorm-eval (both branches), the add and the ReLU run in the 1x1 conv's store step:
    one launch and its intermediate fewer, fewer warp instructions."""
    x = g(2, 4, 9, 11)
    fused, cf = run(ConvBnBlock(), [x], mode, gemm_padding=False)
    plain, cp = run(ConvBnBlock(), [x], mode, gemm_padding=False, gemm_epilogue=False)
    assert plain[-1].endswith("_loops") and fused[-1].endswith("_gemm"), (fused, plain)
    assert len(fused) == len(plain) - 1
    assert cf["instructions"] < cp["instructions"], (cf["instructions"], cp["instructions"])


def test_gemm_fused_padding(mode):
    """The 3x3 conv reads x through guarded loads: no fill and copy kernels before it."""
    kernels, _ = run(ConvBnBlock(), [g(2, 4, 9, 11)], mode, gemm_padding=True)
    assert all(k.endswith("_gemm") for k in kernels), kernels


class BasicBlock(torch.nn.Module):
    """conv-bn-relu, then a ResNet basic block on its output (padded 3x3 convs whose epilogues
    add the block's input)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.c0, self.c1, self.c2 = (torch.nn.Conv2d(4, 4, k, padding=k // 2, bias=False) for k in (1, 3, 3))
        self.b0, self.b1, self.b2 = (torch.nn.BatchNorm2d(4) for _ in range(3))
        self.eval()

    def forward(self, x):
        y = torch.relu(self.b0(self.c0(x)))
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(y))))) + y)


def test_gemm_fused_padding_in_residual_block(mode):
    """Fused padding and epilogues together (off by default: tiled_gemm.strategy says why).
    BEVFormer's backbone (benchmarks/vortex_bevformer_parts.py) once failed here when the
    epilogue's output was checked against the padded copy instead of its source."""
    kernels, _ = run(BasicBlock(), [g(1, 4, 12, 10)], mode, gemm_padding=True)
    assert all(k.endswith("_gemm") for k in kernels), kernels


def test_padding_fill_and_copy_gain(mode, monkeypatch):
    """max_pool2d's -inf padding: a flat fill and a row copy instead of two `loops` kernels
    (no index decomposition per element). (GAC_POOL_CLAMP=0: the padded pool; by default it
    reads clamped indices, no padding at all.)"""
    monkeypatch.setenv("GAC_POOL_CLAMP", "0")
    fn = Fn(lambda a: torch.nn.functional.max_pool2d(a, 3, 2, 1))
    x = g(2, 4, 30, 34)
    flat, cf = run(fn, [x], mode)
    plain, cp = run(fn, [x], mode, flat_fill=False)
    assert flat[:2] == ["gac_k0_fill", "gac_k1_copy"] and plain[0].endswith("_loops"), (flat, plain)
    for k in (0, 1):
        assert cf["kernels"][k]["instructions"] * 2 < cp["kernels"][k]["instructions"], (k, cf["kernels"][k], cp["kernels"][k])
    short, _ = run(fn, [g(2, 4, 6, 10)], mode)   # rows of 10 < a CTA's 16 threads: `loops` copy
    assert short[:2] == ["gac_k0_fill", "gac_k1_loops"], short


def test_batched_matmul_tiled_gemm_gain(mode):
    """q @ k^T over (batch, heads): batch dims in the grid, B transposed in memory."""
    q, k = g(2, 3, 16, 8, seed=1), g(2, 3, 16, 8, seed=2)
    fn = Fn(lambda a, b: a @ b.transpose(-1, -2))
    tiled, ct = run(fn, [q, k], mode)
    plain, cp = run(fn, [q, k], mode, tiled_gemm=False)
    assert any(n.endswith("_gemm") for n in tiled)
    assert ct["instructions"] < cp["instructions"], (ct["instructions"], cp["instructions"])


def test_elementwise_coarsening_gain(mode, monkeypatch):
    a, b = g(64, 96, seed=3), g(64, 96, seed=4)
    fn = Fn(lambda x, y: torch.relu(x) * y + 1)
    _, coarse = run(fn, [a, b], mode)
    monkeypatch.setattr(backend, "LOOPS_COARSEN", 1)
    _, fine = run(fn, [a, b], mode)
    assert coarse["kernels"][0]["ctas"] * 8 <= fine["kernels"][0]["ctas"] if mode == "functional" else True
    assert coarse["instructions"] * 3 < fine["instructions"] * 2, (coarse["instructions"], fine["instructions"])


@pytest.mark.parametrize("config,grid", [(None, 6), ("4x8x8", 24)])
def test_coarsening_threshold_follows_the_device(config, grid):
    """Coarsened once 16 points per hardware thread remain: 1536 points on 1x4x4 (16 threads)
    -> 6 CTAs of 16 threads (was a thread per point below 4096 points: 96 CTAs); on 4x8x8 (256
    threads) the same space keeps a thread per point (24 CTAs of 64)."""
    a, b = g(48, 32, seed=3), g(48, 32, seed=4)
    fn = Fn(lambda x, y: torch.relu(x) * y + 1)
    compiled = gac_torch.compile(fn, (a, b), target="vortex", options={
        "vortex_mode": "functional", "vortex_config": config, "cache": False})
    assert f"known_grid_size = array<i32: {grid}, 1, 1>" in compiled.ir("gpu")
    torch.testing.assert_close(compiled(a, b), fn(a, b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,fn,x", [
    ("sum_rows", lambda a: a.sum(-1), lambda: g(3, 203)),            # rows not a multiple of 4 lanes
    ("amax", lambda a: a.amax(-1), lambda: g(2, 64)),
    ("mean_all", lambda a: a.mean(), lambda: g(16, 37)),
])
def test_warp_reduction_parity(name, fn, x, mode):
    """A warp per output, combined with vx_shfl_bfly (4-lane butterfly); on SimX fewer cycles
    than a thread per output."""
    inputs = [x()]
    kernels, c = run(Fn(fn), inputs, mode)
    assert any(k.endswith("_reduce") for k in kernels), kernels
    plain, cp = run(Fn(fn), inputs, mode, warp_reduce=False)
    assert not any(k.endswith("_reduce") for k in plain)
    if mode == "simx":
        assert c["cycles"] < cp["cycles"], (c["cycles"], cp["cycles"])


def test_column_reduction_stays_a_thread_per_output(mode):
    """Reduced dim outermost: a warp's lanes would read strided elements (SimX: 0.64x)."""
    kernels, _ = run(Fn(lambda a: a.sum(0)), [g(101, 3)], mode)
    assert not any(k.endswith("_reduce") for k in kernels), kernels


def test_multicore_configuration_functional(monkeypatch):
    """vortex_config "4x8x8": CTAs of 8 warps x 8 threads, 8-lane shuffles, the functional
    simulator with 4 cores; the same model as on 1x4x4, same results, no divergent branch."""
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)).eval()
    x = g(2, 3, 6, 6)
    counts = {}
    for cfg in ("1x4x4", "4x8x8"):
        with torch.no_grad(), vortex.compile_flags(warp_reduce=True):
            compiled = gac_torch.compile(model, (x,), target="vortex",
                                         options={"vortex_mode": "functional", "vortex_config": cfg, "cache": False})
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        part = next(iter(compiled.compiled.partitions.values())).executable
        assert part.device.config.cores == int(cfg[0])
        threads = {k.block[0] for k in part.program.launches}
        assert max(threads) == (64 if cfg == "4x8x8" else 16), threads
        counts[cfg] = vortex.last_counters(compiled)
        assert counts[cfg]["divergent_branches"] == 0


def test_vortex_config_option_is_checked():
    with pytest.raises(gac_torch.errors.OptionError, match="vortex_config"):
        gac_torch.compile(Fn(lambda a: a + 1), (g(3),), target="vortex", options={"vortex_config": "4x8"})

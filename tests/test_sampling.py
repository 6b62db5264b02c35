"""grid_sampler_2d on the GPU schedule (issue 15, sampling): one kernel that writes the output
in place, with the sample position computed once per point and a loop over channels inside the
thread (backends/gpu/invariant.py). Compile-side checks for cuda (no GPU: PTX + ptxas), the
same schedule run on the vortex functional simulator against a float64 reference, and the
cuda parity at the benchmark's sampling pattern (marked cuda)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gac_torch
from gac_torch.backends.cuda import ptxas
from parity import Fn
from test_ops import r


def _sample(mode: str = "bilinear", padding: str = "zeros", align: bool = False):
    return lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)


def _header(compiled) -> str:
    return compiled.ir("ptx").split("\n.version")[0]


def test_grid_sample_is_one_cuda_kernel_looping_over_channels():
    """The benchmark's pattern (fewer points): one `loops` kernel writing the output directly
    (no intermediate, no copy kernel), one thread per (n, point) and a loop over channels, so
    the sample position is computed once per point, not once per channel."""
    x, g = r(2, 8, 5, 7), r(2, 300, 128, 2, lo=-1.1, hi=1.1)  # 76800 points >= serial_min_threads
    compiled = gac_torch.compile(Fn(_sample()), (x, g), target="cuda",
                                 options={"arch": "sm_90", "fallback": False})
    head = _header(compiled)
    launches = [ln for ln in head.splitlines() if ln.startswith("// launch")]
    assert len(launches) == 1 and "[loops]" in launches[0], head
    assert "workspace 0 B" in head, head  # was an 8x... intermediate + a copy kernel
    assert "grid=(300, 1, 1) block=(256, 1, 1)" in launches[0], head  # 2*300*128 threads
    gpu = compiled.ir("gpu")
    assert gpu.count("scf.for") >= 1 and "step %c4" in gpu, "expected the 4x unrolled channel loop"
    result = ptxas.assemble(compiled.ir("ptx"), "sm_90")
    assert result.ok and " 0 bytes spill stores" in result.log, result.log


def test_invariant_dim_needs_enough_invariant_work():
    """A broadcast add (one invariant load) keeps one thread per point: the loop is for bodies
    where the work along the dim is mostly invariant."""
    a, b = r(2, 8, 40000), r(2, 1, 40000)
    compiled = gac_torch.compile(Fn(lambda a, b: a + b), (a, b), target="cuda",
                                 options={"arch": "sm_90", "fallback": False})
    assert "grid=(2500, 1, 1)" in _header(compiled)  # a thread per point (313 with the loop)
    assert "scf.for" not in compiled.ir("gpu")


CASES = [(m, p, a) for m in ("bilinear", "nearest") for p in ("zeros", "border", "reflection")
         for a in (False, True)]


@pytest.mark.parametrize("target", ["cpu", "vortex"])
@pytest.mark.parametrize("mode,padding,align", CASES)
def test_grid_sample_odd_shapes_vs_float64(mode, padding, align, target, monkeypatch):
    """Odd shapes (6 channels, 5x7 image, 3x5 points, a corner and far points) against float64
    eager. On vortex (the same GPU schedule layer as cuda, functional simulator) the channel
    loop is on (a few threads fill its cores; 6 channels: unrolled by 3)."""
    if target == "vortex":
        pytest.importorskip("ziglang")
        pytest.importorskip("elftools")
        monkeypatch.delenv("VORTEX_HOME", raising=False)
    x, g = r(2, 6, 5, 7), r(2, 3, 5, 2, lo=-1.3, hi=1.3)
    g[1, 2, 3], g[0, 1, 1] = torch.tensor([1.0, -1.0]), torch.tensor([7.0, -3.0])  # corner, far
    fn = _sample(mode, padding, align)
    compiled = gac_torch.compile(Fn(fn), (x, g), target=target, options={"fallback": False})
    if target == "vortex":
        gpu = compiled.ir("gpu")
        assert "scf.for" in gpu and "step %c3" in gpu, "the channel loop was not used"
    want = fn(x.double(), g.double()).float()
    torch.testing.assert_close(compiled(x, g), want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("align", [False, True])
def test_msda_pattern_cuda(align):
    """The benchmark's sampling pattern (smaller), channel loop on: cuda vs float64 eager."""
    x, g = r(2, 32, 15, 25).cuda(), r(2, 300, 128, 2, lo=-1.1, hi=1.1).cuda()
    fn = _sample(align=align)
    compiled = gac_torch.compile(Fn(fn), (x, g), target="cuda", options={"fallback": False})
    assert "workspace 0 B" in _header(compiled)
    want = fn(x.double(), g.double()).float()
    torch.testing.assert_close(compiled(x, g), want, rtol=1e-5, atol=1e-5)


# --- multi-scale deformable attention: per-level sampling, weighting and the sum over levels
# and points in one kernel (passes/concat_sum.py, backends/gpu/sampling.py) -------------------

LEVELS = [(5, 7), (3, 4), (2, 3)]


class MsDeformAttn(torch.nn.Module):
    def forward(self, value, loc, weights):
        from gac_torch.models.bevformer.attention import ms_deform_attn

        return ms_deform_attn(value, LEVELS, loc, weights)


def _msda_inputs(q: int = 9, heads: int = 2, d: int = 6, points: int = 3, batch: int = 1):
    s = sum(h * w for h, w in LEVELS)
    value = r(batch, s, heads, d)
    loc = r(batch, q, heads, len(LEVELS), points, 2, lo=-0.1, hi=1.1)  # some outside: zeros
    weights = r(batch, q, heads, len(LEVELS), points, lo=0.0, hi=1.0)
    return value, loc, weights


def test_msda_levels_sum_in_one_cuda_kernel():
    """All levels' samples are weighted and summed in one kernel that writes the output: no
    buffer holds the samples (1x2x6x9x9 floats) or a level's partial sums."""
    inputs = _msda_inputs()
    compiled = gac_torch.compile(MsDeformAttn(), inputs, target="cuda",
                                 options={"arch": "sm_90", "fallback": False})
    head = _header(compiled)
    assert "gac.concat" not in compiled.ir("gac")
    out_arg = f"arg{len(inputs)}"
    sums = [ln for ln in head.splitlines() if ln.startswith("// launch") and f"{out_arg}:rW" in ln]
    assert len(sums) == 1, head
    reads = sums[0].split("(")[-1].count("temp")
    assert reads >= 3 * len(LEVELS), sums[0]  # every level's grid, weights and value
    samples = 2 * 6 * 9 * 9 * len(LEVELS) * 4
    temps = [int(ln.split(":")[1].split()[0]) for ln in head.splitlines() if ln.startswith("// temp")]
    assert max(temps) < samples, head
    assert ptxas.assemble(compiled.ir("ptx"), "sm_90").ok


@pytest.mark.parametrize("target", ["cpu", "vortex"])
def test_msda_vs_float64(target, monkeypatch):
    """ms_deform_attn with three odd levels against float64 eager (vortex: the one-kernel
    schedule of the GPU targets on the functional simulator, channel loop on)."""
    if target == "vortex":
        pytest.importorskip("ziglang")
        pytest.importorskip("elftools")
        monkeypatch.delenv("VORTEX_HOME", raising=False)
    inputs = _msda_inputs(batch=2)
    compiled = gac_torch.compile(MsDeformAttn(), inputs, target=target, options={"fallback": False})
    if target == "vortex":  # 6 channels: loops by 3 for the output's zero fill and per point
        assert compiled.ir("gpu").count("step %c3") == 2, "the channel loops were not used"
    want = MsDeformAttn()(*(t.double() for t in inputs)).float()
    torch.testing.assert_close(compiled(*inputs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_msda_cuda():
    inputs = tuple(t.cuda() for t in _msda_inputs(q=300, heads=4, d=8, points=4))
    compiled = gac_torch.compile(MsDeformAttn(), inputs, target="cuda", options={"fallback": False})
    want = MsDeformAttn()(*(t.double() for t in inputs)).float()
    torch.testing.assert_close(compiled(*inputs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["weighted", "weight_first_keepdim", "broadcast_weight", "plain3"])
def test_sum_over_concat_is_split(case):
    """gac-split-concat-sum on unequal parts (3 + 5 (+ 2)), the weight on either side, with
    keepdim, broadcast along the summed dim, or absent: no concat left, cpu vs float64."""
    fns = {
        "weighted": lambda a, b, w: (torch.cat([a, b], -1) * w).sum(-1),
        "weight_first_keepdim": lambda a, b, w: (w * torch.cat([a, b], 2)).sum(2, keepdim=True),
        "broadcast_weight": lambda a, b, w: (torch.cat([a, b], -1) * w[..., :1]).sum(-1),
        "plain3": lambda a, b, w: torch.cat([a, b, a[..., :2]], -1).sum(-1),
    }
    fn = fns[case]
    inputs = (r(2, 4, 3), r(2, 4, 5), r(4, 8))
    compiled = gac_torch.compile(Fn(fn), inputs, target="cpu", options={"fallback": False})
    assert "gac.concat" not in compiled.ir("gac")
    want = fn(*(t.double() for t in inputs)).float()
    torch.testing.assert_close(compiled(*inputs), want, rtol=1e-5, atol=1e-5)

"""Combo kernels (backends/gpu/combine.py): the `loops` kernels that only prepare the graph's
inputs (casts, weight relayouts) run as one launch per dependence level. On the CPU: the launch
list for cuda and ptxas; on an NVIDIA GPU (`-m cuda`): bit-exact against eager and against the
kernels kept apart (GAC_COMBO=0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gac_torch
from gac_torch.backends import get_target, stages_only
from gac_torch.backends.cuda import ptxas
from gac_torch.backends.gpu import combine
from gac_torch.backends.gpu.program import BufferRef
from gac_torch.frontends.fx import compile_graph
from gac_torch.legalize import decompositions
from gac_torch.options import resolve

SIZES = ((1,), (7,), (1000,), (37, 3))  # none a multiple of a block; (37, 3): copied transposed
DTYPES = (torch.bfloat16, torch.float16)


class _Casts(torch.nn.Module):
    """Independent casts of odd sizes (one through a transposed copy), as autocast makes, beside
    a matmul (a program of nothing but preparation is left as it is)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, a, b, c, d, m):
        dt = self.dtype
        return a.to(dt), b.to(dt), c.to(dt), d.t().contiguous().to(dt), m @ m


class _Convs(torch.nn.Module):
    """Two 3x3 convs on bf16 casts of their f32 inputs and weights (what autocast traces): each
    weight's cast is computed in its copy into K order (weight_layout.py)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype

    def forward(self, x, w1, w2):
        dt = self.dtype
        y = F.relu(F.conv2d(x.to(dt), w1.to(dt), padding=1))
        return F.conv2d(y, w2.to(dt), padding=1)


class _Stem(torch.nn.Module):
    """A 3-channel 7x7 stride-2 conv (its input and weights zero-padded to 4 channels: a fill,
    a copy into it, a relayout - three levels) and a 3x3 conv, under bf16 casts."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype

    def forward(self, x, w1, w2):
        dt = self.dtype
        y = F.relu(F.conv2d(x.to(dt), w1.to(dt), stride=2, padding=3))
        return F.conv2d(y, w2.to(dt), padding=1)


def _inputs(seed: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 3 for s in shapes]


def _conv_inputs() -> list[torch.Tensor]:
    return _inputs(1, ((2, 16, 9, 11), (24, 16, 3, 3), (8, 24, 3, 3)))


def _stem_inputs() -> list[torch.Tensor]:
    return _inputs(3, ((2, 3, 20, 22), (16, 3, 7, 7), (16, 16, 3, 3)))


def _program(model: torch.nn.Module, inputs: list[torch.Tensor]):
    ep = torch.export.export(model, tuple(inputs))
    gm = ep.run_decompositions(decompositions()).graph_module
    compiled = compile_graph(gm, resolve({"fallback": False, "arch": "sm_90"}, target="cuda"),
                             target=stages_only(get_target("cuda")))
    (part,) = compiled.partitions.values()
    return part.executable


@pytest.mark.parametrize("dtype", DTYPES)
def test_independent_casts_are_one_launch(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _inputs(0, (*SIZES, (8, 8)))
    monkeypatch.setenv("GAC_COMBO", "0")
    apart = _program(_Casts(dtype), inputs)
    casts = apart.launches[:-1]
    # (the one-element cast is a one-thread `serial` kernel)
    assert [k.strategy for k in casts] == ["serial"] + ["loops"] * 3, apart.describe()
    monkeypatch.setenv("GAC_COMBO", "1")
    program = _program(_Casts(dtype), inputs)
    launch, matmul = program.launches
    assert launch.strategy == "combo" and matmul.strategy == apart.launches[-1].strategy, program.describe()
    # the members' grids end to end; blocks as wide as the widest member's
    assert launch.grid[0] == sum(k.grid[0] for k in casts), (program.describe(), apart.describe())
    assert launch.block[0] == max(k.block[0] for k in casts) > min(k.block[0] for k in casts)
    assert program.dataflow_errors(len(inputs)) == [], program.describe()
    _assembles(program)


def test_max_params_splits_a_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(combine, "MAX_PARAMS", 4)  # two members' buffers a launch
    program = _program(_Casts(torch.bfloat16), _inputs(0, (*SIZES, (8, 8))))
    assert [k.strategy for k in program.launches][:2] == ["combo", "combo"], program.describe()
    assert all(len(k.args) <= 4 for k in program.launches[:2]), program.describe()


def test_weight_casts_fold_into_their_relayouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_COMBO", "0")  # cast, cast, relayout, conv, cast, relayout, conv
    assert [k.strategy for k in _program(_Convs(), _conv_inputs()).launches].count("loops") == 5
    monkeypatch.setenv("GAC_COMBO", "1")
    program = _program(_Convs(), _conv_inputs())
    assert [k.strategy for k in program.launches] == ["combo", "cwgmma", "cwgmma"], program.describe()
    prep = program.launches[0]  # reads the three inputs, never a cast's buffer
    assert {a for a, m in zip(prep.args, prep.access) if "r" in m} == {BufferRef("arg", i) for i in range(3)}
    assert program.dataflow_errors(3) == [], program.describe()
    _assembles(program)


def test_stem_padding_is_three_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_STEM_S2D", "0")  # the padded 7x7 stem (space-to-depth has its own prep)
    program = _program(_Stem(), _stem_inputs())
    kinds = [k.strategy for k in program.launches]
    # level 0 (the input's pad gather, the stem weight's pad fill, the 3x3 weight's relayout) is
    # one combo; the weight's pad copy and its relayout are levels 1 and 2, one kernel each
    assert kinds == ["combo", "loops", "loops", "igemm", "cwgmma"], program.describe()
    assert program.dataflow_errors(3) == [], program.describe()
    _assembles(program)


def _assembles(program) -> None:
    exe = ptxas.find_ptxas()
    assert exe is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    target = "sm_90a" if ".target sm_90a" in program.ptx else program.arch
    result = ptxas.assemble(program.ptx, target, exe)
    assert result.ok, result.log


# ------------------------------------------------------------------------------------------------
# on the GPU


def _run(model, inputs, combo: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GAC_COMBO", combo)
    compiled = gac_torch.compile(model, tuple(inputs), target="cuda", options={"fallback": False})
    return compiled(*inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_casts_match_torch_exactly(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [t.cuda() for t in _inputs(2, (*SIZES, (8, 8)))]
    model = _Casts(dtype)
    out = _run(model, inputs, "1", monkeypatch)
    for got, want in zip(out[:-1], model(*inputs)[:-1]):
        assert got.dtype == want.dtype and torch.equal(got, want)  # torch's rounding, bit for bit


@pytest.mark.cuda
@pytest.mark.parametrize("model, make", [(_Convs(), _conv_inputs), (_Stem(), _stem_inputs)])
def test_convs_combined_or_apart_agree(model, make, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [t.cuda() for t in make()]
    on = _run(model, inputs, "1", monkeypatch)
    off = _run(model, inputs, "0", monkeypatch)
    assert torch.equal(on, off)  # the same convs; only the preparation's launches differ
    want = type(model)(torch.float64)(*(t.double() for t in inputs))
    err = ((on.double() - want).norm() / want.norm()).item()
    assert err < 2e-2, err


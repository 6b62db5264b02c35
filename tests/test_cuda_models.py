"""The cuda target on whole models. CI (no GPU): every test model compiles to PTX for sm_80 and
sm_90 and ptxas accepts it. On a GPU (marked cuda): test_models.py/test_ops.py run the same
models and ops on device; here, the no-GPU behaviour is checked."""

from __future__ import annotations

import pytest
import torch
from models import build
from parity import Fn, check_op

import gac_torch
from gac_torch.errors import TargetUnavailable
from gac_torch.backends.cuda import pipeline
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas
from gac_torch.backends.cuda.target import compile_options


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "unsupported"])
def test_models_compile_to_ptx_that_ptxas_accepts(name, arch):
    if find_ptxas() is None:
        pytest.fail("ptxas missing: the dev extra installs nvidia-cuda-nvcc-cu12")
    model, inputs = build(name)
    compiled = gac_torch.compile(model, inputs, target="cuda", options={"arch": arch})
    assert compiled.stages == ["gac", "linalg", "gpu", "llvm", "ptx"]
    for part in compiled.compiled.partitions.values():
        ptx = part.ir("ptx")
        assert f".target {arch}" in ptx
        result = assemble(ptx, arch)
        assert result.ok, result.log


def test_cuda_without_gpu_compiles_but_refuses_to_run():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model, inputs = build("mlp")
    compiled = gac_torch.compile(model, inputs, target="cuda", options={"arch": "sm_90"})
    assert ".entry" in compiled.ir("ptx")
    with pytest.raises(TargetUnavailable, match="needs an NVIDIA GPU"):
        compiled(*inputs)


# Graphs whose outputs share buffers or inits after CSE: each output must hold its own value.
_G = torch.Generator().manual_seed(7)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_G)


MULTI_OUTPUT = {
    # CSE merges the zero fills of the two sums (output 2 once returned output 1)
    "two_sums": (lambda x: (x.sum(2), (x * x).sum(2)), lambda: (_r(3, 4, 50),)),
    "two_sums_long": (lambda x: (x.sum(-1), (x * x).sum(-1)), lambda: (_r(6, 700),)),
    "sum_mean_max_var": (lambda x: (x.sum(-1), x.mean(-1), x.amax(-1), x.var(-1)),
                         lambda: (_r(5, 300),)),
    # an output that is also consumed by another output's computation
    "output_feeds_output": (lambda x, w: (x @ w, (x @ w).relu().sum(1)), lambda: (_r(8, 16), _r(16, 12))),
    # the same value returned twice, and an input returned as is
    "same_value_twice": (lambda x: (x * 2 + 1, x * 2 + 1), lambda: (_r(4, 7),)),
    "input_as_output": (lambda x, y: (x, x + y, y), lambda: (_r(4, 7), _r(4, 7))),
    "max_argmax_sum": (lambda x: (x.max(1).values, x.argmax(1), x.sum(1)), lambda: (_r(6, 200),)),
    "shared_init_matmuls": (lambda a, b, c: (a @ b, a @ c, a @ b + a @ c),
                            lambda: (_r(16, 32), _r(32, 8), _r(32, 8))),
}


@pytest.mark.parametrize("name", list(MULTI_OUTPUT))
def test_multi_output_graphs_keep_dataflow_invariants(name):
    fn, make = MULTI_OUTPUT[name]
    inputs = make()
    compiled = gac_torch.compile(Fn(fn), inputs, target="cuda",
                                 options={"arch": "sm_90", "fallback": False})
    assert compiled.report.compiled == compiled.report.total, compiled.report.summary()
    opts = compile_options({"arch": "sm_90"})
    for part in compiled.compiled.partitions.values():
        stage = pipeline.map_stage(part.ir("linalg"), opts)  # raises on a dataflow violation
        program = stage.program
        n_in = len(part.signature.inputs)
        assert program.dataflow_errors(n_in) == [], program.describe()
        # no copy kernel between two outputs: every output is computed, or copied once from
        # an output whose value is already final
        last = {}
        for i, k in enumerate(program.launches):
            for a, m in zip(k.args, k.access):
                if getattr(a, "kind", None) == "arg" and "w" in m.lower():
                    last[a.index] = i
        assert sorted(last) == list(range(n_in, len(program.args))), program.describe()


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(MULTI_OUTPUT))
def test_multi_output_graphs_on_gpu(name):
    fn, make = MULTI_OUTPUT[name]
    for _ in range(2):  # two sets of fresh random inputs
        check_op(fn, make(), target="cuda", what=name)

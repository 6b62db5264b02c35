"""The cuda target on whole models. CI (no GPU): every test model compiles to PTX for sm_80 and
sm_90 and ptxas accepts it. On a GPU (marked cuda): test_models.py/test_ops.py run the same
models and ops on device; here, the no-GPU behaviour is checked."""

from __future__ import annotations

import pytest
import torch

import gac_torch
from gac_torch.backends import TargetUnavailable
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas
from models import build


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

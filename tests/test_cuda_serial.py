"""Scalar host code the GPU schedule runs in one-thread `serial` kernels: compiled to PTX on the CPU
(ptxas checks it), and run against eager on an NVIDIA GPU (`-m cuda`)."""

from __future__ import annotations

import pytest
import torch

from conftest import TARGETS
from gac_torch.backends import get_target, stages_only
from gac_torch.backends.cuda import ptxas
from gac_torch.frontends.fx import compile_graph
from gac_torch.legalize import decompositions
from gac_torch.options import resolve
from parity import check_op


def _index_put(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return torch.index_put(x, (i,), torch.tensor(1.0, device=x.device))


class _Fn(torch.nn.Module):
    def forward(self, x, i):
        return _index_put(x, i)


def test_serial_code_cut_by_a_kernel_keeps_its_scalars() -> None:
    # issue 12: a 1-D x with a one-element index: the index normalization and the scatter are
    # scalar code around the x -> out copy kernel; the index computed before the copy is read
    # by the store after it ("host value from arith.index_cast used outside its kernel").
    ep = torch.export.export(_Fn(), (torch.randn(7), torch.tensor([3])))
    gm = ep.run_decompositions(decompositions()).graph_module
    compiled = compile_graph(gm, resolve({"fallback": False}, target="cuda"),
                             target=stages_only(get_target("cuda")))
    (part,) = compiled.partitions.values()
    program = part.executable
    assert [k.strategy for k in program.launches] == ["serial", "loops", "serial"], program.describe()
    assert program.dataflow_errors(3) == [], program.describe()
    if ptxas.find_ptxas():
        result = ptxas.assemble(program.ptx, program.arch)
        assert result.ok, result.log


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("index", [[3], [-2], [0, 6]])
def test_index_put_one_dim(target, index) -> None:
    g = torch.Generator().manual_seed(len(index))
    check_op(_index_put, [torch.randn(7, generator=g), torch.tensor(index)], target)

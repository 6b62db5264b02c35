"""The exact-f32 MLP training step's graphs around its GEMMs (bench_h200's train_mlp_fp32):
GELU's backward in the epilogue of the GEMM that produces dh (backends/gpu/hoist.py moves it
up past the weight and bias gradients), checked offline (the kernels the cuda target emits),
on the vortex functional simulator (the same GPU schedule, run: float64 parity over odd
shapes) and on the GPU (cuda-marked)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from parity import Fn

import gac_torch
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas


def gelu_grad(h):
    """d gelu(h) / dh as AOTAutograd's decomposition writes it (erf GELU)."""
    cdf = (torch.erf(h * (1 / math.sqrt(2))) + 1) * 0.5
    return cdf + h * (torch.exp(h * h * -0.5) * (1 / math.sqrt(2 * math.pi)))


def mlp_backward(dy, w2, h, a):
    """The MLP's backward below the loss in AOTAutograd's order: dW2 and db2 between the GEMM
    dy @ W2 and GELU's backward that reads it."""
    dg = dy @ w2
    dw2 = dy.t() @ a
    db2 = dy.sum(0)
    dh = dg * gelu_grad(h)
    return dw2, db2, dh, dh.sum(0)


def _inputs(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=g), torch.randn(n, k, generator=g), torch.randn(m, k, generator=g),
            torch.randn(m, k, generator=g))


def _kernels(f, *xs, target: str = "cuda") -> list[str]:
    c = gac_torch.compile(Fn(f), xs, target=target,
                          options={"arch": "sm_90", "allow_tf32": False, "fallback": False, "cache": False})
    (part,) = c.compiled.partitions.values()
    return re.findall(r"gpu.launch_func\s+@gac_kernels::@gac_k\d+_(\w+)", part.ir("gpu")), part


@pytest.mark.parametrize("hoist", ["1", "0"])
def test_gelu_backward_runs_in_the_dh_gemm_epilogue(hoist: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # dh = (dy @ W2) * gelu'(h) is stored by the GEMM (before: dy @ W2 stored, then a loops
    # kernel read it back with h: 192 MB at 4096^2 instead of 64); GAC_EPILOGUE_HOIST=0 keeps
    # the loops kernel (the A/B switch)
    monkeypatch.setenv("GAC_EPILOGUE_HOIST", hoist)
    kernels, part = _kernels(mlp_backward, *_inputs(300, 136, 264))
    assert kernels.count("sgemm") == 2, kernels
    assert ("loops" in kernels) == (hoist == "0"), kernels
    if hoist == "1" and find_ptxas() is not None:
        info = assemble(part.ir("ptx"), "sm_90")
        assert info.ok


def test_consumer_stays_where_a_kernel_in_between_writes_what_it_reads() -> None:
    # the consumer reads a column sum of the weight gradient, computed in between: it stays a
    # kernel of its own after them (moved up, it would read the sums before they exist)
    def f(dy, w2, h, a):
        dg = dy @ w2
        dw2 = dy.t() @ a  # [k, k]
        return dg * dw2.sum(0), dw2

    kernels, _ = _kernels(f, *_inputs(40, 24, 40, seed=1))
    assert kernels[0] == "sgemm" and kernels[-1] == "loops", kernels


@pytest.mark.parametrize("m,n,k", [(37, 29, 45), (130, 67, 70)])
def test_hoisted_epilogue_matches_float64_on_vortex(m: int, n: int, k: int) -> None:
    # the gpu schedule with the move, run by the vortex functional simulator (its GEMM strategy
    # fuses the same epilogues)
    pytest.importorskip("ziglang")
    pytest.importorskip("elftools")
    xs = _inputs(m, n, k, seed=m)
    with torch.no_grad():
        compiled = gac_torch.compile(Fn(mlp_backward), xs, target="vortex",
                                     options={"vortex_mode": "functional", "cache": False, "fallback": False})
        got = compiled(*xs)
    want = mlp_backward(*(x.double() for x in xs))
    for g, w in zip(got, want):
        err = ((g.double() - w).norm() / w.norm()).item()
        assert err < 1e-5, err


def _check_gpu(f, *xs, tol: float = 1e-5) -> None:
    xs = tuple(x.cuda() for x in xs)
    compiled = gac_torch.compile(Fn(f), xs, target="cuda", options={"allow_tf32": False, "fallback": False})
    got = compiled(*xs)
    want = f(*(x.double() for x in xs))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        err = ((g.double() - w).norm() / w.norm()).item()
        assert err < tol, err


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(37, 29, 45), (300, 136, 264), (1300, 256, 1700)])
def test_hoisted_epilogue_matches_float64_on_gpu(m: int, n: int, k: int) -> None:
    _check_gpu(mlp_backward, *_inputs(m, n, k, seed=m))

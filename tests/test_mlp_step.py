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


# --------------------------------------------------------------------------------------------
# the SGD update's write-back: the new parameters computed into the parameters' own buffers


class Step(torch.nn.Module):
    """bench_h200's TrainStep (forward, mse_loss, backward, SGD under no_grad; returns the
    gradients), plus what the update reads besides the gradient (`extra`)."""

    def __init__(self, net: torch.nn.Module, extra=None, lr: float = 0.1):
        super().__init__()
        self.net, self.lr, self.extra = net, lr, extra

    def forward(self, x, target):
        params = list(self.net.parameters())
        with torch.enable_grad():
            for p in params:
                p.grad = None
            torch.nn.functional.mse_loss(self.net(x), target).backward()
        grads = [p.grad for p in params]
        with torch.no_grad():
            seen = [self.extra(p) for p in params] if self.extra is not None else []
            for p in params:
                p.sub_(p.grad, alpha=self.lr)
        return grads + seen


def _mlp(d_in: int, d_h: int, d_out: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d_in, d_h), torch.nn.GELU(), torch.nn.Linear(d_h, d_out))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.cpu()).norm() / b.norm()).item()


def _train(extra, monkeypatch: pytest.MonkeyPatch, in_place: str = "1", target: str = "vortex",
           sizes: tuple = (9, 13, 11, 7)):
    """Two steps compiled for `target` against float64 eager; the update partition's donations."""
    import copy

    if target == "vortex":
        pytest.importorskip("ziglang")
        pytest.importorskip("elftools")
    monkeypatch.setenv("GAC_IN_PLACE", in_place)
    torch._dynamo.reset()
    dev = "cuda" if target == "cuda" else "cpu"
    batch, d_in, d_h, d_out = sizes
    net = _mlp(d_in, d_h, d_out).to(dev)
    ref = Step(copy.deepcopy(net).double(), extra)
    options = {"vortex_mode": "functional"} if target == "vortex" else {"allow_tf32": False}
    step = torch.compile(Step(net, extra), backend="gac", options={"target": target, "cache": False, **options})
    g = torch.Generator().manual_seed(5)
    ptrs = [p.data_ptr() for p in net.parameters()]
    for _ in range(3):
        x, t = (torch.randn(batch, d, generator=g).to(dev) for d in (d_in, d_out))
        got, want = step(x, t), ref(x.double(), t.double())
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-5, _rel(a, b)
    for p, q in zip(net.parameters(), ref.net.parameters()):
        assert _rel(p, q) < 1e-6, _rel(p, q)
    assert [p.data_ptr() for p in net.parameters()] == ptrs
    from gac_torch.frontends.dynamo import compiled_graphs

    update = compiled_graphs[len(compiled_graphs) - 1]
    (part,) = [m for m in update.gm.modules() if hasattr(m, "donate")]
    return part._donate


def test_sgd_update_is_written_into_the_parameters_on_vortex(monkeypatch: pytest.MonkeyPatch) -> None:
    # the update graph's 4 outputs (W1, b1, W2, b2 minus lr * grad) are computed in place: the
    # loops kernel reads and writes the parameter's buffer (the simulator runs it so), and
    # AOTAutograd's write-back copy is a copy onto itself; parameters and gradients as eager's
    # (float64) over 2 steps
    donated = _train(None, monkeypatch)
    assert len(donated) == 4, donated
    assert _train(None, monkeypatch, in_place="0") == {}


def test_a_parameter_read_elsewhere_is_not_updated_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # the update graph also returns 2 * p (computed from the old p by another kernel): no
    # parameter may be overwritten before that kernel reads it
    donated = _train(lambda p: p * 2, monkeypatch)
    assert donated == {}, donated


@pytest.mark.cuda
@pytest.mark.parametrize("sizes", [(9, 13, 11, 7), (300, 264, 136, 200)])
def test_sgd_update_in_place_matches_float64_on_gpu(sizes: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 steps (CUDA graphs replay the update from the third call on): parameters and gradients
    # as eager's in float64, the parameters never moved, all 4 updated in place
    assert len(_train(None, monkeypatch, target="cuda", sizes=sizes)) == 4
    assert _train(lambda p: p * 2, monkeypatch, target="cuda", sizes=sizes) == {}


class _Sgd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(24, 40)

    def forward(self, gw, gb):
        with torch.no_grad():
            self.lin.weight.sub_(gw, alpha=0.1)
            self.lin.bias.sub_(gb, alpha=0.1)


@pytest.mark.parametrize("in_place", ["1", "0"])
def test_cuda_runtime_gets_the_parameters_as_the_update_outputs(in_place: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # the cuda runtime on CPU tensors with a no-op driver (cuda_stub): the update partition runs
    # through `run` with the parameters themselves as its outputs (their pointers are what the
    # kernel writes), so AOTAutograd's write-back copies each parameter onto itself; with
    # GAC_IN_PLACE=0 it keeps the fast path and its fresh outputs
    from cuda_stub import stub_cuda

    from gac_torch.backends.cuda.runtime import CudaExecutable
    from gac_torch.frontends.dynamo import compiled_graphs
    from gac_torch.runtime.compiled import CompiledGraph

    monkeypatch.setenv("GAC_IN_PLACE", in_place)
    ran = []
    monkeypatch.setattr(CudaExecutable, "run", lambda self, inputs, outputs: ran.append(list(outputs)))
    # (CPU tensors stand in for cuda ones: the checked path's device check would refuse them)
    monkeypatch.setattr(CompiledGraph, "check_inputs", lambda self, args: [tuple(s.shape) for s in self.signature.outputs])
    m = _Sgd()
    gw, gb = torch.randn(40, 24), torch.randn(40)
    before = [p.clone() for p in m.parameters()]
    with stub_cuda():
        torch._dynamo.reset()
        fn = torch.compile(m, backend="gac", options={"target": "cuda", "cache": False})
        fn(gw, gb)
        fn(gw, gb)
        (cg,) = compiled_graphs[-1].partitions.values()
        torch._dynamo.reset()
    params = {m.lin.weight.data_ptr(), m.lin.bias.data_ptr()}
    if in_place == "1":
        assert len(cg._donate) == 2 and cg._call is None
        assert len(ran) == 2 and all({t.data_ptr() for t in r} == params for r in ran)
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))  # (no kernel ran: no copy either)
    else:
        assert cg._donate == {} and cg._call is not None and ran == []


def test_in_place_pairs_offline_and_no_read_only_loads_of_them() -> None:
    # p - lr * g: the output (argument 2, after p and g) may share p's buffer, or g's (each is
    # read element for element by that kernel alone), and the kernel reads it with plain
    # loads (a read-only ld.global.nc of a buffer it may write is not allowed); p also read by
    # another kernel (2 * p): p pairs with nothing
    p, g = torch.randn(70, 33), torch.randn(70, 33)

    def paired(f):
        _, part = _kernels(f, p, g)
        names = {"args_0": "p", "args_1": "g"}
        return {(names[part.input_names[i]], o) for i, o in part.executable.in_place}, part.ir("ptx")

    pairs, ptx = paired(lambda p, g: p - 0.1 * g)
    assert pairs in ({("p", 2)}, {("g", 2)}), pairs  # (one output: one pair)
    loads = re.findall(r"ld\.global(\.nc)?\.", ptx)
    assert loads.count(".nc") == loads.count("") >= 1, loads  # (the paired input's loads are plain)
    pairs, _ = paired(lambda p, g: (p - 0.1 * g, p * 2))
    assert ("p", 2) not in pairs and ("p", 3) not in pairs, pairs
    # a GEMM's residual add: its epilogue's loads are not checked for in-place use (no pair, and
    # the residual keeps its read-only loads)
    _, part = _kernels(lambda x, w, r: x @ w + r, torch.randn(70, 40), torch.randn(40, 33), torch.randn(70, 33))
    assert part.executable.in_place == ()


@pytest.mark.unit
def test_epilogue_stores_a_transposed_copy_twin() -> None:
    # GAC_SGEMM_EPILOGUE_T's forward (backends/gpu/relayout.py): the first GEMM's epilogue stores
    # GELU(x @ W^T + b) and its transpose (the second GEMM's A as [k][m]); the lockstep twin on a
    # ragged tiled GEMM
    import numpy as np

    from gac_torch.kernels import conv_gemm as cg
    from gac_torch.kernels import conv_gemm_plan as cgp
    from gac_torch.kernels import conv_gemm_twin as twin
    from gac_torch.kernels.gemm_epilogue import EOp, Epilogue
    from test_sgemm import M_, N_, _operand, gemm_spec

    m, n, k = 130, 70, 40
    spec, shapes, strides = gemm_spec("tn", m, n, k)
    ranges = (m, n, k)
    bias, z = _operand((N_,), ranges)[0], _operand((M_, N_), ranges)[0]
    zt, zt_shape, zt_strides = _operand((N_, M_), ranges)  # (n, m): the transposed copy
    ops = (EOp("arith.addf", (("arg", 0), ("arg", 1)), "", ("f32", "f32"), "f32"),
           EOp("math.tanh", (("op", 0),), "", ("f32",), "f32"))
    ep = Epilogue((None, (bias, None)), (zt, None), ops, ("op", 1), taps=((("op", 1), (z, None)),))
    spec = cg.Spec(**{**spec.__dict__, "epilogue": ep})
    p = cgp.plan(spec, big=True)
    rng = np.random.default_rng(5)
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    b = rng.standard_normal(n).astype(np.float32)
    tap, out = np.full((m, n), np.nan, np.float32), np.full(zt_shape, np.nan, np.float32)
    got = twin.emulate(spec, p, A, Bm, np.zeros((m, n), np.float32), tuple(strides), epi=(None, (b, (1,))),
                       out=(out, zt_strides), taps=((tap, strides[2]),))
    want = np.tanh(A.astype(np.float64).T @ Bm.astype(np.float64) + b)
    assert np.abs(tap - want).max() < 1e-5
    assert np.abs(np.asarray(got).reshape(zt_shape) - want.T).max() < 1e-5

"""The MLP training step's K-outer GEMM operands written by their producers (issue 15):

- GAC_TRANSPOSE_PRODUCER: the backward's dy = 2 (y - t) / n (a `loops` kernel) and its K-outer
  copy for dh = dy @ W2 (a tiled transpose that read dy back) are one tiled kernel that computes
  dy, stores it and its transpose (kernels/transpose.py's prologue, strategies/sgemm_relayout.py);
  GAC_TRANSPOSE_COLSUM: the same kernel adds up its tile's columns, the first stage of
  db2 = dy.sum(0) (whose first `reduce` kernel read dy back again).
- GAC_SGEMM_EPILOGUE_T: the forward's a = GELU(x @ W1^T + b1), the second GEMM's A along K, is
  stored K-outer by the first GEMM's epilogue too (backends/gpu/relayout.py), not transposed by
  a kernel of its own.

Checked offline (the kernels the cuda target emits for sm_90, ptxas), by the numpy twin of the
new kernel (odd shapes, against float32 numpy exactly and float64), by that twin run on the
spec and the tensors the compiler used (the producer's body as extracted), and on the GPU
(cuda-marked: a training step's gradients and parameters against float64 eager)."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from parity import Fn

import gac_torch
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas
from gac_torch.kernels import transpose as tp
from gac_torch.kernels.gemm_epilogue import EOp


def _op(name: str, *args: tuple) -> EOp:
    return EOp(name, tuple(args), "", ("f32",) * len(args), "f32")


# body: (X0 - X1) * 0.5 * X2 + X3 * X4: X0, X1 at the element, X2 a scalar, X3 per column, X4 per row
_OPS = (_op("arith.subf", ("arg", 0), ("arg", 1)), _op("arith.mulf", ("op", 0), ("const", "5.000000e-01", "f32")),
        _op("arith.mulf", ("op", 1), ("arg", 2)), _op("arith.mulf", ("arg", 3), ("arg", 4)),
        _op("arith.addf", ("op", 2), ("op", 3)))


def _pro_inputs(r: int, c: int, seed: int):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(s).astype(np.float32) for s in ((r, c), (r, c), (), (c,), (r,))]
    dims = ((0, 1), (0, 1), (), (1,), (0,))
    types = [tp.dense_type(x.shape, "f32") if x.shape else "memref<f32>" for x in xs]
    return xs, tuple(zip(types, dims))


def _want(xs) -> np.ndarray:
    """The body in float32, op by op (what the kernel computes)."""
    x0, x1, x2, x3, x4 = xs
    f = np.float32
    return ((x0 - x1) * f(0.5)) * x2 + x3[None, :] * x4[:, None]


@pytest.mark.unit
@pytest.mark.parametrize("r,c", [(70, 45), (130, 67), (64, 128), (1, 7), (200, 1)])
@pytest.mark.parametrize("plain,colsum", [(True, True), (False, False), (True, False)])
def test_prologue_transpose_twin_matches_numpy(r: int, c: int, plain: bool, colsum: bool) -> None:
    xs, ins = _pro_inputs(r, c, r * c)
    gx = -(-r // tp.T)
    q = (tp.dense_type((gx, 1, c), "f32"), 2) if colsum else None
    pro = tp.Prologue(ins, _OPS, ("op", 4), plain, q)
    s = tp.spec(tp.dense_type((r, c), "f32"), "f32", (r, c), (1, 0), pro)
    p_got, d_got, q_got = tp.emulate(s, inputs=tuple(xs))
    want = _want(xs)
    assert np.array_equal(d_got, want.T)  # (every element written once: NaN-filled before)
    assert (p_got is not None) == plain and (not plain or np.array_equal(p_got, want))
    assert (q_got is not None) == colsum
    if colsum:
        tiles = np.zeros((gx * tp.T, c), np.float32)
        tiles[:r] = want
        seq = tiles.reshape(gx, tp.T, c)
        acc = seq[:, 0].copy()
        for i in range(1, tp.T):  # the kernel's order: row by row within the tile
            acc = acc + seq[:, i]
        assert np.array_equal(q_got[:, 0, :], acc)
        assert np.abs(q_got.sum(axis=(0, 1)) - want.astype(np.float64).sum(0)).max() < 1e-4
    text = tp.template(s)
    stores = re.findall(r"memref.store \S+, %(\w+)\[", text)
    assert [stores.count(n) for n in ("P", "D", "Q")] == [plain * (tp.T // tp.ROWS), tp.T // tp.ROWS, colsum]
    assert ("scf.if" in text) == (r % tp.T != 0 or c % tp.T != 0 or colsum)


# --------------------------------------------------------------------------------------------
# offline: what the cuda target emits


def gelu_grad(h):
    return (torch.erf(h * 0.7071067811865476) + 1) * 0.5 + h * (torch.exp(h * h * -0.5) * 0.3989422804014327)


def mlp_backward(y, t, w2, h, a, x):
    """The step's backward below mse_loss (AOTAutograd's order): dW2, db2, dW1, db1."""
    dy = (y - t) * (2.0 / y.numel())
    dg = dy @ w2
    dh = dg * gelu_grad(h)
    return dy.t() @ a, dy.sum(0), dh.t() @ x, dh.sum(0)


def mlp_forward(x, w1, b1, w2, b2, t):
    pre = x @ w1.t() + b1
    a = torch.nn.functional.gelu(pre)
    y = a @ w2.t() + b2
    return pre, a, y, torch.nn.functional.mse_loss(y, t)


def _bwd_inputs(m: int, n: int, k: int, seed: int = 0):
    """y, t [m][n]; W2 [n][k]; h, a [m][k]; x [m][k] (the first layer as wide as the hidden)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g) for s in ((m, n), (m, n), (n, k), (m, k), (m, k), (m, k)))


def _fwd_inputs(m: int, d: int, h: int, o: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g) / 4 for s in ((m, d), (h, d), (h,), (o, h), (o,), (m, o)))


def _compile(f, xs):
    c = gac_torch.compile(Fn(f), xs, target="cuda",
                          options={"arch": "sm_90", "allow_tf32": False, "fallback": False, "cache": False})
    (part,) = c.compiled.partitions.values()
    return [re.search(r"gac_k\d+_(\w+)", ln).group(1)  # type: ignore[union-attr]
            for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln], part


def _launch(part, kind: str) -> str:
    return next(ln for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln and f"_{kind} " in ln)


@pytest.mark.parametrize("producer,colsum", [("1", "1"), ("1", "0"), ("0", "1")])
def test_backward_dy_and_its_transpose_are_one_kernel(producer: str, colsum: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # forced on at an odd size (GAC_SGEMM_RELAYOUT=all; the default does it from ~4096^3): dy's
    # loops kernel is gone, the transpose reads y, t (and writes dy, dy^T and, with the column
    # sums, db2's partial sums: db2's first reduce kernel is gone, a small kernel adds them)
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    monkeypatch.setenv("GAC_TRANSPOSE_PRODUCER", producer)
    monkeypatch.setenv("GAC_TRANSPOSE_COLSUM", colsum)
    kinds, part = _compile(mlp_backward, _bwd_inputs(300, 136, 264))
    if producer == "0":
        assert kinds[:2] == ["loops", "transpose"], kinds
        return
    assert kinds[0] == "transpose" and kinds.count("transpose") == 1 and kinds.count("sgemm") == 3, kinds
    first = _launch(part, "transpose")
    assert first.count("memref<300x136xf32>") == 3  # y, t; dy (the dW2 GEMM and db2 read it)
    assert "memref<136x300xf32>" in first  # dy^T
    assert bool(re.search(r"memref<5x(1x)?136xf32>", first)) == (colsum == "1"), first  # 300 rows: 5 tiles of 64
    first_sgemm = kinds.index("sgemm")
    assert "loops" not in kinds[:first_sgemm], kinds
    # db2: two reduce kernels over dy before; its partial sums' 5 rows after (one kernel), and
    # db1's two (dh, the GEMM's output) as before
    assert kinds.count("reduce") == (2 if colsum == "1" else 4), kinds
    if find_ptxas() is not None:
        info = assemble(part.ir("ptx"), "sm_90")
        assert info.ok, info.log
        assert all(int(s) == 0 for s in re.findall(r"(\d+) bytes spill stores", info.log)), info.log


def test_the_kernel_the_compiler_made_computes_dy_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # the spec the strategy spliced (its prologue: dy's body as extracted, the inputs' dims) run
    # by the numpy twin on the step's own tensors: dy, dy^T and db2 as torch computes them
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    specs = []
    real = tp.template
    monkeypatch.setattr(tp, "template", lambda s: specs.append(s) or real(s))
    xs = _bwd_inputs(130, 70, 96, seed=3)
    _compile(mlp_backward, xs)
    (s,) = [s for s in specs if s.pro is not None]
    y, t = xs[0].numpy(), xs[1].numpy()
    scale = np.float32(1.0)  # (a rank-0 input: AOTAutograd's tangent in the real step)
    inputs = [x for x, (_, dims) in zip((y, t, scale), s.pro.inputs)]
    assert len(inputs) == len(s.pro.inputs) and s.pro.plain
    p, d, q = tp.emulate(s, inputs=tuple(inputs))
    dy = ((xs[0] - xs[1]) * (2.0 / xs[0].numel())).numpy()
    assert np.array_equal(p, dy) and np.array_equal(d, dy.T)
    assert np.abs(q.sum(axis=0).reshape(-1) - dy.astype(np.float64).sum(0)).max() < 1e-6


@pytest.mark.parametrize("switch", ["1", "0"])
def test_forward_a_transposed_by_the_first_gemm_epilogue(switch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # x and W1 transposed for the first GEMM, W2 for the second; a^T (the second GEMM's A)
    # stored by the first GEMM's epilogue with pre and a (GAC_SGEMM_EPILOGUE_T=0: a transpose)
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    monkeypatch.setenv("GAC_SGEMM_EPILOGUE_T", switch)
    kinds, part = _compile(mlp_forward, _fwd_inputs(300, 72, 136, 40))
    sgemms = [i for i, k in enumerate(kinds) if k == "sgemm"]
    assert kinds[:sgemms[1]].count("transpose") == (3 if switch == "1" else 4), kinds
    first = _launch(part, "sgemm")
    assert ("memref<136x300xf32>" in first) == (switch == "1"), first  # a^T [hidden][batch]
    assert first.count("memref<300x136xf32>") == 2  # pre, a: graph outputs
    if find_ptxas() is not None:
        assert assemble(part.ir("ptx"), "sm_90").ok


def test_a_copy_no_epilogue_takes_is_the_tiled_transpose(monkeypatch: pytest.MonkeyPatch) -> None:
    # a first GEMM that splits K (1100 x 260 outputs over K = 1028) keeps bias and GELU as loops
    # kernels: a's K-outer copy is then sgemm_relayout's tiled transpose, as without the switch,
    # not a `loops` copy
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    xs = _fwd_inputs(1100, 1028, 260, 1300)
    kinds, part = _compile(mlp_forward, xs)
    monkeypatch.setenv("GAC_SGEMM_EPILOGUE_T", "0")
    before, _ = _compile(mlp_forward, xs)
    assert "blocks in (%c5, %c18, %c2)" in _launch(part, "sgemm")  # (K split in 2)
    assert sorted(kinds) == sorted(before) and kinds.count("transpose") == 4, (kinds, before)


def test_epilogue_copy_only_where_an_epilogue_writes_the_operand(monkeypatch: pytest.MonkeyPatch) -> None:
    # an operand that is a graph input, or the output of a loops kernel that no contraction
    # feeds, keeps the tiled transpose (a `loops` copy would be uncoalesced: the removed
    # GAC_SGEMM_RELAYOUT=graph)
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(100, 70, generator=g), torch.randn(60, 70, generator=g)
    kinds, _ = _compile(lambda x, w: torch.tanh(x * 2) @ w.t(), (x, w))
    assert "loops" not in kinds and kinds.count("transpose") == 2, kinds  # (tanh: the transpose's prologue)
    monkeypatch.setenv("GAC_TRANSPOSE_PRODUCER", "0")
    kinds, _ = _compile(lambda x, w: torch.tanh(x * 2) @ w.t(), (x, w))
    assert kinds == ["loops", "transpose", "transpose", "sgemm"], kinds


@pytest.mark.parametrize("f,fused,copies", [
    (lambda x, w: (x * 2) @ w.t(), True, 2),
    (lambda x, w: (torch.tanh(x), torch.tanh(x) @ w.t()), False, 2),  # the operand is a graph output
    (lambda x, w: (x.t() * 3).contiguous().t() @ w.t(), False, 1)])  # already K-outer: not transposed
def test_producer_only_where_the_kernel_can_compute_it(f, fused: bool, copies: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # the prologue computes a scratch buffer only (a graph output is the caller's buffer: kept
    # as the loops kernel's), and only for an operand that is transposed at all
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(100, 70, generator=g), torch.randn(60, 70, generator=g)
    kinds, _ = _compile(f, (x, w))
    assert ("loops" not in kinds) == fused, kinds
    assert kinds[-1] == "sgemm" and kinds.count("transpose") == copies, kinds


# --------------------------------------------------------------------------------------------
# on the GPU: the training step against float64 eager


def _train_gpu(sizes: tuple, monkeypatch: pytest.MonkeyPatch, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    torch._dynamo.reset()
    from test_mlp_step import Step, _mlp, _rel

    batch, d_in, d_h, d_out = sizes
    net = _mlp(d_in, d_h, d_out).cuda()
    ref = Step(copy.deepcopy(net).double())
    step = torch.compile(Step(net), backend="gac", options={"target": "cuda", "cache": False, "allow_tf32": False})
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, t = (torch.randn(batch, d, generator=g).cuda() for d in (d_in, d_out))
        got, want = step(x, t), ref(x.double(), t.double())
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-5, _rel(a, b)
    for p, q in zip(net.parameters(), ref.net.parameters()):
        assert _rel(p, q) < 1e-6, _rel(p, q)


@pytest.mark.cuda
@pytest.mark.parametrize("sizes", [(300, 264, 136, 200), (1100, 1028, 260, 1300)])
@pytest.mark.parametrize("env", [{}, {"GAC_TRANSPOSE_COLSUM": "0", "GAC_SGEMM_EPILOGUE_T": "0"}])
def test_training_step_matches_float64_on_gpu(sizes: tuple, env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    _train_gpu(sizes, monkeypatch, {"GAC_SGEMM_RELAYOUT": "all", **env})


@pytest.mark.cuda
def test_dy_kernel_and_a_transposed_match_float64_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_sgemm import _check_gpu

    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    _check_gpu(mlp_backward, *_bwd_inputs(300, 136, 264, seed=2))
    _check_gpu(mlp_backward, *_bwd_inputs(1300, 70, 200, seed=3))
    _check_gpu(mlp_forward, *_fwd_inputs(300, 72, 136, 40, seed=4))

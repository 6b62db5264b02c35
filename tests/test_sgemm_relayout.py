"""Exact-f32 GEMM operands along K copied K-outer by the tiled transpose first
(strategies/sgemm_relayout.py, kernels/transpose.py; GAC_SGEMM_RELAYOUT): the transpose's
numpy twin on odd shapes, the relaid GEMM's twins against float64, the cost switch, the kernel
list it gives, and float64 parity on the GPU (cuda-marked)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from test_sgemm import B_, K_, M_, N_, _check_gpu, _compile_cuda, _FNS, gemm_spec

from gac_torch.backends.cuda.ptxas import assemble, find_ptxas
from gac_torch.backends.gpu.strategies import sgemm_relayout as sr
from gac_torch.kernels import conv_gemm as cg
from gac_torch.kernels import conv_gemm_plan as cgp
from gac_torch.kernels import conv_gemm_twin as twin
from gac_torch.kernels import transpose as tp

GRID = (2**31 - 1, 65535, 65535)


@pytest.mark.unit
@pytest.mark.parametrize("shape,perm", [((33, 65), (1, 0)), ((1, 7), (1, 0)), ((4097, 31), (1, 0)),
                                        ((64, 128), (1, 0)),  # whole tiles: no bounds checks
                                        ((3, 70, 40), (0, 2, 1)), ((2, 5, 3, 66), (0, 2, 3, 1))])
def test_transpose_twin_matches_numpy_on_odd_shapes(shape: tuple, perm: tuple) -> None:
    s = tp.spec(tp.dense_type(shape, "f32"), "f32", shape, perm)
    x = np.random.default_rng(len(shape) + shape[-1]).standard_normal(shape).astype(np.float32)
    got = tp.emulate(s, x)  # (every element written once; NaN-filled before)
    assert np.array_equal(got, np.transpose(x, perm))
    text = tp.template(s)
    assert ("scf.if" in text) == (shape[perm[-1]] % tp.T != 0 or shape[perm[-2]] % tp.T != 0)


@pytest.mark.unit
def test_copy_pays_for_4096_cubed_not_for_2048_cubed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GAC_SGEMM_RELAYOUT", raising=False)
    assert sr.pays(4096**3, 4 * 4096**2)  # ~0.13 ms saved vs ~0.04 ms copied
    assert not sr.pays(2048**3, 4 * 2048**2)  # ~16 us saved vs ~13 us copied: not 1.5x
    assert not sr.pays(4096 * 4096 * 64, 4 * 4096 * 64)  # short K: too little saved
    spec, _, _ = gemm_spec("nt", 4096, 4096, 4096)
    dims = (M_, K_)
    assert sr.permuted("memref<4096x4096xf32>", "f32", (4096, 4096), dims, spec.a, (K_,), [M_], (),
                       spec.ranges, GRID) is not None
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "0")
    assert sr.permuted("memref<4096x4096xf32>", "f32", (4096, 4096), dims, spec.a, (K_,), [M_], (),
                       spec.ranges, GRID) is None


def _relaid(layout: str, m: int, n: int, k: int, batch: int):
    """gemm_spec's GEMM with the operands along K replaced by their K-outer copies (forced on):
    (spec, shapes, strides, copies (None: kept))."""
    spec, shapes, strides = gemm_spec(layout, m, n, k, batch, fill=True)
    bd = (B_,) if batch else ()
    a_dims = bd + ((M_, K_) if layout[0] == "n" else (K_, M_))
    b_dims = bd + ((K_, N_) if layout[1] == "n" else (N_, K_))
    copies = []
    ops = [spec.a, spec.b]
    for i, (dims, outer) in enumerate(((a_dims, M_), (b_dims, N_))):
        t = tp.dense_type(shapes[i], "f32")
        tr = sr.permuted(t, "f32", shapes[i], dims, ops[i], (K_,), [outer], bd, spec.ranges, GRID)
        copies.append(tr)
        if tr is not None:
            ops[i] = tr.operand
            shapes[i] = tuple(shapes[i][j] for j in tr.spec.perm)
            strides[i] = tuple(int(np.prod(shapes[i][j + 1:])) for j in range(len(shapes[i])))
    spec = cg.Spec(**{**spec.__dict__, "a": ops[0], "b": ops[1]})
    return spec, shapes, strides, copies


@pytest.mark.unit
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,n,k,batch", [(37, 29, 45, 0), (70, 68, 36, 2), (130, 131, 20, 0)])
def test_relaid_gemm_twins_match_float64(layout: str, m: int, n: int, k: int, batch: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    spec, shapes, strides, copies = _relaid(layout, m, n, k, batch)
    # exactly the operands stored along K are copied, into the tn layout's K-outer order
    assert [c is not None for c in copies] == [layout[0] == "n", layout[1] == "t"]
    assert spec.a.coef[M_] == 1 and spec.b.coef[N_] == 1
    rng = np.random.default_rng(m + n + k)
    bd = (batch,) if batch else ()
    a64 = rng.standard_normal(bd + (m, k))
    b64 = rng.standard_normal(bd + (k, n))
    # the inputs as stored (layout), then through the transpose kernel's twin where copied
    stored = [a64 if layout[0] == "n" else a64.swapaxes(-1, -2), b64 if layout[1] == "n" else b64.swapaxes(-1, -2)]
    ins = []
    for x, c in zip(stored, copies):
        x = np.ascontiguousarray(x, dtype=np.float32)
        ins.append(tp.emulate(c.spec, x) if c is not None else x)
    p = cgp.plan(spec)
    assert p is not None and not p.a.glob_k and not p.b.glob_k  # both staged from K-outer runs
    C0 = np.zeros(shapes[2], np.float32)
    out = twin.emulate(spec, p, ins[0], ins[1], C0, tuple(strides), init=0.25).reshape(shapes[2])
    ref = stored[0].astype(np.float32).astype(np.float64)
    ref = (ref if layout[0] == "n" else ref.swapaxes(-1, -2)) @ b64.astype(np.float32).astype(np.float64) + 0.25
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()


def _kinds(part) -> list[str]:
    return [re.search(r"gac_k\d+_(\w+)", ln).group(1)  # type: ignore[union-attr]
            for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln]


@pytest.mark.parametrize("env,layout,n,want", [
    (None, "nt", 4096, ["transpose", "transpose", "sgemm"]),  # default: pays at 4096^3
    (None, "nn", 4096, ["transpose", "sgemm"]),
    (None, "tn", 4096, ["sgemm"]),  # nothing along K
    ("0", "nt", 4096, ["sgemm"]),  # switched off: as before
    (None, "nt", 1024, ["sgemm"]),  # too small to pay
    ("all", "tt", 77, ["transpose", "sgemm"])])  # forced: any size
def test_switch_changes_the_kernel_list(env: str | None, layout: str, n: int, want: list[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_SGEMM_STREAMK", "0")  # (its counters' zero kernel: test_sgemm_streamk.py)
    if env is None:
        monkeypatch.delenv("GAC_SGEMM_RELAYOUT", raising=False)
    else:
        monkeypatch.setenv("GAC_SGEMM_RELAYOUT", env)
    part = _compile_cuda(_FNS[layout], torch.randn(n, n), torch.randn(n, n))
    assert _kinds(part) == want
    if want != ["sgemm"] and find_ptxas() is not None:
        log = assemble(part.ir("ptx"), "sm_90").log
        assert all(int(s) == 0 for s in re.findall(r"(\d+) bytes spill stores", log)), log


def test_relaid_nt_gemm_is_the_tn_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # the GEMM after the copies is the tn GEMM's kernel, instruction for instruction
    monkeypatch.delenv("GAC_SGEMM_RELAYOUT", raising=False)
    n = 4096

    def sgemm_ptx(layout: str) -> str:
        ptx = _compile_cuda(_FNS[layout], torch.randn(n, n), torch.randn(n, n)).ir("ptx")
        (f,) = [b for b in re.split(r"(?=\.visible \.entry)", ptx) if re.search(r"\.entry gac_k\d+_sgemm", b)]
        return re.sub(r"gac_k\d+_", "", f)

    assert sgemm_ptx("nt") == sgemm_ptx("tn")


def test_batched_and_transposed_view_inputs_are_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    a, b = torch.randn(3, 40, 70), torch.randn(3, 50, 70)
    part = _compile_cuda(lambda a, b: torch.bmm(a, b.transpose(1, 2)), a, b)
    assert _kinds(part) == ["transpose", "transpose", "sgemm"]
    assert "blocks in (%c1, %c2, %c3)" in part.ir("gpu")  # (40 or 50 rows x 70 K, 3 batches)
    # a strided view (a column slice) is read in place by the transpose
    part = _compile_cuda(lambda x, w: x[:, 3:67] @ w.t(), torch.randn(300, 100), torch.randn(136, 64))
    assert _kinds(part) == ["transpose", "transpose", "sgemm"]
    assert "transpose blocks in (%c5, %c1, %c1) threads in (%c256, %c1, %c1) args(%subview : " \
           "memref<300x64xf32, strided<[100, 1], offset: 3>>" in re.sub(r"\s+", " ", part.ir("gpu"))


# --------------------------------------------------------------------------------------------
# on the GPU


@pytest.mark.cuda
@pytest.mark.parametrize("layout,m,n,k", [("nt", 37, 29, 45), ("nn", 257, 200, 1001), ("tt", 4097, 31, 65),
                                          ("nt", 136, 264, 4100), ("nt", 1300, 1700, 301)])
def test_relaid_gemm_matches_float64_on_gpu(layout: str, m: int, n: int, k: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn((m, k) if layout[0] == "n" else (k, m), generator=g)
    b = torch.randn((k, n) if layout[1] == "n" else (n, k), generator=g)
    _check_gpu(_FNS[layout], a, b)


@pytest.mark.cuda
def test_relaid_batched_gelu_and_default_4096_match_float64_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_SGEMM_RELAYOUT", "all")
    g = torch.Generator().manual_seed(0)
    a, b, x, w = (torch.randn(s, generator=g) for s in ((3, 40, 70), (3, 50, 70), (300, 264), (136, 264)))
    _check_gpu(lambda a, b: torch.bmm(a, b.transpose(1, 2)), a, b)
    _check_gpu(lambda x, w: torch.nn.functional.gelu(x @ w.t()), x, w)
    _check_gpu(lambda x, w: x[:, 3:67] @ w.t(), torch.randn(300, 100, generator=g), torch.randn(136, 64, generator=g))
    monkeypatch.delenv("GAC_SGEMM_RELAYOUT")  # the default at the MLP's size: copies both
    a, b = torch.randn(4096, 4096, generator=g), torch.randn(4096, 4096, generator=g)
    _check_gpu(_FNS["nt"], a, b)

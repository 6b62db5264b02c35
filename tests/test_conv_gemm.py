"""Implicit-GEMM kernels (gac_torch/kernels/conv_gemm.py) on the CPU: the numpy lockstep twin
against float64 torch on odd shapes, its race check, and the generated MLIR -> PTX -> ptxas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gac_torch.kernels import conv_gemm as cg
from gac_torch.kernels import conv_gemm_plan as cgp
from gac_torch.kernels import conv_gemm_twin as twin
from gac_torch.kernels import cuda_mma_twin as cmt
from gac_torch.kernels.builder import RaceError, round_to

pytestmark = pytest.mark.unit  # the fast tier: pure Python, no model compile

# conv as the shared lowering emits it (conv_2d_ngchw_gfchw on the padded input):
# dims d0..d7 = (n, g, f, oh, ow, c, kh, kw)
N_, G_, F_, OH_, OW_, C_, KH_, KW_ = range(8)


def _dense(shape: tuple[int, ...]) -> tuple[int, ...]:
    st = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        st[i] = st[i + 1] * shape[i + 1]
    return tuple(st)


def _op(elem: str, shape: tuple[int, ...], terms, ndims: int,
        strides: tuple[int, ...] | None = None, guarded: tuple[int, ...] = ()) -> tuple[cg.Operand, tuple[int, ...]]:
    strides = strides or _dense(shape)
    t = "memref<" + "x".join(map(str, shape)) + f"x{elem}>" if strides == _dense(shape) else (
        "memref<" + "x".join(map(str, shape)) + f"x{elem}, strided<[{', '.join(map(str, strides))}]>>")
    return cg.operand(t, elem, shape, strides, 0, terms, ndims, guarded), strides


def conv_spec(kind: str, n: int, g: int, cg_: int, h: int, w: int, fg: int, kh: int, kw: int,
              stride: int = 1, dil: int = 1, pad: int = 0, ec: str = "f32", fill: bool = True,
              fold_pad: bool = False, channels_last_k: bool = False):
    """(spec, shapes, strides): input [n, g, cg, h + 2 pad, w + 2 pad] (already padded), or with
    fold_pad the unpadded [n, g, cg, h, w] read through guards."""
    hp, wp = h + 2 * pad, w + 2 * pad
    oh, ow = (hp - dil * (kh - 1) - 1) // stride + 1, (wp - dil * (kw - 1) - 1) // stride + 1
    e = "f32" if kind in ("tf32", "f32") else kind
    sh = -pad if fold_pad else 0
    xs = (n, g, cg_, h, w) if fold_pad else (n, g, cg_, hp, wp)
    a, sa = _op(e, xs, [({N_: 1}, 0), ({G_: 1}, 0), ({C_: 1}, 0),
                        ({OH_: stride, KH_: dil}, sh), ({OW_: stride, KW_: dil}, sh)], 8,
                guarded=(3, 4) if fold_pad and pad else ())
    b, sb = _op(e, (g, fg, cg_, kh, kw), [({G_: 1}, 0), ({F_: 1}, 0), ({C_: 1}, 0), ({KH_: 1}, 0),
                                          ({KW_: 1}, 0)], 8)
    c, sc = _op(ec, (n, g, fg, oh, ow), [({d: 1}, 0) for d in (N_, G_, F_, OH_, OW_)], 8)
    ranges = (n, g, fg, oh, ow, cg_, kh, kw)
    ks = (KH_, KW_, C_) if channels_last_k else (C_, KH_, KW_)
    spec = cg.Spec(kind, (N_, OH_, OW_), (F_,), ks, (G_,), ranges, a, b, c, fill)
    shapes = (xs, (g, fg, cg_, kh, kw), (n, g, fg, oh, ow))
    return spec, shapes, (sa, sb, sc)


def _conv_ref(x: np.ndarray, w: np.ndarray, stride: int, dil: int, pad: int = 0) -> np.ndarray:
    n, g, c, h, wd = x.shape
    y = torch.nn.functional.conv2d(torch.from_numpy(x.astype(np.float64)).reshape(n, g * c, h, wd),
                                   torch.from_numpy(w.astype(np.float64)).reshape(g * w.shape[1], *w.shape[2:]),
                                   stride=stride, dilation=dil, groups=g, padding=pad)
    return y.reshape(n, g, w.shape[1], *y.shape[2:]).numpy()


_TOL = {"f32": 1e-5, "tf32": 3e-3, "f16": 2e-3, "bf16": 1e-2}

CONVS = [  # kind, n, g, cg, h, w, fg, kh, kw, stride, dil, pad, ec, fill, big
    ("f32", 2, 1, 3, 9, 11, 5, 3, 3, 1, 1, 1, "f32", True, False),  # odd everything
    ("f32", 1, 1, 8, 8, 12, 70, 1, 1, 1, 1, 0, "f32", False, True),  # 1x1, N > 64, onto C, float4 A
    ("f32", 1, 2, 3, 13, 9, 4, 3, 3, 2, 2, 2, "f32", True, False),  # groups, stride 2, dilation 2
    ("tf32", 1, 1, 5, 10, 7, 9, 3, 3, 2, 1, 1, "f32", True, False),
    ("f16", 2, 1, 3, 15, 15, 8, 7, 7, 2, 1, 3, "f32", True, False),  # 7x7 stride-2 stem
    ("bf16", 1, 1, 16, 8, 8, 24, 1, 1, 1, 1, 0, "bf16", True, True),  # vector A loads, bf16 out
    ("f16", 1, 4, 1, 9, 10, 1, 3, 3, 1, 1, 1, "f16", False, False),  # depthwise, accumulate
    ("bf16", 1, 1, 8, 6, 9, 40, 3, 3, 1, 1, 1, "f32", True, True),  # 128x64 tile
]


@pytest.mark.parametrize("case", CONVS, ids=lambda c: "_".join(map(str, c[:12])))
def test_conv_twin_matches_float64(case) -> None:
    kind, n, g, c, h, w, f, kh, kw, s, d, pad, ec, fill, big = case
    spec, shapes, strides = conv_spec(kind, n, g, c, h, w, f, kh, kw, s, d, pad, ec, fill)
    p = cgp.plan(spec, big=big)
    assert p is not None
    rng = np.random.default_rng(sum(shapes[0]) + f)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    C0 = round_to(rng.standard_normal(shapes[2]).astype(np.float32), ec)
    out = twin.emulate(spec, p, X, W, C0, strides, init=0.5).reshape(shapes[2])
    rnd = {"tf32": "tf32", "f32": "f32"}.get(kind, kind)
    ref = _conv_ref(round_to(X, rnd), round_to(W, rnd), s, d)
    ref = ref + (0.5 if fill else C0.astype(np.float64))
    tol = max(_TOL[kind], _TOL.get(ec, 0) if ec != "f32" else 0)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < tol, err
    if kind == "f32":  # exact fp32: every element within a few ulps of the sum's magnitude
        assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()


def test_gemm_over_dim_sets_with_transposed_operands() -> None:
    # C[b, i, j, n] = sum_{k1, k2} A[k1, b, i, j, k2] * B[n, b, k2, k1]: M = (i, j), K = (k1, k2)
    B_, I_, J_, K1, K2, Nn = range(6)
    r = (2, 5, 7, 3, 6, 9)
    a, sa = _op("bf16", (3, 2, 5, 7, 6), [({K1: 1}, 0), ({B_: 1}, 0), ({I_: 1}, 0), ({J_: 1}, 0), ({K2: 1}, 0)], 6)
    b, sb = _op("bf16", (9, 2, 6, 3), [({Nn: 1}, 0), ({B_: 1}, 0), ({K2: 1}, 0), ({K1: 1}, 0)], 6)
    c, sc = _op("f32", (2, 5, 7, 9), [({B_: 1}, 0), ({I_: 1}, 0), ({J_: 1}, 0), ({Nn: 1}, 0)], 6)
    rng = np.random.default_rng(3)
    A = rng.standard_normal((3, 2, 5, 7, 6)).astype(np.float32)
    Bm = rng.standard_normal((9, 2, 6, 3)).astype(np.float32)
    for kind, aa, bb in (("bf16", a, b), ("f32", None, None)):
        if kind == "f32":
            aa, _ = _op("f32", (3, 2, 5, 7, 6), [({K1: 1}, 0), ({B_: 1}, 0), ({I_: 1}, 0), ({J_: 1}, 0), ({K2: 1}, 0)], 6)
            bb, _ = _op("f32", (9, 2, 6, 3), [({Nn: 1}, 0), ({B_: 1}, 0), ({K2: 1}, 0), ({K1: 1}, 0)], 6)
        spec = cg.Spec(kind, (I_, J_), (Nn,), (K1, K2), (B_,), r, aa, bb, c, True)
        p = cgp.plan(spec)
        src = (A, Bm) if kind == "f32" else (round_to(A, "bf16"), round_to(Bm, "bf16"))
        ref = np.einsum("xbijy,nbyx->bijn", *(x.astype(np.float64) for x in src))
        out = twin.emulate(spec, p, *src, np.zeros((2, 5, 7, 9), np.float32), (sa, sb, sc))
        err = np.linalg.norm(out.reshape(ref.shape) - ref) / np.linalg.norm(ref)
        assert err < (1e-5 if kind == "f32" else 1e-2), (kind, err)


def test_twin_catches_a_missing_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    spec, shapes, strides = conv_spec("f32", 1, 1, 8, 10, 10, 16, 3, 3, pad=1)
    p = cgp.plan(spec, big=False)
    calls = []
    real = cmt.MmaNumpy.barrier

    def barrier(self):  # only the prologue's barrier survives
        calls.append(1)
        if len(calls) == 1:
            real(self)

    monkeypatch.setattr(cmt.MmaNumpy, "barrier", barrier)
    X, W, C0 = (np.ones(s, np.float32) for s in shapes)
    with pytest.raises(RaceError):
        twin.emulate(spec, p, X, W, C0, strides)


def test_vector_widths_follow_the_unit_stride_runs() -> None:
    # 1x1 stride 1: A's run is the whole (oh, ow) plane along M -> 16-byte loads of f16 (8 wide);
    # the weight's run is the whole K (c, kh, kw) of a dense [f, c, kh, kw] -> 8 wide too
    spec, _, _ = conv_spec("f16", 1, 1, 64, 16, 24, 64, 1, 1)
    p = cgp.plan(spec)
    assert (p.a.glob_k, p.a.vec, p.b.glob_k, p.b.vec) == (False, 8, True, 8)
    # 3x3 padded: A's runs break at each kw shift -> scalars; weight K = 64*9 still 8 wide
    spec, _, _ = conv_spec("f16", 1, 1, 64, 16, 24, 64, 3, 3, pad=1)
    p = cgp.plan(spec)
    assert (p.a.vec, p.b.vec) == (1, 8)
    # the stem: K = 3*7*7 = 147 is odd -> scalar weight loads
    spec, _, _ = conv_spec("f32", 1, 1, 3, 32, 32, 64, 7, 7, 2, 1, 3)
    assert cgp.plan(spec).b.vec == 1


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_strided_conv_input_is_walked_along_ow(kind: str) -> None:
    # stride 2, K = (kh, kw, c): no unit-stride run either way; lanes step 2 along ow (a 32-byte
    # sector serves several), not a whole c plane (one word a sector) -- and stay exact
    spec, shapes, strides = conv_spec(kind, 2, 1, 32, 12, 14, 24, 3, 3, 2, 1, 1, fold_pad=True,
                                      channels_last_k=True)
    p = cgp.plan(spec)
    assert not p.a.glob_k and p.a.cp == (kind == "tf32")
    rng = np.random.default_rng(11)
    X, W = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    out = twin.emulate(spec, p, X, W, np.zeros(shapes[2], np.float32), strides).reshape(shapes[2])
    ref = _conv_ref(round_to(X, kind), round_to(W, kind), 2, 1, 1)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < _TOL[kind]


def _bn_relu_residual_epilogue(shape: tuple[int, ...], out_elem: str, direct: bool = False):
    """Z = bf16/f32(relu((y - mean[f]) * rsqrt(var[f] + eps) * w[f] + b[f] + res[e])) over
    e = (n, g, f, oh, ow), the BatchNorm-eval + residual + ReLU body the lowering emits."""
    from gac_torch.kernels.gemm_epilogue import EOp, Epilogue

    # e = (n, g, f, oh, ow); direct: the operands over the conv's own dims d0..d7 instead
    nd, dims = (8, (N_, G_, F_, OH_, OW_)) if direct else (len(shape), tuple(range(len(shape))))
    per_f = [_op("f32", (shape[2],), [({dims[2]: 1}, 0)], nd)[0] for _ in range(4)]
    res, _ = _op("f32", shape, [({d: 1}, 0) for d in dims], nd)
    out, _ = _op(out_elem, shape, [({d: 1}, 0) for d in dims], nd)
    f, z = "f32", ("const", "0.000000e+00 : f32", "f32")
    ops = (EOp("arith.addf", (("arg", 2), ("const", "9.99999974E-6 : f32", f)), "", (f, f), f),
           EOp("math.rsqrt", (("op", 0),), "", (f,), f),
           EOp("arith.subf", (("arg", 0), ("arg", 1)), "", (f, f), f),
           EOp("arith.mulf", (("op", 2), ("op", 1)), "", (f, f), f),
           EOp("arith.mulf", (("op", 3), ("arg", 3)), "", (f, f), f),
           EOp("arith.addf", (("op", 4), ("arg", 4)), "", (f, f), f),
           EOp("arith.addf", (("op", 5), ("arg", 5)), "", (f, f), f),
           EOp("arith.cmpf", (("op", 6), z), "{predicate = 2 : i64}", (f, f), "i1"),
           EOp("arith.cmpf", (("op", 6), ("op", 6)), "{predicate = 14 : i64}", (f, f), "i1"),
           EOp("arith.select", (("op", 8), ("op", 6), z), "", ("i1", f, f), f),
           EOp("arith.select", (("op", 7), ("op", 6), ("op", 9)), "", ("i1", f, f), f))
    result = ("op", 10)
    if out_elem != "f32":
        ops += (EOp("arith.truncf", (("op", 10),), "", (f,), out_elem),)
        result = ("op", 11)
    space = None if direct else shape
    return Epilogue((None, *((x, space) for x in (*per_f, res))), (out, space), ops, result)


@pytest.mark.parametrize("kind,out_elem,direct", [("f32", "f32", False), ("bf16", "bf16", False),
                                                  ("tf32", "f32", False), ("f32", "f32", True),
                                                  ("f16", "f16", True)])
def test_conv_with_fused_batchnorm_residual_relu(kind: str, out_elem: str, direct: bool) -> None:
    import dataclasses

    spec, shapes, strides = conv_spec(kind, 2, 1, 5, 9, 10, 12, 3, 3, pad=1)
    ep = _bn_relu_residual_epilogue(shapes[2], out_elem, direct)
    spec = dataclasses.replace(spec, epilogue=ep)
    p = cgp.plan(spec)
    rng = np.random.default_rng(5)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    mean, w, b = (rng.standard_normal(12).astype(np.float32) for _ in range(3))
    var = rng.random(12).astype(np.float32) + 0.5
    res = rng.standard_normal(shapes[2]).astype(np.float32)
    params = [(v, (1,)) for v in (mean, var, w, b)]
    z0 = np.full(shapes[2], np.nan, np.float32)
    out = twin.emulate(spec, p, X, W, np.zeros(shapes[2], np.float32), strides, epi=(None, *params, (res, _dense(shapes[2]))),
                     out=(z0, _dense(shapes[2]))).reshape(shapes[2])
    rnd = {"tf32": "tf32", "f32": "f32"}.get(kind, kind)
    y = _conv_ref(round_to(X, rnd), round_to(W, rnd), 1, 1)
    f = (None, None, slice(None), None, None)
    ref = np.maximum((y - mean[f]) / np.sqrt(var[f] + 1e-5) * w[f] + b[f] + res, 0)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert not np.isnan(out).any() and err < max(_TOL[kind], _TOL.get(out_elem, 0) if out_elem != "f32" else 0), err
    from mlir import ir

    from gac_torch.kernels.conv_gemm_text import template

    ir.Module.parse(template(spec, p), ir.Context())  # the generated MLIR parses


@pytest.mark.parametrize("kind,k,stride,dil,pad", [("f32", 3, 1, 1, 1), ("f16", 7, 2, 1, 3),
                                                  ("tf32", 3, 2, 2, 2), ("bf16", 3, 1, 1, 1)])
def test_fused_padding_reads_zeros_outside(kind: str, k: int, stride: int, dil: int, pad: int) -> None:
    # the padding kernel folded into the loads: the unpadded input, guarded rows and columns
    spec, shapes, strides = conv_spec(kind, 2, 1, 3, 11, 13, 9, k, k, stride, dil, pad, fold_pad=True)
    assert spec.a.guards and shapes[0] == (2, 1, 3, 11, 13)
    p = cgp.plan(spec)
    assert p.a.vec == 1
    rng = np.random.default_rng(k + pad)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    out = twin.emulate(spec, p, X, W, np.zeros(shapes[2], np.float32), strides).reshape(shapes[2])
    rnd = {"tf32": "tf32", "f32": "f32"}.get(kind, kind)
    ref = _conv_ref(round_to(X, rnd), round_to(W, rnd), stride, dil, pad)
    assert out.shape == ref.shape
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < _TOL[kind], err


@pytest.mark.parametrize("kind,c", [("f16", 64), ("f32", 32), ("tf32", 16), ("bf16", 32)])
def test_k_ordered_kh_kw_c_splits_once_per_slice(kind: str, c: int) -> None:
    # K = (kh, kw, c) with c a multiple of the slice depth: the kernel delinearises kbase once
    # per slice and adds the element's offset to c (the backend's order for convs)
    spec, shapes, strides = conv_spec(kind, 1, 1, c, 7, 9, 12, 3, 3, 1, 1, 1, fold_pad=True,
                                      channels_last_k=True)
    p = cgp.plan(spec)
    assert spec.ranges[spec.ks[-1]] % p.bk == 0
    rng = np.random.default_rng(c)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    out = twin.emulate(spec, p, X, W, np.zeros(shapes[2], np.float32), strides).reshape(shapes[2])
    rnd = {"tf32": "tf32", "f32": "f32"}.get(kind, kind)
    ref = _conv_ref(round_to(X, rnd), round_to(W, rnd), 1, 1, 1)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < _TOL[kind], err


@pytest.mark.parametrize("kind,pad", [("tf32", 1), ("bf16", 0)])
def test_twin_catches_a_cp_async_read_before_its_wait(kind: str, pad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the cp.async pipeline: slice kt is read after cp.async.wait_group(stages - 2) + barrier;
    # waiting for one group fewer reads shared memory the copies have not filled yet
    spec, shapes, strides = conv_spec(kind, 1, 1, 16, 6, 9, 24, 3, 3, pad=pad)
    p = cgp.plan(spec)
    assert (p.a.cp or p.b.cp) and p.stages >= 3
    X, W, C0 = (np.random.default_rng(1).standard_normal(s).astype(np.float32) for s in shapes)
    ok = twin.emulate(spec, p, X, W, C0, strides).reshape(shapes[2])
    ref = _conv_ref(round_to(X, kind), round_to(W, kind), 1, 1)  # (a fused fill: C0 unread)
    assert np.linalg.norm(ok - ref) / np.linalg.norm(ref) < _TOL[kind]
    real = twin._Numpy.cp_wait
    monkeypatch.setattr(twin._Numpy, "cp_wait", lambda self, n: real(self, n + 1))
    with pytest.raises(AssertionError, match="never written"):
        twin.emulate(spec, p, X, W, C0, strides)


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("a_km,b_kn", [(False, False), (True, False), (False, True), (True, True)])
def test_ldmatrix_fragments_in_every_operand_layout(kind: str, a_km: bool, b_kn: bool) -> None:
    # C[m, n] = sum_k A * B with A stored [m][k] or [k][m] and B [n][k] or [k][n]: the shared
    # tiles take the global run's layout, ldmatrix (.trans for [k][outer]) rebuilds fragments
    M_, N_, K_ = range(3)
    r = (37, 24, 48)
    a, sa = _op(kind, (48, 37) if a_km else (37, 48), [({K_: 1}, 0), ({M_: 1}, 0)][:: 1 if a_km else -1], 3)
    b, sb = _op(kind, (48, 24) if b_kn else (24, 48), [({K_: 1}, 0), ({N_: 1}, 0)][:: 1 if b_kn else -1], 3)
    c, sc = _op("f32", (37, 24), [({M_: 1}, 0), ({N_: 1}, 0)], 3)
    spec = cg.Spec(kind, (M_,), (N_,), (K_,), (), r, a, b, c, True)
    p = cgp.plan(spec, big=True)
    assert (p.a.smem_k, p.b.smem_k) == (not a_km, not b_kn)
    rng = np.random.default_rng(7)
    A = round_to(rng.standard_normal((48, 37) if a_km else (37, 48)).astype(np.float32), kind)
    B = round_to(rng.standard_normal((48, 24) if b_kn else (24, 48)).astype(np.float32), kind)
    ref = (A.T if a_km else A).astype(np.float64) @ (B if b_kn else B.T).astype(np.float64)
    out = twin.emulate(spec, p, A, B, np.zeros((37, 24), np.float32), (sa, sb, sc)).reshape(37, 24)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("kind,c,f,stride", [("tf32", 32, 12, 1), ("bf16", 32, 9, 2), ("f32", 64, 20, 1)])
def test_weights_copied_into_the_k_order_are_staged_in_vectors(kind: str, c: int, f: int, stride: int) -> None:
    # K = (kh, kw, c): [g, f, c, kh, kw] weights gather c at a stride of kh*kw (scalars);
    # weight_layout's copy [g, f, kh, kw, c] is contiguous along K -> 16-byte vectors, same conv
    from gac_torch.backends.gpu.strategies import weight_layout

    spec, shapes, strides = conv_spec(kind, 2, 1, c, 7, 9, f, 3, 3, stride, 1, 1, fold_pad=True,
                                      channels_last_k=True)
    assert cgp.plan(spec).b.vec == 1
    e = spec.b.elem
    rl = weight_layout.permuted(spec.b.type, e, shapes[1], strides[1], 0, (G_, F_, C_, KH_, KW_), 8,
                                spec.ks, spec.ranges)
    assert rl is not None and rl.perm == (0, 1, 3, 4, 2)
    spec2 = cg.Spec(**{**spec.__dict__, "b": rl.operand})
    p = cgp.plan(spec2)
    assert (p.b.glob_k, p.b.vec, p.b.cp) == (True, 16 // cgp.ESIZE[e], kind != "f32")
    rng = np.random.default_rng(c + f)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    Wt = np.ascontiguousarray(W.transpose(rl.perm))
    out = twin.emulate(spec2, p, X, Wt, np.zeros(shapes[2], np.float32), (strides[0], _dense(Wt.shape), strides[2]))
    rnd = {"tf32": "tf32", "f32": "f32"}.get(kind, kind)
    ref = _conv_ref(round_to(X, rnd), round_to(W, rnd), stride, 1, 1)
    err = np.linalg.norm(out.reshape(ref.shape) - ref) / np.linalg.norm(ref)
    assert err < _TOL[kind], err
    # already contiguous along K (a 1x1 conv's [g, f, c, 1, 1]): no copy
    spec1, shapes1, strides1 = conv_spec(kind, 1, 1, c, 5, 5, f, 1, 1, channels_last_k=True)
    assert weight_layout.permuted(spec1.b.type, e, shapes1[1], strides1[1], 0, (G_, F_, C_, KH_, KW_), 8,
                                  spec1.ks, spec1.ranges) is None


def nhwc_spec(kind: str, n: int, c: int, h: int, w: int, f: int, k: int, stride: int, dil: int, pad: int):
    """(spec, shapes, strides) of a conv on an unpadded N H W C input read through padding
    guards, [f, kh, kw, c] weights (weight_layout's copy), an N OH OW F result; K = (kh, kw, c),
    the order implicit_gemm gives a channels-last conv (passes/channels_last.py)."""
    oh, ow = (h + 2 * pad - dil * (k - 1) - 1) // stride + 1, (w + 2 * pad - dil * (k - 1) - 1) // stride + 1
    e = "f32" if kind in ("tf32", "f32") else kind
    a, sa = _op(e, (n, h, w, 1, c), [({N_: 1}, 0), ({OH_: stride, KH_: dil}, -pad),
                                     ({OW_: stride, KW_: dil}, -pad), ({G_: 1}, 0), ({C_: 1}, 0)], 8,
                guarded=(1, 2) if pad else ())
    b, sb = _op(e, (1, f, k, k, c), [({d: 1}, 0) for d in (G_, F_, KH_, KW_, C_)], 8)
    cc, sc = _op("f32", (n, oh, ow, 1, f), [({d: 1}, 0) for d in (N_, OH_, OW_, G_, F_)], 8)
    ranges = (n, 1, f, oh, ow, c, k, k)
    spec = cg.Spec(kind, (N_, OH_, OW_), (F_,), (KH_, KW_, C_), (G_,), ranges, a, b, cc, True)
    return spec, ((n, h, w, 1, c), (1, f, k, k, c), (n, oh, ow, 1, f)), (sa, sb, sc)


@pytest.mark.parametrize("kind,c,f,stride,dil,pad,big", [
    ("f32", 12, 10, 1, 1, 1, False), ("tf32", 32, 20, 2, 1, 1, False), ("tf32", 16, 9, 1, 2, 2, False),
    ("bf16", 32, 12, 2, 1, 1, False), ("f16", 24, 40, 1, 1, 1, False), ("bf16", 64, 8, 1, 1, 0, False),
    ("tf32", 32, 70, 1, 1, 1, True), ("bf16", 64, 130, 2, 1, 1, True)])
def test_channels_last_input_is_staged_in_vectors_through_the_padding(kind, c, f, stride, dil, pad, big) -> None:
    # N H W C: the channels are K's innermost run and no padding guard reads them, so a whole
    # 16-byte vector is inside or outside the padding together (NCHW's padded input: scalars);
    # big: 128-wide tiles, 4 cp.async stages (the twin checks every read waits for its copy)
    spec, shapes, strides = nhwc_spec(kind, 2, c, 7, 9, f, 3, stride, dil, pad)
    p = cgp.plan(spec, big=big or None, dynamic_limit=cgp.DYNAMIC_SMEM_PER_BLOCK if big else 0)
    assert p.bm == (128 if big else 64) and (p.stages == 4 or not big)
    es = cgp.ESIZE[spec.a.elem]
    assert p.a.glob_k and p.a.vec == 16 // es, p.a
    assert p.a.cp == (kind != "f32") and p.b.vec == 16 // es
    rng = np.random.default_rng(c + f + stride)
    X = rng.standard_normal(shapes[0]).astype(np.float32)
    W = rng.standard_normal(shapes[1]).astype(np.float32)
    out = twin.emulate(spec, p, X, W, np.zeros(shapes[2], np.float32), strides, init=0.25)
    rnd = {"tf32": "tf32", "f32": "f32"}.get(kind, kind)
    x64 = torch.from_numpy(round_to(X, rnd).astype(np.float64)).reshape(2, 7, 9, c).permute(0, 3, 1, 2)
    w64 = torch.from_numpy(round_to(W, rnd).astype(np.float64)).reshape(f, 3, 3, c).permute(0, 3, 1, 2)
    ref = torch.nn.functional.conv2d(x64, w64, stride=stride, dilation=dil, padding=pad).permute(0, 2, 3, 1)
    ref = ref.numpy() + 0.25
    err = np.linalg.norm(out.reshape(ref.shape) - ref) / np.linalg.norm(ref)
    assert err < _TOL[kind], err

"""Kernel templates (gac_torch/kernels/) run on the CPU through their numpy twin: the same kernel
body the MLIR is generated from, all threads of a block in lockstep, shared-memory races checked
against the barriers. Odd shapes (tile overhangs in every dim), layouts, batch, fused fills, f16
and int element types, run-time extents; compared with a float64 (or exact int) reference."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir
from mlir.dialects import gpu as _gpu  # noqa: F401  (registers the dialects the templates use)

from gac_torch.kernels import simt_matmul as sm
from gac_torch.kernels.builder import RaceError, round_to

pytestmark = pytest.mark.unit  # the fast tier: pure Python, no model compile


def _mm_spec(M: int, N: int, K: int, elem: str = "f32", out: str | None = None, a_t: bool = False,
             b_t: bool = False, batch: tuple[int, ...] = (), fill: bool = False,
             dynamic: bool = False) -> sm.Spec:
    """C[b.., m, n] = init + A[b.., m, k] (or [k, m]) * B[b.., k, n] (or [n, k]); an f16 input
    with an f32 output is widened by an arith.extf cast in the body, as linalg does."""
    out = out or elem
    nb = len(batch)
    bd = tuple(range(nb))
    m, n, k = nb, nb + 1, nb + 2
    ranges = (*batch, M, N, K)
    a_dims = bd + ((k, m) if a_t else (m, k))
    b_dims = bd + ((n, k) if b_t else (k, n))
    c_dims = bd + (m, n)

    def ty(dims: tuple[int, ...], e: str) -> str:
        return "memref<" + "".join(("?" if dynamic and d in (m, n, k) else str(ranges[d])) + "x" for d in dims) + e + ">"

    sources = tuple(("A", a_dims.index(d)) if d in a_dims else ("B", b_dims.index(d)) for d in range(nb + 3))
    casts = (("arith.extf", out),) if elem != out and elem.startswith(("f", "bf")) else ()
    if dynamic:
        ranges = (*batch, None, None, None)
    return sm.Spec(m, n, k, bd, ranges, sources, sm.Operand(ty(a_dims, elem), elem, a_dims, casts),
                   sm.Operand(ty(b_dims, elem), elem, b_dims, casts), sm.Operand(ty(c_dims, out), out, c_dims),
                   is_float=elem[0] in "fb", fill=fill)


def _shape(op: sm.Operand, ext: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(ext[d] for d in op.dims)


def _run(spec: sm.Spec, ext: tuple[int, ...], seed: int, init: float = 0.25):
    rng = np.random.default_rng(seed)
    if spec.is_float:
        A = round_to(rng.standard_normal(_shape(spec.a, ext)), spec.a.elem)
        B = round_to(rng.standard_normal(_shape(spec.b, ext)), spec.b.elem)
        C = round_to(rng.standard_normal(_shape(spec.c, ext)), spec.c.elem)
    else:
        A, B, C = (rng.integers(-50, 50, _shape(o, ext)).astype(np.int64) for o in (spec.a, spec.b, spec.c))
    tiling = sm.plan(spec)
    assert tiling is not None
    got = sm.emulate(spec, tiling, A, B, C.copy(), init=init)
    nb = len(spec.batch)
    Am = A if spec.a.dims[nb:] == (spec.m, spec.k) else np.swapaxes(A, -1, -2)
    Bm = B if spec.b.dims[nb:] == (spec.k, spec.n) else np.swapaxes(B, -1, -2)
    base = np.float64(init) if spec.fill else C.astype(np.float64)
    ref = base + Am.astype(np.float64) @ Bm.astype(np.float64)
    return got, ref, tiling


@pytest.mark.parametrize("M,N,K,elem,out,a_t,b_t,batch,fill", [
    (37, 29, 41, "f32", None, False, False, (), False),  # every dim overhangs a tile
    (70, 50, 33, "f32", None, False, True, (), True),  # nn.Linear layout, fused fill
    (33, 65, 17, "f32", None, True, False, (3,), False),  # transposed A, batch
    (40, 24, 50, "f16", "f32", False, False, (2, 2), True),  # f16 inputs widened in the body
    (31, 35, 19, "f16", None, False, True, (), False),  # f16 out, f32 accumulators
    (21, 30, 45, "i32", None, False, False, (), False),  # ints: exact
])
def test_simt_matmul_emulated_on_cpu(M, N, K, elem, out, a_t, b_t, batch, fill) -> None:
    spec = _mm_spec(M, N, K, elem, out, a_t, b_t, batch, fill)
    got, ref, tiling = _run(spec, (*batch, M, N, K), seed=M * N + K)
    if not spec.is_float:
        assert np.array_equal(got, ref.astype(np.int64))
    else:
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < (2e-3 if spec.c.elem == "f16" else 1e-5), err
    ir.Module.parse(sm.template(spec, tiling), ir.Context())  # the MLIR for the same plan parses


def test_simt_matmul_run_time_extents() -> None:
    # Sizes known only at run time: a 64-wide tile, extents read from the buffers.
    spec = _mm_spec(0, 0, 0, dynamic=True)
    got, ref, tiling = _run(spec, (45, 70, 23), seed=3)
    assert (tiling.tm, tiling.tn) == (4, 4)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    text = sm.template(spec, tiling)
    assert text.count("memref.dim") == 3
    ir.Module.parse(text, ir.Context())


def test_simt_matmul_emulation_catches_a_missing_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _mm_spec(32, 32, 48)
    calls = []
    real = sm._Numpy.barrier

    def barrier(self):  # the barrier after each slice's FMAs (3d) is dropped
        calls.append(1)
        if len(calls) % 2:
            real(self)

    monkeypatch.setattr(sm._Numpy, "barrier", barrier)
    with pytest.raises(RaceError):
        _run(spec, (32, 32, 48), seed=0)


# ------------------------------------------------------------------------------------------------
# reduce: the schedule once; the math (element, combiner) given here as numpy functions

from gac_torch.kernels import reduce as rd  # noqa: E402

_NP_REDUCE = {"add": np.sum, "mul": np.prod, "max": np.max, "min": np.min,
              "and": np.bitwise_and.reduce, "or": np.bitwise_or.reduce, "xor": np.bitwise_xor.reduce}


@pytest.mark.parametrize("kind,p_ext,r_ext,dtype,acc,fill", [
    ("add", (13,), (37,), "f32", "f32", None),  # ragged rows, idle warps in the last block
    ("add", (3, 7), (5, 41), "f16", "f32", 0.5),  # 2-D spaces, f16 data in f32, fused fill
    ("max", (3,), (3000,), "f32", "f32", None),  # long rows: a block per output
    ("min", (2, 5), (1100,), "f32", "f32", None),  # just past the warp limit
    ("xor", (9,), (300,), "i8", "i32", None),  # small ints accumulate in i32
    ("mul", (4,), (129,), "f64", "f64", None),
])
def test_reduce_emulated_on_cpu(kind, p_ext, r_ext, dtype, acc, fill) -> None:
    rng = np.random.default_rng(sum(p_ext) * 31 + sum(r_ext))
    shape = (*p_ext, *r_ext)
    if dtype[0] == "i":
        X = rng.integers(-100, 100, shape).astype(np.int64)
        out = rng.integers(-100, 100, p_ext).astype(np.int64)
    else:
        X = round_to(rng.uniform(0.9, 1.1, shape) if kind == "mul" else rng.standard_normal(shape), dtype)
        out = round_to(rng.standard_normal(p_ext), dtype)
    ref_init = np.float64(fill) if fill is not None else out.astype(np.float64 if dtype[0] != "i" else np.int64)
    sq = kind == "add"  # the body maps before it combines: sum of squares

    def element(p, r):
        x = X[tuple(p) + tuple(r)]
        return x * x if sq else x

    got = rd.emulate(kind, acc, element, p_ext, r_ext, out.copy(), init=fill)
    flat = X.reshape(*p_ext, -1).astype(np.float64 if dtype[0] != "i" else np.int64)
    part = _NP_REDUCE[kind](flat * flat if sq else flat, axis=-1)
    ref = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
           "xor": np.bitwise_xor}[kind](ref_init, part)
    if dtype[0] == "i":
        assert np.array_equal(got, ref)
    else:
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), np.abs(got - ref).max()


def test_reduce_a_thread_per_output_emulated_on_cpu() -> None:
    # `per_thread` (column sums): each thread reduces its own row in sequence; no shuffles mix
    # neighbouring outputs
    rng = np.random.default_rng(5)
    X = rng.standard_normal((70, 45)).astype(np.float32)  # [output, r]: ragged last block
    out = rng.standard_normal(70).astype(np.float32)
    got = rd.emulate("add", "f32", lambda p, r: X[p[0], r[0]], (70,), (45,), out.copy(), p=rd.per_thread())
    ref = out.astype(np.float64) + X.astype(np.float64).sum(1)
    assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max()


def test_reduce_plan() -> None:
    assert rd.plan(37) == rd.Plan(True, 256, 32, 32) and rd.plan(None).per_warp
    assert rd.plan(3000) == rd.Plan(False, 256, 256, 32)
    assert rd.plan(1100, threads=1024) == rd.Plan(False, 1024, 1024, 32)


# ------------------------------------------------------------------------------------------------
# vortex tiled GEMM (local memory, register tiles; clamped loads + select at the edges)

from gac_torch.kernels import vortex_gemm as vg  # noqa: E402


@pytest.mark.parametrize("M,N,K,b_t,batch,fill", [
    (13, 10, 7, False, (), False),  # every dim overhangs its tile; K < 16
    (16, 16, 40, True, (), True),  # exact tiles, nn.Linear layout, fused fill
    (9, 23, 33, False, (2, 3), False),  # batch, the last staging round overhangs
])
def test_vortex_gemm_emulated_on_cpu(M, N, K, b_t, batch, fill) -> None:
    nb = len(batch)
    bd = tuple(range(nb))
    m, n, k = nb, nb + 1, nb + 2
    a_dims, b_dims, c_dims = bd + (m, k), bd + ((n, k) if b_t else (k, n)), bd + (m, n)
    ext = {**dict(zip(bd, batch)), m: M, n: N, k: K}

    def ty(dims):
        return "memref<" + "".join(f"{ext[d]}x" for d in dims) + "f32>"

    s = vg.GemmShape((m,), (M,), (n,), (N,), (k,), (K,), bd, batch, a_dims, b_dims, c_dims,
                     ty(a_dims), ty(b_dims), ty(c_dims))
    t = vg.choose_tiling(M, N, K)
    rng = np.random.default_rng(M + N + K)
    A, B, C = (rng.standard_normal([ext[d] for d in dims]).astype(np.float32) for dims in (a_dims, b_dims, c_dims))
    got = vg.emulate(s, t, A, B, C, init=0.5 if fill else None)
    Bm = np.swapaxes(B, -1, -2) if b_t else B
    ref = (0.5 if fill else C.astype(np.float64)) + A.astype(np.float64) @ Bm.astype(np.float64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    ir.Module.parse(vg.gemm_template(s, t, fill), ir.Context())


@pytest.mark.parametrize("pad,direct", [(0, False), (1, False), (1, True)])
def test_vortex_gemm_conv_subscripts_emulated_on_cpu(pad: int, direct: bool) -> None:
    """Implicit GEMM: out[n, f, oh, ow] += x[n, c, 2 oh + kh - pad, 2 ow + kw - pad] * w[f, c, kh, kw],
    A = w (rows f), B = x (columns n, oh, ow: linear subscripts), K over (c, kh, kw) = 27
    (overhangs). A padding is read through guarded loads: 0 outside x (negative subscripts
    too: unsigned compares), staged and direct tiles."""
    n, f, oh, ow, c, kh, kw = range(7)
    N, F, OH, OW, C, KH, KW = 2, 5, 4, 3, 3, 3, 3
    H, W = 2 * OH + KH - 2 - 2 * pad, 2 * OW + KW - 2 - 2 * pad
    a_dims, c_dims = (f, c, kh, kw), (n, f, oh, ow)
    shift = ((None, -pad),) if pad else ()
    b_dims = (n, c, ((oh, 2), (kh, 1), *shift), ((ow, 2), (kw, 1), *shift))
    s = vg.GemmShape((f,), (F,), (n, oh, ow), (N, OH, OW), (c, kh, kw), (C, KH, KW), (), (),
                     a_dims, b_dims, c_dims, f"memref<{F}x{C}x{KH}x{KW}xf32>",
                     f"memref<{N}x{C}x{H}x{W}xf32>", f"memref<{N}x{F}x{OH}x{OW}xf32>",
                     b_guard=((2, H), (3, W)) if pad else ())
    t = vg.choose_tiling(s.M, s.N, s.K, direct=direct)
    rng = np.random.default_rng(7)
    w, x = rng.standard_normal((F, C, KH, KW)).astype(np.float32), rng.standard_normal((N, C, H, W)).astype(np.float32)
    got = vg.emulate(s, t, w, x, np.zeros((N, F, OH, OW), np.float32), init=0.0)
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    patches = np.stack([[xp[:, :, i:i + 2 * OH - 1:2, j:j + 2 * OW - 1:2] for j in range(KW)] for i in range(KH)])
    ref = np.einsum("fcij,ijncyx->nfyx", w.astype(np.float64), patches.astype(np.float64))
    assert np.abs(got - ref).max() < 1e-4
    ir.Module.parse(vg.gemm_template(s, t, True), ir.Context())


@pytest.mark.parametrize("space", [False, True])
def test_vortex_gemm_epilogue_emulated_on_cpu(space: bool) -> None:
    """Z = relu(A @ B + bias[n]) in the store step, its operands over the GEMM's own dims or
    over Z's shape (the flat index delinearised); tiles overhang M and N (guarded stores)."""
    from gac_torch.kernels.conv_gemm import operand
    from gac_torch.kernels.gemm_epilogue import EOp, Epilogue

    M, N, K = 13, 10, 7
    f = "f32"
    s = vg.GemmShape((0,), (M,), (1,), (N,), (2,), (K,), (), (), (0, 2), (2, 1), (0, 1),
                     f"memref<{M}x{K}xf32>", f"memref<{K}x{N}xf32>", f"memref<{M}x{N}xf32>")
    dims = 2 if space else 3
    bias = operand(f"memref<{N}xf32>", f, (N,), (1,), 0, [({1: 1}, 0)], dims)
    z = operand(f"memref<{M}x{N}xf32>", f, (M, N), (N, 1), 0, [({0: 1}, 0), ({1: 1}, 0)], dims)
    at = (M, N) if space else None
    ops = (EOp("arith.addf", (("arg", 0), ("arg", 1)), "", (f, f), f),
           EOp("arith.maximumf", (("op", 0), ("const", "0.000000e+00", f)), "", (f, f), f))
    ep = vg.Fused(Epilogue((None, (bias, at)), (z, at), ops, ("op", 1)),
                  operand(f"memref<{M}x{N}xf32>", f, (M, N), (N, 1), 0, [({0: 1}, 0), ({1: 1}, 0)], 3))
    rng = np.random.default_rng(9)
    A, B, b = rng.standard_normal((M, K)), rng.standard_normal((K, N)), rng.standard_normal(N)
    t = vg.choose_tiling(M, N, K)
    got = vg.emulate(s, t, A, B, np.zeros((M, N)), init=0.0, ep=ep,
                     extra={"E1": b, "Z": np.full((M, N), np.nan)})
    ref = np.maximum(A @ B + b, 0)
    assert np.abs(got - ref).max() < 1e-4
    ir.Module.parse(vg.gemm_template(s, t, True, ep), ir.Context())


@pytest.mark.parametrize("n,per", [(1000, 1), (4100, 16), (512, 2)])
def test_vortex_fill_emulated_on_cpu(n: int, per: int) -> None:
    """Every element set once, nothing past n touched (the last CTA overhangs or not)."""
    from gac_torch.kernels import vortex_fill as vf

    buf = np.full(n, np.nan, np.float32)
    out = vf.emulate(n, per, 16, -np.inf, buf)
    assert (out == -np.inf).all()
    ir.Module.parse(vf.fill_template(n, per, 16, f"memref<{n}xf32>", "f32"), ir.Context())

"""Exact-fp32 GEMMs on the register-tiled SIMT kernel (`sgemm`, kernels/conv_gemm.py with
kind f32): every transpose combination of A and B read in place (transposes fold into the
matmul's maps: backends/gpu/transposes.py), odd shapes through guarded loads, the numpy
lockstep twin against float64, the strategy choice and ptxas (registers, spills) offline, and
float64 parity on the GPU (cuda-marked)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from parity import Fn

import gac_torch
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas
from gac_torch.kernels import conv_gemm as cg
from gac_torch.kernels import conv_gemm_plan as cgp
from gac_torch.kernels import conv_gemm_twin as twin

M_, N_, K_, B_ = range(4)
LAYOUTS = ["nn", "nt", "tn", "tt"]  # A as [m][k] (n) or [k][m] (t); B as [k][n] (n) or [n][k] (t)


def _dense(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))


def _operand(dims: tuple[int, ...], ranges: tuple[int, ...]) -> tuple[cg.Operand, tuple, tuple]:
    shape = tuple(ranges[d] for d in dims)
    t = "memref<" + "x".join(map(str, shape)) + "xf32>"
    st = _dense(shape)
    return cg.operand(t, "f32", shape, st, 0, [({d: 1}, 0) for d in dims], len(ranges)), shape, st


def gemm_spec(layout: str, m: int, n: int, k: int, batch: int = 0, fill: bool = True):
    """C[(b,) m, n] = sum_k A * B with A, B in `layout`: (spec, shapes, strides)."""
    ranges = (m, n, k) + ((batch,) if batch else ())
    bd = (B_,) if batch else ()
    a_dims = bd + ((M_, K_) if layout[0] == "n" else (K_, M_))
    b_dims = bd + ((K_, N_) if layout[1] == "n" else (N_, K_))
    ops = [_operand(d, ranges) for d in (a_dims, b_dims, bd + (M_, N_))]
    spec = cg.Spec("f32", (M_,), (N_,), (K_,), bd, ranges, ops[0][0], ops[1][0], ops[2][0], fill)
    return spec, [o[1] for o in ops], [o[2] for o in ops]


@pytest.mark.unit
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m,n,k,batch,big", [(37, 29, 45, 0, False),   # odd: scalar loads, guards
                                             (70, 68, 36, 2, False),   # float4 + cp.async, batched
                                             (130, 131, 20, 0, True),  # 128x128 tiles, ragged
                                             (70, 40, 2100, 0, False),  # split K (4 x 528)
                                             (40, 70, 1100, 3, False)])  # batched, split (2 x 560)
def test_twin_matches_float64_in_every_layout(layout: str, m: int, n: int, k: int, batch: int,
                                              big: bool) -> None:
    spec, shapes, strides = gemm_spec(layout, m, n, k, batch, fill=bool(batch) and k < 1024)
    p = cgp.plan(spec, big=big)  # (split K accumulates into C: the strategy unfolds the fill)
    assert p is not None and p.tm == p.bm // 16 and (p.bm == 128) == big
    assert (p.splits, p.kchunk) == {2100: (4, 528), 1100: (2, 560)}.get(k, (1, 0))
    # cp.async everywhere: vectors where the run along outer allows; a run along k element by
    # element, scattered into the [k][outer] tile
    a_run_k, b_run_k = layout[0] == "n", layout[1] == "t"
    for st, run, along_k in ((p.a, k if a_run_k else m, a_run_k), (p.b, k if b_run_k else n, b_run_k)):
        assert st.vec == (1 if along_k else next((v for v in (4, 2) if run % v == 0), 1))
        assert st.glob_k == st.scatter == along_k and st.cp
    rng = np.random.default_rng(m + n + k)
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    C0 = rng.standard_normal(shapes[2]).astype(np.float32)
    out = twin.emulate(spec, p, A, Bm, C0, tuple(strides), init=0.25).reshape(shapes[2])
    a64, b64 = A.astype(np.float64), Bm.astype(np.float64)
    if layout[0] == "t":
        a64 = a64.swapaxes(-1, -2)
    if layout[1] == "t":
        b64 = b64.swapaxes(-1, -2)
    ref = a64 @ b64 + (0.25 if spec.fill else C0.astype(np.float64))
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()


@pytest.mark.unit
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m,n,k,batch,big", [(128, 256, 48, 0, True),  # 3 slices, 4 buffers: prefetches past K
                                             (64, 64, 32, 0, False),   # 2 slices: the prologue's too
                                             (64, 128, 64, 3, False),  # batched
                                             (64, 128, 2048, 0, False)])  # split K, 4 whole chunks of 512
def test_lean_kernel_on_whole_tiles_matches_float64(layout: str, m: int, n: int, k: int, batch: int, big: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # M, N multiples of the tile, K of the slice: no bound checks (the lean kernel, default);
    # slices past K re-read the last one into buffers nobody computes with; the twin checks
    # the values and the shared-memory races, GAC_SGEMM_LEAN=0 keeps every check
    from gac_torch.kernels import conv_gemm_text

    spec, shapes, strides = gemm_spec(layout, m, n, k, batch, fill=k < 1024)  # (split K: C holds the init)
    p = cgp.plan(spec, big=big)
    monkeypatch.setenv("GAC_SGEMM_LEAN", "0")
    full = cgp.plan(spec, big=big)
    assert p is not None and p.lean and full is not None and not full.lean
    assert (p.splits > 1) == (k == 2048)
    checks = [conv_gemm_text.template(spec, q).count("arith.cmpi ult") for q in (p, full)]
    assert checks[0] < checks[1], checks
    rng = np.random.default_rng(m + n + k)
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    C0 = np.zeros(shapes[2], np.float32) if p.splits > 1 else rng.standard_normal(shapes[2]).astype(np.float32)
    out = twin.emulate(spec, p, A, Bm, C0, tuple(strides), init=0.25).reshape(shapes[2])
    a64 = A.astype(np.float64) if layout[0] == "n" else A.astype(np.float64).swapaxes(-1, -2)
    b64 = Bm.astype(np.float64) if layout[1] == "n" else Bm.astype(np.float64).swapaxes(-1, -2)
    ref = a64 @ b64 + (0.25 if spec.fill else C0.astype(np.float64))
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()


# --------------------------------------------------------------------------------------------
# the cuda pipeline offline: strategy choice, no transpose kernels, ptxas


_FNS = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.t(), "tn": lambda a, b: a.t() @ b,
        "tt": lambda a, b: a.t() @ b.t()}


def _compile_cuda(f, *xs):
    c = gac_torch.compile(Fn(f), xs, target="cuda",
                          options={"arch": "sm_90", "allow_tf32": False, "fallback": False})
    (part,) = c.compiled.partitions.values()
    return part


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_gemm_is_one_sgemm_kernel_without_spills(layout: str) -> None:
    # 2048^3 takes 128x128 tiles (a 16x16 grid); transposed operands are read in place
    n = 2048
    part = _compile_cuda(_FNS[layout], torch.randn(n, n), torch.randn(n, n))
    launches = [ln for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln]
    assert len(launches) == 1 and "_sgemm blocks in (%c16, %c16, %c1)" in launches[0], launches
    if find_ptxas() is None:
        pytest.fail("ptxas missing: the dev extra installs nvidia-cuda-nvcc-cu12")
    log = assemble(part.ir("ptx"), "sm_90").log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 128, log  # two blocks per SM (.minnctapersm 2)
    assert all(int(s) == 0 for s in re.findall(r"(\d+) bytes spill stores", log)), log


def test_exact_f32_gemm_offers_deeper_k_slices_as_a_choice() -> None:
    # 4096^3 (an MLP step's GEMM): 128-wide tiles with 16-deep slices by default, 32-deep
    # ones and 128-thread blocks candidates the autotuner measures (forcing one changes the
    # kernel, no spills)
    from gac_torch.backends.gpu import tuning

    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)

    def compile_with(force=None):
        with tuning.session(force=force) as s:
            return _compile_cuda(_FNS["nn"], a, b), s

    first, s = compile_with()
    (choice,) = [c for cs in s.kernels.values() for c in cs if c.key.startswith("igemm:f32")]
    assert set(choice.candidates) == {"tile128", "tile64", "tile128bk32", "tile128t128"}
    assert choice.heuristic == "tile128"
    for other in ("tile128bk32", "tile128t128"):
        forced, _ = compile_with({choice.key: other})
        assert forced.ir("ptx") != first.ir("ptx")
        assert ("threads in (%c128" in forced.ir("gpu")) == (other == "tile128t128")
        if find_ptxas() is not None:
            log = assemble(forced.ir("ptx"), "sm_90").log
            assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes spill stores", log)), log


def test_wide_tiles_fit_one_block_per_sm_without_spills(monkeypatch: pytest.MonkeyPatch) -> None:
    # GAC_SGEMM_BN=256 (being measured): 128x256 tiles, 8x16 accumulators per thread, one
    # block per SM (GAC_SGEMM_CTAS=1: up to 255 registers)
    monkeypatch.setenv("GAC_SGEMM_BN", "256")
    monkeypatch.setenv("GAC_SGEMM_CTAS", "1")
    for layout, m, n, k in (("nn", 130, 300, 40), ("tn", 128, 512, 64)):  # ragged; whole tiles (lean)
        spec, shapes, strides = gemm_spec(layout, m, n, k)
        p = cgp.plan(spec, big=True, dynamic_limit=227 * 1024)  # (over the static 48 KB)
        assert p is not None and (p.bn, p.tn) == (256, 16)
        rng = np.random.default_rng(m + n + k)
        A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
        out = twin.emulate(spec, p, A, Bm, np.zeros(shapes[2], np.float32), tuple(strides), init=0.5)
        a64 = A.astype(np.float64) if layout[0] == "n" else A.astype(np.float64).T
        ref = a64 @ Bm.astype(np.float64) + 0.5
        assert np.abs(out.reshape(shapes[2]) - ref).max() < 1e-5 * np.abs(ref).max()
    part = _compile_cuda(_FNS["nn"], torch.randn(2048, 2048), torch.randn(2048, 2048))
    assert re.search(r"_sgemm blocks in \(%c8, %c16, %c\d\)", part.ir("gpu"))  # (z: K split in 2)
    if find_ptxas() is not None:
        log = assemble(part.ir("ptx"), "sm_90").log
        assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes spill stores", log)), log


@pytest.mark.parametrize("cp_k", ["0", "1"])
@pytest.mark.parametrize("env", [{"GAC_SGEMM_BK": "32"}, {"GAC_SGEMM_BN": "256"}])
def test_k_run_operands_of_wide_tiles_take_dynamic_shared_memory(env: dict, cp_k: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # x @ W^T reads both operands along k: 4-byte cp.async scatters them into [k][outer] tiles
    # (GAC_SGEMM_CP_K=0: through registers, 2 buffers); 32-deep or 128x256 tiles pass the
    # static 48 KB and take dynamic shared memory (before: no plan, and the GEMM fell back to
    # simt_matmul's kernel); the twin checks a ragged one
    for k, v in {**env, "GAC_SGEMM_CP_K": cp_k}.items():
        monkeypatch.setenv(k, v)
    spec, shapes, strides = gemm_spec("nt", 130, 300, 70)
    p = cgp.plan(spec, big=True, dynamic_limit=227 * 1024)
    assert p is not None and p.dynamic
    if cp_k == "1":
        assert p.a.scatter and p.b.scatter and p.stages >= 3
    else:
        assert not (p.a.cp or p.b.cp) and p.stages == 2
    rng = np.random.default_rng(7)
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    out = twin.emulate(spec, p, A, Bm, np.zeros(shapes[2], np.float32), tuple(strides), init=0.5)
    ref = A.astype(np.float64) @ Bm.astype(np.float64).T + 0.5
    assert np.abs(out.reshape(shapes[2]) - ref).max() < 1e-5 * np.abs(ref).max()
    part = _compile_cuda(_FNS["nt"], torch.randn(2048, 2048), torch.randn(2048, 2048))
    launches = [ln for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln]
    assert "_sgemm" in launches[-1] and "dynamic_shared_memory_size" in launches[-1], launches  # (split K: a fill first)
    assert not any("_matmul" in ln for ln in launches), launches
    if find_ptxas() is not None and cp_k == "1":  # (through registers, 32-deep slices spill 4 bytes)
        log = assemble(part.ir("ptx"), "sm_90").log
        assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes spill stores", log)), log


@pytest.mark.parametrize("layout", LAYOUTS)
def test_128_thread_blocks_hold_8x16_tiles_and_match_float64(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # GAC_SGEMM_THREADS=128 (being measured): 128x128 tiles over 16 x 8 threads, each 8 x 16
    # accumulators in 4x4 quadrants 64 rows / 32 columns apart (a 128x256 tile's per-thread
    # work and shared-read economy at two blocks per SM); ragged M/N, fill and C-init
    monkeypatch.setenv("GAC_SGEMM_THREADS", "128")
    for m, n, k, fill in ((130, 131, 20, True), (128, 256, 64, False)):
        spec, shapes, strides = gemm_spec(layout, m, n, k, fill=fill)
        p = cgp.plan(spec, big=True, dynamic_limit=227 * 1024)
        assert p is not None and (p.threads, p.tm, p.tn, p.bm, p.bn) == (128, 8, 16, 128, 128)
        rng = np.random.default_rng(m + n + k)
        A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
        C0 = rng.standard_normal(shapes[2]).astype(np.float32)
        out = twin.emulate(spec, p, A, Bm, C0, tuple(strides), init=0.25).reshape(shapes[2])
        a64 = A.astype(np.float64) if layout[0] == "n" else A.astype(np.float64).T
        b64 = Bm.astype(np.float64) if layout[1] == "n" else Bm.astype(np.float64).T
        ref = a64 @ b64 + (0.25 if fill else C0.astype(np.float64))
        assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
    part = _compile_cuda(_FNS[layout], torch.randn(2048, 2048), torch.randn(2048, 2048))
    assert re.search(r"_sgemm blocks in \(%c16, %c16, %c1\) threads in \(%c128", part.ir("gpu"))
    if find_ptxas() is not None:
        log = assemble(part.ir("ptx"), "sm_90").log
        assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes spill stores", log)), log


def test_k_runs_stage_by_4_byte_cp_async_like_outer_runs() -> None:
    # x @ W^T reads both operands along k: by default each element is its own 4-byte cp.async
    # into the [k][outer] tile, so the kernel is the weight gradient's (dy^T @ x: 16-byte
    # copies) but for the copies: no register staging, the same FMAs and shared reads
    parts = {lay: _compile_cuda(_FNS[lay], torch.randn(2048, 2048), torch.randn(2048, 2048)) for lay in ("nt", "tn")}
    nt, tn = (parts[lay].ir("ptx") for lay in ("nt", "tn"))
    assert "ld.global" not in nt and nt.count("cp.async.ca.shared.global") == 4 * tn.count("cp.async.cg.shared.global")
    for op in ("fma.rn.f32", "ld.shared.v4.f32", "bar.sync"):
        assert nt.count(op) == tn.count(op), op


@pytest.mark.parametrize("order", ["", "rows"])
def test_fmas_go_down_and_up_columns(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a slice's FMAs column by column, every other one bottom-up: consecutive FMAs share b (an
    # a at the turns), which leaves ptxas fewer FMAs with two uncached sources in one register
    # bank (sm_90: 26 -> 12 % at 4096^3, same FMA count); GAC_SGEMM_ORDER=rows: row by row
    if order:
        monkeypatch.setenv("GAC_SGEMM_ORDER", order)
    ptx = _compile_cuda(_FNS["tn"], torch.randn(2048, 2048), torch.randn(2048, 2048)).ir("ptx")
    fmas = re.findall(r"fma\.rn\.f32\s+%r\d+, (%r\d+), (%r\d+), %r\d+;", ptx)[:64]  # k's 8 x 8
    a, b = [x for x, _ in fmas], [y for _, y in fmas]
    if order:
        assert [len(set(b[i:i + 8])) for i in range(0, 64, 8)] == [8] * 8 and len(set(a[:8])) == 1
    else:
        assert [len(set(b[i:i + 8])) for i in range(0, 64, 8)] == [1] * 8 and len(set(a[:8])) == 8
        assert a[8:16] == a[:8][::-1]


def test_register_staged_slice_loads_precede_the_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    # GAC_SGEMM_CP_K=0: x @ W^T stages both operands through registers. Their global loads come
    # right before the slice's barrier, as plain ld.global: ptxas does not move those past
    # bar.sync, so they are in flight during the slice's FMAs (ld.global.nc ones it sank to the
    # end of the FMAs, just before the shared stores waiting on them: their latency exposed)
    monkeypatch.setenv("GAC_SGEMM_CP_K", "0")
    part = _compile_cuda(_FNS["nt"], torch.randn(2048, 2048), torch.randn(2048, 2048))
    ptx = part.ir("ptx")
    assert "ld.global.nc" not in ptx
    lines = ptx.splitlines()
    before = []  # per bar.sync: the global vector loads since the last FMA or label
    for i, ln in enumerate(lines):
        if "bar.sync" in ln:
            j, n = i - 1, 0
            while j >= 0 and "fma.rn" not in lines[j] and not lines[j].startswith("$L"):
                n += "ld.global.v4" in lines[j]
                j -= 1
            before.append(n)
    assert max(before) >= 4, before  # (2 float4 of A and 2 of B per thread and slice)


def test_linear_backward_gemms_read_transposes_in_place() -> None:
    # an MLP step's three GEMM layouts (x @ W^T, dy^T @ x, dy @ W) and a 3-D linear: no
    # transpose kernel is left, every GEMM is an sgemm
    x, w, dy = torch.randn(96, 80), torch.randn(72, 80), torch.randn(96, 72)
    part = _compile_cuda(lambda x, w, dy: (x @ w.t(), dy.t() @ x, dy @ w,
                                           torch.nn.functional.linear(x.reshape(4, 24, 80), w)), x, w, dy)
    kernels = re.findall(r"gac_k\d+_(\w+)", part.ir("gpu"))
    assert sorted(set(kernels)) == ["sgemm"], kernels


def test_small_output_long_k_splits_k_after_a_fill_kernel() -> None:
    # a weight gradient dy^T @ x over 4096 tokens: 16 64x64 tiles -> 8 K chunks, atomically added
    # into C, which a fill kernel zeroes first (the fill is not folded in then)
    part = _compile_cuda(_FNS["tn"], torch.randn(4096, 256), torch.randn(4096, 256))
    launches = [ln for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln]
    assert len(launches) == 2 and "_loops" in launches[0], launches
    assert "_sgemm blocks in (%c4, %c4, %c8)" in launches[1], launches
    assert "atom.global.add.f32" in part.ir("ptx") or "red.global.add.f32" in part.ir("ptx")


def bias_tanh_spec(m: int, n: int, k: int):
    """tanh(x @ W^T + b) with the pre-activation tapped: (spec, shapes, strides) as gemm_spec."""
    from gac_torch.kernels.gemm_epilogue import EOp, Epilogue

    spec, shapes, strides = gemm_spec("nt", m, n, k)
    ranges = (m, n, k)
    bias, z = _operand((N_,), ranges)[0], _operand((M_, N_), ranges)[0]
    ops = (EOp("arith.addf", (("arg", 0), ("arg", 1)), "", ("f32", "f32"), "f32"),
           EOp("math.tanh", (("op", 0),), "", ("f32",), "f32"))
    ep = Epilogue((None, (bias, None)), (z, None), ops, ("op", 1), taps=((("op", 0), (z, None)),))
    return cg.Spec(**{**spec.__dict__, "epilogue": ep}), shapes, strides


def check_bias_tanh(m: int, n: int, k: int, plan_of) -> None:
    """The twin of `bias_tanh_spec` on the plan `plan_of(spec)` against float64: the tap and
    the tanh'd value."""
    spec, shapes, strides = bias_tanh_spec(m, n, k)
    p = plan_of(spec)
    rng = np.random.default_rng(3)
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    b = rng.standard_normal(n).astype(np.float32)
    tap, out = np.full((m, n), np.nan, np.float32), np.full((m, n), np.nan, np.float32)
    got = twin.emulate(spec, p, A, Bm, np.zeros((m, n), np.float32), tuple(strides), epi=(None, (b, (1,))),
                       out=(out, strides[2]), taps=((tap, strides[2]),)).reshape(m, n)
    ref = A.astype(np.float64) @ Bm.astype(np.float64).T + b
    assert np.abs(tap - ref).max() < 1e-5 * np.abs(ref).max()
    assert np.abs(got - np.tanh(ref)).max() < 1e-5


def test_epilogue_stores_a_tapped_stage_and_the_next_one() -> None:
    # x @ W^T + b is a graph output (the MLP's pre-activation, saved for the backward) that GELU
    # then reads: both stages run in the GEMM's epilogue, which stores the tap and the final
    # value (before: a loops kernel re-read the 64 MB pre-activation); twin on a ragged GEMM
    check_bias_tanh(130, 70, 40, lambda spec: cgp.plan(spec, big=True))

    def f(x, w, b):
        y = x @ w.t() + b
        return y, torch.tanh(y)

    part = _compile_cuda(f, torch.randn(300, 264), torch.randn(136, 264), torch.randn(136))
    kernels = re.findall(r"gac_k\d+_(\w+)", part.ir("gpu"))
    assert sorted(set(kernels)) == ["sgemm"], kernels
    if find_ptxas() is not None:
        assert assemble(part.ir("ptx"), "sm_90").ok


def test_dynamic_and_integer_matmuls_stay_on_simt_matmul() -> None:
    part = _compile_cuda(lambda a, b: a @ b, torch.randint(-5, 5, (33, 20)), torch.randint(-5, 5, (20, 17)))
    assert set(re.findall(r"gac_k\d+_(\w+)", part.ir("gpu"))) == {"matmul"}


def test_folded_transposes_match_eager_end_to_end_on_vortex() -> None:
    # the gpu layer's fold, run: the vortex functional simulator executes the same schedule
    pytest.importorskip("ziglang")
    pytest.importorskip("elftools")
    a, b = torch.randn(12, 10), torch.randn(9, 12)
    f = Fn(lambda a, b: (a.t() @ b.t(), torch.bmm(a.reshape(2, 6, 10).transpose(1, 2), a.reshape(2, 6, 10))))
    with torch.no_grad():
        compiled = gac_torch.compile(f, (a, b), target="vortex",
                                     options={"vortex_mode": "functional", "cache": False})
        got, want = compiled(a, b), f(a, b)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (part,) = compiled.compiled.partitions.values()
    assert "_loops" not in part.ir("gpu")  # no transpose kernel
    # a permutation moving the batch dim stays a transpose (batch_matmul keeps batch outermost)
    f = Fn(lambda a, b: torch.bmm(a.permute(1, 2, 0), b))
    a, b = torch.randn(5, 3, 4), torch.randn(3, 5, 6)
    with torch.no_grad():
        compiled = gac_torch.compile(f, (a, b), target="vortex",
                                     options={"vortex_mode": "functional", "cache": False, "fallback": False})
        torch.testing.assert_close(compiled(a, b), f(a, b), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# on the GPU: float64 parity (exact fp32: TF32 off)


def _check_gpu(f, *xs, tol: float = 1e-5) -> None:
    xs = tuple(x.cuda() for x in xs)
    compiled = gac_torch.compile(Fn(f), xs, target="cuda", options={"allow_tf32": False, "fallback": False})
    got = compiled(*xs)
    want = f(*(x.double() for x in xs))
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.isfinite(g).all()
        err = ((g.double() - w).norm() / w.norm()).item()
        assert err < tol, err


@pytest.mark.cuda
@pytest.mark.parametrize("layout,m,n,k", [  # odd sizes, a GEMV, float4 + cp.async, split K
    ("nn", 1, 77, 300), ("nn", 257, 200, 1001), ("nt", 37, 29, 45), ("nt", 136, 264, 4100),
    ("tn", 257, 200, 1001), ("tn", 136, 264, 4100), ("tt", 37, 29, 45), ("tt", 1, 77, 300),
    ("nn", 256, 384, 2048), ("nt", 256, 384, 2048), ("tn", 128, 256, 4096)])  # whole tiles: lean
def test_gemm_matches_float64_on_gpu(layout: str, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn((m, k) if layout[0] == "n" else (k, m), generator=g)
    b = torch.randn((k, n) if layout[1] == "n" else (n, k), generator=g)
    _check_gpu(_FNS[layout], a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("env", ["GAC_SGEMM_THREADS=128", "GAC_SGEMM_BN=256", "GAC_SGEMM_BK=32"])
@pytest.mark.parametrize("layout,m,n,k", [("nt", 1300, 1700, 301), ("tn", 1536, 1408, 512)])  # (>= 132 tiles: big)
def test_tile_variants_match_float64_on_gpu(env: str, layout: str, m: int, n: int, k: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the env-switch tilings gemm_variants.py measures, on a ragged GEMM with a fused GELU
    # epilogue (an MLP's forward) and a whole-tile (lean) one
    name, value = env.split("=")
    monkeypatch.setenv(name, value)  # (read when the kernel is planned; part of the cache key)
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn((m, k) if layout[0] == "n" else (k, m), generator=g)
    b = torch.randn((k, n) if layout[1] == "n" else (n, k), generator=g)
    f = _FNS[layout]
    _check_gpu((lambda a, b: torch.nn.functional.gelu(f(a, b))) if layout == "nt" else f, a, b)


@pytest.mark.cuda
def test_mlp_step_gemms_and_batched_linear_match_float64_on_gpu() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, bias, dy = (torch.randn(s, generator=g) for s in ((300, 264), (136, 264), (136,), (300, 136)))
    _check_gpu(lambda x, w, bias, dy: (torch.nn.functional.gelu(x @ w.t() + bias), dy.t() @ x, dy @ w,
                                       torch.nn.functional.linear(x.reshape(3, 100, 264), w, bias)),
               x, w, bias, dy)
    # the pre-activation returned too (the training step's forward): a tap in the epilogue
    _check_gpu(lambda x, w, bias: (lambda y: (y, torch.nn.functional.gelu(y)))(x @ w.t() + bias), x, w, bias)


def test_sm75_stages_through_registers() -> None:
    # cp.async exists from sm_80 on: older archs stage every operand through registers
    for arch in ("sm_75", "sm_80"):
        c = gac_torch.compile(Fn(_FNS["tn"]), (torch.randn(96, 64), torch.randn(96, 80)), target="cuda",
                              options={"arch": arch, "allow_tf32": False, "fallback": False})
        (part,) = c.compiled.partitions.values()
        assert set(re.findall(r"gac_k\d+_(\w+)", part.ir("gpu"))) == {"sgemm"}
        assert ("cp.async" in part.ir("ptx")) == (arch == "sm_80")
        if find_ptxas() is not None:
            assert assemble(part.ir("ptx"), arch).ok

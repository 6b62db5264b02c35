"""Stream-K for the exact-f32 sgemm (kernels/conv_gemm_streamk.py): the plan's cost rule, the
schedule covering every (tile, slice) once, the numpy twin against float64 on odd shapes whose
tiles split in 2-5 pieces (with and without an epilogue, C or a fill as the init), bit-identical
results whichever block draws the last ticket, the counters left at zero, ptxas offline
(registers, spills) and float64 parity on the GPU (cuda-marked)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from test_sgemm import _FNS, _check_gpu, _compile_cuda, check_bias_tanh, gemm_spec

from gac_torch.backends.cuda.ptxas import assemble, find_ptxas
from gac_torch.kernels import conv_gemm_plan as cgp
from gac_torch.kernels import conv_gemm_streamk as sk
from gac_torch.kernels import conv_gemm_twin as twin


@pytest.mark.unit
def test_plan_takes_stream_k_where_the_last_wave_is_partial(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4096^3: 1024 128x128 tiles over 264 slots = 3.88 waves (3.1 % lost): the 232 tiles of the
    # last wave are shared by 264 workers, the other 792 one block each
    spec = gemm_spec("tn", 4096, 4096, 4096)[0]
    p = cgp.plan(spec)
    assert p is not None and (p.sk_workers, p.sk_tiles, p.grid) == (264, 232, (264 + 792, 1, 1))
    assert max(len(s) for s in sk.schedule(spec, p)) == 2  # (225 of a tile's 256 slices each)
    # under a wave (2048^3: 256 tiles), short K, whole waves, K not whole slices: the plain grid
    for m, n, k in ((2048, 2048, 2048), (4096, 4096, 512), (4096, 8448, 1024), (4096, 4096, 4100),
                    (3000, 3000, 1040)):  # (ragged tiles: bound checks would spill)
        q = cgp.plan(gemm_spec("tn", m, n, k)[0])
        assert q is not None and not q.sk_workers and len(q.grid) == 3 and q.grid[0] > 1, (m, n, k)
    monkeypatch.setenv("GAC_SGEMM_STREAMK", "0")
    assert not cgp.plan(spec).sk_workers


@pytest.mark.unit
@pytest.mark.parametrize("tiles,nk,slots", [(6, 5, 4), (7, 6, 5), (1024, 256, 264), (11, 3, 4)])
def test_schedule_covers_every_slice_once(tiles: int, nk: int, slots: int) -> None:
    spec = gemm_spec("nn", 64 * tiles, 64, 16 * nk)[0]
    p = cgp.streamk(cgp.plan(spec, big=False), spec, slots=slots, force=True)
    seen = np.zeros((tiles, nk), int)
    for segs in sk.schedule(spec, p):
        assert segs and all(k0 < k1 for _, k0, k1 in segs)
        for t, k0, k1 in segs:
            seen[t, k0:k1] += 1
    assert (seen == 1).all()


def _run(layout: str, m: int, n: int, k: int, slots: int, fill: bool, big: bool = False,
         order: str = "grid", batch: int = 0):
    spec, shapes, strides = gemm_spec(layout, m, n, k, batch, fill=fill)
    p = cgp.streamk(cgp.plan(spec, big=big), spec, slots=slots, force=True)
    assert p.sk_workers == slots
    rng = np.random.default_rng(m + n + k)
    A, Bm = (rng.standard_normal(s).astype(np.float32) for s in shapes[:2])
    C0 = rng.standard_normal(shapes[2]).astype(np.float32)
    blocks = [(x, 0, 0) for x in range(p.grid[0])]
    ws: dict = {}
    out = twin.emulate(spec, p, A, Bm, C0, tuple(strides), init=0.25, sk=ws,
                       order=blocks[::-1] if order == "reversed" else blocks).reshape(shapes[2])
    assert (ws["F"] == 0).all()  # every counter back at zero for the next call
    a64 = A.astype(np.float64) if layout[0] == "n" else A.astype(np.float64).swapaxes(-1, -2)
    b64 = Bm.astype(np.float64) if layout[1] == "n" else Bm.astype(np.float64).swapaxes(-1, -2)
    return out, a64 @ b64 + (0.25 if fill else C0.astype(np.float64)), p, spec


@pytest.mark.unit
@pytest.mark.parametrize("layout,m,n,k,slots,fill", [
    ("nt", 130, 100, 80, 4, True),  # ragged, 6 tiles: 2 stream-K tiles in 2 pieces each
    ("tn", 70, 130, 96, 5, False),  # C as the init (the first piece only), one tile in 5 pieces
    ("nn", 128, 192, 96, 4, True),  # whole tiles and slices: the lean kernel (clamped prefetch)
    ("tt", 37, 200, 48, 3, False),  # 4 tiles, 1 stream-K tile in 3 pieces
    ("nt", 100, 130, 90, 4, True)])  # K not whole slices: the segment's k offsets the slices
def test_twin_matches_float64_and_any_last_block(layout: str, m: int, n: int, k: int, slots: int,
                                                 fill: bool) -> None:
    out, ref, p, spec = _run(layout, m, n, k, slots, fill)
    pieces = [sum(t == 0 for segs in sk.schedule(spec, p) for t, _, _ in segs)]
    assert 2 <= pieces[0] <= 5, pieces
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
    rev = _run(layout, m, n, k, slots, fill, order="reversed")[0]  # other blocks draw the last tickets
    assert np.array_equal(out, rev)


@pytest.mark.unit
@pytest.mark.parametrize("layout,m,n,k,batch,big,slots", [
    ("tn", 130, 260, 64, 0, True, 4),  # 128x128 tiles (64 accumulators a thread), 6 tiles
    ("nt", 70, 60, 80, 3, False, 4)])  # batched: tiles over (batch, m, n), 6 tiles
def test_wide_tiles_and_batches_match_float64(layout: str, m: int, n: int, k: int, batch: int, big: bool,
                                               slots: int) -> None:
    out, ref, p, spec = _run(layout, m, n, k, slots, True, big=big, batch=batch)
    assert p.bm == (128 if big else 64) and p.sk_tiles == 6 % 4
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()


@pytest.mark.unit
def test_split_tiles_run_the_epilogue_once_on_the_whole_sum() -> None:
    # x @ W^T + b, tanh'd, the pre-activation a tap: a wrong partial would show after tanh
    def plan_of(spec):
        p = cgp.streamk(cgp.plan(spec, big=False), spec, slots=4, force=True)
        assert p.sk_tiles == 6 % 4 and p.sk_workers == 4  # (130 x 70: 6 tiles)
        return p

    check_bias_tanh(130, 70, 80, plan_of)


def test_mlp_gemm_compiles_to_stream_k_without_spills() -> None:
    # 4096^2 x 4096 with a bias + GELU epilogue: the counters' zero kernel, then 1056 blocks;
    # two blocks per SM still (<= 128 registers), no spills
    n = 4096
    part = _compile_cuda(lambda a, b, c: torch.nn.functional.gelu(a.t() @ b + c),
                         torch.randn(n, n), torch.randn(n, n), torch.randn(n))
    launches = [ln for ln in part.ir("gpu").splitlines() if "gpu.launch_func" in ln]
    assert len(launches) == 2 and "_loops" in launches[0] and "memref<232xi32>" in launches[0], launches
    assert "_sgemm blocks in (%c1056, %c1, %c1)" in launches[1], launches
    ptx = part.ir("ptx")
    assert "atom.global.add.u32" in ptx and "fence.acq_rel.gpu" in ptx
    if find_ptxas() is None:
        pytest.fail("ptxas missing: the dev extra installs nvidia-cuda-nvcc-cu12")
    log = assemble(ptx, "sm_90").log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 128, log
    assert all(int(s) == 0 for s in re.findall(r"(\d+) bytes spill stores", log)), log


@pytest.mark.cuda
@pytest.mark.parametrize("layout,m,n,k", [
    ("nt", 3072, 3072, 1040),  # 576 tiles (2.18 waves), 48 stream-K tiles
    ("tn", 4096, 4096, 1024),  # whole tiles (lean): 232 stream-K tiles in 2 pieces
    ("nn", 2944, 3328, 2048)])  # 23 x 26 = 598 tiles
def test_stream_k_gemm_matches_float64_on_gpu(layout: str, m: int, n: int, k: int) -> None:
    assert cgp.plan(gemm_spec(layout, m, n, k)[0]).sk_workers  # (the rule takes these)
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn((m, k) if layout[0] == "n" else (k, m), generator=g)
    b = torch.randn((k, n) if layout[1] == "n" else (n, k), generator=g)
    f = _FNS[layout]
    import gac_torch
    from parity import Fn

    xs = (a.cuda(), b.cuda())
    got = gac_torch.compile(Fn(f), xs, target="cuda", options={"allow_tf32": False, "fallback": False})(*xs)
    want = f(*(x.double() for x in xs))  # element by element: a lost or doubled piece shows
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.cuda
def test_stream_k_epilogue_matches_float64_on_gpu_run_to_run() -> None:
    # the MLP's forward shape (bias + GELU, the pre-activation tapped), twice: bit-identical
    g = torch.Generator().manual_seed(1)
    x, w, bias = (torch.randn(s, generator=g) for s in ((4096, 1024), (4096, 1024), (4096,)))
    _check_gpu(lambda x, w, bias: (lambda y: (y, torch.nn.functional.gelu(y)))(x @ w.t() + bias), x, w, bias)
    import gac_torch
    from parity import Fn

    xs = tuple(t.cuda() for t in (x, w, bias))
    c = gac_torch.compile(Fn(lambda x, w, bias: torch.nn.functional.gelu(x @ w.t() + bias)), xs,
                          target="cuda", options={"allow_tf32": False, "fallback": False})

    def run() -> torch.Tensor:
        out = c(*xs)
        return (out if isinstance(out, tuple) else (out,))[0].clone()

    first = run()
    for _ in range(3):
        assert torch.equal(run(), first)

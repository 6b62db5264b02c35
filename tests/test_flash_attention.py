"""The flash-attention kernel (gac_torch/kernels/flash_attention.py) on the CPU: its numpy
lockstep twin against a float64 reference on odd shapes, masks and causal, race detection, and
the PTX of every kind through the cuda pipeline (ptxas: no spills)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import gac_torch
from gac_torch.backends.cuda import ptxas
from gac_torch.frontends.fx import compile_graph
from gac_torch.kernels import flash_attention as fa
from gac_torch.kernels import flash_attention_twin as twin
from gac_torch.kernels.flash_attention_text import template
from gac_torch.kernels.builder import RaceError, round_to
from gac_torch.options import resolve

# ‖out − ref‖ / ‖ref‖ bounds (METHOD.md): P is rounded to the operand type for the P·V mma.
TOL = {"f16": 2e-3, "bf16": 1.2e-2, "tf32": 2e-3, "f32x3": 1e-5}
_ELEM = {"f16": "f16", "bf16": "bf16", "tf32": "f32", "f32x3": "f32"}


def _buf(shape, elem) -> fa.Buf:
    strides = [1]
    for s in reversed(shape[1:]):
        strides.insert(0, strides[0] * s)
    return fa.Buf(f"memref<{'x'.join(map(str, shape))}x{elem}>", elem, tuple(shape), tuple(strides))


def _case(kind, batch, L, S, D, Dv, mask_kind="none", mshape=None, causal=False, seed=0):
    rng = np.random.default_rng(seed)
    e = _ELEM[kind]
    q = rng.standard_normal(batch + (L, D)).astype(np.float32)
    k = rng.standard_normal(batch + (S, D)).astype(np.float32)
    v = rng.standard_normal(batch + (S, Dv)).astype(np.float32)
    mask = mb = None
    if mask_kind != "none":
        mshape = mshape or batch + (L, S)
        if mask_kind == "bool":
            mask, mb = (rng.random(mshape) > 0.4).astype(np.int8), _buf(mshape, "i8")
        else:
            mask, mb = rng.standard_normal(mshape).astype(np.float32), _buf(mshape, e)
    scale = 1 / math.sqrt(D)
    spec = fa.Spec(kind, _buf(batch + (L, D), e), _buf(batch + (S, D), e), _buf(batch + (S, Dv), e),
                   _buf(batch + (L, Dv), e), mb, mask_kind, scale, causal)
    return spec, q, k, v, mask


# (kind, batch, L, S, D, Dv, mask kind, mask shape, causal): seq 1/7/65/130, head dims 16..256
CASES = [
    ("f16", (1,), 1, 7, 16, 16, "none", None, False),
    ("f16", (1,), 9, 33, 48, 24, "none", None, True),  # an odd count of 8-column output tiles
    ("bf16", (2, 1), 7, 65, 32, 32, "none", None, True),
    ("f16", (1, 2), 65, 130, 64, 64, "add", (1, 1, 1, 130), False),
    ("bf16", (1,), 130, 65, 80, 80, "bool", None, False),
    ("f16", (1,), 65, 65, 128, 128, "bool", (1, 65, 1), True),
    ("bf16", (1,), 7, 130, 256, 256, "add", None, True),
    ("tf32", (2,), 65, 7, 32, 48, "add", (2, 1, 7), False),
    ("tf32", (1,), 7, 65, 128, 128, "none", None, True),
    ("f32x3", (1,), 130, 65, 16, 8, "bool", None, True),
    ("f32x3", (1,), 1, 1, 80, 80, "none", None, False),
    ("f32x3", (1,), 65, 7, 256, 256, "none", None, False),
]


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_twin_matches_float64(case):
    kind, batch, L, S, D, Dv, mk, ms, causal = case
    spec, q, k, v, mask = _case(kind, batch, L, S, D, Dv, mk, ms, causal)
    p = fa.plan(spec)
    assert p is not None
    out = twin.emulate(spec, p, q, k, v, mask)
    assert not np.isnan(out).any(), "an output element was not written"
    e = _ELEM[kind]
    ref = twin.reference(round_to(q, e), round_to(k, e), round_to(v, e),
                         mask if mk != "add" else round_to(mask, e), mk, spec.scale, causal)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL[kind], err


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["bf16", "f32x3"])
def test_twin_eight_warps(kind):
    spec, q, k, v, mask = _case(kind, (1,), 130, 70, 32, 48, "add", (1, 1, 70), True)
    p = fa.plan(spec, big=True)
    assert p.warps == 8 and p.bm == 128
    out = twin.emulate(spec, p, q, k, v, mask)
    e = _ELEM[kind]
    ref = twin.reference(round_to(q, e), round_to(k, e), round_to(v, e), round_to(mask, e), "add", spec.scale, True)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL[kind]


@pytest.mark.parametrize("kind,tiles,mt,D", [("bf16", (4, 128), 1, 64), ("f16", (8, 128), 1, 32),
                                             ("f32x3", (4, 64), 1, 32), ("tf32", (8, 32), 1, 48),
                                             ("bf16", (4, 64), 2, 64), ("f16", (2, 128), 2, 32)])
def test_twin_other_tilings(kind, tiles, mt, D):
    """The tilings benchmarks/flash_variants.py times ((warps, BN), m-tiles a warp), on odd L
    and S (S past one 128-key tile), a broadcast additive mask and causal."""
    spec, q, k, v, mask = _case(kind, (1,), 70, 131, D, D, "add", (1, 1, 131), True, seed=2)
    p = fa.plan(spec, tiles=(tiles,), mt=mt)
    assert (p.warps, p.bn, p.bm) == (*tiles, 16 * tiles[0] * mt)
    out = twin.emulate(spec, p, q, k, v, mask)
    e = _ELEM[kind]
    ref = twin.reference(round_to(q, e), round_to(k, e), round_to(v, e), round_to(mask, e), "add", spec.scale, True)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL[kind]


@pytest.mark.parametrize("kind,stages,mt", [("bf16", 1, 1), ("bf16", 2, 1), ("f16", 2, 2)])
def test_twin_kv_stages(kind, stages, mt):
    """Two K/V stages (f16/bf16 with D <= 64: Q's fragments straight from global memory, the
    next tile loading during the whole of this one, one barrier a tile) and one, over seven
    key tiles (the last partial), rows past L, causal and a broadcast additive mask."""
    spec, q, k, v, mask = _case(kind, (2,), 70, 200, 40, 24, "add", (1, 70, 1), True, seed=6)
    p = fa.plan(spec, tiles=((4, 32),), mt=mt, stages=stages)
    assert p.stages == stages
    assert template(spec, p).count("gpu.barrier") == (2 if stages == 2 else 5)  # 1 a tile (+ 1 peeled), or 2 (+ Q's)
    out = twin.emulate(spec, p, q, k, v, mask)
    e = _ELEM[kind]
    ref = twin.reference(round_to(q, e), round_to(k, e), round_to(v, e), round_to(mask, e), "add", spec.scale, True)
    assert not np.isnan(out).any() and np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL[kind]


@pytest.mark.parametrize("kind,mt,mask_kind", [("bf16", 1, "none"), ("f16", 2, "add")])
def test_twin_lazy_rescale(kind, mt, mask_kind, monkeypatch):
    """f16/bf16 rescale O and l only when a row max grows by more than RESCALE (log2 units).
    Keys scaled up along the row make the max grow by ~20 units a tile, so later tiles rescale;
    with the threshold at infinity the first max is never taken and p overflows (the test
    sees the rescaling)."""
    spec, q, k, v, mask = _case(kind, (2,), 40, 200, 32, 32, mask_kind, (1, 1, 200) if mask_kind == "add" else None,
                                False, seed=8)
    k = k * (1 + 40 * np.arange(200) / 200)[None, :, None].astype(np.float32)
    p = fa.plan(spec, tiles=((2, 32),), mt=mt)
    e = _ELEM[kind]
    ref = twin.reference(round_to(q, e), round_to(k, e), round_to(v, e), None if mask is None else round_to(mask, e),
                         mask_kind, spec.scale, False)

    def err() -> float:
        with np.errstate(invalid="ignore", over="ignore"):
            out = twin.emulate(spec, p, q, k, v, mask)
            return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err() < TOL[kind]
    monkeypatch.setattr(fa, "RESCALE", math.inf)
    assert not err() < TOL[kind]


def test_plan_kv_stages():
    """The default: two stages where Q's fragments stay in registers (f16/bf16, D <= 64) and
    both stages fit 48 KB; one otherwise."""
    for kind, D, stages in (("bf16", 64, 2), ("f16", 32, 2), ("bf16", 80, 1), ("f16", 128, 1), ("tf32", 32, 1)):
        spec, *_ = _case(kind, (64,), 4096, 4096, D, D)
        p = fa.plan(spec)
        assert p.stages == stages, (kind, D)
        assert fa.smem_bytes(spec, p.bm, p.bn, p.dp, p.dvc, p.pad, p.stages) <= 48 * 1024
    spec, *_ = _case("bf16", (64,), 4096, 4096, 64, 64)
    assert fa.plan(spec, tiles=((4, 128),)).stages == 1  # two 128-key stages of K and V: 72 KB
    assert fa.plan(_case("tf32", (1,), 7, 7, 16, 16)[0], stages=2) is None


@pytest.mark.unit
def test_plan_default_tiles():
    """The default tiling, deterministic: where 128-row blocks fill the GPU, f16/bf16 with
    D, Dv <= 32, no mask, not causal take 4 warps of 2 m-tiles (measured faster on the H200);
    masks, causal, wider heads, f32 and a forced `big` keep 8 warps of one; small grids 4 of one."""
    def tiling(kind, D, Dv=None, batch=(8, 8), L=2500, mk="none", causal=False, **kw):
        spec = _case(kind, batch, L, L, D, Dv or D, mk, (1, 1, 1, L) if mk != "none" else None, causal)[0]
        p = fa.plan(spec, **kw)
        assert p == fa.plan(spec, **kw)
        return p.warps, p.bn, p.mt, p.stages, p.bm
    for kind in ("bf16", "f16"):
        for D in (32, 24, 16):
            assert tiling(kind, D) == (4, 64, 2, 2, 128), (kind, D)
    assert tiling("bf16", 32, causal=True) == (8, 64, 1, 2, 128)
    assert tiling("bf16", 32, mk="add") == tiling("f16", 32, mk="bool") == (8, 64, 1, 2, 128)
    assert tiling("bf16", 32, 64) == tiling("bf16", 48) == tiling("bf16", 64) == (8, 64, 1, 2, 128)
    assert tiling("f32x3", 32) == tiling("tf32", 32) == (8, 64, 1, 1, 128)
    assert tiling("bf16", 32, L=250) == (4, 64, 1, 2, 64)  # 128 blocks of 128 rows: under two an SM
    assert tiling("bf16", 32, big=True) == (8, 64, 1, 2, 128)
    assert tiling("bf16", 32, mt=1) == (8, 64, 1, 2, 128)


@pytest.mark.parametrize("kind,D,Dv", [("bf16", 32, 32), ("f16", 24, 16)])
def test_twin_default_two_m_tiles(monkeypatch, kind, D, Dv):
    """The default 4 warps of 2 m-tiles (taken here on a small grid: SM_COUNT_HINT 1) on odd L
    and S: rows past L in both m-tiles of the last block, a partial last key tile."""
    monkeypatch.setattr(fa, "SM_COUNT_HINT", 1)
    spec, q, k, v, _ = _case(kind, (2,), 301, 263, D, Dv, seed=9)
    p = fa.plan(spec)
    assert (p.warps, p.mt, p.stages) == (4, 2, 2)
    out = twin.emulate(spec, p, q, k, v)
    e = _ELEM[kind]
    ref = twin.reference(round_to(q, e), round_to(k, e), round_to(v, e), None, "none", spec.scale, False)
    assert not np.isnan(out).any() and np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL[kind]


def test_two_m_tiles_odd_rows_and_bool_mask():
    """Two m-tiles a warp: the second tile's rows run past L (L = 70 in a 128-row block)."""
    spec, q, k, v, mask = _case("bf16", (2,), 70, 33, 80, 40, "bool", None, False, seed=4)
    p = fa.plan(spec, tiles=((4, 32),), mt=2)
    out = twin.emulate(spec, p, q, k, v, mask)
    ref = twin.reference(round_to(q, "bf16"), round_to(k, "bf16"), round_to(v, "bf16"), mask, "bool", spec.scale, False)
    assert not np.isnan(out).any() and np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL["bf16"]
    assert fa.plan(_case("f32x3", (1,), 7, 7, 16, 16)[0], mt=2) is None  # f32 kinds: one m-tile


def test_twin_catches_a_read_before_the_copy_lands(monkeypatch):
    spec, q, k, v, _ = _case("bf16", (1,), 20, 70, 16, 16)
    monkeypatch.setattr(twin.FlashNumpy, "wait_async", lambda self: None)
    with pytest.raises(AssertionError, match="never written"):
        twin.emulate(spec, fa.plan(spec), q, k, v)


@pytest.mark.unit
def test_fully_masked_rows_give_zero():
    spec, q, k, v, _ = _case("bf16", (1,), 9, 20, 16, 16, "none")
    mask = np.ones((1, 9, 20), dtype=np.int8)
    mask[0, 3] = 0  # query 3 sees no key
    spec = fa.Spec(spec.kind, spec.q, spec.k, spec.v, spec.o, _buf((1, 9, 20), "i8"), "bool", spec.scale, False)
    out = twin.emulate(spec, fa.plan(spec), q, k, v, mask)
    assert (out[0, 3] == 0).all() and np.abs(out[0, 2]).sum() > 0


@pytest.mark.unit
def test_twin_catches_a_missing_barrier(monkeypatch):
    spec, q, k, v, _ = _case("f16", (1,), 20, 70, 16, 16)
    monkeypatch.setattr(twin.FlashNumpy, "barrier", lambda self: None)
    with pytest.raises(RaceError):
        twin.emulate(spec, fa.plan(spec), q, k, v)


@pytest.mark.unit
def test_plan_fits_shared_memory_and_splits_wide_values():
    for kind in fa.KINDS:
        for D in (16, 32, 64, 80, 128, 256):
            spec, *_ = _case(kind, (1,), 1, 1, D, D)
            p = fa.plan(spec)
            assert p is not None and fa.smem_bytes(spec, p.bm, p.bn, p.dp, p.dvc, p.pad) <= 48 * 1024
            assert p.dvc <= 128 and p.grid[1] == -(-D // p.dvc)
    spec, *_ = _case("f16", (1,), 1, 1, 16, 300)
    assert fa.plan(spec) is None  # head dims over 256: the unfused maths


@contextlib.contextmanager
def tf32(allowed: bool):
    """torch's TF32 flag (gac follows it at compile time), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.set_float32_matmul_precision("high" if allowed else "highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


# ------------------------------------------------------------------------------------------------
# PTX through the cuda pipeline: one flash kernel per attention, the kind's mma, no spills

_PTXAS = ptxas.find_ptxas()
_MMA = {"f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        "f32x3": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}
_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "f32x3": torch.float32}


@pytest.mark.parametrize("kind,D,mask,causal", [
    ("f16", 64, None, False), ("bf16", 128, "bool", True), ("bf16", 256, "add", False),
    ("tf32", 80, None, True), ("f32x3", 32, "add", False), ("f32x3", 256, None, False)])
def test_ptx_per_kind(monkeypatch, kind, D, mask, causal):
    monkeypatch.setenv("GAC_FLASH_WGMMA", "0")  # (the mma.sync kernel on sm_90 too)
    dt = _DTYPE[kind]
    q, k, v = (torch.randn(2, 3, 65, D, dtype=dt) for _ in range(3))
    m = None if mask is None else (torch.rand(2, 1, 65, 65) > 0.5 if mask == "bool" else torch.randn(1, 3, 65, 65, dtype=dt))
    fn = lambda a, b, c, mm: torch.ops.aten._scaled_dot_product_efficient_attention(
        a, b, c, mm, False, 0.0, causal)[0]
    def ptx_for(arch: str, allow_tf32: bool) -> str:
        gm = make_fx(fn, tracing_mode="fake")(q, k, v, m)  # (compiling rewrites the graph)
        with tf32(allow_tf32):
            return compile_graph(gm, resolve({"target": "cuda", "fallback": False, "arch": arch})).ir("ptx")

    for arch in ("sm_80", "sm_90"):
        ptx = ptx_for(arch, kind == "tf32")
        assert [line for line in ptx.splitlines() if ".entry" in line and "flash" in line], ptx[:2000]
        assert {line.split()[0] for line in ptx.splitlines() if "mma.sync" in line} == {_MMA[kind]}
        if _PTXAS is None:
            pytest.skip("ptxas not found (pip install nvidia-cuda-nvcc-cu12)")
        result = ptxas.assemble(ptx, arch, _PTXAS)
        assert result.ok, result.log
        assert " 0 bytes spill stores" in result.log and "spill stores" in result.log, result.log
    if kind == "tf32":  # the exact mode issues three mma per product
        def n_mma(ptx: str) -> int:
            return sum("mma.sync" in line for line in ptx.splitlines())
        assert n_mma(ptx_for("sm_90", False)) == 3 * n_mma(ptx)


def test_two_attentions_get_two_flash_kernels():
    """Every attention of a graph gets its own kernel (the first version named both launches
    alike, so outlining renamed the second and it lost its strategy name)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 33, 64)
    with torch.no_grad():
        ptx = gac_torch.compile(enc, (x,), target="cuda", options={"fallback": False}).ir("ptx")
    flash = [line for line in ptx.splitlines() if ".entry" in line and "_flash(" in line]
    assert len(flash) == 2, [line for line in ptx.splitlines() if ".entry" in line]


def test_tc_dot_truncates_like_the_tensor_cores():
    """The twin's mma adds as the hardware does: toward zero, so a long chain drifts low."""
    a = np.ones((1, 16, 8), np.float32)
    b = np.full((1, 8, 8), 2.0**-26, np.float32)
    c = np.ones((1, 16, 8))  # 1 + 8 · 2^-26: the exact sum is 1 + 2^-23 (one ulp up)
    assert (twin.tc_dot(a, b, c) == np.float32(1 + 2.0**-23)).all()
    b[:] = 1.5 * 2.0**-26  # exact sum 1 + 1.5 ulp: one ulp (each term cut to the grid), not two
    assert (twin.tc_dot(a, b, c) == np.float32(1 + 2.0**-23)).all()


def test_f32x3_long_rows_keep_f32_error():
    """Exact f32 over 2500 keys (the sdpa_f32_8x8x2500x32 row): one mma chain for P·V over every
    key drifted to 2.1e-5 in the twin (1.8e-5 measured on the H200; eager 6.5e-7). Each key
    tile now accumulates P·V afresh and adds it to O in an fma rounded to nearest."""
    spec, q, k, v, _ = _case("f32x3", (1,), 16, 2500, 32, 32, seed=3)
    out = twin.emulate(spec, fa.plan(spec), q, k, v)
    ref = twin.reference(q, k, v, None, "none", spec.scale, False)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-6

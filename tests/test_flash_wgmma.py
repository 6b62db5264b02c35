"""The Hopper flash-attention kernel (gac_torch/kernels/flash_wgmma.py) without a GPU: its numpy
twin (warpgroups as threads, TMA and wgmma modelled on shared-memory bytes) against a float64
reference on odd shapes, head dims, causal and tilings; the twin's own checks; the routing
(GAC_FLASH_WGMMA) and the PTX (sm_90a, ptxas: no spills)."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gac_torch.backends.cuda import ptxas
from gac_torch.frontends.fx import compile_graph
from gac_torch.kernels import flash_wgmma as fw
from gac_torch.kernels import flash_wgmma_twin as tw
from gac_torch.kernels import wgmma_plan
from gac_torch.kernels.builder import RaceError
from gac_torch.kernels.flash_attention_twin import reference
from gac_torch.options import resolve
from tests.test_flash_attention import TOL, _case

# (kind, batch, L, S, D, Dv, causal, plan overrides): sequence lengths off the tiles, more key
# tiles than stages, every head dim (swizzle 32 / 64 / 128 bytes, 1 or 2 boxes a row); "ctas":
# a persistent grid smaller than the work (each CTA takes several work tiles); "pingpong": the
# consumers (2 or 3) take turns (named barriers: the twin checks none is left with arrivals pending);
# "poly": exponentials by the polynomial (EXP2_POLY); row sums by the tensor cores (onesum, the
# default: a ones box shared by the stages, or one a stage where V takes two boxes) or by adds;
# 3 consumers with 128-key tiles (24-register producer)
CASES = [
    ("bf16", (1,), 37, 130, 64, 64, False, {}),
    ("f16", (2,), 130, 37, 32, 32, True, {}),
    ("bf16", (1,), 65, 200, 128, 128, True, {}),
    ("f16", (1, 2), 7, 9, 16, 16, False, {}),
    ("bf16", (1,), 130, 601, 64, 64, False, {"bn": 64, "persistent": False}),
    ("bf16", (1, 2), 130, 601, 64, 64, False, {"bn": 64, "ctas": 3}),
    ("f16", (3,), 200, 300, 128, 64, True, {"bn": 64, "stages": 3, "ctas": 2}),
    ("bf16", (1,), 37, 700, 32, 128, False, {"wgs": 3, "stages": 4}),
    ("bf16", (2,), 130, 1, 16, 32, False, {}),
    ("f16", (2,), 250, 250, 16, 16, True, {"wgs": 1, "bn": 192, "ctas": 3}),
    ("bf16", (1, 2), 130, 601, 64, 64, False, {"bn": 64, "pingpong": True, "ctas": 3}),
    ("f16", (2,), 130, 37, 32, 32, True, {"pingpong": True}),
    ("bf16", (1,), 37, 130, 64, 64, False, {"poly": 2}),
    ("f16", (2,), 130, 300, 32, 32, True, {"poly": 3}),
    ("f16", (1,), 65, 200, 128, 128, False, {"poly": 8}),
    ("bf16", (1,), 130, 601, 64, 64, True, {"bn": 64, "serial": True}),
    ("bf16", (1,), 37, 130, 64, 64, False, {"onesum": False}),
    ("f16", (2,), 130, 300, 32, 32, True, {"onesum": False, "stages": 3}),
    ("f16", (1,), 130, 300, 128, 128, False, {"bn": 64, "onesum": True}),
    ("bf16", (1, 2), 250, 601, 64, 64, False, {"wgs": 3, "bn": 128, "ctas": 2}),
    ("bf16", (1,), 800, 260, 64, 64, False, {"ctas": 2}),  # (the default at head dim 64: 3 consumers)
    # 3 consumers taking turns (a ring of named barriers), several work tiles a CTA, causal
    ("bf16", (1, 2), 250, 601, 64, 64, False, {"wgs": 3, "pingpong": True, "ctas": 2}),
    ("f16", (2,), 300, 260, 64, 64, True, {"wgs": 3, "bn": 64, "pingpong": True, "ctas": 3}),
]


def _emulate(case):
    kind, batch, L, S, D, Dv, causal, kw = case
    spec, q, k, v, _ = _case(kind, batch, L, S, D, Dv, "none", None, causal)
    kw = dict(kw)
    ctas, poly, serial = kw.pop("ctas", None), kw.pop("poly", 0), kw.pop("serial", False)
    p = fw.plan(spec, **kw)
    assert p is not None
    p = dataclasses.replace(p, grid=(ctas, 1, 1) if ctas else p.grid, poly=poly, serial=serial)
    out = tw.emulate(spec, p, q, k, v)
    return out, reference(q, k, v, None, "none", spec.scale, causal)


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])) + "-" + "-".join(f"{k}{v}" for k, v in c[7].items()))
def test_twin_matches_float64(case):
    out, ref = _emulate(case)
    assert not np.isnan(out).any(), "an output element was not written"
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL[case[0]]


def test_twin_catches_a_wrong_stride_byte_offset(monkeypatch):
    orig = tw._WgTwin.descriptor
    monkeypatch.setattr(tw._WgTwin, "descriptor", lambda self, a, lbo, sbo, sw: orig(self, a, lbo, sbo // 2, sw))
    out, ref = _emulate(CASES[0])
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) > 0.1


def test_twin_catches_a_tma_write_under_a_pending_wgmma():
    spec, *_ = _case("bf16", (1,), 64, 64, 64, 64)
    p = fw.plan(spec)
    arrays = {w: np.ones((1, 64, 64), np.float32) for w in "QKV"}
    cta = tw._Cta(spec, p, arrays, (0, 0, 0))
    b = tw._WgTwin(cta, 0)
    lay = fw.layout(spec, p)
    b.mbar_init(b.const(lay.bars), 1)
    b.mask = b.tid() == 0
    b.mbar_expect(b.const(lay.bars), 2 * lay.k_stage)
    b.tma_load("K", b.const(lay.k), [b.const(0), b.const(0), b.const(0)], b.const(lay.bars))
    d = b.descriptor(b.const(lay.k), 16, 1024, 128)
    b.wgmma_ss(None, d, d, 128)  # (in flight: not yet waited for)
    with pytest.raises(RaceError):
        b.tma_load("K", b.const(lay.k), [b.const(0), b.const(64), b.const(0)], b.const(lay.bars))


def test_exp2_polynomial():
    x = np.linspace(-100, 8, 100001).astype(np.float32)
    rel = np.abs(tw._WgTwin.fexp2_poly(x) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 1e-4
    assert (tw._WgTwin.fexp2_poly(np.array([-np.inf], np.float32)) < 1e-36).all()  # (masked keys)


def test_descriptor_bits():
    assert fw.descriptor(0x1230, 16, 1024, 128) == wgmma_plan.descriptor(0x1230, 16, 1024)
    assert fw.descriptor(0, 16, 512, 64) >> 62 == 2 and fw.descriptor(0, 16, 256, 32) >> 62 == 3
    assert [fw.swizzle(o, 128) for o in (0, 128, 16 + 7 * 128)] == [0, 128 + 16, 7 * 128 + 16 * (1 ^ 7)]


def test_plan_takes_only_what_it_covers():
    spec, *_ = _case("bf16", (4, 16), 4096, 4096, 64, 64)
    p = fw.plan(spec)
    assert p is not None and p.bm == 192 and fw.layout(spec, p).total <= fw.SMEM_LIMIT
    assert p.stages == 4 and p.onesum and p.nv == 72  # (stage and phase by shifts; sums by wgmma)
    assert p.producer_regs * fw.WG + p.wgs * p.consumer_regs * fw.WG <= 65536 and p.consumer_regs == 160
    assert fw.plan(_case("bf16", (4, 16), 4096, 4096, 64, 64, causal=True)[0]).bm == 128
    for args in [("tf32", (1,), 65, 65, 64, 64), ("bf16", (1,), 65, 65, 80, 80), ("f16", (1,), 65, 65, 256, 256)]:
        assert fw.plan(_case(*args)[0]) is None
    assert fw.plan(_case("f16", (1,), 65, 65, 64, 64, "add")[0]) is None  # masks: the mma.sync kernel


# ------------------------------------------------------------------------------------------------
# routing and PTX

_PTXAS = ptxas.find_ptxas()


def _ptx(monkeypatch, on: bool, dt, shape, D, causal=False, mask=False, arch="sm_90"):
    monkeypatch.setenv("GAC_FLASH_WGMMA", "1" if on else "0")
    B, H, L, S = shape
    q, k, v = torch.randn(B, H, L, D, dtype=dt), torch.randn(B, H, S, D, dtype=dt), torch.randn(B, H, S, D, dtype=dt)
    m = torch.randn(1, H, L, S, dtype=dt) if mask else None
    fn = lambda a, b, c, mm: torch.ops.aten._scaled_dot_product_efficient_attention(a, b, c, mm, False, 0.0, causal)[0]  # noqa: E731
    gm = make_fx(fn, tracing_mode="fake")(q, k, v, m)
    return compile_graph(gm, resolve({"target": "cuda", "fallback": False, "arch": arch, "cache": False})).ir("ptx")


@pytest.mark.parametrize("dt,shape,D,causal", [
    (torch.bfloat16, (4, 16, 4096, 4096), 64, False), (torch.bfloat16, (8, 8, 2500, 2500), 32, False),
    (torch.float16, (1, 2, 130, 37), 128, True), (torch.float16, (2, 1, 7, 9), 16, False)])
def test_fa3_chosen_and_assembles(monkeypatch, dt, shape, D, causal):
    ptx = _ptx(monkeypatch, True, dt, shape, D, causal)
    assert ".target sm_90a" in ptx and ptx.count("_fa3(") == 1 and "_flash(" not in ptx
    e = "bf16" if dt == torch.bfloat16 else "f16"
    shapes = {line.split()[0] for line in ptx.splitlines() if line.strip().startswith("wgmma.mma_async")}
    bn = 128 if D <= 64 else 80 if causal else 112  # (plan: Dv = 128 takes narrower key tiles)
    nv = D + 8 if D <= 64 else D  # (P V: 8 columns of ones where V is one box)
    assert shapes == {f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{e}.{e}",
                      f"wgmma.mma_async.sync.aligned.m64n{nv}k16.f32.{e}.{e}"}
    assert _PTXAS is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
    assert result.ok, result.log
    assert " 0 bytes spill stores" in result.log and "wgmma" not in result.log.lower().replace("gac_k0_fa3", ""), result.log


@pytest.mark.parametrize("on,mask,arch", [(False, False, "sm_90"), (True, True, "sm_90"), (True, False, "sm_80")])
def test_other_cases_keep_the_mma_flash(monkeypatch, on, mask, arch):
    ptx = _ptx(monkeypatch, on, torch.bfloat16, (1, 2, 65, 65), 64, mask=mask, arch=arch)
    assert ptx.count("_flash(") == 1 and "_fa3(" not in ptx


def test_compile_cache_key_follows_the_opt_in(monkeypatch):
    """A kernel compiled with GAC_FLASH_WGMMA=0 is not served from the cache once it is 1."""
    from gac_torch.options import resolve
    from gac_torch.runtime import cache

    def key() -> str:
        return cache.cache_key("module", "sig", resolve({"target": "cuda", "arch": "sm_90"}), "cuda")

    monkeypatch.setenv("GAC_FLASH_WGMMA", "0")
    off = key()
    monkeypatch.setenv("GAC_FLASH_WGMMA", "1")
    assert key() != off


@pytest.mark.parametrize("D,fa3", [(64, True), (32, False)])
def test_default_routes_head_dims_from_64_to_fa3(monkeypatch, D, fa3):
    monkeypatch.delenv("GAC_FLASH_WGMMA", raising=False)
    q = torch.randn(1, 2, 65, D, dtype=torch.bfloat16)
    fn = lambda a, b, c: torch.ops.aten._scaled_dot_product_efficient_attention(a, b, c, None, False, 0.0, False)[0]  # noqa: E731
    gm = make_fx(fn, tracing_mode="fake")(q, q, q)
    ptx = compile_graph(gm, resolve({"target": "cuda", "fallback": False, "arch": "sm_90", "cache": False})).ir("ptx")
    assert ("_fa3(" in ptx) == fa3 and ("_flash(" in ptx) == (not fa3)

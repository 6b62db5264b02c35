"""The Vortex tensor-core unit: the functional simulator's WMMA (sim_tcu) against float64 math
through the fragment map, and the opt-in TCU GEMM (option vortex_tcu) on f16/bf16 matmuls of
odd shapes vs eager -- on the functional simulator (CI) and on a SimX built with the TCU
(`VORTEX_TCU_HOME`: CONFIGS=-DVX_CFG_EXT_TCU_ENABLE; skipped without one), where outputs and
instruction counts must equal the functional simulator's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("ziglang")
pytest.importorskip("elftools")

from parity import Fn

import gac_torch
from gac_torch.backends import vortex
from gac_torch.backends.vortex import sim_tcu
from gac_torch.backends.vortex.target import WMMA
from gac_torch.errors import OptionError, TargetUnavailable

TCU_HOME = os.environ.get("VORTEX_TCU_HOME")
needs_tcu_simx = pytest.mark.skipif(not TCU_HOME, reason="needs VORTEX_TCU_HOME (a SimX built with the TCU)")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # ~2 ulps of the output's rounding, relative


def _pack(a: np.ndarray, b: np.ndarray, c: np.ndarray, elem: str) -> np.ndarray:
    """A (8x8), B (8x4) in `elem`, C (8x4) f32 into a warp's FP registers by Wmma's lane map."""
    bits = (lambda x: x.astype(np.float16).view(np.uint16)) if elem == "f16" else (
        lambda x: (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    ab, bb = bits(a).astype(np.uint32), bits(b).astype(np.uint32)
    f = np.zeros((32, 4), np.uint32)
    for lane in range(4):
        h, p = lane // 2, lane % 2
        for k in range(2):
            kk = 4 * k + 2 * p
            for m in range(4):
                r = 2 * m + h
                f[WMMA.a_base + WMMA.a_reg(m, k), lane] = ab[r, kk] | (ab[r, kk + 1] << 16)
            for n in range(2):
                col = 2 * n + h
                f[WMMA.b_base + WMMA.b_reg(n, k), lane] = bb[kk, col] | (bb[kk + 1, col] << 16)
        for m in range(4):
            for n in range(2):
                f[WMMA.c_base + WMMA.c_reg(m, n), lane] = np.float32(c[2 * m + h, 2 * n + p]).view(np.uint32)
    return f


@pytest.mark.parametrize("elem", ["f16", "bf16"])
def test_wmma_model_is_c_plus_a_times_b(elem):
    rng = np.random.default_rng(3)
    a, b, c = rng.standard_normal((8, 8)), rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
    rd = (lambda x: x.astype(np.float16).astype(np.float64)) if elem == "f16" else (
        lambda x: ((x.astype(np.float32).view(np.uint32) >> 16) << 16).view(np.float32).astype(np.float64))
    f = _pack(a, b, c, elem)
    sim_tcu.wmma(f, elem)
    d = np.zeros((8, 4))
    for lane in range(4):
        for m in range(4):
            for n in range(2):
                d[2 * m + lane // 2, 2 * n + lane % 2] = f[WMMA.c_reg(m, n), lane].view(np.float32)
    ref = np.float32(c).astype(np.float64) + rd(a) @ rd(b)     # products exact: f32 sums only
    np.testing.assert_allclose(d, ref, rtol=1e-6, atol=1e-5)


class _Linear(torch.nn.Module):
    def __init__(self, k: int, n: int, dtype: torch.dtype, bias: bool = False, relu: bool = False):
        super().__init__()
        self.lin, self.relu = torch.nn.Linear(k, n, bias=bias).to(dtype), relu

    def forward(self, x):
        y = self.lin(x)
        return torch.relu(y) if self.relu else y


CASES = {   # name -> (module, input shapes): M, K, N off the 8x8x4 tile
    "mm_13x21x10": (lambda dt: Fn(lambda x, y: x @ y), [(13, 21), (21, 10)]),
    "mm_17x16x9": (lambda dt: Fn(lambda x, y: x @ y), [(17, 16), (16, 9)]),
    "mm_16x16x8": (lambda dt: Fn(lambda x, y: x @ y), [(16, 16), (16, 8)]),   # no overhang: no guards
    "mm_at_12x20x9": (lambda dt: Fn(lambda x, y: x.t() @ y), [(20, 12), (20, 9)]),   # A's k strided
    "linear_2x5x24x7": (lambda dt: _Linear(24, 7, dt), [(2, 5, 24)]),
    "bmm_3x9x11x6": (lambda dt: Fn(torch.bmm), [(3, 9, 11), (3, 11, 6)]),
    "linear_bias_relu_6x19x12": (lambda dt: _Linear(19, 12, dt, bias=True, relu=True), [(6, 19)]),
}


def _run(name: str, dtype: torch.dtype, mode: str, tcu: bool = True, home: str | None = None):
    torch.manual_seed(hash(name) % 1000)
    make, shapes = CASES[name]
    mod = make(dtype)
    if isinstance(mod, _Linear):
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(torch.randn_like(p))
    xs = [torch.randn(*s).to(dtype) for s in shapes]
    opts = {"vortex_mode": mode, "vortex_tcu": tcu, "fallback": False, "cache": False}
    if home:
        opts["vortex_home"] = home
    compiled = gac_torch.compile(mod, tuple(xs), target="vortex", options=opts)
    out = compiled(*xs)
    with torch.no_grad():
        ref = mod.double()(*[x.double() for x in xs]) if isinstance(mod, _Linear) else mod(*[x.double() for x in xs])
    return out, ref, vortex.last_counters(compiled)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_tcu_gemm_parity_functional(name, dtype, monkeypatch):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    out, ref, c = _run(name, dtype, "functional")
    assert any(k["kernel"].endswith("_tcu") for k in c["kernels"]), c["kernels"]
    assert c["launches"] == 1, c["kernels"]   # the f16/bf16 rounding (bias, ReLU) in the store step
    assert c["divergent_branches"] == 0
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= TOL[dtype], (name, float(err))


def test_tcu_gemm_without_epilogue(monkeypatch):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    with vortex.compile_flags(gemm_epilogue=False):
        out, ref, c = _run("linear_bias_relu_6x19x12", torch.float16, "functional")
    assert c["launches"] > 1 and c["kernels"][0]["kernel"].endswith("_tcu")
    assert (out.double() - ref).abs().max() / ref.abs().max() <= TOL[torch.float16]


def test_tcu_is_opt_in(monkeypatch):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    monkeypatch.delenv("GAC_VORTEX_TCU", raising=False)
    _, _, c = _run("mm_13x21x10", torch.float16, "functional", tcu=None)
    assert not any(k["kernel"].endswith("_tcu") for k in c["kernels"])
    monkeypatch.setenv("GAC_VORTEX_TCU", "1")
    _, _, c = _run("mm_13x21x10", torch.float16, "functional", tcu=None)
    assert any(k["kernel"].endswith("_tcu") for k in c["kernels"])


def test_tcu_needs_four_thread_warps(monkeypatch):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    x, y = torch.randn(9, 10).half(), torch.randn(10, 5).half()
    with pytest.warns(gac_torch.errors.GacCompilerWarning, match="4-thread warps"):
        compiled = gac_torch.compile(Fn(lambda a, b: a @ b), (x, y), target="vortex", options={
            "vortex_mode": "functional", "vortex_tcu": True, "vortex_config": "1x4x8", "cache": False})
    out = compiled(x, y)
    assert not any(k["kernel"].endswith("_tcu") for k in vortex.last_counters(compiled)["kernels"])
    assert (out.double() - x.double() @ y.double()).abs().max() <= 2e-3 * (x.double() @ y.double()).abs().max()


def test_vortex_tcu_option_is_checked():
    with pytest.raises(OptionError, match="vortex_tcu"):
        gac_torch.compile(Fn(lambda x: x + 1), (torch.ones(2),), target="vortex",
                          options={"vortex_mode": "functional", "vortex_tcu": "yes"})


def test_wmma_is_illegal_without_the_unit():
    """A device without a TCU rejects the instruction (SimX built without it aborts on it)."""
    from gac_torch.backends.vortex import FunctionalDevice, KernelSpec, build, pack_args
    from gac_torch.backends.vortex.target import DEFAULT_CONFIG, VortexConfig

    asm, cons = WMMA.asm("f16")
    ft = ", ".join(["float"] * 8)
    ir = (f"define void @k(ptr %o) {{\n  %r = call {{ {ft} }} asm sideeffect \"{asm}\", \"{cons}\"("
          + ", ".join(["float 1.0"] * 20) + f")\n  %d = extractvalue {{ {ft} }} %r, 0\n"
          "  store float %d, ptr %o\n  ret void\n}")
    prog = build(ir=[ir], kernels=[KernelSpec("k", ("ptr",))])
    for cfg, ok in ((VortexConfig(tcu=True), True), (DEFAULT_CONFIG, False)):
        dev = FunctionalDevice(cfg)
        buf = dev.alloc(4)
        run = lambda: dev.launch(dev.load_module(prog.vxbin), "k", pack_args(("ptr",), [buf.address]),
                                 grid=(1, 1, 1), block=(4, 1, 1))
        if ok:
            run()
            assert dev.download(buf, np.float32)[0] != 1.0
        else:
            with pytest.raises(Exception, match="no tensor-core unit"):
                run()


@needs_tcu_simx
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", ["mm_13x21x10", "linear_2x5x24x7", "linear_bias_relu_6x19x12"])
def test_tcu_gemm_on_simx_matches_functional(name, dtype, monkeypatch):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    fout, ref, fc = _run(name, dtype, "functional")
    sout, _, sc = _run(name, dtype, "simx", home=TCU_HOME)
    assert torch.equal(sout.view(torch.int16), fout.view(torch.int16))   # bit-identical
    assert [k["instructions"] for k in sc["kernels"]] == [k["instructions"] for k in fc["kernels"]]
    assert sc["cycles"] > 0
    assert (sout.double() - ref).abs().max() / ref.abs().max() <= TOL[dtype]


@pytest.mark.simx
def test_tcu_needs_a_simx_with_the_unit(monkeypatch):
    """VORTEX_HOME without the TCU: compiling with vortex_tcu fails at load, naming the fix."""
    from gac_torch.backends.vortex import runtime

    dev = runtime.device("simx", os.environ["VORTEX_HOME"])
    if dev.config.tcu:
        pytest.skip("this SimX build has the TCU")
    with pytest.raises(TargetUnavailable, match="VX_CFG_EXT_TCU_ENABLE"):
        _run("mm_13x21x10", torch.float16, "simx")


def test_contiguous_pairs_load_as_words(monkeypatch):
    """A linear layer's operands are k-contiguous: every pair is one 32-bit load, no halves
    (the first half's 4-byte alignment lets LLVM combine the two)."""
    from gac_torch.backends.vortex import disassemble

    monkeypatch.delenv("VORTEX_HOME", raising=False)
    x = torch.randn(8, 16).half()
    mod = _Linear(16, 4, torch.float16)
    compiled = gac_torch.compile(mod, (x,), target="vortex", options={
        "vortex_mode": "functional", "vortex_tcu": True, "fallback": False, "cache": False})
    ex = next(iter(compiled.compiled.partitions.values())).executable
    ops = [ln.split()[2] for ln in disassemble(ex.program.vxbin).splitlines() if ln.startswith("  ")]
    assert "vx.wmma" in ops
    assert not {"lh", "lhu"} & set(ops), sorted(set(ops))
    assert ops.count("flw") + ops.count("lw") >= 12

"""The Hopper flash-attention kernel on the GPU (marked cuda; kernels/flash_wgmma.py, opt-in with
GAC_FLASH_WGMMA=1): parity with a float64 reference over odd shapes (sequence lengths that are
not multiples of the tiles), head dims 16-128, causal, f16 and bf16, tilings; each compiled graph
holds one `fa3` kernel. Tolerances as tests/test_cuda_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gac_torch
from tests.parity import Fn
from tests.test_cuda_attention import REL, _rel

pytestmark = pytest.mark.cuda
DT = {"f16": torch.float16, "bf16": torch.bfloat16}

CASES = [  # (B, H, L, S, D, Dv, causal)
    (1, 2, 37, 130, 64, 64, False),
    (2, 1, 130, 37, 32, 32, True),
    (1, 2, 65, 300, 128, 128, True),
    (2, 3, 7, 9, 16, 16, False),
    (1, 1, 200, 601, 64, 128, False),
    (8, 8, 250, 250, 32, 32, False),
    (5, 30, 200, 260, 64, 64, True),  # 4 x 150 work tiles: the persistent grid takes several each
    (3, 50, 800, 777, 64, 64, False),  # 3 consumers (the default from L = 768 at head dim 64), odd L and S
]


def _run(kind, case, env: dict[str, str], monkeypatch):
    B, H, L, S, D, Dv, causal = case
    monkeypatch.setenv("GAC_FLASH_WGMMA", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=DT[kind], generator=g)
               for n, d in ((L, D), (S, D), (S, Dv)))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    compiled = gac_torch.compile(Fn(fn), (q, k, v), target="cuda", options={"fallback": False, "cache": False})
    ptx = compiled.ir("ptx")
    assert ptx.count("_fa3(") == 1 and "_flash(" not in ptx, ptx.split("\n.version")[0]
    out = compiled(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    return _rel(out, ref)


@pytest.mark.parametrize("kind", list(DT))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sdpa_fa3_parity(kind, case, monkeypatch):
    assert _run(kind, case, {}, monkeypatch) < REL[kind]


@pytest.mark.parametrize("env", [{"GAC_FLASH_WGMMA_STAGES": "2"}, {"GAC_FLASH_WGMMA_PERSISTENT": "0"},
                                 {"GAC_FLASH_WGMMA_BN": "64"}, {"GAC_FLASH_WGMMA_PINGPONG": "1"},
                                 {"GAC_FLASH_WGMMA_POLY": "2"}, {"GAC_FLASH_WGMMA_SERIAL": "1"},
                                 {"GAC_FLASH_WGMMA_WGS": "3", "GAC_FLASH_WGMMA_BN": "64"},
                                 {"GAC_FLASH_WGMMA_WGS": "3", "GAC_FLASH_WGMMA_BN": "128"},
                                 {"GAC_FLASH_WGMMA_ONESUM": "0"},
                                 {"GAC_FLASH_WGMMA_STAGES": "3"},
                                 {"GAC_FLASH_WGMMA_WGS": "3", "GAC_FLASH_WGMMA_PINGPONG": "1"}],
                         ids=lambda e: ",".join(f"{k[17:]}={v}" for k, v in e.items()))
def test_sdpa_fa3_tilings(env, monkeypatch):
    assert _run("bf16", (1, 2, 200, 601, 64, 64, True), env, monkeypatch) < REL["bf16"]


@pytest.mark.parametrize("shape", [(8, 8, 2500, 32), (4, 16, 4096, 64)], ids=lambda s: "x".join(map(str, s)))
def test_sdpa_fa3_bench_shapes_at_eager_error(shape, monkeypatch):
    """The bench rows sdpa_bf16_*: gac's error at most twice eager's (cuDNN / flash), with the
    row sums by the tensor cores (4096 keys of bf16-rounded P summed by wgmma)."""
    B, H, L, D = shape
    monkeypatch.setenv("GAC_FLASH_WGMMA", "1")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    compiled = gac_torch.compile(Fn(F.scaled_dot_product_attention), (q, k, v), target="cuda",
                                 options={"fallback": False, "cache": False})
    assert compiled.ir("ptx").count("_fa3(") == 1
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    err, eager = _rel(compiled(q, k, v), ref), _rel(F.scaled_dot_product_attention(q, k, v), ref)
    print(f"sdpa bf16 {shape}: gac {err:.2e} eager {eager:.2e}")
    assert err < 2 * eager + 1e-3


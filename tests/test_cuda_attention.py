"""Flash attention on the GPU (marked cuda): parity with a float64 reference and with eager for
sdpa (every kind: f16, bf16, f32 exact via 3xTF32, TF32 when allowed), masks, causal, odd shapes,
and the encoder layer; each compiled graph must hold one flash kernel and no score matrix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gac_torch
from tests.parity import Fn
from tests.test_flash_attention import tf32

pytestmark = pytest.mark.cuda
# ‖out − ref‖ / ‖ref‖ (METHOD.md); f32 is the exact mode (3xTF32), tf32 the TF32 one
REL = {"f32": 1e-5, "tf32": 3e-3, "f16": 3e-3, "bf16": 1.5e-2}
DT = {"f32": torch.float32, "tf32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _rel(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES = [  # (B, H, L, S, D, Dv, mask, causal)
    (2, 3, 1, 7, 16, 16, None, False),
    (1, 2, 65, 130, 64, 64, "add", False),
    (2, 1, 130, 65, 80, 80, "bool", False),
    (1, 2, 7, 7, 128, 128, None, True),
    (1, 1, 65, 65, 256, 256, "bool", False),  # torch refuses a mask together with is_causal
    (1, 1, 65, 65, 256, 256, None, True),
    (8, 8, 250, 250, 32, 32, None, False),
]


@pytest.mark.parametrize("kind", list(REL))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sdpa_flash_parity(kind, case):
    B, H, L, S, D, Dv, mk, causal = case
    dt = DT[kind]
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=dt, generator=g)
               for n, d in ((L, D), (S, D), (S, Dv)))
    inputs = [q, k, v]
    if mk == "add":
        inputs.append(torch.randn(1, H, L, S, device="cuda", dtype=dt, generator=g))
    elif mk == "bool":
        inputs.append(torch.rand(B, 1, L, S, device="cuda", generator=g) > 0.3)

    def fn(q, k, v, *m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[0] if m else None, is_causal=causal)
    with tf32(kind == "tf32"):
        compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"fallback": False})
    ptx = compiled.ir("ptx")  # (f16/bf16 with head dims >= 64 and no mask: the Hopper kernel fa3)
    assert ptx.count("_flash(") + ptx.count("_fa3(") == 1 and "_reduce(" not in ptx, compiled.ir("gpu")
    out = compiled(*inputs)
    ref = fn(*[t.double() if t.is_floating_point() else t for t in inputs])
    assert _rel(out, ref) < REL[kind]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_layer_flash_parity(dtype):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 8, 512, dropout=0.0, batch_first=True).eval().to("cuda", dtype)
    x = torch.randn(1, 500, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        compiled = gac_torch.compile(layer, (x,), target="cuda", options={"fallback": False})
        assert compiled.ir("ptx").count("_flash(") == 1
        out = compiled(x)
        ref = layer.double()(x.double())
    assert _rel(out, ref) < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("shape", [(8, 8, 2500, 32), (4, 16, 4096, 64)], ids=lambda s: "x".join(map(str, s)))
def test_sdpa_f32_long_rows_at_eager_error(shape):
    """The bench rows sdpa_f32_*: exact f32 over 2500 / 4096 keys. One mma chain over every key
    gave 1.8e-5 / 2.9e-5 (the tensor cores truncate while they add; eager 6.5e-7 / 6.9e-7);
    each key tile now accumulates afresh and joins O through an fma."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
    fn = F.scaled_dot_product_attention
    with tf32(False):
        compiled = gac_torch.compile(Fn(fn), (q, k, v), target="cuda", options={"fallback": False})
        assert compiled.ir("ptx").count("_flash(") == 1
        out, eager = compiled(q, k, v), fn(q, k, v)
    ref = fn(q.double(), k.double(), v.double())
    err, err_eager = _rel(out, ref), _rel(eager, ref)
    print(f"sdpa f32 {shape}: gac {err:.2e}, eager {err_eager:.2e}")
    assert err < 1e-5 and err < 3 * err_eager


@pytest.mark.parametrize("tiles,mt,stages", [((4, 128), 1, None), ((8, 128), 1, None), ((4, 64), 2, None),
                                             ((4, 128), 2, None), ((8, 64), 1, 1), ((4, 64), 1, 2)], ids=str)
def test_sdpa_flash_other_tilings(monkeypatch, tiles, mt, stages):
    """The tilings benchmarks/flash_variants.py times (not the default plan's; one or two K/V
    stages), on odd sizes with an additive mask and with causal: parity before any of them
    becomes a default."""
    from gac_torch.kernels import flash_attention as fa

    orig = fa.plan
    monkeypatch.setattr(fa, "plan", lambda spec, *a, **k: orig(spec, *a, tiles=(tiles,), mt=mt, stages=stages))
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(2, 3, n, 32, device="cuda", dtype=torch.bfloat16, generator=g) for n in (300, 271, 271))
    m = torch.randn(1, 3, 300, 271, device="cuda", dtype=torch.bfloat16, generator=g)
    for causal, inputs in ((False, (q, k, v, m)), (True, (q, k, v))):
        def fn(q, k, v, *mm):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mm[0] if mm else None, is_causal=causal)
        compiled = gac_torch.compile(Fn(fn), inputs, target="cuda", options={"fallback": False, "cache": False})
        assert compiled.ir("ptx").count("_flash(") == 1
        out = compiled(*inputs)
        assert _rel(out, fn(*[t.double() for t in inputs])) < REL["bf16"]
        if stages is not None:
            assert compiled.ir("ptx").count("bar.sync") == (2 if stages == 2 else 5)


@pytest.mark.parametrize("dtype,D,Dv", [(torch.bfloat16, 32, 32), (torch.float16, 24, 16)], ids=str)
def test_sdpa_flash_default_two_m_tiles(monkeypatch, dtype, D, Dv):
    """The default at head dims <= 32 where 128-row blocks fill the GPU (the bench row
    sdpa_bf16_8x8x2500x32): 4 warps of 2 m-tiles, taken here on odd sizes (SM_COUNT_HINT 1)."""
    from gac_torch.kernels import flash_attention as fa

    monkeypatch.setattr(fa, "SM_COUNT_HINT", 1)
    g = torch.Generator(device="cuda").manual_seed(19)
    q, k, v = (torch.randn(2, 3, n, d, device="cuda", dtype=dtype, generator=g) for n, d in ((301, D), (263, D), (263, Dv)))
    fn = F.scaled_dot_product_attention
    compiled = gac_torch.compile(Fn(fn), (q, k, v), target="cuda", options={"fallback": False, "cache": False})
    launch = [line for line in compiled.ir("ptx").splitlines() if line.startswith("// launch") and "_flash" in line]
    assert len(launch) == 1 and "grid=(3, 1, 6) block=(128, 1, 1)" in launch[0], launch
    tol = REL["f16" if dtype == torch.float16 else "bf16"]
    assert _rel(compiled(q, k, v), fn(q.double(), k.double(), v.double())) < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sdpa_lazy_rescale_growing_keys(monkeypatch, dtype):
    """f16/bf16 rescale O and l only when a row max of the warp grows by more than 8 log2 units
    (a warp vote and branch): keys scaled up along the row make later tiles rescale, the
    bench shape's head dim (two K/V stages) and an odd one. (The mma.sync kernel: fa3 off.)"""
    monkeypatch.setenv("GAC_FLASH_WGMMA", "0")
    g = torch.Generator(device="cuda").manual_seed(17)
    for D in (64, 40):
        q, k, v = (torch.randn(2, 4, n, D, device="cuda", dtype=dtype, generator=g) for n in (300, 333, 333))
        k = k * (1 + 40 * torch.arange(333, device="cuda", dtype=dtype) / 333)[:, None]
        fn = F.scaled_dot_product_attention
        compiled = gac_torch.compile(Fn(fn), (q, k, v), target="cuda", options={"fallback": False})
        assert compiled.ir("ptx").count("_flash(") == 1 and "vote.sync.any" in compiled.ir("ptx")
        tol = REL["f16" if dtype == torch.float16 else "bf16"]
        assert _rel(compiled(q, k, v), fn(q.double(), k.double(), v.double())) < tol

"""The fused SDPA kernels export picks on CUDA, lowered to math: checked on the cpu target by
tracing graphs that contain them (fake mode needs no CUDA kernel) against PyTorch's math SDPA."""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import gac_torch
from gac_torch.frontends.fx import compile_graph
from gac_torch.options import resolve
from tests.parity import Fn, assert_close, reference

aten = torch.ops.aten
CASES = {
    "efficient": lambda q, k, v, causal: aten._scaled_dot_product_efficient_attention(q, k, v, None, False, 0.0, causal)[0],
    "flash": lambda q, k, v, causal: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0],
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_fused_sdpa_lowered_to_math(kind, causal):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    gm = make_fx(lambda a, b, c: CASES[kind](a, b, c, causal), tracing_mode="fake")(q, k, v)
    compiled = compile_graph(gm, resolve({"target": "cpu", "fallback": False}))
    assert compiled.report.compiled == compiled.report.total
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal).float()
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# gac.attention: sdpa and the written-out maths become one op (passes/attention.py), whose shared
# lowering is the plain maths: cpu parity through export and torch.compile


def _inputs(seed, *shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


def _sdpa(mask_kind, causal, scale):
    def fn(q, k, v, *m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[0] if m else None,
                                              is_causal=causal, scale=scale)
    return fn


SDPA_CASES = [  # (B, H, L, S, D, Dv, mask kind, mask shape, causal, scale)
    (2, 3, 7, 7, 16, 16, "none", None, False, None),
    (1, 2, 1, 9, 32, 8, "add", (1, 1, 1, 9), False, 0.3),
    (2, 1, 65, 33, 16, 16, "bool", (2, 1, 65, 33), False, None),
    (1, 2, 13, 13, 80, 80, "none", None, True, None),
    (1, 1, 9, 5, 16, 24, "add", (9, 5), False, None),
]


def _sdpa_inputs(case, seed=3):
    B, H, L, S, D, Dv, mk, ms, _causal, _scale = case
    q, k, v = _inputs(seed, (B, H, L, D), (B, H, S, D), (B, H, S, Dv))
    if mk == "add":
        return [q, k, v, _inputs(seed + 1, ms)[0]]
    if mk == "bool":
        g = torch.Generator().manual_seed(seed + 1)
        return [q, k, v, torch.rand(*ms, generator=g) > 0.3]
    return [q, k, v]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sdpa_export_is_one_attention(case):
    fn = _sdpa(case[6], case[8], case[9])
    inputs = _sdpa_inputs(case)
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cpu", options={"fallback": False})
    assert compiled.ir("gac").count("gac.attention") == 1, compiled.ir("gac")
    assert "gac.softmax" not in compiled.ir("gac")
    assert_close(compiled(*inputs), reference(fn, inputs))


@pytest.mark.parametrize("case", SDPA_CASES[:3], ids=lambda c: "-".join(map(str, c)))
def test_sdpa_dynamo_is_one_attention(case, tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_DUMP_DIR", str(tmp_path))
    torch._dynamo.reset()
    fn = _sdpa(case[6], case[8], case[9])
    inputs = _sdpa_inputs(case, seed=8)
    out = torch.compile(fn, backend=gac_torch.backend, fullgraph=True)(*inputs)
    assert_close(out, reference(fn, inputs))
    gac = "".join(f.read_text() for f in pathlib.Path(tmp_path).rglob("*.gac"))
    assert gac.count("gac.attention") == 1 and "gac.softmax" not in gac


def _encoder(seed=0, **kw):
    torch.manual_seed(seed)
    return torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, **kw).eval()


@pytest.mark.parametrize("model", ["mha", "encoder", "encoder_norm_first", "mha_key_padding"])
def test_modules_export_use_one_attention(model):
    (x,) = _inputs(4, (2, 13, 32))
    if model.startswith("mha"):
        torch.manual_seed(1)
        mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
        pad = torch.zeros(2, 13, dtype=torch.bool)
        pad[1, 9:] = True  # the second sequence is 9 long
        fn = (functools.partial(lambda m, p, x: m(x, x, x, key_padding_mask=p, need_weights=False)[0], mha, pad)
              if model == "mha_key_padding" else
              functools.partial(lambda m, x: m(x, x, x, need_weights=False)[0], mha))
    else:
        fn = _encoder(norm_first=model.endswith("norm_first"))
    with torch.no_grad():
        compiled = gac_torch.compile(Fn(fn), (x,), target="cpu", options={"fallback": False})
        assert compiled.ir("gac").count("gac.attention") == 1, compiled.ir("gac")
        assert_close(compiled(x), reference(fn, [x]))


def test_attention_weights_returned_stay_unfused():
    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    (x,) = _inputs(5, (1, 7, 16))
    fn = functools.partial(lambda m, x: m(x, x, x, need_weights=True), mha)
    with torch.no_grad():
        compiled = gac_torch.compile(Fn(fn), (x,), target="cpu", options={"fallback": False})
        assert "gac.attention" not in compiled.ir("gac")  # the probabilities are an output
        assert_close(compiled(x), reference(fn, [x]))


def test_encoder_training_gradients_match_eager():
    """Training: forward and backward through torch.compile; the backward recomputes through the
    unfused maths (aot autograd saves what it needs, so the forward pattern may stay unfused)."""
    model = _encoder(3).train()
    ref_model = _encoder(3).train()
    (x,) = _inputs(6, (2, 9, 32))
    torch._dynamo.reset()
    out = torch.compile(model, backend=gac_torch.backend)(x)
    out.square().mean().backward()
    ref_model(x).square().mean().backward()
    torch.testing.assert_close(out, ref_model(x), rtol=1e-4, atol=1e-5)
    for (n, p), r in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-5, msg=n)


def test_sdpa_with_run_time_sizes_stays_correct():
    """Run-time sequence lengths: the pattern is left unfused (its reshapes would need size
    operands) and the graph still compiles once for every length."""
    q, k, v = _inputs(9, (1, 2, 9, 16), (1, 2, 9, 16), (1, 2, 9, 16))
    fn = _sdpa("none", True, None)
    n = torch.export.Dim("n", min=2, max=64)
    ep = torch.export.export(Fn(fn), (q, k, v), dynamic_shapes=(({2: n}, {2: n}, {2: n}),))
    compiled = gac_torch.compile(ep, target="cpu", options={"fallback": False})
    for size in (5, 13):
        inputs = _inputs(size, *[(1, 2, size, 16)] * 3)
        assert_close(compiled(*inputs), reference(fn, inputs))


def test_hand_written_attention_fuses():
    """BEVFormer's decoder self-attention (q scaled before bmm, softmax, bmm) and a mask added on
    the left of the scores both become one gac.attention."""
    from gac_torch.models.bevformer.attention import MultiheadSelfAttention

    torch.manual_seed(7)
    mod = MultiheadSelfAttention(32, 4).eval()
    q, pos = _inputs(10, (2, 11, 32), (2, 11, 32))
    with torch.no_grad():
        compiled = gac_torch.compile(mod, (q, pos), target="cpu", options={"fallback": False})
        assert compiled.ir("gac").count("gac.attention") == 1
        assert_close(compiled(q, pos), reference(mod, [q, pos]))

    def fn(q, k, v, m):
        return torch.softmax(m + q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v
    inputs = _inputs(11, (2, 9, 16), (2, 7, 16), (2, 7, 8), (9, 7))
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cpu", options={"fallback": False})
    assert compiled.ir("gac").count("gac.attention") == 1
    assert_close(compiled(*inputs), reference(fn, inputs))


def test_regrouped_scores_stay_unfused():
    """Scores reshaped so a softmax row is not one query's keys' row: no attention (the rewrite
    would regroup q and v wrongly; it used to fail on v's element count)."""
    def fn(q, k, v):
        s = (q @ k.transpose(-1, -2)).reshape(2, 3, 2, 4)
        return torch.softmax(s, dim=-1).reshape(2, 6, 4) @ v
    inputs = _inputs(12, (2, 6, 16), (2, 4, 16), (2, 4, 8))
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cpu", options={"fallback": False})
    assert "gac.attention" not in compiled.ir("gac")
    assert_close(compiled(*inputs), reference(fn, inputs))


def test_masked_fill_attention_fuses():
    """scores.masked_fill(hide, -inf) (hand-written masking) is a bool mask of one attention."""
    def fn(q, k, v, hide):
        s = (q @ k.transpose(-1, -2)) / 4.0
        return torch.softmax(s.masked_fill(hide, float("-inf")), dim=-1) @ v
    q, k, v = _inputs(13, (2, 3, 9, 16), (2, 3, 7, 16), (2, 3, 7, 8))
    hide = torch.rand(2, 1, 9, 7, generator=torch.Generator().manual_seed(1)) > 0.7
    hide[..., 0] = False  # every query sees a key (eager's softmax of a row of -inf is NaN)
    compiled = gac_torch.compile(Fn(fn), (q, k, v, hide), target="cpu", options={"fallback": False})
    assert compiled.ir("gac").count("gac.attention") == 1, compiled.ir("gac")
    assert_close(compiled(q, k, v, hide), reference(fn, [q, k, v, hide]))


def test_scale_after_mask_stays_unfused():
    """(s · a + mask) · b scales the mask too: not the attention's form, left as written."""
    def fn(q, k, v, m):
        return torch.softmax(((q @ k.transpose(-1, -2)) * 0.5 + m) * 0.5, dim=-1) @ v
    inputs = _inputs(14, (2, 5, 16), (2, 6, 16), (2, 6, 8), (5, 6))
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cpu", options={"fallback": False})
    assert "gac.attention" not in compiled.ir("gac")
    assert_close(compiled(*inputs), reference(fn, inputs))

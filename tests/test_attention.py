"""The fused SDPA kernels export picks on CUDA, lowered to math: checked on the cpu target by
tracing graphs that contain them (fake mode needs no CUDA kernel) against PyTorch's math SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from gac_torch.frontends.fx import compile_graph
from gac_torch.options import resolve

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

"""Symbolic sizes (dynamo dynamic=True / mark_dynamic): dynamo compiles the graph once; gac
compiles one static specialization per distinct shape at run time, and results match eager."""

from __future__ import annotations

import torch

from gac_torch.frontends import dynamo as gac_dynamo
from models import MODEL_TOL, build


def _count_backend_calls(monkeypatch):
    calls = []
    original = gac_dynamo.gac_backend

    def counting(gm, example_inputs, **kw):
        calls.append(gm)
        return original(gm, example_inputs, **kw)

    monkeypatch.setattr(gac_dynamo, "gac_backend", counting)
    return calls, counting


def test_dynamic_batch_and_sequence(monkeypatch):
    torch._dynamo.reset()
    calls, backend = _count_backend_calls(monkeypatch)
    model, _ = build("transformer")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    gac_dynamo.compiled_graphs.clear()
    g = torch.Generator().manual_seed(11)
    shapes = [(3, 7), (5, 16), (64, 9), (2, 130)]  # a size of 1 is specialized by dynamo
    compiles_after_first = None
    with torch.no_grad():
        for b, s in shapes:
            x = torch.randn(b, s, 64, generator=g)
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
            compiles_after_first = compiles_after_first or len(calls)
    assert len(calls) == compiles_after_first  # no dynamo recompilation when shapes change
    graphs_per_call = len(gac_dynamo.compiled_graphs) // len(shapes)
    assert len(gac_dynamo.compiled_graphs) == graphs_per_call * len(shapes)  # one gac specialization per shape
    assert all(c.report.compiled == c.report.total for c in gac_dynamo.compiled_graphs)


def test_mark_dynamic_reuses_specializations(monkeypatch):
    torch._dynamo.reset()
    calls, backend = _count_backend_calls(monkeypatch)
    model, (x,) = build("mlp")
    compiled = torch.compile(model, backend=backend)
    gac_dynamo.compiled_graphs.clear()
    with torch.no_grad():
        for b in (3, 17, 3, 17, 40):
            xb = torch.randn(b, 32)
            torch._dynamo.mark_dynamic(xb, 0)
            torch.testing.assert_close(compiled(xb), model(xb), **MODEL_TOL)
    assert len(calls) == 1
    assert len(gac_dynamo.compiled_graphs) == 3  # 3, 17 and 40: repeats hit the cache

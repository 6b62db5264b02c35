"""Sizes known only at run time: dynamo symbolic sizes (`dynamic=True`, `mark_dynamic`) and
export `Dim`s compile ONCE, to kernels that take the sizes at run time; results match eager for
batch 1..64 and sequence 7..130. Graphs with an op lowered for static sizes only are compiled
once per shape instead, and say why."""

from __future__ import annotations

import contextlib

import pytest
import torch

import gac_torch
from gac_torch.frontends import dynamo as gac_dynamo
from gac_torch.frontends import fx as gac_fx
from gac_torch.errors import GacInputError
from models import MODEL_TOL, build

# (batch, sequence): both ends of batch 1..64 and sequence 7..130, and sizes in between.
SHAPES = [(1, 7), (64, 130), (2, 9), (17, 64), (5, 129), (1, 130), (64, 7), (3, 33)]


def _count(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counting(*args, **kw):
        calls.append(args[0])
        return original(*args, **kw)

    monkeypatch.setattr(module, name, counting)
    return calls, counting


@contextlib.contextmanager
def _no_size_one_specialization():
    """Dynamo specializes sizes 0 and 1 by default (a batch of 1 would recompile); torch >= 2.6
    can reason size-obliviously instead."""
    from torch.fx.experimental import _config

    if not hasattr(_config, "backed_size_oblivious"):
        pytest.skip("this torch cannot keep a size of 1 symbolic (backed_size_oblivious)")
    with _config.patch(backed_size_oblivious=True):
        yield


def test_dynamo_compiles_once_for_every_batch_and_sequence(monkeypatch):
    torch._dynamo.reset()
    calls, backend = _count(monkeypatch, gac_dynamo, "gac_backend")
    partitions, _ = _count(monkeypatch, gac_fx, "compile_partition")
    model, _ = build("attention")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    gac_dynamo.compiled_graphs.clear()
    g = torch.Generator().manual_seed(5)
    calls_after_first = None
    with torch.no_grad(), _no_size_one_specialization():
        for b, t in SHAPES:
            x = torch.randn(b, t, 64, generator=g)
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
            # (dynamo may hand over a graph twice on the first call: it restarts the trace to
            # specialize LayerNorm's float eps; no recompilation after that)
            calls_after_first = calls_after_first if (b, t) != SHAPES[0] else len(calls)
    assert len(calls) == calls_after_first  # dynamo: no recompilation for any shape
    assert len(gac_dynamo.compiled_graphs) == 1 and len(partitions) == 1  # gac: one compilation
    (graph,) = gac_dynamo.compiled_graphs
    assert graph.dynamic and graph.report.compiled == graph.report.total
    ir = graph.ir("gac")
    assert "tensor<?x?x64xf32>" in ir and ": index" in ir  # sizes are run-time values


def test_export_dims_compile_once(monkeypatch):
    partitions, _ = _count(monkeypatch, gac_fx, "compile_partition")
    model, (x0,) = build("attention")
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=7, max=130)
    ep = torch.export.export(model, (x0,), dynamic_shapes=({0: batch, 1: seq},))
    compiled = gac_torch.compile(ep, target="cpu")
    assert len(partitions) == 1 and compiled.dynamic
    assert compiled.report.compiled == compiled.report.total
    assert "tensor<?x?x64xf32>" in compiled.ir("gac") and ": index" in compiled.ir("gac")  # run-time sizes
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for b, t in SHAPES:
            x = torch.randn(b, t, 64, generator=g)
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
    assert len(partitions) == 1
    with pytest.raises(GacInputError, match=r"outside the exported range \[7, 130\]"):
        compiled(torch.randn(2, 131, 64))
    with pytest.raises(GacInputError, match="expected shape"):
        compiled(torch.randn(2, 9, 32))


def test_mark_dynamic_compiles_once(monkeypatch):
    torch._dynamo.reset()
    calls, backend = _count(monkeypatch, gac_dynamo, "gac_backend")
    model, _ = build("mlp")
    compiled = torch.compile(model, backend=backend)
    gac_dynamo.compiled_graphs.clear()
    with torch.no_grad():
        for b in (3, 17, 3, 40):
            xb = torch.randn(b, 32)
            torch._dynamo.mark_dynamic(xb, 0)
            torch.testing.assert_close(compiled(xb), model(xb), **MODEL_TOL)
    assert len(calls) == 1
    assert len(gac_dynamo.compiled_graphs) == 1 and gac_dynamo.compiled_graphs[0].dynamic


def test_shared_size_must_agree():
    """Two inputs exported with one Dim: a call where they disagree is refused, not computed."""

    class Add(torch.nn.Module):
        def forward(self, x, y):
            return (x + y).relu()

    n = torch.export.Dim("n", min=2, max=100)
    ep = torch.export.export(Add(), (torch.randn(4, 8), torch.randn(4, 8)), dynamic_shapes=({0: n}, {0: n}))
    compiled = gac_torch.compile(ep, target="cpu")
    x, y = torch.randn(9, 8), torch.randn(9, 8)
    torch.testing.assert_close(compiled(x, y), (x + y).relu())
    with pytest.raises(GacInputError, match="size .* = 5 here, but 9"):
        compiled(x, torch.randn(5, 8))


def test_cnn_with_run_time_batch_compiles_once(monkeypatch):
    """Convolution, batch norm and pooling take a run-time batch size (channels and spatial
    sizes static)."""
    partitions, _ = _count(monkeypatch, gac_fx, "compile_partition")
    model, (x0,) = build("cnn")
    ep = torch.export.export(model, (x0,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    compiled = gac_torch.compile(ep, target="cpu")
    assert compiled.dynamic and compiled.report.compiled == compiled.report.total
    with torch.no_grad():
        for b in (1, 64, 5):
            x = torch.randn(b, 3, 32, 32)
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
    assert len(partitions) == 1


def test_static_only_ops_compile_per_shape(monkeypatch):
    """dynamic=True makes the CNN's spatial sizes symbolic too, and convolution windows are
    lowered for static spatial sizes only: the symbolic graph is specialized per shape (and
    says so) instead of failing or falling back to eager."""
    torch._dynamo.reset()
    calls, backend = _count(monkeypatch, gac_dynamo, "gac_backend")
    model, _ = build("cnn")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    gac_dynamo.compiled_graphs.clear()
    calls_after_first = None
    with torch.no_grad():
        for i, b in enumerate((2, 3, 2)):
            x = torch.randn(b, 3, 16, 16)
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
            calls_after_first = len(calls) if i == 0 else calls_after_first
    assert len(calls) == calls_after_first  # (the first call may restart once: see above)
    assert len(gac_dynamo.compiled_graphs) == 2  # batch 2 and 3; the repeat hits the cache
    assert all(not c.dynamic and c.report.compiled == c.report.total for c in gac_dynamo.compiled_graphs)


def test_specialization_reason_names_the_op():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Upsample(scale_factor=2.0)).eval()
    ep = torch.export.export(model, (torch.randn(2, 3, 16, 16),),
                             dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=8)},))
    compiled = gac_torch.compile(ep, target="cpu")
    assert not compiled.dynamic and "upsample" in compiled.compiled.reason
    with pytest.raises(KeyError, match="call the program first"):
        compiled.report
    with torch.no_grad():
        for b in (2, 5):
            x = torch.randn(b, 3, 16, 16)
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
    assert compiled.report.compiled == compiled.report.total


@pytest.mark.cuda
def test_cuda_static_only_ops_compile_per_shape():
    """On cuda too, a graph holding an op lowered for static sizes only (convolution windows
    over symbolic spatial sizes) is compiled per shape, and matches eager."""
    torch._dynamo.reset()
    model, _ = build("cnn")
    model = model.cuda()
    compiled = torch.compile(model, backend="gac", dynamic=True)
    gac_dynamo.compiled_graphs.clear()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for b in (2, 3, 2):
            x = torch.randn(b, 3, 16, 16, generator=g).cuda()
            torch.testing.assert_close(compiled(x), model(x), **MODEL_TOL)
    assert len(gac_dynamo.compiled_graphs) == 2  # one per distinct shape; the repeat is cached
    assert all(c.target == "cuda" and not c.dynamic for c in gac_dynamo.compiled_graphs)

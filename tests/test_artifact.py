"""gac_torch.save / gac_torch.load (runtime/artifact.py): a saved program runs in a new process
without importing MLIR (so nothing is compiled) and without re-exporting, with results identical
to the compiled program's; damaged, edited, other-version and other-target files are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import gac_torch
from gac_torch.runtime.artifact import ArtifactError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WithFallback(torch.nn.Module):
    """Two compiled partitions around an op gac leaves to eager (digamma)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 12)
        self.b = torch.nn.Linear(12, 6)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.a(x)) * y
        h = torch.digamma(h.abs() + 1)
        return self.b(h).softmax(-1), h.sum()


def _inputs():
    g = torch.Generator().manual_seed(4)
    return torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)


def _load_in_new_process(path, inputs, tmp_path, target=None) -> list:
    """Loads and runs the artifact in a fresh interpreter; asserts MLIR was never imported."""
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch, gac_torch
        inputs = torch.load({str(tmp_path / 'inputs.pt')!r})
        loaded = gac_torch.load({str(path)!r}, target={target!r})
        with torch.no_grad():
            out = loaded(*inputs)
        assert not [m for m in sys.modules if m == "mlir" or m.startswith("mlir.")], "MLIR was imported"
        torch.save(out, {str(tmp_path / 'out.pt')!r})
    """))
    env = dict(os.environ, PYTHONPATH=ROOT, GAC_CACHE="0")
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return torch.load(tmp_path / "out.pt")


def _saved(tmp_path):
    torch.manual_seed(0)
    model, inputs = WithFallback().eval(), _inputs()
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(model, inputs), target="cpu")
        want = compiled(*inputs)
    assert len(compiled.compiled.partitions) == 2 and compiled.report.unsupported
    path = tmp_path / "model.gac"
    gac_torch.save(compiled, str(path))
    return path, inputs, want, model


def test_load_in_new_process_without_mlir(tmp_path):
    path, inputs, want, model = _saved(tmp_path)
    got = _load_in_new_process(path, inputs, tmp_path)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    torch.testing.assert_close(got[0], model(*inputs)[0], rtol=1e-5, atol=1e-5)


def _rewrite(path, name, change):
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    files[name] = change(files[name])
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)


def test_damaged_edited_and_foreign_files_are_refused(tmp_path):
    path, *_ = _saved(tmp_path)
    good = path.read_bytes()

    def flip(data: bytes) -> bytes:
        i = len(data) // 2
        return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]

    def manifest(**changes):
        def edit(data: bytes) -> bytes:
            m = json.loads(data)
            for k, v in changes.items():
                if k == "gac":
                    m["versions"]["gac"] = v
                else:
                    m[k] = v
            return json.dumps(m).encode()
        return edit

    cases = [("partitions/fused_0.gac", flip, "checksum"), ("program.pt2", flip, "checksum"),
             ("manifest.json", manifest(gac="0.0.1"), "saved with gac 0.0.1"),
             ("manifest.json", manifest(version=99), "v99")]
    for name, change, message in cases:
        path.write_bytes(good)
        _rewrite(path, name, change)
        with pytest.raises(ArtifactError, match=message):
            gac_torch.load(str(path))
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ArtifactError, match="not a readable gac artifact"):
        gac_torch.load(str(path))
    path.write_bytes(good)
    with pytest.raises(ArtifactError, match="compiled for target 'cpu', not 'vortex'"):
        gac_torch.load(str(path), target="vortex")
    assert gac_torch.load(str(path))  # the untouched file still loads


def test_bevformer_test_tiny_saved_and_loaded(tmp_path):
    from gac_torch.models.bevformer import build_bevformer, make_test_inputs

    model = build_bevformer("test_tiny", seed=0)
    frame0 = tuple(make_test_inputs(model.cfg, frame=0))
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(model, frame0), target="cpu")
        want = compiled(*frame0)
    path = tmp_path / "bevformer_tiny.gac"
    gac_torch.save(compiled, str(path))
    got = _load_in_new_process(path, frame0, tmp_path)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.cuda
def test_cuda_program_saved_and_loaded(tmp_path):
    torch.manual_seed(0)
    model = WithFallback().eval().cuda()
    inputs = tuple(t.cuda() for t in _inputs())
    with torch.no_grad():
        compiled = gac_torch.compile(torch.export.export(model, inputs), target="cuda")
        want = compiled(*inputs)
    path = tmp_path / "cuda.gac"
    gac_torch.save(compiled, str(path))
    got = _load_in_new_process(path, inputs, tmp_path, target="cuda")
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))


def test_run_time_sizes_saved_and_loaded(tmp_path):
    """A program exported with a Dim (one compilation for every batch size) loads in a new
    process and still takes any size in the range."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(12, 5)

        def forward(self, x):
            return torch.relu(self.lin(x)).softmax(-1) * x.sum(-1, keepdim=True)

    torch.manual_seed(0)
    model = M().eval()
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(n, 12, generator=g) for n in (3, 7)]
    ep = torch.export.export(model, (xs[0],), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    with torch.no_grad():
        compiled = gac_torch.compile(ep, target="cpu")
        assert compiled.dynamic
        want = [compiled(x) for x in xs]
    path = tmp_path / "dyn.gac"
    gac_torch.save(compiled, str(path))
    for x, w in zip(xs, want):
        got = _load_in_new_process(path, (x,), tmp_path)
        assert torch.equal(got, w)
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


def test_partition_whose_compile_failed_travels_as_eager(tmp_path, monkeypatch):
    """A partition that fell back at compile time (not by the registry) is saved as its ATen
    nodes, inside the torch.export program."""
    from gac_torch.frontends import fx

    real = fx.compile_partition

    def fail_second(sub, name, *a, **k):
        if name == "fused_1":
            raise RuntimeError("injected compile failure")
        return real(sub, name, *a, **k)

    monkeypatch.setattr(fx, "compile_partition", fail_second)
    monkeypatch.delenv("GAC_STRICT_INTERNAL", raising=False)  # default mode: a visible fallback
    torch.manual_seed(0)
    model, inputs = WithFallback().eval(), _inputs()
    with torch.no_grad(), pytest.warns(gac_torch.GacCompilerWarning, match="injected"):
        compiled = gac_torch.compile(torch.export.export(model, inputs), target="cpu", options={"cache": False})
    with torch.no_grad():
        want = compiled(*inputs)
    assert list(compiled.compiled.partitions) == ["fused_0"]
    assert any("injected" in why for _, why in compiled.report.unsupported)
    path = tmp_path / "partly.gac"
    gac_torch.save(compiled, str(path))
    got = _load_in_new_process(path, inputs, tmp_path)
    assert all(torch.equal(g, w) for g, w in zip(got, want))

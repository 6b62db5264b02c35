"""The on-disk compile cache (runtime/cache.py): hits give identical results without running a
single MLIR stage; damaged, foreign or other-version entries are recompiled with a warning;
several processes may fill the cache at once; the size bound and the switches hold."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gac_torch
from gac_torch import driver
from gac_torch.backends.cpu import native
from gac_torch.runtime import cache, plain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(torch.nn.Module):
    """Wide enough that its cpu LLVM IR passes native.NATIVE_MIN_IR_BYTES (cached as native code)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(24, 24), torch.nn.GELU(), torch.nn.LayerNorm(24)) for _ in range(4)])

    def forward(self, x):
        return torch.softmax(self.layers(x), -1) + x.sin()


def _model():
    torch.manual_seed(0)
    return Net().eval(), torch.randn(5, 24, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_CACHE", "1")
    monkeypatch.setenv("GAC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "partitions"


def _entries(root, kind: str | None = None) -> list:
    """Cache files; kind "program" (whole programs) or "partition" (compiled partitions)."""
    cache.flush()  # (stores behind the compile: GAC_CACHE_BACKGROUND)
    files = sorted(root.glob("*/*.gac")) if root.exists() else []
    if kind is None:
        return files
    is_program = [cache.unpack_entry(p.read_bytes(), p.stem).meta.get("kind") == "program" for p in files]
    return [p for p, prog in zip(files, is_program) if prog == (kind == "program")]


def _no_stages(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("an MLIR stage ran on a cache hit")
    monkeypatch.setattr(driver, "_run_stages", fail)


def _compile(model, x, **kw):
    with torch.no_grad():
        return gac_torch.compile(torch.export.export(model, (x,)), target="cpu", **kw)


def test_cpu_hit_is_native_and_identical(cache_on, monkeypatch, caplog):
    """A warm compile hits the whole program (no decomposition, no MLIR stage); without the
    program entry it hits the partition (no MLIR stage); both give the cold run's bits."""
    model, x = _model()
    cold = _compile(model, x)
    assert len(_entries(cache_on, "partition")) == 1 and len(_entries(cache_on, "program")) == 1
    ref = model(x)
    torch.testing.assert_close(cold(x), ref, rtol=1e-5, atol=1e-5)
    _no_stages(monkeypatch)
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="gac_torch"):
        m.setattr(torch.export.ExportedProgram, "run_decompositions",
                  lambda *a, **k: pytest.fail("decomposed on a program hit"))
        warm = _compile(model, x)
    assert "gac cache hit" in caplog.text
    (cg,) = warm.compiled.partitions.values()
    assert isinstance(cg.executable, native.NativeExecutable)
    assert torch.equal(warm(x), cold(x))
    assert warm.ir("llvm") == cold.ir("llvm")  # stage texts travel with the entry
    assert warm.report.summary() == cold.report.summary()
    gac_torch.save(warm, str(cache_on.parent / "warm.gac"))  # a cached program saves as any other
    assert torch.equal(gac_torch.load(str(cache_on.parent / "warm.gac"))(x), cold(x))
    for p in _entries(cache_on, "program"):
        p.unlink()
    again = _compile(model, x)
    assert torch.equal(again(x), cold(x))
    assert isinstance(next(iter(again.compiled.partitions.values())).executable, native.NativeExecutable)


def test_program_hit_runs_the_callers_weights(cache_on):
    """Same graph, other parameter values: the cached program runs with the new weights."""
    model, x = _model()
    _compile(model, x)
    other = Net().eval()
    torch.manual_seed(5)
    for p in other.parameters():
        p.data.normal_()
    with torch.no_grad():
        got = _compile(other, x)(x)
        torch.testing.assert_close(got, other(x), rtol=1e-5, atol=1e-5)
    assert len(_entries(cache_on, "program")) == 1  # it was a hit


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_damaged_entry_is_recompiled_with_a_warning(cache_on, monkeypatch, caplog, damage):
    model, x = _model()
    cold = _compile(model, x)
    paths = _entries(cache_on)
    assert len(paths) == 2  # the partition and the whole program: both damaged
    for path in paths:
        data = path.read_bytes()
        if damage == "flip":
            i = len(data) // 2
            data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
        elif damage == "truncate":
            data = data[: len(data) // 3]
        elif damage == "foreign":  # a whole, valid entry, but stored under another key
            entry = cache.unpack_entry(data, None)
            data = cache.pack_entry("0" * 64, entry)
        else:
            data = b"\x7fELF not an entry"
        path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="gac_torch"):
        again = _compile(model, x)
    assert caplog.text.count("recompiling") == 2
    assert torch.equal(again(x), cold(x))
    cache.flush()
    for path in paths:
        assert cache.unpack_entry(path.read_bytes(), path.stem)  # rewritten, whole


def test_other_versions_and_settings_miss(cache_on, monkeypatch):
    model, x = _model()
    _compile(model, x)
    key_of = {}
    real = cache.cache_key

    def spy(*a, **k):
        key_of["key"] = real(*a, **k)
        return key_of["key"]

    monkeypatch.setattr(cache, "cache_key", spy)
    _compile(model, x)
    first = key_of["key"]
    real_versions = cache.versions
    versions = dict(real_versions(), torch="0.0.0")
    monkeypatch.setattr(cache, "versions", lambda: versions)
    _compile(model, x)
    assert key_of["key"] != first and len(_entries(cache_on, "partition")) == 2
    monkeypatch.setattr(cache, "versions", real_versions)
    torch.set_float32_matmul_precision("high")
    try:
        _compile(model, x)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert len(_entries(cache_on, "partition")) == 3
    _compile(model, x, options={"min_block_size": 2})
    assert len(_entries(cache_on, "partition")) == 4
    assert len(_entries(cache_on, "program")) == 4
    monkeypatch.setenv("GAC_SGEMM_LEAN", "0")  # a switch that picks kernels: a new entry
    _compile(model, x, options={"min_block_size": 2})
    assert len(_entries(cache_on, "partition")) == 5
    monkeypatch.setenv("GAC_COMPILE_WORKERS", "1")  # one that does not: a hit
    _compile(model, x, options={"min_block_size": 2})
    assert len(_entries(cache_on, "partition")) == 5


@pytest.mark.unit
def test_entry_from_another_format_is_refused():
    entry = cache.Entry({"a": 1}, {"so": b"\0\1"}, {"gac": "x"})
    data = bytearray(cache.pack_entry("k" * 64, entry))
    assert cache.unpack_entry(bytes(data), "k" * 64).blobs == {"so": b"\0\1"}
    header_at = data.index(b'"format": %d' % cache.FORMAT)
    data[header_at:header_at + 11] = b'"format": 9'
    with pytest.raises(cache.CacheError, match="checksum"):
        cache.unpack_entry(bytes(data), "k" * 64)
    body = bytes(data[len(cache.MAGIC) + 32:])
    import hashlib
    resealed = cache.MAGIC + hashlib.sha256(body).digest() + body
    with pytest.raises(cache.CacheError, match="format 9"):
        cache.unpack_entry(resealed, "k" * 64)


def test_stage_texts_pack_in_chunks(monkeypatch):
    # stage texts beyond STAGES_CHUNK are compressed in pieces (in threads) and read back whole
    monkeypatch.setattr(cache, "STAGES_CHUNK", 1000)
    rng = torch.Generator().manual_seed(0)
    texts = {"gac": "ünï " * 900, "gpu": "".join(map(str, torch.randint(0, 10, (5000,), generator=rng).tolist())),
             "empty": ""}
    calls = []
    real = cache.zlib.compress
    monkeypatch.setattr(cache.zlib, "compress", lambda *a: calls.append(1) or real(*a))
    packed = cache.pack_entry("k", cache.Entry({}, {}, dict(texts)))
    assert len(calls) > 3
    assert dict(cache.unpack_entry(packed, "k").stages) == texts


def test_an_entry_packs_its_stage_texts_once(monkeypatch):
    # a compiled program's cache entry packs its partitions' entries again: their stage texts
    # (64 MB for BEVFormer-tiny on cuda) are compressed once, then reused
    texts = {"gac": "x = 1\n" * 50, "linalg": "y = 2\n" * 50}
    entry = cache.Entry({"n": 1}, {"b": b"\1\2"}, dict(texts))
    calls = []
    real = cache.zlib.compress
    monkeypatch.setattr(cache.zlib, "compress", lambda *a: calls.append(1) or real(*a))
    first, again = cache.pack_entry("k", entry), cache.pack_entry("k", entry)
    assert first == again and len(calls) == 1 and dict(entry.stages) == texts
    back = cache.unpack_entry(again, "k")
    assert dict(back.stages) == texts and back.blobs == {"b": b"\1\2"} and back.meta == {"n": 1}


def test_switches_clear_and_size_bound(cache_on, monkeypatch):
    model, x = _model()
    _compile(model, x, options={"cache": False})
    monkeypatch.setenv("GAC_CACHE", "0")
    _compile(model, x)
    assert _entries(cache_on) == []
    monkeypatch.setenv("GAC_CACHE", "1")
    _compile(model, x)
    _compile(model, x, options={"min_block_size": 2})
    assert len(_entries(cache_on)) == 4
    newest = max(_entries(cache_on), key=lambda p: p.stat().st_mtime)
    cache.evict(newest.stat().st_size)  # room for one: the least recently used go
    assert _entries(cache_on) == [newest]
    assert gac_torch.cache.clear() == 1 and _entries(cache_on) == []


def test_concurrent_writers(cache_on, tmp_path):
    """Four processes compile the same model into an empty cache at once: all succeed with
    the same result, one whole entry remains, no temporary file is left behind."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from test_cache import _model, _compile
        model, x = _model()
        torch.save(_compile(model, x)(x), sys.argv[1])
    """))
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"out{i}.pt")], env=env,
                              stderr=subprocess.PIPE) for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-3000:]
    outs = [torch.load(tmp_path / f"out{i}.pt") for i in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert len(_entries(cache_on, "partition")) == 1 and len(_entries(cache_on, "program")) == 1
    assert not [p for p in cache_on.rglob("*") if p.is_file() and p.suffix != ".gac"]


def test_cuda_program_plain_data_round_trip():
    """The cuda host program travels as JSON (no pickle): same program back, PTX included."""
    from gac_torch.backends import get_target
    from gac_torch.backends.base import stages_only
    from gac_torch.backends.gpu.program import GpuProgram, from_json, to_json
    from gac_torch.frontends.fx import compile_graph
    from gac_torch.legalize import decompositions
    from gac_torch.options import resolve

    def f(a, b, n):
        return torch.relu(a @ b + n.sum(0)) * 2, (a.exp() - 1).amax(-1)

    args = (torch.randn(16, 8), torch.randn(8, 16), torch.randn(3, 16))
    gm = torch.export.export(_Fn(f), args).run_decompositions(decompositions()).graph_module
    compiled = compile_graph(gm, resolve({"target": "cuda", "cache": False}), stages_only(get_target("cuda")))
    programs = [cg.executable for cg in compiled.partitions.values()]
    assert programs and all(isinstance(p, GpuProgram) for p in programs)
    for p in programs:
        data = json.loads(json.dumps(to_json(p)))
        assert from_json(data) == p
    with pytest.raises(plain.PlainDataError, match="not one of"):
        plain.decode({"type": "Popen", "fields": {}}, [GpuProgram])


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_vortex_hit_identical(cache_on, monkeypatch):
    pytest.importorskip("ziglang")
    pytest.importorskip("elftools")
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(2))
    fn = _Fn(lambda t: torch.tanh(t) * 3 + t.sum(-1, keepdim=True))
    opts = {"vortex_mode": "functional"}
    cold = gac_torch.compile(torch.export.export(fn, (x,)), target="vortex", options=opts)
    assert len(_entries(cache_on)) >= 1
    _no_stages(monkeypatch)
    from gac_torch.backends.vortex import runtime

    modes = []
    real = runtime.resolve_mode
    monkeypatch.setattr(runtime, "resolve_mode", lambda o: modes.append(o.get("vortex_mode")) or real(o))
    warm = gac_torch.compile(torch.export.export(fn, (x,)), target="vortex", options=opts)
    assert modes and set(modes) == {"functional"}  # the caller's run-time options reach the loader
    assert torch.equal(warm(x), cold(x))
    torch.testing.assert_close(warm(x), fn(x), rtol=1e-5, atol=1e-5)


def test_torch_compile_uses_the_cache_and_reports(cache_on, monkeypatch):
    """torch.compile(backend="gac") hits the cache after a reset; gac_torch.reports() lists
    the graphs (with fallbacks) and torch.compiler.reset() clears them; the profiler shows a
    range per partition."""
    model, x = _model()
    torch.compiler.reset()
    with torch.no_grad():
        cold = torch.compile(model, backend="gac")(x)
    assert len(_entries(cache_on)) == 1
    report = gac_torch.last_report()
    assert report is not None and report.partitions == 1 and gac_torch.reports() == [report]
    torch.compiler.reset()
    assert gac_torch.reports() == [] and gac_torch.last_report() is None
    _no_stages(monkeypatch)
    with torch.no_grad(), torch.profiler.profile() as prof:
        warm = torch.compile(model, backend="gac")(x)
    assert torch.equal(warm, cold)
    assert any(e.name.startswith("gac:fused_") for e in prof.events())
    assert len(gac_torch.reports()) == 1


def test_torch_compiler_cache_artifacts_carry_gac_entries(cache_on, monkeypatch, caplog):
    """torch.compiler.save_cache_artifacts() carries the entries a torch.compile(backend="gac")
    compile used; load_cache_artifacts() into an empty cache makes the next compile a hit that
    runs no MLIR stage; a damaged artifact is not installed (a warning, then a plain miss)."""
    model, x = _model()
    torch.compiler.reset()
    with torch.no_grad():
        cold = torch.compile(model, backend="gac")(x)
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    data, info = saved
    files = _entries(cache_on)
    assert len(files) == 1 and info.gac_artifacts == [files[0].stem]
    entry_bytes = files[0].read_bytes()
    assert cache.clear() == 1 and not _entries(cache_on)
    torch.compiler.reset()
    torch.compiler.load_cache_artifacts(data)
    assert [p.read_bytes() for p in _entries(cache_on)] == [entry_bytes]
    with monkeypatch.context() as m:
        _no_stages(m)
        with torch.no_grad():
            assert torch.equal(torch.compile(model, backend="gac")(x), cold)
    cache.clear()
    damaged = entry_bytes[:-1] + bytes([entry_bytes[-1] ^ 1])
    with caplog.at_level(logging.WARNING, logger="gac_torch"):
        assert not cache.install(files[0].stem, damaged)
    assert "not installing" in caplog.text and not _entries(cache_on)


def test_slow_compile_says_so_once(monkeypatch, capsys):
    from gac_torch.runtime import progress

    monkeypatch.setattr(progress, "SLOW_SECONDS", 0.05)
    import time

    with progress.Compile("graph 7 on cpu") as c:
        c.step("stage llvm", partition="partition 1 of 2 (fused_0)")
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert err.count("is taking over") == 1 and "partition 1 of 2 (fused_0): stage llvm" in err


def test_cuda_offline_hit_is_quiet(cache_on, monkeypatch, caplog):
    """Compiling for cuda without a GPU twice: the whole-program entry cannot load here (no
    device), which is no damage: no warning, and every partition is a hit (no MLIR stage)."""
    from gac_torch.backends import get_target
    from gac_torch.errors import TargetUnavailable

    def no_gpu():
        raise TargetUnavailable("no GPU in this test")

    monkeypatch.setattr(get_target("cuda"), "check_available", no_gpu)  # (also on a GPU machine)
    model, x = _model()
    opts = {"arch": "sm_90"}
    with torch.no_grad():
        cold = gac_torch.compile(torch.export.export(model, (x,)), target="cuda", options=opts)
        _no_stages(monkeypatch)
        with caplog.at_level(logging.WARNING, logger="gac_torch"):
            warm = gac_torch.compile(torch.export.export(model, (x,)), target="cuda", options=opts)
    assert caplog.text == "" and warm.ir("ptx") == cold.ir("ptx")


@pytest.mark.cuda
def test_cuda_hit_identical(cache_on, monkeypatch):
    """On the GPU: the warm compile (no MLIR stage) replays the cached PTX + host program."""
    model, x = _model()
    model, x = model.cuda(), x.cuda()
    with torch.no_grad():
        cold = gac_torch.compile(torch.export.export(model, (x,)), target="cuda")
        ref = cold(x)
        _no_stages(monkeypatch)
        monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                            lambda *a, **k: pytest.fail("decomposed on a program hit"))
        warm = gac_torch.compile(torch.export.export(model, (x,)), target="cuda")
        assert torch.equal(warm(x), ref)
        torch.testing.assert_close(ref, model(x), rtol=1e-4, atol=1e-4)


def test_program_hit_with_run_time_sizes(cache_on, monkeypatch):
    """A program exported with a Dim comes back from the cache still taking every size."""
    model, _ = _model()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 24, generator=g) for n in (2, 9)]
    ep = torch.export.export(model, (xs[0],), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=32)},))
    with torch.no_grad():
        cold = gac_torch.compile(ep, target="cpu")
        assert cold.dynamic
        want = [cold(x) for x in xs]
        with monkeypatch.context() as m:
            m.setattr(torch.export.ExportedProgram, "run_decompositions",
                      lambda *a, **k: pytest.fail("decomposed on a program hit"))
            warm = gac_torch.compile(ep, target="cpu")
        assert warm.dynamic
        for x, w in zip(xs, want):
            assert torch.equal(warm(x), w)
        with pytest.raises(Exception, match="outside the exported range"):
            warm(torch.randn(40, 24))


class _ZeroDConstant(torch.nn.Module):
    def forward(self, x):
        # a 0-d int64 tensor constant in the exported graph (found by the fuzzer on the H200)
        return x * torch.tensor(3) + x.sum()


def test_program_key_takes_0d_tensor_constants(cache_on):
    x = torch.randn(4, 5)
    ep = torch.export.export(_ZeroDConstant(), (x,))
    assert any(c.dim() == 0 for c in ep.constants.values() if isinstance(c, torch.Tensor))
    for _ in range(2):  # a miss, then a hit
        torch.testing.assert_close(gac_torch.compile(ep, target="cpu")(x), _ZeroDConstant()(x))


def test_program_entry_leaves_weights_to_the_caller(cache_on, monkeypatch, tmp_path):
    """The whole-program entry stores parameters and buffers as meta tensors (the caller's
    program brings the values) and, for a graph of partition calls only, a JSON form that comes
    back without torch.export.load; stage texts stay packed until read. Such an entry is no
    artifact gac_torch.load accepts. A JSON form that does not fit falls back to program.pt2."""
    import io
    import zipfile

    from gac_torch.runtime import artifact, program_json

    model, x = _model()
    cold = _compile(model, x)
    (path,) = _entries(cache_on, "program")
    blob = cache.unpack_entry(path.read_bytes(), path.stem).blobs["artifact"]
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        manifest, pt2, names = json.loads(z.read("manifest.json")), z.read("program.pt2"), z.namelist()
    assert manifest["weights"] == "caller" and "program.json" in names
    artifact._define_op()
    saved = torch.export.load(io.BytesIO(pt2))
    assert saved.state_dict and all(t.device.type == "meta" for t in saved.state_dict.values())
    with monkeypatch.context() as m:
        _no_stages(m)
        m.setattr(torch.export, "load", lambda *a, **k: pytest.fail("torch.export.load on a program hit"))
        warm = _compile(model, x)
    (cg,) = warm.compiled.partitions.values()
    assert isinstance(cg.stages, cache.Stages) and cg.stages._texts is None  # not unpacked
    assert torch.equal(warm(x), cold(x)) and warm.ir("llvm") == cold.ir("llvm")
    with monkeypatch.context() as m:
        m.setattr(program_json, "rebuild", lambda *a: (_ for _ in ()).throw(KeyError("no fit")))
        again = _compile(model, x)
    assert torch.equal(again(x), cold(x))
    (tmp_path / "entry.gac").write_bytes(blob)
    with pytest.raises(artifact.ArtifactError, match="compile-cache entry"):
        gac_torch.load(str(tmp_path / "entry.gac"))


def test_program_key_has_the_targets_own_key(monkeypatch):
    """The whole-program key holds what the target's partition keys hold beyond the options
    (cuda: the measured tile table's digest, the ptxas version): after an autotune run changed
    the table, a program hit must not hand back the program compiled with the old tiles."""
    from gac_torch.backends.gpu import tuning
    from gac_torch.options import resolve
    from gac_torch.runtime import artifact

    ep = torch.export.export(_ZeroDConstant(), (torch.randn(4, 5),))
    options = resolve({"target": "cuda", "arch": "sm_90"}, target="cuda")
    keys = set()
    for digest in ("table-a", "table-b"):
        monkeypatch.setattr(tuning, "digest", lambda arch, d=digest: d)
        keys.add(artifact.program_key(ep, options))
    assert len(keys) == 2

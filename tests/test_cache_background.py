"""Cache stores behind the compile (runtime/cache.py store_later, GAC_CACHE_BACKGROUND): in
order, a load of a queued key waits for it, a failing store is a warning that leaves the cache
as it was and lets the next stores go on, the interpreter's exit waits for the queue, and a
cold compile returns before its whole-program store is done."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import gac_torch
from gac_torch.runtime import artifact, cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "ab" + "0" * 62


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_CACHE", "1")
    monkeypatch.setenv("GAC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GAC_CACHE_BACKGROUND", raising=False)
    yield tmp_path / "cache" / "partitions"
    cache.flush()


def _entry(tag: str) -> cache.Entry:
    return cache.Entry({"tag": tag}, {"b": tag.encode()}, {"s": tag})


def _slow(tag: str, gate: threading.Event, seconds: float = 30):
    def make():
        assert gate.wait(seconds)
        return _entry(tag)
    return make


@pytest.mark.unit
def test_stores_run_in_order_and_a_load_waits_for_its_key(root):
    gate = threading.Event()
    cache.store_later(KEY, _slow("first", gate))
    cache.store_later(KEY, _entry("second"))
    assert not (root / KEY[:2] / f"{KEY}.gac").exists()  # still queued behind the gate
    threading.Timer(0.3, gate.set).start()
    t = time.perf_counter()
    got = cache.load(KEY)  # waits for both queued stores of KEY
    assert time.perf_counter() - t >= 0.2
    assert got is not None and got.meta == {"tag": "second"} and got.stages["s"] == "second"


@pytest.mark.unit
def test_a_load_under_the_trace_lock_does_not_wait(root):
    """The writer's program store takes gac's trace lock (artifact.to_bytes): a load made while
    holding it must not wait for that store (a deadlock); it is a miss instead."""
    from gac_torch.frontends.torch_state import TRACE_LOCK

    def needs_lock():  # (bounded: gives up on the lock after 10 s, so a regression fails, not hangs)
        if TRACE_LOCK.acquire(timeout=10):
            TRACE_LOCK.release()
            return _entry("locked")
        return _entry("gave up")
    got = []
    with TRACE_LOCK:
        cache.store_later(KEY, needs_lock)
        t = threading.Thread(target=lambda: got.append(cache.load(KEY)), daemon=True)
        t.start()  # (another thread: waits, as it does not hold the lock)
        got.append(("here", cache.load(KEY)))  # would hang here without the rule
    t.join(30)
    assert got[0] == ("here", None) and got[1].meta == {"tag": "locked"}


@pytest.mark.unit
def test_without_the_switch_the_caller_stores(root, monkeypatch):
    monkeypatch.setenv("GAC_CACHE_BACKGROUND", "0")
    assert "GAC_CACHE_BACKGROUND" not in cache.code_switches()  # (same entries either way)
    threads = []
    cache.store_later(KEY, lambda: (threads.append(threading.current_thread()), _entry("now"))[1])
    assert threads == [threading.current_thread()] and (root / KEY[:2] / f"{KEY}.gac").exists()
    with pytest.raises(RuntimeError, match="in the caller"):
        cache.store_later(KEY, lambda: (_ for _ in ()).throw(RuntimeError("in the caller")))


@pytest.mark.unit
def test_a_failing_store_is_a_warning_and_the_next_ones_go_on(root, caplog):
    other = "cd" + "1" * 62

    def boom():
        raise RuntimeError("cannot pack")
    with caplog.at_level(logging.WARNING, logger="gac_torch"):
        cache.store_later(KEY, boom)
        cache.store_later(other, _entry("after"))
        assert cache.flush(30)
    assert "store behind the compile failed" in caplog.text and "cannot pack" in caplog.text
    assert cache.load(KEY) is None and cache.load(other).meta == {"tag": "after"}


@pytest.mark.unit
def test_a_failed_write_leaves_the_old_entry(root, monkeypatch, caplog):
    cache.store_later(KEY, _entry("old"))
    assert cache.flush(30)

    def fail(*a, **k):
        raise OSError("disk full")
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="gac_torch"):
        m.setattr(os, "replace", fail)
        cache.store_later(KEY, _entry("new"))
        assert cache.flush(30)
    assert "cannot write" in caplog.text
    assert cache.load(KEY).meta == {"tag": "old"}
    assert [p.name for p in root.rglob("*") if p.is_file()] == [f"{KEY}.gac"]  # no temporary left


@pytest.mark.unit
def test_clear_and_flush_wait_for_the_queue(root):
    gate = threading.Event()
    cache.store_later(KEY, _slow("x", gate))
    assert not cache.flush(0.2)  # still behind the gate
    threading.Timer(0.2, gate.set).start()
    assert cache.clear() == 1  # (waited: the entry landed, then went)


@pytest.mark.unit
def test_the_interpreter_exit_waits_for_queued_stores(tmp_path):
    """The writer is no daemon: a script that queues a slow store and ends still writes it,
    its stage texts packed in a thread pool (as a compile's are) although the script has ended."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        os.environ["GAC_CACHE_DIR"] = {str(tmp_path)!r}
        from gac_torch.runtime import cache
        cache.STAGES_CHUNK = 64  # (several chunks: zlib'd by a ThreadPoolExecutor)
        def make():
            time.sleep(1.0)
            return cache.Entry({{"tag": "late"}}, {{}}, {{"s": "x" * 1000}})
        cache.store_later({KEY!r}, make)
        print("queued", flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    data = (tmp_path / "partitions" / KEY[:2] / f"{KEY}.gac").read_bytes()
    entry = cache.unpack_entry(data, KEY)
    assert entry.meta == {"tag": "late"} and entry.stages["s"] == "x" * 1000
    assert "failed" not in p.stderr


@pytest.mark.unit
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_has_its_own_writer(root):
    """A child forked while the parent's writer holds the queue's lock (and has a store queued)
    stores and flushes on its own instead of waiting forever on the parent's lock."""
    gate, held = threading.Event(), threading.Event()
    cache.store_later(KEY, _slow("parent", gate))

    def hold():
        with cache._cond:
            held.set()
            gate.wait(30)
    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: a store of its own, then exit with whether it landed
        try:
            cache.store_later("ef" + "2" * 62, _entry("child"))
            ok = cache.flush(20) and cache.load("ef" + "2" * 62).meta == {"tag": "child"}
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    gate.set()
    deadline = time.monotonic() + 60
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if status[0] == 0:  # (stuck on the parent's lock)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's store did not finish")
    assert os.WIFEXITED(status[1]) and os.WEXITSTATUS(status[1]) == 0
    assert cache.load(KEY).meta == {"tag": "parent"}


def test_cold_compile_returns_before_its_program_store(root, monkeypatch):
    """gac_torch.compile returns while the whole program is still being packed (held here);
    a load of its key in the same process then waits for that store and hits it."""
    from test_cache import _model

    gate, started, keys = threading.Event(), threading.Event(), []
    to_bytes, remember = artifact.to_bytes, artifact.remember_program

    def held(*a, **k):
        started.set()
        assert gate.wait(60)
        return to_bytes(*a, **k)
    monkeypatch.setattr(artifact, "to_bytes", held)
    monkeypatch.setattr(artifact, "remember_program", lambda key, c: (keys.append(key), remember(key, c)))
    model, x = _model()
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
        cold = gac_torch.compile(ep, target="cpu")
        if any(cg.saved[1] is None for cg in cold.compiled.partitions.values()):
            gate.set()
            pytest.skip("cpu partitions not kept as native code here (no linker): no program entry")
        assert keys and started.wait(60) and not gate.is_set()  # returned; its store still held
        threading.Timer(0.3, gate.set).start()
        hit = artifact.cached_program(keys[0], None, ep)
    assert hit is not None and gate.is_set()  # the load waited for the queued store
    torch.testing.assert_close(cold(x), model(x), rtol=1e-5, atol=1e-5)

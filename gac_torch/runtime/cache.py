"""The on-disk compile cache: what a partition needs to run without MLIR, keyed by what decides it.

    GAC_CACHE=0                 disables it (as does the option cache=False)
    GAC_CACHE_DIR=/path         where entries live (default: ~/.cache/gac_torch, or $XDG_CACHE_HOME)
    GAC_CACHE_SIZE_MB=2048      bound; the least recently used entries go first
    GAC_CACHE_BACKGROUND=0      compiles write their entries themselves (default: a writer thread
                                behind the compile: store_later)
    gac_torch.cache.clear()     removes every entry

The key (`cache_key`) is a sha256 over a canonical JSON of: the partition's gac module text and
signature (every later stage is a function of them), the resolved options, the target and what
else decides its code (cuda: the arch), torch's precision flags, the GAC_* switches that pick
kernels (`code_switches`), and the versions of gac (plus a
digest of its sources, so an edited checkout never reuses stale code), the MLIR bindings, torch
and the platform. An entry is one file, MAGIC | sha256(body) | body, written to a temporary file
and renamed into place (readers see a whole entry or none; several processes may write at once).
A corrupt, truncated or foreign entry fails its checksum or key check: it is removed and the
partition recompiled, with a warning.

torch's own persistence: entries used by a torch.compile(backend="gac") compile (hits and
stores) are recorded with torch.compiler's cache-artifact manager under the type "gac", so
`torch.compiler.save_cache_artifacts()` carries them and `load_cache_artifacts()` writes them into
this cache (checked as a read is); gac_torch must be imported before load_cache_artifacts, for
torch to know the type. Dynamo still traces and AOTAutograd still runs in the new process (torch
caches those only for Inductor); the MLIR compile is what is skipped.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (before _drain's registration: see there)
import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import platform
import struct
import sys
import tempfile
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gac_torch.errors import GacError
from gac_torch.options import Options, key_fields

log = logging.getLogger("gac_torch")

MAGIC = b"GACCACHE\x01\n"
FORMAT = 2  # 2: stage texts packed in chunks (_pack_stages)
STAGES_CHUNK = 4 << 20  # bytes of stage text compressed apart (in parallel)
SUFFIX = ".gac"
DEFAULT_SIZE_MB = 2048


class CacheError(GacError, ValueError):
    """An entry that cannot be trusted (bad magic, checksum, key or format)."""


class Stages(Mapping):
    """Stage texts as an entry keeps them (_pack_stages), unpacked at the first read: a warm
    compile reads none (BEVFormer-tiny's cuda stages: 37 MB of text, 4.5 MB packed)."""

    def __init__(self, packed: bytes, texts: dict[str, str] | None = None):
        self.packed = packed
        self._texts = texts  # (given: the texts `packed` was made from)

    def _unpacked(self) -> dict[str, str]:
        if self._texts is None:
            self._texts = _unpack_stages(self.packed)  # (checked with the entry)
        return self._texts

    def __getitem__(self, stage: str) -> str:
        return self._unpacked()[stage]

    def __iter__(self) -> Iterator[str]:
        return iter(self._unpacked())

    def __len__(self) -> int:
        return len(self._unpacked())


@dataclass
class Entry:
    """A compiled partition as plain data: `meta` (JSON), named binary `blobs`, stage texts."""

    meta: dict[str, Any]
    blobs: dict[str, bytes] = field(default_factory=dict)
    stages: Mapping[str, str] = field(default_factory=dict)


# -- switches and place --------------------------------------------------------------------------

def enabled(options: Options | None = None) -> bool:
    given = options.cache if options is not None else None
    if given is not None:
        return bool(given)
    return os.environ.get("GAC_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    root = os.environ.get("GAC_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(base, "gac_torch")
    return Path(root) / "partitions"


def size_limit() -> int:
    return int(float(os.environ.get("GAC_CACHE_SIZE_MB", DEFAULT_SIZE_MB)) * 2**20)


def clear() -> int:
    """Removes every cache entry; returns how many."""
    flush()  # (stores still queued would land after)
    n = 0
    root = cache_dir()
    if not root.is_dir():
        return 0
    for p in root.rglob("*"):
        if p.is_file() and (p.suffix == SUFFIX or ".tmp" in p.name):
            try:
                p.unlink()
                n += 1
            except FileNotFoundError:
                pass
    return n


# -- the key -------------------------------------------------------------------------------------

def options_json(options: Options) -> dict[str, Any]:
    """The options that decide what is compiled (`options.key_fields`: not where dumps go nor
    whether to cache), as canonical JSON-able data; the options' class names the target."""
    fields = {k: (v if isinstance(v, (bool, int, float, str, type(None))) else str(v))
              for k, v in sorted(key_fields(options).items())}
    return {"class": type(options).__name__, **fields}


def precision_flags() -> dict[str, Any]:
    import torch

    return {"cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """gac (with a digest of its sources), the MLIR bindings, torch, python and the platform."""
    from importlib import metadata

    import torch

    import gac_torch

    digest = hashlib.sha256()
    root = Path(gac_torch.__file__).parent
    for p in sorted(root.rglob("*.py")):
        digest.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    try:
        mlir = metadata.version("xtc-mlir-python-bindings")
    except metadata.PackageNotFoundError:
        mlir = "unknown"
    return {"gac": gac_torch.__version__, "gac_sources": digest.hexdigest()[:16], "mlir": mlir,
            "torch": torch.__version__, "python": sys.version.split()[0],
            "platform": f"{sys.platform}-{platform.machine()}"}


# GAC_* variables that do not decide generated code (where things go, how many workers, the
# run-time launch path); every other GAC_* switch (GAC_WGMMA_*, GAC_SGEMM_*, GAC_CONV1X1_WGMMA, ...)
# picks kernels, so it is part of the key: flipping one for an A/B run never reuses stale code.
RUNTIME_ONLY = frozenset({"GAC_CACHE", "GAC_CACHE_DIR", "GAC_CACHE_SIZE_MB", "GAC_CACHE_BACKGROUND",
                          "GAC_DUMP_DIR", "GAC_COMMIT",
                          "GAC_COMPILE_WORKERS", "GAC_CUDA_GRAPHS", "GAC_CUDA_SYNC", "GAC_STRICT_INTERNAL",
                          "GAC_VORTEX_SIMX_TIMEOUT",
                          # (the same code either way: how a call launches it, how dynamo calls it)
                          "GAC_LAUNCH_BLOCK", "GAC_DYNAMO_RECORDS",
                          # (the same code either way: how the "gpu" stage spends its time)
                          "GAC_GPU_STAGE_WORKERS", "GAC_GPU_KERNELS_ASIDE"})


def code_switches() -> dict[str, str]:
    """The GAC_* environment switches that pick generated code (see RUNTIME_ONLY)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("GAC_") and k not in RUNTIME_ONLY}


def cache_key(graph_text: str, signature: str, options: Options, target: str,
              target_key: Mapping[str, Any] | None = None) -> str:
    """The content address of one compiled partition (see the module docstring)."""
    data = {"format": FORMAT, "graph": hashlib.sha256(graph_text.encode()).hexdigest(),
            "signature": signature, "options": options_json(options), "target": target,
            "target_key": dict(target_key or {}), "precision": precision_flags(),
            "switches": code_switches(), "versions": versions()}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


# -- entries -------------------------------------------------------------------------------------

def pack_entry(key: str, entry: Entry) -> bytes:
    """MAGIC | sha256(body) | body; body = u32 header length | header JSON | blobs."""
    blobs = dict(entry.blobs)
    if not isinstance(entry.stages, Stages):  # packed once: a compiled program's entry packs its
        # partitions' entries again (BEVFormer-tiny cuda: 64 MB of stage text)
        texts = dict(entry.stages)
        entry.stages = Stages(_pack_stages(texts), texts)
    blobs["\0stages"] = entry.stages.packed
    layout, offset = {}, 0
    for name, data in blobs.items():
        layout[name] = [offset, len(data)]
        offset += len(data)
    header = json.dumps({"format": FORMAT, "key": key, "meta": entry.meta, "blobs": layout,
                         "versions": versions()}, sort_keys=True).encode()
    body = struct.pack("<I", len(header)) + header + b"".join(blobs.values())
    return MAGIC + hashlib.sha256(body).digest() + body


def _pack_stages(texts: Mapping[str, str]) -> bytes:
    """u32 n | JSON {stages: [[name, UTF-8 bytes]...], chunks: [packed bytes...]} | the chunks:
    the texts' UTF-8 joined (no JSON escaping: ~0.4 s of 37 MB), cut in STAGES_CHUNK pieces
    zlib'd apart, in threads (zlib lets go of the GIL)."""
    raw = [t.encode() for t in texts.values()]
    data = b"".join(raw)
    pieces = [data[i:i + STAGES_CHUNK] for i in range(0, len(data), STAGES_CHUNK)] or [b""]
    if len(pieces) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1)) as pool:
            packed = list(pool.map(lambda p: zlib.compress(p, 3), pieces))
    else:
        packed = [zlib.compress(pieces[0], 3)]
    head = json.dumps({"stages": [[k, len(r)] for k, r in zip(texts, raw)],
                       "chunks": [len(p) for p in packed]}).encode()
    return struct.pack("<I", len(head)) + head + b"".join(packed)


def _unpack_stages(packed: bytes) -> dict[str, str]:
    (n,) = struct.unpack("<I", packed[:4])
    head = json.loads(packed[4:4 + n])
    at, parts = 4 + n, []
    for size in head["chunks"]:
        parts.append(zlib.decompress(packed[at:at + size]))
        at += size
    data, at, out = b"".join(parts), 0, {}
    for name, size in head["stages"]:
        out[name] = data[at:at + size].decode()
        at += size
    return out


def unpack_entry(data: bytes, key: str | None) -> Entry:
    """Raises CacheError unless `data` is a whole, unmodified entry (for `key`, if given)."""
    if not data.startswith(MAGIC):
        raise CacheError("not a gac cache entry (bad magic)")
    view = memoryview(data)  # (slices without copying the body: entries reach 100s of MB)
    digest, body = bytes(view[len(MAGIC):len(MAGIC) + 32]), view[len(MAGIC) + 32:]
    if len(digest) < 32 or hashlib.sha256(body).digest() != digest:
        raise CacheError("checksum mismatch (truncated or modified)")
    try:
        (n,) = struct.unpack("<I", body[:4])
        header = json.loads(bytes(body[4:4 + n]))
        base = 4 + n
        blobs = {name: bytes(body[base + off:base + off + size]) for name, (off, size) in header["blobs"].items()}
        stages = Stages(blobs.pop("\0stages"))
    except (KeyError, ValueError, struct.error) as e:
        raise CacheError(f"malformed entry: {e}") from e
    if header.get("format") != FORMAT:
        raise CacheError(f"entry format {header.get('format')}, this gac reads {FORMAT}")
    if key is not None and header.get("key") != key:
        raise CacheError("entry belongs to another key")
    return Entry(header["meta"], blobs, stages)


def _path(key: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / key[:2] / f"{key}{SUFFIX}"


# -- torch.compiler.save_cache_artifacts / load_cache_artifacts ------------------------------------

ARTIFACT_TYPE = "gac"
_recording: contextvars.ContextVar[bool] = contextvars.ContextVar("gac_cache_recording", default=False)


@contextlib.contextmanager
def recording():
    """Entries read or written inside are recorded for torch.compiler.save_cache_artifacts()."""
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


def _record(key: str, data: bytes) -> None:
    if not _recording.get():
        return
    try:
        from torch.compiler._cache import CacheArtifactManager

        CacheArtifactManager.record_artifact(ARTIFACT_TYPE, key, data)
    except Exception as e:  # noqa: BLE001  (a torch without the manager: nothing to join)
        log.debug("gac cache: not recorded for torch.compiler: %s", e)


def install(key: str, data: bytes) -> bool:
    """Writes an entry from torch.compiler.load_cache_artifacts() after checking it as `load`
    would; a damaged one is skipped with a warning."""
    try:
        unpack_entry(data, key)
    except CacheError as e:
        log.warning("gac cache: not installing artifact %s from torch.compiler (%s)", key[:16], e)
        return False
    _write(key, data, logging.INFO)
    return True


def register_with_torch_artifacts() -> None:
    """Makes "gac" a torch.compiler cache-artifact type (torch.compiler._cache, torch >= 2.7)."""
    try:
        from torch.compiler._cache import CacheArtifact, CacheArtifactFactory
    except ImportError:
        return
    if ARTIFACT_TYPE in getattr(CacheArtifactFactory, "_artifact_types", {}):
        return

    class GacCacheArtifact(CacheArtifact):
        def populate_cache(self) -> None:
            install(self.key, self.content)

        @staticmethod
        def type() -> str:
            return ARTIFACT_TYPE

    CacheArtifactFactory.register(GacCacheArtifact)


def load(key: str, quiet: bool = False) -> Entry | None:
    """The entry for `key`, or None (a miss). A damaged entry is removed: a miss, with a warning.
    `quiet`: hits and misses at DEBUG (one per cuda kernel would flood INFO)."""
    _wait_for(key)  # (a store of it still queued in this process: store_later)
    path = _path(key)
    level = logging.DEBUG if quiet else logging.INFO
    try:
        data = path.read_bytes()
    except OSError:
        log.log(level, "gac cache miss %s", key[:16])
        return None
    try:
        entry = unpack_entry(data, key)
    except CacheError as e:
        log.warning("gac cache: ignoring entry %s (%s); recompiling", path, e)
        _remove(path)
        return None
    try:
        os.utime(path)  # least recently *used* goes first
    except OSError:
        pass
    log.log(level, "gac cache hit %s", key[:16])
    if not quiet:
        _record(key, data)
    return entry


def store(key: str, entry: Entry, quiet: bool = False, root: Path | None = None) -> None:
    """Writes atomically (temporary file in the same folder, then rename); never raises.
    `quiet` (one of many, e.g. a cuda kernel): logged at DEBUG, and the caller evicts once
    after the batch (each eviction lists the whole cache). `root`: the cache folder (default:
    cache_dir() now)."""
    data = pack_entry(key, entry)
    _write(key, data, logging.DEBUG if quiet else logging.INFO, evict_after=not quiet, root=root)
    if not quiet:
        _record(key, data)


def _write(key: str, data: bytes, level: int, evict_after: bool = True, root: Path | None = None) -> None:
    path = _path(key, root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            _remove(Path(tmp))
            raise
        log.log(level, "gac cache store %s (%d bytes)", key[:16], len(data))
        if evict_after:
            evict(size_limit(), root)
    except OSError as e:
        log.warning("gac cache: cannot write %s: %s", path, e)


def evict(limit: int, root: Path | None = None) -> None:
    """Removes least recently used entries until the cache holds at most `limit` bytes."""
    files = []
    for p in (root or cache_dir()).glob(f"*/*{SUFFIX}"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(s for _, s, _ in files)
    for _, size, p in sorted(files, key=lambda f: f[0]):
        if total <= limit:
            break
        _remove(p)
        total -= size


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# -- stores behind the compile (GAC_CACHE_BACKGROUND) --------------------------------------------
# A cold compile ends with stores (BEVFormer-tiny on cuda: ~500 cubins, the partition, the whole
# program, whose torch.export.save alone is ~1.5 s): a writer thread does them in order while
# the compile returns. Each is still store(): atomic, safe with other processes; one that fails
# is a warning and leaves the cache as it was. The thread is no daemon: the interpreter's exit
# waits for it (a killed process loses the queue, never an entry's integrity), and the queue is
# drained before concurrent.futures refuses new work at exit (stores pack in thread pools).

_cond = threading.Condition()
_jobs: deque = deque()  # (key or None, function of the cache folder, folder, contextvars); the
# running one first until it is done
_writer: list[threading.Thread] = []  # the writer while it runs (it ends when the queue is empty)
_pending: dict[str, int] = {}  # key -> its stores queued or running
_closing = False  # (the interpreter is exiting: the writer does not linger)
LINGER = 0.5  # s the writer waits for another job before it ends


def background() -> bool:
    return os.environ.get("GAC_CACHE_BACKGROUND", "1").strip().lower() not in ("0", "false", "off", "no")


def store_later(key: str, entry: Entry | Callable[[], Entry | None], quiet: bool = False) -> None:
    """store(key, entry) by the writer thread, after the stores queued before it (in this
    thread, now, with GAC_CACHE_BACKGROUND=0). `entry` may be a function making it (there):
    None stores nothing; an exception is a warning (in this thread: raised). The cache folder,
    size bound are the caller's at this call; a load() of `key` in this process waits for it;
    flush() waits for all. A store recorded for torch.compiler (recording()) is done now."""
    def job(root: Path) -> None:
        made = entry() if callable(entry) else entry
        if made is not None:
            store(key, made, quiet, root)

    _enqueue(key, job)


def evict_later() -> None:
    """evict(size_limit()) after the stores queued so far (see store_later)."""
    limit = size_limit()
    _enqueue(None, lambda root: evict(limit, root))


def _enqueue(key: str | None, job: Callable[[Path], None]) -> None:
    root = cache_dir()
    # (recorded for torch.compiler.save_cache_artifacts, which the caller may call right after)
    if not background() or _recording.get():
        job(root)
        return
    with _cond:
        _jobs.append((key, job, root, contextvars.copy_context()))
        if key is not None:
            _pending[key] = _pending.get(key, 0) + 1
        if not _writer:
            t = threading.Thread(target=_write_queued, name="gac-cache-writer", daemon=False)
            _writer.append(t)
            t.start()
        _cond.notify_all()


def _write_queued() -> None:
    """The writer: the queue's jobs in order; it waits LINGER s for more before it ends (the
    kernels' entries arrive one by one while the pool compiles), and says at DEBUG how many
    entries it wrote in how many seconds of its own work."""
    import time

    n, busy = 0, 0.0
    while True:
        with _cond:
            if not _jobs and not _closing:
                _cond.wait(LINGER)
            if not _jobs:
                _writer.clear()
                _cond.notify_all()
                if n:
                    log.debug("gac: %d entries written behind the compile in %.2f s (GAC_CACHE_BACKGROUND)",
                              n, busy)
                return
            key, job, root, ctx = _jobs[0]
        t = time.perf_counter()
        try:
            ctx.run(job, root)
        except BaseException as e:  # noqa: BLE001  (a store is an optimization: the next ones go on;
            # nothing may end this thread while it is the writer)
            log.warning("gac: a store behind the compile failed (GAC_CACHE_BACKGROUND; %s): %s",
                        key and key[:16], e)
        finally:
            busy += time.perf_counter() - t
            n += 1
            with _cond:
                _jobs.popleft()  # (done: flush() waits for an empty queue)
                if key is not None:
                    _pending[key] -= 1
                    if not _pending[key]:
                        del _pending[key]
                _cond.notify_all()


def _wait_for(key: str) -> None:
    from gac_torch.frontends.torch_state import TRACE_LOCK

    # (not under gac's trace lock: the writer's program store takes it; the load is then a miss)
    if getattr(TRACE_LOCK, "_is_owned", lambda: False)():
        return
    with _cond:
        if _writer and threading.current_thread() is not _writer[0]:
            _cond.wait_for(lambda: key not in _pending)


def flush(timeout: float | None = None) -> bool:
    """Waits until every store queued by store_later is done; False if `timeout` ran out."""
    with _cond:
        if _writer and threading.current_thread() is _writer[0]:
            return not _jobs
        return _cond.wait_for(lambda: not _jobs, timeout)


def _after_fork() -> None:
    """A forked child starts with no writer and an empty queue (the parent's are the parent's;
    its lock may have been held by the parent's writer at the fork)."""
    global _cond, _closing
    _cond, _closing = threading.Condition(), False
    _jobs.clear()
    _writer.clear()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _drain() -> None:
    global _closing
    _closing = True  # (the writer ends as soon as the queue is empty)
    flush()


# threading runs these at exit before it joins the threads, the last registered first: this
# one before concurrent.futures' (imported above), which makes every later ThreadPoolExecutor
# raise "cannot schedule new futures after interpreter shutdown"
try:
    threading._register_atexit(_drain)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # (another Python; or at exit already)
    pass

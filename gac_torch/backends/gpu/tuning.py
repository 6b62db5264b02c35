"""Tile choice measured on the device (issue 14 item 5), remembered on disk per arch.

A strategy with several sensible tilings for a problem calls

    choice = tuning.choose("wgmma:bf16:4096x4096x4096", ("bn128", "bn256"), heuristic="bn256")

and builds the plan that `choice` names. Without a GPU (or before anything was measured) that is
the heuristic, so a compile is deterministic. The autotuner (backends/cuda/autotune.py, run by
`options={"autotune": True}` or torch.compile's mode="max-autotune") compiles a partition once per
candidate index, times every kernel, and writes the fastest candidate of each key into
`$GAC_CACHE_DIR/tuning/<arch>.json`; later compiles read it (a table's digest is part of the cache
key, so a new measurement recompiles). An entry that is no longer a candidate is ignored.

Choices are recorded per kernel (the scheduler binds them to the kernel it emits next), which is
how the autotuner knows which kernel's time belongs to which key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("gac_torch.tuning")
_local = threading.local()


@dataclass(frozen=True)
class Choice:
    key: str
    candidates: tuple[str, ...]
    heuristic: str
    chosen: str


@dataclass
class Session:
    """The choices of one compile. `table`: key -> measured best; `force`: key -> candidate
    (the autotuner's variants; wins over the table)."""

    table: Mapping[str, str] = field(default_factory=dict)
    force: Mapping[str, str] = field(default_factory=dict)
    kernels: dict[str, list[Choice]] = field(default_factory=dict)  # kernel name -> its choices
    _pending: list[Choice] = field(default_factory=list)

    def choose(self, key: str, candidates: Sequence[str], heuristic: str) -> str:
        cands = tuple(candidates)
        chosen = next((c for c in (self.force.get(key), self.table.get(key)) if c in cands), heuristic)
        self._pending.append(Choice(key, cands, heuristic, chosen))
        return chosen

    def bind(self, kernel: str) -> None:
        """The choices made since the last bind belong to `kernel` (just emitted)."""
        if self._pending:
            self.kernels.setdefault(kernel, []).extend(self._pending)
            self._pending = []

    def rename(self, names: Mapping[str, str]) -> None:
        """Kernels renumbered after scheduling (outline.number_kernels): old -> new name."""
        self.kernels = {names.get(k, k): v for k, v in self.kernels.items()}


def choose(key: str, candidates: Sequence[str], heuristic: str) -> str:
    """The candidate to build for `key`: forced, else measured best, else `heuristic`."""
    s = current()
    return heuristic if s is None else s.choose(key, candidates, heuristic)


def problem_key(spec: object) -> str:
    """A readable, stable name of a GEMM/conv problem: its sizes, then a digest of everything
    else the plan reads (operand layouts, windows), so two problems never share an entry."""
    sizes = "x".join(str(getattr(spec, d)) for d in ("M", "N", "K") if hasattr(spec, d))
    return f"{sizes}:{hashlib.sha256(repr(spec).encode()).hexdigest()[:10]}"


def bind(kernel: str) -> None:
    if (s := current()) is not None:
        s.bind(kernel)


def discard() -> None:
    if (s := current()) is not None:
        s._pending = []


def rename(names: Mapping[str, str]) -> None:
    if (s := current()) is not None:
        s.rename(names)


def current() -> Session | None:
    return getattr(_local, "session", None)


@contextmanager
def session(table: Mapping[str, str] | None = None, force: Mapping[str, str] | None = None) -> Iterator[Session]:
    """Choices inside go through one Session; an enclosing session (the autotuner's) wins."""
    outer = current()
    if outer is not None:
        yield outer
        return
    s = Session(dict(table or {}), dict(force or {}))
    _local.session = s
    try:
        yield s
    finally:
        _local.session = None


# -- the table on disk ---------------------------------------------------------------------------

def table_path(arch: str) -> Path:
    from gac_torch.runtime.cache import cache_dir

    return cache_dir().parent / "tuning" / f"{arch}.json"  # beside the entries: never evicted


def load_table(arch: str) -> dict[str, str]:
    """key -> candidate; {} when there is none or it does not read (with a warning)."""
    path = table_path(arch)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("gac tuning: ignoring unreadable table %s (%s)", path, e)
        return {}
    if not isinstance(data, dict) or data.get("arch") != arch or not isinstance(data.get("best"), dict):
        log.warning("gac tuning: ignoring table %s (not a table for %s)", path, arch)
        return {}
    return {str(k): str(v) for k, v in data["best"].items()}


def digest(arch: str) -> str:
    """Part of the cache key: compiles after a measurement differ from those before."""
    table = load_table(arch)
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16] if table else ""


def save_table(arch: str, best: Mapping[str, str], times: Mapping[str, Mapping[str, float]] | None = None) -> Path:
    """Merge `best` into the arch's table (atomically: several processes may tune at once)."""
    path = table_path(arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**load_table(arch), **best}
    data = {"arch": arch, "best": dict(sorted(merged.items())),
            "ms": {k: dict(v) for k, v in sorted((times or {}).items())}}
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

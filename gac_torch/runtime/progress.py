"""What a user sees of a compile: progress lines, one line past 10 s, reports under torch.compile.

Logs go to the `gac_torch` logger, quiet by default:
    TORCH_LOGS=gac_torch        INFO: one line per graph, cache hits and stores
    TORCH_LOGS=+gac_torch       DEBUG: every partition and stage, with times
    torch._logging.set_logs(gac=logging.DEBUG)   the same from Python (registered as "gac")
A compile still running after SLOW_SECONDS says so once, on stderr when the logger is quiet.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

log = logging.getLogger("gac_torch")
SLOW_SECONDS = 10.0
_RESET_SENTINEL = "gac_torch: reports since the last torch.compiler.reset()"
_reports: list[Any] = []  # GraphReports of graphs compiled under torch.compile, oldest first
_local = threading.local()


def register_with_torch() -> None:
    """`torch._logging.set_logs(gac=...)` (TORCH_LOGS takes the module name, gac_torch)."""
    try:
        from torch._logging._internal import register_log

        register_log("gac", "gac_torch")
    except Exception:  # noqa: BLE001  (a torch without it: the logger still works)
        pass


class Compile:
    """One graph's compile: `step()` records where it is; a timer reports it once past 10 s."""

    def __init__(self, what: str):
        self.what = what
        self.where = "starting"
        self.start = time.perf_counter()
        self.timer = threading.Timer(SLOW_SECONDS, self._slow)
        self.timer.daemon = True
        self.slow = False
        self.spent: dict[str, list[float]] = {}  # timed() pieces of the current step: [wall, thread]
        self.step_times = (self.start, time.thread_time())

    def __enter__(self) -> Compile:
        self.outer = getattr(_local, "current", None)
        _local.current = self
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.report_spent()
        self.timer.cancel()
        _local.current = self.outer
        if self.slow:
            log.info("gac: %s compiled in %.1f s", self.what, time.perf_counter() - self.start)

    def step(self, where: str, partition: str | None = None) -> None:
        self.report_spent()
        if partition is not None:
            self.partition = partition
        where = f"{self.partition}: {where}" if getattr(self, "partition", None) else where
        self.where = where
        log.debug("gac: %s: %s (+%.1f s)", self.what, where, time.perf_counter() - self.start)

    def report_spent(self) -> None:
        """DEBUG: the step that ends, when it timed pieces: its wall and main-thread CPU time
        (less CPU than wall: the thread waited, for a worker, the GIL or a core), then each piece."""
        wall, cpu = time.perf_counter(), time.thread_time()
        if self.spent and log.isEnabledFor(logging.DEBUG):
            pieces = ", ".join(f"{k} {w:.2f} s (cpu {t:.2f})" for k, (w, t) in self.spent.items())
            log.debug("gac: %s: %s took %.2f s (main thread cpu %.2f s): %s", self.what, self.where,
                      wall - self.step_times[0], cpu - self.step_times[1], pieces)
        self.spent.clear()
        self.step_times = (wall, cpu)

    def _slow(self) -> None:
        self.slow = True
        msg = (f"gac: compiling {self.what} is taking over {SLOW_SECONDS:.0f} s (now: {self.where}); "
               "TORCH_LOGS=+gac_torch shows progress, the on-disk cache makes the next one fast")
        if log.isEnabledFor(logging.INFO):
            log.info(msg)
        else:
            print(msg, file=sys.stderr, flush=True)


@contextmanager
def timed(piece: str) -> Iterator[None]:
    """Times a piece of the current step (wall and this thread's CPU), reported with the step
    at DEBUG (`Compile.report_spent`); a repeated piece adds up. Nothing outside a compile."""
    current = getattr(_local, "current", None)
    if current is None:
        yield
        return
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        acc = current.spent.setdefault(piece, [0.0, 0.0])
        acc[0] += time.perf_counter() - wall
        acc[1] += time.thread_time() - cpu


def step(where: str, partition: str | None = None) -> None:
    """Records progress in the innermost running compile (if any); `partition` names the one
    the next steps belong to (e.g. "partition 2 of 5 (fused_1)")."""
    current = getattr(_local, "current", None)
    if current is not None:
        current.step(where, partition)


# -- reports under torch.compile -----------------------------------------------------------------

def _warn_once_cache() -> Any:
    try:
        import torch._dynamo.utils as utils

        return utils.warn_once_cache  # a set torch.compiler.reset() clears
    except (ImportError, AttributeError):
        return None


def _drop_if_reset() -> None:
    marks = _warn_once_cache()
    if marks is not None and _RESET_SENTINEL not in marks:
        _reports.clear()
        marks.add(_RESET_SENTINEL)


def add_report(report: Any) -> None:
    _drop_if_reset()
    _reports.append(report)
    del _reports[:-256]


def reports() -> list:
    """GraphReports (what compiled, what fell back and why) of the graphs torch.compile handed
    to gac since the last torch.compiler.reset(), oldest first."""
    _drop_if_reset()
    return list(_reports)


def last_report() -> Any:
    """The most recent of reports(), or None."""
    _drop_if_reset()
    return _reports[-1] if _reports else None

"""Kernel templates parsed and folded in worker processes (GAC_GPU_STAGE_WORKERS).

The "gpu" stage splices a kernel template per strategy-owned op (strategy.splice_template);
each distinct template text is parsed and folded (`canonicalize, cse`) once, which on
BEVFormer-tiny is ~1.2 s of the main process's ~8 s stage (61 distinct of 184 templates, 21 MB
of text). While the scheduler's loop over the generics runs (schedule.map_to_gpu), a template
not folded yet is sent to a worker (fold_worker.py: MLIR bindings only) and a placeholder op
(`func.call @__gac_pending_template(args..., init)`) takes the kernel's place; the loop goes
on with the next ops. The placeholders are replaced by the folded templates (MLIR bytecode,
parsed here ~5x faster than text) at the loop's end, in order, or earlier where an analysis
asks who uses a buffer a placeholder holds (irutil.users, settle): those questions then see
the kernel as the serial path would. Same templates, same positions: the module comes out
byte-identical (tests/test_gpu_fold_pool.py; benchmarks/ptx_fingerprint.py).

GAC_GPU_STAGE_WORKERS: unset: min(4, CPUs - 1) workers for a program of >= 64 generics, else
none; 0: folded in-process, as before; N: N workers whatever the program's size. A worker that
fails (dies, or cannot fold a template) fails the compile with a CompileError naming it.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

from gac_torch.backends.gpu import fold_worker
from gac_torch.errors import CompileError

log = logging.getLogger("gac_torch")

MIN_GENERICS = 64  # a smaller program folds its few templates in-process (a worker costs ~0.3 s)
MAX_WORKERS = 4  # BEVFormer-tiny: ~1.2 s of folding, 61 jobs


def worker_count(generics: int) -> int:
    """How many fold workers a program of `generics` linalg.generic ops gets (0: none)."""
    given = os.environ.get("GAC_GPU_STAGE_WORKERS", "").strip()
    if given:
        if not given.isdigit():
            raise ValueError(f"GAC_GPU_STAGE_WORKERS={given!r}: expected a number of processes (0: in-process)")
        return int(given)
    if generics < MIN_GENERICS:
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cpus = os.cpu_count() or 1
    return max(0, min(MAX_WORKERS, cpus - 1))


def _command() -> list[str]:
    return [sys.executable, str(Path(fold_worker.__file__))]


class FoldPool:
    """Up to `n` worker processes (started as jobs arrive), each fed by a thread of this
    process; `submit(text)` returns a Future of the folded template's bytecode (one job per
    distinct text). A failed worker fails its job and every job not started yet (no waiter is
    left hanging); the others finish theirs."""

    def __init__(self, n: int):
        self.n = n
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.futures: dict[str, Future] = {}
        self.threads: list[threading.Thread] = []
        self.broken: CompileError | None = None
        self.lock = threading.Lock()

    def submit(self, text: str) -> Future:
        with self.lock:
            fut = self.futures.get(text)
            if fut is not None:
                return fut
            fut = self.futures[text] = Future()
            if self.broken is not None:
                fut.set_exception(self.broken)
                return fut
            self.jobs.put((text, fut))
            if len(self.threads) < self.n:
                t = threading.Thread(target=self._serve, daemon=True, name="gac-fold")
                self.threads.append(t)
                t.start()
            return fut

    def _serve(self) -> None:
        fut: Future | None = None
        proc = None
        try:
            proc = subprocess.Popen(_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            while (item := self.jobs.get()) is not None:
                text, fut = item
                if not fut.set_running_or_notify_cancel():
                    fut = None  # (taken back: the scheduler folded it itself)
                    continue
                try:
                    fold_worker.write_message(proc.stdin, {"text": text})
                    reply = fold_worker.read_message(proc.stdout)
                except OSError:  # (a broken pipe: the worker is gone)
                    reply = None
                if reply is None:
                    raise CompileError(f"a gpu stage worker (template folding) exited with code "
                                       f"{proc.wait()}; GAC_GPU_STAGE_WORKERS=0 folds in-process")
                if "error" in reply:
                    log.debug("gac gpu stage worker: %s", reply.get("trace"))
                    fut.set_exception(CompileError(f"folding a kernel template failed in a gpu stage "
                                                   f"worker: {reply['error']}"))
                else:
                    fut.set_result(base64.b64decode(reply["bytecode"]))
                fut = None
        except BaseException as e:  # noqa: BLE001  (handed to the waiters)
            err = e if isinstance(e, CompileError) else CompileError(f"a gpu stage worker failed: {e!r}")
            if fut is not None and not fut.done():
                fut.set_exception(err)
            self._fail(err)
        finally:
            if proc is not None:
                _end(proc)

    def _fail(self, err: CompileError) -> None:
        with self.lock:
            self.broken = err
            while True:
                try:
                    item = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not None and not item[1].done():
                    item[1].set_exception(err)

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)  # (each thread ends its worker)


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()

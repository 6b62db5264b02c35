"""The torch process state gac's front-ends touch while they trace, kept safe and left clean.

torch's tracing (torch.export, ExportedProgram.run_decompositions, make_fx) is not thread-safe:
it patches global op tables and dispatch state for its duration (4 threads decomposing at once
fail with "Trying to override a python impl", KeyError('custom'), and can leave a patch behind).
Every front-end traces under `tracing()`: one process-wide lock (re-entrant: a trace may call
another front-end), released before gac's own compile, which runs in parallel (each partition
has its own MLIR context). On the way out `tracing()` also drops the references torch keeps to
the last traced graph (proxy_tensor's fake-tensor → node map, read only by torch.export's leak
check right after its own trace): gac rewrites that graph into the compiled program, so the map
would keep the last program and its device memory alive after the user drops it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

TRACE_LOCK = threading.RLock()


def release_trace_globals() -> None:
    """Forgets the graph torch's last make_fx trace left in module globals."""
    from torch.fx.experimental import proxy_tensor

    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Holds the trace lock; on exit no torch global refers to the traced graph."""
    with TRACE_LOCK:
        try:
            yield
        finally:
            release_trace_globals()

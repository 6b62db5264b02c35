"""The torch process state gac's front-ends touch while they trace, kept safe and left clean.

torch's tracing (torch.export, ExportedProgram.run_decompositions, make_fx) is not thread-safe:
it patches global op tables and dispatch state for its duration (4 threads decomposing at once
fail with "Trying to override a python impl", KeyError('custom'), and can leave a patch behind).
Every front-end traces under `tracing()`: one process-wide lock (re-entrant: a trace may call
another front-end), released before gac's own compile, which runs in parallel (each partition
has its own MLIR context). On the way out `tracing()` also drops the references torch keeps to
the last traced graph (proxy_tensor's fake-tensor → node map, read only by torch.export's leak
check right after its own trace): gac rewrites that graph into the compiled program, so the map
would keep the last program and its device memory alive after the user drops it; and the
generated source torch.fx keeps forever for every GraphModule ever recompiled, once the module is
gone (~50 KB per compile otherwise). The dynamo front-end calls release_trace_globals() after
AOTAutograd. benchmarks/compile_memory.py measures what 1,000 compile cycles leave.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

TRACE_LOCK = threading.RLock()
_STALE_SEEN: weakref.WeakSet = weakref.WeakSet()  # dynamo guard managers seen without a cache entry


def release_trace_globals() -> None:
    """Forgets the graph torch's last make_fx trace left in module globals, and the generated
    source of GraphModules that no longer exist."""
    from torch.fx.experimental import proxy_tensor

    with TRACE_LOCK:  # not while another gac trace builds GraphModules
        getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()
        forget_dead_fx_sources()


def _live_fx_sources() -> set[str]:
    """The generated-source file names the forward of every GraphModule class alive uses (each
    GraphModule gets its own class; dead ones leave __subclasses__ when collected)."""
    from torch import fx

    names: set[str] = set()
    todo: list[type] = [fx.GraphModule]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        code = getattr(cls.__dict__.get("forward"), "__code__", None)
        if code is not None:
            names.add(code.co_filename)
    return names


def forget_dead_fx_sources() -> None:
    """torch.fx keeps the source of every GraphModule.recompile() (its _loader and linecache) for
    the life of the process: ~50 KB per compile, never freed (aot_eager grows the same way). Drops
    the entries no live GraphModule's forward uses; they serve only to show source lines."""
    import linecache

    from torch.fx import graph_module

    cache = getattr(getattr(graph_module, "_loader", None), "eval_cache", None)
    if not isinstance(cache, dict):
        return
    live = _live_fx_sources()
    for name in [k for k in cache if k.startswith("<eval_with_key>") and k not in live]:
        cache.pop(name, None)
        linecache.cache.pop(name, None)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Holds the trace lock; on exit no torch global refers to the traced graph."""
    with TRACE_LOCK:
        try:
            yield
        finally:
            release_trace_globals()


@contextlib.contextmanager
def retrace_without_export_guards() -> Iterator[None]:
    """ExportedProgram.run_decompositions re-traces ep.module(), whose `_guards_fn` fails on the
    fake inputs when an example input is non-contiguous and its dims are dynamic (torch 2.13:
    "'NoneType' object has no attribute 'size'"; e.g. two column views of one tensor with
    Dim.AUTO). gac checks the inputs itself, so the retrace goes without the guard module.
    Use under tracing() (the lock: torch's flag is a module global)."""
    from torch.export import _unlift

    ok = getattr(_unlift, "_ok_to_generate_guards_fn", None)
    if ok is None:  # another torch version: nothing to switch off
        yield
        return
    _unlift._ok_to_generate_guards_fn = lambda: False
    try:
        yield
    finally:
        _unlift._ok_to_generate_guards_fn = ok


@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """GraphModules that torch's tracing builds generate their Python code when first run or
    read, not at every recompile(): run_decompositions recompiles its intermediate graphs
    several times and runs none of them. torch's switch is a module global: held under the
    trace lock, so that concurrent compiles cannot leave it on."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # another torch version: eager code generation, as before
        yield
        return
    with TRACE_LOCK, _use_lazy_graph_module(True):
        yield


def lazy_graph_module(root, graph, class_name: str = "GraphModule"):
    """fx.GraphModule(root, graph) whose code is generated when first run or read."""
    from torch import fx

    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule(root, graph, class_name)
    return _LazyGraphModule(root, graph, class_name)


def copy_graph_module(gm):
    """A copy of gm's graph (each node's metadata dict copied, its values shared) in a lazy graph
    module over gm's attributes: what a deepcopy gives for a graph gac compiles, without copying
    every fake tensor and generating the code again (~1 s for a BEVFormer-sized graph)."""
    import copy

    from torch import fx

    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = lazy_graph_module(gm, graph)
    copied.meta.update(gm.meta)
    return copied


def forget_stale_dynamo_guards() -> None:
    """Every dynamo compile registers weakref.finalize callbacks on the long-lived objects its
    guards ID-match (torch.nn.functional, module classes, builtins). They keep the guard manager
    (~100 KB) until those objects die, i.e. forever, though after torch._dynamo.reset() the
    callback does nothing (CheckFunctionManager.invalidate needs a cache entry; reset clears it).
    Detaches the callbacks of managers without a cache entry at two successive gac compiles (a
    manager being built has none for a moment, then gets one). Called under dynamo's compile lock."""
    try:
        from torch._dynamo.guards import CheckFunctionManager
    except ImportError:
        return
    invalidate = getattr(CheckFunctionManager, "invalidate", None)
    for fin, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
        method = getattr(getattr(info, "func", None), "func", None)
        if invalidate is None or getattr(method, "__func__", None) is not invalidate:
            continue
        manager = method.__self__
        if getattr(getattr(manager, "guard_manager", None), "cache_entry", True) is not None:
            continue
        if manager in _STALE_SEEN:
            fin.detach()
        else:
            _STALE_SEEN.add(manager)

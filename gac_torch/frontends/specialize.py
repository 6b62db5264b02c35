"""Graphs with symbolic sizes that gac cannot compile once for all sizes.

gac compiles a graph with symbolic sizes (dynamo `dynamic=True` / `mark_dynamic`, export `Dim`s)
once, with kernels that take the sizes at run time, when its target and every op's lowering
handle run-time sizes (frontends/fx.py specialization_reason) and the target's compiler does not
refuse them (gac_torch.errors.StaticShapesOnly). Otherwise it is compiled once per distinct
concrete input signature seen at run time: the symbolic graph is re-traced with the
call's real shapes (make_fx in fake mode: no data is touched), and that static graph goes through
compile_graph. Dynamo compiles (and guards) once; gac keeps a small LRU of specializations.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable

import torch
import torch.fx as fx

log = logging.getLogger("gac_torch")


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a
                 for a in args)


def _drop_detach(gm: fx.GraphModule) -> None:
    """make_fx may detach parameters it is handed; in a functional graph that is the identity."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()


class ShapeSpecializing:
    """Callable over the graph's flat inputs; compiles and caches one static graph per shape."""

    def __init__(self, gm: fx.GraphModule, compile_static: Callable[[fx.GraphModule], Any],
                 max_entries: int = 16, reason: str = ""):
        self.gm = gm
        self.compile_static = compile_static  # static GraphModule -> CompiledFx
        self.max_entries = max_entries
        self.reason = reason  # why the sizes are not left to run time
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.latest: Any = None

    def specialize(self, args) -> Any:
        from torch.fx.experimental.proxy_tensor import make_fx

        key = _signature(args)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        from gac_torch.frontends.torch_state import tracing

        # no_grad: AOTAutograd graphs are already functional, no autograd to trace
        with tracing(), torch.no_grad():
            static = make_fx(self.gm, tracing_mode="fake")(*args)
        _drop_detach(static)
        compiled = self.compile_static(static)
        log.info("gac: specialized a dynamic-shape graph for %s (%s)",
                 [k[0] for k in key if isinstance(k, tuple)], self.reason)
        self.cache[key] = compiled
        if len(self.cache) > self.max_entries:
            self.cache.popitem(last=False)
        return compiled

    def __call__(self, *args):
        self.latest = self.specialize(args)
        return self.latest(*args)

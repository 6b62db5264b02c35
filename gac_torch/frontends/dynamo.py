"""torch.compile(model, backend="gac"): dynamo graph -> AOTAutograd (functional core ATen) -> gac.

Registered through the `torch_dynamo_backends` entry point, so no import is needed. AOTAutograd
gives inference graphs under no_grad and forward/backward graphs otherwise; both are compiled by
gac, so autograd stays correct (unsupported backward ops fall back to eager like any other).
"""

from __future__ import annotations

import collections
import logging
import weakref

import torch

from gac_torch.frontends.fx import compile_graph, compile_once_or_reason
from gac_torch.frontends.specialize import ShapeSpecializing
from gac_torch.frontends.torch_state import forget_stale_dynamo_guards, release_trace_globals
from gac_torch.legalize import decompositions
from gac_torch.legalize.fast_paths import FAST_PATH_DECOMPOSITIONS
from gac_torch.options import resolve

log = logging.getLogger("gac_torch")


class RecentGraphs:
    """The most recently compiled graphs (CompiledFx: .report, .ir(stage)), newest last, for as
    long as torch keeps them: a weak list, so that torch._dynamo.reset() frees them (each
    CompiledFx lives as long as its GraphModule, which dynamo holds)."""

    def __init__(self, maxlen: int = 64):
        self._refs: collections.deque = collections.deque(maxlen=maxlen)

    def append(self, compiled) -> None:
        compiled.gm.meta["gac_compiled"] = compiled  # a cycle the garbage collector frees
        self._refs.append(weakref.ref(compiled))

    def _live(self) -> list:
        return [c for c in (r() for r in self._refs) if c is not None]

    def clear(self) -> None:
        self._refs.clear()

    def __iter__(self):
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __getitem__(self, i):
        return self._live()[i]


compiled_graphs = RecentGraphs(64)


def gac_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None, **kw):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    opts = resolve(options, **kw)

    def compile_static(graph: torch.fx.GraphModule):
        compiled = compile_graph(graph, opts)
        compiled_graphs.append(compiled)
        return compiled.gm

    def compile_fn(graph: torch.fx.GraphModule, inputs):
        # Symbolic sizes compile once (kernels take the sizes at run time) where gac can.
        compiled, reason = compile_once_or_reason(graph, opts)
        if compiled is not None:
            compiled_graphs.append(compiled)
            return make_boxed_func(compiled.gm)
        log.info("gac: graph with symbolic sizes compiled per shape: %s", reason)
        return make_boxed_func(ShapeSpecializing(graph, compile_static, reason=reason))

    forget_stale_dynamo_guards()
    try:
        return aot_autograd(fw_compiler=compile_fn, bw_compiler=compile_fn,
                            decompositions={**decompositions(), **FAST_PATH_DECOMPOSITIONS})(gm, example_inputs)
    finally:
        release_trace_globals()  # AOTAutograd's make_fx left the graph gac compiled in torch's globals

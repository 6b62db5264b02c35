"""torch.compile(model, backend="gac"): dynamo graph -> AOTAutograd (functional core ATen) -> gac.

Registered through the `torch_dynamo_backends` entry point, so no import is needed. AOTAutograd
gives inference graphs under no_grad and forward/backward graphs otherwise; both are compiled by
gac, so autograd stays correct (unsupported backward ops fall back to eager like any other).
"""

from __future__ import annotations

import collections
import logging

import torch

from gac_torch.backends.base import StaticShapesOnly
from gac_torch.frontends.fx import compile_graph, specialization_reason
from gac_torch.frontends.specialize import ShapeSpecializing
from gac_torch.legalize import decompositions
from gac_torch.legalize.fast_paths import FAST_PATH_DECOMPOSITIONS
from gac_torch.options import resolve
from gac_torch.runtime import progress

log = logging.getLogger("gac_torch")
# The most recently compiled graphs (CompiledFx: .report, .ir(stage)), newest last.
compiled_graphs: collections.deque = collections.deque(maxlen=64)


def gac_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None, **kw):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    opts = resolve(options, **kw)

    def compile_static(graph: torch.fx.GraphModule):
        compiled = compile_graph(graph, opts)
        compiled_graphs.append(compiled)
        progress.add_report(compiled.report)  # gac_torch.reports() / last_report()
        return compiled.gm

    def compile_fn(graph: torch.fx.GraphModule, inputs):
        # Symbolic sizes compile once (kernels take the sizes at run time) where gac can.
        reason = specialization_reason(graph, opts)
        if not reason:
            try:
                return make_boxed_func(compile_static(graph))
            except StaticShapesOnly as e:
                reason = str(e)
        log.info("gac: graph with symbolic sizes compiled per shape: %s", reason)
        return make_boxed_func(ShapeSpecializing(graph, compile_static, reason=reason))

    return aot_autograd(fw_compiler=compile_fn, bw_compiler=compile_fn,
                        decompositions={**decompositions(), **FAST_PATH_DECOMPOSITIONS})(gm, example_inputs)

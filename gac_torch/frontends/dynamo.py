"""torch.compile(model, backend="gac"): dynamo graph -> AOTAutograd (functional core ATen) -> gac.

Registered through the `torch_dynamo_backends` entry point, so no import is needed. AOTAutograd
gives inference graphs under no_grad and forward/backward graphs otherwise; both are compiled by
gac, so autograd stays correct (unsupported backward ops fall back to eager like any other).
"""

from __future__ import annotations

import collections
import logging
import re
import warnings

import torch

from gac_torch.backends.base import StaticShapesOnly
from gac_torch.frontends.fx import compile_graph, specialization_reason
from gac_torch.frontends.specialize import ShapeSpecializing
from gac_torch.legalize import decompositions
from gac_torch.legalize.fast_paths import FAST_PATH_DECOMPOSITIONS
from gac_torch.options import OptionError, resolve
from gac_torch.runtime import progress

log = logging.getLogger("gac_torch")
# The most recently compiled graphs (CompiledFx: .report, .ir(stage)), newest last.
compiled_graphs: collections.deque = collections.deque(maxlen=64)


MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_modes_warned: set = set()


def _check_mode(mode) -> None:
    """torch.compile's `mode`: gac has one way to compile today, so any other mode says so once."""
    if mode not in MODES:
        raise OptionError(f"unknown torch.compile mode {mode!r} for backend 'gac'; torch's modes: "
                          f"{', '.join(m for m in MODES if m)}")
    if mode not in (None, "default") and mode not in _modes_warned:
        _modes_warned.add(mode)
        warnings.warn(f"gac: mode={mode!r} has no effect yet (no autotuner, no CUDA graphs per mode); "
                      "compiling as mode='default'", stacklevel=2)


def _user_names(gm: torch.fx.GraphModule) -> list[str]:
    """Per dynamo graph input, the name the user knows: `x` for L['x'], `linear.weight` for a
    module's parameter (dynamo's sources), else dynamo's placeholder name."""
    names = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        source = getattr(n.meta.get("grapharg"), "source", None)
        parts = re.findall(r"\['([^']+)'\]", source.name) if source is not None else []
        parts = [p for p in parts if p not in ("self", "_modules", "_parameters", "_buffers")]
        names.append("_".join(parts) if parts else n.name)
    return names


def _name_inputs(graph: torch.fx.GraphModule, names: list[str]) -> None:
    """AOTAutograd's forward graph takes dynamo's inputs in order as primals_k / arg_k: give
    them the user's names so errors say `input 'x'` (other graphs are left alone)."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names) or not all(
            re.fullmatch(r"(primals|arg\d+)_\d+", p.name) for p in placeholders):
        return
    for p, name in zip(placeholders, names):
        if name.isidentifier():
            p._rename(name)
    graph.recompile()


def gac_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None, **kw):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    opts = resolve(options, **kw)
    _check_mode(mode)

    def compile_static(graph: torch.fx.GraphModule):
        compiled = compile_graph(graph, opts)
        compiled_graphs.append(compiled)
        progress.add_report(compiled.report)  # gac_torch.reports() / last_report()
        return compiled.gm

    user_names = _user_names(gm)

    def compile_fn(graph: torch.fx.GraphModule, inputs):
        _name_inputs(graph, user_names)
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

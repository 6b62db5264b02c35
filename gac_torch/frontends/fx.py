"""Shared by every torch front-end: an ATen FX graph -> partitions compiled by gac, rest eager."""

from __future__ import annotations

import itertools
import logging
import operator
import os
import warnings

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from gac_torch.backends import Target, get_target
from gac_torch.driver import compile_partition
from gac_torch.errors import (
    GacCompilerError, GacCompilerWarning, GacUnsupportedError, MissingDependency, StaticShapesOnly,
)
from gac_torch.legalize.context import NEEDS_STATIC
from gac_torch.legalize.norm import eager_layer_norm_stat_dtypes
from gac_torch.options import resolve
from gac_torch.passes.input_views import views_of_inputs
from gac_torch.passes.partition import (
    COMPILER_ERROR, GraphReport, analyze, drop_metadata_asserts, op_name, partition,
)
from gac_torch.runtime import progress
from gac_torch.runtime.compiled import CompiledGraph

log = logging.getLogger("gac_torch")
_graph_ids = itertools.count()


def strict_internal() -> bool:
    """GAC_STRICT_INTERNAL=1: a compiler error is an error even in default mode (tests/conftest)."""
    return os.environ.get("GAC_STRICT_INTERNAL", "") not in ("", "0")


def default_target(gm: fx.GraphModule) -> str:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.device.type == "cuda":
            return "cuda"
    return "cpu"


def has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt):
            return True
        if isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape):
            return True
    return False


def specialization_reason(gm: fx.GraphModule, options: dict) -> str | None:
    """Why a graph with symbolic sizes must be compiled once per concrete shape, or None when gac
    compiles it once, with kernels that take the sizes at run time."""
    if not has_symbolic_shapes(gm):
        return None
    target = get_target(options["target"] or default_target(gm))
    if not target.dynamic_shapes:
        return f"the {target.name} target compiles static shapes only"
    _, report = analyze(gm)
    static_only = sorted({op for (op, why) in report.unsupported if why.startswith(NEEDS_STATIC)})
    if static_only:
        return "lowered for static sizes only: " + ", ".join(static_only)
    return None


def compile_once_or_reason(gm: fx.GraphModule, options: dict) -> tuple[CompiledFx | None, str | None]:
    """The run-time-size policy, in one place for every front-end: a graph compiles once (sizes
    as kernel arguments where it has symbolic ones) unless its target or ops need static sizes,
    before compiling (`specialization_reason`) or while compiling (the target raises
    StaticShapesOnly). Returns (the compiled graph, None) or (None, why to compile per shape)."""
    reason = specialization_reason(gm, options)
    if not reason:
        try:
            return compile_graph(gm, options), None
        except StaticShapesOnly as e:
            reason = str(e)
    return None, reason


class CompiledFx:
    """The result of compiling one graph: a callable GraphModule plus what happened to it.
    `dynamic`: the graph has sizes known only at run time, compiled once for all of them."""

    def __init__(self, gm: fx.GraphModule, report: GraphReport, partitions: dict[str, CompiledGraph],
                 target: str, dynamic: bool = False):
        self.gm = gm
        self.report = report
        self.partitions = partitions
        self.target = target
        self.dynamic = dynamic

    def __call__(self, *args):
        return self.gm(*args)

    def ir(self, stage: str) -> str:
        if not self.partitions:
            raise KeyError("nothing was compiled for this graph (every node fell back to eager)")
        texts = [f"// partition {name}\n{cg.ir(stage)}" if len(self.partitions) > 1 else cg.ir(stage)
                 for name, cg in self.partitions.items()]
        return "\n".join(texts)


def compile_graph(gm: fx.GraphModule, options: dict, target: Target | None = None) -> CompiledFx:
    """Partitions gm and compiles each supported partition (`target`: a Target object to use
    instead of options["target"], e.g. the CLI's stages-only copy)."""
    # torch.compile calls its backend under its FakeTensorMode: constants gac builds while
    # legalizing (index tables, flips) must be real tensors.
    with unset_fake_temporarily():
        return _compile_graph(gm, options, target)


def _compile_graph(gm: fx.GraphModule, options: dict, target: Target | None) -> CompiledFx:
    graph_id = next(_graph_ids)
    target_name = target.name if target else options["target"] or default_target(gm)
    target = target or get_target(target_name)  # no silent fallback to another target: its errors surface
    options = resolve(options, target=target_name)  # the target's options (CudaOptions, ...)

    target.check_requirements()  # a missing extra is an error naming it, not a silent fallback
    drop_metadata_asserts(gm)
    eager_layer_norm_stat_dtypes(gm)
    views_of_inputs(gm)  # transposed matrices between graphs: torch's views, not copies
    gm.graph.eliminate_dead_code()  # e.g. getitems of unused statistics (keeps impure nodes)
    decisions, report = analyze(gm)
    if report.unsupported and not options["fallback"]:
        gm.recompile()  # its code matches its edited graph (partition() recompiles otherwise)
        raise GacUnsupportedError(
            "gac cannot compile these ops (fallback=False):\n" + "\n".join(
                f"  {op}: {n} node(s), {why}" for (op, why), n in sorted(report.unsupported.items())))

    dump_dir = os.path.join(options["dump_dir"], f"graph_{graph_id}") if options["dump_dir"] else None
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, "fx_graph.txt"), "w") as f:
            f.write(str(gm.graph))

    fused, names = partition(gm, decisions, options["min_block_size"])  # recompiles gm, once
    compiled: dict[str, CompiledGraph] = {}
    with progress.Compile(f"graph {graph_id} on {target_name}") as running:
        for k, name in enumerate(names):
            running.step("legalize", partition=f"partition {k + 1} of {len(names)} ({name})")
            _compile_one(fused, name, target, options, dump_dir, report, compiled, graph_id)
    report.partitions = len(compiled)  # (compiled partitions replaced submodules: code unchanged)
    log.info("gac: graph %d on %s: %s", graph_id, target_name, report.summary())
    return CompiledFx(fused, report, compiled, target_name, dynamic=has_symbolic_shapes(gm))


def _compile_one(fused: fx.GraphModule, name: str, target: Target, options, dump_dir: str | None,
                 report: GraphReport, compiled: dict, graph_id: int) -> None:
    """Compiles partition `name` in place (or leaves it to eager, visibly, recording why)."""
    sub = getattr(fused, name)
    try:
        cg = compile_partition(sub, name, target, options, dump_dir)
    except (StaticShapesOnly, MissingDependency):
        raise  # the front-end compiles the graph per shape instead; an extra to install
    except Exception as e:  # a gac bug: visible, and in default mode the partition runs eagerly
        ops = [n for n in sub.graph.nodes  # counted as analyze() counts them
               if n.op == "call_function" and n.target is not operator.getitem]
        why = f"{COMPILER_ERROR}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        if not options["fallback"] or strict_internal():
            kinds = sorted({op_name(n) for n in ops})
            raise GacCompilerError(f"gac failed to compile partition {name} ({len(ops)} node(s): "
                                   f"{', '.join(kinds[:8])}{' ...' if len(kinds) > 8 else ''}): "
                                   f"{why}") from e
        report.compiled -= len(ops)
        report.unsupported[(f"partition {name}", why)] += len(ops)
        warnings.warn(f"gac: graph {graph_id} partition {name} ({len(ops)} node(s)) runs eagerly "
                      f"after a {why}", GacCompilerWarning, stacklevel=3)
        return
    setattr(fused, name, cg)
    # also an instance attribute: the generated code's `self.<name>` per call then skips
    # nn.Module.__getattr__ (a Python-level lookup in _modules per partition and call)
    fused.__dict__[name] = cg
    compiled[name] = cg


__all__ = ["compile_graph", "compile_once_or_reason", "CompiledFx", "specialization_reason"]

"""Partitioning: supported ATen nodes are grouped into compiled regions, the rest stay eager.

Uses torch's CapabilityBasedPartitioner (as Torch-TensorRT does): it merges supported nodes into
maximal groups without creating cycles; each group becomes a `call_module` to a submodule that the
driver compiles.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

try:  # a graph module whose code is generated when first run or read
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # another torch: generated at once
    _LazyGraphModule = fx.GraphModule

from gac_torch.legalize import node_support
from gac_torch.legalize.context import HOST_SIZE_MATH, INPUT_VIEW
from gac_torch.legalize.registry import COLLECTIVE

_SKIP = {"placeholder", "output", "get_attr"}

# Export-time metadata asserts: with static shapes they restate what the compiled graph's input
# checks enforce, and as side-effecting nodes they would split partitions.
_METADATA_ASSERTS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size")


def drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Edits gm's graph only: its code is regenerated once, by partition() (each recompile of a
    BEVFormer-sized graph costs ~0.1 s of code generation and `compile`)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and not node.users and any(
                a in str(node.target) for a in _METADATA_ASSERTS):
            gm.graph.erase_node(node)


def op_name(node: fx.Node) -> str:
    t = node.target
    return str(t) if not callable(t) or not hasattr(t, "__name__") or "aten" in str(t) else t.__name__


COMPILER_ERROR = "compiler error"  # the reason of nodes whose partition failed to compile


@dataclass
class GraphReport:
    """What happened to one graph: how much compiles and what falls back, with reasons."""

    total: int = 0
    compiled: int = 0
    partitions: int = 0
    unsupported: Counter = field(default_factory=Counter)  # (op, reason) -> count
    in_torch: Counter = field(default_factory=Counter)  # op -> count: collectives, torch's by design

    @property
    def compiler_errors(self) -> int:
        """Nodes that run eagerly because their partition failed to compile (a gac bug)."""
        return sum(n for (_, why), n in self.unsupported.items() if why.startswith(COMPILER_ERROR))

    @property
    def percent(self) -> float:
        return 100.0 * self.compiled / self.total if self.total else 100.0

    def summary(self) -> str:
        line = (f"{self.compiled}/{self.total} ATen nodes compiled ({self.percent:.1f}%), "
                f"{self.partitions} compiled partition(s)")
        if self.unsupported:
            falls = ", ".join(f"{op} x{n} ({why})" for (op, why), n in sorted(self.unsupported.items()))
            line += f"; eager fallback: {falls}"
        if self.in_torch:
            line += "; left to torch: " + ", ".join(f"{op} x{n}" for op, n in sorted(self.in_torch.items()))
            line += f" ({COLLECTIVE})"
        return line

    __str__ = summary


def analyze(gm: fx.GraphModule) -> tuple[dict[fx.Node, str | None], GraphReport]:
    """Support decision per compute node, and the report (before partitioning)."""
    decisions, report = {}, GraphReport()
    for node in gm.graph.nodes:
        if node.op in _SKIP:
            continue
        why = node_support(node)
        decisions[node] = why
        if node.op == "call_function" and node.target is operator.getitem or why in (HOST_SIZE_MATH, INPUT_VIEW):
            continue  # bookkeeping (tuple access, size arithmetic on Python ints), not an op
        if why == COLLECTIVE:  # communication is torch's job: neither compiled nor a fallback
            report.in_torch[op_name(node)] += 1
            continue
        report.total += 1
        if why is None:
            report.compiled += 1
        else:
            report.unsupported[(op_name(node), why)] += 1
    return decisions, report


class _Support(OperatorSupportBase):
    def __init__(self, decisions):
        self.decisions = decisions

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return self.decisions.get(node, "unknown") is None


def partition(gm: fx.GraphModule, decisions, min_block_size: int = 1) -> tuple[fx.GraphModule, list[str]]:
    """Fuses supported regions into submodules named fused_*; returns the graph and their names."""
    whole = _whole_graph(gm, decisions)
    if whole is not None:
        proposed = [whole]
    else:
        partitioner = CapabilityBasedPartitioner(gm, _Support(decisions), allows_single_node_partition=True)
        proposed = [p.nodes for p in partitioner.propose_partitions()]
    parts = [p for p in proposed if sum(1 for n in p if n.target is not operator.getitem) >= min_block_size]
    fused = _fuse_partitions(gm, parts)
    return fused, renumber_partitions(fused)


def renumber_partitions(fused: fx.GraphModule) -> list[str]:
    """torch numbers the partitions in reverse: renumbers them fused_0, ... in graph (execution)
    order and returns their names."""
    calls = [n for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]
    subs = [getattr(fused, n.target) for n in calls]
    for n in calls:
        delattr(fused, n.target)
    for i, (n, sub) in enumerate(zip(calls, subs)):
        n.target = f"fused_{i}"
        n._rename(f"{n.target}_out")  # (the graph's namespace keeps the old node names taken)
        setattr(fused, n.target, sub)
    fused.recompile()
    return [n.target for n in calls]


def _whole_graph(gm: fx.GraphModule, decisions) -> dict[fx.Node, None] | None:
    """The one partition CapabilityBasedPartitioner proposes when every compute node is supported
    (all of them, in graph order), found without its merging (quadratic in the graph: ~1.5 s
    for BEVFormer-tiny's 1,800 nodes); None otherwise."""
    nodes = {}  # (a get_attr node is an input of the partition, as a placeholder is)
    for n in gm.graph.nodes:
        if n.op not in _SKIP:
            if decisions.get(n, "unknown") is not None:
                return None
            nodes[n] = None
    return nodes or None


def _fuse_partitions(gm: fx.GraphModule, partitions: list[dict[fx.Node, None]]) -> fx.GraphModule:
    """torch's fuse_by_partitions (fx/passes/utils/fuser_utils.py), each submodule a lazy graph
    module: the driver compiles its graph and never runs its Python code, which torch would
    otherwise generate at every recompile of gm (each ~0.3 s for a BEVFormer-sized partition)."""
    from torch.fx.passes.tools_common import stable_topological_sort
    from torch.fx.passes.utils.fuser_utils import erase_nodes, insert_subgm, topo_sort, validate_partition

    # torch < 2.12's insert_subgm has no insertion point (it appends; the sort below moves it)
    at_point = "insertion_point" in inspect.signature(insert_subgm).parameters
    for k, part in enumerate(partitions):
        nodes = topo_sort(list(part))
        if not validate_partition(nodes):
            raise AssertionError("Invalid partition, found dependency cycles")
        sub, inputs, outputs = _fuse_as_graph_module(gm, nodes, f"fused_{k}", part)
        insert_subgm(gm, sub, inputs, outputs, *([nodes[-1]] if at_point else []))
        erase_nodes(gm, nodes)
    stable_topological_sort(gm)
    gm.graph.lint()
    return gm


def _fuse_as_graph_module(gm: fx.GraphModule, nodes: list[fx.Node], name: str, part: dict):
    """fuser_utils.fuse_as_graphmodule: (the submodule, its inputs in gm, its outputs in gm)."""
    from torch.fx.passes.utils.common import HolderModule

    sub = fx.Graph()
    placeholders: dict[fx.Node, fx.Node] = {}
    copies: dict[fx.Node, fx.Node] = {}

    def remap(x: fx.Node) -> fx.Node:
        if x in part:
            return copies[x]
        if x not in placeholders:
            p = placeholders[x] = sub.placeholder(x.name, type_expr=x.type)
            p.meta = copy.copy(x.meta)
        return placeholders[x]

    for node in nodes:
        copies[node] = sub.node_copy(node, remap)
    outputs = {node: copies[node] for node in nodes if any(u not in part for u in node.users)}
    outs = tuple(outputs.values())
    sub.output(outs[0] if len(outs) == 1 else outs)
    sub.lint()
    root = HolderModule({})
    for node in sub.nodes:  # (what lift_subgraph_as_module copies: get_attr / call_module targets)
        if node.op in ("get_attr", "call_module"):
            raise AssertionError(f"a {node.op} node in a partition")
    return _LazyGraphModule(root, sub, name), tuple(placeholders), tuple(outputs)

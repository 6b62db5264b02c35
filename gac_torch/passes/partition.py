"""Partitioning: supported ATen nodes are grouped into compiled regions, the rest stay eager.

Uses torch's CapabilityBasedPartitioner (as Torch-TensorRT does): it merges supported nodes into
maximal groups without creating cycles; each group becomes a `call_module` to a submodule that the
driver compiles.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from gac_torch.legalize import node_support
from gac_torch.legalize.context import HOST_SIZE_MATH
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
        if node.op == "call_function" and node.target is operator.getitem or why == HOST_SIZE_MATH:
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
    partitioner = CapabilityBasedPartitioner(gm, _Support(decisions), allows_single_node_partition=True)
    parts = [p for p in partitioner.propose_partitions()
             if sum(1 for n in p.nodes if n.target is not operator.getitem) >= min_block_size]
    fused = partitioner.fuse_partitions(parts)
    calls = [n for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]
    # torch numbers the partitions in reverse; renumber them in graph (execution) order
    subs = [getattr(fused, n.target) for n in calls]
    for n in calls:
        delattr(fused, n.target)
    for i, (n, sub) in enumerate(zip(calls, subs)):
        n.target = f"fused_{i}"
        n._rename(f"{n.target}_out")  # (the graph's namespace keeps the old node names taken)
        setattr(fused, n.target, sub)
    fused.recompile()
    return fused, [n.target for n in calls]

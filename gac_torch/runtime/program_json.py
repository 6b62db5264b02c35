"""A cached program's graph as plain JSON, when it is nothing but compiled partitions.

A whole-program cache entry (artifact.remember_program) holds the partitioned program as
`program.pt2`; reading that back costs torch.export.load ~1.5 s on BEVFormer-tiny (its
deserializer resolves type hints per object), most of a warm compile. A program whose graph is
only placeholders, `gac::partition` calls, their getitems and the output (every node compiled,
static sizes) is described here as JSON instead and rebuilt around the caller's
ExportedProgram: on a hit the cache key vouches that the caller's program has the same
placeholders, signature, constants and size ranges, and its parameters and buffers are the
values to run with. `describe` writes the description only where that holds for the program
being stored (same placeholder names, the same constant tensors); anything else keeps the
torch.export path.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument,
)

FORMAT = 1


def _is_constant(s: InputSpec) -> bool:
    return s.kind == InputKind.CONSTANT_TENSOR or (s.kind == InputKind.BUFFER and not s.persistent)


def _same_tensor(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu()))


def describe(ep: ExportedProgram, caller: ExportedProgram) -> dict | None:
    """The JSON description of `ep` (a saved program: partition calls only) rebuildable around
    `caller`, or None when it is not that simple."""
    sig = ep.graph_signature
    if any(not isinstance(s.arg, TensorArgument) for s in (*sig.input_specs, *sig.output_specs)):
        return None
    theirs = {n.name for n in caller.graph.nodes if n.op == "placeholder"}
    inputs = []
    for s in sig.input_specs:
        if s.arg.name not in theirs:
            return None
        if _is_constant(s):
            if not _same_tensor(ep.constants.get(s.target), caller.constants.get(s.target)):
                return None
        elif s.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            if s.target not in caller.state_dict:
                return None
        elif s.kind != InputKind.USER_INPUT:
            return None
        inputs.append({"name": s.arg.name, "kind": s.kind.name, "target": s.target, "persistent": s.persistent})
    nodes: list[dict] = []
    outputs: list[str] = []
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            outs = n.args[0]
            if not isinstance(outs, (tuple, list)) or not all(isinstance(o, torch.fx.Node) for o in outs):
                return None
            outputs = [o.name for o in outs]
        elif n.op == "call_function" and n.target is torch.ops.gac.partition.default:
            name, tensors, sizes = n.args
            vals = n.meta.get("val")
            if sizes or not all(isinstance(t, torch.fx.Node) for t in tensors) or not isinstance(vals, (list, tuple)) \
                    or not all(isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape) for v in vals):
                return None  # run-time sizes: torch.export's symbolic metadata is needed
            nodes.append({"op": "partition", "name": n.name, "partition": name, "tensors": [t.name for t in tensors],
                          "outputs": [[list(v.shape), str(v.dtype).removeprefix("torch."), str(v.device)] for v in vals]})
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) \
                and n.args[0].target is torch.ops.gac.partition.default and isinstance(n.args[1], int):
            nodes.append({"op": "getitem", "name": n.name, "of": n.args[0].name, "index": n.args[1]})
        else:
            return None
    return {"format": FORMAT, "inputs": inputs, "nodes": nodes, "outputs": outputs,
            "output_specs": [{"kind": s.kind.name, "name": s.arg.name, "target": s.target} for s in sig.output_specs]}


def rebuild(desc: dict, caller: ExportedProgram) -> ExportedProgram:
    """The program `describe` described, with the caller's parameters, buffers, constants,
    ranges and placeholder metadata. Raises (KeyError, ValueError, ...) where the description
    does not fit the caller: the cache then reads program.pt2."""
    if desc.get("format") != FORMAT:
        raise ValueError(f"program description format {desc.get('format')}")
    theirs = {n.name: n.meta.get("val") for n in caller.graph.nodes if n.op == "placeholder"}
    mode = next((v.fake_mode for v in theirs.values() if hasattr(v, "fake_mode")), None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def named(node: torch.fx.Node, name: str) -> torch.fx.Node:
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        env[name] = node
        return node

    for i in desc["inputs"]:
        named(graph.placeholder(i["name"]), i["name"]).meta["val"] = theirs[i["name"]]
    for d in desc["nodes"]:
        if d["op"] == "partition":
            node = graph.create_node("call_function", torch.ops.gac.partition.default,
                                     (d["partition"], [env[t] for t in d["tensors"]], []), name=d["name"])
            with mode:
                node.meta["val"] = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                                    for shape, dtype, device in d["outputs"]]
        else:
            of = env[d["of"]]
            node = graph.create_node("call_function", operator.getitem, (of, d["index"]), name=d["name"])
            node.meta["val"] = of.meta["val"][d["index"]]
        named(node, d["name"])
    graph.output(tuple(env[o] for o in desc["outputs"]))
    inputs = [InputSpec(InputKind[i["kind"]], TensorArgument(i["name"]), i["target"], i["persistent"])
              for i in desc["inputs"]]
    outputs = [OutputSpec(OutputKind[o["kind"]], TensorArgument(o["name"]), o["target"]) for o in desc["output_specs"]]
    state_dict = {s.target: caller.state_dict[s.target] for s in inputs
                  if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and not _is_constant(s)}
    constants = {s.target: caller.constants[s.target] for s in inputs if _is_constant(s)}
    return ExportedProgram(root=torch.fx.GraphModule(torch.nn.Module(), graph), graph=graph,
                           graph_signature=ExportGraphSignature(input_specs=inputs, output_specs=outputs),
                           state_dict=state_dict, range_constraints=caller.range_constraints,
                           module_call_graph=caller.module_call_graph, example_inputs=None,
                           constants=constants, verifiers=[caller.verifier])

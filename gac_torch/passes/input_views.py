"""Transposed matrices between graphs as views, not copies (GAC_INPUT_VIEWS=0 turns it off).

A training step's forward saves W^T for the backward (AOTAutograd's `t = aten.t(W)`, used by the
forward's GEMM and returned): compiled into a partition, that output was a transpose kernel
(128 MB of traffic for a 4096^2 weight), and the backward, whose input then had the view's
strides in its metadata, read it as if dense. Two rewrites of the ATen graph before
partitioning, both leaving a view op to torch (a node marked INPUT_VIEW: no kernel, no copy,
not a fallback; Inductor returns such a view too):

- an output that is a transpose of a graph input is computed by torch (`aten.t` on the input,
  a view); the partition keeps its own transpose for the ops that read it (folded into the GEMM);
- a 2-D graph input whose strides are a transpose's (stride (1, rows)) and that the graph only
  transposes (the backward's `aten.t(W^T)`) reaches the partition as `aten.t(input)`, the dense
  matrix it views (a view again), and the partition transposes that back: the two transposes
  cancel (the GEMM reads W). Other strided inputs are made dense per call, as before. Should the input come dense at run time, the
  partition receives a strided view and makes it dense, as before: values never depend on it.
"""

from __future__ import annotations

import os

import torch
import torch.fx as fx

from gac_torch.legalize.context import INPUT_VIEW_KEY, node_support

aten = torch.ops.aten


def enabled() -> bool:
    return os.environ.get("GAC_INPUT_VIEWS", "1") != "0"


def _transposed_matrix(v) -> bool:
    return (isinstance(v, torch.Tensor) and v.dim() == 2 and all(isinstance(s, int) for s in v.shape)
            and v.shape[0] > 1 and v.shape[1] > 1 and tuple(v.stride()) == (1, v.shape[0]))


def _eager_view(graph: fx.Graph, like: fx.Node, src: fx.Node, val) -> fx.Node:
    """aten.t(src), left to torch (INPUT_VIEW)."""
    node = graph.call_function(aten.t.default, (src,))
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
    node.meta["val"] = val
    node.meta[INPUT_VIEW_KEY] = True
    return node


def views_of_inputs(gm: fx.GraphModule) -> int:
    """Applies both rewrites (module docstring); returns how many nodes they added."""
    if not enabled():
        return 0
    graph = gm.graph
    nodes = list(graph.nodes)
    output = nodes[-1]
    added = 0
    # 1. outputs that are a transpose of an input: torch's view
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else None
    if outs is not None:
        new_outs = list(outs)
        for i, r in enumerate(outs):
            if not (isinstance(r, fx.Node) and r.op == "call_function" and r.target is aten.t.default
                    and isinstance(r.args[0], fx.Node) and r.args[0].op == "placeholder" and node_support(r) is None):
                continue
            with graph.inserting_before(output):
                new_outs[i] = _eager_view(graph, r, r.args[0], r.meta.get("val"))
            added += 1
        if added:
            output.args = (type(outs)(new_outs),) + tuple(output.args[1:])
    # 2. transposed 2-D inputs: the dense matrix they view goes in, transposed back inside
    for p in [n for n in nodes if n.op == "placeholder"]:
        v = p.meta.get("val")
        users = list(p.users)
        if not _transposed_matrix(v) or not users or any(
                u.target is not aten.t.default or node_support(u) is not None or u.meta.get(INPUT_VIEW_KEY)
                for u in users):
            continue  # (only where the graph transposes it back: the two transposes then cancel)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            dense = _eager_view(graph, p, p, v.t())
            back = graph.call_function(aten.t.default, (dense,))
            back.meta["val"] = v
        for u in users:
            u.replace_input_with(p, back)
        added += 2
    if added:
        gm.recompile()
    return added

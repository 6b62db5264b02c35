"""The eager semantics the export path restores around gac's functional graph.

torch.export hands gac a functional graph: an in-place update of a user input or a buffer becomes
an extra output (the graph signature's USER_INPUT_MUTATION / BUFFER_MUTATION), an output that is
a view of an input is computed like any other, and autograd is gone. `ExportSemantics` puts eager
back: (1) mutation outputs are copied into the caller's tensor / the program's buffer, so the next
call sees them; (2) an output that eager returns as the mutated input itself, or as a view of an
input, is that tensor (or a view replayed eagerly on it), so it aliases as eager's does; (3) when
autograd is on and an input or parameter requires grad, the compiled forward runs inside an
autograd.Function whose backward recomputes the functional graph eagerly (with the forward's RNG
state) and differentiates it: gradients are eager's, the backward is not compiled (for a compiled
backward use torch.compile(backend="gac")).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from gac_torch.frontends.torch_state import copy_graph_module

_MUTATIONS = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION, OutputKind.USER_INPUT_MUTATION)


def _is_view(n: fx.Node) -> bool:
    """An ATen op whose result aliases its first argument (view, select, permute, ...)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # an element of split / unbind / chunk
        return isinstance(n.args[0], fx.Node) and _is_view(n.args[0])
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    alias = schema.returns[0].alias_info
    first = schema.arguments[0].alias_info
    return alias is not None and not alias.is_write and first is not None and \
        alias.before_set == first.before_set


def _eager_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """An eager copy of the functional graph (compile_graph rewrites gm in place); its code is
    generated at its first run, i.e. by a backward only."""
    return copy_graph_module(gm)


class ExportSemantics:
    """What to do with the compiled graph's outputs: mutations to apply and user outputs to give
    back (a compiled value, an input itself, or an eagerly replayed view of one)."""

    def __init__(self, ep: ExportedProgram, gm: fx.GraphModule):
        sig = ep.graph_signature
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out_nodes = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        by_target = {s.target: i for i, s in enumerate(sig.input_specs)
                     if s.kind in (InputKind.BUFFER, InputKind.PARAMETER)}
        by_name = {s.arg.name: i for i, s in enumerate(sig.input_specs) if s.kind == InputKind.USER_INPUT}
        self.mutations: list[tuple[int, int]] = []  # (graph output, input it is written to)
        self.user_outputs: list[int] = []
        for j, s in enumerate(sig.output_specs):
            if s.kind in _MUTATIONS:
                table = by_name if s.kind == OutputKind.USER_INPUT_MUTATION else by_target
                self.mutations.append((j, table[s.target]))
            elif s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                self.user_outputs.append(j)
        self.mutated_inputs = {i for _, i in self.mutations}
        # a node whose value eager leaves in an input (x.add_(1) returns x itself)
        written: dict[fx.Node, fx.Node] = {out_nodes[j]: placeholders[i] for j, i in self.mutations}
        index = {p: i for i, p in enumerate(placeholders)}
        # per user output: ("compiled", graph output) | ("input", input index) | ("view", replay)
        self.plan: list[tuple[str, Any]] = []
        for j in self.user_outputs:
            node = out_nodes[j]
            base = written.get(node, node) if isinstance(node, fx.Node) else node
            if isinstance(base, fx.Node) and base.op == "placeholder":
                self.plan.append(("input", index[base]))
            elif isinstance(node, fx.Node) and _is_view(node):
                replay = _view_replay(node, placeholders, written)
                self.plan.append(("view", replay) if replay is not None else ("compiled", j))
            else:
                self.plan.append(("compiled", j))
        self.random = any(n.op == "call_function" and torch.Tag.nondeterministic_seeded in
                          getattr(n.target, "tags", ()) for n in gm.graph.nodes)
        self.eager = _eager_copy(gm)  # the backward's recompute

    def run(self, compiled: Callable, full: list) -> list:
        """Calls the compiled graph on the full input list; applies mutations; the user outputs."""
        tensors = [t for t in full if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            outs = _autograd_run(self, compiled, full)
        else:
            outs = compiled(*full)
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        with torch.no_grad():
            for j, i in self.mutations:
                if full[i] is not outs[j]:
                    full[i].copy_(outs[j])
        user = []
        for kind, what in self.plan:
            if kind == "compiled":
                user.append(outs[what])
            elif kind == "input":
                user.append(full[what])
            else:
                user.append(what(*full))
        return user


def _view_replay(node: fx.Node, placeholders: Sequence[fx.Node],
                 written: dict[fx.Node, fx.Node]) -> fx.GraphModule | None:
    """A graph that recomputes `node` from the inputs with view ops only (a mutated value read as
    its input), or None when node is not a pure view of an input."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: graph.placeholder(p.name) for p in placeholders}
    for p, new in zip(placeholders, env.values()):
        new.meta = dict(p.meta)

    def copy(n: fx.Node) -> fx.Node | None:
        n = written.get(n, n)
        if n in env:
            return env[n]
        val = n.meta.get("val")
        if n.op != "call_function" or (not _is_view(n) and not isinstance(val, (torch.SymInt, int))):
            return None  # computes a new tensor: not a view
        deps = n.all_input_nodes
        copied = [copy(d) for d in deps]
        if any(c is None for c in copied):
            return None
        mapping = dict(zip(deps, copied))
        env[n] = graph.node_copy(n, lambda a: mapping[a])
        return env[n]

    out = copy(node)
    if out is None:
        return None
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


class _CompiledForward(torch.autograd.Function):
    """Forward: gac's compiled graph. Backward: eager recompute of the functional graph."""

    @staticmethod
    def forward(ctx, sem: ExportSemantics, compiled: Callable, full: list, saved: list, rng, diff: list,
                *leaves):
        outs = compiled(*full)
        outs = tuple(outs) if isinstance(outs, (list, tuple)) else (outs,)
        ctx.sem, ctx.saved, ctx.rng, ctx.diff = sem, saved, rng, diff
        ctx.set_materialize_grads(False)
        dead = {j for j, _ in sem.mutations}
        ctx.mark_non_differentiable(*[o for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and (
            j in dead or not (o.is_floating_point() or o.is_complex()))])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        full = list(ctx.saved)
        with torch.enable_grad(), torch.random.fork_rng(devices=ctx.rng[1] if ctx.rng else [],
                                                        enabled=ctx.rng is not None):
            if ctx.rng is not None:
                _set_rng(ctx.rng)
            leaves = []
            for i in ctx.diff:
                full[i] = full[i].detach().requires_grad_()
                leaves.append(full[i])
            outs = ctx.sem.eager(*full)
            outs = outs if isinstance(outs, (list, tuple)) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                      allow_unused=True) if pairs else [None] * len(leaves)
        return (None,) * 6 + tuple(got)


def _get_rng(tensors: Sequence[torch.Tensor]):
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng(rng) -> None:
    cpu, devices, states = rng
    torch.set_rng_state(cpu)
    for d, s in zip(devices, states):
        torch.cuda.set_rng_state(s, d)


def _autograd_run(sem: ExportSemantics, compiled: Callable, full: list) -> tuple:
    diff = [i for i, t in enumerate(full) if isinstance(t, torch.Tensor) and t.requires_grad]
    for i in diff:
        if i in sem.mutated_inputs:
            raise RuntimeError("a tensor that requires grad is modified in place by the exported program; "
                               "gac_torch.compile(exported_program) does not differentiate through that "
                               "(use torch.compile(backend='gac'))")
    # the backward recomputes from the inputs as they were before this call's mutations
    saved = [t.clone() if i in sem.mutated_inputs else t for i, t in enumerate(full)]
    rng = _get_rng([t for t in full if isinstance(t, torch.Tensor)]) if sem.random else None
    return _CompiledForward.apply(sem, compiled, full, saved, rng, diff, *[full[i] for i in diff])

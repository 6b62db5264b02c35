"""Numerical blame: which op of a model does gac get wrong?

    report = gac_torch.debug.bisect(model, (x,), target="cpu")
    print(report)            # the first op whose output diverges from eager, and its repro file

bisect() exports the model, decomposes it as gac_torch.compile does and runs the core ATen graph
eagerly once, keeping every node's value. Then:
1. op by op: each node is compiled alone by gac (strict) and run on the very values eager gave its
   inputs, so an upstream error cannot hide or fake a downstream one; the first node whose output
   is off beyond the fuzzer's tolerances (gac_torch.tools.fuzz.oracle, with the float64 tie-break)
   or whose compile crashes is blamed;
2. if every op is right alone but the whole graph is wrong (a bug of fusion or of a pass that
   sees several ops), prefixes of the graph are compiled and halved until the shortest prefix
   whose last value diverges; its last node is blamed.
The blamed node's inputs are saved with torch.save (op name, args with tensors, kwargs, eager's
and gac's outputs) so the op can be replayed without the model: see Blame.replay().
"""

from __future__ import annotations

import operator
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from gac_torch.frontends.fx import GacUnsupportedError, compile_graph
from gac_torch.legalize import decompositions
from gac_torch.options import resolve
from gac_torch.tools.fuzz.oracle import compare_tensor


@dataclass
class Blame:
    node: str  # the FX node's name
    op: str  # its target, e.g. "aten.add.Tensor"
    how: str  # "op" (alone), "prefix" (only with the ops before it), "crash"
    detail: str
    repro: str | None  # the torch.save file
    checked: int  # nodes compiled and compared before it was found

    def __str__(self) -> str:
        where = f"; inputs saved to {self.repro}" if self.repro else ""
        return f"bisect: {self.op} (node {self.node}) diverges [{self.how}]: {self.detail}{where}"

    @staticmethod
    def replay(path: str, target: str = "cpu"):
        """Runs the saved op once eagerly and once compiled by gac: (eager, gac)."""
        saved = torch.load(path, weights_only=False)
        op = _resolve_op(saved["op"])
        args, kwargs = saved["args"], saved["kwargs"]

        class One(torch.nn.Module):
            def forward(self, *ts):
                it = iter(ts)
                a = pytree.tree_map(lambda x: next(it) if isinstance(x, torch.Tensor) else x, args)
                return op(*a, **kwargs)

        import gac_torch

        tensors = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        compiled = gac_torch.compile(One(), tuple(tensors), target=target, options={"fallback": False})
        return One()(*tensors), compiled(*tensors)


def _resolve_op(name: str):
    """"torch.ops.aten.add.Tensor" -> the OpOverload."""
    ns, op, overload = name.split(".")[-3:]
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _graph(model, inputs: Sequence[torch.Tensor]) -> tuple[fx.GraphModule, list]:
    """The core ATen graph gac_torch.compile would see, and its placeholders' values."""
    from torch.export.graph_signature import InputKind

    from gac_torch.frontends.decompose import decompose_program
    from gac_torch.frontends.export import _lifted_value

    ep = model if isinstance(model, torch.export.ExportedProgram) else torch.export.export(model, tuple(inputs))
    ep = decompose_program(ep, decompositions())
    user = iter(inputs)
    values = [next(user) if s.kind == InputKind.USER_INPUT else _lifted_value(ep, s)
              for s in ep.graph_signature.input_specs]
    return ep.graph_module, values


def _eager_values(gm: fx.GraphModule, args: list) -> dict[fx.Node, Any]:
    env: dict[fx.Node, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]

    Keep(gm).run(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return env


def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and isinstance(n.meta.get("val"), (torch.Tensor, tuple, list))]


def _prefix(gm: fx.GraphModule, last: fx.Node) -> list[fx.Node]:
    """The call nodes up to `last` (getitems included), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.append(n)
        if n is last:
            return out
    raise ValueError(f"{last} is not in the graph")


def _tensors_of(value) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _sub_graph(gm: fx.GraphModule, nodes: list[fx.Node], out: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A graph of `nodes` (in order) whose inputs are the values they read from outside and
    whose outputs are out's tensors."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    outside: list[fx.Node] = []
    inside = set(nodes)

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:
            p = g.placeholder(f"in_{len(outside)}")
            p.meta = dict(a.meta)
            env[a] = p
            outside.append(a)
        return env[a]

    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
        env[n] = g.node_copy(n, lambda a: env[a])
    o = env[out]
    val = out.meta["val"]
    if isinstance(val, (tuple, list)):
        items = []
        for i, v in enumerate(val):
            if isinstance(v, torch.Tensor):
                gi = g.call_function(operator.getitem, (o, i))
                gi.meta["val"] = v
                items.append(gi)
        g.output(tuple(items))
    else:
        g.output((o,))
    return fx.GraphModule(gm, g), outside


class _Check:
    def __init__(self, gm, env, target: str):
        self.gm, self.env = gm, env
        self.options = resolve({"fallback": False}, target=target)
        self.checked = 0

    def run(self, nodes: list[fx.Node], out: fx.Node) -> tuple[str | None, list]:
        """(why out diverges or None, gac's outputs); raises on compile errors."""
        sub, outside = _sub_graph(self.gm, nodes, out)
        args = [self.env[a] for a in outside]
        self.checked += 1
        compiled = compile_graph(sub, self.options)
        got = list(compiled(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
        want = _tensors_of(self.env[out])
        if len(got) != len(want):
            return f"{len(got)} outputs, eager {len(want)}", got
        wide = _lazy_wide(sub, args)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            why = compare_tensor(g, w, lambda i=i: wide()[i] if wide() else None)
            if why:
                return f"output {i}: {why}", got
        return None, got


def _lazy_wide(sub: fx.GraphModule, args: list) -> Callable[[], list | None]:
    """The sub-graph run eagerly on float64 copies of its inputs (the oracle's tie-break)."""
    cache: list = []

    def get():
        if not cache:
            try:
                wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
                cache.append(list(sub(*wide)))
            except Exception:  # noqa: BLE001
                cache.append(None)
        return cache[0]
    return get


def _save(node: fx.Node, env, got, out_dir: str | None) -> str:
    out_dir = out_dir or tempfile.mkdtemp(prefix="gac_bisect_")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"bisect_{node.name}.pt")
    args = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args)
    kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, dict(node.kwargs))
    torch.save({"op": f"torch.ops.{node.target}", "args": args, "kwargs": kwargs,
                "eager": env[node], "gac": got, "node": node.format_node()}, path)
    return path


def bisect(model, inputs: Sequence[torch.Tensor], target: str = "cpu", out_dir: str | None = None
           ) -> Blame | None:
    """The first op of `model` whose gac output diverges from eager (None when none does).
    model: an nn.Module or a torch.export ExportedProgram; inputs: its positional tensors."""
    gm, args = _graph(model, inputs)
    env = _eager_values(gm, args)
    check = _Check(gm, env, target)
    ops = _ops(gm)
    # 1. op by op, on eager's values
    for n in ops:
        try:
            why, got = check.run([n], n)
        except GacUnsupportedError:
            continue  # gac does not lower it: the op runs eagerly, it cannot be wrong
        except Exception as e:  # noqa: BLE001
            return Blame(n.name, str(n.target), "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                         _save(n, env, None, out_dir), check.checked)
        if why:
            return Blame(n.name, str(n.target), "op", why, _save(n, env, got, out_dir), check.checked)
    # 2. prefixes: the shortest one whose last value diverges
    def bad(k: int):
        try:
            why, got = check.run(_prefix(gm, ops[k]), ops[k])
        except GacUnsupportedError:
            return None
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", None
        return (why, got) if why else None

    lo, hi = 0, len(ops) - 1
    if not ops or bad(hi) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if bad(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    why, got = bad(lo)
    n = ops[lo]
    return Blame(n.name, str(n.target), "prefix", why, _save(n, env, got, out_dir), check.checked)


__all__ = ["Blame", "bisect"]

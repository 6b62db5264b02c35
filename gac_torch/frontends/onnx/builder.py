"""GraphBuilder: builds the FX graph of ATen calls that an ONNX model becomes.

A value is either an `fx.Node` (computed at run time; `meta["val"]` is a FakeTensor filled as the
node is created) or a real `torch.Tensor` (known at import time). `call` folds a call whose inputs
are all known (that is how Shape -> Gather -> Concat -> Reshape chains vanish on static shapes)
and otherwise lifts known tensors into the graph: splats become `aten.full`, everything else a
parameter placeholder bound at call time (weights never become IR text).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any, TypeGuard, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from gac_torch.frontends.onnx.registry import Unsupported

aten = torch.ops.aten
Value = Union[torch.Tensor, fx.Node]


class GraphBuilder:
    def __init__(self, device: str = "cpu"):
        self.graph = fx.Graph()
        self.fake = FakeTensorMode()
        self.device = torch.device(device)
        self.inputs: list[fx.Node] = []  # user inputs, in ONNX order
        self.params: dict[fx.Node, torch.Tensor] = {}  # lifted tensors, bound at call time
        self._lifted: dict[int, fx.Node] = {}  # id(tensor) -> its node
        self._names: dict[int, str] = {}  # id(initializer) -> ONNX name
        self._keep: list[torch.Tensor] = []  # keeps ids above unique
        self._last_placeholder: fx.Node | None = None
        self._used_names: set[str] = set()

    # --- graph inputs -------------------------------------------------------------------------
    def _placeholder(self, name: str, val: torch.Tensor) -> fx.Node:
        if self._last_placeholder is not None:
            ctx = self.graph.inserting_after(self._last_placeholder)
        else:
            first = next(iter(self.graph.nodes), None)
            ctx = self.graph.inserting_before(first)
        # ONNX names ("onnx::Mul_4", "2199") are not Python identifiers; FX's code needs them to be.
        ident = re.sub(r"\W", "_", name)
        ident = ident if ident[:1].isalpha() else f"v_{ident}"
        while ident in self._used_names:
            ident = f"{ident}_{len(self._used_names)}"
        self._used_names.add(ident)
        with ctx:
            node = self.graph.placeholder(ident)
        node.meta["val"] = val
        self._last_placeholder = node
        return node

    def input(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> fx.Node:
        with self.fake:
            val = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        node = self._placeholder(name, val)
        self.inputs.append(node)
        return node

    def initializer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Registers an ONNX initializer: known at import time, a parameter when used as data."""
        self._names[id(t)] = name
        self._keep.append(t)
        return t

    def lift(self, t: torch.Tensor) -> fx.Node:
        node = self._lifted.get(id(t))
        if node is not None:
            return node
        is_init = id(t) in self._names
        if t.numel() <= 1 or (not is_init and _is_splat(t)):  # a splat is one number, not data
            value = t.flatten()[0].item() if t.numel() else 0
            node = self._node(
                aten.full.default, (list(t.shape), value), {"dtype": t.dtype, "device": self.device}
            )
        else:
            with self.fake:
                val = torch.empty(tuple(t.shape), dtype=t.dtype, device=self.device)
            node = self._placeholder(self._names.get(id(t), "const"), val)
            self.params[node] = t
        self._lifted[id(t)] = node
        self._keep.append(t)
        return node

    # --- calls --------------------------------------------------------------------------------
    def call(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        """target(*args, **kwargs): folded now if every tensor argument is known, else a node
        (or a list of getitem nodes for list results)."""
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(a, fx.Node) for a in leaves):
            with torch.no_grad():
                return target(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(torch.Tensor, self.lift, (args, kwargs))
        node = self._node(target, args, kwargs)
        val = node.meta["val"]
        if isinstance(val, (list, tuple)):
            outs = []
            for i, v in enumerate(val):
                item = self.graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = v
                outs.append(item)
            return outs
        return node

    def _node(self, target: Any, args: tuple, kwargs: dict) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fargs, fkwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
        with self.fake:
            node.meta["val"] = target(*fargs, **fkwargs)
        return node

    # --- what op functions ask about values ---------------------------------------------------
    @staticmethod
    def meta(v: Value) -> torch.Tensor:
        return v.meta["val"] if isinstance(v, fx.Node) else v

    def shape(self, v: Value) -> list[int]:
        return [int(s) for s in self.meta(v).shape]

    def rank(self, v: Value) -> int:
        return self.meta(v).dim()

    def dtype(self, v: Value) -> torch.dtype:
        return self.meta(v).dtype

    @staticmethod
    def is_const(v: Value | None) -> TypeGuard[torch.Tensor]:
        return isinstance(v, torch.Tensor)

    @staticmethod
    def const(v: Value, what: str) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            raise Unsupported(f"{what} must be static (a constant or foldable from static shapes)")
        return v

    def ints(self, v: Value | None, what: str) -> list[int]:
        """A static input's values ([] for an omitted optional input)."""
        return [] if v is None else [int(i) for i in self.const(v, what).flatten().tolist()]

    def floats(self, v: Value | None, what: str) -> list[float]:
        return [] if v is None else [float(i) for i in self.const(v, what).flatten().tolist()]

    def scalar(self, v: Value, what: str) -> float | int | bool:
        return self.const(v, what).flatten()[0].item()

    def cast(self, v: Value, dtype: torch.dtype) -> Value:
        return v if self.dtype(v) == dtype else self.call(aten._to_copy.default, v, dtype=dtype)

    # --- finishing ----------------------------------------------------------------------------
    def output(self, values: Sequence[Value]) -> None:
        nodes = [self.lift(v) if isinstance(v, torch.Tensor) else v for v in values]
        self.graph.output(tuple(nodes))
        self.graph.eliminate_dead_code()
        for node, _ in list(self.params.items()):  # weights only dead code used
            if not node.users:
                self.graph.erase_node(node)
                del self.params[node]

    def placeholder_values(self) -> list[torch.Tensor]:
        return [n.meta["val"] for n in self.graph.nodes if n.op == "placeholder"]


def _is_splat(t: torch.Tensor) -> bool:
    flat = t.flatten()
    return flat.numel() == 0 or bool((flat == flat[0]).all())

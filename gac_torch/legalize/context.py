"""Turning one FX graph of ATen ops into a gac `func.func @main`."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from mlir import ir
from mlir.dialects import func

from gac_torch.ir.builder import GacBuilder
from gac_torch.ir.types import SUPPORTED_DTYPES, elem_of, shape_of, tensor_type, torch_dtype
from gac_torch.legalize.registry import REGISTRY


class LegalizeError(RuntimeError):
    """A node could not be legalized; names the node and op."""


def meta_val(node: Any):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_static_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape)


def node_support(node: fx.Node) -> str | None:
    """None if the node can be compiled, else the reason it falls back."""
    if node.op != "call_function":
        return "not a call"
    if node.target is operator.getitem:
        src = node.args[0]
        return None if isinstance(src, fx.Node) and node_support(src) is None else "getitem of a fallback"
    entry = REGISTRY.get(node.target)
    if entry is None:
        return "no lowering"
    if entry.bucket != "lower":
        return entry.reason or f"bucket {entry.bucket}"
    vals = [meta_val(a) for a in node.all_input_nodes] + _used_outputs(node)
    for v in vals:
        if v is None:
            return "missing shape metadata"
        if isinstance(v, torch.Tensor):
            if not is_static_tensor(v):
                return "dynamic shape"
            if v.dtype not in SUPPORTED_DTYPES:
                return f"dtype {v.dtype}"
        elif not isinstance(v, (int, float, bool)):
            return f"non-tensor value {type(v).__name__}"
    for v in [meta_val(a) for a in node.all_input_nodes]:
        if not isinstance(v, torch.Tensor):
            return "scalar graph input"
    if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in vals):
        # The runtime launches nothing for empty buffers; eager gives these for free.
        return "zero-size tensor"
    primary = next((v for v in (meta_val(a) for a in node.all_input_nodes) if isinstance(v, torch.Tensor)),
                   None)
    if primary is None:
        primary = _flat_outputs(meta_val(node))[0]
    if primary.dtype not in entry.dtypes:
        return f"dtype {primary.dtype} not supported by {entry.name}"
    if entry.check is not None:
        return entry.check(node)
    return None


def _used_outputs(node: fx.Node) -> list:
    """The output values the graph uses: unused tuple members (training statistics, RNG state)
    do not decide whether a node compiles."""
    v = meta_val(node)
    if not isinstance(v, (list, tuple)):
        return [v]
    used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
    return [x for i, x in enumerate(v) if x is not None and i in used]


def _flat_outputs(v) -> list:
    if isinstance(v, (list, tuple)):
        return [x for x in v if x is not None]
    return [v]


class Cx:
    """What a lowering sees: the builder, the node and its output metadata, and coercions."""

    def __init__(self, b: GacBuilder, node: fx.Node):
        self.b = b
        self.node = node
        self.val = meta_val(node)

    @property
    def out_dtype(self) -> torch.dtype:
        v = self.val[0] if isinstance(self.val, (list, tuple)) else self.val
        return v.dtype

    @property
    def out_shape(self) -> list[int]:
        v = self.val[0] if isinstance(self.val, (list, tuple)) else self.val
        return list(v.shape)

    def dtype_of(self, v) -> torch.dtype:
        if isinstance(v, ir.Value):
            return torch_dtype(elem_of(v))
        if isinstance(v, bool):
            return torch.bool
        return torch.int64 if isinstance(v, int) else torch.float32

    def to(self, v, dtype: torch.dtype) -> ir.Value:
        """A Value of `dtype`: casts tensors, turns Python scalars into splat constants."""
        if isinstance(v, ir.Value):
            return self.b.cast(v, dtype)
        return self.b.constant(v, dtype)

    def shape(self, v: ir.Value) -> list[int]:
        return list(shape_of(v))

    def matmul(self, a: ir.Value, b: ir.Value, wide: bool = False) -> ir.Value:
        """gac.matmul of (..., M, K) and (..., K, N); `wide` keeps an f16/bf16 product as its f32
        accumulator (so an epilogue rounds once, like ATen's addmm)."""
        dt = self.dtype_of(a)
        out = torch.float32 if wide and dt in (torch.float16, torch.bfloat16) else dt
        shape = self.shape(a)[:-1] + self.shape(b)[-1:]
        return self.b.matmul(a, b, result_type=tensor_type(shape, out))

    @staticmethod
    def compute_dtype(dt: torch.dtype) -> torch.dtype:
        """Where multi-step math on dt runs: f32 for f16/bf16 (ATen's opmath type)."""
        return torch.float32 if dt in (torch.float16, torch.bfloat16) else dt


def build_module(gm: fx.GraphModule, ctx: ir.Context) -> ir.Module:
    """Legalizes every node of gm (all must be supported) into `func.func @main`."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        in_types = [tensor_type(meta_val(p).shape, meta_val(p).dtype) for p in placeholders]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("main", ir.FunctionType.get(in_types, []))
            entry = fn.add_entry_block()
        env: dict[fx.Node, Any] = dict(zip(placeholders, entry.arguments))
        b = GacBuilder()
        results: list[ir.Value] = []
        with ir.InsertionPoint(entry):
            for node in graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    outs = node.args[0]
                    outs = outs if isinstance(outs, (list, tuple)) else [outs]
                    results = [env[o] for o in outs]
                    func.ReturnOp(results)
                    continue
                env[node] = _legalize_node(b, node, env)
        fn.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(in_types, [r.type for r in results]))
    return module


def _legalize_node(b: GacBuilder, node: fx.Node, env: dict) -> Any:
    if node.op != "call_function":
        raise LegalizeError(f"{node.format_node()}: unexpected {node.op} node")
    if node.target is operator.getitem:
        return env[node.args[0]][node.args[1]]
    entry = REGISTRY.get(node.target)
    if entry is None or entry.bucket != "lower":
        raise LegalizeError(f"{node.target} has no lowering")
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    try:
        out = entry.fn(Cx(b, node), *args, **kwargs)
    except LegalizeError:
        raise
    except Exception as e:  # a lowering bug must name the node, not surface deep in MLIR
        raise LegalizeError(f"legalizing {node.format_node()} ({node.target}) failed: "
                            f"{type(e).__name__}: {e}") from e
    _check_against_meta(node, out)
    return out


def _check_against_meta(node: fx.Node, out) -> None:
    expect = meta_val(node)
    outs = out if isinstance(out, tuple) else (out,)
    exps = expect if isinstance(expect, (list, tuple)) else (expect,)
    for o, e in zip(outs, exps):
        if o is None or e is None:
            continue
        if tuple(shape_of(o)) != tuple(e.shape) or torch_dtype(elem_of(o)) != e.dtype:
            raise LegalizeError(
                f"{node.format_node()}: gac produced {torch_dtype(elem_of(o))}{list(shape_of(o))}, "
                f"ATen says {e.dtype}{list(e.shape)}")

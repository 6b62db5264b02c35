"""Turning one FX graph of ATen ops into a gac `func.func @main`."""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from mlir import ir
from mlir.dialects import arith, func

from gac_torch.ir.builder import GacBuilder
from gac_torch.ir.types import DYN, SUPPORTED_DTYPES, elem_of, shape_of, static_dim, tensor_type, torch_dtype
from gac_torch.legalize.registry import REGISTRY
from gac_torch.legalize.sizes import SizeTable, size_expr
from gac_torch.runtime.sizes import solvable
from gac_torch.errors import GacUnsupportedError

# Reasons node_support gives that the front-ends act on.
HOST_SIZE_MATH = "size arithmetic (runs on the host, feeds compiled graphs as a size argument)"
# A view of a graph input that torch makes (passes/input_views.py): neither compiled nor a fallback.
INPUT_VIEW = "a view of a graph input (torch makes it: no kernel, no copy)"
INPUT_VIEW_KEY = "gac_input_view"  # the node meta flag that marks one
# Prefix of the reasons that only hold for run-time sizes (the op compiles once shapes are static).
NEEDS_STATIC = "dynamic shape"


class LegalizeError(GacUnsupportedError):
    """A node could not be legalized; names the node and op."""


def meta_val(node: Any):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_static_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape)


def is_empty_output(v) -> bool:
    """A statically zero-size tensor (or spec): never an output of a compiled kernel program."""
    return isinstance(getattr(v, "shape", None), (tuple, torch.Size)) and any(
        isinstance(s, int) and s == 0 for s in v.shape)


def is_size_value(v) -> bool:
    return isinstance(v, torch.SymInt)


def node_support(node: fx.Node) -> str | None:
    """None if the node can be compiled, else the reason it falls back."""
    if node.op != "call_function":
        return "not a call"
    if node.meta.get(INPUT_VIEW_KEY):
        return INPUT_VIEW
    if is_size_value(meta_val(node)):
        return HOST_SIZE_MATH
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
            if not is_static_tensor(v) and not entry.dynamic:
                return f"{NEEDS_STATIC} ({entry.name} is compiled for static sizes only)"
            if v.dtype not in SUPPORTED_DTYPES:
                return f"dtype {v.dtype}"
        elif not isinstance(v, (int, float, bool)) and not is_size_value(v):
            return f"non-tensor value {type(v).__name__}"
    for v in [meta_val(a) for a in node.all_input_nodes]:
        if not isinstance(v, torch.Tensor) and not is_size_value(v):
            return "scalar graph input"
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
    """What a lowering sees: the builder, the node and its output metadata, and coercions.

    Shapes (`out_shape`, `shape(v)`) are lists of ints, with an index Value in place of each size
    known only at run time; gac ops that make sizes (reshape, broadcast) take such lists."""

    def __init__(self, b: GacBuilder, node: fx.Node, sizes: SizeTable | None = None,
                 known: dict | None = None):
        self.b = b
        self.node = node
        self.val = meta_val(node)
        self.sizes = sizes or SizeTable()
        self.known = known or {}  # gac Value -> its torch (symbolic) shape

    @property
    def out_dtype(self) -> torch.dtype:
        v = self.val[0] if isinstance(self.val, (list, tuple)) else self.val
        return v.dtype

    @property
    def out_shape(self) -> list:
        v = self.val[0] if isinstance(self.val, (list, tuple)) else self.val
        return self.dims(v.shape)

    def dims(self, torch_shape) -> list:
        """A torch shape (ints / SymInts) as ints and run-time index Values."""
        return [s if static_dim(s) != DYN else self.sizes.value(size_expr(s)) for s in torch_shape]

    def size(self, s) -> int | ir.Value:
        return s if static_dim(s) != DYN else self.sizes.value(size_expr(s))

    def dtype_of(self, v) -> torch.dtype:
        if isinstance(v, ir.Value) and isinstance(v.type, ir.IndexType):
            return torch.int64
        if isinstance(v, ir.Value):
            return torch_dtype(elem_of(v))
        if isinstance(v, bool):
            return torch.bool
        return torch.int64 if isinstance(v, int) else torch.float32

    def to(self, v, dtype: torch.dtype) -> ir.Value:
        """A Value of `dtype`: casts tensors, turns Python scalars into splat constants (and
        run-time sizes, index Values, into 0-d tensors)."""
        if isinstance(v, ir.Value) and isinstance(v.type, ir.IndexType):
            v = self.b.from_size(v)
        if isinstance(v, ir.Value):
            return self.b.cast(v, dtype)
        return self.b.constant(v, dtype)

    def shape(self, v: ir.Value) -> list:
        static = list(shape_of(v))
        if DYN not in static:
            return static
        if v in self.known:  # a node's value: its symbolic sizes, shared by every user
            return self.dims(self.known[v])
        return [s if s != DYN else self.b.dim(v, i) for i, s in enumerate(static)]

    def matmul(self, a: ir.Value, b: ir.Value, wide: bool = False) -> ir.Value:
        """gac.matmul of (..., M, K) and (..., K, N); `wide` keeps an f16/bf16 product as its f32
        accumulator (so an epilogue rounds once, like ATen's addmm)."""
        dt = self.dtype_of(a)
        out = torch.float32 if wide and dt in (torch.float16, torch.bfloat16) else dt
        shape = list(shape_of(a))[:-1] + list(shape_of(b))[-1:]
        return self.b.matmul(a, b, result_type=tensor_type(shape, out))

    @staticmethod
    def compute_dtype(dt: torch.dtype) -> torch.dtype:
        """Where multi-step math on dt runs: f32 for f16/bf16 (ATen's opmath type)."""
        return torch.float32 if dt in (torch.float16, torch.bfloat16) else dt


def _arg_type(p: fx.Node) -> ir.Type:
    v = meta_val(p)
    return ir.IndexType.get() if is_size_value(v) else tensor_type(v.shape, v.dtype)


def build_module(gm: fx.GraphModule, ctx: ir.Context) -> ir.Module:
    """Legalizes every node of gm (all must be supported) into `func.func @main`. Placeholders
    become arguments in order: tensors (run-time sizes as `?`), and sizes (SymInts) as index."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        in_types = [_arg_type(p) for p in placeholders]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("main", ir.FunctionType.get(in_types, []))
            entry = fn.add_entry_block()
        env: dict[fx.Node, Any] = dict(zip(placeholders, entry.arguments))
        b = GacBuilder()
        sizes = SizeTable()
        known: dict = {}  # gac Value -> torch shape, for values with run-time sizes
        results: list[ir.Value] = []
        with ir.InsertionPoint(entry):
            _bind_sizes(b, placeholders, env, sizes, known)
            for node in graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    outs = node.args[0]
                    outs = outs if isinstance(outs, (list, tuple)) else [outs]
                    # A zero-size output needs no buffer: the runtime makes it (is_empty_output).
                    results = [env[o] for o in outs if not is_empty_output(meta_val(o))]
                    func.ReturnOp(results)
                    continue
                env[node] = _legalize_node(b, node, env, sizes, known)
                _remember_shapes(node, env[node], known)
        fn.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(in_types, [r.type for r in results]))
    return module


def _bind_sizes(b: GacBuilder, placeholders, env: dict, sizes: SizeTable, known: dict) -> None:
    """Size arguments bind their expressions; each remaining symbol binds to gac.dim of the first
    input that has it as a bare dim, then to one where it is the one unknown of a linear size
    (a*s + b: s = (dim - b) / a). The runtime binds the same way (runtime/sizes.py)."""
    for p in placeholders:
        if is_size_value(meta_val(p)):
            sizes.bind(size_expr(meta_val(p)), env[p])
    dims = []
    for p in placeholders:
        v = meta_val(p)
        if isinstance(v, torch.Tensor) and not is_static_tensor(v):
            known[env[p]] = tuple(v.shape)
            dims += [(size_expr(s), p, i) for i, s in enumerate(v.shape) if not isinstance(s, int)]
    bound = {e for e in sizes.values if e.is_Symbol}
    for e, p, i in dims:
        if e.is_Symbol and e not in bound:
            sizes.bind(e, b.dim(env[p], i))
            bound.add(e)
    for e, p, i in dims:
        found = solvable(e, bound)
        if found:
            sym, a, c = found
            d = arith.subi(b.dim(env[p], i), sizes.value(sympy.Integer(c)))
            sizes.bind(sym, arith.floordivsi(d, sizes.value(sympy.Integer(a))) if a != 1 else d)
            bound.add(sym)


def _remember_shapes(node: fx.Node, out, known: dict) -> None:
    vals = meta_val(node)
    outs = out if isinstance(out, tuple) else (out,)
    exps = vals if isinstance(vals, (list, tuple)) else (vals,)
    for o, e in zip(outs, exps):
        if isinstance(o, ir.Value) and isinstance(e, torch.Tensor) and not is_static_tensor(e):
            known[o] = tuple(e.shape)


def _legalize_node(b: GacBuilder, node: fx.Node, env: dict, sizes: SizeTable | None = None,
                   known: dict | None = None) -> Any:
    if node.op != "call_function":
        raise LegalizeError(f"{node.format_node()}: unexpected {node.op} node")
    if node.target is operator.getitem:
        return env[node.args[0]][node.args[1]]
    entry = REGISTRY.get(node.target)
    if entry is None or entry.bucket != "lower":
        raise LegalizeError(f"{node.target} has no lowering")
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    outs = meta_val(node)
    if is_static_tensor(outs) and outs.numel() == 0:  # nothing to compute (inputs may be empty too)
        return b.broadcast(b.constant(0, outs.dtype), tuple(outs.shape))
    try:
        out = entry.fn(Cx(b, node, sizes, known), *args, **kwargs)
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
        want = tuple(static_dim(s) for s in e.shape)
        got = tuple(shape_of(o))
        # A run-time size may come out static (pinned by broadcasting against a static one).
        if (len(got) != len(want) or any(w != DYN and g != w for g, w in zip(got, want))
                or torch_dtype(elem_of(o)) != e.dtype):
            raise LegalizeError(
                f"{node.format_node()}: gac produced {torch_dtype(elem_of(o))}{list(shape_of(o))}, "
                f"ATen says {e.dtype}{list(e.shape)}")

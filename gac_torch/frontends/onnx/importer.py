"""ONNX graph -> FX graph of core ATen ops (with FakeTensor `meta["val"]`), ready for compile_graph.

Steps: (1) user inputs become placeholders with static shapes, initializers known tensors;
(2) each node goes through its op function (folded at import when its inputs are known), or,
if it has none or refuses its attributes, becomes an onnxruntime fallback node; (3) make_fx with
gac's decomposition table turns the graph into the core ATen that the registry speaks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from gac_torch.errors import GacUnsupportedError
from gac_torch.frontends.onnx import (  # noqa: F401 (each module registers its ops)
    ops_elementwise,
    ops_math,
    ops_nn,
    ops_reduce,
    ops_sample,
    ops_shape,
    ort_fallback,
)
from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.load import (
    OnnxLoadError,
    default_opset,
    to_torch,
    torch_dtype,
    value_types,
)
from gac_torch.frontends.onnx.registry import OnnxNode, Unsupported, lookup
from gac_torch.legalize import decompositions

log = logging.getLogger("gac_torch")


class OnnxUnsupportedError(GacUnsupportedError):
    """Strict mode (fallback=False): lists every ONNX node gac cannot map, at once."""

    def __init__(self, message: str, report: OnnxReport):
        super().__init__(message)
        self.report = report


@dataclass
class OnnxReport:
    """ONNX-level coverage: how many nodes map to ATen, fold away, or fall back to onnxruntime."""

    total: int = 0
    folded: int = 0  # evaluated at import (static shapes, constants)
    mapped: int = 0  # became ATen calls
    unsupported: Counter = field(default_factory=Counter)  # (op, reason) -> count
    ops: Counter = field(default_factory=Counter)  # op -> count, every node

    @property
    def supported(self) -> int:
        return self.folded + self.mapped

    @property
    def percent(self) -> float:
        return 100.0 * self.supported / self.total if self.total else 100.0

    def summary(self) -> str:
        line = (
            f"{self.supported}/{self.total} ONNX nodes supported ({self.percent:.1f}%): "
            f"{self.mapped} mapped to ATen, {self.folded} folded at import"
        )
        if self.unsupported:
            line += "; onnxruntime fallback: " + ", ".join(
                f"{op} x{n} ({why})" for (op, why), n in sorted(self.unsupported.items())
            )
        return line

    __str__ = summary


@dataclass
class ImportedGraph:
    gm: fx.GraphModule  # placeholders: user inputs, then parameters
    input_names: list[str]
    input_specs: list[tuple[tuple[int, ...], torch.dtype]]
    params: list[torch.Tensor]
    output_names: list[str]
    report: OnnxReport
    ort_nodes: list = field(default_factory=list)  # the onnxruntime nodes gm calls (kept alive)


def import_model(
    model: onnx.ModelProto,
    *,
    strict: bool = False,
    device: str = "cpu",
    example_inputs: Sequence[torch.Tensor] | None = None,
) -> ImportedGraph:
    """`model` has been through load_model. Inputs with symbolic dims take their shapes from
    `example_inputs` (one tensor per non-initializer graph input)."""
    opsets = {imp.domain or "": int(imp.version) for imp in model.opset_import}
    opsets[""] = default_opset(model)
    types = value_types(model)
    g = GraphBuilder(device)
    env: dict[str, Value | None] = {}  # None: unknown (after an unsupported node in strict mode)
    graph = model.graph
    for init in graph.initializer:
        env[init.name] = g.initializer(init.name, to_torch(init))
    user_inputs = [i for i in graph.input if i.name not in env]
    _add_inputs(g, env, user_inputs, example_inputs)

    report = OnnxReport()
    ort_nodes: list = []
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for proto in graph.node:
        n = OnnxNode.of(proto, opsets.get(proto.domain or "", 1))
        report.total += 1
        report.ops[n.key] += 1
        xs = [env[name] if name else None for name in proto.input]
        unknown_input = any(name and env.get(name) is None for name in proto.input)
        fn = lookup(n.op_type, n.domain)
        reason, outs = None, None
        if fn is None:
            reason = (
                "no ONNX -> ATen mapping" if n.domain in ("", "ai.onnx") else f"domain {n.domain!r}"
            )
        elif unknown_input:
            reason = "input from an unsupported node"  # in strict mode only: not counted below
        else:
            try:
                outs = _outputs(fn(g, n, *xs), proto, used)
            except Unsupported as e:
                reason = str(e)
            except Exception as e:  # a mapping bug must name the node; the model still runs
                if strict:
                    raise RuntimeError(
                        f"importing {n.label} failed: {type(e).__name__}: {e}"
                    ) from e
                reason = f"import failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                log.warning("gac onnx: %s falls back to onnxruntime: %s", n.label, reason)
        if outs is None:
            if reason != "input from an unsupported node":
                report.unsupported[(n.key, reason)] += 1
            # Strict mode only lists: the node's outputs stay unknown and later nodes are checked
            # for a mapping only. Otherwise the node runs through onnxruntime.
            outs = None if strict else _fallback(g, proto, n, xs, model, types, ort_nodes)
        elif all(isinstance(o, torch.Tensor) or o is None for o in outs):
            report.folded += 1
        else:
            report.mapped += 1
        for name, v in zip(proto.output, outs or [None] * len(proto.output)):
            if name:
                env[name] = v

    if report.unsupported and strict:
        raise OnnxUnsupportedError(
            f"gac cannot map these ONNX ops (fallback=False; {len(report.unsupported)} kind(s)):\n"
            + "\n".join(
                f"  {op}: {n} node(s), {why}" for (op, why), n in sorted(report.unsupported.items())
            ),
            report,
        )
    outputs = [env[o.name] for o in graph.output]
    assert all(o is not None for o in outputs)
    g.output(outputs)  # type: ignore[arg-type]
    gm = _to_core_aten(g)
    return ImportedGraph(
        gm,
        [i.name for i in user_inputs],
        [(tuple(g.shape(p)), g.dtype(p)) for p in g.inputs],
        list(g.params.values()),
        [o.name for o in graph.output],
        report,
        ort_nodes,
    )


def _add_inputs(
    g: GraphBuilder,
    env: dict,
    inputs: list[onnx.ValueInfoProto],
    examples: Sequence[torch.Tensor] | None,
) -> None:
    if examples is not None and len(examples) != len(inputs):
        raise OnnxLoadError(
            f"example_inputs: the model has {len(inputs)} inputs "
            f"({[i.name for i in inputs]}), got {len(examples)}"
        )
    for k, vi in enumerate(inputs):
        tt = vi.type.tensor_type
        dtype = torch_dtype(tt.elem_type)
        dims: list[int | None] = [
            d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim
        ]
        if examples is not None:
            ex = examples[k]
            ex_shape = list(ex.shape)
            if len(ex_shape) != len(dims) or any(
                d is not None and d != e for d, e in zip(dims, ex_shape)
            ):
                raise OnnxLoadError(
                    f"input {vi.name!r}: example shape {ex_shape} does not match "
                    f"the model's {['?' if d is None else d for d in dims]}"
                )
            dims = list(ex_shape)
        static = [d for d in dims if d is not None]
        if len(static) != len(dims):
            raise OnnxLoadError(
                f"input {vi.name!r} has symbolic dims "
                f"{[d.dim_value if d.HasField('dim_value') else d.dim_param or '?' for d in tt.shape.dim]}; "
                f"gac compiles static shapes: pass example_inputs to fix them"
            )
        env[vi.name] = g.input(vi.name, static, dtype)


def _outputs(result, proto: onnx.NodeProto, used: set[str]) -> list:
    outs = list(result) if isinstance(result, (list, tuple)) else [result]
    for k, name in enumerate(proto.output):
        if k >= len(outs) and name and name in used:
            raise Unsupported(f"output {k} ({name!r}) is not supported")
    return outs[: len(proto.output)] + [None] * (len(proto.output) - len(outs))


def _fallback(
    g: GraphBuilder,
    proto: onnx.NodeProto,
    n: OnnxNode,
    xs: list,
    model: onnx.ModelProto,
    types: dict,
    ort_nodes: list,
) -> list:
    """The node as an onnxruntime call (or folded through onnxruntime if its inputs are known);
    a call's node goes into `ort_nodes`, which keeps it alive as long as the graph."""
    present = [(name, x) for name, x in zip(proto.input, xs) if name]
    inputs = [(name, g.meta(x), g.is_const(x)) for name, x in present]
    try:
        key, entry = ort_fallback.register(proto, n.key, model, inputs, types)
    except ort_fallback.OrtUnavailable:
        raise OnnxLoadError(
            f"{n.label}: gac has no mapping and its output shapes are unknown "
            f"without onnxruntime (pip install onnxruntime)"
        ) from None
    except Exception as e:  # onnxruntime could not build or run the node either
        raise OnnxLoadError(
            f"{n.label}: gac has no mapping and onnxruntime cannot run it: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from e
    if all(g.is_const(x) for _, x in present) and ort_fallback.have_onnxruntime():
        return entry.run([])  # every input known: fold now
    dyn = [x for _, x in present if not g.is_const(x)]
    ort_nodes.append(entry)
    outs = g.call(torch.ops.gac_onnx.ort_node.default, key, dyn)
    it = iter(outs)
    return [next(it) if name else None for name in proto.output]


def _to_core_aten(g: GraphBuilder) -> fx.GraphModule:
    """make_fx over the builder's graph: decomposes to the core ATen the registry covers and
    re-derives every meta["val"] (reusing the builder's fake mode)."""
    from gac_torch.frontends.torch_state import tracing

    gm = fx.GraphModule(torch.nn.Module(), g.graph)
    with tracing():  # torch's tracing is not thread-safe; drops torch's reference to the graph
        core = make_fx(gm, decomposition_table=decompositions(), tracing_mode="fake")(
            *g.placeholder_values()
        )
    core.graph.eliminate_dead_code()
    core.recompile()
    return core

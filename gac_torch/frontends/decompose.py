"""ExportedProgram -> the core-ATen graph `run_decompositions` gives, without re-exporting it.

`ep.run_decompositions(table)` re-exports the whole program: it fakes every parameter, traces
the graph twice through AOTAutograd's functionalization (metadata, then the graph) and re-verifies
it: most of a cold compile's front end (BEVFormer-tiny: ~6 of its ~9 s). For the usual program
(static sizes, functional ATen ops) the result differs from the exported graph only at the nodes
that decompose, and each of those expands the same way wherever its inputs' metadata is the same.
So `decompose_program` decomposes only those nodes, through torch's own machinery (make_fx with
the same table, CIA overrides and backend flags as run_decompositions; one node per distinct op
and input metadata, all in one trace), re-normalizes the arguments of the nodes it keeps as the
dispatcher would, traces anew the nodes whose inputs' values differ from the exported ones (a
decomposition whose value is not the exported meta's, e.g. torch 2.11's linalg_vector_norm over a
negative dim of size 1, as gac's table rewrites it: every consumer's value changes, as in torch's
re-trace), and falls back to run_decompositions for anything else (symbolic sizes,
mutations, higher-order ops, a decomposition that traces a mutation). tests/test_decompose.py
asserts that the two graphs are the same, node for node, on the models the tests compile.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import os
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind, OutputSpec, TensorArgument

from gac_torch.errors import GacError
from gac_torch.frontends.fx import strict_internal
from gac_torch.frontends.torch_state import lazy_graph_module, lazy_graph_modules, retrace_without_export_guards

log = logging.getLogger("gac_torch")
aten = torch.ops.aten


_REWRITTEN = (aten.lift_fresh_copy.default, aten.detach_.default)  # as functionalization does


class _Unsupported(GacError):
    """The program needs torch's full re-export (the reason says why); never leaves this module."""


def decompose_program(ep: ExportedProgram, table: dict) -> ExportedProgram:
    """ep with `table`'s decompositions applied: run_decompositions' graph, made node by node
    where the program allows it (module doc). Use under tracing()."""
    start = time.perf_counter()
    try:
        decomposer = _Decomposer(ep, table)
        done = decomposer.program()
        log.debug("gac: decomposed node by node in %.2f s (%d distinct decompositions, %d nodes traced anew)",
                  time.perf_counter() - start, len(decomposer.traces), decomposer.retraced)
        return done
    except _Unsupported as e:
        why = str(e)
    except Exception as e:  # a gac bug (or another torch): torch's way still gives the graph
        if strict_internal():
            raise
        why = f"{type(e).__name__}: {e}"
        log.warning("gac: the node-by-node decomposition failed (%s); using torch's run_decompositions", why)
    with retrace_without_export_guards(), lazy_graph_modules():
        done = ep.run_decompositions(table)
    log.debug("gac: decomposed by torch's run_decompositions in %.2f s (%s)", time.perf_counter() - start, why)
    return done


def _torch_parts():
    """torch's private helpers run_decompositions itself uses (another torch: unsupported)."""
    if os.environ.get("GAC_DECOMPOSE", "") == "torch":
        raise _Unsupported("GAC_DECOMPOSE=torch")
    # checked node for node against run_decompositions on torch 2.11 and 2.13 (test_decompose,
    # benchmarks/decompose_check.py over the fuzz cases)
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 11):
        raise _Unsupported(f"verified on torch >= 2.11, not {torch.__version__}")
    try:
        from torch._export.utils import (
            _collect_all_valid_cia_ops_for_aten_namespace, _is_cia_op, _special_op_to_preserve_cia,
        )
        from torch._export.verifier import Verifier
        from torch.export._trace import _ignore_backend_decomps
        from torch.export.exported_program import _override_composite_implicit_decomp
    except ImportError as e:
        raise _Unsupported(f"torch's export internals moved ({e})") from e
    arities = {_override_composite_implicit_decomp: 1, _collect_all_valid_cia_ops_for_aten_namespace: 0,
               _ignore_backend_decomps: 0, _is_cia_op: 1}
    if any(len(inspect.signature(fn).parameters) != n for fn, n in arities.items()):
        raise _Unsupported("torch's export internals take other arguments")
    return (Verifier, _ignore_backend_decomps, _override_composite_implicit_decomp,
            _collect_all_valid_cia_ops_for_aten_namespace, _is_cia_op, _special_op_to_preserve_cia)


_SPLITS: dict[frozenset, tuple[dict, dict, frozenset]] = {}


def _split(table: dict, preservable: Callable[[], set], preserve: Callable) -> tuple[dict, dict, frozenset]:
    """run_decompositions' split of a table (_split_decomp_table_to_cia_and_python_decomp) for
    ATen ops: (the CIA ops whose kernel is overridden: the preserved ones and those with a
    decomposition of their own, the table for the rest, the preserved ops). The CIA ops that
    decompose by their own kernel are left alone: that is what the override would do."""
    key = frozenset(table.items())
    if key not in _SPLITS:
        cia = preservable()  # (torch caches it)
        overrides = {op: fn for op, fn in table.items() if op in cia and not _cia_kernel(fn)}
        preserved = frozenset(op for op in cia if op not in table)
        overrides.update({op: preserve for op in preserved})
        _SPLITS[key] = (overrides, {op: fn for op, fn in table.items() if op not in cia}, preserved)
    return _SPLITS[key]


def _cia_kernel(fn: Callable) -> bool:
    """Whether a table entry is torch's stand-in for an op's own CIA kernel (_get_decomp_for_cia)."""
    return getattr(getattr(fn, "func", None), "__name__", "") == "_special_op_to_decompose_cia"


def _is_default(arg: Any, value: Any) -> bool:
    value = _plain(value)
    return arg.has_default_value() and type(value) is type(arg.default_value) and value == arg.default_value


def _plain(value: Any) -> Any:
    """A value as torch's dispatcher hands it to Python: sequences as lists."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Size):
        return list(value)
    return value


def dispatcher_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) as a trace records them (torch's parseIValuesToPyArgsKwargs): positional
    arguments up to the last one that is not its default, keyword-only ones that are not."""
    schema = op._schema
    values, given = [], []
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(args):
            values.append(args[i])
        elif a.name in kwargs:
            values.append(kwargs[a.name])
        elif a.has_default_value():
            values.append(a.default_value)
        else:
            raise _Unsupported(f"{op}: argument {a.name} missing")
        given.append(not a.kwarg_only and i < len(args) or a.name in kwargs)
    if len(args) > sum(not a.kwarg_only for a in schema.arguments):
        raise _Unsupported(f"{op}: too many arguments")
    positional = [i for i, a in enumerate(schema.arguments) if not a.kwarg_only]
    end = len(positional)
    while end and _is_default(schema.arguments[positional[end - 1]], values[positional[end - 1]]):
        end -= 1
    new_args = tuple(_plain(values[i]) for i in positional[:end])
    new_kwargs = {a.name: _plain(values[i]) for i, a in enumerate(schema.arguments)
                  if a.kwarg_only and not _is_default(a, values[i])}
    return new_args, new_kwargs


def _op_name(graph: fx.Graph, op: torch._ops.OpOverload) -> str:
    """A node's name as make_fx gives it (proxy_call): `__lshift__` becomes lshift."""
    return graph._target_to_str(op.overloadpacket.__name__)


def _value(new: Any) -> Any:
    """The value (meta "val") of a new graph's node, or of a decomposition's outputs."""
    return pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), new)


def _same_meta(a: Any, b: Any) -> bool:
    """Whether two values have the same metadata (tensors: what _static_meta reads)."""
    if a is b:
        return True
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if _static_meta(x) != _static_meta(y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _static_meta(value: Any) -> tuple:
    """What a decomposition may read of a traced tensor (static sizes only)."""
    if any(not isinstance(s, int) for s in (*value.shape, *value.stride(), value.storage_offset())):
        raise _Unsupported("symbolic sizes")
    return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device)


def retrace_input_order(ep: ExportedProgram) -> list[int]:
    """The order of ep's inputs (indices of its input specs) in the program run_decompositions
    returns. It re-exports ep.module(), whose module tree fx.GraphModule builds from its get_attr
    nodes, in input order (fx/graph_module.py:_copy_attr); constants become buffers after the
    modules' own (_export/utils.py:_register_constants_as_buffers); the new program lifts
    named_parameters(), then named_buffers() (depth first, each module's own first), then takes
    the user inputs."""
    specs = ep.graph_signature.input_specs
    children: dict[str, list[str]] = {"": []}
    params: dict[str, list[int]] = {"": []}
    buffers: dict[str, list[int]] = {"": []}
    constants: dict[str, list[int]] = {"": []}

    def module(path: str) -> str:
        if path not in children:
            parent = module(path.rpartition(".")[0]) if "." in path else ""
            children[parent].append(path)
            children[path], params[path], buffers[path], constants[path] = [], [], [], []
        return path

    kinds = {InputKind.PARAMETER: params, InputKind.BUFFER: buffers, InputKind.CONSTANT_TENSOR: constants}
    if any(s.kind not in kinds and s.kind != InputKind.USER_INPUT for s in specs):
        raise _Unsupported("an input of another kind")
    targets = [s.target for s in specs if s.kind != InputKind.USER_INPUT]
    values = [id(ep.state_dict.get(t, ep.constants.get(t))) for t in targets]
    if len(set(targets)) != len(targets) or len(set(values)) != len(values):
        raise _Unsupported("one tensor under two names")
    for i, s in enumerate(specs):
        if s.kind in kinds:
            kinds[s.kind][module(s.target.rpartition(".")[0])].append(i)
    order_p: list[int] = []
    order_b: list[int] = []

    def walk(path: str) -> None:
        order_p.extend(params[path])
        order_b.extend(buffers[path] + constants[path])
        for child in children[path]:
            walk(child)

    walk("")
    return order_p + order_b + [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]


class _Decomposer:
    def __init__(self, ep: ExportedProgram, table: dict):
        (self.Verifier, self.ignore_backend_decomps, self.override_cia, preservable, self.is_cia,
         preserve) = _torch_parts()
        if ep.graph_signature.backward_signature is not None or ep.range_constraints:
            raise _Unsupported("a joint graph or symbolic sizes")
        self.ep = ep
        self.cia_overrides, self.python_table, self.preserved = _split(table, preservable, preserve)
        self.fake_mode = None
        self.traces: dict[tuple, tuple] = {}  # key -> (placeholders, nodes, outputs) of its trace
        self.retraced = 0  # nodes traced anew: their inputs' values differ from the exported ones

    def _placeholders(self) -> list[fx.Node]:
        return [n for n in self.ep.graph_module.graph.nodes if n.op == "placeholder"]

    def _needs_decomposing(self, op) -> bool:
        if op in self.python_table:
            return True
        return self.is_cia(op) and op not in self.preserved

    def program(self) -> ExportedProgram:
        old = self.ep.graph_module.graph
        placeholders = self._placeholders()
        graph = fx.Graph()
        env: dict[fx.Node, Any] = {}
        for i in retrace_input_order(self.ep):
            p = env[placeholders[i]] = graph.node_copy(placeholders[i])
            p.name = p.target = placeholders[i].name  # (fx renames e.g. `input`; the specs name it)
            self._fake_mode_of(placeholders[i])
        with self._tracing():
            decomposed = {}  # node -> (its key, its distinct tensor inputs, their values)
            for node in old.nodes:
                self._check(node)
                if node.op == "call_function" and node.target not in (operator.getitem, *_REWRITTEN) \
                        and self._needs_decomposing(node.target):
                    decomposed[node] = self._key(node, lambda n: n.meta.get("val"))
            self._trace({key: (node, inputs, values) for node, (key, inputs, values) in decomposed.items()})
            changed: set[fx.Node] = set()  # nodes whose value's metadata is not the exported one's
            for node in old.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    out = graph.output(pytree.tree_map_only(fx.Node, env.__getitem__, node.args[0]))
                    out.meta.update(node.meta)
                    continue
                if node.op == "call_function" and node.target is not operator.getitem \
                        and any(i in changed for i in node.all_input_nodes):
                    env[node] = self._retrace(graph, node, env)  # (as torch's re-trace meets it)
                elif node.target is operator.getitem:
                    source = env[node.args[0]]  # (a decomposed op's outputs: a list of nodes)
                    env[node] = source[node.args[1]] if isinstance(source, (list, tuple)) else \
                        graph.node_copy(node, env.__getitem__)
                elif node.target is aten.lift_fresh_copy.default:  # as functionalization rewrites it
                    env[node] = self._call(graph, aten.clone.default, (env[node.args[0]],), {}, node)
                elif node.target is aten.detach_.default:  # no autograd in the inference graph
                    env[node] = env[node.args[0]]
                elif node in decomposed:
                    env[node] = self._splice(graph, *decomposed[node][:2], env)
                else:
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                    env[node] = self._call(graph, node.target, *dispatcher_args(node.target, args, kwargs), node)
                if not _same_meta(_value(env[node]), node.meta.get("val")):
                    changed.add(node)
        graph.eliminate_dead_code()
        return self._program(graph)

    @contextlib.contextmanager
    def _tracing(self):
        """The dispatch state run_decompositions traces under (export/_trace.py:_export_to_aten_ir)."""
        from torch._dispatch.python import enable_python_dispatcher

        with contextlib.ExitStack() as stack:
            stack.enter_context(self.ignore_backend_decomps())  # e.g. no cudnn_batch_norm
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.override_cia(self.cia_overrides))
            stack.enter_context(enable_python_dispatcher())
            stack.enter_context(lazy_graph_modules())
            yield

    def _check(self, node: fx.Node) -> None:
        if node.op in ("get_attr", "call_module", "call_method"):
            raise _Unsupported(f"a {node.op} node")
        if node.op != "call_function" or node.target is operator.getitem:
            return
        op = node.target
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            raise _Unsupported(f"{op} is no ATen op")
        if op in (aten.lift_fresh_copy.default, aten.detach_.default):
            return
        if op._schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write
                                        for a in op._schema.arguments):
            raise _Unsupported(f"{op} mutates")

    def _fake_mode_of(self, node: fx.Node) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        v = node.meta.get("val")
        if isinstance(v, FakeTensor):
            if self.fake_mode is None:
                self.fake_mode = v.fake_mode
            _static_meta(v)

    def _call(self, graph: fx.Graph, op, args, kwargs, like: fx.Node) -> fx.Node:
        new = graph.call_function(op, args, kwargs, name=_op_name(graph, op))
        new.meta["val"] = like.meta.get("val")
        return new

    def _key(self, node: fx.Node, value: Callable[[fx.Node], Any]) -> tuple[tuple, list[fx.Node], list]:
        """The node's op and arguments with each tensor input as its metadata (and which of the
        distinct inputs it is), the distinct inputs and their values (`value` of each): two nodes
        with one key decompose alike."""
        inputs: list[fx.Node] = []

        def meta(n: fx.Node):
            v = value(n)
            if not isinstance(v, torch.Tensor):
                raise _Unsupported(f"{n.name} has no tensor value")
            if n not in inputs:
                inputs.append(n)
            return ("input", inputs.index(n), *_static_meta(v))

        structure = fx.node.map_arg((node.args, node.kwargs), meta)
        return (node.target, repr(structure)), inputs, [value(n) for n in inputs]

    def _retrace(self, graph: fx.Graph, node: fx.Node, env: dict) -> Any:
        """The node traced anew on its inputs' values in the new graph, which differ from the
        exported ones (e.g. torch 2.11's meta of linalg_vector_norm over a negative dim of size
        1 keeps the dim, gac's table rewrites the dim: each consumer's value is another shape):
        a kept op's value is recomputed, a decomposed op's expansion made for those values."""
        self.retraced += 1
        key, inputs, values = self._key(node, lambda n: _value(env[n]))
        if key not in self.traces:
            self._trace({key: (node, inputs, values)})
        return self._splice(graph, key, inputs, env)

    def _trace(self, todo: dict[tuple, tuple[fx.Node, list[fx.Node], list]]) -> None:
        """Decomposes one node per key, all in one make_fx trace (its setup costs more than most
        decompositions), each on fresh fake inputs; records per key its placeholders, its nodes
        (a contiguous run of the trace) and its outputs."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

        mode = self.fake_mode
        if not todo:
            return
        if mode is None:
            raise _Unsupported("no fake tensors in the graph")
        items = list(todo.items())
        with mode:  # the export's fake mode, as run_decompositions' (inputs: requiring no grad)
            fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                     for _, (_, _, values) in items for v in values]
        marks: list[int] = []  # the trace's node count before each decomposition, and at the end

        def run(*tensors):
            nodes, outs, at = get_proxy_mode().tracer.graph.nodes, [], 0
            for _, (node, inputs, _) in items:
                marks.append(len(nodes))
                index = {n: at + k for k, n in enumerate(inputs)}
                args, kwargs = pytree.tree_map_only(fx.Node, lambda n: tensors[index[n]], (node.args, node.kwargs))
                outs.append(node.target(*args, **kwargs))
                at += len(inputs)
            marks.append(len(nodes))
            return outs

        with mode:
            traced = make_fx(run, decomposition_table=self.python_table, tracing_mode="real")(*fakes)
        nodes = list(traced.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if marks[0] != len(placeholders) or nodes[marks[-1]].op != "output":
            raise _Unsupported("an unexpected trace")
        at = 0
        for k, (key, (node, inputs, _)) in enumerate(items):
            own = placeholders[at:at + len(inputs)]
            run_k = nodes[marks[k]:marks[k + 1]]
            known = set(own) | set(run_k)
            for n in run_k:  # (unused getitems stay till the end: names as torch's)
                if n.op != "call_function" or any(i not in known for i in n.all_input_nodes):
                    raise _Unsupported(f"{node.target} decomposes into a {n.op} node")
                self._check(n)
                if n.target in (*_REWRITTEN, aten.detach.default):
                    raise _Unsupported(f"{node.target} decomposes into {n.target}")
            self.traces[key] = (own, run_k, nodes[-1].args[0][k])
            at += len(inputs)

    def _splice(self, graph: fx.Graph, key: tuple, inputs: list[fx.Node], env: dict) -> Any:
        """A copy of key's decomposition on the node's inputs; its outputs."""
        own, run_k, outs = self.traces[key]
        mapping = dict(zip(own, (env[i] for i in inputs)))
        for n in run_k:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), mapping.__getitem__)
            name = _op_name(graph, n.target) if isinstance(n.target, torch._ops.OpOverload) else None
            new = mapping[n] = graph.create_node("call_function", n.target, args, kwargs, name=name)
            new.meta = {"val": n.meta.get("val")}
        return pytree.tree_map_only(fx.Node, mapping.__getitem__, outs)

    def _program(self, graph: fx.Graph) -> ExportedProgram:
        ep = self.ep
        sig = ep.graph_signature
        outs = next(n for n in graph.nodes if n.op == "output").args[0]
        out_specs = []
        for s, o in zip(sig.output_specs, outs):
            if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT) or not isinstance(s.arg, TensorArgument) \
                    or not isinstance(o, fx.Node):
                raise _Unsupported(f"an output of kind {s.kind}")
            out_specs.append(OutputSpec(kind=s.kind, arg=TensorArgument(name=o.name), target=s.target))
        specs = sig.input_specs
        signature = ExportGraphSignature(input_specs=[specs[i] for i in retrace_input_order(ep)],
                                         output_specs=out_specs)
        with lazy_export_graph_modules():
            return ExportedProgram(root=ep.graph_module, graph=graph, graph_signature=signature,
                                   state_dict=ep.state_dict, range_constraints=ep.range_constraints,
                                   module_call_graph=ep.module_call_graph, example_inputs=ep.example_inputs,
                                   constants=ep.constants, verifiers=[self.Verifier])


def graph_rows(gm: fx.GraphModule) -> list[tuple]:
    """The graph as rows to compare two decompositions by: per node its op, name, target,
    arguments (nodes as their index) and value metadata (shape, strides, dtype, device, grad)."""
    index: dict[fx.Node, str] = {}
    rows = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = f"%{i}"
        args = pytree.tree_map_only(fx.Node, index.__getitem__, (n.args, n.kwargs))
        v = n.meta.get("val")
        meta = (tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) \
            else type(v).__name__
        rows.append((n.op, n.name, str(n.target), repr(args), meta))
    return rows


@contextlib.contextmanager
def lazy_export_graph_modules():
    """ExportedPrograms made meanwhile get a graph module whose code is generated when first run
    or read (torch's _LazyGraphModule): gac rewrites the graph before it runs (~0.3 s of code
    generation for a BEVFormer-sized graph otherwise). Under the trace lock (a module global)."""
    from torch.export import exported_program

    make = getattr(exported_program, "_create_graph_module_for_export", None)
    if make is None:
        yield
        return
    exported_program._create_graph_module_for_export = lazy_graph_module
    try:
        yield
    finally:
        exported_program._create_graph_module_for_export = make


__all__ = ["decompose_program", "dispatcher_args", "graph_rows"]

"""torch.compile(model, backend="gac"): dynamo graph -> AOTAutograd (functional core ATen) -> gac.

Registered through the `torch_dynamo_backends` entry point, so no import is needed. AOTAutograd
gives inference graphs under no_grad and forward/backward graphs otherwise; both are compiled by
gac, so autograd stays correct (unsupported backward ops fall back to eager like any other).
"""

from __future__ import annotations

import collections
import functools
import logging
import operator
import os
import re
import threading
import warnings
import weakref

import torch

from gac_torch.backends.base import TensorSpec
from gac_torch.frontends.fx import compile_graph, compile_once_or_reason
from gac_torch.frontends.specialize import ShapeSpecializing
from gac_torch.frontends.torch_state import copy_graph_module, forget_stale_dynamo_guards, release_trace_globals
from gac_torch.legalize import decompositions
from gac_torch.legalize.fast_paths import FAST_PATH_DECOMPOSITIONS
from gac_torch.options import OptionError, precision_flags, resolve
from gac_torch.runtime import cache, progress

log = logging.getLogger("gac_torch")


class RecentGraphs:
    """The most recently compiled graphs (CompiledFx: .report, .ir(stage)), newest last, for as
    long as torch keeps them: a weak list, so that torch._dynamo.reset() frees them (each
    CompiledFx lives as long as its GraphModule, which dynamo holds)."""

    def __init__(self, maxlen: int = 64):
        self._refs: collections.deque = collections.deque(maxlen=maxlen)

    def append(self, compiled) -> None:
        compiled.gm.meta["gac_compiled"] = compiled  # a cycle the garbage collector frees
        self._refs.append(weakref.ref(compiled))

    def _live(self) -> list:
        return [c for c in (r() for r in self._refs) if c is not None]

    def clear(self) -> None:
        self._refs.clear()

    def __iter__(self):
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __getitem__(self, i):
        return self._live()[i]


compiled_graphs = RecentGraphs(64)


MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_modes_warned: set = set()


def _check_mode(mode) -> dict:
    """torch.compile's `mode` -> the options it implies: max-autotune measures tile candidates
    (options["autotune"], backends/gpu/tuning.py); reduce-overhead is what gac does anyway (CUDA
    graphs where safe), which a warning says once."""
    if mode not in MODES:
        raise OptionError(f"unknown torch.compile mode {mode!r} for backend 'gac'; torch's modes: "
                          f"{', '.join(m for m in MODES if m)}")
    if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        return {"autotune": True}
    if mode == "reduce-overhead" and mode not in _modes_warned:
        _modes_warned.add(mode)
        warnings.warn("gac: mode='reduce-overhead' changes nothing: gac replays CUDA graphs by default "
                      "where that is safe (options={'cuda_graphs': False} turns them off)", stacklevel=2)
    return {}


def _user_names(gm: torch.fx.GraphModule) -> list[str]:
    """Per dynamo graph input, the name the user knows: `x` for L['x'], `linear.weight` for a
    module's parameter (dynamo's sources), else dynamo's placeholder name."""
    names = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        source = getattr(n.meta.get("grapharg"), "source", None)
        parts = re.findall(r"\['([^']+)'\]", source.name) if source is not None else []
        parts = [p for p in parts if p not in ("self", "_modules", "_parameters", "_buffers")]
        names.append("_".join(parts) if parts else n.name)
    return names


def _name_inputs(graph: torch.fx.GraphModule, names: list[str]) -> None:
    """AOTAutograd's forward graph takes dynamo's inputs in order as primals_k / arg_k: give
    them the user's names so errors say `input 'x'` (other graphs are left alone)."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names) or not all(
            re.fullmatch(r"(primals|arg\d+)_\d+", p.name) for p in placeholders):
        return
    for p, name in zip(placeholders, names):
        if name.isidentifier():
            p._rename(name)
    graph.recompile()


def _reads_unguarded_flags(gm: torch.fx.GraphModule) -> bool:
    """Whether gac's code for this graph can depend on a precision flag that dynamo does not
    guard: cuDNN's TF32 flag, which gac reads for convolutions (a broad match on the op's name,
    to be safe). The matmul flag (and the float32 matmul precision, which sets it) is in
    dynamo's global-state guard: a call under another value recompiles."""
    return any(n.op == "call_function" and "conv" in str(n.target) for n in gm.graph.nodes)


def _forward_of(gm: torch.fx.GraphModule):
    """The partitioned graph's generated forward, compiled now: calling it directly skips
    nn.Module.__call__ and fx's lazy-recompile and error-reporting wrappers (microseconds per
    call, which a launch-bound graph pays on every call). A graph that is one compiled
    partition over all its inputs, returning its outputs in order, is that partition's call."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    whole = _whole_partition(gm)
    if whole is not None:
        if whole.tuple_output:
            call = functools.partial(whole.forward)
        else:
            def call(*args, _forward=whole.forward):
                return (_forward(*args),)
        # what dynamo holds keeps the graph alive, as gm.forward did (compiled_graphs is weak)
        call.graph_module = gm
        return call
    _LazyGraphModule.force_recompile(gm)
    return gm.forward


def _boxed_of(gm: torch.fx.GraphModule):
    """What AOTAutograd calls: it passes the arguments as one list and takes the outputs as one
    sequence. A graph that is one compiled partition is that partition's `boxed` (no frame in
    between: AOTAutograd's wrapper calls it directly); any other, its forward behind
    make_boxed_func."""
    from functorch.compile import make_boxed_func

    whole = _whole_partition(gm)
    if whole is None:
        return make_boxed_func(_forward_of(gm))
    call = functools.partial(whole.boxed)
    call._boxed_call = True
    call.graph_module = gm  # (kept alive by what dynamo holds, as above)
    call.partition = whole
    return call


def _plain_inference(example_inputs: list) -> bool:
    """Whether AOTAutograd's runtime wrapper around the inference graph it is compiling does
    nothing but call it (read from AOTAutograd's metadata while it compiles): static plain
    tensors in, one graph input each (none deduplicated), no input mutated, every output a fresh
    tensor (no alias of an input or another output), no effect tokens, no functionalized RNG,
    no autocast to turn off. Anything unknown (another torch's metadata) says no."""
    from torch._guards import TracingContext

    try:
        from torch._functorch._aot_autograd.schemas import OutputType

        meta = TracingContext.try_get().fw_metadata
        return (all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in example_inputs)
                and len(meta.input_info) == len(example_inputs)
                and not any(i.mutates_data or i.mutates_metadata or getattr(i, "mutates_storage_metadata", False)
                            for i in meta.input_info)
                and all(o.output_type == OutputType.non_alias for o in meta.output_info)
                and not meta.num_intermediate_bases and not getattr(meta, "tokens", None)
                and not torch._functorch.config.functionalize_rng_ops
                and not torch._C._is_any_autocast_enabled())
    except (AttributeError, ImportError):
        return False


def donate_mutated_inputs(gm: torch.fx.GraphModule) -> int:
    """For the graph AOTAutograd is compiling (read from its metadata while it compiles): where
    the graph returns a mutated input's new value (data only: an optimizer's `p.sub_(...)`) as an
    output of a compiled partition that is the only reader of that input, the partition writes
    it into the input's own buffer (CompiledGraph.donate, where its program proves that safe),
    and AOTAutograd's `p.copy_(new)` becomes a copy onto itself, which torch skips. Returns the
    number of inputs updated in place. GAC_IN_PLACE=0: none."""
    import os

    from torch._guards import TracingContext

    from gac_torch.runtime.compiled import CompiledGraph

    if os.environ.get("GAC_IN_PLACE", "1") == "0":
        return 0
    try:
        meta = TracingContext.try_get().fw_metadata
        mutated, infos = list(meta.mutated_inp_runtime_indices), meta.input_info
        if meta.num_intermediate_bases or getattr(meta, "tokens", None):
            return 0
    except AttributeError:  # (no tracing context, or another torch's metadata)
        return 0
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    returned = list(nodes[-1].args[0]) if isinstance(nodes[-1].args[0], (tuple, list)) else []
    if len(infos) != len(placeholders) or len(returned) < len(mutated):
        return 0
    wanted: dict = {}
    for m, j in enumerate(mutated):
        info, ph, r = infos[j], placeholders[j], returned[m]
        if (not info.mutates_data or info.mutates_metadata or getattr(info, "mutates_storage_metadata", False)
                or not isinstance(r, torch.fx.Node) or returned.count(r) != 1 or len(r.users) != 1):
            continue
        call, k = r.args if r.op == "call_function" and r.target is operator.getitem else (r, 0)
        part = getattr(gm, str(call.target), None) if isinstance(call, torch.fx.Node) else None
        if (not isinstance(part, CompiledGraph) or call.op != "call_module" or part.tuple_output != (call is not r)
                or set(ph.users) != {call} or list(call.args).count(ph) != 1):
            continue  # (the input must reach nothing but this partition, once)
        wanted.setdefault(call.target, (part, {}))[1][k] = list(call.args).index(ph)
    return sum(len(part.donate(pairs)) for part, pairs in wanted.values())


def _without_aot_wrapper(call, gm: torch.fx.GraphModule, example_inputs: list):
    """What dynamo calls for an inference graph whose AOTAutograd wrapper would only pass the
    arguments on (see _plain_inference; a graph with parameters of its own would have them
    prepended): the one compiled partition's call, behind torch._dynamo.disable (whose frames
    dynamo must not trace) as AOTAutograd's is. None: keep AOTAutograd's."""
    if call is None or any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return None
    part = call.partition
    # dynamo's guards hold each input to its compile-time dtype, shape, strides and device: where
    # those were what the partition takes (dense, on one device), only pointers need reading
    specs = part.signature.inputs
    guarded = len({t.device for t in example_inputs}) <= 1 and len(specs) == len(example_inputs) and all(
        isinstance(s, TensorSpec) and t.dtype == s.dtype and tuple(t.shape) == tuple(s.shape) and t.is_contiguous()
        for t, s in zip(example_inputs, specs))
    direct = functools.partial(part.call_guarded if guarded else part.call_args)
    direct.graph_module = call.graph_module  # (kept alive by what dynamo holds)
    return torch._dynamo.disable(direct, reason="gac: the AOT-compiled graph, called directly")


def _whole_partition(gm: torch.fx.GraphModule):
    """The CompiledGraph that the whole of gm is: placeholders -> one call of it with exactly
    those arguments -> its outputs returned in order (its getitems, or its one output)."""
    from gac_torch.runtime.compiled import CompiledGraph

    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != 1 or calls[0].kwargs or list(calls[0].args) != placeholders:
        return None
    call, output = calls[0], nodes[-1]
    cg = getattr(gm, call.target, None)
    if not isinstance(cg, CompiledGraph) or not isinstance(output.args[0], (tuple, list)):
        return None
    returned = list(output.args[0])
    if not cg.tuple_output:
        expected = [call]
    elif all(isinstance(r, torch.fx.Node) and r.target is operator.getitem for r in returned):
        expected = [r for i, r in enumerate(returned) if r.args == (call, i)]
        expected = expected if len(expected) == len(cg.signature.outputs) else []
    else:
        return None
    rest = len(nodes) - len(placeholders) - 2 - (len(returned) if cg.tuple_output else 0)
    return cg if returned == expected and rest == 0 else None


_records = threading.local()  # .saved: torch's record_runtime_overhead while a gac frame compiles


@torch._dynamo.disable
def _restore_records(_args=None) -> None:
    """Dynamo's compile-end callback. Also run at the end of a lazy backward's compile, which
    happens inside a running compiled frame: without `disable`, dynamo would compile this very
    function there, under the callbacks' lock it already holds (a training step hung)."""
    saved = getattr(_records, "saved", None)
    if saved is not None:
        _records.saved = None
        torch._dynamo.config.record_runtime_overhead = saved


def _skip_pregraph_records() -> None:
    """GAC_DYNAMO_RECORDS=0 (default): the frame dynamo is compiling for gac gets no profiler
    records around its graph call. With torch._dynamo.config.record_runtime_overhead on (torch's
    default), dynamo's pre-graph bytecode calls record_pregraph_bytecode_enter/_exit on every
    call, each behind torch._dynamo.disable (set_eval_frame twice), to mark a "Pregraph bytecode"
    range in profiler traces: 2.3-4.2 us per call on the H200's host (the noop floor with and
    without them: 22.3 vs 18.1 us in session 10, 13.1-13.6 vs 10.8-11.2 in session 11), a
    fifth to a tenth of a one-kernel call. The flag is read when dynamo generates the frame's
    code, after the backend returns, so it is turned off here and restored when the frame's
    compilation ends (dynamo's compile-end callbacks, which torch._dynamo.reset() clears: the
    callback is registered again when missing; without that API, or outside a frame's
    compilation, nothing changes). gac's own graphs still mark their ranges under a profiler
    (runtime/compiled.py). =1: torch's records kept."""
    if os.environ.get("GAC_DYNAMO_RECORDS", "0").strip() not in ("", "0"):
        return
    handler = getattr(torch._dynamo, "callback_handler", None)
    cfg = torch._dynamo.config
    if handler is None or not hasattr(handler, "end_callbacks") or not getattr(
            cfg, "record_runtime_overhead", False) or torch._guards.TracingContext.try_get() is None:
        return  # (no API to restore it; or the flag is off; or no frame of dynamo's is compiling)
    if _restore_records not in getattr(handler, "end_callbacks", ()):  # (one; reset() clears them)
        handler.register_end_callback(_restore_records)
    if getattr(_records, "saved", None) is None:
        _records.saved = cfg.record_runtime_overhead
    cfg.record_runtime_overhead = False


def gac_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None, **kw):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    options = {**_check_mode(mode), **(options or {})}
    resolve(options, **kw)  # unknown or ill-typed options fail here, before tracing
    _skip_pregraph_records()

    def compile_now(graph: torch.fx.GraphModule):
        with cache.recording():  # for torch.compiler.save_cache_artifacts()
            compiled = compile_graph(graph, resolve(options, **kw))  # torch's TF32 flags: now
        compiled_graphs.append(compiled)
        progress.add_report(compiled.report)  # gac_torch.reports() / last_report()
        return _forward_of(compiled.gm)

    user_names = _user_names(gm)

    def per_flags(pristine: torch.fx.GraphModule, first, compile_again):
        # dynamo guards torch.backends.cuda.matmul.allow_tf32 but not cuDNN's flag: a call under
        # other precision flags than the compile's gets (and keeps) its own compilation; a graph
        # without convolutions needs no such check (and skips reading the flags)
        if not _reads_unguarded_flags(pristine):
            return first
        by_flags = {precision_flags(): first}

        def call(*args):
            flags = precision_flags()
            fn = by_flags.get(flags)
            if fn is None:
                fn = by_flags[flags] = compile_again(copy_graph_module(pristine))
            return fn(*args)

        return call

    def compile_static(graph: torch.fx.GraphModule):
        pristine = copy_graph_module(graph)  # (compiling rewrites the graph in place; no deepcopy: ~1 s)
        return per_flags(pristine, compile_now(graph), compile_now)

    plain: dict = {}  # the inference graph's boxed call, where AOTAutograd's wrapper adds nothing

    def compile_inference(graph: torch.fx.GraphModule, inputs):
        fn = compile_fn(graph, inputs, donate=True)
        if getattr(fn, "partition", None) is not None and _plain_inference(example_inputs):
            plain["call"] = fn
        return fn

    def compile_fn(graph: torch.fx.GraphModule, inputs, donate: bool = False):
        _name_inputs(graph, user_names)
        # Symbolic sizes compile once (kernels take the sizes at run time) where gac can.
        pristine = copy_graph_module(graph)
        with cache.recording():  # for torch.compiler.save_cache_artifacts()
            compiled, reason = compile_once_or_reason(graph, resolve(options, **kw))
        if compiled is not None:
            compiled_graphs.append(compiled)
            progress.add_report(compiled.report)
            if donate:  # an inference graph's mutated inputs (an optimizer step) in place
                donate_mutated_inputs(compiled.gm)
            if not _reads_unguarded_flags(pristine):  # (the common case: nothing between)
                return _boxed_of(compiled.gm)
            return make_boxed_func(per_flags(pristine, _forward_of(compiled.gm), compile_now))
        log.info("gac: graph with symbolic sizes compiled per shape: %s", reason)
        return make_boxed_func(ShapeSpecializing(pristine, compile_static, reason=reason))

    forget_stale_dynamo_guards()
    try:
        compiled = aot_autograd(fw_compiler=compile_fn, bw_compiler=compile_fn, inference_compiler=compile_inference,
                                decompositions={**decompositions(), **FAST_PATH_DECOMPOSITIONS})(gm, example_inputs)
        return _without_aot_wrapper(plain.get("call"), gm, example_inputs) or compiled
    finally:
        release_trace_globals()  # AOTAutograd's make_fx left the graph gac compiled in torch's globals

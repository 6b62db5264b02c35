"""The per-call host path of a compiled graph (issue 15 point 4): what each call does in Python.

CPU (CI): CudaExecutable.call against the fake driver (test_cuda_graphs' fixture) for outputs
that are not pooled, inputs at new addresses on every call, the precision flags read per call,
NVTX ranges only with a tool attached, partitions found without nn.Module.__getattr__. With
`-m cuda`: parity of the fresh-output path over changing inputs, outputs held across calls.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from gac_torch.backends.cuda import runtime
from gac_torch.errors import GacInputError
from gac_torch.runtime.compiled import CompiledGraph
from cuda_cases import CASES
from cuda_stub import stub_cuda
from test_cuda_graphs import _Chain, _executables, _out_ptr
from test_cuda_graphs import fake as fake  # noqa: F401, PLC0414  (a fixture these tests use)


def _read(records: list, program, inputs: list) -> list[list[int]]:
    """Per program input, the pointers the recorded launches pass for it."""
    return [_out_ptr(records, program, i) for i in range(len(inputs))]


def test_fresh_outputs_launch_without_run(fake, monkeypatch) -> None:
    # outputs over POOL_BYTES are fresh each call; the call still takes the lane (no run():
    # its checks are CompiledGraph's), reads the inputs it was given and writes the output it
    # returns; outputs held by the caller are never written again
    driver, program, make, inputs = fake
    monkeypatch.setattr(runtime, "POOL_BYTES", 16)
    exe, ran = make()
    assert not exe._poolable
    n = len(program.launches)
    sets = [inputs, [t.clone() for t in inputs], [t.clone() for t in inputs]]
    held = []
    for k in range(6):
        xs = sets[k % 3]
        before = len(driver.launched)
        out = exe.call(xs)[0]
        assert len(driver.launched) == before + n  # every pointer set is new (outputs held)
        records = driver.launched[before:]
        for got, t in zip(_read(records, program, xs), xs):
            assert got and set(got) == {t.data_ptr()}
        assert set(_out_ptr(records, program, len(xs))) == {out.data_ptr()}
        held.append(out)
    assert len({t.data_ptr() for t in held}) == len(held) and not ran
    assert exe.stats["tables_built"] == 6 and exe.stats["pool_misses"] == 0
    assert not exe._contexts[1].pools  # nothing pooled


def test_inputs_at_new_addresses_are_read_every_call(fake) -> None:
    # different input tensors on every call (two alternating sets, then new ones): the direct
    # launches and the replayed graphs read the addresses of this call's inputs
    driver, program, make, inputs = fake
    exe, _ = make()
    a, b = inputs, [t.clone() for t in inputs]
    for xs in (a, b, a, b, a, b, [t.clone() for t in inputs]):
        launched, replayed = len(driver.launched), len(driver.replayed)
        out = exe.call(xs)
        if len(driver.replayed) > replayed:
            records = driver.graphs[driver.replayed[-1]]
        else:
            records = driver.launched[launched:]
        for got, t in zip(_read(records, program, xs), xs):
            assert got and set(got) == {t.data_ptr()}
        del out
    assert exe.stats["graphs_built"] == 2 and exe.stats["graph_calls"] >= 2


def test_lane_is_built_once_per_stream(fake, monkeypatch) -> None:
    # the context, CUstream, pool and workspace are looked up on a stream's first call only;
    # another stream gets its own lane (and workspace, and pool)
    driver, program, make, inputs = fake
    exe, _ = make()
    lanes = []
    real = runtime._Lane
    monkeypatch.setattr(runtime, "_Lane", lambda *a: lanes.append(a[2]) or real(*a))
    for _ in range(5):
        exe.call(inputs)
    monkeypatch.setattr(runtime, "_raw_stream", lambda index: 9)
    for _ in range(3):
        exe.call(inputs)
    assert lanes == [7, 9]
    state = exe._contexts[1]
    assert set(state.pools) == {7, 9}
    assert set(state.workspaces) == ({7, 9} if program.plan.workspace_size else set())


def test_threads_get_their_own_lanes_and_never_share_an_output(fake, monkeypatch) -> None:
    # calls from two threads on one stream: a lane per thread (the context made current there),
    # one pool between them, and no output set handed to both while either holds it
    import threading

    driver, program, make, inputs = fake
    exe, _ = make()
    lanes = []
    real = runtime._Lane
    monkeypatch.setattr(runtime, "_Lane", lambda *a: lanes.append(threading.get_ident()) or real(*a))
    held: dict[int, list] = {0: [], 1: []}
    start = threading.Barrier(2)

    def work(k: int) -> None:
        start.wait()
        for _ in range(3):
            held[k].append(exe.call(inputs)[0])

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ptrs = [t.data_ptr() for k in (0, 1) for t in held[k]]
    assert len(ptrs) == 6 and len(set(ptrs)) == 6  # every output still held: six sets
    assert len(lanes) == 2 and len(set(lanes)) == 2
    assert len(exe._contexts[1].pools) == 1 and len(exe._contexts[1].pools[7].sets) == 6


def test_churning_pointer_sets_stop_paying_for_captures(fake) -> None:
    # pointer sets that are each seen twice and never again (inputs from fresh allocations):
    # past GRAPH_FREE captures that were never replayed, a set is captured only from its
    # GRAPH_AFTER_CHURN-th call, so a stable set still gets its graph
    driver, program, make, inputs = fake
    exe, _ = make()
    cpu = torch.device("cpu")

    def ptrs(k: int) -> list[int]:
        return [0x100000 * (k + 1) + 0x100 * i for i in range(len(program.args))]

    for k in range(3 * runtime.GRAPH_FREE):
        for _ in range(runtime.GRAPH_AFTER):
            exe._launch_all(cpu, ptrs(k), handle=7)
    # (the capturing call launches its graph: one replay per capture, none after)
    assert exe.stats["graphs_built"] == runtime.GRAPH_FREE == exe.stats["graph_calls"]
    stable = ptrs(1000)
    for i in range(runtime.GRAPH_AFTER_CHURN + 2):
        exe._launch_all(cpu, stable, handle=7)
    assert exe.stats["graphs_built"] == runtime.GRAPH_FREE + 1
    assert exe.stats["graph_calls"] == runtime.GRAPH_FREE + 3


def test_prebuilt_launches_follow_the_stream(fake) -> None:
    # a one-kernel program's launch arguments are built once per pointer set and stream: one
    # pointer set launched on two streams in turn goes to the stream of each call
    import dataclasses

    driver, program, make, inputs = fake
    # (no workspace: the streams' pointer sets are the same, so is their argument table)
    one = dataclasses.replace(program, launches=program.launches[:1],
                              plan=dataclasses.replace(program.plan, workspace_size=0))
    exe = runtime.CudaExecutable(one, CASES["mlp_softmax_graph"].signature())
    exe._devices[-1] = torch.device("cpu")
    ptrs = [0x10000 * (i + 1) for i in range(len(program.args))]
    for handle in (7, 9, 9, 7):
        exe._launch_all(torch.device("cpu"), ptrs, handle=handle)
    assert [r[3] for r in driver.launched] == [7, 9, 9, 7]
    assert exe.stats["tables_built"] == 1 and exe.stats["direct_calls"] == 4


def test_precision_flags_match_torchs_properties() -> None:
    from gac_torch.options import precision_flags, torch_allows_tf32, torch_allows_tf32_conv

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    cudnn = torch.backends.cudnn
    seen = set()
    try:
        for allow in (False, True):
            for precision in ("highest", "high", "medium"):
                for conv in (False, True):
                    torch.backends.cuda.matmul.allow_tf32 = allow
                    torch.set_float32_matmul_precision(precision)
                    # (cudnn's flags through its context manager: torch's test utilities, which
                    # other tests in this process may import, freeze plain assignment)
                    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                                     deterministic=cudnn.deterministic, allow_tf32=conv):
                        flags = precision_flags()
                        assert flags == (torch_allows_tf32(), torch_allows_tf32_conv())
                    seen.add(flags)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])
    assert len(seen) == 4


class _Exe:
    def __init__(self):
        self.calls = 0

    def call(self, inputs):
        self.calls += 1
        return [inputs[0] * 2]

    def run(self, inputs, outputs):
        outputs[0].copy_(inputs[0] * 2)


def _cuda_partition(monkeypatch):
    from gac_torch.backends.base import Signature, TensorSpec

    sig = Signature((TensorSpec((4,), torch.float32),), (TensorSpec((4,), torch.float32),))
    cg = CompiledGraph("p", _Exe(), sig, "cuda", {}, ["x"], tuple_output=False)
    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    return cg, pushed


def test_nvtx_ranges_only_with_a_tool_attached(monkeypatch) -> None:
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    cg, pushed = _cuda_partition(monkeypatch)
    x = torch.randn(4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(cg(x), x * 2)
    assert not pushed and cg.executable.calls == 1
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    cg, pushed = _cuda_partition(monkeypatch)
    torch.testing.assert_close(cg(x), x * 2)
    assert pushed == ["gac:p", "pop"]
    # under torch.profiler: a record_function range named after the partition
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    cg, pushed = _cuda_partition(monkeypatch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cg(x)
    assert "gac:p" in {e.name for e in prof.events()} and not pushed


def test_partitions_are_found_without_module_getattr(monkeypatch) -> None:
    # the partitioned graph's code looks up each compiled partition per call: an instance
    # attribute, not nn.Module.__getattr__'s walk through _modules (rand_like runs eagerly
    # between partitions, so the graph's own code runs)
    import gc

    from gac_torch.frontends.dynamo import compiled_graphs

    def f(x, y):
        return torch.tanh(x * y) + torch.rand_like(x) * y

    torch._dynamo.reset()
    fn = torch.compile(f, backend="gac", options={"target": "cpu"})
    x, y = (torch.randn(8, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with torch.no_grad():
        fn(x, y)
        gc.collect()  # (the compiled graph lives as long as dynamo holds its call)
        c = compiled_graphs[-1]
        assert c.partitions and any(n.op == "call_function" for n in c.gm.graph.nodes)
        for name, cg in c.partitions.items():
            assert c.gm.__dict__[name] is cg and c.gm._modules[name] is cg
        looked_up = []
        real = torch.nn.Module.__getattr__
        monkeypatch.setattr(torch.nn.Module, "__getattr__",
                            lambda self, n: looked_up.append(n) or real(self, n))
        torch.manual_seed(7)
        got = fn(x, y)
        torch.manual_seed(7)
        torch.testing.assert_close(got, f(x, y))
    assert not set(c.partitions) & set(looked_up)


def _graph_over(cg, args_of, returns_of):
    """A GraphModule calling partition `cg` as `p`: args_of(placeholders) -> its arguments,
    returns_of(call, placeholders, graph) -> what the graph returns."""
    g = torch.fx.Graph()
    xs = [g.placeholder("x"), g.placeholder("y")]
    call = g.call_module("p", tuple(args_of(xs)))
    g.output(returns_of(call, xs, g))
    root = torch.nn.Module()
    root.p = cg
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("tuple_output", [False, True])
def test_a_graph_that_is_one_partition_is_called_directly(tuple_output) -> None:
    # AOTAutograd calls the partition itself (no fx forward frame) only where the graph is
    # exactly that partition over its inputs, returning its outputs in order
    import operator

    from gac_torch.backends.base import Signature, TensorSpec
    from gac_torch.frontends.dynamo import _forward_of, _whole_partition
    from gac_torch.runtime.compiled import CompiledGraph

    spec = TensorSpec((4,), torch.float32)
    outs = (spec, spec) if tuple_output else (spec,)

    class Exe:
        def run(self, inputs, outputs):
            for k, o in enumerate(outputs):
                o.copy_(inputs[0] * (k + 2) - inputs[1])

    cg = CompiledGraph("p", Exe(), Signature((spec, spec), outs), "cpu", {}, ["x", "y"], tuple_output)

    def results(call, xs, g):
        if not tuple_output:
            return (call,)
        return tuple(g.call_function(operator.getitem, (call, i)) for i in range(2))

    x, y = (torch.randn(4, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    whole = _graph_over(cg, lambda xs: xs, results)
    assert _whole_partition(whole) is cg
    call = _forward_of(whole)
    assert call.graph_module is whole  # (the report lives as long as dynamo holds the call)
    got = call(x, y)
    assert isinstance(got, tuple) and len(got) == len(outs)
    for k, t in enumerate(got):
        torch.testing.assert_close(t, x * (k + 2) - y)
    # anything else keeps the graph's own code: arguments in another order, an input returned,
    # outputs reordered, another node
    swapped = _graph_over(cg, lambda xs: xs[::-1], results)
    plus_input = _graph_over(cg, lambda xs: xs, lambda call, xs, g: (*results(call, xs, g), xs[0]))
    extra = _graph_over(cg, lambda xs: xs, lambda call, xs, g: tuple(
        g.call_function(torch.neg, (r,)) for r in results(call, xs, g)))
    others = [swapped, plus_input, extra]
    if tuple_output:
        others.append(_graph_over(cg, lambda xs: xs, lambda call, xs, g: results(call, xs, g)[::-1]))
    for gm in others:
        assert _whole_partition(gm) is None
        assert _forward_of(gm).__func__ is type(gm).forward
    torch.testing.assert_close(_forward_of(swapped)(x, y)[0], y * 2 - x)


def test_fast_path_launches_well_formed_inputs_and_declines_the_rest(fake, monkeypatch) -> None:
    # CompiledGraph hands every call to CudaExecutable.call, which launches well-formed inputs
    # without another check (a strided one made dense first) and declines the rest; a declined
    # call goes through check_inputs, which names what is wrong
    driver, program, make, inputs = fake
    exe, ran = make()
    case = CASES["mlp_softmax_graph"]
    cg = CompiledGraph("p", exe, case.signature(), "cuda", {}, ["x", "w1", "b1", "w2"], tuple_output=False)
    checked = []
    real = CompiledGraph.check_inputs
    monkeypatch.setattr(CompiledGraph, "check_inputs", lambda self, args: checked.append(1) or real(self, args))
    out = cg(*inputs)
    assert out.shape == case.outputs[0][0] and not checked and not ran
    assert exe.stats["direct_calls"] == 1
    strided = inputs[1].t().contiguous().t()  # (the values and shape of w1, column-major)
    assert not strided.is_contiguous()
    before = len(driver.launched)
    cg(inputs[0], strided, *inputs[2:])
    read = _out_ptr(driver.launched[before:], program, 1)  # the launches read a dense copy
    assert read and strided.data_ptr() not in read and inputs[1].data_ptr() not in read
    assert not checked and not ran and exe.stats["direct_calls"] == 2
    x = inputs[0]
    for bad, what in ((x.double(), "dtype torch.float32, got torch.float64"),
                      (torch.randn(x.shape[0], x.shape[1] + 1), "shape"), (3, "expected a tensor, got int")):
        with pytest.raises(GacInputError, match=what):
            cg(bad, *inputs[1:])
    monkeypatch.setattr(runtime, "_current_device", lambda: 0)  # the inputs are on another device
    with pytest.raises(GacInputError, match="compiled for cuda tensors, got one on cpu"):
        cg(*inputs)
    assert len(checked) == 4 and not ran and exe.stats["direct_calls"] == 2


def _called_by_dynamo(fn_globals: dict, before: set):
    """What dynamo's code calls for the graph compiled since `before` (its globals then), under
    torch._dynamo.disable's wrappers."""
    (name,) = [k for k in set(fn_globals) - before if k.startswith("__compiled_fn")]
    call = fn_globals[name]
    while hasattr(call, "_torchdynamo_orig_callable"):
        call = call._torchdynamo_orig_callable
    return call


def test_torch_compile_reads_only_the_pointers_of_guarded_inputs(monkeypatch) -> None:
    # an inference graph that is one compiled partition over dense inputs: dynamo's code calls
    # CompiledGraph.call_guarded (no AOTAutograd wrapper, no forward, no check_inputs, no run),
    # which passes the inputs to CudaExecutable.call_guarded (pointers only), once per call; an
    # input dynamo's guards pass at a misaligned address is declined there; an input that was
    # strided when compiled is called through the checked path (made dense every call)
    from gac_torch.frontends.dynamo import compiled_graphs

    gen = torch.Generator().manual_seed(11)
    x, y = (torch.randn(16, 16, generator=gen) for _ in range(2))
    with stub_cuda(), torch.no_grad():
        torch._dynamo.reset()
        before = set(globals())
        fn = torch.compile(lambda p, q: torch.tanh(p * q + 1.0), backend="gac", options={"target": "cuda"})
        fn(x, y)
        assert _called_by_dynamo(globals(), before).func.__name__ == "call_guarded"
        (cg,) = compiled_graphs[-1].partitions.values()
        seen = []
        for attr in ("_guarded", "_call"):
            real = getattr(cg, attr)
            setattr(cg, attr, lambda args, real=real, attr=attr: seen.append((attr, [a.data_ptr() for a in args]))
                    or real(args))
        for name in ("forward", "check_inputs", "_forward"):
            monkeypatch.setattr(CompiledGraph, name, lambda self, *a, name=name: seen.append(name))
        outs = [fn(x, y) for _ in range(3)]
        raw = torch.empty(x.numel() + 1)
        shifted = raw[1:].view(x.shape)  # (the sizes and strides dynamo guards; 4 bytes off)
        assert cg.executable.call_guarded([shifted, y]) is None
        torch._dynamo.reset()
        before = set(globals())
        strided = torch.compile(lambda p, q: torch.tanh(p * q), backend="gac", options={"target": "cuda"})
        strided(x.t(), y)
        assert _called_by_dynamo(globals(), before).func.__name__ == "call_args"
    assert seen == [("_guarded", [x.data_ptr(), y.data_ptr()])] * 3
    assert len({o.data_ptr() for o in outs}) == 3  # each held: its own pooled set
    # (the first call's set, dropped, serves the second: three pointer sets in all; one kernel:
    # launched through the lane's block, no table per pointer set, launch_block.py)
    assert cg.executable.stats["direct_calls"] == 4 and cg.executable.stats["tables_built"] == 0


def test_matmul_tf32_flag_is_guarded_by_dynamo() -> None:
    # what lets a matmul graph skip reading the TF32 flags per call (dynamo.py's per_flags keeps
    # that for convolutions): a call under another matmul precision recompiles, and a call under
    # the first flags again finds the first compilation
    from gac_torch.frontends.dynamo import compiled_graphs

    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    gen = torch.Generator().manual_seed(12)
    x, y = (torch.randn(8, 8, generator=gen) for _ in range(2))
    try:
        torch.set_float32_matmul_precision("highest")
        torch._dynamo.reset()
        fn = torch.compile(lambda p, q: torch.relu(p @ q), backend="gac", options={"target": "cpu"})
        with torch.no_grad():
            fn(x, y)
            once = len(compiled_graphs)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.testing.assert_close(fn(x, y), torch.relu(x @ y))
            assert len(compiled_graphs) == once + 1
            torch.set_float32_matmul_precision("highest")
            fn(x, y)
            torch.set_float32_matmul_precision("high")  # (the same flag as allow_tf32 = True)
            fn(x, y)
            assert len(compiled_graphs) == once + 1
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


@pytest.mark.parametrize("case", ["plain", "two_outputs", "mutates_input", "returns_a_view", "training"])
def test_aot_wrapper_is_skipped_only_where_it_adds_nothing(case) -> None:
    # an inference graph that is one partition, with no input mutated and only fresh outputs, is
    # called by dynamo without AOTAutograd's runtime wrapper; a mutated input (copied back by
    # that wrapper), an output that is a view of an input (regenerated by it) and a training
    # graph keep it, and every case matches eager
    def plain(x, y):
        return torch.tanh(x * y)

    def mutates_input(x, y):
        x.mul_(2.0)
        return torch.tanh(x * y)

    def returns_a_view(x, y):
        return x.t(), torch.tanh(x * y)

    def two_outputs(x, y):
        return torch.tanh(x * y), (x + y).sum(0)

    f = {"plain": plain, "two_outputs": two_outputs, "mutates_input": mutates_input,
         "returns_a_view": returns_a_view, "training": plain}[case]
    gen = torch.Generator().manual_seed(13)
    x, y = (torch.randn(6, 6, generator=gen) for _ in range(2))
    if case == "training":
        y.requires_grad_(True)
    torch._dynamo.reset()
    before = set(globals())
    fn = torch.compile(f, backend="gac", options={"target": "cpu"})
    with torch.no_grad() if case != "training" else contextlib.nullcontext():
        xc, xe = x.clone(), x.clone()
        got, want = fn(xc, y), f(xe, y)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(xc, xe)  # (the mutated input too)
        if case == "returns_a_view":
            assert got[0].data_ptr() == xc.data_ptr() and got[0]._base is xc
    if case == "training":
        got.sum().backward()
        g = y.grad.clone()
        y.grad = None
        want.sum().backward()
        torch.testing.assert_close(g, y.grad)
    direct = isinstance(_called_by_dynamo(globals(), before), functools.partial)
    assert direct == (case in ("plain", "two_outputs")), case


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.parametrize("records", ["0", "1"])
def test_gac_frames_skip_dynamos_pregraph_records(monkeypatch, records) -> None:
    # GAC_DYNAMO_RECORDS=0 (default): a frame compiled for gac calls no pre-graph profiler
    # records per call (frontends/dynamo.py); torch's flag is back on once the frame is compiled,
    # so another backend's frame compiled next still gets them; =1 keeps them for gac too
    import torch._dynamo.utils as dutils

    if not hasattr(torch._dynamo.config, "record_runtime_overhead"):
        pytest.skip("this torch has no pre-graph records")
    monkeypatch.setenv("GAC_DYNAMO_RECORDS", records)
    monkeypatch.setattr(torch._dynamo.config, "record_runtime_overhead", True)
    entered = []
    real = dutils.record_pregraph_bytecode_enter
    monkeypatch.setattr(dutils, "record_pregraph_bytecode_enter", lambda: entered.append(1) or real())
    torch._dynamo.reset()
    x = torch.randn(8, 8)
    gac = torch.compile(lambda a: torch.tanh(a) * 2, backend="gac")
    for _ in range(3):
        gac(x)
    assert torch._dynamo.config.record_runtime_overhead is True
    assert len(entered) == (3 if records == "1" else 0)
    eager = torch.compile(lambda a: torch.sin(a) + 1, backend="eager")
    for _ in range(2):
        eager(x)
    assert len(entered) == (5 if records == "1" else 2)  # (torch's default, for the other backend)
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_fresh_outputs_over_changing_inputs(monkeypatch, graphs) -> None:
    # outputs too large for the pool (here: any): fresh each call, launched through the lane;
    # changing inputs (new tensors, new contents at old addresses) match eager, and outputs
    # the caller holds keep their values
    monkeypatch.setattr(runtime, "POOL_BYTES", 16)
    torch._dynamo.reset()
    model = _Chain(6)
    fn = torch.compile(model, backend="gac", options={"target": "cuda", "cuda_graphs": graphs})
    from gac_torch.frontends.dynamo import compiled_graphs

    gen = torch.Generator(device="cuda").manual_seed(21)
    sets = [[torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)] for _ in range(2)]
    held = []
    with torch.no_grad():
        for trial in range(10):
            xs = sets[trial % 2] if trial % 3 else [torch.randn(64, 64, generator=gen, device="cuda")
                                                    for _ in range(3)]
            if trial % 4 == 1:
                xs[0].copy_(torch.randn(64, 64, generator=gen, device="cuda"))
            ref = model(*(t.double() for t in xs))
            got = fn(*xs)
            held.append((got, ref))
        torch.cuda.synchronize()
        for got, ref in held:
            for g, r in zip(got, ref):
                torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)
    exe = _executables(compiled_graphs)[-1]
    assert not exe._poolable and exe.stats["pool_misses"] == 0, exe.stats
    assert exe.stats["direct_calls"] + exe.stats["graph_calls"] == 10, exe.stats
    if not graphs:
        assert exe.stats["graph_calls"] == 0 and exe.stats["graphs_built"] == 0, exe.stats


def test_a_replaced_executable_is_the_one_called(monkeypatch):
    # the fast path caches the executable's `call`; assigning another executable must replace it
    # (the H200 cubin-fallback test swapped executables and the old one kept running)
    cg, _ = _cuda_partition(monkeypatch)
    old, new = cg.executable, _Exe()
    x = torch.randn(4)
    cg(x)
    cg.executable = new
    torch.testing.assert_close(cg(x), x * 2)
    assert (old.calls, new.calls) == (1, 1)


@pytest.mark.cuda
def test_gpu_one_kernel_gemm_takes_the_fast_path() -> None:
    # gemm_fp32_2048_tf32on's graph, small: every call goes through CudaExecutable.call_guarded
    # (no AOTAutograd wrapper) or .call (no check_inputs, no run) into pooled outputs; rotated inputs and
    # held outputs match float64 at TF32's tolerance; a transposed operand (dynamo recompiles
    # for its strides) still does; CPU inputs handed to the partition itself are named
    from gac_torch.frontends.dynamo import compiled_graphs

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b: a @ b, backend="gac", options={"target": "cuda"})
        gen = torch.Generator(device="cuda").manual_seed(31)
        sets = [[torch.randn(192, 160, generator=gen, device="cuda"),
                 torch.randn(160, 136, generator=gen, device="cuda")] for _ in range(3)]
        held = []
        with torch.no_grad():
            fn(*sets[0])
            (cg,) = compiled_graphs[-1].partitions.values()
            exe = cg.executable
            taken = []
            for attr in ("_guarded", "_call"):  # (guarded: where AOTAutograd's wrapper is skipped)
                def spy(args, real=getattr(cg, attr), attr=attr):
                    outs = real(args)
                    taken.append(attr if outs is not None else None)
                    return outs

                setattr(cg, attr, spy)
            for k in range(6):  # (fewer than the pool's sets: none is missed)
                a, b = sets[k % 3]
                held.append((fn(a, b), a.double() @ b.double()))
            assert len(taken) == 6 and len(set(taken)) == 1 and None not in taken, taken
            print(f"fast path: {taken[0]}")  # (torch 2.13: _guarded; without AOT metadata: _call)
            assert exe.stats["direct_calls"] == 7 and exe.stats["pool_misses"] == 0, exe.stats
            a, b = sets[0]
            bt = b.t().contiguous().t()  # (b's values, column-major)
            held.append((fn(a, bt), a.double() @ b.double()))
            torch.cuda.synchronize()
            for got, ref in held:
                rel = ((got.double() - ref).norm() / ref.norm()).item()
                assert rel < 3e-3, rel
            with pytest.raises(GacInputError, match="compiled for cuda tensors, got one on cpu"):
                cg(a.cpu(), b.cpu())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved

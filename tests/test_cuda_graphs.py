"""CUDA graphs by default and the per-call host path (issue 15 point 4).

CPU (CI): the output pool's bookkeeping, and CudaExecutable.call against a fake driver on CPU
tensors: which launches and graph replays a call issues, into which buffers, when a set is
reused, the option and GAC_CUDA_GRAPHS=0, the fallbacks. With `-m cuda`: graph replay against
direct launches over changing inputs through torch.compile, outputs a later call must not
overwrite, dynamic shapes, and memory that does not grow.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import struct

import pytest
import torch

from gac_torch.backends.cuda import runtime
from gac_torch.backends.cuda.pool import OutputPool
from gac_torch.backends.cuda.target import TARGET
from gac_torch.options import resolve
from cuda_cases import CASES, compile_case
from test_cuda_runtime import _FakeDriver, use_fake_driver


# ------------------------------------------------------------------------------------------------
# the output pool (CPU tensors: the bookkeeping does not depend on the device)


def test_pool_reuses_a_set_only_when_every_alias_is_gone() -> None:
    pool = OutputPool([((4, 3), torch.float32), ((5,), torch.int64)], torch.device("cpu"), max_sets=3)
    s0, a0 = pool.acquire()
    assert [tuple(t.shape) for t in a0] == [(4, 3), (5,)] and [t.data_ptr() for t in a0] == s0.ptrs
    s1, a1 = pool.acquire()  # set 0 is held by a0
    assert s1 is not s0 and not set(s1.ptrs) & set(s0.ptrs)
    view = a0[0][1:]  # a view keeps the set held, the alias itself does not need to
    del a0
    s2, a2 = pool.acquire()
    assert s2 not in (s0, s1)
    assert pool.acquire() is None  # all three held: the caller gets fresh buffers instead
    del view
    again, a0 = pool.acquire()
    assert again is s0 and len(pool.sets) == 3
    # many calls that drop their outputs: one set, memory does not grow
    del a0, a1, a2
    for _ in range(50):
        s, outs = pool.acquire()
        assert s is s0
        del outs
    assert len(pool.sets) == 3 and pool.nbytes == 3 * (4 * 3 * 4 + 5 * 8)


def test_pool_never_reuses_a_set_whose_storage_the_caller_moved() -> None:
    pool = OutputPool([((4,), torch.float32)], torch.device("cpu"), max_sets=2)
    s0, (a,) = pool.acquire()
    a.resize_(1 << 16)  # reallocates the shared storage: a graph would write to the old address
    del a
    gc.collect()
    s1, _ = pool.acquire()
    assert s1 is not s0 and not s0.free()


# ------------------------------------------------------------------------------------------------
# CudaExecutable.call against a fake driver, on CPU tensors


class _GraphDriver(_FakeDriver):
    """The fake driver, with one handle per instantiated graph and the launches each replays."""

    def __init__(self, program):
        super().__init__(program)
        self.graphs: dict[str, list] = {}  # exec handle -> the launches captured into it
        self.replayed: list[str] = []

    def cuStreamEndCapture(self, stream):  # noqa: N802
        self.capturing = None
        return (0, [x for x in self.launched if x[5] == "side"][-len(self.program.launches):])

    def cuGraphInstantiate(self, graph, flags):  # noqa: N802
        name = f"exec{len(self.graphs)}"
        self.graphs[name] = graph
        return (0, name)

    def cuGraphLaunch(self, exe, stream):  # noqa: N802
        self.replayed.append(exe)
        return super().cuGraphLaunch(exe, stream)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    case = CASES["mlp_softmax_graph"]  # 4 inputs, one output, several kernels and temps
    program = compile_case(case, "sm_90")
    driver = _GraphDriver(program)
    use_fake_driver(monkeypatch, driver)
    monkeypatch.delenv("GAC_CUDA_GRAPHS", raising=False)

    def make(**kw):
        exe = runtime.CudaExecutable(program, case.signature(), **kw)
        exe._devices[-1] = torch.device("cpu")
        ran = []
        exe.run = lambda inputs, outputs: ran.append([o.data_ptr() for o in outputs])  # direct path
        return exe, ran

    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(s, generator=gen, dtype=d) for s, d in case.inputs]
    return driver, program, make, inputs


def _out_ptr(records: list, program, arg: int) -> list[int]:
    """The pointers that the recorded launches (the fake driver's, in program order) pass for
    argument `arg` of the program."""
    n, ptrs = len(program.launches), []
    for i, (kernel, _grid, _block, _stream, params, _capturing) in enumerate(records):
        k = program.launches[i % n]
        assert kernel == k.kernel
        ptrs += [struct.unpack("<Q", raw)[0] for a, raw in zip(k.args, params)
                 if getattr(a, "kind", None) == "arg" and a.index == arg]
    return ptrs


def test_call_replays_one_graph_per_pointer_set(fake) -> None:
    driver, program, make, inputs = fake
    exe, ran = make()
    assert exe.use_graphs and exe._poolable
    n, out_arg = len(program.launches), len(inputs)
    outs = exe.call(inputs)  # a new pointer set: launched kernel by kernel
    first_ptr = outs[0].data_ptr()
    assert len(driver.launched) == n and not driver.replayed
    del outs
    for _ in range(4):  # same inputs, the caller dropped its output: same set, one graph
        outs = exe.call(inputs)
        assert outs[0].data_ptr() == first_ptr
        del outs
    assert exe.stats == {"direct_calls": 1, "graph_calls": 4, "tables_built": 1, "graphs_built": 1,
                         "pool_misses": 0}
    assert driver.replayed == ["exec0"] * 4 and len(driver.launched) == 2 * n  # + the capture
    assert set(_out_ptr(driver.graphs["exec0"], program, out_arg)) == {first_ptr}
    assert not ran  # nothing went through the fresh-buffer path


def test_call_never_overwrites_an_output_the_caller_holds(fake, monkeypatch) -> None:
    driver, program, make, inputs = fake
    monkeypatch.setattr(runtime, "POOL_SETS", 3)
    exe, ran = make()
    held = [exe.call(inputs)[0] for _ in range(3)]  # each call: another set
    assert len({t.data_ptr() for t in held}) == 3
    n = len(program.launches)
    before = len(driver.launched)
    fourth = exe.call(inputs)[0]  # every set held: fresh buffers, launched directly
    assert exe.stats["pool_misses"] == 1 and not ran
    assert len(driver.launched) == before + n  # a new pointer set: kernel by kernel
    assert set(_out_ptr(driver.launched[before:], program, len(inputs))) == {fourth.data_ptr()}
    assert fourth.data_ptr() not in {t.data_ptr() for t in held}
    keep = held[1]
    del held, fourth
    driver.launched.clear()
    driver.replayed.clear()
    for _ in range(3):  # sets 0 and 2 are free again; set 1 is still held
        out = exe.call(inputs)[0]
        assert out.data_ptr() != keep.data_ptr()
        del out
    # no launch and no replayed graph of these calls writes into the held buffer
    written = _out_ptr(driver.launched, program, len(inputs))
    written += [p for g in driver.replayed for p in _out_ptr(driver.graphs[g], program, len(inputs))]
    assert written and keep.data_ptr() not in written
    assert len(exe._contexts[1].pools[7].sets) == 3


def test_new_input_addresses_get_their_own_graph(fake) -> None:
    driver, program, make, inputs = fake
    exe, _ = make()
    other = [t.clone() for t in inputs]
    for _ in range(3):
        exe.call(inputs)
        exe.call(other)
    assert exe.stats["tables_built"] == 2 and exe.stats["graphs_built"] == 2
    assert exe.stats["graph_calls"] == 4 and exe.stats["direct_calls"] == 2


@pytest.mark.parametrize("block", ["1", "0"])
def test_one_kernel_launches_directly_into_the_pool(fake, monkeypatch, block) -> None:
    # a graph of one kernel saves nothing: launched directly, into pooled outputs; through the
    # lane's one argument array (GAC_LAUNCH_BLOCK, default), or the argument table built for the
    # first call serves every later one (=0); either way each launch passes this call's pointers
    driver, program, make, inputs = fake
    monkeypatch.setenv("GAC_LAUNCH_BLOCK", block)
    one = dataclasses.replace(program, launches=program.launches[:1])
    exe = runtime.CudaExecutable(one, CASES["mlp_softmax_graph"].signature())
    exe._devices[-1] = torch.device("cpu")
    for _ in range(5):
        ptrs = [t.data_ptr() for t in inputs + exe.call(inputs)]  # (outputs dropped: one pooled set)
        for i, p in enumerate(ptrs):
            assert set(_out_ptr(driver.launched[-1:], one, i)) <= {p}
    assert exe.stats == {"direct_calls": 5, "graph_calls": 0, "tables_built": int(block == "0"), "graphs_built": 0,
                         "pool_misses": 0}


def test_inside_the_callers_own_graph_capture_nothing_is_pooled_or_captured(fake, monkeypatch) -> None:
    # torch.cuda.graph() around a gac call: its launches go into the caller's graph, writing
    # buffers the caller's graph owns; gac's own capture would fail there
    driver, program, make, inputs = fake
    exe, ran = make()
    monkeypatch.setattr(runtime, "_capturing", lambda: True)
    assert exe.call(inputs) is None and not exe._contexts  # declined: CompiledGraph runs it
    out = _partition(exe, CASES["mlp_softmax_graph"])(*inputs)
    assert ran == [[out.data_ptr()]] and not exe._contexts  # through run, into fresh outputs
    exe = runtime.CudaExecutable(program, CASES["mlp_softmax_graph"].signature())
    ptrs = [0x10000 * (i + 1) for i in range(len(program.args))]
    for _ in range(runtime.GRAPH_AFTER + 1):
        exe._launch_all(torch.device("cpu"), ptrs, handle=7)
    assert exe.stats["graphs_built"] == 0 and exe.stats["direct_calls"] == runtime.GRAPH_AFTER + 1


def test_graphs_off_by_option_or_environment(fake, monkeypatch) -> None:
    driver, program, make, inputs = fake
    exe, ran = make(graphs=False)
    for _ in range(2 * runtime.GRAPH_AFTER):  # kernel by kernel every time, into fresh outputs
        outs = exe.call(inputs)
    assert not exe.use_graphs and not ran and not driver.replayed and not exe._contexts[1].pools
    assert len(driver.launched) == 2 * runtime.GRAPH_AFTER * len(program.launches)
    assert exe.stats["graph_calls"] == 0 and exe.stats["graphs_built"] == 0
    assert _out_ptr(driver.launched[-len(program.launches):], program, len(inputs))[-1] == outs[0].data_ptr()
    monkeypatch.setenv("GAC_CUDA_GRAPHS", "0")
    assert not make()[0].use_graphs and make(graphs=True)[0].use_graphs
    assert not runtime.graphs_enabled(resolve({"cuda_graphs": False}, target="cuda").cuda_graphs)
    monkeypatch.setenv("GAC_CUDA_GRAPHS", "1")
    exe = TARGET.load(program, CASES["mlp_softmax_graph"].signature(), resolve({"cuda_graphs": False}, target="cuda"))
    assert not exe.use_graphs
    assert TARGET.load(program, CASES["mlp_softmax_graph"].signature(), resolve({}, target="cuda")).use_graphs


def test_not_poolable_launches_directly(fake, monkeypatch) -> None:
    # run-time sizes (one graph would not fit every shape) and outputs over POOL_BYTES: fresh
    # outputs, launched through run(); a misaligned input too
    driver, program, make, inputs = fake
    case = CASES["mlp_softmax_graph"]
    exe = runtime.CudaExecutable(dataclasses.replace(program, dynamic=True), case.signature())
    assert not exe._poolable
    limit = runtime.POOL_BYTES
    monkeypatch.setattr(runtime, "POOL_BYTES", 16)
    exe, ran = make()
    assert not exe._poolable
    monkeypatch.setattr(runtime, "POOL_BYTES", limit)
    out_bytes = sum(math.prod(s) * d.itemsize for s, d in case.outputs)
    monkeypatch.setattr(runtime, "POOL_TOTAL", 3 * out_bytes)  # memory bounds the sets too
    assert make()[0]._pool_sets == 3
    monkeypatch.setattr(runtime, "POOL_TOTAL", out_bytes)
    assert make()[0]._pool_sets == 2  # (two at least: x = f(x) alternates between two)
    exe, ran = make()
    raw = torch.empty(inputs[0].numel() + 1)
    shifted = raw[1:].view(inputs[0].shape)
    shifted.copy_(inputs[0])
    assert exe.call([shifted, *inputs[1:]]) is None  # declined: staged by run
    _partition(exe, case)(shifted, *inputs[1:])
    assert len(ran) == 1 and not driver.launched


def _partition(exe, case):
    """A CompiledGraph over `exe` (device type cpu: CPU tensors stand in for the device's)."""
    from gac_torch.runtime.compiled import CompiledGraph

    names = [f"x{i}" for i in range(len(case.inputs))]
    return CompiledGraph("p", exe, case.signature(), "cpu", {}, names, tuple_output=False)


def test_only_convolution_graphs_read_precision_flags_per_call(monkeypatch) -> None:
    # per call, torch.compile's gac graph reads torch's TF32 flags only where they can change its
    # code and dynamo does not guard them: convolutions (test_cuda_conv checks that those still
    # recompile under cuDNN's flag)
    from gac_torch.frontends import dynamo

    reads = []
    real = dynamo.precision_flags
    monkeypatch.setattr(dynamo, "precision_flags", lambda: reads.append(1) or real())
    torch._dynamo.reset()
    x, a, b = (torch.randn(8, 8) for _ in range(3))
    fn = torch.compile(_Chain(3), backend="gac", options={"target": "cpu"})
    with torch.no_grad():
        fn(x, a, b)
        n = len(reads)
        for _ in range(3):
            fn(x, a, b)
    assert len(reads) == n
    # a matmul's TF32 flag is in dynamo's guards (test_host_path); cuDNN's is read per call
    mm = torch.compile(lambda p, q: torch.tanh(p @ q), backend="gac", options={"target": "cpu"})
    conv = torch.compile(lambda p, w: torch.tanh(torch.nn.functional.conv2d(p, w)), backend="gac",
                         options={"target": "cpu"})
    img, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    with torch.no_grad():
        mm(x, a)
        conv(img, w)
        n = len(reads)
        torch.testing.assert_close(mm(x, a), torch.tanh(x @ a))
        assert len(reads) == n
        torch.testing.assert_close(conv(img, w), torch.tanh(torch.nn.functional.conv2d(img, w)))
    assert len(reads) == n + 1


# ------------------------------------------------------------------------------------------------
# GPU


class _Chain(torch.nn.Module):
    def __init__(self, n: int = 20):
        super().__init__()
        self.n = n

    def forward(self, x, a, b):
        for _ in range(self.n):
            x = torch.tanh(x * a + b) * 0.5
        return x, x.sum(0)  # two kernels at least (a reduction after the chain)


def _compiled(model, **options):
    from gac_torch.frontends.dynamo import compiled_graphs

    fn = torch.compile(model, backend="gac", options={"target": "cuda", **options})
    return fn, compiled_graphs


def _executables(graphs) -> list:
    return [cg.executable for c in graphs for cg in c.partitions.values()]


@pytest.mark.cuda
def test_gpu_graph_replay_matches_direct_launches() -> None:
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(11)
    sets = [[torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)] for _ in range(2)]
    model = _Chain()
    with torch.no_grad():
        on, graphs = _compiled(model)
        on(*sets[0])
        exe_on = _executables(graphs)[-1]
        off, graphs = _compiled(_Chain(), cuda_graphs=False)
        off(*sets[0])
        exe_off = _executables(graphs)[-1]
        for trial in range(8):
            xs = sets[trial % 2]
            fresh = [torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)]
            for dst, src in zip(xs, fresh):
                dst.copy_(src)  # new contents at the same addresses: a replay must read them
            ref = model(*(t.double() for t in fresh))
            got_on, got_off = on(*xs), off(*xs)
            for g_on, g_off, r in zip(got_on, got_off, ref):
                torch.testing.assert_close(g_on.double(), r, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(g_on, g_off, rtol=0, atol=0)
    if len(exe_on.program.launches) >= runtime.GRAPH_MIN_LAUNCHES:
        assert exe_on.stats["graph_calls"] >= 4 and exe_on.stats["graphs_built"] == 2, exe_on.stats
    assert exe_on.stats["tables_built"] == 2, exe_on.stats  # two input sets, two output sets
    assert exe_off.stats["graph_calls"] == 0, exe_off.stats


@pytest.mark.cuda
def test_gpu_outputs_held_by_the_caller_are_not_overwritten() -> None:
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(12)
    model = _Chain()
    fn, graphs = _compiled(model)
    xs = [torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)]
    with torch.no_grad():
        held = []
        for i in range(2 * runtime.POOL_SETS):  # more calls than sets, every output held
            xs[0].copy_(torch.randn(64, 64, generator=gen, device="cuda"))
            y = fn(*xs)
            held.append((y, [t.clone() for t in y]))
        torch.cuda.synchronize()
        for y, copy in held:
            for a, b in zip(y, copy):
                assert torch.equal(a, b)
        exe = _executables(graphs)[-1]
        assert exe.stats["pool_misses"] >= runtime.POOL_SETS, exe.stats
        ptrs = [y[0].data_ptr() for y, _ in held]
        assert len(set(ptrs)) == len(ptrs)


@pytest.mark.cuda
def test_gpu_dynamic_shapes_launch_directly() -> None:
    torch._dynamo.reset()
    model = _Chain(4)
    fn = torch.compile(model, backend="gac", dynamic=True, options={"target": "cuda"})
    gen = torch.Generator(device="cuda").manual_seed(13)
    with torch.no_grad():
        for n in (17, 33, 17, 64):
            xs = [torch.randn(n, 8, generator=gen, device="cuda") for _ in range(3)]
            for g, r in zip(fn(*xs), model(*(t.double() for t in xs))):
                torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_gpu_memory_does_not_grow() -> None:
    torch._dynamo.reset()
    fn, graphs = _compiled(_Chain())
    gen = torch.Generator(device="cuda").manual_seed(14)
    sets = [[torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)] for _ in range(3)]
    with torch.no_grad():
        for i in range(10):
            fn(*sets[i % 3])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for i in range(200):
            fn(*sets[i % 3])  # outputs dropped: one output set, one graph per input set
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    exe = _executables(graphs)[-1]
    assert exe.stats["tables_built"] == 3, exe.stats
    if len(exe.program.launches) >= runtime.GRAPH_MIN_LAUNCHES:
        assert exe.stats["graphs_built"] == 3 and exe.stats["graph_calls"] >= 200, exe.stats



@pytest.mark.cuda
def test_gpu_call_inside_a_torch_cuda_graph() -> None:
    # A caller capturing its own graph around a compiled call: gac records plain launches into
    # buffers the caller's graph owns; replays read the inputs' new contents.
    torch._dynamo.reset()
    model = _Chain()
    fn, _ = _compiled(model)
    gen = torch.Generator(device="cuda").manual_seed(15)
    xs = [torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm up (compile, load the module) outside the capture
                fn(*xs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = fn(*xs)
        for _ in range(2):
            fresh = [torch.randn(64, 64, generator=gen, device="cuda") for _ in range(3)]
            for dst, src in zip(xs, fresh):
                dst.copy_(src)
            graph.replay()
            for g, r in zip(ys, model(*(t.double() for t in fresh))):
                torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)

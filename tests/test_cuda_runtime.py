"""The cuda runtime: the launch path against a fake driver (CPU, CI), TargetUnavailable without
a GPU; with `-m cuda` (an NVIDIA GPU) every case in cuda_cases.py runs against its float64
reference on fresh random inputs with poisoned outputs, plus DLPack, misaligned buffers, CUDA
graphs and streams, and a throughput report."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

import pytest
import torch

from gac_torch.backends.cuda.target import TARGET, compile_options
from gac_torch.backends.gpu.program import BufferRef, GpuProgram, KernelLaunch
from cuda_cases import CASES, TOL, Case, compile_case, elementwise, matmul, reduce_last, reduce_middle


class _FakeDriver:
    """Just enough of cuda.bindings.driver to drive CudaExecutable's launch path on a CPU."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    class CUstreamCaptureMode:
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1

    def __init__(self, program: GpuProgram):
        self.program = program
        self.launched: list[tuple] = []  # (kernel, grid, block, stream, [8-byte params])
        self.calls: list[str] = []
        self.capturing = None
        self.fail_kernel = None

    def CUstream(self, handle):  # noqa: N802
        return handle

    def cuCtxGetCurrent(self):  # noqa: N802
        return (0, 1)

    def cuModuleLoadData(self, ptx):  # noqa: N802
        self.calls.append("load")
        return (0, "module")

    def cuModuleGetFunction(self, module, name):  # noqa: N802
        return (0, name.decode())

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):  # noqa: N802
        import ctypes

        if f == self.fail_kernel:
            return (700,)
        k = next(k for k in self.program.launches if k.kernel == f)
        arr = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))
        params = [ctypes.string_at(arr[i], 8) for i in range(len(k.args))]
        self.launched.append((f, (gx, gy, gz), (bx, by, bz), stream, params, self.capturing))
        return (0,)

    def cuGetErrorName(self, err):  # noqa: N802
        return (0, b"CUDA_ERROR_ILLEGAL_ADDRESS")

    def cuGetErrorString(self, err):  # noqa: N802
        return (0, b"an illegal memory access was encountered")

    def cuStreamCreate(self, flags):  # noqa: N802
        return (0, "side")

    def cuStreamBeginCapture(self, stream, mode):  # noqa: N802
        self.capturing = stream
        return (0,)

    def cuStreamEndCapture(self, stream):  # noqa: N802
        self.capturing = None
        return (0, "graph")

    def cuGraphInstantiate(self, graph, flags):  # noqa: N802
        return (0, "exec")

    def cuGraphLaunch(self, exe, stream):  # noqa: N802
        self.calls.append(f"graph@{stream}")
        return (0,)

    def cuStreamDestroy(self, stream):  # noqa: N802
        return (0,)

    def cuGraphDestroy(self, graph):  # noqa: N802
        return (0,)

    def cuGraphExecDestroy(self, exe):  # noqa: N802
        return (0,)


def use_fake_driver(monkeypatch: pytest.MonkeyPatch, driver: _FakeDriver) -> None:
    """The cuda runtime on CPU tensors with `driver`: one stream (handle 7), never capturing, the
    current device is a CPU tensor's get_device() (-1)."""
    from gac_torch.backends.cuda import runtime

    monkeypatch.setattr(runtime, "_driver", driver)
    monkeypatch.setattr(runtime, "check_available", lambda: None)
    monkeypatch.setattr(runtime, "_raw_stream", lambda index: 7)
    monkeypatch.setattr(runtime, "_capturing", lambda: False)
    monkeypatch.setattr(runtime, "_current_device", lambda: -1)


def test_runtime_launch_path_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # The host side of CudaExecutable against a fake driver: argument arrays hold the right
    # pointers/scalars, are built once per pointer set, one workspace per stream, CUDA graphs
    # captured on a private stream and replayed, driver errors name the kernel.
    import struct

    from gac_torch.backends.cuda import launch_args, runtime

    from gac_torch.backends.gpu.program import ScalarArg

    # scalar arguments (none of the cases has one: constants are sunk into the kernels)
    scalars = (ScalarArg("i8", -3), ScalarArg("f16", 1.5), ScalarArg("bf16", -2.0),
               ScalarArg("i32", 123456), ScalarArg("f32", 0.25), ScalarArg("i64", -(1 << 40)),
               ScalarArg("f64", 3.5))
    launch = KernelLaunch("k", (1, 1, 1), (1, 1, 1), 0, (BufferRef("arg", 1), *scalars, BufferRef("temp", 0)))
    table = launch_args.ArgTable([launch, launch], [0x1000, 0x2000], [0x3000])
    assert table.param(1, 0) == struct.pack("<Q", 0x2000) and table.param(0, 8) == struct.pack("<Q", 0x3000)
    for j, a in enumerate(scalars, 1):
        raw = launch_args.pack_scalar(a.ctype, a.value)
        assert table.param(0, j)[:len(raw)] == raw
    assert struct.unpack("<e", table.param(1, 2)[:2])[0] == 1.5
    assert struct.unpack("<f", b"\0\0" + table.param(1, 3)[:2])[0] == -2.0  # bf16: top half of f32
    case = CASES["index_constant_copy"]
    program = compile_case(case, "sm_90")
    case2 = CASES["mlp_softmax_graph"]  # temps in a workspace
    program2 = compile_case(case2, "sm_90")
    for prog, sig in ((program, case.signature()), (program2, case2.signature())):
        fake = _FakeDriver(prog)
        monkeypatch.setattr(runtime, "_driver", fake)
        monkeypatch.setattr(runtime, "check_available", lambda: None)
        monkeypatch.setattr(runtime, "_raw_stream", lambda index: 7)
        monkeypatch.setattr(runtime, "_capturing", lambda: False)
        exe = runtime.CudaExecutable(prog, sig)
        exe.use_graphs = False
        dev = torch.device("cpu")
        ptrs = [0x10000 * (i + 1) for i in range(len(prog.args))]
        for _ in range(3):
            exe._launch_all(dev, ptrs)
        assert exe.stats == {"direct_calls": 3, "graph_calls": 0, "tables_built": 1, "graphs_built": 0,
                             "pool_misses": 0}
        assert fake.calls.count("load") == 1
        state = next(iter(exe._contexts.values()))
        ws = state.workspaces.get(7)
        assert (ws is not None) == bool(prog.plan.workspace_size)
        base = ws.data_ptr() if ws is not None else 0
        n = len(prog.launches)
        assert len(fake.launched) == 3 * n
        for (kname, grid, block, stream, params, _), k in zip(fake.launched[:n], prog.launches):
            assert (kname, grid, block, stream) == (k.kernel, k.grid, k.block, 7)
            for a, raw in zip(k.args, params):
                if isinstance(a, BufferRef):
                    want = ptrs[a.index] if a.kind == "arg" else base + prog.plan.offsets[prog.temps[a.index].name]
                    assert struct.unpack("<Q", raw)[0] == want
                else:
                    size = {"i8": 1, "i16": 2, "f16": 2, "bf16": 2, "i32": 4, "f32": 4}.get(a.ctype, 8)
                    assert raw[:size] == launch_args.pack_scalar(a.ctype, a.value)
        # a new pointer set: a new table; graphs: captured on the GRAPH_AFTER-th call, then replayed
        exe.use_graphs = True
        other = [p + 0x100 for p in ptrs]
        fake.launched.clear()
        for _ in range(runtime.GRAPH_AFTER + 2):
            exe._launch_all(dev, other)
        assert exe.stats["tables_built"] == 2 and exe.stats["graphs_built"] == 1
        assert exe.stats["graph_calls"] == 3 and fake.calls.count("graph@7") == 3
        captured = [x for x in fake.launched if x[5] == "side"]
        assert len(captured) == n and len(fake.launched) == (runtime.GRAPH_AFTER - 1) * n + n
        # a failing launch names the kernel and the driver's error
        exe.use_graphs = False
        fake.fail_kernel = prog.launches[-1].kernel
        with pytest.raises(runtime.CudaError, match=f"{fake.fail_kernel}.*CUDA_ERROR_ILLEGAL_ADDRESS"):
            exe._launch_all(dev, ptrs)


def test_no_gpu_is_target_unavailable() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from gac_torch.errors import TargetUnavailable

    with pytest.raises(TargetUnavailable, match="GPU"):
        TARGET.check_available()


# ------------------------------------------------------------------------------------------------
# GPU: run against torch


def _inputs(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for i, (shape, dtype) in enumerate(case.inputs):
        if case.make_input is not None:
            out.append(case.make_input(i, shape, dtype))
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
        else:
            out.append(torch.randint(-100, 100, shape, generator=gen).to(dtype))
    return out


def _poison(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, 0x5A if dtype != torch.bool else True, dtype=dtype, device=device)


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float | None) -> str:
    got = got.cpu()
    if not got.dtype.is_floating_point:
        bad = (got != ref.to(got.dtype)).sum().item()
        assert bad == 0, f"{name}: {bad} of {got.numel()} integer elements differ"
        return f"{name}: exact"
    assert not torch.isnan(got).any(), f"{name}: NaN in output (unwritten elements?)"
    g, r = got.double(), ref.double()
    rel = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
    bound = tol or TOL[got.dtype]
    assert rel <= bound, f"{name}: relative error {rel:.3e} > {bound:.1e}; max abs {(g - r).abs().max().item():.3e}"
    return f"{name}: rel {rel:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_runs_on_gpu(name: str) -> None:
    from gac_torch.backends.cuda.runtime import CudaExecutable

    TARGET.check_available()
    case = CASES[name]
    program = compile_case(case, compile_options({}).arch)
    exe = CudaExecutable(program, case.signature())
    # a seed per case, printed (GAC_TEST_SEED overrides it to replay another draw)
    seed = int(os.environ.get("GAC_TEST_SEED", zlib.crc32(name.encode())))
    print(f"{name}: seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for trial in range(2):  # fresh inputs each time; the second run reuses the loaded module
        inputs = _inputs(case, gen)
        ref = case.reference(*[t.double() if t.dtype.is_floating_point else t for t in inputs])
        outs = [_poison(s, d, "cuda") for s, d in case.outputs]
        exe.run([t.cuda() for t in inputs], outs)
        torch.cuda.synchronize()
        report = [_check(f"{name}[{i}]", o, r, case.tol) for i, (o, r) in enumerate(zip(outs, ref))]
    print("; ".join(report), "|", " ".join(f"{k.kernel}{k.grid}x{k.block}" for k in program.launches))


@pytest.mark.cuda
def test_gpu_dlpack_noncontiguous_and_stream() -> None:
    from gac_torch.backends.cuda.runtime import CudaExecutable

    TARGET.check_available()
    case = CASES["elementwise_broadcast_f32"]
    exe = CudaExecutable(compile_case(case, compile_options({}).arch), case.signature())
    a, b, c = (t.cuda() for t in _inputs(case, torch.Generator().manual_seed(1)))

    class Producer:  # any DLPack producer, not a torch tensor
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def __dlpack__(self, stream=None, **kw):
            return self.t.__dlpack__(stream=stream, **kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    out_t = torch.full((case.outputs[0][0][1], case.outputs[0][0][0]), float("nan"), device="cuda").T
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # inputs were written on the default stream
    with torch.cuda.stream(stream):
        exe.run([Producer(a), b, c], [out_t])  # non-contiguous output is written back
    stream.synchronize()
    ref = torch.tanh(a * b[None, :] + c[:, None]) * 0.5
    torch.testing.assert_close(out_t, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_gpu_misaligned_buffers_are_staged() -> None:
    # Views whose data pointer is not 16-byte aligned (the tensor-core kernel loads 16-byte
    # vectors from buffer bases): inputs are copied, outputs written back.
    from gac_torch.backends.cuda.runtime import CudaExecutable

    TARGET.check_available()
    case = CASES["matmul_96x64x80_f16"]
    exe = CudaExecutable(compile_case(case, compile_options({}).arch), case.signature())
    a, b = _inputs(case, torch.Generator().manual_seed(5))

    def shifted(t: torch.Tensor) -> torch.Tensor:
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:]
        flat.copy_(t.flatten().cuda())
        return flat.view(t.shape)

    out = shifted(torch.full((96, 80), float("nan"), dtype=torch.float16))
    assert out.data_ptr() % 16 and shifted(a).data_ptr() % 16
    exe.run([shifted(a), shifted(b)], [out])
    torch.cuda.synchronize()
    _check("misaligned", out, a.double() @ b.double(), None)


@pytest.mark.cuda
def test_gpu_graph_replay_and_streams() -> None:
    # Repeated calls with the same buffers replay a CUDA graph that reads the inputs' current
    # contents; another stream gets its own workspace; results match the plain launches.
    from gac_torch.backends.cuda import runtime
    from gac_torch.backends.cuda.runtime import CudaExecutable

    TARGET.check_available()
    case = CASES["mlp_softmax_graph"]
    program = compile_case(case, compile_options({}).arch)
    exe = CudaExecutable(program, case.signature())
    exe.use_graphs = True
    gen = torch.Generator().manual_seed(3)
    ins = [t.cuda() for t in _inputs(case, gen)]
    outs = [_poison(s, d, "cuda") for s, d in case.outputs]
    for trial in range(runtime.GRAPH_AFTER + 3):
        fresh = _inputs(case, gen)
        for dst, src in zip(ins, fresh):
            dst.copy_(src)
        outs[0].fill_(float("nan"))
        exe.run(ins, outs)
        torch.cuda.synchronize()
        ref = case.reference(*[t.double() for t in fresh])
        _check(f"graph trial {trial}", outs[0], ref[0], case.tol)
    assert exe.stats["graphs_built"] == 1 and exe.stats["graph_calls"] >= 3, exe.stats
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = [_poison(s, d, "cuda") for s, d in case.outputs]
        exe.run(ins, other)
    side.synchronize()
    torch.testing.assert_close(other[0], outs[0], rtol=0, atol=0)
    state = next(iter(exe._contexts.values()))
    assert len(state.workspaces) == 2


def _median_ms(fn: Callable[[], None], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.cuda
def test_gpu_throughput_report() -> None:
    """Not a benchmark suite: one number per strategy against torch eager, to see where we are.
    Writes the table to $GAC_CUDA_REPORT when set."""
    from gac_torch.backends.cuda.runtime import CudaExecutable

    TARGET.check_available()
    arch = compile_options({}).arch
    rows = []
    f32 = torch.float32
    specs = [
        ("elementwise 4096x4096 f32", elementwise(torch.float32, 4096, 4096), 2 * 4 * 4096 * 4096, 0,
         lambda a, b, c: torch.tanh(a * b[None, :] + c[:, None]) * 0.5),
        ("row sum 16384x1024 f32", reduce_last("sum", 16384, 1024), 4 * 16384 * 1024, 0,
         lambda a: a.sum(1)),
        ("row sum 2048x8192 f32", reduce_last("sum", 2048, 8192), 4 * 2048 * 8192, 0,
         lambda a: a.sum(1)),
        ("col sum-sq 64x2048x512 f32", reduce_middle(64, 2048, 512), 4 * 64 * 2048 * 512, 0,
         lambda a: (a * a).sum(1)),
        ("matmul 2048^3 f32", matmul(2048, 2048, 2048, f32), 0, 2 * 2048**3, lambda a, b: a @ b),
        ("matmul 2048^3 bf16", matmul(2048, 2048, 2048, torch.bfloat16), 0, 2 * 2048**3,
         lambda a, b: a @ b),
        ("matmul 4096^3 f16 (mma)", matmul(4096, 4096, 4096, torch.float16), 0, 2 * 4096**3,
         lambda a, b: a @ b),
    ]
    for label, case, nbytes, flops, eager in specs:
        exe = CudaExecutable(compile_case(case, arch), case.signature())
        gen = torch.Generator().manual_seed(2)
        ins = [t.cuda() for t in _inputs(case, gen)]
        outs = [torch.empty(s, dtype=d, device="cuda") for s, d in case.outputs]
        ours = _median_ms(lambda: exe.run(ins, outs))
        ref = eager(*ins)
        theirs = _median_ms(lambda: eager(*ins))
        rel = ((outs[0].double() - ref.double()).norm() / ref.double().norm()).item()
        rate = f"{nbytes / ours / 1e6:.0f} GB/s" if nbytes else f"{flops / ours / 1e9:.1f} TFLOP/s"
        rows.append(f"{label:30s} gac {ours:8.3f} ms ({rate})  eager {theirs:8.3f} ms  rel err {rel:.1e}")
        assert rel < {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(case.inputs[0][1], 1e-4), rows[-1]
    table = "\n".join(rows)
    print("\n" + table)
    if os.environ.get("GAC_CUDA_REPORT"):
        with open(os.environ["GAC_CUDA_REPORT"], "a") as f:
            f.write(table + "\n")

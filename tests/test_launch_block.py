"""A one-kernel program's launch through its lane's argument array, fresh outputs by empty_like
of prototypes (backends/cuda/launch_block.py, GAC_LAUNCH_BLOCK; issue 15's per-call host path).

CPU (CI), against the fake driver: a one-kernel program with fresh outputs (over POOL_BYTES,
as grid_sample_msda's 82 MB) held over rotated input sets passes each call's own pointers, no
table built; GAC_LAUNCH_BLOCK=0 passes the same through tables; scalars and workspace pointers
written once stay; each stream gets its own block; a program with a TMA argument or several
launches keeps the tables; prototypes make dense outputs of every rank.
With `-m cuda`: grid_sample at the bench's pattern (smaller) with fresh outputs, rotated inputs
and held outputs behind a busy stream, both switch values, against float64 eager.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from gac_torch.backends.cuda import launch_block, runtime
from gac_torch.backends.gpu.program import BufferRef, KernelLaunch, ScalarArg, TensorMapArg
from cuda_cases import CASES, compile_case
from test_cuda_runtime import _FakeDriver, use_fake_driver


@pytest.fixture(scope="module")
def one_kernel():
    case = CASES["mlp_softmax_graph"]  # 4 inputs, one output, a workspace
    program = compile_case(case, "sm_90")
    return case, dataclasses.replace(program, launches=program.launches[:1])


def _params(record, launch) -> list:
    """What a recorded launch passed: per argument its 8 bytes as an integer."""
    return [struct.unpack("<Q", raw)[0] for raw in record[4][:len(launch.args)]]


def _want(launch, ptrs: list[int], ws: int, program) -> list:
    return [ptrs[a.index] if isinstance(a, BufferRef) and a.kind == "arg"
            else ws + program.plan.offsets[program.temps[a.index].name] if isinstance(a, BufferRef)
            else None for a in launch.args]


@pytest.mark.parametrize("block", ["1", "0"])
def test_fresh_outputs_over_rotated_inputs_pass_each_calls_pointers(one_kernel, monkeypatch, block) -> None:
    case, program = one_kernel
    driver = _FakeDriver(program)
    use_fake_driver(monkeypatch, driver)
    monkeypatch.setenv("GAC_LAUNCH_BLOCK", block)
    monkeypatch.setattr(runtime, "POOL_BYTES", 0)  # (fresh outputs, as over 64 MB)
    exe = runtime.CudaExecutable(program, case.signature())
    exe._devices[-1] = torch.device("cpu")
    assert exe._one == (block == "1") and not exe._poolable
    gen = torch.Generator().manual_seed(1)
    sets = [[torch.randn(s, generator=gen, dtype=d) for s, d in case.inputs] for _ in range(5)]
    held = []
    (launch,) = program.launches
    for _ in range(3):
        for xs in sets:
            outs = exe.call(xs)
            (shape, dtype), = [(tuple(s.shape), s.dtype) for s in case.signature().outputs]
            assert outs[0].shape == shape and outs[0].dtype == dtype and outs[0].is_contiguous()
            lane = next(iter(exe._ready.lanes.values()))
            got = _params(driver.launched[-1], launch)
            want = _want(launch, [t.data_ptr() for t in xs + outs], lane.ws_ptr, program)
            assert [g for g, w in zip(got, want) if w is not None] == [w for w in want if w is not None]
            held.append(outs)
    assert len({o[0].data_ptr() for o in held}) == len(held)  # held fresh outputs: all distinct
    assert exe.stats["direct_calls"] == 15
    assert exe.stats["tables_built"] == (0 if block == "1" else 15)  # (every output address new)
    assert (lane.block is not None) == (block == "1") and (lane.protos is not None) == (block == "1")


def test_scalars_and_workspace_are_written_once_and_kept(monkeypatch) -> None:
    # a launch with a scalar between buffers and a workspace temp: per call only the buffer
    # slots change; the scalar's bytes and the temp's pointer are the block's from its build
    launch = KernelLaunch("k", (3, 1, 1), (128, 1, 1), 0,
                                  (BufferRef("arg", 1), ScalarArg("f32", 0.25), BufferRef("temp", 0),
                                   BufferRef("arg", 0)))
    block = launch_block.LaunchBlock(launch, ("f", 3, 1, 1, 128, 1, 1, 0), 7, [0x9000])
    for ptrs in ([0x1000, 0x2000], [0x3000, 0x4000]):
        block.fill(ptrs)
        assert struct.unpack("<Q", block.param(0))[0] == ptrs[1]
        assert struct.unpack("<Q", block.param(3))[0] == ptrs[0]
        assert block.param(1)[:4] == struct.pack("<f", 0.25)
        assert struct.unpack("<Q", block.param(2))[0] == 0x9000
    assert block.args[:8] == ("f", 3, 1, 1, 128, 1, 1, 0) and block.args[8] == 7 and block.args[10] == 0


def test_each_stream_gets_its_own_block(one_kernel, monkeypatch) -> None:
    case, program = one_kernel
    driver = _FakeDriver(program)
    use_fake_driver(monkeypatch, driver)
    monkeypatch.delenv("GAC_LAUNCH_BLOCK", raising=False)
    stream = [7]
    monkeypatch.setattr(runtime, "_raw_stream", lambda index: stream[0])
    exe = runtime.CudaExecutable(program, case.signature())
    exe._devices[-1] = torch.device("cpu")
    xs = [torch.randn(s, dtype=d) for s, d in case.inputs]
    for s in (7, 9, 7):
        stream[0] = s
        exe.call(xs)
        assert driver.launched[-1][3] == s
    blocks = {h: lane.block for (_, h), lane in exe._ready.lanes.items()}
    assert set(blocks) == {7, 9} and blocks[7] is not blocks[9] and blocks[9].args[8] == 9


def test_tma_and_multi_launch_programs_keep_the_tables(one_kernel) -> None:
    _, program = one_kernel
    assert launch_block.takes_block(program)
    (launch,) = program.launches
    ref = next(a for a in launch.args if isinstance(a, BufferRef) and a.kind == "arg")
    tma = TensorMapArg(ref, "f32", (16, 16), (64,), 0, (16, 16), 0)
    assert not launch_block.takes_block(dataclasses.replace(
        program, launches=[dataclasses.replace(launch, args=(*launch.args, tma))]))
    assert not launch_block.takes_block(dataclasses.replace(program, launches=[launch, launch]))


@pytest.mark.parametrize("shape", [(), (0,), (3, 1, 5), (2, 3, 4, 5)])
def test_prototypes_make_dense_fresh_outputs(shape) -> None:
    (p,) = launch_block.prototypes([(shape, torch.float16)], torch.device("cpu"))
    a, b = (torch.empty_like(p, memory_format=torch.contiguous_format) for _ in range(2))
    assert a.shape == shape and a.dtype == torch.float16 and a.is_contiguous()
    assert a.stride() == torch.empty(shape).stride()
    if a.numel() > 1:
        assert a.data_ptr() != b.data_ptr() and a.untyped_storage().nbytes() == a.numel() * 2


@pytest.mark.cuda
@pytest.mark.parametrize("block", ["1", "0"])
def test_gpu_grid_sample_fresh_outputs_behind_a_busy_stream(block, monkeypatch) -> None:
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.setenv("GAC_LAUNCH_BLOCK", block)
    monkeypatch.setattr(runtime, "POOL_BYTES", 0)  # (fresh outputs, as the bench's 82 MB)
    torch._dynamo.reset()

    def fn(x, g):
        return F.grid_sample(x, g, mode="bilinear", padding_mode="zeros", align_corners=False)

    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [(torch.randn(2, 8, 15, 25, generator=gen, device="cuda"),
             torch.rand(2, 250, 32, 2, generator=gen, device="cuda") * 2.2 - 1.1) for _ in range(4)]
    compiled = torch.compile(fn, backend="gac")
    busy = torch.randn(4096, 4096, device="cuda")
    with torch.no_grad():
        outs = []
        for _ in range(3):
            for x, g in sets:
                for _ in range(4):
                    busy = busy @ busy * 1e-3  # (the launches queue behind it)
                outs.append((compiled(x, g), x, g))
        torch.cuda.synchronize()
    for out, x, g in outs:
        torch.testing.assert_close(out, fn(x.double(), g.double()).float(), rtol=1e-5, atol=1e-5)
    assert len({o.data_ptr() for o, _, _ in outs}) == len(outs)

"""Failures the fuzzer (gac_torch.tools.fuzz) found beyond issue 12's list, one minimal repro each.

Marked xfail(strict=True) with the reason while the bug is open: the fix turns the test into an
XPASS, which fails, so the mark is removed with the fix. Each compares with eager in strict mode.
"""

from __future__ import annotations

import pytest
import torch

import gac_torch

STRICT = {"fallback": False}
FAKE_TABLE = ("a lowering builds its index table with torch while torch.compile's fake mode is on: "
              "'.numpy() is not supported for tensor subclasses' (flip's bug, issue 12 item 4, in "
              "more lowerings: unfold, diagonal, diagonal_scatter, strided slice_scatter)")


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _strided_assign(x, y):
    x = x.clone()
    x[::2].copy_(y)
    return x


def _inputs(*shapes):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=g) for s in shapes)


UNDER_TORCH_COMPILE = {  # found by fuzz seeds 27 (unfold), 27 of the first cpu run (diagonal)
    "unfold": (lambda x: x.unfold(-1, 2, 1) + 1, _inputs((3, 4))),
    "diagonal": (lambda x: x.diagonal() * 2, _inputs((3, 4))),
    "diagonal_scatter": (lambda x, y: torch.diagonal_scatter(x, y), _inputs((3, 3), (3,))),
    "slice_scatter_step": (_strided_assign, _inputs((4, 3), (2, 3))),
}


@pytest.mark.parametrize("name", sorted(UNDER_TORCH_COMPILE))
def test_torch_compile_index_tables(name):
    """Fixed (issue 12 item 4): was FAKE_TABLE under torch.compile's fake mode."""
    fn, inputs = UNDER_TORCH_COMPILE[name]
    torch._dynamo.reset()
    out = torch.compile(Fn(fn), backend="gac", options=STRICT)(*inputs)
    torch.testing.assert_close(out, fn(*inputs))


@pytest.mark.parametrize("name", sorted(UNDER_TORCH_COMPILE))
def test_export_index_tables(name):
    """The export path compiles the same ops (a control: the bug is torch.compile's fake mode)."""
    fn, inputs = UNDER_TORCH_COMPILE[name]
    out = gac_torch.compile(torch.export.export(Fn(fn), inputs), options=STRICT)(*inputs)
    torch.testing.assert_close(out, fn(*inputs))


def test_flip_of_a_0d_tensor():
    """flip of a 0-d tensor (dims=[0]) failed to legalize: IndexError, both front-ends (seed 14)."""
    def fn(x):
        return x.sum().flip(0) + 1

    (x,) = _inputs((3,))
    out = gac_torch.compile(torch.export.export(Fn(fn), (x,)), options=STRICT)(x)
    torch.testing.assert_close(out, fn(x))


def test_atan2_of_constant_zeros():
    """atan2 of two constant zeros was NaN (MLIR's atan2 folder), eager 0 / pi: fuzz seed 1463.
    All four signed-zero pairs, as constants, through both front-ends."""
    def fn(x):
        pairs = ((0.0, 0.0), (0.0, -0.0), (-0.0, 0.0), (-0.0, -0.0))  # fresh constants each
        return (torch.atan2(torch.zeros_like(x), torch.zeros_like(x)) + x,
                *(torch.atan2(torch.full_like(x, a), torch.full_like(x, b)) + x for a, b in pairs))

    (x,) = _inputs((4,))
    ref = fn(x)
    out = gac_torch.compile(torch.export.export(Fn(fn), (x,)), options=STRICT)(x)
    torch.testing.assert_close(out, ref)
    torch._dynamo.reset()
    out = torch.compile(Fn(fn), backend="gac", options=STRICT)(x)
    torch.testing.assert_close(out, ref)


def test_atan2_of_zero_inputs():
    """The control: zeros that arrive as inputs, signed, give eager's 0, pi, -0, -pi."""
    def fn(y, x):
        return torch.atan2(y, x)

    y = torch.tensor([0.0, 0.0, -0.0, -0.0, 1.0, 0.0])
    x = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0, 2.0])
    out = gac_torch.compile(torch.export.export(Fn(fn), (y, x)), options=STRICT)(y, x)
    torch.testing.assert_close(out, fn(y, x))
    assert torch.equal(out.signbit(), fn(y, x).signbit())


def test_torch_compile_graph_with_a_tensor_constant():
    """The dynamo path deep-copied the graph under AOTAutograd's fake mode: a lifted constant
    (torch.tensor([0])) became a meta tensor and the copy raised 'set the storage of a tensor on
    device "meta"' (fuzz seeds of every KNOWN class once their fixes were merged)."""
    def fn(x):
        return x.clone().index_put_((torch.tensor([0]),), torch.tensor(1.0)) + 1

    (x,) = _inputs((3, 2))
    torch._dynamo.reset()
    out = torch.compile(Fn(fn), backend="gac", options=STRICT)(x)
    torch.testing.assert_close(out, fn(x))


def test_split_of_a_0_size_dim():
    """torch.split of a 0-size dim gives one empty chunk; the lowering made none, and taking
    chunk [0] raised IndexError (fuzz seed 627 of the zero_size class)."""
    def fn(x, y):
        return x.split(2, 0)[0], torch.sinh(y)

    x, y = torch.randn(0, 3), torch.randn(2, 3)
    out = gac_torch.compile(torch.export.export(Fn(fn), (x, y)), options=STRICT)(x, y)
    torch.testing.assert_close(out, fn(x, y))


def _concat_also_sliced(x):
    c = torch.cat([x - 1, x - 1], 2)
    return c, c.split(2, 0)[0]


@pytest.mark.parametrize("target", ["vortex", "cuda"], ids=["vortex", "cuda_ptx_offline"])
def test_concat_output_also_sliced_into_another_output(target):
    """A concat that is an output and whose slice is another output: bufferization initialized
    the concat's buffer from the (uninitialized) output argument and the dataflow check refused
    the launch list ('reads arg1 before any write'), H200 fuzz seed 120; the vortex simulator
    runs it here, cuda is compiled to PTX without a GPU."""
    x = torch.randint(-4, 5, (5, 4, 1, 3), generator=torch.Generator().manual_seed(0))
    prog = gac_torch.compile(torch.export.export(Fn(_concat_also_sliced), (x,)), target=target,
                             options=STRICT)
    if target == "vortex":
        torch.testing.assert_close(prog(x), _concat_also_sliced(x), rtol=0, atol=0)


def test_vector_norm_over_a_negative_size_1_dim_is_traced_with_dims_from_0():
    """torch 2.11's reference for linalg_vector_norm (the fake-tensor shape under torch.compile
    on cuda) kept a size-1 dim reduced through a negative index, so legalization refused the
    node's shape (H200 fuzz seeds 207, 221, 401, 494): the trace now gives dims >= 0."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from gac_torch.legalize.registry import decompositions

    def fn(x):
        return (torch.linalg.vector_norm(x, 1, dim=-2), torch.linalg.vector_norm(x, 2, dim=[-1, 0]),
                torch.linalg.vector_norm(x.sum(), 2, dim=[-1]))

    (x,) = _inputs((2, 1, 3))
    g = make_fx(fn, decomposition_table=decompositions())(x)
    dims = [n.args[2] for n in g.graph.nodes if n.target == torch.ops.aten.linalg_vector_norm.default]
    assert dims == [[1], [2, 0], [-1]], dims  # (a 0-d input keeps its dims: no recursion)
    torch._dynamo.reset()
    out = torch.compile(Fn(fn), backend="gac", options=STRICT)(x)
    torch.testing.assert_close(out, fn(x))


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [120, 167, 207, 221, 401, 494])
def test_h200_fuzz_crashes(seed):
    """The six cuda-only crashes of the 600-seed H200 fuzz run (fuzz_2026-12-01_h200_cuda.md)."""
    from gac_torch.tools.fuzz import generate, run_case

    result = run_case(generate(seed).source(), seed, ("cuda",))
    assert result.status == "ok", result.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_split_chunk_feeding_a_matmul(dtype):
    """A chunk of a 0-size dim that feeds a linear (K = 0: the output is the bias) was an
    extract_slice at offset 0 into the 0-size dim, which MLIR's verifier refuses (cpu fuzz seed
    1937, found by the 2,000-case run; default mode ran the partition eagerly)."""
    def fn(x, w, b):
        h = torch.relu(x % 3)
        return torch.nn.functional.linear(h.split(2, -1)[0], w, b), torch.sqrt(h)

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 0).to(dtype), torch.randn(3, 0).to(dtype), torch.randn(3, generator=g).to(dtype)
    out = gac_torch.compile(torch.export.export(Fn(fn), (x, w, b)), options=STRICT)(x, w, b)
    torch.testing.assert_close(out, fn(x, w, b))


def test_gelu_of_inf_judged_against_float64():
    """cpu fuzz seed 1978 (the 2,000-case run): eager's vectorized float32 gelu gives NaN for
    +inf where its scalar path and float64 give inf; gac follows the formula, so its later
    element is finite and equal to the float64 program's while eager's is NaN. The oracle lets
    exactly that pass (oracle.py); the whole case runs here."""
    from gac_torch.tools.fuzz import generate, run_case

    result = run_case(generate(1978).source(), 1978, ("cpu",))
    assert result.status == "ok", result.summary()



@torch.library.custom_op("gac_fuzz_test::tracer_bug", mutates_args=())
def _tracer_bug(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


@_tracer_bug.register_fake
def _(x):  # stands in for a bug of torch's tracer (seed 167: torch 2.11's fake-tensor `split`)
    raise IndexError("list assignment index out of range")


_TRACER_BUG = '''
import torch
F32 = torch.float32


def make_inputs():
    return [torch.randn((3, 4), generator=torch.Generator().manual_seed(5))]


def forward(x0):
    return (torch.ops.gac_fuzz_test.tracer_bug(x0) + 1,)
'''


def test_torch_tracer_failure_is_not_a_gac_crash():
    """H200 fuzz seed 167: torch 2.11's fake-tensor `split` of a 0-size dim raises inside dynamo,
    whatever the backend; the case was counted as a gac crash. A crash under torch.compile is
    torch's when backend="eager" fails too: that front-end is skipped, like an export torch
    refuses (which is what the export front-end reports here)."""
    from gac_torch.tools.fuzz import run_case

    result = run_case(_TRACER_BUG, 0, ("cpu",))
    assert result.status == "ok", result.summary()
    by_front = {f: [o for o in result.outcomes if f"/{f}/" in o.config] for f in ("compile", "export")}
    assert by_front["compile"] and all("backend='eager' too" in o.detail for o in by_front["compile"])
    assert by_front["export"] and all("torch.export failed" in o.detail for o in by_front["export"])


_CUDA_OFFLINE = '''
import sys
import torch
import gac_torch
{program}
ins = tuple(make_inputs())
ep = torch.export.export(Fn(), ins)
gac_torch.compile(ep, target="cuda", options={{"fallback": False, "arch": "sm_90"}})
print("compiled")
'''

_CONSTANT_PROD = '''
class Fn(torch.nn.Module):
    def forward(self, x):
        return (torch.ceil(torch.zeros_like(x)) + -1.25).prod(-1), torch.fmin(x, x + 1)


def make_inputs():
    return [torch.randn(SHAPE)]
'''


def _compile_cuda_offline(program: str) -> None:
    """Compile for cuda sm_90 (PTX, no GPU) in a subprocess: a segfault fails the test."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "GAC_CACHE": "0", "GAC_STRICT_INTERNAL": "1"}
    r = subprocess.run([sys.executable, "-c", _CUDA_OFFLINE.format(program=program)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, (r.returncode, r.stderr[-3000:])


@pytest.mark.parametrize("shape", [(4, 1, 1), (2, 3, 5), (7,)])
def test_reduction_of_a_constant_cuda_offline(shape):
    """A product over a constant (`ceil(zeros_like(x)) - 1.25`, a generic without inputs):
    fold_casts_into_copies computed it inside the reduction reading it, leaving a generic whose
    reduction dim no operand bounded, and convert-linalg-to-parallel-loops segfaulted the process
    (H200/offline fuzz seeds 319, 394, 551, 620 on cuda)."""
    _compile_cuda_offline(f"SHAPE = {shape!r}\n" + _CONSTANT_PROD)


@pytest.mark.parametrize("seed", [319, 394, 551, 620])
def test_fuzz_segfaults_cuda_offline(seed):
    """The fuzz programs that segfaulted the cuda compile (the cause above), compiled to PTX."""
    from gac_torch.tools.fuzz import generate

    src = generate(seed).source().split('\nif __name__ == "__main__":')[0]
    _compile_cuda_offline(src + "\n\nclass Fn(torch.nn.Module):\n    def forward(self, *a):\n"
                                "        return forward(*a)\n")


@pytest.mark.unit
def test_invalid_linalg_op_is_a_compile_error_naming_the_step():
    """What the gpu stage verifies before an unverified pipeline: an invalid generic (a loop
    dim no operand bounds) is a CompileError naming the step, not a crash in the pass."""
    from mlir import ir

    from gac_torch.backends.gpu.irutil import verify_ops
    from gac_torch.errors import CompileError

    text = """
    func.func @main(%x: memref<4x1x3xf32>, %out: memref<4x1xf32>) {
      linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>],
                      iterator_types = ["parallel", "parallel", "reduction"]}
          ins(%x : memref<4x1x3xf32>) outs(%out : memref<4x1xf32>) {
      ^bb0(%i: f32, %o: f32):
        %m = arith.mulf %i, %o : f32
        linalg.yield %m : f32
      }
      return
    }"""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        fn = module.body.operations[0].operation
        generic = [op.operation for op in fn.regions[0].blocks[0].operations][0]
        verify_ops([generic], "some step")  # valid
        d = [ir.AffineDimExpr.get(i) for i in range(3)]  # the input's map no longer bounds d2
        generic.attributes["indexing_maps"] = ir.ArrayAttr.get(
            [ir.AffineMapAttr.get(ir.AffineMap.get(3, 0, d[:2]))] * 2)
        with pytest.raises(CompileError, match="some step left an invalid linalg.generic"):
            verify_ops([generic], "some step")

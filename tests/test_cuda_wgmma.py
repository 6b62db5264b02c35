"""Hopper GEMM on the GPU (strategies/wgmma.py): matmuls through gac_torch.compile vs a float64
reference, over sizes that are not tile multiples, transposed operands, batches, f16/bf16 and
TF32; which kernel ran is checked (sizes TMA cannot read stay with mma.sync)."""

from __future__ import annotations

import pytest
import torch

import gac_torch
from test_wgmma_gemm import (
    EPILOGUES, LINEAR_3D, BlockEnd, Epilogue, WeightT, epilogue_shapes, launches, linear_3d_shapes, matmul_tf32,
)

pytestmark = pytest.mark.cuda

# ‖out - ref‖ / ‖ref‖ (as cuda_cases.TOL): one rounding of the f32 result to the half type
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 3e-3}  # f32: TF32 operands


class _Mm(torch.nn.Module):
    """a @ b with a given as [K, M] (a_t) or b as [N, K] (b_t): views, no copies."""

    def __init__(self, a_t: bool, b_t: bool) -> None:
        super().__init__()
        self.a_t, self.b_t = a_t, b_t

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = a.transpose(-1, -2) if self.a_t else a
        b = b.transpose(-1, -2) if self.b_t else b
        return torch.matmul(a, b)


CASES = [  # M, K, N, dtype, a_t, b_t, batch, expected strategy
    (1000, 520, 1032, torch.bfloat16, False, False, 0, "wgmma"),  # partial tiles in M, N, K
    (4096, 4096, 4096, torch.bfloat16, False, False, 0, "wgmma"),
    (4096, 4096, 4096, torch.float16, False, False, 0, "wgmma"),
    (1000, 520, 1030, torch.bfloat16, False, False, 0, "mma"),  # B's rows not 16-byte multiples
    (129, 64, 257, torch.float16, False, False, 0, "mma"),
    (136, 72, 264, torch.bfloat16, True, False, 0, "wgmma"),  # A M-major
    (200, 136, 264, torch.float16, False, True, 0, "wgmma"),  # B K-major (nn.Linear's layout)
    (520, 200, 1032, torch.bfloat16, True, True, 0, "wgmma"),
    (200, 136, 264, torch.bfloat16, False, False, 3, "wgmma"),  # bmm
    (200, 136, 264, torch.float16, False, True, 3, "wgmma"),
    (200, 136, 262, torch.float16, False, True, 0, "wgmma"),  # C stored in pairs (no staging)
    # f32 with TF32 allowed: B N-major -> C^T = B^T A^T with B's tile from registers
    (2048, 2048, 2048, torch.float32, False, False, 0, "wgmma"),
    (1000, 520, 1032, torch.float32, False, False, 0, "wgmma"),
    (200, 136, 264, torch.float32, False, False, 3, "wgmma"),
    (136, 72, 264, torch.float32, True, True, 0, "wgmma"),  # A M-major from registers, no swap
    (520, 200, 1032, torch.float32, False, True, 0, "wgmma"),  # both K-major (shared memory)
    (520, 200, 1032, torch.float32, True, False, 0, "mma"),  # A M-major, B N-major
]


@pytest.mark.parametrize("M,K,N,dtype,a_t,b_t,batch,strategy", CASES)
def test_gemm_matches_float64_on_gpu(M, K, N, dtype, a_t, b_t, batch, strategy) -> None:
    gen = torch.Generator().manual_seed(M * 7 + N * 3 + K)
    lead = (batch,) if batch else ()
    a_shape = lead + ((K, M) if a_t else (M, K))
    b_shape = lead + ((N, K) if b_t else (K, N))
    model = _Mm(a_t, b_t)
    a = torch.randn(a_shape, generator=gen).to("cuda", dtype)
    b = torch.randn(b_shape, generator=gen).to("cuda", dtype)
    tf32 = dtype == torch.float32
    with matmul_tf32(tf32):  # read at compile time
        compiled = gac_torch.compile(model, (a, b), target="cuda")
    kernels = launches(compiled)  # transposes are read in place, the rounding is in the store
    assert kernels == ([strategy] if strategy == "wgmma" or tf32 else [strategy, "loops"]), kernels
    for seed in (0, 1):  # fresh inputs: descriptors are rebuilt for new addresses
        g2 = torch.Generator().manual_seed(seed)
        a = torch.randn(a_shape, generator=g2).to("cuda", dtype)
        b = torch.randn(b_shape, generator=g2).to("cuda", dtype)
        got = compiled(a, b)
        ref = model(a.double(), b.double())
        assert got.dtype == dtype and got.shape == ref.shape
        assert torch.isfinite(got).all()
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < TOL[dtype], (M, K, N, dtype, a_t, b_t, batch, err)


@pytest.mark.parametrize("M,K,N,dtype,a_t,b_t,batch", [
    (2048, 1024, 1536, torch.float32, False, True, 0),  # TF32: both operands K-major
    (520, 200, 1032, torch.bfloat16, True, True, 0),  # A M-major, B K-major, read in place
    (200, 136, 264, torch.float16, True, False, 3),
])
def test_transposed_operands_in_place_on_gpu(M, K, N, dtype, a_t, b_t, batch) -> None:
    # linalg with the transposed indexing maps (the frontend may copy a transpose first;
    # here the kernel itself reads the operands in their layout through TMA)
    from gac_torch.backends.cuda.runtime import CudaExecutable
    from gac_torch.backends.cuda.target import compile_options
    from cuda_cases import compile_case
    from test_wgmma_gemm import _case

    case = _case(M, K, N, dtype, a_t, b_t, batch)
    case.options = {"allow_tf32": dtype == torch.float32}
    program = compile_case(case, compile_options({}).arch)
    assert [k.strategy for k in program.launches] == ["wgmma"]
    exe = CudaExecutable(program, case.signature())
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(s, generator=gen).to(d) for s, d in case.inputs]
    out = torch.full(case.outputs[0][0], float("nan"), dtype=dtype, device="cuda")
    exe.run([t.cuda() for t in inputs], [out])
    ref = case.reference(*[t.double() for t in inputs])[0]
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err < TOL[dtype], err


def _one_wgmma_kernel_matches_float64(model, shapes, dtype, seeds=(0, 1)) -> None:
    """Compiled once (TF32 allowed for f32), one wgmma kernel; per seed, fresh inputs vs float64."""
    gen = torch.Generator().manual_seed(sum(map(sum, shapes)))
    args = [torch.randn(s, generator=gen).to("cuda", dtype) for s in shapes]
    with matmul_tf32(dtype == torch.float32):
        compiled = gac_torch.compile(model, tuple(args), target="cuda")
    assert launches(compiled) == ["wgmma"], compiled.ir("ptx").split("\n.version")[0]
    for seed in seeds:
        g2 = torch.Generator().manual_seed(seed)
        args = [torch.randn(s, generator=g2).to("cuda", dtype) for s in shapes]
        got = compiled(*args)
        ref = model(*[t.double() for t in args])
        assert got.dtype == dtype and got.shape == ref.shape and torch.isfinite(got).all()
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < TOL[dtype], (shapes, dtype, err)


@pytest.mark.parametrize("M,K,N,dtype,act,residual,linear,batch", EPILOGUES)
def test_epilogue_in_the_store_on_gpu(M, K, N, dtype, act, residual, linear, batch) -> None:
    _one_wgmma_kernel_matches_float64(Epilogue(act, residual, linear), epilogue_shapes(M, K, N, linear, batch), dtype)


@pytest.mark.parametrize("M,K,N,batch", [(1000, 72, 200, 0), (520, 200, 1032, 0), (200, 136, 264, 2)])
def test_short_k_f32_c_staged_epilogue_on_gpu(M, K, N, batch) -> None:
    # TF32 x @ w.T with a short K: C through the tile buffers, 16-byte row chunks (5d, stage_c);
    # M, N not tile multiples, a batch
    lead = (batch,) if batch else ()
    _one_wgmma_kernel_matches_float64(_Mm(False, True), [lead + (M, K), lead + (N, K)], torch.float32)


@pytest.mark.parametrize("B,M,K,N,dtype,act,residual,linear", LINEAR_3D)
def test_linear_on_3d_input_on_gpu(B, M, K, N, dtype, act, residual, linear) -> None:
    _one_wgmma_kernel_matches_float64(Epilogue(act, residual, linear), linear_3d_shapes(B, M, K, N, linear), dtype)


@pytest.mark.parametrize("N", [520, 262])
def test_3d_input_times_weight_t_on_gpu(N) -> None:
    _one_wgmma_kernel_matches_float64(WeightT(), [(4, 130, 256), (N, 256)], torch.bfloat16, seeds=(0,))


@pytest.mark.parametrize("M,K,N,dtype", [(9000, 256, 1024, torch.float32), (1000, 136, 262, torch.bfloat16)])
def test_heavy_epilogue_on_gpu(M, K, N, dtype) -> None:
    # nine epilogue operands (two unfolded BatchNorms, a residual): 8-accumulator chunks, no pairs
    gen = torch.Generator().manual_seed(M + N)
    args = [torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen) / K**0.5, torch.randn(M, N, generator=gen),
            *[torch.rand(N, generator=gen) + 0.5 for _ in range(8)]]
    args = [a.to(dtype) for a in args]
    model = BlockEnd()
    with matmul_tf32(True):
        compiled = gac_torch.compile(model, tuple(a.cuda() for a in args), target="cuda")
    assert launches(compiled) == ["wgmma"]
    got = compiled(*[a.cuda() for a in args])
    ref = model(*[a.double() for a in args])
    err = ((got.double().cpu() - ref).norm() / ref.norm()).item()
    assert got.dtype == dtype and torch.isfinite(got).all() and err < TOL[dtype], err

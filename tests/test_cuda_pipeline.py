"""CUDA target: hand-written linalg modules (the `linalg` stage ABI) -> PTX.

CPU (fast, CI): every case compiles for sm_80 and sm_90 and ptxas accepts the PTX; the expected
strategies are chosen; the memory plan reuses buffers. `-m cuda` (an NVIDIA GPU): every case runs
against a float64 torch reference on fresh random inputs, with poisoned outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from gac_torch.backends.base import Signature, TensorSpec
from gac_torch.backends.cuda import ptxas
from gac_torch.backends.cuda.program import (
    ArgSpec,
    BufferRef,
    CudaProgram,
    KernelLaunch,
    TempBuffer,
)
from gac_torch.backends.cuda.target import TARGET, compile_options
from gac_torch.passes.memory_plan import BufferUse, MemoryPlan, check_plan, plan_memory

_MLIR = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
         torch.bool: "i1", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
# ‖out - ref‖ / ‖ref‖ bounds (METHOD.md): f32 far under 1e-3; half types a few ulps of 2^-8/2^-11.
_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _tt(shape: tuple[int, ...], dtype: torch.dtype, kind: str = "tensor") -> str:
    dims = "x".join(str(s) for s in shape)
    return f"{kind}<{dims + 'x' if dims else ''}{_MLIR[dtype]}>"


@dataclass
class Case:
    name: str
    inputs: list[tuple[tuple[int, ...], torch.dtype]]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    body: str  # uses %t0.. (input tensors), defines %r0.. (results)
    reference: Callable[..., list[torch.Tensor]]  # float64/int CPU tensors in, results out
    strategies: set[str] = field(default_factory=set)  # expected among the kernels
    make_input: Callable[[int, tuple[int, ...], torch.dtype], torch.Tensor] | None = None
    tol: float | None = None
    options: dict = field(default_factory=dict)  # cuda target options (e.g. allow_tf32)

    def mlir(self) -> str:
        args = [f"%in{i}: {_tt(s, d, 'memref')}" for i, (s, d) in enumerate(self.inputs)]
        args += [f"%out{i}: {_tt(s, d, 'memref')}" for i, (s, d) in enumerate(self.outputs)]
        lines = [f"func.func @main({', '.join(args)}) attributes {{llvm.emit_c_interface}} {{"]
        for i, (s, d) in enumerate(self.inputs):
            lines.append(f"  %t{i} = bufferization.to_tensor %in{i} restrict : "
                         f"{_tt(s, d, 'memref')} to {_tt(s, d)}")
        lines.append(self.body)
        for i, (s, d) in enumerate(self.outputs):
            lines.append(f"  bufferization.materialize_in_destination %r{i} in restrict writable "
                         f"%out{i} : ({_tt(s, d)}, {_tt(s, d, 'memref')}) -> ()")
        lines += ["  return", "}"]
        return "\n".join(lines)

    def signature(self) -> Signature:
        return Signature(tuple(TensorSpec(s, d) for s, d in self.inputs),
                         tuple(TensorSpec(s, d) for s, d in self.outputs))


ID2 = "affine_map<(d0, d1) -> (d0, d1)>"
ID3 = "affine_map<(d0, d1, d2) -> (d0, d1, d2)>"
ID4 = "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>"
PP = '"parallel", "parallel"'


def _elementwise(dt: torch.dtype, M: int = 37, N: int = 129) -> Case:
    e = _MLIR[dt]
    up = (lambda v, o: f"%{o} = arith.extf %{v} : {e} to f32") if e != "f32" else None
    conv_in = (f"%a32 = arith.extf %a : {e} to f32\n    %b32 = arith.extf %b : {e} to f32\n"
               f"    %c32 = arith.extf %c : {e} to f32") if up else \
        "%a32 = arith.addf %a, %zero : f32\n    %b32 = arith.addf %b, %zero : f32\n    %c32 = arith.addf %c, %zero : f32"
    conv_out = f"%res = arith.truncf %y : f32 to {e}" if up else "%res = arith.addf %y, %zero : f32"
    body = f"""
  %zero = arith.constant 0.0 : f32
  %half = arith.constant 0.5 : f32
  %e = tensor.empty() : tensor<{M}x{N}x{e}>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d1)>, affine_map<(d0, d1) -> (d0)>, {ID2}], iterator_types = [{PP}]}}
      ins(%t0, %t1, %t2 : tensor<{M}x{N}x{e}>, tensor<{N}x{e}>, tensor<{M}x{e}>) outs(%e : tensor<{M}x{N}x{e}>) {{
  ^bb0(%a: {e}, %b: {e}, %c: {e}, %o: {e}):
    {conv_in}
    %m = arith.mulf %a32, %b32 : f32
    %s = arith.addf %m, %c32 : f32
    %t = math.tanh %s : f32
    %y = arith.mulf %t, %half : f32
    {conv_out}
    linalg.yield %res : {e}
  }} -> tensor<{M}x{N}x{e}>"""
    name = f"elementwise_broadcast_{e}" + ("" if (M, N) == (37, 129) else f"_{M}x{N}")
    return Case(name, [((M, N), dt), ((N,), dt), ((M,), dt)], [((M, N), dt)],
                body, lambda a, b, c: [torch.tanh(a * b[None, :] + c[:, None]) * 0.5], {"loops"})


def _elementwise_chain() -> Case:
    # Separate named/generic ops that elementwise fusion must merge into one kernel.
    M, N = 64, 96
    body = f"""
  %e = tensor.empty() : tensor<{M}x{N}xf32>
  %b = linalg.broadcast ins(%t1 : tensor<{N}xf32>) outs(%e : tensor<{M}x{N}xf32>) dimensions = [0]
  %s = linalg.add ins(%t0, %b : tensor<{M}x{N}xf32>, tensor<{M}x{N}xf32>) outs(%e : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %x = linalg.exp ins(%s : tensor<{M}x{N}xf32>) outs(%e : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %r0 = linalg.mul ins(%x, %t0 : tensor<{M}x{N}xf32>, tensor<{M}x{N}xf32>) outs(%e : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>"""
    return Case("elementwise_named_chain", [((M, N), torch.float32), ((N,), torch.float32)],
                [((M, N), torch.float32)], body, lambda a, b: [torch.exp(a + b) * a], {"loops"})


def _reduce_last(kind: str, M: int, N: int, dt: torch.dtype = torch.float32) -> Case:
    e = _MLIR[dt]
    acc = "f32" if e in ("f16", "bf16") else e
    init = {"sum": "0.0", "max": "0xFF800000" if acc == "f32" else "0xFFF0000000000000"}[kind]
    comb = {"sum": "arith.addf", "max": "arith.maximumf"}[kind]
    ext = f"%x = arith.extf %a : {e} to {acc}" if e != acc else f"%x = arith.addf %a, %zero : {acc}"
    body = f"""
  %zero = arith.constant 0.0 : {acc}
  %init = arith.constant {init} : {acc}
  %e = tensor.empty() : tensor<{M}x{acc}>
  %f = linalg.fill ins(%init : {acc}) outs(%e : tensor<{M}x{acc}>) -> tensor<{M}x{acc}>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%t0 : tensor<{M}x{N}x{e}>) outs(%f : tensor<{M}x{acc}>) {{
  ^bb0(%a: {e}, %o: {acc}):
    {ext}
    %s = {comb} %x, %o : {acc}
    linalg.yield %s : {acc}
  }} -> tensor<{M}x{acc}>"""
    ref = (lambda a: [a.sum(1)]) if kind == "sum" else (lambda a: [a.amax(1)])
    odt = torch.float32 if acc == "f32" else dt
    strat = {"reduce"} if N >= 128 else {"loops"}
    return Case(f"reduce_last_{kind}_{M}x{N}_{e}", [((M, N), dt)], [((M,), odt)], body, ref, strat)


def _reduce_middle(B: int, R: int, C: int) -> Case:
    body = f"""
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{B}x{C}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{B}x{C}xf32>) -> tensor<{B}x{C}xf32>
  %r0 = linalg.generic {{indexing_maps = [{ID3}, affine_map<(d0, d1, d2) -> (d0, d2)>], iterator_types = ["parallel", "reduction", "parallel"]}}
      ins(%t0 : tensor<{B}x{R}x{C}xf32>) outs(%f : tensor<{B}x{C}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %sq = arith.mulf %a, %a : f32
    %s = arith.addf %sq, %o : f32
    linalg.yield %s : f32
  }} -> tensor<{B}x{C}xf32>"""
    strat = {"reduce"} if B * C < 8192 else {"loops"}
    return Case(f"reduce_middle_{B}x{R}x{C}", [((B, R, C), torch.float32)], [((B, C), torch.float32)],
                body, lambda a: [(a * a).sum(1)], strat)


def _reduce_all() -> Case:
    M, N = 1000, 37
    body = f"""
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<f32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<f32>) -> tensor<f32>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> ()>], iterator_types = ["reduction", "reduction"]}}
      ins(%t0 : tensor<{M}x{N}xf32>) outs(%f : tensor<f32>) {{
  ^bb0(%a: f32, %o: f32):
    %s = arith.addf %a, %o : f32
    linalg.yield %s : f32
  }} -> tensor<f32>"""
    return Case("reduce_all_to_scalar", [((M, N), torch.float32)], [((), torch.float32)], body,
                lambda a: [a.sum()], {"reduce"})


def _matmul(M: int, K: int, N: int, dt: torch.dtype) -> Case:
    e = _MLIR[dt]
    acc = "f32" if e in ("f16", "bf16") else e
    if e == acc:
        body = f"""
  %zero = arith.constant 0.0 : {e}
  %em = tensor.empty() : tensor<{M}x{N}x{e}>
  %f = linalg.fill ins(%zero : {e}) outs(%em : tensor<{M}x{N}x{e}>) -> tensor<{M}x{N}x{e}>
  %r0 = linalg.matmul ins(%t0, %t1 : tensor<{M}x{K}x{e}>, tensor<{K}x{N}x{e}>) outs(%f : tensor<{M}x{N}x{e}>) -> tensor<{M}x{N}x{e}>"""
    else:  # as the shared lowering does: f32 accumulation, then one rounding
        body = f"""
  %zero = arith.constant 0.0 : f32
  %em = tensor.empty() : tensor<{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%em : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %mm = linalg.matmul ins(%t0, %t1 : tensor<{M}x{K}x{e}>, tensor<{K}x{N}x{e}>) outs(%f : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %eo = tensor.empty() : tensor<{M}x{N}x{e}>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, {ID2}], iterator_types = [{PP}]}} ins(%mm : tensor<{M}x{N}xf32>) outs(%eo : tensor<{M}x{N}x{e}>) {{
  ^bb0(%a: f32, %o: {e}):
    %t = arith.truncf %a : f32 to {e}
    linalg.yield %t : {e}
  }} -> tensor<{M}x{N}x{e}>"""
    # f16/bf16 run on tensor cores (mma.sync, sm_80+); f32 too when TF32 is allowed
    return Case(f"matmul_{M}x{K}x{N}_{e}", [((M, K), dt), ((K, N), dt)], [((M, N), dt)], body,
                lambda a, b: [a @ b], {"mma"} if e != "f32" else {"matmul"})


def _matmul_tf32(M: int, K: int, N: int) -> Case:
    case = _matmul(M, K, N, torch.float32)
    # TF32 operands (10-bit mantissa, rounded): ~2^-11 relative per product
    return Case(f"matmul_{M}x{K}x{N}_tf32", case.inputs, case.outputs, case.body, case.reference,
                {"mma"}, tol=3e-3, options={"allow_tf32": True})


def _matmul_transposed_b(dt: torch.dtype = torch.float32) -> Case:
    # x @ w.T with w [N, K]: the nn.Linear layout (k contiguous in both operands)
    M, K, N = (48, 80, 72) if dt == torch.float32 else (200, 264, 136)
    e = _MLIR[dt]
    body = f"""
  %zero = arith.constant 0.0 : f32
  %em = tensor.empty() : tensor<{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%em : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %r0 = linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]
      ins(%t0, %t1 : tensor<{M}x{K}x{e}>, tensor<{N}x{K}x{e}>) outs(%f : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>"""
    name = "matmul_transposed_b" + ("" if dt == torch.float32 else f"_{e}")
    return Case(name, [((M, K), dt), ((N, K), dt)], [((M, N), torch.float32)], body,
                lambda a, b: [a @ b.T], {"matmul"} if dt == torch.float32 else {"mma"})


def _batch_matmul(dt: torch.dtype = torch.float32) -> Case:
    B, M, K, N = 3, 65, 40, 33
    e = _MLIR[dt]
    body = f"""
  %zero = arith.constant 0.0 : f32
  %em = tensor.empty() : tensor<{B}x{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%em : tensor<{B}x{M}x{N}xf32>) -> tensor<{B}x{M}x{N}xf32>
  %r0 = linalg.batch_matmul ins(%t0, %t1 : tensor<{B}x{M}x{K}x{e}>, tensor<{B}x{K}x{N}x{e}>) outs(%f : tensor<{B}x{M}x{N}xf32>) -> tensor<{B}x{M}x{N}xf32>"""
    return Case(f"batch_matmul_{e}", [((B, M, K), dt), ((B, K, N), dt)], [((B, M, N), torch.float32)],
                body, lambda a, b: [torch.bmm(a, b)], {"matmul"} if e == "f32" else {"mma"})


def _conv2d() -> Case:
    N, C, H, W, F, KH, KW = 2, 3, 17, 17, 8, 3, 3
    OH, OW = (H - KH) // 2 + 1, (W - KW) // 2 + 1
    body = f"""
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{N}x{F}x{OH}x{OW}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{N}x{F}x{OH}x{OW}xf32>) -> tensor<{N}x{F}x{OH}x{OW}xf32>
  %r0 = linalg.conv_2d_nchw_fchw {{dilations = dense<1> : tensor<2xi64>, strides = dense<2> : tensor<2xi64>}}
      ins(%t0, %t1 : tensor<{N}x{C}x{H}x{W}xf32>, tensor<{F}x{C}x{KH}x{KW}xf32>) outs(%f : tensor<{N}x{F}x{OH}x{OW}xf32>) -> tensor<{N}x{F}x{OH}x{OW}xf32>"""
    return Case("conv2d_nchw_stride2", [((N, C, H, W), torch.float32), ((F, C, KH, KW), torch.float32)],
                [((N, F, OH, OW), torch.float32)], body,
                lambda x, w: [torch.nn.functional.conv2d(x, w, stride=2)], {"sgemm"})


def _conv2d_grouped_padded() -> Case:
    # What the shared lowering emits for conv: tensor.pad, then conv_2d_ngchw_gfchw.
    N, G, CG, H, W, FG = 1, 2, 3, 10, 12, 4
    body = f"""
  %zero = arith.constant 0.0 : f32
  %p = tensor.pad %t0 low[0, 0, 0, 1, 1] high[0, 0, 0, 1, 1] {{
  ^bb0(%i0: index, %i1: index, %i2: index, %i3: index, %i4: index):
    tensor.yield %zero : f32
  }} : tensor<{N}x{G}x{CG}x{H}x{W}xf32> to tensor<{N}x{G}x{CG}x{H + 2}x{W + 2}xf32>
  %e = tensor.empty() : tensor<{N}x{G}x{FG}x{H}x{W}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{N}x{G}x{FG}x{H}x{W}xf32>) -> tensor<{N}x{G}x{FG}x{H}x{W}xf32>
  %r0 = linalg.conv_2d_ngchw_gfchw {{dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}}
      ins(%p, %t1 : tensor<{N}x{G}x{CG}x{H + 2}x{W + 2}xf32>, tensor<{G}x{FG}x{CG}x3x3xf32>) outs(%f : tensor<{N}x{G}x{FG}x{H}x{W}xf32>) -> tensor<{N}x{G}x{FG}x{H}x{W}xf32>"""

    def ref(x, w):
        y = torch.nn.functional.conv2d(x.reshape(N, G * CG, H, W), w.reshape(G * FG, CG, 3, 3),
                                       padding=1, groups=G)
        return [y.reshape(N, G, FG, H, W)]

    return Case("conv2d_grouped_padded", [((N, G, CG, H, W), torch.float32), ((G, FG, CG, 3, 3), torch.float32)],
                [((N, G, FG, H, W), torch.float32)], body, ref, {"loops"})  # 4 per group: under an mma tile


def _pooling(kind: str) -> Case:
    N, C, H, W = 2, 4, 17, 17
    OH = OW = 8
    init = "0xFF800000" if kind == "max" else "0.0"
    body = f"""
  %init = arith.constant {init} : f32
  %win = tensor.empty() : tensor<3x3xf32>
  %e = tensor.empty() : tensor<{N}x{C}x{OH}x{OW}xf32>
  %f = linalg.fill ins(%init : f32) outs(%e : tensor<{N}x{C}x{OH}x{OW}xf32>) -> tensor<{N}x{C}x{OH}x{OW}xf32>
  %r0 = linalg.pooling_nchw_{kind} {{dilations = dense<1> : tensor<2xi64>, strides = dense<2> : tensor<2xi64>}}
      ins(%t0, %win : tensor<{N}x{C}x{H}x{W}xf32>, tensor<3x3xf32>) outs(%f : tensor<{N}x{C}x{OH}x{OW}xf32>) -> tensor<{N}x{C}x{OH}x{OW}xf32>"""
    ref = (lambda x: [torch.nn.functional.max_pool2d(x, 3, 2)]) if kind == "max" else \
        (lambda x: [torch.nn.functional.avg_pool2d(x, 3, 2) * 9])
    return Case(f"pooling_{kind}", [((N, C, H, W), torch.float32)], [((N, C, OH, OW), torch.float32)],
                body, ref, {"loops"})


def _transpose() -> Case:
    body = """
  %e0 = tensor.empty() : tensor<65x33xf32>
  %r0 = linalg.transpose ins(%t0 : tensor<33x65xf32>) outs(%e0 : tensor<65x33xf32>) permutation = [1, 0]
  %e1 = tensor.empty() : tensor<6x4x5xf16>
  %r1 = linalg.transpose ins(%t1 : tensor<4x5x6xf16>) outs(%e1 : tensor<6x4x5xf16>) permutation = [2, 0, 1]"""
    return Case("transpose", [((33, 65), torch.float32), ((4, 5, 6), torch.float16)],
                [((65, 33), torch.float32), ((6, 4, 5), torch.float16)], body,
                lambda a, b: [a.T, b.permute(2, 0, 1)], {"loops"})


def _slices() -> Case:
    body = """
  %c = tensor.concat dim(1) %t0, %t1 : (tensor<4x6xf32>, tensor<4x3xf32>) -> tensor<4x9xf32>
  %z = arith.constant 0.5 : f32
  %r0 = tensor.pad %c low[1, 2] high[1, 0] {
  ^bb0(%i: index, %j: index):
    tensor.yield %z : f32
  } : tensor<4x9xf32> to tensor<6x11xf32>
  %s = tensor.extract_slice %t0[1, 1] [2, 3] [1, 2] : tensor<4x6xf32> to tensor<2x3xf32>
  %e = tensor.empty() : tensor<4x3xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<4x3xf32>) -> tensor<4x3xf32>
  %r1 = tensor.insert_slice %s into %f[2, 0] [2, 3] [1, 1] : tensor<2x3xf32> into tensor<4x3xf32>
  %r2 = tensor.concat dim(0) %t1, %t1 : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>"""

    def ref(a, b):
        p = torch.full((6, 11), 0.5, dtype=a.dtype)
        p[1:5, 2:] = torch.cat([a, b], 1)
        r1 = torch.full((4, 3), 0.5, dtype=a.dtype)
        r1[2:4] = a[1:3, 1:6:2]
        return [p, r1, torch.cat([b, b], 0)]

    return Case("concat_pad_slices", [((4, 6), torch.float32), ((4, 3), torch.float32)],
                [((6, 11), torch.float32), ((4, 3), torch.float32), ((8, 3), torch.float32)], body, ref)


def _reshapes() -> Case:
    body = """
  %x = tensor.expand_shape %t0 [[0, 1], [2]] output_shape [4, 8, 16] : tensor<32x16xf32> into tensor<4x8x16xf32>
  %e = tensor.empty() : tensor<4x16x8xf32>
  %y = linalg.transpose ins(%x : tensor<4x8x16xf32>) outs(%e : tensor<4x16x8xf32>) permutation = [0, 2, 1]
  %r0 = tensor.collapse_shape %y [[0, 1], [2]] : tensor<4x16x8xf32> into tensor<64x8xf32>
  %r1 = tensor.collapse_shape %t0 [[0, 1]] : tensor<32x16xf32> into tensor<512xf32>"""
    return Case("expand_collapse", [((32, 16), torch.float32)], [((64, 8), torch.float32), ((512,), torch.float32)],
                body, lambda a: [a.reshape(4, 8, 16).transpose(1, 2).reshape(64, 8), a.reshape(512)])


def _mlp_softmax() -> Case:
    # A multi-op graph: several intermediates with disjoint lifetimes for the memory plan.
    M, K, H, N = 64, 256, 128, 200
    body = f"""
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e1 = tensor.empty() : tensor<{M}x{H}xf32>
  %f1 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<{M}x{H}xf32>) -> tensor<{M}x{H}xf32>
  %mm1 = linalg.matmul ins(%t0, %t1 : tensor<{M}x{K}xf32>, tensor<{K}x{H}xf32>) outs(%f1 : tensor<{M}x{H}xf32>) -> tensor<{M}x{H}xf32>
  %h = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d1)>, {ID2}], iterator_types = [{PP}]}}
      ins(%mm1, %t2 : tensor<{M}x{H}xf32>, tensor<{H}xf32>) outs(%e1 : tensor<{M}x{H}xf32>) {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %s = arith.addf %a, %b : f32
    %r = arith.maximumf %s, %zero : f32
    linalg.yield %r : f32
  }} -> tensor<{M}x{H}xf32>
  %e2 = tensor.empty() : tensor<{M}x{N}xf32>
  %f2 = linalg.fill ins(%zero : f32) outs(%e2 : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %y = linalg.matmul ins(%h, %t3 : tensor<{M}x{H}xf32>, tensor<{H}x{N}xf32>) outs(%f2 : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %e3 = tensor.empty() : tensor<{M}xf32>
  %f3 = linalg.fill ins(%ninf : f32) outs(%e3 : tensor<{M}xf32>) -> tensor<{M}xf32>
  %mx = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%y : tensor<{M}x{N}xf32>) outs(%f3 : tensor<{M}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  }} -> tensor<{M}xf32>
  %ex = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>, {ID2}], iterator_types = [{PP}]}}
      ins(%y, %mx : tensor<{M}x{N}xf32>, tensor<{M}xf32>) outs(%e2 : tensor<{M}x{N}xf32>) {{
  ^bb0(%a: f32, %m: f32, %o: f32):
    %d = arith.subf %a, %m : f32
    %r = math.exp %d : f32
    linalg.yield %r : f32
  }} -> tensor<{M}x{N}xf32>
  %f4 = linalg.fill ins(%zero : f32) outs(%e3 : tensor<{M}xf32>) -> tensor<{M}xf32>
  %sm = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%ex : tensor<{M}x{N}xf32>) outs(%f4 : tensor<{M}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  }} -> tensor<{M}xf32>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>, {ID2}], iterator_types = [{PP}]}}
      ins(%ex, %sm : tensor<{M}x{N}xf32>, tensor<{M}xf32>) outs(%e2 : tensor<{M}x{N}xf32>) {{
  ^bb0(%a: f32, %s: f32, %o: f32):
    %r = arith.divf %a, %s : f32
    linalg.yield %r : f32
  }} -> tensor<{M}x{N}xf32>"""

    def ref(x, w1, b1, w2):
        return [torch.softmax(torch.relu(x @ w1 + b1) @ w2, dim=1)]

    return Case("mlp_softmax_graph", [((M, K), torch.float32), ((K, H), torch.float32), ((H,), torch.float32),
                                      ((H, N), torch.float32)], [((M, N), torch.float32)], body, ref,
                {"matmul", "reduce", "loops"})


def _ints() -> Case:
    M, N = 50, 300
    body = f"""
  %z32 = arith.constant 0 : i32
  %z64 = arith.constant 0 : i64
  %min32 = arith.constant -2147483648 : i32
  %false = arith.constant false
  %e0 = tensor.empty() : tensor<{M}xi32>
  %f0 = linalg.fill ins(%z32 : i32) outs(%e0 : tensor<{M}xi32>) -> tensor<{M}xi32>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d1)>, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%t0, %t1 : tensor<{M}x{N}xi32>, tensor<{N}xi32>) outs(%f0 : tensor<{M}xi32>) {{
  ^bb0(%a: i32, %b: i32, %o: i32):
    %m = arith.muli %a, %b : i32
    %s = arith.addi %m, %o : i32
    linalg.yield %s : i32
  }} -> tensor<{M}xi32>
  %f1 = linalg.fill ins(%min32 : i32) outs(%e0 : tensor<{M}xi32>) -> tensor<{M}xi32>
  %r1 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%t0 : tensor<{M}x{N}xi32>) outs(%f1 : tensor<{M}xi32>) {{
  ^bb0(%a: i32, %o: i32):
    %s = arith.maxsi %a, %o : i32
    linalg.yield %s : i32
  }} -> tensor<{M}xi32>
  %e2 = tensor.empty() : tensor<{M}xi1>
  %f2 = linalg.fill ins(%false : i1) outs(%e2 : tensor<{M}xi1>) -> tensor<{M}xi1>
  %r2 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%t0 : tensor<{M}x{N}xi32>) outs(%f2 : tensor<{M}xi1>) {{
  ^bb0(%a: i32, %o: i1):
    %big = arith.constant 95 : i32
    %c = arith.cmpi sgt, %a, %big : i32
    %s = arith.ori %c, %o : i1
    linalg.yield %s : i1
  }} -> tensor<{M}xi1>
  %e3 = tensor.empty() : tensor<{N}xi64>
  %f3 = linalg.fill ins(%z64 : i64) outs(%e3 : tensor<{N}xi64>) -> tensor<{N}xi64>
  %r3 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d1)>], iterator_types = ["reduction", "parallel"]}}
      ins(%t0 : tensor<{M}x{N}xi32>) outs(%f3 : tensor<{N}xi64>) {{
  ^bb0(%a: i32, %o: i64):
    %w = arith.extsi %a : i32 to i64
    %s = arith.addi %w, %o : i64
    linalg.yield %s : i64
  }} -> tensor<{N}xi64>
  %e4 = tensor.empty() : tensor<{N}xi8>
  %r4 = linalg.generic {{indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>], iterator_types = ["parallel"]}}
      ins(%t2 : tensor<{N}xi8>) outs(%e4 : tensor<{N}xi8>) {{
  ^bb0(%a: i8, %o: i8):
    %s = arith.addi %a, %a : i8
    %t = arith.muli %s, %a : i8
    linalg.yield %t : i8
  }} -> tensor<{N}xi8>"""

    def make(i, shape, dtype):
        return torch.randint(-100, 100, shape, dtype=dtype)

    def ref(a, b, c):
        return [(a * b).sum(1).to(torch.int32), a.amax(1), (a > 95).any(1), a.to(torch.int64).sum(0),
                ((c + c) * c).to(torch.int8)]

    return Case("integers_i1_i8_i32_i64", [((M, N), torch.int32), ((N,), torch.int32), ((N,), torch.int8)],
                [((M,), torch.int32), ((M,), torch.int32), ((M,), torch.bool), ((N,), torch.int64),
                 ((N,), torch.int8)], body, ref, {"reduce", "loops"}, make)


def _f64() -> Case:
    M, N = 40, 150
    body = f"""
  %zero = arith.constant 0.0 : f64
  %e = tensor.empty() : tensor<{M}xf64>
  %f = linalg.fill ins(%zero : f64) outs(%e : tensor<{M}xf64>) -> tensor<{M}xf64>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%t0 : tensor<{M}x{N}xf64>) outs(%f : tensor<{M}xf64>) {{
  ^bb0(%a: f64, %o: f64):
    %x = math.exp %a : f64
    %s = arith.addf %x, %o : f64
    linalg.yield %s : f64
  }} -> tensor<{M}xf64>"""
    return Case("f64_exp_sum", [((M, N), torch.float64)], [((M,), torch.float64)], body,
                lambda a: [torch.exp(a).sum(1)], {"reduce"})


def _index_and_const() -> Case:
    body = f"""
  %cst = arith.constant dense<[1.0, -2.0, 3.5, 4.25]> : tensor<4xf32>
  %e = tensor.empty() : tensor<10x4xf32>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d1)>, {ID2}], iterator_types = [{PP}]}}
      ins(%t0, %cst : tensor<10x4xf32>, tensor<4xf32>) outs(%e : tensor<10x4xf32>) {{
  ^bb0(%a: f32, %c: f32, %o: f32):
    %i = linalg.index 0 : index
    %j = linalg.index 1 : index
    %h = arith.constant 100 : index
    %ih = arith.muli %i, %h : index
    %k = arith.addi %ih, %j : index
    %ki = arith.index_cast %k : index to i64
    %kf = arith.sitofp %ki : i64 to f32
    %s = arith.addf %a, %c : f32
    %r = arith.addf %s, %kf : f32
    linalg.yield %r : f32
  }} -> tensor<10x4xf32>
  %r1 = bufferization.to_tensor %in0 restrict : memref<10x4xf32> to tensor<10x4xf32>"""
    cst = torch.tensor([1.0, -2.0, 3.5, 4.25], dtype=torch.float64)
    iota = (torch.arange(10)[:, None] * 100 + torch.arange(4)[None, :]).to(torch.float64)
    return Case("index_constant_copy", [((10, 4), torch.float32)], [((10, 4), torch.float32), ((10, 4), torch.float32)],
                body, lambda a: [a + cst + iota, a.clone()])


def _half_reduce_elementwise(dt: torch.dtype) -> Case:
    # softmax-like row normalisation computed in f32 and rounded once (shared lowering style).
    e = _MLIR[dt]
    M, N = 96, 512
    body = f"""
  %zero = arith.constant 0.0 : f32
  %ef = tensor.empty() : tensor<{M}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%ef : tensor<{M}xf32>) -> tensor<{M}xf32>
  %s = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%t0 : tensor<{M}x{N}x{e}>) outs(%f : tensor<{M}xf32>) {{
  ^bb0(%a: {e}, %o: f32):
    %x = arith.extf %a : {e} to f32
    %ab = math.absf %x : f32
    %r = arith.addf %ab, %o : f32
    linalg.yield %r : f32
  }} -> tensor<{M}xf32>
  %eo = tensor.empty() : tensor<{M}x{N}x{e}>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>, {ID2}], iterator_types = [{PP}]}}
      ins(%t0, %s : tensor<{M}x{N}x{e}>, tensor<{M}xf32>) outs(%eo : tensor<{M}x{N}x{e}>) {{
  ^bb0(%a: {e}, %n: f32, %o: {e}):
    %x = arith.extf %a : {e} to f32
    %d = arith.divf %x, %n : f32
    %t = arith.truncf %d : f32 to {e}
    linalg.yield %t : {e}
  }} -> tensor<{M}x{N}x{e}>"""
    return Case(f"l1_normalize_{e}", [((M, N), dt)], [((M, N), dt)], body,
                lambda a: [a / a.abs().sum(1, keepdim=True)], {"reduce", "loops"})


def _scalars() -> Case:
    # Rank-0 ops leave scalar code on the host: it runs as a one-thread kernel.
    body = """
  %three = arith.constant 3.0 : f32
  %one = arith.constant 1.0 : f32
  %e0 = tensor.empty() : tensor<f32>
  %r0 = linalg.generic {indexing_maps = [affine_map<() -> ()>, affine_map<() -> ()>], iterator_types = []}
      ins(%t0 : tensor<f32>) outs(%e0 : tensor<f32>) {
  ^bb0(%a: f32, %o: f32):
    %m = arith.mulf %a, %three : f32
    %s = arith.addf %m, %one : f32
    linalg.yield %s : f32
  } -> tensor<f32>
  %e1 = tensor.empty() : tensor<5xf32>
  %r1 = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> ()>, affine_map<(d0) -> (d0)>], iterator_types = ["parallel"]}
      ins(%t1, %t0 : tensor<5xf32>, tensor<f32>) outs(%e1 : tensor<5xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %s = arith.addf %a, %b : f32
    linalg.yield %s : f32
  } -> tensor<5xf32>"""
    return Case("rank0_scalars", [((), torch.float32), ((5,), torch.float32)],
                [((), torch.float32), ((5,), torch.float32)], body,
                lambda a, b: [a * 3 + 1, b + a], {"serial", "loops"})


# ------------------------------------------------------------------------------------------------
# Several outputs derived from one buffer: what the shared lowering emits after CSE. These once
# went wrong: two reductions sharing one (CSE-merged) zero fill returned output 1 in output 2.


_SUM_SQ = """
  ^bb0(%a: f32, %o: f32):
    %sq = arith.mulf %a, %a : f32
    %s = arith.addf %sq, %o : f32
    linalg.yield %s : f32"""
_SUM = """
  ^bb0(%a: f32, %o: f32):
    %s = arith.addf %a, %o : f32
    linalg.yield %s : f32"""
_MAX = """
  ^bb0(%a: f32, %o: f32):
    %s = arith.maximumf %a, %o : f32
    linalg.yield %s : f32"""


def _two_reductions_shared_fill(R: int = 50) -> Case:
    # x.sum(2), (x*x).sum(2): one fill is the init of both reductions.
    B, M = 3, 4
    red = (f'{{indexing_maps = [{ID3}, affine_map<(d0, d1, d2) -> (d0, d1)>], '
           f'iterator_types = ["parallel", "parallel", "reduction"]}}')
    body = f"""
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{B}x{M}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{B}x{M}xf32>) -> tensor<{B}x{M}xf32>
  %r0 = linalg.generic {red} ins(%t0 : tensor<{B}x{M}x{R}xf32>) outs(%f : tensor<{B}x{M}xf32>) {{{_SUM}
  }} -> tensor<{B}x{M}xf32>
  %r1 = linalg.generic {red} ins(%t0 : tensor<{B}x{M}x{R}xf32>) outs(%f : tensor<{B}x{M}xf32>) {{{_SUM_SQ}
  }} -> tensor<{B}x{M}xf32>"""
    return Case(f"multi_two_reductions_shared_fill_r{R}", [((B, M, R), torch.float32)],
                [((B, M), torch.float32)] * 2, body, lambda x: [x.sum(2), (x * x).sum(2)],
                {"reduce"} if R >= 128 else {"loops"})


def _three_reductions_shared_fills() -> Case:
    # sum, sum of squares and max of one input; the two zero fills are one value, the max has
    # its own -inf fill; the sum is also consumed by a fourth output (mean = sum / N).
    M, N = 37, 300
    red = f'{{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}'
    body = f"""
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %n = arith.constant {float(N)} : f32
  %e = tensor.empty() : tensor<{M}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{M}xf32>) -> tensor<{M}xf32>
  %g = linalg.fill ins(%ninf : f32) outs(%e : tensor<{M}xf32>) -> tensor<{M}xf32>
  %r0 = linalg.generic {red} ins(%t0 : tensor<{M}x{N}xf32>) outs(%f : tensor<{M}xf32>) {{{_SUM}
  }} -> tensor<{M}xf32>
  %r1 = linalg.generic {red} ins(%t0 : tensor<{M}x{N}xf32>) outs(%f : tensor<{M}xf32>) {{{_SUM_SQ}
  }} -> tensor<{M}xf32>
  %r2 = linalg.generic {red} ins(%t0 : tensor<{M}x{N}xf32>) outs(%g : tensor<{M}xf32>) {{{_MAX}
  }} -> tensor<{M}xf32>
  %r3 = linalg.generic {{indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>], iterator_types = ["parallel"]}}
      ins(%r0 : tensor<{M}xf32>) outs(%e : tensor<{M}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %d = arith.divf %a, %n : f32
    linalg.yield %d : f32
  }} -> tensor<{M}xf32>"""
    return Case("multi_three_reductions_and_mean", [((M, N), torch.float32)], [((M,), torch.float32)] * 4,
                body, lambda x: [x.sum(1), (x * x).sum(1), x.amax(1), x.sum(1) / N], {"reduce"})


def _output_feeds_output() -> Case:
    # h = x @ w is output 0 and the input of output 1 (relu(h).sum(1)); the matmul's zero fill is
    # also the reduction's init.
    M, K, N = 40, 24, 36
    body = f"""
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %r0 = linalg.matmul ins(%t0, %t1 : tensor<{M}x{K}xf32>, tensor<{K}x{N}xf32>) outs(%f : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %e1 = tensor.empty() : tensor<{M}xf32>
  %f1 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<{M}xf32>) -> tensor<{M}xf32>
  %r1 = linalg.generic {{indexing_maps = [{ID2}, affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%r0 : tensor<{M}x{N}xf32>) outs(%f1 : tensor<{M}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %p = arith.maximumf %a, %zero : f32
    %s = arith.addf %p, %o : f32
    linalg.yield %s : f32
  }} -> tensor<{M}xf32>"""
    return Case("multi_output_feeds_output", [((M, K), torch.float32), ((K, N), torch.float32)],
                [((M, N), torch.float32), ((M,), torch.float32)], body,
                lambda x, w: [x @ w, (x @ w).relu().sum(1)], {"matmul"})


def _same_value_and_input_returned() -> Case:
    # One value returned twice, an input returned as is, and an output that accumulates into a
    # buffer another output also starts from (two matmuls of one shared zero fill).
    M, K, N = 16, 32, 8
    body = f"""
  %zero = arith.constant 0.0 : f32
  %two = arith.constant 2.0 : f32
  %e = tensor.empty() : tensor<{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %a = linalg.matmul ins(%t0, %t1 : tensor<{M}x{K}xf32>, tensor<{K}x{N}xf32>) outs(%f : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %b = linalg.matmul ins(%t0, %t2 : tensor<{M}x{K}xf32>, tensor<{K}x{N}xf32>) outs(%f : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %r0 = linalg.generic {{indexing_maps = [{ID2}, {ID2}, {ID2}], iterator_types = [{PP}]}}
      ins(%a, %b : tensor<{M}x{N}xf32>, tensor<{M}x{N}xf32>) outs(%e : tensor<{M}x{N}xf32>) {{
  ^bb0(%x: f32, %y: f32, %o: f32):
    %s = arith.addf %x, %y : f32
    %t = arith.mulf %s, %two : f32
    linalg.yield %t : f32
  }} -> tensor<{M}x{N}xf32>
  %r1 = tensor.cast %r0 : tensor<{M}x{N}xf32> to tensor<{M}x{N}xf32>
  %r2 = tensor.cast %b : tensor<{M}x{N}xf32> to tensor<{M}x{N}xf32>
  %r3 = tensor.cast %t0 : tensor<{M}x{K}xf32> to tensor<{M}x{K}xf32>"""
    return Case("multi_same_value_twice_and_input", [((M, K), torch.float32), ((K, N), torch.float32),
                                                      ((K, N), torch.float32)],
                [((M, N), torch.float32)] * 3 + [((M, K), torch.float32)], body,
                lambda x, w, v: [(x @ w + x @ v) * 2, (x @ w + x @ v) * 2, x @ v, x], {"matmul"})


def all_cases() -> list[Case]:
    return [
        _elementwise(torch.float32), _elementwise(torch.float16), _elementwise(torch.bfloat16),
        _elementwise_chain(),
        _reduce_last("sum", 300, 1000), _reduce_last("max", 300, 1000), _reduce_last("sum", 40, 50),
        _reduce_last("sum", 64, 700, torch.float16), _reduce_last("max", 33, 513, torch.bfloat16),
        _reduce_middle(8, 500, 33), _reduce_middle(16, 64, 1024), _reduce_all(),
        _matmul(100, 70, 130, torch.float32), _matmul(256, 128, 192, torch.float32),
        _matmul(1, 300, 77, torch.float32), _matmul(96, 64, 80, torch.float16),
        _matmul(70, 50, 66, torch.bfloat16), _matmul_transposed_b(),
        _batch_matmul(torch.float32), _batch_matmul(torch.float16),
        _conv2d(), _conv2d_grouped_padded(), _pooling("max"), _pooling("sum"),
        _transpose(), _slices(), _reshapes(), _mlp_softmax(), _ints(), _f64(), _index_and_const(),
        _half_reduce_elementwise(torch.float16), _half_reduce_elementwise(torch.bfloat16),
        _scalars(),
        _two_reductions_shared_fill(50), _two_reductions_shared_fill(300),
        _three_reductions_shared_fills(), _output_feeds_output(), _same_value_and_input_returned(),
        # Larger shapes for the tuned paths: coarsened elementwise with a tail, block-per-row
        # reductions (rows > 1024), 128x128 matmul tiles with ragged edges.
        _elementwise(torch.float32, 1031, 1021), _reduce_last("max", 20, 5000, torch.bfloat16),
        _reduce_last("sum", 7, 3000), _matmul(2000, 100, 1999, torch.float32),
        # Tensor cores: TF32 when allowed, the nn.Linear layout, the 128x128 tile with ragged
        # M/N/K (K not a multiple of the 32-deep slice), bf16 with a batch
        _matmul_tf32(300, 200, 260), _matmul_tf32(1500, 72, 1400), _matmul_transposed_b(torch.float16),
        _matmul(2050, 1000, 2056, torch.float16), _batch_matmul(torch.bfloat16),
    ]


CASES = {c.name: c for c in all_cases()}


def _compile(case: Case, arch: str) -> CudaProgram:
    artifact = case.mlir()
    for stage in TARGET.stages({"arch": arch, "allow_tf32": False, **case.options}):
        artifact = stage.run(artifact)
    return artifact


# ------------------------------------------------------------------------------------------------
# CPU: compile + ptxas


_PTXAS = ptxas.find_ptxas()


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_and_ptxas_accepts(name: str) -> None:
    case = CASES[name]
    for arch in ("sm_80", "sm_90"):
        program = _compile(case, arch)
        assert program.ptx.startswith("//") and f".target {arch}" in program.ptx
        kinds = {k.strategy for k in program.launches}
        assert case.strategies <= kinds, (case.strategies, program.describe())
        assert all(len(k.access) == len(k.args) for k in program.launches)
        assert program.dataflow_errors(len(case.inputs)) == [], program.describe()
        assert {k.kernel for k in program.launches} <= {
            line.split("(")[0].split()[-1] for line in program.ptx.splitlines() if ".entry" in line}
        if _PTXAS is None:
            pytest.skip("ptxas not found (pip install nvidia-cuda-nvcc-cu12)")
        result = ptxas.assemble(program.ptx, arch, _PTXAS)
        assert result.ok, result.log
        assert "spill" not in result.log or " 0 bytes spill stores" in result.log


def test_stage_texts_and_options() -> None:
    case = CASES["mlp_softmax_graph"]
    artifact = case.mlir()
    texts = {}
    for stage in TARGET.stages({"arch": "sm_80"}):
        artifact = stage.run(artifact)
        texts[stage.name] = artifact.text
    assert list(texts) == ["gpu", "llvm", "ptx"]
    assert "gpu.launch_func" in texts["gpu"] and "gpu.module @gac_kernels" in texts["gpu"]
    assert "llvm.func" in texts["llvm"] and "nvvm" in texts["llvm"]
    assert ".target sm_80" in texts["ptx"] and "launch gac_k0_" in texts["ptx"]
    with pytest.raises(ValueError, match="unsupported cuda arch"):
        compile_options({"arch": "sm_11"})
    assert TARGET.name == "cuda" and TARGET.device_type == "cuda"


def test_memory_plan_reuses_intermediates() -> None:
    program = _compile(CASES["mlp_softmax_graph"], "sm_90")
    assert len(program.temps) >= 3
    assert program.plan.workspace_size < program.plan.unplanned_size
    # Buffer lifetimes from the launch list; the plan must keep live buffers apart.
    steps: dict[int, list[int]] = {}
    for i, k in enumerate(program.launches):
        for a in k.args:
            if getattr(a, "kind", None) == "temp":
                steps.setdefault(a.index, []).append(i)
    uses = [BufferUse(t.name, t.nbytes, min(steps[i]), max(steps[i])) for i, t in enumerate(program.temps)]
    check_plan(uses, program.plan)


def _writers(program: CudaProgram, arg: int) -> list[int]:
    return [i for i, k in enumerate(program.launches)
            for a, m in zip(k.args, k.access) if a == BufferRef("arg", arg) and "w" in m.lower()]


def test_two_reductions_of_one_input_write_their_own_outputs() -> None:
    # Regression: CSE merged the zero fills of x.sum(2) and (x*x).sum(2); bufferization then
    # computed the second sum in output 1's buffer and copied it to output 2 after output 1's
    # own copy had overwritten it (output 2 returned output 1). Each output must now be written
    # by one kernel that reads only the input.
    for r in (50, 300):
        case = CASES[f"multi_two_reductions_shared_fill_r{r}"]
        program = _compile(case, "sm_90")
        assert not program.temps, program.describe()
        for out in (1, 2):
            (w,) = _writers(program, out)
            k = program.launches[w]
            reads = {a for a, m in zip(k.args, k.access) if "r" in m and a != BufferRef("arg", out)}
            assert reads == {BufferRef("arg", 0)}, program.describe()
        assert _writers(program, 1) != _writers(program, 2)


def test_dataflow_checker_flags_a_clobbered_output() -> None:
    # The launch list the bug produced (fill; copy; two sums; copy temp -> out1; copy out1 -> out2).
    def k(i: int, *args: tuple[str, int, str]) -> KernelLaunch:
        return KernelLaunch(f"k{i}", (1, 1, 1), (32, 1, 1), 0,
                            tuple(BufferRef(kind, n) for kind, n, _ in args), "loops",  # type: ignore[arg-type]
                            tuple(m for _, _, m in args))

    plan = plan_memory([BufferUse("t0", 48, 1, 4)])
    args = [ArgSpec((3, 4, 50), "f32"), ArgSpec((3, 4), "f32"), ArgSpec((3, 4), "f32")]
    bad = CudaProgram("sm_90", "", [
        k(0, ("arg", 1, "W")), k(1, ("arg", 1, "r"), ("temp", 0, "W")),
        k(2, ("arg", 0, "r"), ("temp", 0, "rW")), k(3, ("arg", 0, "r"), ("arg", 1, "rW")),
        k(4, ("temp", 0, "r"), ("arg", 1, "W")), k(5, ("arg", 1, "r"), ("arg", 2, "W"))],
        [TempBuffer("t0", 48)], plan, args)
    errors = bad.dataflow_errors(1)
    assert any("overwrites arg1" in e and "launch 3" in e for e in errors), errors
    good = CudaProgram("sm_90", "", [k(0, ("arg", 0, "r"), ("arg", 1, "W")),
                                     k(1, ("arg", 0, "r"), ("arg", 2, "W"))], [], plan_memory([]), args)
    assert good.dataflow_errors(1) == []
    # inputs written, outputs never written, reads of unwritten temps, temps sharing bytes
    odd = CudaProgram("sm_90", "", [k(0, ("temp", 0, "r"), ("arg", 0, "W")), k(1, ("temp", 1, "W")),
                                    k(2, ("temp", 0, "W"), ("temp", 1, "r"), ("arg", 1, "W"))],
                      [TempBuffer("a", 64), TempBuffer("b", 64)],
                      MemoryPlan({"a": 0, "b": 0}, 256, 512), args)
    text = "\n".join(odd.dataflow_errors(1))
    for what in ("writes input arg0", "reads temp0 before any write", "output arg2 is never written",
                 "share workspace bytes"):
        assert what in text, text


def test_unsafe_bufferization_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the fix (memref destinations + eliminate-empty-tensors on shared fills) the
    # compile must fail loudly instead of returning a wrong program.
    from gac_torch.backends.cuda import mapping

    monkeypatch.setattr(mapping, "_tensor_destinations", lambda fn: None)
    monkeypatch.setattr(mapping, "_unshare_fills", lambda fn: None)
    with pytest.raises(RuntimeError, match="dataflow invariants"):
        _compile(CASES["multi_two_reductions_shared_fill_r50"], "sm_90")


# ------------------------------------------------------------------------------------------------
# tensor cores (gac_torch/kernels/cuda_mma.py): PTX, fragment layouts, CPU emulation of the kernel


_MMA_PTX = {"f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
            "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}


@pytest.mark.parametrize("name,kind", [("matmul_96x64x80_f16", "f16"), ("matmul_70x50x66_bf16", "bf16"),
                                       ("batch_matmul_f16", "f16"), ("matmul_transposed_b_f16", "f16"),
                                       ("matmul_300x200x260_tf32", "tf32")])
def test_mma_instructions_in_ptx(name: str, kind: str) -> None:
    case = CASES[name]
    for arch in ("sm_80", "sm_90"):
        program = _compile(case, arch)
        mma = {line.split()[0] for line in program.ptx.splitlines() if "mma.sync" in line}
        assert mma == {_MMA_PTX[kind]}, mma
        if kind == "tf32":
            assert "cvt.rna.tf32.f32" in program.ptx
        # 16-byte shared-memory stores need 16-byte aligned buffers
        shared = [line for line in program.ptx.splitlines() if ".shared" in line and "__wg_" in line]
        assert shared and all(".align 16" in line for line in shared), shared
        if _PTXAS is not None:
            result = ptxas.assemble(program.ptx, arch, _PTXAS)
            assert result.ok and " 0 bytes spill stores" in result.log, result.log
    # no tensor cores before sm_80; no TF32 unless allowed: the exact f32 FMA kernel
    assert "mma.sync" not in _compile(case, "sm_75").ptx
    if kind == "tf32":
        plain = Case(case.name, case.inputs, case.outputs, case.body, case.reference)
        program = _compile(plain, "sm_90")
        assert "mma.sync" not in program.ptx and {k.strategy for k in program.launches} == {"matmul"}


def test_allow_tf32_follows_torch_at_compile_time() -> None:
    # Saved and restored by hand: the flag is a property of a module object (no instance
    # attribute), which some pytest versions' monkeypatch cannot undo.
    saved_flag, saved_precision = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert compile_options({"arch": "sm_90"}).limits.allow_tf32 is False
        torch.set_float32_matmul_precision("high")
        assert compile_options({"arch": "sm_90"}).limits.allow_tf32 is True
        assert compile_options({"arch": "sm_90", "allow_tf32": False}).limits.allow_tf32 is False
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = True
        assert compile_options({"arch": "sm_90"}).limits.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_flag
        torch.set_float32_matmul_precision(saved_precision)
    assert compile_options({"arch": "sm_75"}).limits.mma is False
    assert compile_options({"arch": "sm_80"}).limits.mma is True


def _upstream_fragments(elem: str, k: int) -> dict[str, list[tuple[str, str]]]:
    """Per operand, the (row, col) index expressions of each register element that upstream's
    `transform.nvgpu.rewrite_matmul_as_mma_sync` emits (lane = s0)."""
    from mlir import ir
    from mlir.dialects.transform import interpreter

    text = f"""
module attributes {{transform.with_named_sequence}} {{
  func.func @mm(%a: memref<16x{k}x{elem}>, %b: memref<{k}x8x{elem}>, %c: memref<16x8x{elem}>) {{
    linalg.matmul ins(%a, %b : memref<16x{k}x{elem}>, memref<{k}x8x{elem}>) outs(%c : memref<16x8x{elem}>)
    return
  }}
  transform.named_sequence @__transform_main(%root: !transform.any_op {{transform.readonly}}) {{
    %mm = transform.structured.match ops{{["linalg.matmul"]}} in %root : (!transform.any_op) -> !transform.any_op
    transform.nvgpu.rewrite_matmul_as_mma_sync %mm : (!transform.any_op) -> ()
    transform.yield
  }}
}}"""
    ctx = ir.Context()
    module = ir.Module.parse(text, ctx)
    seq = next(op for op in module.body.operations if op.operation.name == "transform.named_sequence")
    interpreter.apply_named_sequence(module.operation, seq, module)
    fn = next(op for op in module.body.operations if op.operation.name == "func.func")
    exprs: dict[str, str] = {}
    loads: dict[str, list[tuple[str, str]]] = {"a": [], "b": [], "c": []}
    for op in fn.regions[0].blocks[0].operations:
        op = op.operation
        if op.name == "affine.apply":
            exprs[op.results[0].get_name()] = str(op.attributes["map"]).split("-> (")[1].rsplit(")", 1)[0]
        elif op.name == "memref.load":
            which = "abc"[[str(a.get_name()) for a in fn.regions[0].blocks[0].arguments].index(
                op.operands[0].get_name())]
            loads[which].append((exprs[op.operands[1].get_name()], exprs[op.operands[2].get_name()]))
    return loads


def _eval(expr: str, lane: int) -> int:
    return eval(expr.replace("floordiv", "//").replace("mod", "%").replace("s0", str(lane)))


def test_mma_fragment_tables_match_upstream() -> None:
    from gac_torch.kernels import cuda_mma as cm

    f16 = _upstream_fragments("f16", 16)
    tf32 = _upstream_fragments("f32", 4)  # upstream's tf32 shape is m16n8k4: the first half of k8
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = [(g + r, 2 * t + c + h) for r, c in cm.FRAG_A16 for h in (0, 1)]
        b = [(2 * t + k + h, g) for k in cm.FRAG_B16 for h in (0, 1)]
        c = [(g + r, 2 * t + cc) for r, cc in cm.FRAG_C]
        for which, ours in (("a", a), ("b", b), ("c", c)):
            theirs = [(_eval(x, lane), _eval(y, lane)) for x, y in f16[which]]
            assert theirs == ours, (which, lane, theirs, ours)
        a8 = [(g + r, t + cc) for r, cc in cm.FRAG_A8 if cc == 0]
        b8 = [(t + k, g) for k in cm.FRAG_B8 if k == 0]
        assert [(_eval(x, lane), _eval(y, lane)) for x, y in tf32["a"]] == a8
        assert [(_eval(x, lane), _eval(y, lane)) for x, y in tf32["b"]] == b8


def _mma_spec(kind: str, M: int, N: int, K: int, a_t: bool = False, b_t: bool = False,
              batch: int = 0, fill: bool = True, ec: str = "f32"):
    from gac_torch.kernels import cuda_mma as cm

    def operand(elem: str, dims: tuple[int, ...], shape: tuple[int, ...]) -> cm.Operand:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return cm.Operand("memref<" + "x".join(map(str, shape)) + f"x{elem}>", elem, dims, shape,
                          tuple(strides), 0)

    e = "f32" if kind == "tf32" else kind
    be = (2, 3)[:batch]
    bd = tuple(range(batch))
    m, n, k = batch, batch + 1, batch + 2
    a = operand(e, bd + ((k, m) if a_t else (m, k)), be + ((K, M) if a_t else (M, K)))
    b = operand(e, bd + ((n, k) if b_t else (k, n)), be + ((N, K) if b_t else (K, N)))
    c = operand(ec, bd + (m, n), be + (M, N))
    return cm.Spec(kind, m, n, k, bd, be + (M, N, K), a, b, c, fill)


@pytest.mark.parametrize("kind,M,N,K,a_t,b_t,batch,fill,ec,big", [
    ("f16", 70, 50, 66, False, False, 0, True, "f32", False),  # ragged everything, 2-wide loads
    ("f16", 96, 64, 80, False, False, 0, False, "f32", False),  # accumulate onto C
    ("bf16", 70, 50, 66, False, True, 0, True, "f32", False),  # nn.Linear layout
    ("bf16", 64, 64, 64, True, True, 0, True, "bf16", False),  # transposed A, bf16 output
    ("tf32", 33, 40, 37, True, False, 0, False, "f32", False),  # scalar loads (K, M odd)
    ("f16", 130, 136, 40, False, False, 1, True, "f16", True),  # 128x128 tile, batch, f16 out
    ("tf32", 129, 130, 48, False, True, 2, True, "f32", True),
])
def test_mma_kernel_emulated_on_cpu(kind, M, N, K, a_t, b_t, batch, fill, ec, big) -> None:
    # The kernel body the MLIR is generated from, executed with numpy (threads in lockstep,
    # mma.sync from the fragment tables, shared-memory races checked against the barriers).
    import numpy as np

    from gac_torch.kernels import cuda_mma as cm

    spec = _mma_spec(kind, M, N, K, a_t, b_t, batch, fill, ec)
    plan = cm.plan(spec, big=big)
    assert plan is not None and (plan.bm == 128) == big
    rng = np.random.default_rng(M * N + K)
    A = rng.standard_normal(spec.a.shape).astype(np.float32)
    B = rng.standard_normal(spec.b.shape).astype(np.float32)
    C = cm._round(rng.standard_normal(spec.c.shape).astype(np.float32), ec)
    out = cm.emulate(spec, plan, A, B, C, init=0.25)
    rnd = "tf32" if kind == "tf32" else kind
    Am, Bm = cm._round(A, rnd).astype(np.float64), cm._round(B, rnd).astype(np.float64)
    Am = np.swapaxes(Am, -1, -2) if a_t else Am
    Bm = np.swapaxes(Bm, -1, -2) if b_t else Bm
    ref = (0.25 if fill else C.astype(np.float64)) + Am @ Bm
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < (1e-2 if ec == "bf16" else 2e-3 if ec == "f16" else 1e-5), err
    # the generated MLIR for the same plan parses
    from mlir import ir
    from mlir.dialects import gpu as _gpu  # noqa: F401  (registers the dialects)

    ir.Module.parse(cm.template(spec, plan), ir.Context())


def test_mma_emulation_catches_a_missing_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    from gac_torch.kernels import cuda_mma as cm

    spec = _mma_spec("f16", 64, 64, 96)
    plan = cm.plan(spec, big=False)
    import numpy as np

    calls = []
    real = cm._Numpy.barrier

    def barrier(self):  # the loop's barrier (every one after the prologue's) is dropped
        calls.append(1)
        if len(calls) == 1:
            real(self)

    monkeypatch.setattr(cm._Numpy, "barrier", barrier)
    A, B, C = (np.ones(s, np.float32) for s in (spec.a.shape, spec.b.shape, spec.c.shape))
    with pytest.raises(cm.RaceError):
        cm.emulate(spec, plan, A, B, C)


def test_memory_planner_unit() -> None:
    bufs = [BufferUse("a", 1000, 0, 1), BufferUse("b", 1000, 1, 2), BufferUse("c", 1000, 2, 3),
            BufferUse("d", 4000, 4, 5), BufferUse("e", 10, 0, 5)]
    plan = plan_memory(bufs)
    check_plan(bufs, plan)
    assert plan.offsets["a"] == plan.offsets["c"] or plan.offsets["d"] in (plan.offsets["a"], plan.offsets["b"])
    assert plan.workspace_size <= 4096 + 256
    assert plan_memory([]).workspace_size == 0


class _FakeDriver:
    """Just enough of cuda.bindings.driver to drive CudaExecutable's launch path on a CPU."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    class CUstreamCaptureMode:
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1

    def __init__(self, program: CudaProgram):
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


def test_runtime_launch_path_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # The host side of CudaExecutable against a fake driver: argument arrays hold the right
    # pointers/scalars, are built once per pointer set, one workspace per stream, CUDA graphs
    # captured on a private stream and replayed, driver errors name the kernel.
    import struct

    from gac_torch.backends.cuda import runtime

    from gac_torch.backends.cuda.program import ScalarArg

    # scalar arguments (none of the cases has one: constants are sunk into the kernels)
    scalars = (ScalarArg("i8", -3), ScalarArg("f16", 1.5), ScalarArg("bf16", -2.0),
               ScalarArg("i32", 123456), ScalarArg("f32", 0.25), ScalarArg("i64", -(1 << 40)),
               ScalarArg("f64", 3.5))
    launch = KernelLaunch("k", (1, 1, 1), (1, 1, 1), 0, (BufferRef("arg", 1), *scalars, BufferRef("temp", 0)))
    table = runtime.ArgTable([launch, launch], [0x1000, 0x2000], [0x3000])
    assert table.param(1, 0) == struct.pack("<Q", 0x2000) and table.param(0, 8) == struct.pack("<Q", 0x3000)
    for j, a in enumerate(scalars, 1):
        raw = runtime._pack_scalar(a.ctype, a.value)
        assert table.param(0, j)[:len(raw)] == raw
    assert struct.unpack("<e", table.param(1, 2)[:2])[0] == 1.5
    assert struct.unpack("<f", b"\0\0" + table.param(1, 3)[:2])[0] == -2.0  # bf16: top half of f32
    case = CASES["index_constant_copy"]
    program = _compile(case, "sm_90")
    case2 = CASES["mlp_softmax_graph"]  # temps in a workspace
    program2 = _compile(case2, "sm_90")
    for prog, sig in ((program, case.signature()), (program2, case2.signature())):
        fake = _FakeDriver(prog)
        monkeypatch.setattr(runtime, "_driver", fake)
        monkeypatch.setattr(runtime, "check_available", lambda: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})())
        exe = runtime.CudaExecutable(prog, sig)
        exe.use_graphs = False
        dev = torch.device("cpu")
        ptrs = [0x10000 * (i + 1) for i in range(len(prog.args))]
        for _ in range(3):
            exe._launch_all(dev, ptrs)
        assert exe.stats == {"direct_calls": 3, "graph_calls": 0, "tables_built": 1, "graphs_built": 0}
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
                    assert raw[:size] == runtime._pack_scalar(a.ctype, a.value)
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
    from gac_torch.backends.base import TargetUnavailable

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
    bound = tol or _TOL[got.dtype]
    assert rel <= bound, f"{name}: relative error {rel:.3e} > {bound:.1e}; max abs {(g - r).abs().max().item():.3e}"
    return f"{name}: rel {rel:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_runs_on_gpu(name: str) -> None:
    from gac_torch.backends.cuda.runtime import CudaExecutable

    TARGET.check_available()
    case = CASES[name]
    program = _compile(case, compile_options({}).arch)
    exe = CudaExecutable(program, case.signature())
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
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
    exe = CudaExecutable(_compile(case, compile_options({}).arch), case.signature())
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
    exe = CudaExecutable(_compile(case, compile_options({}).arch), case.signature())
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
    program = _compile(case, compile_options({}).arch)
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
        ("elementwise 4096x4096 f32", _elementwise(torch.float32, 4096, 4096), 2 * 4 * 4096 * 4096, 0,
         lambda a, b, c: torch.tanh(a * b[None, :] + c[:, None]) * 0.5),
        ("row sum 16384x1024 f32", _reduce_last("sum", 16384, 1024), 4 * 16384 * 1024, 0,
         lambda a: a.sum(1)),
        ("row sum 2048x8192 f32", _reduce_last("sum", 2048, 8192), 4 * 2048 * 8192, 0,
         lambda a: a.sum(1)),
        ("col sum-sq 64x2048x512 f32", _reduce_middle(64, 2048, 512), 4 * 64 * 2048 * 512, 0,
         lambda a: (a * a).sum(1)),
        ("matmul 2048^3 f32", _matmul(2048, 2048, 2048, f32), 0, 2 * 2048**3, lambda a, b: a @ b),
        ("matmul 2048^3 bf16", _matmul(2048, 2048, 2048, torch.bfloat16), 0, 2 * 2048**3,
         lambda a, b: a @ b),
        ("matmul 4096^3 f16 (mma)", _matmul(4096, 4096, 4096, torch.float16), 0, 2 * 4096**3,
         lambda a, b: a @ b),
    ]
    for label, case, nbytes, flops, eager in specs:
        exe = CudaExecutable(_compile(case, arch), case.signature())
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

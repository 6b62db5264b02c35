"""The cuda pipeline's test cases: hand-written linalg modules (the `linalg` stage ABI) with a
float64 torch reference each, and `compile_case` (every cuda stage, no GPU). Used by the
test_cuda_* files and benchmarks/ptx_fingerprint.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gac_torch.backends.base import Signature, TensorSpec
from gac_torch.backends.cuda.target import TARGET
from gac_torch.backends.gpu.program import GpuProgram

MLIR = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
         torch.bool: "i1", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
# ‖out - ref‖ / ‖ref‖ bounds (METHOD.md): f32 far under 1e-3; half types a few ulps of 2^-8/2^-11.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def tt(shape: tuple[int, ...], dtype: torch.dtype, kind: str = "tensor") -> str:
    dims = "x".join(str(s) for s in shape)
    return f"{kind}<{dims + 'x' if dims else ''}{MLIR[dtype]}>"


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
        args = [f"%in{i}: {tt(s, d, 'memref')}" for i, (s, d) in enumerate(self.inputs)]
        args += [f"%out{i}: {tt(s, d, 'memref')}" for i, (s, d) in enumerate(self.outputs)]
        lines = [f"func.func @main({', '.join(args)}) attributes {{llvm.emit_c_interface}} {{"]
        for i, (s, d) in enumerate(self.inputs):
            lines.append(f"  %t{i} = bufferization.to_tensor %in{i} restrict : "
                         f"{tt(s, d, 'memref')} to {tt(s, d)}")
        lines.append(self.body)
        for i, (s, d) in enumerate(self.outputs):
            lines.append(f"  bufferization.materialize_in_destination %r{i} in restrict writable "
                         f"%out{i} : ({tt(s, d)}, {tt(s, d, 'memref')}) -> ()")
        lines += ["  return", "}"]
        return "\n".join(lines)

    def signature(self) -> Signature:
        return Signature(tuple(TensorSpec(s, d) for s, d in self.inputs),
                         tuple(TensorSpec(s, d) for s, d in self.outputs))


ID2 = "affine_map<(d0, d1) -> (d0, d1)>"
ID3 = "affine_map<(d0, d1, d2) -> (d0, d1, d2)>"
ID4 = "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>"
PP = '"parallel", "parallel"'


def elementwise(dt: torch.dtype, M: int = 37, N: int = 129) -> Case:
    e = MLIR[dt]
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


def reduce_last(kind: str, M: int, N: int, dt: torch.dtype = torch.float32) -> Case:
    e = MLIR[dt]
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


def reduce_middle(B: int, R: int, C: int) -> Case:
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


def matmul(M: int, K: int, N: int, dt: torch.dtype) -> Case:
    e = MLIR[dt]
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
                lambda a, b: [a @ b], {"mma"} if e != "f32" else {"sgemm"})


def _matmul_tf32(M: int, K: int, N: int) -> Case:
    case = matmul(M, K, N, torch.float32)
    # TF32 operands (10-bit mantissa, rounded): ~2^-11 relative per product
    return Case(f"matmul_{M}x{K}x{N}_tf32", case.inputs, case.outputs, case.body, case.reference,
                {"mma"}, tol=3e-3, options={"allow_tf32": True})


def _matmul_transposed_b(dt: torch.dtype = torch.float32) -> Case:
    # x @ w.T with w [N, K]: the nn.Linear layout (k contiguous in both operands)
    M, K, N = (48, 80, 72) if dt == torch.float32 else (200, 264, 136)
    e = MLIR[dt]
    body = f"""
  %zero = arith.constant 0.0 : f32
  %em = tensor.empty() : tensor<{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%em : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %r0 = linalg.matmul indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>]
      ins(%t0, %t1 : tensor<{M}x{K}x{e}>, tensor<{N}x{K}x{e}>) outs(%f : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>"""
    name = "matmul_transposed_b" + ("" if dt == torch.float32 else f"_{e}")
    return Case(name, [((M, K), dt), ((N, K), dt)], [((M, N), torch.float32)], body,
                lambda a, b: [a @ b.T], {"sgemm"} if dt == torch.float32 else {"mma"})


def _batch_matmul(dt: torch.dtype = torch.float32) -> Case:
    B, M, K, N = 3, 65, 40, 33
    e = MLIR[dt]
    body = f"""
  %zero = arith.constant 0.0 : f32
  %em = tensor.empty() : tensor<{B}x{M}x{N}xf32>
  %f = linalg.fill ins(%zero : f32) outs(%em : tensor<{B}x{M}x{N}xf32>) -> tensor<{B}x{M}x{N}xf32>
  %r0 = linalg.batch_matmul ins(%t0, %t1 : tensor<{B}x{M}x{K}x{e}>, tensor<{B}x{K}x{N}x{e}>) outs(%f : tensor<{B}x{M}x{N}xf32>) -> tensor<{B}x{M}x{N}xf32>"""
    return Case(f"batch_matmul_{e}", [((B, M, K), dt), ((B, K, N), dt)], [((B, M, N), torch.float32)],
                body, lambda a, b: [torch.bmm(a, b)], {"sgemm"} if e == "f32" else {"mma"})


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
                {"sgemm", "row"})


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
    e = MLIR[dt]
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
                lambda a: [a / a.abs().sum(1, keepdim=True)], {"row"})


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
                lambda x, w: [x @ w, (x @ w).relu().sum(1)], {"sgemm"})


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
                lambda x, w, v: [(x @ w + x @ v) * 2, (x @ w + x @ v) * 2, x @ v, x], {"sgemm"})


def all_cases() -> list[Case]:
    return [
        elementwise(torch.float32), elementwise(torch.float16), elementwise(torch.bfloat16),
        _elementwise_chain(),
        reduce_last("sum", 300, 1000), reduce_last("max", 300, 1000), reduce_last("sum", 40, 50),
        reduce_last("sum", 64, 700, torch.float16), reduce_last("max", 33, 513, torch.bfloat16),
        reduce_middle(8, 500, 33), reduce_middle(16, 64, 1024), _reduce_all(),
        reduce_middle(1, 1000, 300),  # a column sum (bias gradient): chunks of 64 rows, the last ragged
        matmul(100, 70, 130, torch.float32), matmul(256, 128, 192, torch.float32),
        matmul(1, 300, 77, torch.float32), matmul(96, 64, 80, torch.float16),
        matmul(70, 50, 66, torch.bfloat16), _matmul_transposed_b(),
        _batch_matmul(torch.float32), _batch_matmul(torch.float16),
        _conv2d(), _conv2d_grouped_padded(), _pooling("max"), _pooling("sum"),
        _transpose(), _slices(), _reshapes(), _mlp_softmax(), _ints(), _f64(), _index_and_const(),
        _half_reduce_elementwise(torch.float16), _half_reduce_elementwise(torch.bfloat16),
        _scalars(),
        _two_reductions_shared_fill(50), _two_reductions_shared_fill(300),
        _three_reductions_shared_fills(), _output_feeds_output(), _same_value_and_input_returned(),
        # Larger shapes for the tuned paths: coarsened elementwise with a tail, block-per-row
        # reductions (rows > 1024), 128x128 matmul tiles with ragged edges.
        elementwise(torch.float32, 1031, 1021), reduce_last("max", 20, 5000, torch.bfloat16),
        reduce_last("sum", 7, 3000), matmul(2000, 100, 1999, torch.float32),
        # Tensor cores: TF32 when allowed, the nn.Linear layout, the 128x128 tile with ragged
        # M/N/K (K not a multiple of the 32-deep slice), bf16 with a batch
        _matmul_tf32(300, 200, 260), _matmul_tf32(1500, 72, 1400), _matmul_transposed_b(torch.float16),
        matmul(2050, 1000, 2056, torch.float16), _batch_matmul(torch.bfloat16),
    ]


CASES = {c.name: c for c in all_cases()}


def compile_case(case: Case, arch: str) -> GpuProgram:
    artifact = case.mlir()
    for stage in TARGET.stages({"arch": arch, "allow_tf32": False, **case.options}):
        artifact = stage.run(artifact)
    return artifact

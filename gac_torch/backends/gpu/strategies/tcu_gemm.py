"""`tcu_gemm` (vortex, opt-in: option `vortex_tcu` / GAC_VORTEX_TCU, on a device with a tensor-core
unit): a half-precision contraction into f32 (a matmul or batched matmul of f16 or bf16 tensors:
out += extf(x) * extf(y)) -> the WMMA template gac_torch.kernels.vortex_tcu_gemm. The target hands
over its TCU facts (`isa`: backends/vortex/target.Wmma) and the warps per CTA. What it does not
take (convolutions, f32, several K dims) goes on to `gemm` / `loops`. The consumers of the f32
result (the rounding to f16/bf16, a bias add, ...) run in the kernel's store step, as on `gemm`."""

from __future__ import annotations

from typing import Any

from mlir import ir

from gac_torch.backends.gpu.analysis import Generic
from gac_torch.backends.gpu.strategies.tiled_gemm import match_gemm, splice_gemm
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.kernels import vortex_tcu_gemm
from gac_torch.kernels.vortex_tcu_gemm import Layout

HALF = ("f16", "bf16")


def layout(v: ir.Value) -> Layout | None:
    """A memref's element strides and offset, if static."""
    strides, offset = ir.MemRefType(v.type).get_strides_and_offset()
    if offset < 0 or any(s < 0 for s in strides):   # dynamic (ShapedType's sentinel is negative)
        return None
    return Layout(tuple(strides), offset)


def strategy(isa: Any, warps: int, epilogue: bool = True) -> Strategy:
    """`epilogue`: C's elementwise consumers (the f16 rounding of the result, a bias, ReLU...:
    tiled_gemm.fused_epilogue's chain) run in the store step; needs implicit_gemm's
    `fused_strategy` in the list to erase them."""

    def match(g: Generic, limits: GpuLimits) -> tuple[Any, ...] | None:
        m = match_gemm(g, HALF) if len(g.inputs) == 2 and len(g.outputs) == 1 else None
        if m is None or 0 in (m[0].M, m[0].N, m[0].K) or not vortex_tcu_gemm.supported(m[0]):
            return None
        shape, swap = m
        a, b = (g.inputs[1], g.inputs[0]) if swap else (g.inputs[0], g.inputs[1])
        la, lb = layout(a), layout(b)
        if la is None or lb is None:
            return None
        elem = str(ir.MemRefType(a.type).element_type)
        tg = vortex_tcu_gemm.choose(shape, la, lb, elem, warps)
        if any(x > lim for x, lim in zip(tg.grid(), limits.max_grid)):
            return None
        return g, tg, a, b

    def emit(m: tuple[Any, ...], name: str, limits: GpuLimits) -> bool:
        g, tg, a, b = m
        splice_gemm(g, a, b, [a, b], epilogue, name, lambda fill, ep: vortex_tcu_gemm.template(tg, isa, fill, ep))
        return True

    return Strategy("tcu", match, emit)

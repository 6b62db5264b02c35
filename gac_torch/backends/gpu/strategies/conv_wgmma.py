"""`cwgmma`: an implicit-GEMM convolution (3x3 stride 1 or 2, a strided 1x1, dilations,
fused zero padding) on sm_90a's warpgroup wgmma, its im2col A tile and its weights loaded by TMA
boxes (one per tap: wgmma_conv.Window; GAC_CONV_WGMMA_TMA=0: never) or gathered by cp.async
straight into the swizzled layout wgmma reads (gac_torch/kernels/wgmma_conv.py).

The match is igemm's (implicit_gemm._match: the conv as a contraction over dim sets, its
padding read through guards, NCHW weights copied into (kh, kw, c) order, the precision from
torch's conv flags); this strategy takes the f16/bf16 and TF32 ones whose channels come in
whole 16-byte vectors (wgmma_conv.applies) and leaves the rest (the 3-channel stem, exact f32,
groups) to igemm / sgemm, after it in the list. The epilogue (BatchNorm, ReLU, residual,
output cast) is igemm's, run in the wgmma store. GAC_CONV_WGMMA=0 turns it off (bisects; a
code-picking switch, so part of the compile cache's key)."""

from __future__ import annotations

import os

from mlir import ir

from gac_torch.backends.gpu import tuning
from gac_torch.backends.gpu.analysis import Generic
from gac_torch.backends.gpu.strategies import implicit_gemm
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, template_text
from gac_torch.kernels import wgmma_conv, wgmma_conv_text
from gac_torch.kernels.wgmma_plan import Plan
from gac_torch.lowering.structured import CONV_CONTRACTION


def _is_conv(g: Generic) -> bool:
    """A convolution (a window in an operand's map, or a 1x1 marked as one), not another
    multi-dim contraction (those stay with igemm)."""
    return (any(not isinstance(e, ir.AffineDimExpr) for m in g.maps[:2] for e in m.results)
            or CONV_CONTRACTION in g.op.attributes)


def choose(spec) -> Plan | None:
    """The wgmma tiling for an igemm spec, or None (igemm keeps it): the heuristic tile width
    (wgmma_conv.heuristic_bn), or the other where the GPU measured it faster (gpu/tuning.py)."""
    if os.environ.get("GAC_CONV_WGMMA") == "0" or spec.kind not in ("tf32", "f16", "bf16"):
        return None
    plan = wgmma_conv.plan(spec)
    if plan is None or os.environ.get("GAC_CONV_WGMMA_BN"):
        return plan
    alts = {f"bn{bn}": p for bn in (64, 128) if (p := wgmma_conv.plan(spec, bn=bn)) is not None}
    if len(alts) < 2 or spec.N <= 64:
        return plan
    way = "tma:" if getattr(plan, "window", None) is not None else ""  # (a gather's measurement is not a window's)
    return alts[tuning.choose(f"cwgmma:{spec.kind}:{way}{tuning.problem_key(spec)}", tuple(alts), f"bn{plan.bn}")]


def strategy(params: implicit_gemm.Params) -> Strategy:
    def match(g: Generic, limits: GpuLimits):
        if os.environ.get("GAC_CONV_WGMMA") == "0" or not _is_conv(g):
            return None
        m = implicit_gemm._match(g, limits, params, inner=wgmma_conv.MIN_VEC)
        if m is None or m.plan.splits > 1:
            return None
        plan = choose(m.spec)
        if plan is None and os.environ.get("GAC_CONV_WGMMA_WHY"):  # (debugging: why not)
            print(f"cwgmma: not {g.op.location}: {wgmma_conv.applies(m.spec)} {m.spec.a} {m.spec.b}")
        return None if plan is None else (m, plan)

    def emit(mp, name: str, limits: GpuLimits) -> bool:
        m, plan = mp

        def text(spec) -> str:
            return template_text(("conv_wgmma", spec, plan),
                                 lambda: wgmma_conv_text.template(spec, plan, spec.c.elem))

        return implicit_gemm._emit(m, name, params, text)

    return Strategy("cwgmma", match, emit)
